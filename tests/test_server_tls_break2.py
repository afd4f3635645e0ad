"""TLS on aoprim.server, broken on purpose -- the second review (issue 21): each test here is
a scenario that misbehaved before its fix (it failed first), against the real server on
loopback, both backends, every slot and fd back to idle after each test (make_server's
teardown), no ERROR log line."""
import logging
import socket
import struct
import threading

import pytest

from aoprim.server import Handler, Server
from aoprim.server.loop import BACKENDS

from tlscerts import tls_certs  # noqa: F401  (fixture)
from test_server_support import frame, make_server, read_frame, wait_for  # noqa: F401

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.WARNING, logger="aoprim.server")
    return caplog


def error_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def connect(srv, certs):
    raw = socket.create_connection(srv.address, timeout=10)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if certs is None:
        return raw
    return certs.client_ctx().wrap_socket(raw, server_hostname="localhost")


# -- what on_close sends, when the close finished inside the iteration's flush ------------------

class Chat(Handler):
    """Echo; ``bye`` closes the session (``bye!`` after a reply); on_close tells the others."""

    def on_read(self, session, data):
        d = bytes(data)
        if d == b"bye!":
            session.send(b"ok")
        if d.startswith(b"bye"):
            session.close()
        else:
            session.send(d)

    def on_close(self, session, exc):
        session.server.broadcast(b"left %d" % session.id, exclude=session)


@pytest.mark.parametrize("tls, how", [(True, "bye"), (True, "eof"), (True, "bye!"),
                                      (False, "bye!")])
def test_what_on_close_sends_leaves_without_waiting_for_another_event(
        make_server, tls_certs, logs, monkeypatch, tls, how):
    """A close that waits for its output (over TLS every graceful close does: close_notify;
    over plain TCP one with a reply still owed) finishes inside the iteration's flush, and
    the handler's on_close runs there: what it sends (here a broadcast to the others) must
    still leave at once.  Before: it marked the other sessions after the flush had passed
    them and waited for the loop's next wake-up -- the next event, or the 1 s sweep (taken
    away here, with every other timer pushed beyond the client's timeout, so the wait is
    the client's 10 s timeout and the test fails instead of being merely slow; with the
sweep, the notice came 1 s late)."""
    ticked = threading.Event()
    monkeypatch.setattr(Server, "_sweep", lambda self: ticked.set())  # one tick, no more
    kw = {"ssl": tls_certs.server_ctx(), "handshake_timeout": 60.0} if tls else {}
    srv = make_server(Chat(), framing="u16", close_linger=60.0, **kw)
    certs = tls_certs if tls else None
    a, b = connect(srv, certs), connect(srv, certs)
    try:
        for s in (a, b):
            s.sendall(frame(b"hi"))
            assert read_frame(s) == b"hi"
        wait_for(lambda: srv.stats()["connections"] == 2, what="both sessions")
        aid = min(s.id for s in srv.sessions)
        assert ticked.wait(10), "the sweep's first tick"    # from here on no timer is due
        if how == "eof":
            a.unwrap().shutdown(socket.SHUT_WR)     # close_notify, then the TCP EOF
        else:
            a.sendall(frame(how.encode()))
        assert read_frame(b, timeout=10) == b"left %d" % aid
    finally:
        a.close()
        b.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    assert not error_lines(logs), error_lines(logs)[:5]
