"""A worker server's hooks at the edges: ``on_close`` of the sessions a shutdown closes runs
on a worker (docs/threads.md), so one that blocks is bounded by ``shutdown_timeout`` as a
blocking ``on_read`` is; whatever ``on_connect`` raises on the loop thread -- ``SystemExit``,
``asyncio.CancelledError``, a ``KeyboardInterrupt`` off the main thread -- closes that session
only (docs/server.md), over plain TCP, the PROXY protocol and TLS; a ``KeyboardInterrupt``
raised on the main thread stops ``serve_forever()`` there."""
import asyncio
import logging
import socket
import ssl
import subprocess
import sys
import textwrap
import threading

import pytest

from aoprim.server import Handler, Server
from aoprim.server.loop import BACKENDS

from server_support import (HOST, assert_no_leaks, frame, make_server,  # noqa: F401
                            read_frame, recv_until_closed, wait_for)
from tlscerts import tls_certs  # noqa: F401  (a fixture)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test here runs on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


class Recorder(Handler):
    """Echoes frames; records the thread each on_close ran on.  ``gate``: on_close waits on
    it (a commit that blocks); b"pause": pause_reading() in on_read."""

    def __init__(self, gate=None):
        self.gate = gate
        self.lock = threading.Lock()
        self.closes = []            # (session id, thread name)
        self.reads = []             # (session id, frame)

    def on_read(self, session, data):
        data = bytes(data)
        with self.lock:
            self.reads.append((session.id, data))
        session.send(data)
        if data == b"pause":
            session.pause_reading()

    def on_close(self, session, exc):
        with self.lock:
            self.closes.append((session.id, threading.current_thread().name))
        if self.gate is not None:
            self.gate.wait(60)


def _clients(srv, n):
    out = []
    for i in range(n):
        c = socket.create_connection(srv.address, timeout=10)
        c.sendall(frame(b"hi%d" % i))
        assert read_frame(c) == b"hi%d" % i
        out.append(c)
    return out


def test_on_close_at_shutdown_runs_on_a_worker(make_server):
    h = Recorder()
    srv = make_server(h, framing="u16", workers=2)
    clients = _clients(srv, 3)
    srv.shutdown(timeout=30)
    for c in clients:
        assert recv_until_closed(c) == (b"", "eof")
        c.close()
    assert len(h.closes) == 3, h.closes
    assert all(name.startswith("aoprim-worker") for _, name in h.closes), h.closes
    assert_no_leaks(srv)


def test_a_blocking_on_close_at_shutdown_is_cut_at_shutdown_timeout(make_server, caplog):
    gate = threading.Event()
    h = Recorder(gate)
    srv = make_server(h, framing="u16", workers=2, shutdown_timeout=0.5)
    clients = _clients(srv, 3)
    try:
        # the default bound, 2 * shutdown_timeout + 5 s: a loop thread held by on_close would
        # make it raise TimeoutError
        with caplog.at_level(logging.ERROR, "aoprim.server"):
            srv.shutdown()
        assert any("worker threads did not exit within 0.5 s" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        gate.set()
    wait_for(lambda: len(h.closes) == 3, 20, "every on_close")
    assert all(name.startswith("aoprim-worker") for _, name in h.closes), h.closes
    wait_for(lambda: srv.live_sessions == 0, 20, "the sessions' last references")
    for c in clients:
        c.close()
    assert_no_leaks(srv)


def test_a_paused_session_at_shutdown_is_closed_on_a_worker_its_held_frames_dropped(
        make_server):
    h = Recorder()
    srv = make_server(h, framing="u16", workers=2)
    c = socket.create_connection(srv.address, timeout=10)
    # one read: the frames behind the one that pauses are queued for the worker, which
    # holds them (white box: the worker backlog)
    c.sendall(frame(b"pause") + frame(b"held1") + frame(b"held2"))
    assert read_frame(c) == b"pause"
    wait_for(lambda: srv.sessions and srv.sessions[0].work.user_paused
             and len(srv.sessions[0].work.backlog) == 2, 10, "the pause, two frames held")
    srv.shutdown(timeout=30)
    assert recv_until_closed(c) == (b"", "eof")
    c.close()
    assert [d for _, d in h.reads] == [b"pause"]
    assert len(h.closes) == 1 and h.closes[0][1].startswith("aoprim-worker"), h.closes
    assert_no_leaks(srv)


# -- on_connect's exceptions with workers ---------------------------------------------------

class RaiseOnFirstConnect(Handler):
    def __init__(self, exc_type):
        self.exc_type = exc_type
        self.first = True
        self.closed = []

    def on_connect(self, session):
        if self.first:
            self.first = False
            raise self.exc_type("from on_connect")

    def on_read(self, session, data):
        session.send(bytes(data))

    def on_close(self, session, exc):
        self.closed.append((session.id, type(exc)))


EXCEPTIONS = [SystemExit, KeyboardInterrupt, asyncio.CancelledError, RuntimeError]


def _check_first_closed_next_served(srv, h, exc_type, connect):
    a = connect()
    assert recv_until_closed(a)[0] == b""
    a.close()
    wait_for(lambda: h.closed, 10, "on_close of the first session")
    assert h.closed == [(1, exc_type)]
    b = connect()
    b.sendall(b"next")
    assert b.recv(4) == b"next"             # the server serves on
    b.close()
    assert srv.stats()["handler_errors"] == 1
    srv.shutdown(timeout=15)


@pytest.mark.parametrize("exc_type", EXCEPTIONS, ids=lambda e: e.__name__)
def test_on_connect_raising_closes_that_session_only(make_server, exc_type):
    h = RaiseOnFirstConnect(exc_type)
    srv = make_server(h, workers=2)
    _check_first_closed_next_served(
        srv, h, exc_type, lambda: socket.create_connection(srv.address, timeout=10))


@pytest.mark.parametrize("exc_type", EXCEPTIONS, ids=lambda e: e.__name__)
def test_on_connect_after_a_proxy_header_raising_closes_that_session_only(make_server,
                                                                          exc_type):
    h = RaiseOnFirstConnect(exc_type)
    srv = make_server(h, workers=2, proxy_protocol="any")

    def connect():
        c = socket.create_connection(srv.address, timeout=10)
        c.sendall(b"PROXY TCP4 192.0.2.1 192.0.2.2 1234 80\r\n")
        return c
    _check_first_closed_next_served(srv, h, exc_type, connect)


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt], ids=lambda e: e.__name__)
def test_on_connect_after_a_tls_handshake_raising_closes_that_session_only(make_server,
                                                                           tls_certs,  # noqa: F811
                                                                           exc_type):
    h = RaiseOnFirstConnect(exc_type)
    srv = make_server(h, workers=2, ssl=tls_certs.server_ctx())
    ctx = tls_certs.client_ctx()

    def connect():
        raw = socket.create_connection(srv.address, timeout=10)
        return ctx.wrap_socket(raw, server_hostname="localhost")
    _check_first_closed_next_served(srv, h, exc_type, connect)


