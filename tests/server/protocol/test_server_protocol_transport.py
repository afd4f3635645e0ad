"""serve_protocol: what an asyncio protocol finds on asyncio's own loop, found here too --
a running loop in every callback (timers, tasks, futures), what ``write()`` then ``abort()``
delivers, a write larger than ``max_pending``, ``close()`` to a slow reader, ``set_protocol()``,
``get_extra_info('sockname')`` in ``connection_lost``, an exception in ``connection_made``.
Both Layer 1 backends, with and without workers; TLS where the write path differs."""
import asyncio
import logging
import socket
import threading

import pytest

from aoprim.server import Handler, Server, serve_protocol

from server_support import (HOST, assert_no_leaks, logs, open_fds,  # noqa: F401
                                 recv_exact, recv_until_closed, wait_for)
from protocol_support import backend, serve, workers  # noqa: F401  (fixtures)
from tlscerts import tls_certs  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)




def connect(srv, certs=None, rcvbuf=None):
    raw = socket.create_connection(srv.address[:2], timeout=10)
    if rcvbuf is not None:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if certs is None:
        return raw
    return certs.client_ctx().wrap_socket(raw, server_hostname="localhost")


class Lost(asyncio.Protocol):
    """Records connection_lost's argument and sets ``done``."""

    def __init__(self, log, done):
        self.log, self.done = log, done

    def connection_made(self, transport):
        self.t = transport

    def connection_lost(self, exc):
        self.log.append(("lost", exc))
        self.done.set()


# -- a running loop in the protocol's callbacks -------------------------------------------

