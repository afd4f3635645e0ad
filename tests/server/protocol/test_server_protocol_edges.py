"""serve_protocol at the edges an asyncio protocol relies on, each checked against what
asyncio's own loop does: several writes in one callback past ``max_pending`` (sent whole),
``pause_writing`` only for a backlog the socket did not take, ``set_write_buffer_limits``
never resuming, one ``contextvars.Context`` per connection, timers cancelled from a worker
leaving the heap, tasks cancelled at shutdown, a bounded default executor, exceptions
routed to the loop's exception handler, ``is_reading()`` after a close, ``get_buffer``'s
size hint.  Both Layer 1 backends, with and without workers."""
import asyncio
import contextvars
import gc
import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from aoprim.server.adapters.asyncio_protocol import _Timer

from server_support import HOST, recv_exact, recv_until_closed, wait_for
from protocol_support import backend, on_asyncio, serve, workers  # noqa: F401
from tlscerts import tls_certs  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)




# -- writes in one callback are not cut before pause_writing ------------------------------

class Reply(asyncio.Protocol):
    """Answers the first bytes with ``parts`` written one by one, then closes."""
    parts = ()

    def __init__(self, log, done):
        self.log, self.done = log, done

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        for p in self.parts:
            self.t.write(p)
        self.t.close()

    def pause_writing(self):
        self.log.append("pause")

    def resume_writing(self):
        self.log.append("resume")

    def connection_lost(self, exc):
        self.log.append(("lost", exc))
        self.done.set()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("shape", ["head-body-end", "chunks"])
def test_several_writes_past_max_pending_in_one_callback_reach_the_peer_whole(serve, shape,
                                                                             tls, tls_certs):
    # an HTTP response (head, a large body, its terminator) or a file in 64 KiB chunks,
    # written in one data_received and closed: asyncio buffers all of it, whatever
    # pause_writing said meanwhile, and the peer reads every byte
    log, done = [], threading.Event()

    class P(Reply):
        if shape == "head-body-end":
            parts = (b"HEAD", b"x" * (4 << 20), b"END")
        else:
            parts = tuple(bytes([65 + i % 26]) * 65536 for i in range(64))

    want = b"".join(P.parts)
    srv = serve(lambda: P(log, done), max_pending=1 << 20,
                **({"ssl": tls_certs.server_ctx()} if tls else {}))
    c = socket.create_connection(srv.address[:2], timeout=10)
    if tls:
        c = tls_certs.client_ctx().wrap_socket(c, server_hostname="localhost")
    c.sendall(b"GET")
    got, how = recv_until_closed(c, limit=len(want) + 1)
    c.close()
    assert (len(got), how) == (len(want), "eof") and got == want
    assert done.wait(10) and log[-1] == ("lost", None), log


# -- pause_writing only for what the socket did not take -----------------------------------

class BigReplies(asyncio.Protocol):
    """One 100 kB reply (above the 64 KiB high-water mark) per request byte."""

    def __init__(self, log):
        self.log = log

    def connection_made(self, transport):
        self.t = transport
        # room for a whole reply in the kernel: the socket takes each one at once
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                     1 << 20)

    def data_received(self, data):
        for _ in data:
            self.t.write(b"r" * 100_000)

    def pause_writing(self):
        self.log.append("pause")

    def resume_writing(self):
        self.log.append("resume")


def _ask_replies(address, n=20, client_ctx=None):
    c = socket.create_connection(address[:2], timeout=10)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    if client_ctx is not None:
        c = client_ctx.wrap_socket(c, server_hostname="localhost")
    try:
        for _ in range(n):
            c.sendall(b"q")
            assert len(recv_exact(c, 100_000)) == 100_000
    finally:
        c.close()
    return n


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_pause_writing_only_for_a_backlog_the_socket_did_not_take(serve, tls, tls_certs):
    # over TLS too: asyncio encrypts a write and hands it to the socket inside write(), so
    # one reply above the high mark to a peer that reads it is no backlog
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    ask = (lambda a: _ask_replies(a, client_ctx=tls_certs.client_ctx())) if tls else _ask_replies
    asyncio_log = []
    assert on_asyncio(lambda: BigReplies(asyncio_log), ask, **kw) == 20
    log = []
    srv = serve(lambda: BigReplies(log), **kw)
    assert ask(srv.address) == 20
    assert log == asyncio_log == []


