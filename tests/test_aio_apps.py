"""Real asyncio applications, unchanged, on aoprim.aio: an aiohttp web application and a
websockets server, each serving its own library's client (``test`` extras)."""
import asyncio

import pytest

import aoprim.aio
from aoprim.aio import SocketTransport

pytestmark = pytest.mark.timeout(60)


def test_aiohttp_app_serves_its_client():
    aiohttp = pytest.importorskip("aiohttp")
    from aiohttp import web

    big = bytes(range(256)) * 8192                        # 2 MiB

    async def hello(request):
        assert type(request.transport) is SocketTransport
        return web.Response(text=f"hello {request.match_info['name']}")

    async def echo(request):
        return web.Response(body=await request.read())

    async def stream(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(100):
            await resp.write(b"%d," % i)                   # many small writes
        await resp.write_eof()
        return resp

    async def large(request):
        return web.Response(body=big)

    async def ws(request):
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            await sock.send_str(msg.data.upper())
        return sock

    async def main():
        assert type(asyncio.get_running_loop()) is aoprim.aio.Loop
        app = web.Application()
        app.router.add_get("/hello/{name}", hello)
        app.router.add_post("/echo", echo)
        app.router.add_get("/stream", stream)
        app.router.add_get("/large", large)
        app.router.add_get("/ws", ws)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        try:
            conn = aiohttp.TCPConnector(limit=4)
            async with aiohttp.ClientSession(connector=conn) as s:
                for i in range(30):                          # keep-alive
                    async with s.get(f"{base}/hello/n{i}") as r:
                        assert r.status == 200
                        assert await r.text() == f"hello n{i}"
                results = await asyncio.gather(*[
                    s.post(f"{base}/echo", data=b"x" * (1000 * k)) for k in range(1, 9)])
                for k, r in enumerate(results, 1):
                    assert await r.read() == b"x" * (1000 * k)
                    r.release()
                async with s.get(f"{base}/stream") as r:
                    assert await r.read() == b"".join(b"%d," % i for i in range(100))
                async with s.get(f"{base}/large") as r:
                    assert await r.read() == big
                async with s.ws_connect(f"{base}/ws") as w:
                    for i in range(20):
                        await w.send_str(f"msg{i}")
                    for i in range(20):
                        assert (await w.receive_str()) == f"MSG{i}"
        finally:
            await runner.cleanup()
        return asyncio.get_running_loop().flush_stats()

    st = aoprim.aio.run(main())
    # (writes above the high-water mark go to the kernel at once, outside the group's flush)
    assert st["syscalls"] > 0 and st["bytes"] > 0


def test_websockets_server_serves_its_client():
    pytest.importorskip("websockets")
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import serve

    async def handler(ws):
        async for msg in ws:
            if isinstance(msg, bytes):
                await ws.send(msg[::-1])
            else:
                for part in msg.split():
                    await ws.send(part)                    # several frames per message

    async def main():
        assert type(asyncio.get_running_loop()) is aoprim.aio.Loop
        async with serve(handler, "127.0.0.1", 0) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}") as c:
                assert type(c.transport) is SocketTransport
                await c.send("a b c d")
                assert [await c.recv() for _ in range(4)] == ["a", "b", "c", "d"]
                payload = bytes(range(256)) * 1024
                for _ in range(5):
                    await c.send(payload)
                    assert await c.recv() == payload[::-1]
                for i in range(200):
                    await c.send(f"m{i}")
                for i in range(200):
                    assert await c.recv() == f"m{i}"

    aoprim.aio.run(main())
