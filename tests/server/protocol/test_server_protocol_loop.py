"""serve_protocol against asyncio's own loop where a protocol leans on the loop itself:
``set_write_buffer_limits`` called from a worker's callback, async generators finalized
(``aclose`` after a broken ``async for``, those alive at shutdown), the contextvars context
of the code that started the server, callbacks queued by one delivery running before the
next, and the loop's debug mode.  Both Layer 1 backends, with and without workers."""
import asyncio
import contextvars
import decimal
import logging
import os
import re
import socket
import threading

import pytest

from server_support import HOST, recv_exact, recv_until_closed, wait_for
from protocol_support import backend, on_asyncio, serve, workers  # noqa: F401

pytestmark = pytest.mark.timeout(90)


# -- set_write_buffer_limits from any thread ----------------------------------------------

class BulkReplies(asyncio.Protocol):
    """Each request line raises the high-water mark, then answers 50000 bytes; the peer's
    EOF is answered with b"END".  Exceptions the loop reports are collected."""
    REPLY = 50000
    HIGH = 1 << 20

    def __init__(self, errors):
        self.errors = errors

    def connection_made(self, transport):
        self.t = transport
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: self.errors.append(ctx.get("exception") or ctx["message"]))

    def data_received(self, data):
        for _ in range(data.count(b"\n")):
            self.t.set_write_buffer_limits(high=self.HIGH)
            self.t.write(b"y" * self.REPLY)

    def eof_received(self):
        self.t.write(b"END")
        return False


def _ask_bulk(address, n, got):
    # one request at a time, each sent once part of the earlier replies arrived: each is
    # a callback of its own, made while the server still flushes what came before
    c = socket.create_connection(address)
    with c:
        n_read = 0
        for i in range(n):
            c.sendall(b"r\n")
            n_read += len(recv_exact(c, 10000, timeout=30))
        c.shutdown(socket.SHUT_WR)
        data, how = recv_until_closed(c, timeout=30)
        got.append((n_read + len(data), how))