def test_set_write_buffer_limits_pauses_but_never_resumes_by_itself(serve, workers):
    # asyncio's set_write_buffer_limits() may call pause_writing(), never resume_writing():
    # that waits for the drain to reach the low mark
    def run(address):
        c = socket.create_connection(address[:2], timeout=10)
        c.sendall(b"x")
        got = recv_exact(c, 8 << 20)
        c.close()
        return len(got)

    class P(asyncio.Protocol):
        def __init__(self, log):
            self.log = log

        def connection_made(self, transport):
            self.t = transport
            # a small send buffer: a quiet machine's loopback can take the whole 8 MiB
            # into the client's receive buffer, leaving no backlog for the limits to see
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                         socket.SO_SNDBUF, 65536)

        def pause_writing(self):
            self.log.append("pause")

        def resume_writing(self):
            self.log.append("resume")

        def data_received(self, data):
            self.t.set_write_buffer_limits(high=64 << 20)
            self.t.write(b"z" * (8 << 20))
            self.log.append("written")
            self.t.set_write_buffer_limits(high=1000)
            self.log.append("lowered")
            self.t.set_write_buffer_limits(high=64 << 20)
            self.log.append("raised")

    want = []
    assert on_asyncio(lambda: P(want), run) == 8 << 20
    assert want == ["written", "pause", "lowered", "raised", "resume"]
    log = []
    srv = serve(lambda: P(log))
    assert run(srv.address) == 8 << 20
    if workers == 0:
        wait_for(lambda: log[-1:] == ["resume"], what=f"resume_writing ({log})")
        assert log == want
    else:
        # a worker's write reaches the loop thread's batch later: whether it is still
        # there when the limits change is a race, and the drain's resume_writing comes from
        # the loop thread any time after the pause (even while data_received still runs on
        # the worker: with workers the two threads' callbacks are not ordered, as
        # docs/server.md says); at most one pause, and its resume after it
        wait_for(lambda: "raised" in log and log.count("pause") == log.count("resume"),
                 what=f"the drain ({log})")
        assert [e for e in log if e not in ("pause", "resume")] == \
            ["written", "lowered", "raised"], log
        assert log.count("pause") <= 1, log
        if "pause" in log:
            assert log.index("pause") < log.index("resume"), log


# -- one contextvars.Context per connection -----------------------------------------------

USER = contextvars.ContextVar("user", default=None)


class SetsUser(asyncio.Protocol):
    """Reports the user it sees before setting it, and what a task it starts sees."""

    def __init__(self, log):
        self.log = log

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        name = data.decode()
        before = USER.get()
        USER.set(name)
        asyncio.get_running_loop().create_task(self.report(name, before))

    async def report(self, name, before):
        self.log.append((name, before, USER.get()))
        self.t.write(b"k")


def test_each_connection_has_its_own_context(serve):
    def run(address):
        a = socket.create_connection(address[:2], timeout=10)
        b = socket.create_connection(address[:2], timeout=10)
        for sock, name in ((a, b"alice"), (b, b"bob"), (a, b"carol"), (b, b"dave")):
            sock.sendall(name)
            recv_exact(sock, 1)
        a.close()
        b.close()
        return True

    want = []
    assert on_asyncio(lambda: SetsUser(want), run)
    log = []
    srv = serve(lambda: SetsUser(log))
    assert run(srv.address)
    assert log == want == [("alice", None, "alice"), ("bob", None, "bob"),
                           ("carol", "alice", "carol"), ("dave", "bob", "dave")]


