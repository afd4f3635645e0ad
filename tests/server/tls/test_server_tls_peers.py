"""Real TLS clients against the server, on every Layer 1 backend: Python's ``ssl``
client and Debian's ``openssl s_client``, TLS 1.2 and 1.3, with and without client
certificates; and HAProxy in TCP mode with PROXY v2 in front (the PROXY header comes first,
then the ClientHello), where ``Session.peer`` must be the client's address.

Each test checks the echo byte for byte (frames from 1 byte to past one TLS record), what
the session reports (``get_extra_info``: cipher and version, the peer's certificate, ALPN,
the ``SSLObject``), and that every session, slot and fd is given back at the end, with no
ERROR log line.
"""
import functools
import logging
import os
import shutil
import socket
import ssl
import threading

import pytest

from aoprim.server import Handler
from aoprim.server.loop import BACKENDS

from haproxy_support import haproxy_v2, needs_haproxy
from support import run_threads
from server_support import (HOST, frame, make_server, open_fds, read_frame,  # noqa: F401
                                 wait_for)
from tls_clients import SClient
from tlscerts import CLIENT_CN, tls_certs  # noqa: F401

pytestmark = pytest.mark.timeout(120)

IDLE_RX = 1
VERSION_NAME = {"1.2": "TLSv1.2", "1.3": "TLSv1.3"}


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test here runs on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


@pytest.fixture(autouse=True)
def _no_error_log(caplog):
    """Ordinary peers (and HAProxy's health checks) log no ERROR."""
    caplog.set_level(logging.WARNING, logger="aoprim.server")
    yield
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:5]


class Recorder(Handler):
    """Echo; records what each session reports in on_connect (after its handshake).  A
    frame ``bye`` is answered, then the server closes the session (close_notify)."""

    KEYS = ("peername", "sockname", "cipher", "peercert", "selected_alpn_protocol",
            "ssl_object")

    def __init__(self):
        self.lock = threading.Lock()
        self.seen = []

    def on_connect(self, session):
        info = {k: session.get_extra_info(k) for k in self.KEYS}
        obj = info.pop("ssl_object")
        info["version"] = obj.version() if obj is not None else None
        info["peer"] = session.peer
        info["proxy_peer"] = getattr(session, "proxy_peer", None)
        with self.lock:
            self.seen.append(info)

    def on_read(self, session, data):
        if bytes(data) in (b"bye", b"bye\n"):
            session.send(data)
            session.close()
            return
        session.send(data)


def settle(srv, fds):
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    wait_for(lambda: srv.live_sessions == 0, 5, "the sessions' last references")
    wait_for(lambda: srv.stats()["rx_slots_in_use"] == IDLE_RX, 5, "the receive slots")
    assert srv.stats()["tx_slots_in_use"] == 0
    wait_for(lambda: open_fds() == fds, 5, f"the fd count to return to {fds}")


def payloads(seed):
    """Frames from 1 byte to 40,000 (past a 16 KiB TLS record), reproducible per seed."""
    sizes = [1, 2, 63, 64, 1000, 16383, 16384, 16385, 40000]
    return [os.urandom(n) for n in sizes] + [bytes([seed & 0xFF]) * (1 + (k * 97) % 3000)
                                             for k in range(100)]


def echo_frames(s, seed=0):
    """Send every payload (pipelined), read every echo back, compare."""
    ps = payloads(seed)
    s.sendall(b"".join(frame(p) for p in ps))
    for p in ps:
        assert read_frame(s, timeout=10) == p


# -- Python's ssl client -------------------------------------------------------------------------

MODES = {
    # name -> (server's client_cert, the client presents one)
    "no client cert": ("none", False),
    "optional, none given": ("optional", False),
    "optional, given": ("optional", True),
    "required, given": ("required", True),
}


@pytest.mark.parametrize("version", ["1.2", "1.3"])
@pytest.mark.parametrize("mode", list(MODES))
def test_python_ssl_client(make_server, tls_certs, version, mode):
    server_mode, with_cert = MODES[mode]
    h = Recorder()
    sctx = tls_certs.server_ctx(client_cert=server_mode, alpn=["aop/1", "h2"])
    srv = make_server(h, framing="u16", ssl=sctx)
    fds = open_fds()
    ctx = tls_certs.client_ctx(with_cert=with_cert, version=version, alpn=["aop/1"])
    n = 3
    socks = []
    try:
        for i in range(n):
            raw = socket.create_connection(srv.address, timeout=10)
            s = ctx.wrap_socket(raw, server_hostname="localhost")
            socks.append(s)
            assert s.version() == VERSION_NAME[version]
            echo_frames(s, seed=i)
        wait_for(lambda: len(h.seen) == n, 5, "on_connect of every session")
        for s, info in zip(socks, h.seen):
            assert info["peer"] == s.getsockname()[:2]
            assert info["peername"][:2] == s.getsockname()[:2]
            assert info["sockname"][:2] == srv.address[:2]
            assert info["version"] == VERSION_NAME[version]
            assert info["cipher"][1] == VERSION_NAME[version]
            assert info["cipher"][0] == s.cipher()[0]
            assert info["selected_alpn_protocol"] == "aop/1"
            if with_cert:
                subject = dict(x[0] for x in info["peercert"]["subject"])
                assert subject["commonName"] == CLIENT_CN
            else:
                assert not info["peercert"]
        # the server's close sends close_notify: a clean TLS EOF, not a ragged one
        s = socks[0]
        s.sendall(frame(b"bye"))
        assert read_frame(s) == b"bye"
        ragged = ctx.wrap_socket(socket.create_connection(srv.address, timeout=10),
                                 server_hostname="localhost", suppress_ragged_eofs=False)
        socks.append(ragged)
        ragged.sendall(frame(b"bye"))
        assert read_frame(ragged) == b"bye"
        ragged.settimeout(10)
        assert ragged.recv(10) == b"", "expected close_notify (SSLEOFError is a ragged EOF)"
    finally:
        for s in socks:
            s.close()
    settle(srv, fds)


