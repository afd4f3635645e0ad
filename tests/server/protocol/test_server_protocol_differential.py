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


# a BufferedProtocol whose buffer_updated pauses reading and has it resumed from a loop
# callback, a task, a timer or another thread, while the peer's FIN may come in the same
# read as its bytes: every byte, in order, then eof_received -- random cases, each run on
# asyncio's loop and on serve_protocol, which must agree
RESUMES = ("soon", "task", "later0", "later", "thread", "none")


class Pauser(asyncio.BufferedProtocol):
    def __init__(self, size, plan, out, done):
        self.buf = bytearray(size)
        self.plan = plan            # what the k-th buffer_updated does: RESUMES[plan[k % n]]
        self.out, self.done = out, done
        self.got = bytearray()
        self.k = 0

    def connection_made(self, transport):
        self.t = transport

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, nbytes):
        assert self.t.is_reading(), "bytes delivered while paused"
        self.got += self.buf[:nbytes]
        how = RESUMES[self.plan[self.k % len(self.plan)]]
        self.k += 1
        if how == "none":
            return
        t = self.t
        t.pause_reading()
        loop = asyncio.get_running_loop()
        if how == "soon":
            loop.call_soon(t.resume_reading)
        elif how == "task":
            async def resume():
                t.resume_reading()
            loop.create_task(resume())
        elif how == "later0":
            loop.call_later(0, t.resume_reading)
        elif how == "later":
            loop.call_later(0.002, t.resume_reading)
        else:
            threading.Thread(target=loop.call_soon_threadsafe,
                             args=(t.resume_reading,)).start()

    def eof_received(self):
        self.out.append(("eof", bytes(self.got)))
        self.t.write(struct.pack("!I", len(self.got)))

    def connection_lost(self, exc):
        self.out.append(("lost", exc))
        self.done.set()


def _pauser_client(address, payload, split):
    with socket.create_connection(address, timeout=10) as c:
        if split:
            c.sendall(payload[:split])
        c.sendall(payload[split:])
        c.shutdown(socket.SHUT_WR)
        return recv_until_closed(c)


def _pauser_case(seed):
    rnd = __import__("random").Random(seed)
    payload = rnd.randbytes(rnd.choice([1, 500, 777, 5000, 20000, 70000]))
    size = rnd.choice([1, 7, 777, 4096, 65536])
    plan = [rnd.randrange(len(RESUMES)) for _ in range(rnd.randint(1, 4))]
    split = rnd.randrange(len(payload)) if rnd.random() < 0.3 else 0
    return payload, size, plan, split


def _pausers_on_asyncio(cases):
    async def main():
        loop = asyncio.get_running_loop()
        res = []
        for payload, size, plan, split in cases:
            out, done = [], threading.Event()
            srv = await loop.create_server(lambda: Pauser(size, plan, out, done), HOST, 0)
            try:
                got = await asyncio.to_thread(_pauser_client, srv.sockets[0].getsockname(),
                                              payload, split)
                await asyncio.wait_for(asyncio.to_thread(done.wait, 10), 15)
            finally:
                srv.close()
            res.append((out, got))
        return res

    return asyncio.run(main())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_buffered_protocol_resumed_from_a_callback_gets_every_byte_before_the_eof(
        backend, workers):
    cases = [_pauser_case(seed) for seed in range(24)]
    want = _pausers_on_asyncio(cases)
    fds = open_fds()
    for (payload, size, plan, split), (want_out, want_got) in zip(cases, want):
        # (asyncio's own result first: every byte, then the EOF)
        assert want_out == [("eof", payload), ("lost", None)], (size, plan, split)
        out, done = [], threading.Event()
        srv = serve_protocol(lambda: Pauser(size, plan, out, done), HOST, 0,
                             backend=backend, workers=workers)
        try:
            got = _pauser_client(srv.address[:2], payload, split)
            assert done.wait(10), out
            wait_for(lambda: srv.stats()["connections"] == 0)
        finally:
            srv.shutdown(timeout=15)
        case = (len(payload), size, [RESUMES[i] for i in plan], split)
        assert [e[0] for e in out] == ["eof", "lost"], (case, out)
        assert len(out[0][1]) == len(payload), case
        assert out[0][1] == payload, case
        assert out[1][1] is None, case
        assert got == want_got == (struct.pack("!I", len(payload)), "eof"), case
    assert_no_leaks(srv, fds)
