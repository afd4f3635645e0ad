"""serve_protocol against asyncio itself: the same Protocol class on asyncio's own loop
(``loop.create_server``) and on serve_protocol, the same client, and the callback sequence
each one saw must be the same -- abort in connection_made, abort in data_received, close
with nothing to write, close with data pending, the peer's EOF (eof_received returning
false and true), the peer's reset; a BufferedProtocol with small buffers that pauses, closes
or aborts inside buffer_updated.  Both Layer 1 backends, with and without workers."""
import asyncio
import socket
import struct
import threading

import pytest

from aoprim.server import serve_protocol
from aoprim.server.loop import BACKENDS

from server_support import HOST, assert_no_leaks, open_fds, recv_until_closed, wait_for

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


# -- BufferedProtocol: pause / close / abort inside buffer_updated, small buffers ----------
# asyncio reads only what get_buffer() hands out; aoprim delivers a chunk it read in several
# buffer_updated calls -- and must stop the moment the protocol pauses, closes or aborts:
# nothing more of the chunk until resume_reading() (pause) or ever (close/abort)
PAYLOAD = b"0123456789abcdef"
PAUSE_FOR = threading.Event()       # never set: a bounded wait


class SmallBuffers(asyncio.BufferedProtocol):
    """Hands out 4-byte buffers; on the first buffer_updated does ``plan`` ("pause": resumed
    from another thread via ``resume``, which logs "resume" first).  Logs every update with
    is_reading/is_closing; once the whole payload came, writes b"ok" and closes."""

    def __init__(self, plan, log, done, resume):
        self.plan, self.log, self.done, self.resume = plan, log, done, resume
        self.buf = bytearray(4)
        self.got = b""

    def connection_made(self, transport):
        self.t = transport

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, nbytes):
        data = bytes(self.buf[:nbytes])
        self.got += data
        self.log.append(("upd", data, self.t.is_reading(), self.t.is_closing()))
        if len(self.log) == 1:
            if self.plan == "pause":
                self.t.pause_reading()
                threading.Thread(target=self._resume_later, daemon=True).start()
            else:
                getattr(self.t, self.plan)()
        elif self.got == PAYLOAD:
            self.t.write(b"ok")
            self.t.close()

    def _resume_later(self):
        # the pause lasts a while (what the test checks is that nothing comes meanwhile:
        # the rest of the chunk would otherwise follow within the same call)
        PAUSE_FOR.wait(0.3)
        self.resume(self.t)

    def eof_received(self):
        self.log.append("eof")

    def connection_lost(self, exc):
        self.log.append("lost")
        self.done.set()


def _drive(address):
    c = socket.create_connection(address, timeout=10)
    try:
        c.sendall(PAYLOAD)
        got = b""
        while True:
            b = c.recv(100)
            if not b:
                return got
            got += b
    except ConnectionResetError:
        return got
    finally:
        c.close()


def _buffered_on_asyncio(plan):
    log, done = [], threading.Event()

    async def main():
        loop = asyncio.get_running_loop()

        def resume(t):          # another thread: asyncio's transport is not thread-safe
            loop.call_soon_threadsafe(lambda: (log.append("resume"), t.resume_reading()))

        srv = await loop.create_server(lambda: SmallBuffers(plan, log, done, resume), HOST, 0)
        try:
            got = await asyncio.to_thread(_drive, srv.sockets[0].getsockname())
            await asyncio.wait_for(asyncio.to_thread(done.wait, 10), 15)
        finally:
            srv.close()
        return got

    return log, asyncio.run(main())


def _buffered_on_aoprim(plan, backend, workers):
    log, done = [], threading.Event()

    def resume(t):
        log.append("resume")
        t.resume_reading()

    fds = open_fds()
    srv = serve_protocol(lambda: SmallBuffers(plan, log, done, resume), HOST, 0,
                         backend=backend, workers=workers)
    try:
        got = _drive(srv.address[:2])
        assert done.wait(10), log
        wait_for(lambda: srv.stats()["connections"] == 0)
    finally:
        srv.shutdown(timeout=15)
    assert_no_leaks(srv, fds)
    return log, got


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plan", ["pause", "close", "abort"])
def test_buffered_protocol_stops_inside_the_chunk_as_asyncio(plan, backend, workers):
    want, want_got = _buffered_on_asyncio(plan)
    log, got = _buffered_on_aoprim(plan, backend, workers)
    assert log == want
    assert got == want_got
    if plan == "pause":
        # every byte, in order, the rest only after the resume, never while paused
        assert log[1] == "resume"
        assert b"".join(e[1] for e in log if type(e) is tuple) == PAYLOAD
        assert all(e[2] for e in log if type(e) is tuple)
        assert got == b"ok"
    else:
        assert [e for e in log if type(e) is tuple] == [("upd", b"0123", True, False)]
