"""With ``workers=N`` a connection's code runs on one thread at a time, as on asyncio's one
thread: its protocol callbacks (on a worker) and its tasks and loop callbacks (on the loop
thread) never overlap, and what a protocol callback schedules runs after it returns --
behind what it did to its transport meanwhile (a ``pause_reading``, its writes).  Each
scenario also runs on asyncio's own loop, which must agree.  Both Layer 1 backends, with and
without workers."""
import asyncio
import functools
import socket
import threading
import time

import pytest

from server_support import recv_exact
from support import run_threads
from protocol_support import backend, on_asyncio, serve, workers  # noqa: F401

pytestmark = pytest.mark.timeout(120)


class WakeThenPause(asyncio.Protocol):
    """uvicorn's flow: ``data_received`` wakes the request task (an ``Event``), then pauses
    reading; the task resumes reading.  If the task ran before the pause, reading would
    stay paused for good."""

    def connection_made(self, transport):
        self.t = transport
        self.got = 0
        self.ev = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self.reader())

    async def reader(self):
        while True:
            await self.ev.wait()
            self.ev.clear()
            self.t.resume_reading()

    def data_received(self, data):
        self.got += len(data)
        self.ev.set()
        self.t.pause_reading()
        time.sleep(0.005)               # some work: the window the task must not run in
        if self.got >= 400:
            self.t.write(b"done")
            self.t.close()

    def connection_lost(self, exc):
        self.task.cancel()


def _wake_then_pause_client(address):
    with socket.create_connection(address[:2], timeout=20) as c:
        for _ in range(4):
            c.sendall(b"x" * 100)
            time.sleep(0.02)            # separate reads, each paused and resumed
        return recv_exact(c, 4, timeout=20)


def test_a_task_woken_before_pause_reading_resumes_after_it(serve):
    assert on_asyncio(WakeThenPause, _wake_then_pause_client) == b"done"
    srv = serve(WakeThenPause)
    assert _wake_then_pause_client(srv.address) == b"done"


class WriteScheduleWrite(asyncio.Protocol):
    """``write(A)``, ``call_soon(write, B)``, ``write(C)``: asyncio's peer gets ``ACB``."""

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        loop = asyncio.get_running_loop()
        self.t.write(b"A")
        loop.call_soon(self.t.write, b"B")
        time.sleep(0.002)
        self.t.write(b"C")
        loop.call_soon(self.t.close)


def _order_client(address):
    got = []
    for _ in range(10):
        with socket.create_connection(address[:2], timeout=20) as c:
            c.sendall(b"x")
            buf = b""
            while d := c.recv(16):
                buf += d
            got.append(buf)
    return got


def test_what_data_received_schedules_runs_after_its_writes(serve):
    assert on_asyncio(WriteScheduleWrite, _order_client) == [b"ACB"] * 10
    srv = serve(WriteScheduleWrite)
    assert _order_client(srv.address) == [b"ACB"] * 10


class PingPong(asyncio.Protocol):
    """Each message wakes the connection's task through an ``Event``; the task answers it.
    ``inside`` counts the connection's code running now -- a protocol callback or a step
    of its task -- and must never be above 1; every overlap is recorded."""

    overlaps = None                     # a list shared by the test

    def connection_made(self, transport):
        self.t = transport
        self.inside = 0
        self.n = 0
        self.ev = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self.answer())

    def _enter(self, where):
        self.inside += 1
        if self.inside != 1:
            self.overlaps.append(where)

    def _leave(self):
        time.sleep(0.0002)              # a window for another thread (the GIL let go)
        self.inside -= 1

    async def answer(self):
        while True:
            await self.ev.wait()
            self._enter("task")
            self.ev.clear()
            self.t.write(b"%d;" % self.n)
            self._leave()

    def data_received(self, data):
        self._enter("data_received")
        self.n += data.count(b";")
        self.ev.set()                   # the task may run only once this returns
        self._leave()

    def connection_lost(self, exc):
        self.task.cancel()


def _ping_pong_clients(address, conns=4, rounds=150):
    results = [None] * conns

    def one(i):
        with socket.create_connection(address[:2], timeout=20) as c:
            last = b""
            for k in range(1, rounds + 1):
                c.sendall(b"m;")
                buf = b""
                while not buf.endswith(b"%d;" % k):
                    d = c.recv(4096)
                    if not d:
                        break
                    buf += d
                last = buf
            results[i] = last.rsplit(b";", 2)[-2]
    run_threads([functools.partial(one, i) for i in range(conns)], timeout=100)
    return results


