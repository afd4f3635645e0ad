"""Real asyncio applications, unchanged, on aoprim.aio: an aiohttp web application and a
websockets server, each serving its own library's client; redis-py's asyncio client against a
real redis-server (10,000 pipelined commands, pub/sub in order, a 12 MiB value); httpx (anyio)
against an aiohttp server.  The last two run on asyncio's loop too, as the baseline."""
import asyncio

import pytest

import aoprim.aio
from aoprim.aio import SocketTransport

pytestmark = pytest.mark.timeout(60)


async def serve_app(app):
    """Start an aiohttp ``app`` on a free local port: (its runner, the port)."""
    from aiohttp import web
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


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
        runner, port = await serve_app(app)
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


# -- redis-py's asyncio client against a real redis-server (Debian package redis-server) ----

LOOPS = {"aoprim": aoprim.aio.new_event_loop, "asyncio": asyncio.new_event_loop}


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of its own on a unix socket in tmp_path; its socket path."""
    import shutil
    import subprocess
    import time
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is absent (Debian: apt-get install -y redis-server)")
    sock = tmp_path / "redis.sock"
    p = subprocess.Popen([exe, "--port", "0", "--unixsocket", str(sock), "--save", "",
                          "--appendonly", "no", "--dir", str(tmp_path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():            # ready once its socket exists (polled)
            assert p.poll() is None and time.monotonic() < deadline, "redis-server died"
            time.sleep(0.01)
        yield str(sock)
    finally:
        p.terminate()
        p.wait(10)


@pytest.mark.parametrize("loop", LOOPS)
def test_redis_pipeline_pubsub_and_large_value(redis_server, loop):
    redis = pytest.importorskip("redis.asyncio")
    n = 10_000
    big = bytes(range(251)) * (12 * 1024 * 1024 // 251 + 1)
    big = big[:12 * 1024 * 1024]                                  # 12 MiB

    async def main():
        r = redis.Redis(unix_socket_path=redis_server)
        sub = redis.Redis(unix_socket_path=redis_server)
        try:
            async with r.pipeline(transaction=False) as pipe:
                for i in range(n):
                    pipe.set(f"k{i}", f"v{i}")
                    pipe.get(f"k{i}")
                replies = await pipe.execute()
            assert replies == [x for i in range(n) for x in (True, f"v{i}".encode())]
            assert await r.incrby("counter", n) == n

            ps = sub.pubsub()
            await ps.subscribe("chan")
            assert (await ps.get_message(timeout=10))["type"] == "subscribe"
            for i in range(1000):
                assert await r.publish("chan", b"m%d" % i) == 1
            for i in range(1000):
                msg = None
                while msg is None:
                    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=10)
                assert msg["data"] == b"m%d" % i
            await ps.aclose()

            assert await r.set("big", big)
            assert await r.get("big") == big
            return type(asyncio.get_running_loop())
        finally:
            await r.aclose()
            await sub.aclose()

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        cls = runner.run(main())
    assert (cls is aoprim.aio.Loop) == (loop == "aoprim")


# -- httpx (anyio) client against an aiohttp server, both on the loop ------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_httpx_client_against_aiohttp_server(loop):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("aiohttp")
    from aiohttp import web
    big = bytes(range(251)) * (8 * 1024 * 1024 // 251)

    async def echo(request):
        return web.Response(body=await request.read())

    async def hello(request):
        return web.Response(text="hi " + request.match_info["n"])

    async def main():
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/hi/{n}", hello)
        app.router.add_post("/echo", echo)
        runner, port = await serve_app(app)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=30) as c:
                for i in range(200):
                    r = await c.get(f"/hi/{i}")
                    assert r.text == f"hi {i}"
                rs = await asyncio.gather(*[c.get(f"/hi/g{i}") for i in range(50)])
                assert [r.text for r in rs] == [f"hi g{i}" for i in range(50)]
                r = await c.post("/echo", content=big)
                assert r.content == big
        finally:
            await runner.cleanup()
        return type(asyncio.get_running_loop())

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        cls = runner.run(main())
    assert (cls is aoprim.aio.Loop) == (loop == "aoprim")