# -- a timer cancelled from a worker leaves the heap -----------------------------------------

class IdleTimer(asyncio.Protocol):
    """The usual idle timer: cancelled and armed again for every request."""

    def connection_made(self, transport):
        self.t = transport
        self.h = None

    def data_received(self, data):
        if self.h is not None:
            self.h.cancel()
        self.h = asyncio.get_running_loop().call_later(3600, self.t.close)
        self.t.write(data)


def _timers():
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is _Timer)


def test_cancelled_timers_do_not_stay_until_their_deadline(serve):
    srv = serve(IdleTimer)
    c = socket.create_connection(srv.address[:2], timeout=10)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = 2000
    for _ in range(n):
        c.sendall(b"m")
        assert recv_exact(c, 1) == b"m"
    # every handle but the last one was cancelled (with workers, on a worker thread)
    wait_for(lambda: _timers() <= 1, what="the cancelled timers to be dropped")
    c.close()


# -- the server's shutdown cancels the protocols' tasks ------------------------------------

def test_shutdown_cancels_pending_tasks_and_lets_them_finish(serve):
    log = []
    started = threading.Event()

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            asyncio.get_running_loop().create_task(self.ticker())

        async def ticker(self):
            try:
                started.set()
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                log.append("cancelled")
                await asyncio.sleep(0)      # its cancellation may await
                log.append("cleaned up")
                raise

        def connection_lost(self, exc):
            log.append(("lost", exc))

    srv = serve(P, shutdown_timeout=5)
    c = socket.create_connection(srv.address[:2], timeout=10)
    assert started.wait(10)
    srv.shutdown(timeout=15)
    c.close()
    assert log == [("lost", None), "cancelled", "cleaned up"]


# -- the default executor is bounded ---------------------------------------------------------

def test_to_thread_runs_on_a_bounded_pool_shut_down_with_the_server(serve):
    calls = 60
    cap = min(32, (os.cpu_count() or 1) + 4)
    release = threading.Event()
    running, results, lock = [0], [], threading.Lock()
    peak = [0]

    def work(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(20)
        with lock:
            running[0] -= 1
        return i

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport

        def data_received(self, data):
            for i in range(calls):
                asyncio.get_running_loop().create_task(self.call(i))

        async def call(self, i):
            results.append(await asyncio.to_thread(work, i))

    srv = serve(P)
    c = socket.create_connection(srv.address[:2], timeout=10)
    c.sendall(b"go")
    wait_for(lambda: running[0] == min(cap, calls), what="the pool's threads to start")
    pool = [t for t in threading.enumerate() if t.name.startswith("aoprim-protocol-executor")]
    assert len(pool) == min(cap, calls)
    release.set()
    wait_for(lambda: len(results) == calls, what="every call to finish")
    assert sorted(results) == list(range(calls)) and peak[0] == min(cap, calls)
    c.close()
    srv.shutdown(timeout=15)
    assert not any(t.is_alive() for t in pool)


def test_set_default_executor_is_used(serve):
    names = []
    mine = ThreadPoolExecutor(1, thread_name_prefix="mine")

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            asyncio.get_running_loop().set_default_executor(mine)

        def data_received(self, data):
            asyncio.get_running_loop().create_task(self.call())

        async def call(self):
            names.append(await asyncio.to_thread(lambda: threading.current_thread().name))
            self.t.write(b"k")

    srv = serve(P)
    c = socket.create_connection(srv.address[:2], timeout=10)
    c.sendall(b"go")
    assert recv_exact(c, 1) == b"k"
    c.close()
    assert len(names) == 1 and names[0].startswith("mine")
    with pytest.raises(TypeError, match="ThreadPoolExecutor"):
        srv.handler._loop.set_default_executor(object())
    mine.shutdown()


# -- exceptions go to the loop's exception handler -----------------------------------------

class Raises(asyncio.Protocol):
    """Sets the loop's exception handler; raises where ``where`` says."""

    def __init__(self, where, seen, done):
        self.where, self.seen, self.done = where, seen, done

    def connection_made(self, transport):
        self.t = transport
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: self.seen.append((ctx["message"], repr(ctx.get("exception")))))

    def data_received(self, data):
        if self.where == "data_received":
            raise ValueError("bad request")
        if self.where == "call_soon":
            asyncio.get_running_loop().call_soon(self.fail)
            self.t.close()
        if self.where == "connection_lost":
            self.t.close()
        if self.where == "task":
            asyncio.get_running_loop().create_task(self.fail_later())   # (never awaited)
            self.t.close()

    async def fail_later(self):
        raise ValueError("in a task")

    def fail(self):
        raise ValueError("in a callback")

    def eof_received(self):
        if self.where == "eof_received":
            raise ValueError("at eof")

    def connection_lost(self, exc):
        self.seen.append(("lost", repr(exc)))
        self.done.set()
        if self.where == "connection_lost":
            raise ValueError("in connection_lost")