class UsesTheLoop(Lost):
    """Written the usual asyncio way: the running loop's timers in connection_made, a task
    per request that sleeps, awaits a future a timer resolves, a wait_for and an executor."""

    def connection_made(self, transport):
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self.log.append(("made", threading.get_ident(), loop.is_running()))
        loop.call_soon(transport.write, b"soon;")
        loop.call_later(0.01, transport.write, b"never;").cancel()
        loop.call_later(0.05, self.timer)
        with pytest.raises(NotImplementedError):
            loop.add_reader(0, print)       # I/O is not offered: a clear refusal

    def timer(self):
        self.log.append(("timer", threading.get_ident()))
        self.t.write(b"timer;")

    def data_received(self, data):
        # (with workers=N the task's first step may run on the loop thread before
        # create_task returns here: the coroutine is published first, the task after)
        self.coro = self.reply(data)
        self.task = asyncio.get_running_loop().create_task(self.coro)

    async def reply(self, data):
        loop = asyncio.get_running_loop()
        assert asyncio.current_task().get_coro() is self.coro
        await asyncio.sleep(0.01)
        fut = loop.create_future()
        loop.call_at(loop.time() + 0.01, fut.set_result, data.upper())
        got = await asyncio.wait_for(fut, 5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(loop.create_future(), 0.02)
        more = await loop.run_in_executor(None, bytes.upper, b"x")
        self.t.write(b"task:" + got + more + b";")
        self.t.close()


def test_callbacks_run_with_a_running_loop_timers_tasks_and_futures(serve, workers):
    log, done = [], threading.Event()
    srv = serve(lambda: UsesTheLoop(log, done))
    c = connect(srv)
    assert recv_exact(c, 11) == b"soon;timer;"
    c.sendall(b"hi")
    got, how = recv_until_closed(c)
    c.close()
    assert (got, how) == (b"task:HIX;", "eof")
    assert done.wait(10)
    assert log[0][0] == "made" and log[0][2] is True
    assert log[1][0] == "timer" and log[-1] == ("lost", None)
    if workers == 0:
        # the loop's callbacks run on the thread of the protocol's own callbacks
        assert log[1][1] == log[0][1]


def test_an_exception_in_a_loop_callback_is_logged_and_the_connection_lives(serve, logs):
    log, done = [], threading.Event()

    class P(Lost):
        def connection_made(self, transport):
            super().connection_made(transport)
            asyncio.get_running_loop().call_soon(self.boom)

        def boom(self):
            raise KeyError("from a timer")

        def data_received(self, data):
            self.t.write(data)
            self.t.close()

    srv = serve(lambda: P(log, done))
    c = connect(srv)
    c.sendall(b"still here")
    assert recv_until_closed(c) == (b"still here", "eof")
    c.close()
    assert done.wait(10) and log == [("lost", None)]
    assert any("from a timer" in r.getMessage() or (r.exc_info and "from a timer" in
               str(r.exc_info[1])) for r in logs.records if r.levelno >= logging.ERROR)


def test_no_running_loop_is_left_behind_on_a_serve_forever_thread(backend, workers):
    """serve_forever() in a thread of the caller's: the running loop is set for each
    protocol callback there only, so once the server returns that thread can asyncio.run()."""
    from aoprim.server.adapters.asyncio_protocol import ProtocolHandler
    seen, after = [], []

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            seen.append((threading.get_ident(), asyncio.get_running_loop()))
            asyncio.get_running_loop().call_soon(transport.close)

    srv = Server(ProtocolHandler(P), HOST, 0, framing="raw", backend=backend,
                 workers=workers)

    def serve():
        srv.serve_forever()
        after.append(asyncio.events._get_running_loop())
        after.append(asyncio.run(asyncio.sleep(0, "ran")))

    th = threading.Thread(target=serve)
    th.start()
    try:
        c = connect(srv)
        assert recv_until_closed(c)[1] == "eof"
        c.close()
        wait_for(lambda: seen)
    finally:
        srv.shutdown(timeout=15)
        th.join(15)
    assert seen[0][0] == th.ident and seen[0][1] is not None
    assert after == [None, "ran"]


# -- write() then abort() -----------------------------------------------------------------

MSG = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"


class WriteThenAbort(Lost):
    def data_received(self, data):
        self.t.write(MSG)
        self.t.abort()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_write_then_abort_delivers_what_was_written(serve, tls, tls_certs):
    log, done = [], threading.Event()
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    srv = serve(lambda: WriteThenAbort(log, done), **kw)
    c = connect(srv, tls_certs if tls else None)
    c.sendall(b"GARBAGE\r\n\r\n")
    got = b""
    try:
        while True:
            b = c.recv(1000)
            if not b:
                break
            got += b
    except OSError:             # (over TLS: no close_notify after an abort)
        pass
    c.close()
    assert got == MSG
    assert done.wait(10) and log == [("lost", None)]


# -- one write above max_pending; writing on after pause_writing -------------------------

class BigWrite(Lost):
    size = 3 << 20
    chunks = 1
    limits = None

    def connection_made(self, transport):
        super().connection_made(transport)
        if self.limits:
            transport.set_write_buffer_limits(high=self.limits)

    def data_received(self, data):
        for _ in range(self.chunks):
            self.t.write(b"x" * self.size)
        self.t.close()

    def pause_writing(self):
        self.log.append("pause")

    def resume_writing(self):
        self.log.append("resume")


@pytest.mark.parametrize("how", ["one-write", "under-high"])
def test_a_write_larger_than_max_pending_is_sent_whole(serve, how):
    log, done = [], threading.Event()

    class P(BigWrite):
        pass

    if how == "under-high":
        # the high-water mark above max_pending: a second write before the first drained
        P.size, P.chunks, P.limits = 3 << 19, 2, 2 << 20
    srv = serve(lambda: P(log, done), max_pending=1 << 20)
    c = connect(srv)
    c.sendall(b"GET")
    got, how_closed = recv_until_closed(c, limit=4 << 20)
    c.close()
    assert (len(got), how_closed) == (3 << 20, "eof")
    assert done.wait(10)
    # pause_writing() only if the socket did not take the write at once (as asyncio's),
    # which is the kernel's to decide; and whether the second write finds the first still
    # pending depends on how much the loop sent meanwhile -- with workers it flushes on
    # another thread, in parallel on a free-threaded build
    assert log in (["pause", "resume", ("lost", None)], [("lost", None)]), log


def test_writing_on_after_pause_writing_past_the_cap_is_cut_with_an_error(serve):
    # told pause_writing(), the protocol writes on: cut once 16 * max_pending is pending
    log, done = [], threading.Event()

    class P(BigWrite):
        size, chunks = 1 << 20, 24

        def connection_made(self, transport):
            super().connection_made(transport)
            # (the kernel takes little: what is pending stays in the batch)
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                         socket.SO_SNDBUF, 65536)

        def data_received(self, data):
            # from a task (the loop thread, with workers too): each write is seen by the
            # loop before the next, so pause_writing() comes before the writes go on
            asyncio.get_running_loop().create_task(self.write_on())

        async def write_on(self):
            for _ in range(self.chunks):
                self.t.write(b"x" * self.size)
                await asyncio.sleep(0)
            self.t.close()

    srv = serve(lambda: P(log, done), max_pending=1 << 20)
    c = connect(srv, rcvbuf=65536)
    c.sendall(b"GET")
    assert done.wait(10)
    got, how = recv_until_closed(c, limit=24 << 20)
    c.close()
    assert how == "reset" and len(got) < 24 << 20
    assert log[0] == "pause" and log[-1][0] == "lost"
    exc = log[-1][1]
    assert isinstance(exc, ConnectionAbortedError) and "max_pending" in str(exc), exc


