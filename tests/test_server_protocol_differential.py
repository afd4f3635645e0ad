"""serve_protocol against asyncio itself: the same Protocol class on asyncio's own loop
(``loop.create_server``) and on serve_protocol, the same client, and the callback sequence
each one saw must be the same -- abort in connection_made, abort in data_received, close
with nothing to write, close with data pending, the peer's EOF (eof_received returning
false and true), the peer's reset.  Both Layer 1 backends, with and without workers."""
import asyncio
import socket
import struct
import threading

import pytest

from aoprim.server import serve_protocol
from aoprim.server.loop import BACKENDS

from test_server_support import HOST, assert_no_leaks, open_fds, recv_until_closed, wait_for

pytestmark = pytest.mark.timeout(60)

BIG = 4 << 20       # written before close(): more than the socket buffers take at once


class Recorder(asyncio.Protocol):
    """Written the usual asyncio way (the transport dropped in connection_lost); records
    every callback, and the end of the ones that act, in order.  ``plan`` says what to do."""

    def __init__(self, plan, log, done):
        self.plan = plan
        self.log = log
        self.done = done
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport
        self.log.append("made")
        if self.plan == "abort-in-made":
            transport.abort()
        self.log.append(("made-end", self.transport.is_closing()))

    def data_received(self, data):
        if self.log and type(self.log[-1]) is tuple and self.log[-1][0] == "data":
            self.log[-1] = ("data", self.log[-1][1] + data)     # however the reads split
        else:
            self.log.append(("data", data))
        if not data.endswith(b"!"):
            return
        t = self.transport
        if self.plan == "abort-in-data":
            t.abort()
        elif self.plan == "close-nothing-pending":
            t.close()
        elif self.plan == "close-data-pending":
            t.write(b"z" * BIG)
            t.close()
        # the transport is still ours here (AttributeError if connection_lost ran inside)
        self.log.append(("data-end", self.transport.is_closing()))

    def eof_received(self):
        self.log.append("eof")
        if self.plan == "eof-keep-open":
            self.transport.write(b"after eof")
            self.transport.close()
            return True
        if self.plan == "eof-write":
            self.transport.write(b"bye")
        return None

    def connection_lost(self, exc):
        self.log.append(("lost", None if exc is None else type(exc).__name__))
        self.transport = None
        self.done.set()


class BufferedRecorder(asyncio.BufferedProtocol):
    """The same, as a BufferedProtocol: its bytes come through get_buffer/buffer_updated."""

    def __init__(self, plan, log, done):
        self.rec = Recorder(plan, log, done)
        self.buf = bytearray(1000)

    def connection_made(self, transport):
        self.rec.connection_made(transport)

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, nbytes):
        self.rec.data_received(bytes(self.buf[:nbytes]))

    def eof_received(self):
        return self.rec.eof_received()

    def connection_lost(self, exc):
        self.rec.connection_lost(exc)


def _client(address, plan):
    """Drive one connection by ``plan``; returns what the client received."""
    c = socket.create_connection(address, timeout=10)
    try:
        if plan == "abort-in-made":
            return recv_until_closed(c)[0]
        if plan in ("eof", "eof-write", "eof-keep-open"):
            c.sendall(b"hello")
            c.shutdown(socket.SHUT_WR)
            return recv_until_closed(c)[0]
        if plan == "reset":
            c.sendall(b"hello")
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return b""
        c.sendall(b"hello!")
        got = recv_until_closed(c, limit=BIG + 1)[0]
        return got
    finally:
        c.close()


def _run_asyncio(plan, cls):
    log, done = [], threading.Event()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    async def main():
        srv = await loop.create_server(lambda: cls(plan, log, done), HOST, 0)
        box["addr"] = srv.sockets[0].getsockname()
        box["srv"] = srv
        started.set()

    def run():
        loop.run_until_complete(main())
        loop.run_forever()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    assert started.wait(10)
    try:
        got = _client(box["addr"], plan)
        assert done.wait(10), f"asyncio: no connection_lost ({log})"
    finally:
        loop.call_soon_threadsafe(box["srv"].close)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        loop.close()
    return log, got


def _run_aoprim(plan, cls, backend, workers):
    log, done = [], threading.Event()
    fds = open_fds()
    srv = serve_protocol(lambda: cls(plan, log, done), HOST, 0, backend=backend,
                         workers=workers)
    try:
        got = _client(srv.address, plan)
        assert done.wait(10), f"aoprim: no connection_lost ({log})"
        wait_for(lambda: srv.stats()["connections"] == 0)
        st = srv.stats()
        assert st["rx_slots_in_use"] == 1 and st["rx_raw_slots_in_use"] == 1, st
    finally:
        srv.shutdown(timeout=15)
    assert_no_leaks(srv, fds)
    return log, got


PLANS = ["abort-in-made", "abort-in-data", "close-nothing-pending", "close-data-pending",
         "eof", "eof-write", "eof-keep-open", "reset"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [Recorder, BufferedRecorder], ids=["Protocol", "Buffered"])
@pytest.mark.parametrize("plan", PLANS)
def test_callback_sequence_matches_asyncio(plan, cls, backend, workers):
    want, want_got = _run_asyncio(plan, cls)
    log, got = _run_aoprim(plan, cls, backend, workers)
    assert log == want
    assert got == want_got
    # the sequence itself, spelt out (what asyncio did, checked above, is this)
    assert log[0] == "made" and log[-1][0] == "lost"
    assert sum(1 for e in log if e[0] == "lost") == 1