def _poke(address, eof):
    c = socket.create_connection(address[:2], timeout=10)
    c.sendall(b"x")
    if eof:
        c.shutdown(socket.SHUT_WR)
    recv_until_closed(c)
    c.close()
    return True


@pytest.mark.parametrize("where", ["data_received", "eof_received", "call_soon",
                                   "connection_lost", "task"])
def test_exceptions_reach_the_loops_exception_handler(serve, where):
    def normalise(seen):
        # (asyncio names the callback object in the message: compare its start)
        return [(m.split(" <")[0].split(" ")[0:3] if m.startswith("Exception in callback")
                 else m, e) for m, e in seen]

    want, done = [], threading.Event()
    on_asyncio(lambda: Raises(where, want, done), lambda a: _poke(a, where == "eof_received"))
    assert done.wait(10)
    # ("Task exception was never retrieved": when the task is freed, maybe by the GC)
    wait_for(lambda: gc.collect() >= 0 and len(want) == 2, what="asyncio's handler")
    seen, done = [], threading.Event()
    srv = serve(lambda: Raises(where, seen, done))
    _poke(srv.address, where == "eof_received")
    assert done.wait(10)
    wait_for(lambda: gc.collect() >= 0 and len(seen) == 2, what="the exception handler")
    if where == "task":
        # (when the task is freed -- before or after connection_lost -- is the GC's)
        seen.sort()
        want.sort()
    assert normalise(seen) == normalise(want), (seen, want)
    assert any(e.startswith("ValueError") for _, e in seen)


class RaisesUnhandled(Raises):
    """Raises as Raises, with no exception handler set: the loop's default handler logs."""

    def connection_made(self, transport):
        self.t = transport


@pytest.mark.parametrize("where", ["data_received", "call_soon"])
def test_the_default_exception_handler_logs_on_asyncios_logger(serve, where, caplog):
    # logging set up for asyncio's logger (a level, a handler, a filter) sees what a
    # protocol raised, on serve_protocol as on asyncio's loop
    def logged():
        return sorted({(r.name, r.levelname, type(r.exc_info[1]).__name__ if r.exc_info
                        else None) for r in caplog.records if r.name in ("asyncio",
                                                                         "aoprim.server")})
    caplog.set_level(logging.ERROR)
    done = threading.Event()
    on_asyncio(lambda: RaisesUnhandled(where, [], done), lambda a: _poke(a, False))
    assert done.wait(10)
    want = logged()
    caplog.clear()
    done = threading.Event()
    srv = serve(lambda: RaisesUnhandled(where, [], done))
    _poke(srv.address, False)
    assert done.wait(10)
    wait_for(lambda: logged(), what="a log record")
    assert want == logged() == [("asyncio", "ERROR", "ValueError")]