# -- close() to a slow reader ---------------------------------------------------------------

class SlowDownload(Lost):
    size = 1 << 20

    def connection_made(self, transport):
        super().connection_made(transport)
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                     65536)

    def data_received(self, data):
        self.t.write(b"x" * self.size)
        self.t.close()


def test_close_sends_the_whole_backlog_to_a_slow_reader(serve):
    """close() waits for the backlog, however long the peer takes (close_linger does not
    cut a protocol's close), as asyncio's close()."""
    log, done = [], threading.Event()
    srv = serve(lambda: SlowDownload(log, done), close_linger=0.2)
    c = connect(srv, rcvbuf=65536)
    c.sendall(b"GET")
    n = 0
    paced = threading.Event()           # never set: the reader's pace
    c.settimeout(10)
    while True:
        b = c.recv(65536)
        if not b:
            break
        n += len(b)
        paced.wait(0.04)                # ~1 MiB in well over close_linger
    c.close()
    assert n == SlowDownload.size
    assert done.wait(10) and log == [("lost", None)]


def test_a_close_backlog_cut_by_the_idle_timeout_ends_in_a_reset(serve):
    """A peer that takes nothing of what close() owes is cut by idle_timeout: a reset (never
    a FIN that would pass the cut stream off as whole), connection_lost gets a TimeoutError."""
    log, done = [], threading.Event()

    class P(SlowDownload):
        size = 4 << 20

    srv = serve(lambda: P(log, done), idle_timeout=0.3, max_pending=8 << 20)
    c = connect(srv, rcvbuf=65536)
    c.sendall(b"GET")
    assert done.wait(10), log
    got, how = recv_until_closed(c, limit=8 << 20)
    c.close()
    assert how == "reset" and len(got) < P.size
    exc = log[-1][1]
    assert isinstance(exc, TimeoutError) and "idle timeout" in str(exc), exc


def test_a_native_session_cut_by_close_linger_ends_in_a_reset(backend, workers):
    """The native API: unsent bytes dropped at close_linger end the stream with a reset."""
    class Dump(Handler):
        def on_connect(self, session):
            session.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)

        def on_read(self, session, data):
            session.send(b"x" * (4 << 20))
            session.close()

        def on_close(self, session, exc):
            done.set()

    done = threading.Event()
    fds = open_fds()
    srv = Server(Dump(), HOST, 0, framing="raw", backend=backend, workers=workers,
                 close_linger=0.2, max_pending=8 << 20).start()
    try:
        c = connect(srv, rcvbuf=65536)
        c.sendall(b"GET")
        assert done.wait(10)
        got, how = recv_until_closed(c, limit=8 << 20)
        c.close()
    finally:
        srv.shutdown(timeout=15)
    assert how == "reset" and len(got) < 4 << 20
    assert_no_leaks(srv, fds)


# -- set_protocol -------------------------------------------------------------------------

class Second(asyncio.Protocol):
    def __init__(self, log, done):
        self.log, self.done = log, done

    def data_received(self, data):
        self.log.append(("B.data", data))

    def eof_received(self):
        self.log.append("B.eof")

    def connection_lost(self, exc):
        self.log.append(("B.lost", exc))
        self.done.set()


class SecondBuffered(asyncio.BufferedProtocol):
    def __init__(self, log, done):
        self.p = Second(log, done)
        self.buf = bytearray(3)

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, n):
        self.p.data_received(bytes(self.buf[:n]))

    def eof_received(self):
        self.p.eof_received()

    def connection_lost(self, exc):
        self.p.connection_lost(exc)


class First(asyncio.Protocol):
    then = Second

    def __init__(self, log, done):
        self.log, self.done = log, done

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.log.append(("A.data", data))
        if data == b"UPGRADE":
            b = self.then(self.log, self.done)
            self.t.set_protocol(b)
            self.log.append(("switched", self.t.get_protocol() is b))
            self.t.write(b"switched")

    def eof_received(self):
        self.log.append("A.eof")

    def connection_lost(self, exc):
        self.log.append(("A.lost", exc))
        self.done.set()


class FirstBuffered(asyncio.BufferedProtocol):
    """A BufferedProtocol that switches to a plain Protocol."""

    def __init__(self, log, done):
        self.first = First(log, done)
        self.buf = bytearray(64)

    def connection_made(self, transport):
        self.first.connection_made(transport)

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, n):
        self.first.data_received(bytes(self.buf[:n]))

    def eof_received(self):
        self.first.eof_received()

    def connection_lost(self, exc):
        self.first.connection_lost(exc)


