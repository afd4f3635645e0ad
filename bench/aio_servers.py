"""The asyncio servers of bench/aio_compare.py: the same code on three loops.

    python bench/aio_servers.py --loop asyncio|uvloop|aoprim --app APP [--port 0]

Apps (written as users write asyncio code; nothing here knows which loop runs it):
  raw          Protocol: data_received -> transport.write(data)         (aoprim.benchmarks.echo_asyncio.Echo)
  proto-u16    Protocol: one transport.write per complete u16 frame     (aoprim.benchmarks.echo_asyncio.FramedEcho)
  streams-u16  start_server: writer.write per complete u16 frame, await writer.drain() per read
  aiohttp      aiohttp.web: GET / -> "Hello, World!" (HTTP/1.1 keep-alive), no access log

Prints ``listening on HOST:PORT``; SIGINT/SIGTERM stop it (exit 0).
"""
import argparse
import asyncio
import signal
import sys

from aoprim.benchmarks.echo_asyncio import Echo, FramedEcho, write_frames  # the project's asyncio echo servers


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
    if args.app == "streams-u16":
        server = await asyncio.start_server(streams_u16, args.host, args.port)
    else:
        proto = Echo if args.app == "raw" else FramedEcho
        server = await loop.create_server(proto, args.host, args.port)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening on {host}:{port}", flush=True)
    await stop.wait()
    server.close()
    await server.wait_closed()


async def main(args):
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(args, stop)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--loop", choices=("asyncio", "uvloop", "aoprim"), default="asyncio")
    p.add_argument("--app", choices=("raw", "proto-u16", "streams-u16", "aiohttp"),
                   default="raw")
    a = p.parse_args()
    if a.loop == "uvloop":
        import uvloop
        run = uvloop.run
    elif a.loop == "aoprim":
        import aoprim.aio
        run = aoprim.aio.run
    else:
        run = asyncio.run
    try:
        run(main(a))
    except KeyboardInterrupt:
        pass
    sys.exit(0)
