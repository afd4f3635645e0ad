"""``Session.socket``: asyncio's ``TransportSocket`` over the connection's socket, whose
``shutdown()`` does not overtake what was sent before it -- from the loop thread and from a
worker -- and which refuses what would make the loop block."""
import gc
import socket
import weakref

import pytest

from aoprim.server import Handler

from server_support import make_server, wait_for  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(60)


class HalfCloses(Handler):
    def on_read(self, session, data):
        session.send(b"reply:" + bytes(data))
        session.socket.shutdown(socket.SHUT_WR)


def _exchange(address):
    with socket.create_connection(address, timeout=10) as c:
        c.sendall(b"ping")
        got = b""
        while True:
            b = c.recv(4096)
            if not b:
                return got
            got += b


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shutdown_after_a_send_sends_the_reply_first(make_server, workers):
    srv = make_server(HalfCloses(), framing="raw", workers=workers)
    for _ in range(3):
        assert _exchange(srv.address) == b"reply:ping"


def test_the_socket_refuses_to_block(make_server):
    seen = []

    class Asks(Handler):
        def on_read(self, session, data):
            try:
                session.socket.setblocking(True)
            except ValueError as e:
                seen.append(str(e))
            session.send(bytes(data))

    srv = make_server(Asks(), framing="raw")
    with socket.create_connection(srv.address, timeout=10) as c:
        c.sendall(b"x")
        assert c.recv(1) == b"x"
    assert len(seen) == 1


def test_a_socket_kept_by_the_application_does_not_keep_its_closed_session(make_server):
    kept, sessions = [], []

    class Keeps(Handler):
        def on_read(self, session, data):
            kept.append(session.socket)
            sessions.append(weakref.ref(session))
            session.close()

    srv = make_server(Keeps(), framing="raw")
    gc.disable()
    try:
        with socket.create_connection(srv.address, timeout=10) as c:
            c.sendall(b"x")
            c.recv(1)
        wait_for(lambda: sessions and srv.live_sessions == 0, 10, "the session's close")
        wait_for(lambda: sessions[0]() is None, 10, "the session freed without the GC")
        assert len(kept) == 1
    finally:
        gc.enable()
