"""``loop.sendfile()`` when the connection goes away while it waits for the transport's
write buffer to drain: asyncio's selector transport fails the wait with
``ConnectionError("Connection is closed by peer")`` when the connection is lost
(``transport.abort()``, 3.13's ``Server.abort_clients()``); aoprim.aio must do the same, not
wait forever.

Each scenario runs on asyncio's default loop (the baseline, asserted too) and on aoprim.aio.
uvloop has no native sendfile (``loop.sendfile()`` raises ``NotImplementedError`` at once),
so its run is skipped with that reason.  The peer never reads and both socket buffers are
small, so the buffered bytes cannot drain; the test waits for ``sendfile()`` to have started
(it pauses reading before it waits), never on a clock.
"""
import asyncio
import os
import socket

import pytest

pytestmark = pytest.mark.timeout(60)

try:
    import uvloop
except ImportError as exc:  # pragma: no cover - depends on the venv
    uvloop = None
    _UVLOOP_WHY = f"uvloop not importable: {exc}"

import aoprim.aio

KINDS = ("asyncio", "uvloop", "aoprim")
#: what the test writes before sendfile(): far more than two 4 KiB socket buffers hold
BACKLOG = 8 << 20


def new_loop(kind):
    if kind == "asyncio":
        return asyncio.new_event_loop()
    if kind == "uvloop":
        if uvloop is None:
            pytest.skip(_UVLOOP_WHY)
        pytest.skip("uvloop's loop.sendfile() raises NotImplementedError (no native path, "
                    "no empty-buffer wait to fail)")
    return aoprim.aio.new_event_loop()


@pytest.fixture
def big_file(tmp_path):
    path = tmp_path / "payload.bin"
    path.write_bytes(os.urandom(4 << 20))
    with open(path, "rb") as f:
        yield f


async def _started(task, transport):
    """Until sendfile() paused the transport's reading (which it does before it waits for
    the buffer to drain) -- or finished, which the caller then reports."""
    while transport.is_reading() and not task.done():
        await asyncio.sleep(0)


def _stuck_peer(lsock):
    """A connected client that never reads, with a small receive buffer; and the server side,
    non-blocking, with a small send buffer."""
    cli = socket.socket()
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    cli.connect(lsock.getsockname())
    srv, _ = lsock.accept()
    srv.setblocking(False)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return cli, srv


@pytest.mark.parametrize("kind", KINDS)
def test_sendfile_waiting_for_the_buffer_fails_after_abort(kind, big_file):
    loop = new_loop(kind)
    lost = []

    class Proto(asyncio.Protocol):
        def connection_lost(self, exc):
            lost.append(exc)

    async def main():
        with socket.create_server(("127.0.0.1", 0)) as lsock:
            cli, srv = _stuck_peer(lsock)
            try:
                tr, _ = await loop.connect_accepted_socket(Proto, srv)
                tr.write(b"x" * BACKLOG)
                task = asyncio.ensure_future(loop.sendfile(tr, big_file))
                await _started(task, tr)
                assert not task.done(), task
                tr.abort()
                with pytest.raises(ConnectionError) as info:
                    await asyncio.wait_for(task, 10)
                return info.value
            finally:
                cli.close()

    try:
        exc = loop.run_until_complete(main())
    finally:
        loop.close()
    assert type(exc) is ConnectionError and str(exc) == "Connection is closed by peer", exc
    assert lost == [None]


@pytest.mark.skipif(not hasattr(asyncio.Server, "abort_clients"),
                    reason="Server.abort_clients() is new in Python 3.13")
@pytest.mark.parametrize("kind", KINDS)
def test_sendfile_waiting_for_the_buffer_fails_after_abort_clients(kind, big_file):
    loop = new_loop(kind)

    async def main():
        started = loop.create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, tr):
                tr.write(b"x" * BACKLOG)
                task = asyncio.ensure_future(loop.sendfile(tr, big_file))
                started.set_result((task, tr))

        server = await loop.create_server(Proto, "127.0.0.1", 0)
        cli = socket.socket()
        cli.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            await loop.sock_connect(cli, server.sockets[0].getsockname())
            task, tr = await asyncio.wait_for(started, 10)
            await _started(task, tr)
            assert not task.done(), task
            server.abort_clients()
            with pytest.raises(ConnectionError) as info:
                await asyncio.wait_for(task, 10)
            return info.value
        finally:
            cli.close()
            server.close()
            await server.wait_closed()

    try:
        exc = loop.run_until_complete(main())
    finally:
        loop.close()
    assert type(exc) is ConnectionError and str(exc) == "Connection is closed by peer", exc
