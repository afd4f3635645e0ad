"""The asyncio baseline echo servers, written the way users write them.

    python echo_asyncio.py --port 0 --framing raw|u16|u32 [--loop asyncio|uvloop|aio] [--uvloop]
                           [--certfile F --keyfile F]

``raw``: ``data_received`` -> ``transport.write(data)``.
``u16``: ``data_received`` appends to a buffer, cuts out every complete u16-framed message
and calls ``transport.write`` once per frame (as game servers do).  ``u32``: the same with a
4-byte length (the large-frame echo).
``--loop``: the event loop it runs on -- asyncio's default, uvloop, or aoprim's asyncio loop
(``aoprim.aio.new_event_loop()``); ``--uvloop`` is ``--loop uvloop``.
``--certfile/--keyfile``: serve TLS (``create_server(ssl=ctx)``, ``ctx`` from
``ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)`` with that key and certificate).
Prints ``listening on HOST:PORT``; SIGINT/SIGTERM stop it (exit 0).

Run as a script (by path): it imports nothing from aoprim unless ``--loop aio``.
"""
import argparse
import asyncio
import signal
import ssl
import struct
import sys

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(data)


class FramedEcho(asyncio.Protocol):
    header = _U16

    def connection_made(self, transport):
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data):
        self.buf += data
        write_frames(self.buf, self.transport.write, self.header)


class FramedEcho32(FramedEcho):
    header = _U32


def write_frames(buf, write, header=_U16):
    """Cut every complete frame (``header``: the length's struct, u16 or u32; header
    included) off the front of ``buf`` and ``write`` each one separately -- one write per
    frame, as such servers are written."""
    pos = 0
    end = len(buf)
    hs = header.size
    unpack = header.unpack_from
    while end - pos >= hs:
        (n,) = unpack(buf, pos)
        if end - pos - hs < n:
            break
        write(bytes(buf[pos:pos + hs + n]))
        pos += hs + n
    del buf[:pos]


async def main(args):
    loop = asyncio.get_running_loop()
    proto = {"raw": Echo, "u16": FramedEcho, "u32": FramedEcho32}[args.framing]
    ctx = None
    if args.certfile:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(args.certfile, args.keyfile)
    server = await loop.create_server(proto, args.host, args.port, ssl=ctx)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    await server.wait_closed()


def cli(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--framing", choices=("raw", "u16", "u32"), default="raw")
    p.add_argument("--loop", choices=("asyncio", "uvloop", "aio"), default="asyncio")
    p.add_argument("--uvloop", action="store_true", help="the same as --loop uvloop")
    p.add_argument("--certfile", help="serve TLS with this certificate (PEM)")
    p.add_argument("--keyfile", help="the certificate's private key (PEM)")
    a = p.parse_args(argv)
    if a.uvloop:
        a.loop = "uvloop"
    try:
        if a.loop == "uvloop":
            import uvloop
            uvloop.install()
            asyncio.run(main(a))
        elif a.loop == "aio":
            import aoprim.aio
            loop = aoprim.aio.new_event_loop()
            try:
                loop.run_until_complete(main(a))
            finally:
                loop.close()
        else:
            asyncio.run(main(a))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(cli())