@pytest.mark.parametrize("kind", ["Protocol-Protocol", "Protocol-Buffered", "Buffered-Protocol"])
def test_set_protocol_routes_everything_after_it_to_the_new_protocol(serve, kind):
    log, done = [], threading.Event()
    first, then = {"Protocol-Protocol": (First, Second),
                   "Protocol-Buffered": (First, SecondBuffered),
                   "Buffered-Protocol": (FirstBuffered, Second)}[kind]

    def factory():
        p = first(log, done)
        (p.first if isinstance(p, FirstBuffered) else p).then = then
        return p

    srv = serve(factory)
    c = connect(srv)
    c.sendall(b"UPGRADE")
    assert recv_exact(c, 8) == b"switched"
    c.sendall(b"frame1")
    wait_for(lambda: sum(len(e[1]) for e in log if e[0] == "B.data") == 6)
    c.shutdown(socket.SHUT_WR)
    assert recv_until_closed(c) == (b"", "eof")
    c.close()
    assert done.wait(10)
    data = b"".join(e[1] for e in log if e[0] == "B.data")
    assert data == b"frame1"
    assert [e for e in log if e[0] != "B.data"] == [
        ("A.data", b"UPGRADE"), ("switched", True), "B.eof", ("B.lost", None)]


# -- sockname asked first in connection_lost / on_close -----------------------------------

def test_sockname_is_known_in_connection_lost(serve):
    log, done = [], threading.Event()

    class P(Lost):
        def connection_lost(self, exc):
            self.log.append(self.t.get_extra_info("sockname"))
            super().connection_lost(exc)

    srv = serve(lambda: P(log, done))
    c = connect(srv)
    c.shutdown(socket.SHUT_WR)
    assert recv_until_closed(c)[1] == "eof"
    c.close()
    assert done.wait(10)
    assert log[0] == srv.address[:2]


def test_sockname_is_known_in_on_close(backend, workers):
    seen, done = [], threading.Event()

    class H(Handler):
        def on_read(self, session, data):
            pass

        def on_close(self, session, exc):
            seen.append(session.sockname)
            done.set()

    srv = Server(H(), HOST, 0, framing="raw", backend=backend, workers=workers).start()
    try:
        c = connect(srv)
        c.close()
        assert done.wait(10)
    finally:
        srv.shutdown(timeout=15)
    assert seen == [srv.address[:2]]


# -- an exception in connection_made ------------------------------------------------------

def test_an_exception_in_connection_made_is_logged_and_the_connection_carries_on(serve,
                                                                                  logs):
    log, done = [], threading.Event()

    class P(Lost):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.log.append("made")
            raise LookupError("made went wrong")

        def data_received(self, data):
            self.log.append(("data", data))
            self.t.write(data)

        def eof_received(self):
            self.log.append("eof")

    srv = serve(lambda: P(log, done))
    c = connect(srv)
    c.sendall(b"hi")
    assert recv_exact(c, 2) == b"hi"
    c.shutdown(socket.SHUT_WR)
    assert recv_until_closed(c) == (b"", "eof")
    c.close()
    assert done.wait(10)
    assert log == ["made", ("data", b"hi"), "eof", ("lost", None)]
    errors = [r for r in logs.records if r.levelno >= logging.ERROR]
    assert any("connection_made" in r.getMessage() and r.exc_info and
               isinstance(r.exc_info[1], LookupError) for r in errors), errors


# -- a shutdown that drops a close's backlog ------------------------------------------------

def test_a_shutdown_that_drops_the_backlog_resets_and_tells_connection_lost(backend, workers):
    log, done = [], threading.Event()

    class P(SlowDownload):
        size = 4 << 20

    fds = open_fds()
    srv = serve_protocol(lambda: P(log, done), HOST, 0, backend=backend, workers=workers,
                         shutdown_timeout=0.3, max_pending=8 << 20)
    try:
        c = connect(srv, rcvbuf=65536)
        c.sendall(b"GET")
        assert recv_exact(c, 1000)       # the download began; the peer reads no more
    finally:
        srv.shutdown(timeout=15)
    assert done.wait(10), log
    got, how = recv_until_closed(c, limit=8 << 20)
    c.close()
    assert how == "reset" and len(got) < P.size
    exc = log[-1][1]
    assert isinstance(exc, ConnectionAbortedError) and "shutdown" in str(exc), exc
    assert_no_leaks(srv, fds)


def test_an_idle_timeout_gives_connection_lost_a_timeout_error(serve):
    log, done = [], threading.Event()
    srv = serve(lambda: Lost(log, done), idle_timeout=0.2)
    c = connect(srv)
    assert done.wait(10)
    assert recv_until_closed(c)[1] in ("eof", "reset")
    c.close()
    exc = log[-1][1]
    assert isinstance(exc, TimeoutError) and "idle timeout" in str(exc), exc
