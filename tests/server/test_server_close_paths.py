"""Every way a session can end returns every resource: receive slots, send slots, fds, the
session itself -- and runs on_close exactly once.  Counted from outside (Server.stats()),
after each way of closing, with and without workers."""
import logging
import socket
import struct
import sysconfig
import threading

import pytest

from aoprim.server import Handler

from server_support import (connect, frame, make_server, open_fds,  # noqa: F401
                                 read_frame, recv_until_closed, wait_for)
from aoprim.server.loop import BACKENDS

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test here runs on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


IDLE_RX = 1     # the scratch slot every session reads into (held while the server runs)


class Recorder(Handler):
    """Echo; b"boom" raises, b"bye" closes from the handler; counts on_close per session."""

    def __init__(self):
        self.closed = {}
        self.lock = threading.Lock()

    def on_read(self, session, data):
        b = bytes(data)
        if b == b"boom":
            raise RuntimeError("handler bug")
        if b == b"bye":
            session.send(b"bye-ack")
            session.close()
            return
        session.send(data)

    def on_close(self, session, exc):
        with self.lock:
            self.closed[session.id] = self.closed.get(session.id, 0) + 1


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="aoprim.server")
    return caplog


def reset(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def errors(caplog, allow=()):
    return [r for r in caplog.records if r.levelno >= logging.ERROR
            and not any(a in r.getMessage() for a in allow)]


def _normal(s):
    s.sendall(frame(b"hello"))
    assert read_frame(s) == b"hello"
    s.close()


def _reset_mid_frame(s):
    s.sendall(struct.pack(">H", 3000) + b"x" * 1000)    # a frame begun, never finished
    reset(s)


def _reset_mid_big_frame(s):
    s.sendall(struct.pack(">H", 60000) + b"y" * 20000)  # larger than a slot: heap buffer
    reset(s)


def _protocol_error(s):
    s.sendall(frame(b"ok") + struct.pack(">H", 65000))     # above max_frame
    assert read_frame(s) == b"ok"
    assert recv_until_closed(s)[0] == b""
    s.close()


def _handler_exception(s):
    s.sendall(frame(b"x" * 10) + frame(b"boom") + struct.pack(">H", 500) + b"z" * 10)
    assert read_frame(s) == b"x" * 10
    assert recv_until_closed(s)[0] == b""
    s.close()


def _application_close(s):
    s.sendall(frame(b"bye") + frame(b"never answered") + struct.pack(">H", 900) + b"q")
    assert read_frame(s) == b"bye-ack"
    data, how = recv_until_closed(s)
    assert (data, how) == (b"", "eof")
    s.close()


def _eof_mid_frame(s):
    s.sendall(struct.pack(">H", 3000) + b"x" * 1000)
    s.shutdown(socket.SHUT_WR)
    assert recv_until_closed(s)[0] == b""
    s.close()


WAYS = {
    "normal": _normal,
    "reset mid-frame": _reset_mid_frame,
    "reset mid big frame": _reset_mid_big_frame,
    "protocol error": _protocol_error,
    "handler exception": _handler_exception,
    "application close": _application_close,
    "eof mid-frame": _eof_mid_frame,
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("way", list(WAYS))
def test_every_close_path_returns_every_resource(make_server, connect, logs, way, workers):
    h = Recorder()
    srv = make_server(h, framing="u16", max_frame=60000, rx_slot_size=4096, workers=workers)
    fds = open_fds()
    n = 20
    socks = [connect(srv) for _ in range(n)]
    wait_for(lambda: srv.stats()["connections"] == n)
    for s in socks:
        WAYS[way](s)
    wait_for(lambda: srv.stats()["connections"] == 0, what="every session to close")
    wait_for(lambda: len(h.closed) == n, what="every on_close")
    assert set(h.closed.values()) == {1}, "on_close must run exactly once per session"
    wait_for(lambda: srv.live_sessions == 0, what="every session's last reference")
    st = srv.stats()
    assert st["rx_slots_in_use"] == IDLE_RX, st
    assert st["tx_slots_in_use"] == 0
    assert open_fds() == fds            # every server-side socket closed (clients too)
    allow = ("handler on_read raised",) if way == "handler exception" else ()
    assert not errors(logs, allow), [r.getMessage() for r in errors(logs, allow)]
    assert "outlived" not in logs.text


@pytest.mark.parametrize("workers", [0, 2])
def test_shutdown_with_frames_in_flight_returns_everything(make_server, connect, workers):
    h = Recorder()
    srv = make_server(h, framing="u16", rx_slot_size=4096, workers=workers)
    socks = [connect(srv) for _ in range(30)]
    for i, s in enumerate(socks):
        s.sendall(frame(b"a" * 100) + struct.pack(">H", 2000 + i) + b"b" * (i * 10))
    for s in socks:
        assert read_frame(s) == b"a" * 100
    srv.shutdown()
    assert len(h.closed) == 30 and set(h.closed.values()) == {1}
    # make_server's teardown asserts rx/tx slots 0, no live sessions, fds back


def test_50_resets_mid_frame_hold_nothing_back(make_server, connect, logs):
    """50 clients send a header for 3000 bytes plus 1000, then reset: every receive slot
    comes back (not 51 in use) and no 'a frame view outlived' line is logged."""
    srv = make_server(Recorder(), framing="u16")
    assert srv.stats()["rx_slots_in_use"] == IDLE_RX
    socks = [connect(srv) for _ in range(50)]
    for s in socks:
        s.sendall(struct.pack(">H", 3000) + b"x" * 1000)
    wait_for(lambda: srv.stats()["bytes_in"] == 50 * 1002, what="the partial frames")
    for s in socks:
        reset(s)
    wait_for(lambda: srv.stats()["connections"] == 0)
    assert srv.stats()["rx_slots_in_use"] == IDLE_RX
    assert srv.stats()["rx_pool_fallbacks"] == 0
    assert not errors(logs)


def test_reply_survives_a_close_with_unread_input(make_server, connect):
    """Lingering close: the handler replies and closes while the client's next request is
    still unread; closing a socket with unread input sends an RST that destroys the reply in
    flight -- the server drains the input first."""
    class ReplyAndClose(Handler):
        def on_read(self, session, data):
            session.send(b"R" * 200000)
            session.close()

    srv = make_server(ReplyAndClose(), framing="raw", rx_slot_size=4096)
    for _ in range(5):
        s = connect(srv, rcvbuf=65536)
        s.sendall(b"req" + b"unread" * 20000)     # read: the first 4 KiB; the rest waits
        data, how = recv_until_closed(s)
        assert how == "eof" and len(data) == 200000
        s.close()
    wait_for(lambda: srv.stats()["connections"] == 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_closed_session_is_freed_without_the_cyclic_gc(make_server, connect, workers):
    """Reference cycles through a session (its RefCount's on_zero, its hand-off queue, its
    receiver's callbacks, its batch's owner) are broken when it ends: reference counting
    frees it, so a connection storm does not pile up garbage for the cyclic GC."""
    import gc
    import weakref
    srv = make_server(Recorder(), framing="u16", workers=workers)
    refs = []
    gc.disable()
    try:
        for _ in range(10):
            s = connect(srv)
            s.sendall(frame(b"hello") + struct.pack(">H", 100) + b"part")
            assert read_frame(s) == b"hello"
            wait_for(lambda: srv.sessions)
            refs.append(weakref.ref(srv.sessions[0]))
            s.close()
            wait_for(lambda: not srv.sessions and srv.live_sessions == 0)
        if not FREE_THREADED:
            wait_for(lambda: all(r() is None for r in refs), what="sessions freed without gc")
            return
        # Free-threaded build: an object whose last reference another thread than its
        # creator drops waits in its creator's merge queue (biased reference counting) until
        # that thread next runs Python code -- an idle worker may not for a long time -- and
        # a collection merges those queues, handing the objects whose count reaches zero to
        # its unreachable list: a pending merge and a cycle look the same to it.  What is
        # checked here is that nothing keeps a closed session alive; that no cycle holds it
        # is checked by the GIL build above, where the same code frees it promptly.
        try:
            wait_for(lambda: all(r() is None for r in refs), timeout=2)
        except AssertionError:
            gc.collect()
        assert all(r() is None for r in refs), "sessions kept alive after close"
    finally:
        gc.enable()


# ---- a large frame's buffer on every close path -------------------------------------------

class Holder(Handler):
    """Echo, and keeps each session (for session.close() from the test)."""

    def __init__(self):
        self.sessions = []

    def on_connect(self, session):
        self.sessions.append(session)

    def on_read(self, session, data):
        session.send(data)


BIG = 600_000       # a u32 frame far above the 16 KiB slots: it gets a frame buffer


@pytest.mark.parametrize("way", ["peer close", "reset", "close()", "server stop",
                                 "max_frame exceeded", "timeout", "reset, echo unsent"])
def test_a_large_frame_buffer_returns_to_the_pool_on_every_close_path(make_server, connect,
                                                                       way):
    h = Holder()
    srv = make_server(h, framing="u32", max_frame=1 << 20,
                      frame_timeout=0.5 if way == "timeout" else 30.0)
    c = connect(srv, rcvbuf=4096 if way == "reset, echo unsent" else None)
    payload = bytes(range(256)) * (BIG // 256)
    msg = frame(payload, "u32")
    if way == "reset, echo unsent":
        c.sendall(msg)                  # whole: echoed by reference, the peer reads nothing
        wait_for(lambda: srv.stats()["frames_in"] == 1, what="the frame received")
    elif way == "max_frame exceeded":
        c.sendall(msg + struct.pack(">I", (1 << 20) + 1))
        wait_for(lambda: srv.stats()["connections_total"] == 1, what="the connection")
    else:
        c.sendall(msg[:BIG // 2])       # an unfinished large frame: the session holds it
        wait_for(lambda: srv.stats()["rx_frame_buffers_in_use"] == 1,
                 what="the frame buffer taken")
    if way == "peer close":
        c.close()
    elif way in ("reset", "reset, echo unsent"):
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
    elif way == "close()":
        h.sessions[0].close()
    elif way == "server stop":
        srv.shutdown(timeout=15)
    # max_frame exceeded and timeout: the server cuts the session itself
    wait_for(lambda: srv.stats()["connections"] == 0, 10, "the session closed")
    st = srv.stats()
    wait_for(lambda: srv.stats()["rx_frame_buffers_in_use"] == 0, 5,
             "the frame buffer back")
    st = srv.stats()
    if way == "server stop":
        assert st["rx_frame_cache_bytes"] == 0      # the arena freed what it kept
    else:
        # back in the arena's cache (resident, for the next large frame), not freed
        assert st["rx_frame_cache_bytes"] >= len(msg), st
    assert st["rx_slots_in_use"] == (0 if way == "server stop" else IDLE_RX)