@pytest.mark.parametrize("high", [1 << 20, 1000], ids=["above", "below"])
def test_set_write_buffer_limits_inside_callbacks_while_a_reply_is_flushing(serve, high):
    # (with workers the callbacks run on a worker while the loop thread flushes the earlier
    # replies: the limits reach the loop thread in order with the writes)
    errors, got = [], []
    class P(BulkReplies):
        HIGH = high

    srv = serve(lambda: P(errors))
    n, clients = 60, 6
    ths = [threading.Thread(target=_ask_bulk, args=(srv.address, n, got))
           for _ in range(clients)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not any(t.is_alive() for t in ths)
    assert errors == []
    assert got == [(n * BulkReplies.REPLY + 3, "eof")] * clients


# -- async generators are finalized as asyncio's loop does --------------------------------

class AbandonsGenerator(asyncio.Protocol):
    """A task reads an async generator until 2, breaks out and drops it, then closes; the
    generator's finally awaits, then writes a trailer.  Another generator, kept by the
    protocol and left suspended, is for the shutdown to close."""

    def __init__(self, log, kept):
        self.log, self.kept = log, kept

    def connection_made(self, transport):
        self.t = transport
        asyncio.get_running_loop().create_task(self.run())

    async def chunks(self):
        try:
            for i in range(10):
                yield i
                await asyncio.sleep(0)
        finally:
            await asyncio.sleep(0)
            self.log.append("dropped generator closed")
            self.t.write(b"trailer")

    async def kept_alive(self):
        try:
            yield 1
            yield 2
        finally:
            await asyncio.sleep(0)
            self.log.append("kept generator closed")

    async def run(self):
        async for i in self.chunks():
            if i == 2:
                break       # (CPython frees the generator here: its finalizer hook runs)
        g = self.kept_alive()
        self.kept.append(g)
        await g.__anext__()
        await asyncio.sleep(0.05)   # (a loop round-trip or two: the aclose task runs)
        self.t.close()


def _read_all(address):
    with socket.create_connection(address) as c:
        return recv_until_closed(c)


def test_async_generators_are_closed_when_dropped_and_at_shutdown(serve):
    log, kept = [], []
    assert on_asyncio(lambda: AbandonsGenerator(log, kept), _read_all) == (b"trailer", "eof")
    # (asyncio.run closed the kept one at its end)
    assert log == ["dropped generator closed", "kept generator closed"]
    log.clear()
    kept.clear()
    srv = serve(lambda: AbandonsGenerator(log, kept))
    assert _read_all(srv.address) == (b"trailer", "eof")
    assert log == ["dropped generator closed"]
    srv.shutdown(timeout=15)
    assert log == ["dropped generator closed", "kept generator closed"]


# -- the context of the code that starts the server ---------------------------------------

SERVICE = contextvars.ContextVar("SERVICE", default="<unset>")


class SeesContext(asyncio.Protocol):
    def __init__(self, seen):
        self.seen = seen

    def connection_made(self, transport):
        self.seen.append((SERVICE.get(), decimal.getcontext().prec))
        transport.close()


def test_protocols_run_in_a_copy_of_the_starters_context(serve):
    seen = []

    def start_here(start):
        # (in a context of its own: nothing is left set for the other tests)
        SERVICE.set("billing")
        decimal.getcontext().prec = 50
        return start()

    def client(address):
        with socket.create_connection(address) as c:
            return recv_until_closed(c)

    async def on_asyncio_loop():
        srv = await asyncio.get_running_loop().create_server(lambda: SeesContext(seen),
                                                             HOST, 0)
        await asyncio.to_thread(client, srv.sockets[0].getsockname())
        srv.close()

    contextvars.copy_context().run(start_here, lambda: asyncio.run(on_asyncio_loop()))
    srv = contextvars.copy_context().run(start_here, lambda: serve(lambda: SeesContext(seen)))
    client(srv.address)
    wait_for(lambda: len(seen) == 2)
    assert seen == [("billing", 50)] * 2
    assert SERVICE.get() == "<unset>"


# -- what one delivery queued runs before the next (workers=0) ----------------------------

NO_ORDER_WITH_WORKERS = ("with workers the protocol's callbacks run on a worker and the "
                         "loop's on the loop thread: no order between them (docs/server.md)")


class CountsLate(asyncio.Protocol):
    """Each data_received queues a call_soon; counts the calls made while the previous
    one's callback had not run yet."""

    def __init__(self, result):
        self.result = result
        self.pending = self.late = self.n = 0

    def data_received(self, data):
        self.n += len(data)
        self.late += self.pending > 0
        self.pending += 1
        asyncio.get_running_loop().call_soon(self.done)

    def done(self):
        self.pending -= 1

    def eof_received(self):
        self.result.set_result((self.n, self.late))


class ParsesLater(asyncio.BufferedProtocol):
    """Hands out one 1000-byte buffer and processes it in a loop callback or a woken task:
    the buffer must not be asked for again before that ran."""
    via = "call_soon"

    def __init__(self, result):
        self.result = result
        self.buf = bytearray(1000)
        self.out = bytearray()
        self.late = 0
        self.pending = 0
        self.waiter = None

    def connection_made(self, transport):
        if self.via == "task":
            asyncio.get_running_loop().create_task(self.consumer())

    def get_buffer(self, hint):
        self.late += self.pending > 0
        return self.buf

    def buffer_updated(self, n):
        self.pending += 1
        if self.via == "call_soon":
            asyncio.get_running_loop().call_soon(self.parse, n)
        else:
            self.waiter.set_result(n)       # (InvalidStateError if the consumer lags)

    def parse(self, n):
        self.pending -= 1
        self.out += self.buf[:n]

    async def consumer(self):
        while True:
            self.waiter = asyncio.get_running_loop().create_future()
            self.parse(await self.waiter)

    def eof_received(self):
        asyncio.get_running_loop().call_soon(
            self.result.set_result, (bytes(self.out), self.late))


def _send_all_at_once(address, data):
    with socket.create_connection(address) as c:
        c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        recv_until_closed(c)


def _run_until_eof(serve, factory, data):
    import concurrent.futures
    on_aio = concurrent.futures.Future()
    on_asyncio(lambda: factory(on_aio), lambda a: _send_all_at_once(a, data))
    on_aoprim = concurrent.futures.Future()
    srv = serve(lambda: factory(on_aoprim))
    _send_all_at_once(srv.address, data)
    return on_aio.result(10), on_aoprim.result(10)


def test_call_soon_in_data_received_runs_before_the_next(serve, workers):
    if workers:
        pytest.skip(NO_ORDER_WITH_WORKERS)
    data = b"x" * (4 << 20)
    on_aio, on_aoprim = _run_until_eof(serve, CountsLate, data)
    assert on_aio == (len(data), 0)
    assert on_aoprim == (len(data), 0)


@pytest.mark.parametrize("via", ["call_soon", "task"])
def test_buffer_is_processed_before_get_buffer_is_called_again(serve, workers, via):
    if workers:
        pytest.skip(NO_ORDER_WITH_WORKERS)
    data = bytes(range(256)) * 256

    class P(ParsesLater):
        pass

    P.via = via
    on_aio, on_aoprim = _run_until_eof(serve, P, data)
    assert on_aio == (data, 0)
    assert on_aoprim == (data, 0)


# -- asyncio's debug mode ------------------------------------------------------------------

class Debugged(asyncio.Protocol):
    """Reports get_debug(); with ``turn_on`` switches debug mode on with a zero slow-callback
    threshold (so every callback counts as slow), queues a loop callback, answers, closes."""
    turn_on = True

    def __init__(self, seen):
        self.seen = seen

    def connection_made(self, transport):
        self.t = transport
        loop = asyncio.get_running_loop()
        self.seen.append(loop.get_debug())
        if self.turn_on:
            loop.set_debug(True)
            loop.slow_callback_duration = 0.0
            self.seen.append(loop.get_debug())

    def data_received(self, data):
        asyncio.get_running_loop().call_soon(self.queued_callback)

    def queued_callback(self):
        self.t.write(b"ok")
        self.t.close()


def _poke(address):
    with socket.create_connection(address) as c:
        c.sendall(b"x")
        return recv_until_closed(c)


def _slow_logs(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "asyncio" and r.getMessage().startswith("Executing ")]


def test_set_debug_logs_slow_callbacks(serve, caplog):
    caplog.set_level(logging.WARNING, logger="asyncio")
    seen = []
    assert on_asyncio(lambda: Debugged(seen), _poke) == (b"ok", "eof")
    assert seen == [False, True]
    on_aio = _slow_logs(caplog)
    assert any("queued_callback" in m for m in on_aio)
    caplog.clear()
    seen.clear()
    srv = serve(lambda: Debugged(seen))
    assert _poke(srv.address) == (b"ok", "eof")
    assert seen == [False, True]
    logged = _slow_logs(caplog)
    assert any("queued_callback" in m and " took " in m for m in logged), logged
    # (the handle's source traceback ends at the protocol's own call_soon, as asyncio's)
    here = os.path.basename(__file__)
    assert any("queued_callback" in m and f"created at {here}" in m.replace(
        os.path.dirname(__file__) + os.sep, "") for m in on_aio), on_aio
    assert any("queued_callback" in m and f"created at {here}" in m.replace(
        os.path.dirname(__file__) + os.sep, "") for m in logged), logged
    assert any("data_received()" in m and " took " in m for m in logged), logged


def test_pythonasynciodebug_turns_debug_mode_on(serve, monkeypatch):
    monkeypatch.setenv("PYTHONASYNCIODEBUG", "1")

    class P(Debugged):
        turn_on = False

    seen = []
    assert on_asyncio(lambda: P(seen), _poke) == (b"ok", "eof")
    srv = serve(lambda: P(seen))
    assert _poke(srv.address) == (b"ok", "eof")
    assert seen == [True, True]


# -- write() after close() while the backlog is sent ---------------------------------------

class WritesAfterClose(asyncio.Protocol):
    """Writes 8 MiB (more than the socket takes at once: its send buffer is made small, as
    a quiet machine's loopback, its reader keeping up, could take the whole write),
    closes, then writes a trailer."""

    def connection_made(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                     65536)
        transport.write(b"a" * (8 << 20))
        transport.close()
        transport.write(b"TRAILER")


def test_write_after_close_joins_the_backlog_still_being_sent(serve):
    def client(address):
        with socket.create_connection(address) as c:
            data, how = recv_until_closed(c, timeout=30)
            return len(data), data[-7:], how

    want = (8 << 20) + 7, b"TRAILER", "eof"
    assert on_asyncio(WritesAfterClose, client) == want
    srv = serve(WritesAfterClose)
    assert client(srv.address) == want


class WritesAfterCloseNoBacklog(asyncio.Protocol):
    """A short reply, close(), then a write: the kernel took the reply at once, so there
    is no backlog for the late write to join -- asyncio drops it."""

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.t.write(b"reply;")
        self.t.close()
        self.t.write(b"WRITTEN-AFTER-CLOSE")


def test_write_after_close_with_no_backlog_is_dropped(serve):
    def client(address):
        with socket.create_connection(address) as c:
            c.sendall(b"x")
            data, how = recv_until_closed(c, timeout=30)
            return data, how

    want = b"reply;", "eof"
    assert on_asyncio(WritesAfterCloseNoBacklog, client) == want
    srv = serve(WritesAfterCloseNoBacklog)
    assert client(srv.address) == want


# -- the order of what a callback schedules: call_soon, due timers, tasks ------------------

def _schedule_plan(rnd, depth=0):
    """Random ops: ("soon", tag, sub) a loop callback, ("timer", tag, sub) a timer already
    due, ("task", tag, sub) a task; each logs its tag when it runs, then does ``sub``."""
    ops = []
    for _ in range(rnd.randint(1, 4 if depth == 0 else 2)):
        kind = rnd.choice(("soon", "timer", "task"))
        sub = _schedule_plan(rnd, depth + 1) if depth < 2 and rnd.random() < 0.4 else []
        ops.append((kind, None, sub))
    return ops


def _tag(ops, counter):
    out = []
    for kind, _, sub in ops:
        counter[0] += 1
        out.append((kind, f"{kind}{counter[0]}", _tag(sub, counter)))
    return out


def _count(ops):
    return sum(1 + _count(sub) for _, _, sub in ops)


class Schedules(asyncio.Protocol):
    """data_received does the plan; once every tag ran, the order goes to the peer.  Timers
    are due at once, each later than the one armed before it (so asyncio's heap, which
    compares deadlines only, orders them as ours does)."""

    def __init__(self, plan):
        self.plan = plan
        self.want = _count(plan)
        self.log = []
        self.k = 0

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.base = asyncio.get_running_loop().time() - 100.0
        self.run(self.plan)

    def run(self, ops):
        loop = asyncio.get_running_loop()
        for kind, tag, sub in ops:
            if kind == "soon":
                loop.call_soon(self.ran, tag, sub)
            elif kind == "timer":
                self.k += 1
                loop.call_at(self.base + self.k * 1e-3, self.ran, tag, sub)
            else:
                async def step(tag=tag, sub=sub):
                    self.ran(tag, sub)
                loop.create_task(step())

    def ran(self, tag, sub):
        self.log.append(tag)
        self.run(sub)
        if len(self.log) == self.want:
            self.t.write(" ".join(self.log).encode())
            self.t.close()


def _ask_order(address):
    with socket.create_connection(address[:2], timeout=20) as c:
        c.sendall(b"go")
        data, how = recv_until_closed(c)
        return data.decode(), how


def test_what_a_callback_schedules_runs_in_asyncios_order(serve):
    import random
    rnd = random.Random(39)
    plans = [_tag(_schedule_plan(rnd), [0]) for _ in range(30)]
    srv = serve(lambda: Schedules(plans[srv.n]))
    for i, plan in enumerate(plans):
        want = on_asyncio(lambda: Schedules(plan), _ask_order)
        assert len(want[0].split()) == _count(plan)
        srv.n = i
        assert _ask_order(srv.address) == want, plan


class BadDeadlines(asyncio.Protocol):
    """Arms timers with deadlines that are not numbers: each raises in the caller; what the
    callback schedules afterwards still runs."""

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        loop = asyncio.get_running_loop()
        got = []
        for when in ("1", b"1", object()):
            try:
                loop.call_at(when, got.append, "ran")
            except TypeError:
                got.append("TypeError")
        loop.call_at(loop.time() - 1, self.t.write, b" timer")
        loop.call_soon(self.t.write, " ".join(got).encode())
        loop.call_later(0.001, self.t.close)


def _read_reply(address):
    with socket.create_connection(address[:2], timeout=10) as c:
        c.sendall(b"x")
        return recv_until_closed(c)


def test_a_deadline_that_is_not_a_number_raises_in_the_caller(serve):
    # (asyncio's own loop takes such a deadline into its heap and then fails in its next
    # iteration, outside any callback: nothing to compare with)
    srv = serve(BadDeadlines)
    assert _read_reply(srv.address) == (b"TypeError TypeError TypeError timer", "eof")
    assert srv.stats()["handler_errors"] == 0


class ShowsHandles(asyncio.Protocol):
    """Answers with the reprs of a call_soon and a call_later handle, the deadline masked."""

    def connection_made(self, transport):
        loop = asyncio.get_running_loop()
        soon = loop.call_soon(print)
        later = loop.call_later(3600, print)
        shown = [repr(soon), repr(later)]
        soon.cancel()
        later.cancel()
        shown += [repr(soon), repr(later)]
        transport.write(re.sub(r"when=[0-9.e+-]+", "when=T", " | ".join(shown)).encode())
        transport.close()


def _read_until_eof(address):
    with socket.create_connection(address[:2], timeout=10) as c:
        return recv_until_closed(c)[0].decode()


def test_handles_show_asyncios_class_names(serve):
    want = on_asyncio(ShowsHandles, _read_until_eof)
    assert want.startswith("<Handle print()> | <TimerHandle when=T print()>")
    srv = serve(ShowsHandles)
    assert _read_until_eof(srv.address) == want