def test_plain_session_reports_no_tls_extras(make_server):
    """Without ssl= the TLS keys answer the default; peername/sockname still answer."""
    h = Recorder()
    srv = make_server(h, framing="u16")
    fds = open_fds()
    with socket.create_connection(srv.address, timeout=10) as s:
        s.sendall(frame(b"plain"))
        assert read_frame(s) == b"plain"
        wait_for(lambda: h.seen, 5)
        info = h.seen[0]
        assert info["peername"][:2] == s.getsockname()[:2]
        assert info["version"] is None and info["cipher"] is None
        assert info["peercert"] is None and info["selected_alpn_protocol"] is None
    settle(srv, fds)


# -- openssl s_client ------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl binary")
@pytest.mark.parametrize("version", ["1.2", "1.3"])
@pytest.mark.parametrize("with_cert", [False, True], ids=["no client cert", "client cert"])
def test_openssl_s_client(make_server, tls_certs, version, with_cert):
    h = Recorder()
    srv = make_server(h, framing="raw",
                      ssl=tls_certs.server_ctx(client_cert="required" if with_cert else "none"))
    fds = open_fds()
    args = ["-tls1_2" if version == "1.2" else "-tls1_3", "-CAfile", tls_certs.ca_cert,
            "-servername", "localhost", "-verify_return_error", "-quiet", "-no_ign_eof"]
    if with_cert:
        args += ["-cert", tls_certs.client_cert, "-key", tls_certs.client_key]
    c = SClient(srv.address, args)
    try:
        for i in range(20):
            line = f"line {i}:" + "x" * (i * 500)
            c.send(line.encode() + b"\n")
            assert c.wait_line(line), f"no echo of line {i}: {b''.join(c.all)[-500:]!r}"
    finally:
        out = c.finish()
    assert c.p.returncode == 0, out[-2000:]
    wait_for(lambda: h.seen, 5)
    info = h.seen[0]
    assert info["version"] == VERSION_NAME[version]
    if with_cert:
        subject = dict(x[0] for x in info["peercert"]["subject"])
        assert subject["commonName"] == CLIENT_CN
    else:
        assert not info["peercert"]
    settle(srv, fds)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl binary")
def test_openssl_s_client_tls13_key_update(make_server, tls_certs):
    """TLS 1.3 KeyUpdate from the client is ordinary traffic: ``k`` (update its own keys)
    and ``K`` (and ask the server to update its keys too: the server's KeyUpdate must go
    out); the echo goes on with the new keys."""
    h = Recorder()
    srv = make_server(h, framing="raw", ssl=tls_certs.server_ctx())
    fds = open_fds()
    c = SClient(srv.address, ["-tls1_3", "-CAfile", tls_certs.ca_cert,
                              "-servername", "localhost", "-msg"])
    try:
        c.send(b"before\n")
        assert c.wait_line("before")
        for i, cmd in enumerate([b"k\n", b"K\n", b"K\n", b"k\n"]):
            # one command per stdin read: s_client swallows the rest of a read after one
            c.send(cmd)
            assert c.wait_line("KEYUPDATE"), b"".join(c.all)[-2000:]
            c.send(f"after {i}\n".encode())
            assert c.wait_line(f"after {i}"), b"".join(c.all)[-2000:]
    finally:
        out = c.finish()
    # -msg: "<<<" marks what the client received; the server answered each K with its own
    received = [line for line in out.splitlines() if line.startswith("<<<")]
    assert sum("KeyUpdate" in line for line in received) == 2, out[-3000:]
    settle(srv, fds)


# -- through HAProxy (TCP mode, PROXY v2) --------------------------------------------------------

@needs_haproxy
@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_behind_haproxy_tcp_mode_with_proxy_v2(make_server, tls_certs, tmp_path, version):
    h = Recorder()
    srv = make_server(h, framing="u16", proxy_protocol="v2", ssl=tls_certs.server_ctx())
    fds = open_fds()
    clients = []
    with haproxy_v2(tmp_path, [srv.address[1]]) as (front, proc):
        try:
            ctx = tls_certs.client_ctx(version=version)
            for i in range(4):
                raw = socket.create_connection((HOST, front), timeout=10)
                clients.append(ctx.wrap_socket(raw, server_hostname="localhost"))
            names = [c.getsockname()[:2] for c in clients]
            run_threads([functools.partial(echo_frames, c, seed=i)
                         for i, c in enumerate(clients)], timeout=60)
            tls_sessions = [i for i in list(h.seen) if i["version"] is not None]
            by_peer = {i["peer"]: i for i in tls_sessions}
            for name in names:
                assert name in by_peer, f"no session saw client {name} as its peer: {sorted(by_peer)}"
                info = by_peer[name]
                assert info["proxy_peer"][0] == HOST and info["proxy_peer"] != name
                assert info["version"] == VERSION_NAME[version]
            for c in clients:
                c.close()
            clients = []
            proc.terminate()                    # no more health checks from here
            proc.wait(5)
            st = srv.stats()
            assert "proxy" not in st.get("closes", {}), st
        finally:
            for c in clients:
                c.close()
    settle(srv, fds)