def test_a_connections_callbacks_and_its_task_never_overlap(serve, workers):
    rounds = 150
    overlaps = []

    class P(PingPong):
        pass
    P.overlaps = overlaps
    assert on_asyncio(P, _ping_pong_clients) == [b"%d" % rounds] * 4
    assert overlaps == []

    srv = serve(P)
    assert _ping_pong_clients(srv.address, rounds=rounds) == [b"%d" % rounds] * 4
    assert overlaps == [], f"{len(overlaps)} overlaps, first: {overlaps[:5]}"


class PausedByItsTask(asyncio.Protocol):
    """The connection's task pauses and resumes reading, 30 times; ``data_received``
    records every delivery that comes while it is paused, or after the task closed the
    transport (``how``: "close", "abort" or None)."""

    def __init__(self, how, bad, done):
        self.how, self.bad, self.done = how, bad, done

    def connection_made(self, transport):
        self.t = transport
        self.paused = self.closed = False
        self.task = asyncio.get_running_loop().create_task(self.toggle())

    async def toggle(self):
        for _ in range(30):
            await asyncio.sleep(0.003)
            self.t.pause_reading()
            self.paused = True
            await asyncio.sleep(0.003)
            self.paused = False
            self.t.resume_reading()
        if self.how is None:
            self.t.write(b"done")
        else:
            getattr(self.t, self.how)()
            self.closed = True

    def data_received(self, data):
        if self.paused:
            self.bad.append("while paused")
        if self.closed:
            self.bad.append(f"after {self.how}()")
        time.sleep(0.0002)              # a worker kept busy: the next delivery waits

    def connection_lost(self, exc):
        self.task.cancel()
        self.done.set()


def _flood(address, until):
    """Send without pause until ``until()`` or the server closes; read what comes."""
    s = socket.create_connection(address[:2], timeout=20)
    s.setblocking(False)
    got = b""
    deadline = time.monotonic() + 20
    try:
        while not until(got) and time.monotonic() < deadline:
            try:
                s.send(b"z" * 16384)
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                d = s.recv(100)
                if d == b"":
                    break
                got += d
            except BlockingIOError:
                pass
            time.sleep(0.0005)
    finally:
        s.close()
    return got


@pytest.mark.parametrize("how", [None, "close", "abort"])
def test_nothing_is_delivered_while_its_task_paused_reading_or_after_it_closed(serve, how):
    bad, done = [], threading.Event()
    srv = serve(lambda: PausedByItsTask(how, bad, done))
    got = _flood(srv.address, lambda got: b"done" in got or done.is_set())
    assert done.wait(20) or how is None
    if how is None:
        assert b"done" in got
    assert bad == [], f"{len(bad)} deliveries: {sorted(set(bad))}"


class BufferedByItsTask(asyncio.Protocol):
    """uvicorn's flow for a large body: ``data_received`` buffers, wakes the task and pauses
    reading above 50 kB; the task echoes what is buffered and resumes reading; at EOF it
    closes."""

    def connection_made(self, transport):
        self.t = transport
        self.buf = bytearray()
        self.ev = asyncio.Event()
        self.eof = False
        self.task = asyncio.get_running_loop().create_task(self.run())

    def data_received(self, data):
        self.buf += data
        self.ev.set()
        if len(self.buf) > 50000:
            self.t.pause_reading()

    def eof_received(self):
        self.eof = True
        self.ev.set()
        return True

    async def run(self):
        while True:
            await self.ev.wait()
            self.ev.clear()
            if self.buf:
                b = bytes(self.buf)
                self.buf.clear()
                self.t.write(b)
                self.t.resume_reading()
                await asyncio.sleep(0)
            if self.eof and not self.buf:
                self.t.close()
                return


def _echo_all(address, conns=10, size=200_000):
    results = [None] * conns

    def one(i):
        data = bytes((i * 7 + k) % 251 for k in range(size))
        with socket.create_connection(address[:2], timeout=20) as s:
            def send():
                for off in range(0, size, 25_000):
                    s.sendall(data[off:off + 25_000])
                s.shutdown(socket.SHUT_WR)
            w = threading.Thread(target=send)
            w.start()
            got = bytearray()
            try:
                while d := s.recv(65536):
                    got += d
            except OSError as e:        # (a hung connection: the timeout)
                got = repr(e).encode()
            w.join(20)
        results[i] = bytes(got) == data
    run_threads([functools.partial(one, i) for i in range(conns)], timeout=60)
    return results


def test_a_pause_from_a_callback_never_lands_after_its_tasks_resume(serve):
    """A worker's pause_reading() reaches the loop thread as a posted call; the task's
    resume_reading() there takes effect at once and may come first.  The pause arriving
    late must not undo it (the connection would stay paused for good)."""
    assert on_asyncio(BufferedByItsTask, _echo_all) == [True] * 10
    srv = serve(BufferedByItsTask)
    assert _echo_all(srv.address) == [True] * 10
