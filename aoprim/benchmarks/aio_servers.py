"""The asyncio servers of the aio benchmarks: the same application code on every loop.

    python -m aoprim.benchmarks.aio_servers --loop asyncio|uvloop|rloop|aoprim --app APP
                                            [--host H] [--port 0]

Apps (written as users write asyncio code; nothing here knows which loop runs it):
  raw          Protocol: data_received -> transport.write(data)          (echo_asyncio.Echo)
  proto-u16    Protocol: one transport.write per complete u16 frame      (echo_asyncio.FramedEcho)
  streams-u16  start_server: writer.write per complete u16 frame, await writer.drain() per read
  streams-raw  start_server: writer.write(data) per read, await writer.drain() per read
  aiohttp      aiohttp.web: GET / -> "Hello, World!" (HTTP/1.1 keep-alive), no access log

The uvicorn apps (a minimal Starlette app, the SSE token stream) are ASGI apps in
``aoprim.benchmarks.aio_asgi``, served by uvicorn's own command line (``--loop``).

Prints ``listening on HOST:PORT``; SIGINT/SIGTERM stop it (exit 0).  Run it as
``python -m aoprim.benchmarks.aio_servers --loop asyncio|uvloop|rloop|aoprim --app APP
[--port 0]``; the repository's bench/ scripts start it so.
"""
import argparse
import asyncio
import signal
import sys

from aoprim.benchmarks.echo_asyncio import Echo, FramedEcho, write_frames

__all__ = ["APPS", "LOOPS", "loop_runner", "main"]

APPS = ("raw", "proto-u16", "streams-u16", "streams-raw", "aiohttp")
LOOPS = ("asyncio", "uvloop", "rloop", "aoprim")


async def streams_u16(reader, writer):
    buf = bytearray()
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
            write_frames(buf, writer.write)             # one writer.write per frame
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


async def streams_raw(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


async def serve(args, stop):
    loop = asyncio.get_running_loop()
    if args.app == "aiohttp":
        from aiohttp import web

        async def hello(request):
            return web.Response(text="Hello, World!")
        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]
        print(f"listening on {host}:{port}", flush=True)
        await stop.wait()
        await runner.cleanup()
        return
    if args.app.startswith("streams-"):
        handler = streams_u16 if args.app == "streams-u16" else streams_raw
        server = await asyncio.start_server(handler, args.host, args.port)
    else:
        proto = Echo if args.app == "raw" else FramedEcho
        server = await loop.create_server(proto, args.host, args.port)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening on {host}:{port}", flush=True)
    await stop.wait()
    server.close()
    await server.wait_closed()


async def _main(args):
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(args, stop)


def loop_runner(name):
    """``run(coro)`` on the named loop (``aoprim`` and ``aoprim.aio`` are the same)."""
    if name == "uvloop":
        import uvloop
        return uvloop.run
    if name == "rloop":
        import rloop
        return lambda coro: _run_with(rloop.new_event_loop, coro)
    if name in ("aoprim", "aoprim.aio"):
        import aoprim.aio
        return aoprim.aio.run
    return asyncio.run


def _run_with(factory, coro):
    """asyncio.run(coro) on a loop from ``factory``."""
    with asyncio.Runner(loop_factory=factory) as r:
        return r.run(coro)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m aoprim.benchmarks.aio_servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--loop", choices=LOOPS + ("aoprim.aio",), default="asyncio")
    p.add_argument("--app", choices=APPS, default="raw")
    a = p.parse_args(argv)
    try:
        loop_runner(a.loop)(_main(a))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