class RaisesInMadeOrLost(asyncio.Protocol):
    """Sets the exception handler, then raises in connection_made or connection_lost."""

    def __init__(self, where, seen, done):
        self.where, self.seen, self.done = where, seen, done

    def connection_made(self, transport):
        self.t = transport
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: self.seen.append(
                (ctx["message"].split(" ")[:3], type(ctx.get("exception")).__name__,
                 sorted(ctx), type(ctx.get("handle")).__name__)))
        if self.where == "connection_made":
            raise ValueError("in connection_made")

    def data_received(self, data):
        self.t.close()

    def connection_lost(self, exc):
        self.done.set()
        if self.where == "connection_lost":
            raise ValueError("in connection_lost")


@pytest.mark.parametrize("where", ["connection_made", "connection_lost"])
def test_made_and_lost_exceptions_reach_the_handler_as_asyncios_callbacks(serve, where):
    # asyncio runs both as loop callbacks: the handler gets "Exception in callback ..."
    # and the callback's Handle, as any callback's failure
    want, done = [], threading.Event()
    on_asyncio(lambda: RaisesInMadeOrLost(where, want, done), lambda a: _poke(a, False))
    assert done.wait(10)
    wait_for(lambda: want, what="asyncio's handler")
    seen, done = [], threading.Event()
    srv = serve(lambda: RaisesInMadeOrLost(where, seen, done))
    _poke(srv.address, False)
    assert done.wait(10)
    wait_for(lambda: seen, what="the exception handler")
    assert seen == want == [(["Exception", "in", "callback"], "ValueError",
                             ["exception", "handle", "message"], "Handle")], (seen, want)


class FailsReading(asyncio.BufferedProtocol):
    """get_buffer() or buffer_updated() raises on the first bytes (a 4-byte buffer: the
    rest of the request is not taken)."""

    def __init__(self, where, done):
        self.where, self.done = where, done
        self.buf = bytearray(4)

    def connection_made(self, transport):
        self.t = transport
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: None)

    def get_buffer(self, sizehint):
        self.t.write(b"400 bad request")       # a reply written before the error
        if self.where == "get_buffer":
            raise ValueError("get_buffer failed")
        return self.buf

    def buffer_updated(self, nbytes):
        raise ValueError("buffer_updated failed")

    def connection_lost(self, exc):
        self.done.set()


def _send_request_and_read(address, client_ctx=None):
    c = socket.create_connection(address[:2], timeout=10)
    if client_ctx is not None:
        # (an end without close_notify raises SSLEOFError instead of reading as b"")
        c = client_ctx.wrap_socket(c, server_hostname="localhost", suppress_ragged_eofs=False)
    try:
        c.sendall(b"x" * 1000)
        try:
            got, how = recv_until_closed(c)
        except OSError as e:                # a TLS peer gone without close_notify
            return type(e).__name__
        return how if got.startswith(b"400 bad request") else f"{how}, reply lost: {got!r}"
    finally:
        c.close()


@pytest.mark.parametrize("where", ["get_buffer", "buffer_updated"])
def test_a_fatal_protocol_error_with_input_left_resets_the_peer(serve, where):
    # asyncio's fatal error closes at once: the request's bytes it never read make the
    # kernel reset the connection, so the peer can tell a failure from an end of stream
    done = threading.Event()
    want = on_asyncio(lambda: FailsReading(where, done), _send_request_and_read)
    assert done.wait(10)
    done = threading.Event()
    srv = serve(lambda: FailsReading(where, done))
    assert _send_request_and_read(srv.address) == want == "reset"
    assert done.wait(10)


@pytest.mark.parametrize("where", ["get_buffer", "buffer_updated"])
def test_a_fatal_protocol_error_over_tls_ends_without_close_notify(serve, where, tls_certs):
    # over TLS asyncio drops the connection without close_notify: the peer never sees a
    # clean end of the TLS session
    done = threading.Event()
    ask = lambda a: _send_request_and_read(a, tls_certs.client_ctx())  # noqa: E731
    want = on_asyncio(lambda: FailsReading(where, done), ask, ssl=tls_certs.server_ctx())
    assert done.wait(10)
    done = threading.Event()
    srv = serve(lambda: FailsReading(where, done), ssl=tls_certs.server_ctx())
    got = ask(srv.address)
    assert done.wait(10)
    assert want != "eof" and got != "eof", (want, got)


