"""The socket of serve_protocol, against asyncio's: ``get_extra_info("socket")`` is one
object per transport; its ``shutdown()`` called on a worker refuses a bad ``how`` at the
call, and a ``write()`` after ``shutdown(SHUT_WR)`` fails the connection
(``BrokenPipeError``) instead of reaching the peer; ``serve_protocol(sock=)`` makes a bound
socket listen, as ``create_server(sock=)`` does.  Both Layer 1 backends, with and without
workers."""
import asyncio
import errno
import socket

import pytest

from aoprim.server import Handler, Server

from server_support import HOST, recv_exact, recv_until_closed, wait_for
from protocol_support import backend, on_asyncio, serve, workers  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def test_the_socket_is_one_object_per_transport_as_asyncio(serve):
    seen = []

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            seen.append(transport.get_extra_info("socket"))

        def data_received(self, data):
            # (with workers: on a worker, where connection_made asked on another thread)
            a, b = self.t.get_extra_info("socket"), self.t.get_extra_info("socket")
            self.t.write(b"%d%d;" % (a is b, a is seen[0]))

    def client(address):
        with socket.create_connection(address, timeout=20) as c:
            c.sendall(b"x")
            return recv_exact(c, 3, timeout=20)

    assert on_asyncio(P, client) == b"11;"
    seen.clear()
    srv = serve(P)
    assert client(srv.address) == b"11;"
    assert len({id(s) for s in seen}) == 1


class WritesAfterShutdown(asyncio.Protocol):
    """Writes b"before;", shuts the socket's write side, writes b"AFTER;"; records the
    exception connection_lost gets."""

    def __init__(self, lost):
        self.lost = lost

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.t.write(b"before;")
        self.t.get_extra_info("socket").shutdown(socket.SHUT_WR)
        self.t.write(b"AFTER;")

    def connection_lost(self, exc):
        self.lost.append(exc)


def _send_and_read(address):
    with socket.create_connection(address, timeout=20) as c:
        c.sendall(b"go")
        data, _ = recv_until_closed(c, timeout=20)
        return data


def test_a_write_after_shutdown_wr_fails_the_connection_as_asyncio(serve, workers):
    """The peer gets what came before the shutdown and then the end of the stream; the
    write after it fails: connection_lost(BrokenPipeError), as asyncio's -- with workers
    too, where the shutdown itself runs later, on the loop thread."""
    lost = []

    def client_then_lost(address):
        data = _send_and_read(address)
        wait_for(lambda: lost, timeout=20, what="connection_lost")
        return data, type(lost[0])

    assert on_asyncio(lambda: WritesAfterShutdown(lost), client_then_lost) == \
        (b"before;", BrokenPipeError)
    srv = serve(lambda: WritesAfterShutdown(lost))
    for _ in range(3):
        lost.clear()
        assert client_then_lost(srv.address) == (b"before;", BrokenPipeError)


@pytest.mark.parametrize("how", [7, -1])
def test_a_bad_shutdown_how_raises_at_the_call_as_asyncio(serve, workers, how):
    """shutdown(how) with a bad ``how`` raises OSError(EINVAL) at the call -- on a worker
    too, where the shutdown runs later on the loop thread -- and the connection goes on."""
    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport

        def data_received(self, data):
            try:
                self.t.get_extra_info("socket").shutdown(how)
            except OSError as e:
                self.t.write(b"%s;" % errno.errorcode.get(e.errno, "?").encode())
            else:
                self.t.write(b"none;")
            try:
                self.t.get_extra_info("socket").shutdown("x")
            except TypeError:
                self.t.write(b"TypeError;")

    def client(address):
        with socket.create_connection(address, timeout=20) as c:
            c.sendall(b"x")
            return recv_exact(c, len(b"EINVAL;TypeError;"), timeout=20)

    assert on_asyncio(P, client) == b"EINVAL;TypeError;"
    srv = serve(P)
    assert client(srv.address) == b"EINVAL;TypeError;"


class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.t.write(data)


def _bound(family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    return s


def test_serve_protocol_makes_a_bound_socket_listen_as_asyncio(serve):
    """uvicorn's bind_socket() hands create_server(sock=) a socket bound, not listening:
    asyncio calls listen() on it, and so does serve_protocol (with its backlog)."""
    def client(address):
        with socket.create_connection(address, timeout=20) as c:
            c.sendall(b"ping")
            return recv_exact(c, 4, timeout=20)

    async def on_asyncio_sock(sock):
        srv = await asyncio.get_running_loop().create_server(Echo, sock=sock)
        try:
            return await asyncio.to_thread(client, sock.getsockname())
        finally:
            srv.close()

    with _bound() as s:
        assert asyncio.run(on_asyncio_sock(s)) == b"ping"
    with _bound() as s:
        srv = serve(Echo, sock=s, backlog=7)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        assert client(srv.address) == b"ping"
        assert client(s.getsockname()) == b"ping"
        srv.shutdown(timeout=15)


def test_serve_protocol_leaves_an_unbound_socket_to_the_refusal(serve):
    """A socket never bound is not made to listen (no port is picked for it): refused,
    naming sock=, and left as it was."""
    with socket.socket() as s:
        with pytest.raises(ValueError, match="sock="):
            serve(Echo, sock=s)
        assert not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)


@pytest.mark.parametrize("bad", [{"idle_timeout": -1}, {"no_such_setting": 1}],
                         ids=["bad value", "unknown setting"])
def test_a_refused_serve_protocol_leaves_a_bound_socket_not_listening(serve, bad):
    """Settings are checked before the socket is made to listen: a call refused for them
    leaves the caller's socket as it was (asyncio checks its arguments first too), not
    listening with a backlog nobody accepts."""
    with _bound() as s:
        with pytest.raises((ValueError, TypeError)):
            serve(Echo, sock=s, **bad)
        assert not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)


class Replies(Handler):
    def on_read(self, session, data):
        session.send(data)


def test_a_server_still_refuses_a_bound_socket_not_listening(backend):
    """Server(sock=) keeps its documented refusal: only serve_protocol does as asyncio."""
    with _bound() as s:
        with pytest.raises(ValueError, match="sock= is not listening"):
            Server(Replies(), sock=s, backend=backend)
        assert not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