MAIN_THREAD = textwrap.dedent("""
    import socket, sys, threading
    from aoprim.server import Handler, Server

    class H(Handler):
        def on_connect(self, session):
            if session.id == 1:
                raise SystemExit(3)
            if session.id == 3:
                raise KeyboardInterrupt
        def on_read(self, session, data):
            session.send(bytes(data))

    srv = Server(H(), "127.0.0.1", 0, backend=sys.argv[1], workers=2)

    def client():
        a = socket.create_connection(srv.address, timeout=10)
        first = a.recv(10)                  # closed: b""
        b = socket.create_connection(srv.address, timeout=10)
        b.sendall(b"x")
        second = b.recv(10)
        print("first", first, "second", second, flush=True)
        c = socket.create_connection(srv.address, timeout=10)
        c.recv(10)

    t = threading.Thread(target=client)
    srv.loop.call_soon(t.start)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        print("serve_forever raised KeyboardInterrupt", flush=True)
    t.join(10)
""")


def test_on_connect_keyboardinterrupt_on_the_main_thread_stops_serve_forever(backend,
                                                                            tmp_path):
    script = tmp_path / "main_thread.py"
    script.write_text(MAIN_THREAD)
    r = subprocess.run([sys.executable, str(script), backend], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["first b'' second b'x'",
                                     "serve_forever raised KeyboardInterrupt"], r.stdout


class SendThenExit(Handler):
    """Answers, then ends the program from the loop thread (workers=0): a "shutdown" command."""
    def __init__(self, exc):
        self.exc = exc

    def on_read(self, session, data):
        session.send(b"bye")
        raise self.exc


@pytest.mark.parametrize("exc", [SystemExit(0), KeyboardInterrupt()], ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_reply_sent_just_before_sys_exit_on_the_loop_thread_reaches_the_peer(
        make_server, tls_certs, caplog, exc, tls):  # noqa: F811
    """asyncio's write() hands the bytes to the kernel at once, so a protocol that answers and
    then calls sys.exit() delivers its answer; here the send is queued until the loop's flush:
    a loop that SystemExit/KeyboardInterrupt ends hands what was queued to the kernel before
    it closes the sessions, and the peer reads the reply and a clean end of stream (not a
    reset).  Not logged as a crash."""
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    srv = make_server(SendThenExit(exc), framing="raw", **kw)
    c = socket.create_connection(srv.address, timeout=10)
    if tls:
        c = tls_certs.client_ctx().wrap_socket(c, server_hostname="localhost")
    with c:
        c.sendall(b"shutdown")
        got = b""
        try:
            while (d := c.recv(100)):
                got += d
        except ssl.SSLEOFError:         # (the TLS close: the server's close_notify is owed)
            pass
    assert got == b"bye"
    wait_for(lambda: srv._done.is_set(), 10, "the server to stop")
    assert not [r for r in caplog.records if "crashed" in r.getMessage()]
    assert [r for r in caplog.records if f"{exc!r} raised on the loop thread" in r.getMessage()]