# -- the loop's task factory, and the loop methods a protocol may not use --------------------

class LoopCalls(asyncio.Protocol):
    """Calls loop methods from connection_made and records each outcome."""

    def __init__(self, calls, seen, done):
        self.calls, self.seen, self.done = calls, seen, done

    def connection_made(self, transport):
        loop = asyncio.get_running_loop()
        for name, f in self.calls:
            try:
                self.seen.append((name, "ok", f(loop)))
            except Exception as e:
                self.seen.append((name, type(e).__name__, str(e)))
        transport.close()

    def connection_lost(self, exc):
        self.done.set()


def _poke_once(address):
    return _poke(address, False)


def test_the_task_factory_is_the_loops(serve):
    made = []

    def factory(loop, coro, **kw):
        made.append(kw.get("context") is not None)
        return asyncio.Task(coro, loop=loop, **kw)

    async def job():
        return 7

    def use(loop):
        before = loop.get_task_factory()
        loop.set_task_factory(factory)
        t = loop.create_task(job(), name="job-1")
        name, now = t.get_name(), loop.get_task_factory() is factory
        loop.set_task_factory(None)
        return (before, name, now, loop.get_task_factory())

    def bad(loop):
        loop.set_task_factory(42)

    calls = [("factory", use), ("bad", bad)]
    want, done = [], threading.Event()
    on_asyncio(lambda: LoopCalls(calls, want, done), _poke_once)
    assert done.wait(10)
    seen, done = [], threading.Event()
    srv = serve(lambda: LoopCalls(calls, seen, done))
    _poke_once(srv.address)
    assert done.wait(10)
    assert seen == want and seen[0] == ("factory", "ok", (None, "job-1", True, None))
    assert seen[1][1] == "TypeError" and made


def test_loop_methods_a_protocol_may_not_use_say_so(serve):
    # loop control and I/O belong to the server: refused with a message naming the method
    calls = [(n, (lambda name: lambda loop: getattr(loop, name)())(n))
             for n in ("stop", "run_forever", "close")]
    calls.append(("add_signal_handler",
                  lambda loop: loop.add_signal_handler(12, print)))
    calls.append(("create_connection",
                  lambda loop: loop.create_connection(asyncio.Protocol, "127.0.0.1", 1)))
    seen, done = [], threading.Event()
    srv = serve(lambda: LoopCalls(calls, seen, done))
    _poke_once(srv.address)
    assert done.wait(10)
    assert [s[:2] for s in seen] == [(n, "NotImplementedError") for n, _ in calls], seen
    for name, _, msg in seen:
        assert f"{name}()" in msg and "serve_protocol" in msg, msg


# -- small things: is_reading() after a close, get_buffer's size hint -----------------------

class Reading(asyncio.BufferedProtocol):
    def __init__(self, log):
        self.log = log
        self.buf = bytearray(8)

    def connection_made(self, transport):
        self.t = transport

    def get_buffer(self, sizehint):
        self.log.append(("hint", sizehint))
        return self.buf

    def buffer_updated(self, nbytes):
        self.log.append(("data", bytes(self.buf[:nbytes])))

    def eof_received(self):
        # returns None: the transport closes itself after this
        asyncio.get_running_loop().call_soon(
            lambda: self.log.append(("after eof", self.t.is_closing(), self.t.is_reading())))

    def connection_lost(self, exc):
        self.log.append(("lost", self.t.is_reading()))


