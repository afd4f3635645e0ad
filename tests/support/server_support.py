"""Helpers shared by the server tests (no tests in here).

Import as ``from server_support import ...`` (conftest puts tests/ on sys.path).
"""
import contextlib
import gc
import logging
import os
import resource
import socket
import struct
import time

import pytest

from aoprim.server import Server
from aoprim.server.apps import Echo

HOST = "127.0.0.1"      # loopback only, always


@pytest.fixture
def logs(caplog):
    """The server's log records from WARNING up (a module that wants DEBUG defines its own)."""
    caplog.set_level(logging.WARNING, logger="aoprim.server")
    return caplog


@contextlib.contextmanager
def fd_limit(need):
    """At least ``need`` open files allowed (RLIMIT_NOFILE's soft limit raised, the test
    skipped if the hard limit is lower) for the block; the limit is restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def error_lines(caplog):
    """The messages of the ERROR (and worse) records ``caplog`` holds."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def wait_for(pred, timeout=5.0, what="condition"):
    """Poll ``pred()`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def recv_exact(sock, n, timeout=10.0):
    sock.settimeout(timeout)
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_until_closed(sock, timeout=10.0, limit=1 << 30):
    """Read until EOF or a reset; returns (data, how) with how in {'eof', 'reset'}."""
    sock.settimeout(timeout)
    buf = bytearray()
    while len(buf) < limit:
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            return bytes(buf), "reset"
        if not chunk:
            return bytes(buf), "eof"
        buf += chunk
    raise AssertionError("too much data")


def frame(payload, kind="u16"):
    return struct.pack(">H" if kind == "u16" else ">I", len(payload)) + payload


def read_frame(sock, kind="u16", timeout=10.0):
    hs = 2 if kind == "u16" else 4
    (n,) = struct.unpack(">H" if kind == "u16" else ">I", recv_exact(sock, hs, timeout))
    return recv_exact(sock, n, timeout)


def open_fds():
    """How many file descriptors this process has open."""
    gc.collect()                    # sockets a test dropped without closing
    return len(os.listdir("/proc/self/fd"))


def assert_no_leaks(srv, fds_before=None):
    """Leak checks after shutdown: pools empty, no live sessions, loop thread joined, and
    (given the count before the server existed) every fd closed."""
    assert srv._thread is None or not srv._thread.is_alive(), "loop thread still running"
    wait_for(lambda: srv.live_sessions == 0, 5, "live sessions to drop to 0")
    st = srv.stats()
    assert st["rx_slots_in_use"] == 0, f"receive slots leaked: {st['rx_slots_in_use']}"
    assert st["tx_slots_in_use"] == 0, f"send slots leaked: {st['tx_slots_in_use']}"
    assert st["rx_raw_slots_in_use"] == 0, f"raw read slots leaked: {st['rx_raw_slots_in_use']}"
    assert st["rx_frame_buffers_in_use"] == 0, \
        f"frame buffers leaked: {st['rx_frame_buffers_in_use']}"
    assert st["connections"] == 0
    if fds_before is not None:
        assert open_fds() == fds_before, "file descriptors leaked"


@pytest.fixture
def make_server(backend):
    servers = []
    fds = open_fds()

    def make(handler=None, **kw):
        kw.setdefault("backend", backend)
        srv = Server(handler if handler is not None else Echo(), kw.pop("host", HOST),
                     kw.pop("port", 0), **kw)
        servers.append(srv)
        return srv.start()

    yield make
    for srv in servers:
        srv.shutdown(timeout=15)
    for srv in servers:
        assert_no_leaks(srv)
    assert open_fds() == fds, "file descriptors leaked"


@pytest.fixture
def connect(make_server):
    """connect(srv) -> a blocking client socket (closed at teardown, before the servers)."""
    socks = []

    def conn(srv, nodelay=True, rcvbuf=None, timeout=10.0):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(timeout)
        s.connect(srv.address)
        if nodelay:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
        return s

    yield conn
    for s in socks:
        s.close()
