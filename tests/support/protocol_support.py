"""Fixtures of the serve_protocol tests: every test runs on both Layer 1 backends, with and
without workers, and ``serve`` starts a server that is shut down and checked for leaks
(gauges, file descriptors) after the test; ``on_asyncio`` runs the same protocol on asyncio's
own loop, to compare."""
import asyncio

import pytest

from aoprim.server import serve_protocol
from aoprim.server.loop import BACKENDS

from server_support import HOST, assert_no_leaks, open_fds


def on_asyncio(factory, client, **kw):
    """Run ``client(address)`` against ``factory`` served by asyncio's own loop
    (``create_server``'s keywords: ``ssl=``); returns what the client returned."""
    async def main():
        srv = await asyncio.get_running_loop().create_server(factory, HOST, 0, **kw)
        try:
            return await asyncio.to_thread(client, srv.sockets[0].getsockname())
        finally:
            srv.close()

    return asyncio.run(main())


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=[0, 2], ids=["workers0", "workers2"])
def workers(request):
    return request.param


@pytest.fixture
def serve(backend, workers):
    """serve(factory, **settings): a started serve_protocol server, shut down and checked
    for leaks after the test."""
    made = []
    fds = open_fds()

    def start(factory, **kw):
        srv = serve_protocol(factory, HOST, 0, backend=backend, workers=workers, **kw)
        made.append(srv)
        return srv

    yield start
    for srv in made:
        srv.shutdown(timeout=15)
        assert_no_leaks(srv)
    assert open_fds() == fds, "file descriptors leaked"
