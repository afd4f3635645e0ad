"""session.close()/abort() called inside a hook: on_close runs after that hook returned, never
inside it (a loop callback of its own, as asyncio's connection_lost), exactly once, and no
on_read follows the close; an exception the hook raises after closing is logged with its
traceback and counted, with and without workers.  Both Layer 1 backends; every fd, session
and receive slot back after each close path."""
import logging
import socket
import threading

import pytest

from aoprim.server import Handler
from aoprim.server.loop import BACKENDS

from server_support import (connect, frame, make_server, open_fds,  # noqa: F401
                                 read_frame, recv_until_closed, wait_for)

pytestmark = pytest.mark.timeout(60)

IDLE_RX = 1     # the scratch slot every session reads into (held while the server runs)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test here runs on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


class Closer(Handler):
    """Closes from the hook the test names; records every hook's entry and exit."""

    def __init__(self, where, how, raise_after=False, send_first=False):
        self.where = where              # "connect" or "read"
        self.how = how                  # "close" or "abort"
        self.raise_after = raise_after
        self.send_first = send_first
        self.lock = threading.Lock()
        self.events = []                # (session id, event)

    def _log(self, session, what):
        with self.lock:
            self.events.append((session.id, what))

    def _end(self, session):
        if self.send_first:
            session.send(b"reply before the close")
        getattr(session, self.how)()
        self._log(session, "closed-in-hook")
        assert session.closed
        if self.raise_after:
            raise RuntimeError("raised after the close")

    def on_connect(self, session):
        self._log(session, "connect")
        try:
            if self.where == "connect":
                self._end(session)
        finally:
            self._log(session, "connect-end")

    def on_read(self, session, data):
        self._log(session, "read")
        try:
            if self.where == "read":
                self._end(session)
        finally:
            self._log(session, "read-end")

    def on_close(self, session, exc):
        self._log(session, "close")

    def of(self, sid):
        with self.lock:
            return [e for i, e in self.events if i == sid]


def _settled(srv, h, n):
    wait_for(lambda: srv.stats()["connections"] == 0, what="every session to close")
    wait_for(lambda: sum(1 for _, e in h.events if e == "close") == n, what="every on_close")
    wait_for(lambda: srv.live_sessions == 0, what="every session's last reference")
    st = srv.stats()
    assert st["rx_slots_in_use"] == IDLE_RX, st
    assert st["tx_slots_in_use"] == 0 and st["rx_frame_buffers_in_use"] == 0, st
    return st


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["close", "abort"])
@pytest.mark.parametrize("where", ["connect", "read"])
@pytest.mark.parametrize("send_first", [False, True], ids=["nothing-owed", "reply-owed"])
def test_on_close_runs_after_the_hook_that_closed_returns(make_server, connect, where, how,
                                                          workers, send_first):
    h = Closer(where, how, send_first=send_first)
    srv = make_server(h, framing="u16", workers=workers)
    fds = open_fds()
    n = 5
    socks = [connect(srv) for _ in range(n)]
    for s in socks:
        s.sendall(frame(b"one") + frame(b"two"))    # two frames: only the first is read
    for s in socks:
        data, _ = recv_until_closed(s)
        if send_first and how == "close":
            assert data == frame(b"reply before the close")    # a graceful close sends it
        s.close()
    _settled(srv, h, n)
    hook = "connect" if where == "connect" else "read"
    for sid in range(1, n + 1):
        ev = h.of(sid)
        assert ev.count("close") == 1, ev
        assert ev.index("close") > ev.index(f"{hook}-end"), ev     # after the hook returned
        assert ev[-1] == "close", ev
        assert ev.count("read") == (1 if where == "read" else 0), ev   # nothing after it
    assert open_fds() == fds


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["close", "abort"])
def test_exception_after_close_in_on_read_is_logged_and_counted(make_server, connect, caplog,
                                                                how, workers):
    caplog.set_level(logging.WARNING, logger="aoprim.server")
    h = Closer("read", how, raise_after=True)
    srv = make_server(h, framing="u16", workers=workers)
    n = 3
    for _ in range(n):
        s = connect(srv)
        s.sendall(frame(b"x"))
        recv_until_closed(s)
        s.close()
    st = _settled(srv, h, n)
    assert st["handler_errors"] == n, st
    recs = [r for r in caplog.records if "handler on_read raised" in r.getMessage()]
    assert len(recs) == n
    for r in recs:
        assert r.levelno == logging.ERROR and r.exc_info is not None
        assert "raised after the close" in str(r.exc_info[1])
    for sid in range(1, n + 1):
        assert h.of(sid).count("close") == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_on_close_after_abort_of_another_session_runs_after_the_hook(make_server, connect,
                                                                     workers):
    """A hook that aborts another session: that one's on_close does not run inside it
    either."""
    events = []
    lock = threading.Lock()
    sessions = {}

    class Killer(Handler):
        def on_connect(self, session):
            with lock:
                sessions[session.id] = session

        def on_read(self, session, data):
            with lock:
                events.append(("read", session.id))
            sessions[1].abort()
            with lock:
                events.append(("read-end", session.id))
            session.close()

        def on_close(self, session, exc):
            with lock:
                events.append(("close", session.id))

    srv = make_server(Killer(), framing="u16", workers=workers)
    victim = connect(srv)
    wait_for(lambda: 1 in sessions, what="the first session")
    killer = connect(srv)
    killer.sendall(frame(b"go"))
    assert recv_until_closed(victim)[0] == b""
    assert recv_until_closed(killer)[0] == b""
    wait_for(lambda: len([e for e in events if e[0] == "close"]) == 2, what="both on_close")
    assert events.index(("close", 1)) > events.index(("read-end", 2)), events
    wait_for(lambda: srv.stats()["connections"] == 0)