def test_is_reading_after_close_and_get_buffer_size_hint(serve, workers):
    def run(address):
        c = socket.create_connection(address[:2], timeout=10)
        c.sendall(b"0123456789abc")
        c.shutdown(socket.SHUT_WR)
        recv_until_closed(c)
        c.close()
        return True

    def shape(log):
        # (how the 13 bytes split between reads is the kernel's)
        hints = {e[1] for e in log if e[0] == "hint"}
        data = b"".join(e[1] for e in log if e[0] == "data")
        return hints, data, [e for e in log if e[0] not in ("hint", "data")]

    want = []
    on_asyncio(lambda: Reading(want), run)
    assert shape(want) == ({-1}, b"0123456789abc", [("after eof", True, False), ("lost", False)])
    log = []
    srv = serve(lambda: Reading(log))
    run(srv.address)
    wait_for(lambda: log and log[-1][0] == "lost")
    if workers:
        # the loop callback runs on the loop thread while eof_received may still be
        # running on the worker (asyncio: one thread, after it returned): a race
        log[:] = [e for e in log if e[0] != "after eof"]
        want[:] = [e for e in want if e[0] != "after eof"]
    assert shape(log) == shape(want)


# -- over TLS: the peer's close_notify is its EOF ---------------------------------------------

class TLSEof(asyncio.Protocol):
    def __init__(self, log, done):
        self.log, self.done = log, done

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.log.append(("data", data))
        self.t.write(b"k")

    def eof_received(self):
        self.log.append("eof")

    def connection_lost(self, exc):
        self.log.append(("lost", exc))
        self.done.set()


def test_a_tls_peers_close_notify_calls_eof_received(serve, tls_certs):
    def run(address):
        c = tls_certs.client_ctx().wrap_socket(
            socket.create_connection(address[:2], timeout=10), server_hostname="localhost")
        try:
            c.sendall(b"go")
            # (after the answer: the close_notify comes in a read of its own)
            assert c.recv(1) == b"k"
            c.unwrap().close()      # close_notify; returns once the server's answers it
        finally:
            c.close()
        return True

    async def main():
        log, done = [], threading.Event()
        srv = await asyncio.get_running_loop().create_server(
            lambda: TLSEof(log, done), HOST, 0, ssl=tls_certs.server_ctx())
        try:
            await asyncio.to_thread(run, srv.sockets[0].getsockname())
            await asyncio.to_thread(done.wait, 10)
        finally:
            srv.close()
        return log

    want = asyncio.run(main())
    log, done = [], threading.Event()
    srv = serve(lambda: TLSEof(log, done), ssl=tls_certs.server_ctx())
    assert run(srv.address)
    assert done.wait(10)
    assert log == want == [("data", b"go"), "eof", ("lost", None)]


class EchoThenLastWord(asyncio.Protocol):
    """Echoes; at the peer's EOF writes a last line (and returns None: the transport
    closes).  Records what connection_lost got."""

    def __init__(self, seen, done):
        self.seen, self.done = seen, done

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.t.write(data)

    def eof_received(self):
        self.t.write(b"last word")

    def connection_lost(self, exc):
        self.seen.append(repr(exc))
        self.done.set()


def test_a_write_at_a_tls_peers_eof_without_close_notify_ends_cleanly(serve, tls_certs):
    """The TLS peer takes its echo and closes its socket without close_notify; the
    protocol's eof_received writes one more line.  The close_notify that follows finds the
    connection gone: connection_lost(None), as on asyncio (whose TLS transport sends no
    close_notify after the peer's EOF), not a BrokenPipeError."""
    def client(address):
        raw = socket.create_connection(address[:2], timeout=10)
        c = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost")
        c.sendall(b"x" * 600)
        assert recv_exact(c, 600, timeout=10) == b"x" * 600
        c.close()                       # a FIN, no close_notify
        return True

    for run in (on_asyncio, None):
        seen, done = [], threading.Event()
        if run is on_asyncio:
            run(lambda: EchoThenLastWord(seen, done), client, ssl=tls_certs.server_ctx())
        else:
            srv = serve(lambda: EchoThenLastWord(seen, done), ssl=tls_certs.server_ctx())
            client(srv.address)
        assert done.wait(10)
        assert seen == ["None"], (run, seen)
