"""The asyncio baseline echo servers, written the way users write them.

    python bench/echo_asyncio.py --port 0 --framing raw|u16 [--uvloop]

``raw``: ``data_received`` -> ``transport.write(data)``.
``u16``: ``data_received`` appends to a buffer, cuts out every complete u16-framed message
and calls ``transport.write`` once per frame (as game servers do).
Prints ``listening on HOST:PORT``; SIGINT/SIGTERM stop it (exit 0).
"""
import argparse
import asyncio
import signal
import struct
import sys

_U16 = struct.Struct(">H")


class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(data)


class FramedEcho(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data):
        buf = self.buf
        buf += data
        pos = 0
        end = len(buf)
        while end - pos >= 2:
            (n,) = _U16.unpack_from(buf, pos)
            if end - pos - 2 < n:
                break
            self.transport.write(bytes(buf[pos:pos + 2 + n]))   # one write per frame
            pos += 2 + n
        del buf[:pos]


async def main(args):
    loop = asyncio.get_running_loop()
    proto = Echo if args.framing == "raw" else FramedEcho
    server = await loop.create_server(proto, args.host, args.port)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    await server.wait_closed()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--framing", choices=("raw", "u16"), default="raw")
    p.add_argument("--uvloop", action="store_true")
    a = p.parse_args()
    if a.uvloop:
        import uvloop
        uvloop.install()
    try:
        asyncio.run(main(a))
    except KeyboardInterrupt:
        pass
    sys.exit(0)
