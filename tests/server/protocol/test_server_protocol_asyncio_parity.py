"""serve_protocol against asyncio's own loop where a protocol fails or asks for what the
transport does not do: a TLS ``connection_made`` that raises (fatal, as asyncio's TLS
transport makes it), an exception handler that raises (asyncio's one record, on its logger),
the TLS write-buffer limits (asyncio's TLS defaults), ``write_eof()`` (refused, saying so),
and a task that swallows its cancellation at the shutdown (named when it is dropped).  Each
scenario runs on asyncio's loop too, where it applies, and the two must agree."""
import asyncio
import logging
import socket
import ssl
import threading

import pytest

from protocol_support import backend, on_asyncio, serve, workers  # noqa: F401  (fixtures)
from server_support import HOST, recv_until_closed, wait_for
from tlscerts import tls_certs  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(120)


def _tls_exchange(ctx, address):
    """A TLS client: handshake, send b"ping", read until the end; returns what it read, or
    the name of the error that ended it."""
    with socket.create_connection(address, timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as c:
                c.sendall(b"ping")
                got = b""
                while True:
                    b = c.recv(4096)
                    if not b:
                        return got
                    got += b
        except (OSError, ssl.SSLError) as e:
            return type(e).__name__


def _made_raises(lost):
    class MadeRaises(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            raise ValueError("connection_made failed")

        def data_received(self, data):
            self.transport.write(data)

        def connection_lost(self, exc):
            lost.append(exc)
    return MadeRaises


def _asyncio_errors(caplog):
    """The first lines of the ERROR records on asyncio's logger so far; then cleared."""
    got = [r.getMessage().splitlines()[0] for r in caplog.records
           if r.name == "asyncio" and r.levelno >= logging.ERROR]
    caplog.clear()
    return got


def test_a_tls_connection_made_that_raises_drops_the_connection_as_asyncio(serve, tls_certs,
                                                                          caplog):
    client = tls_certs.client_ctx()
    theirs = []
    caplog.clear()
    seen_there = on_asyncio(_made_raises(theirs), lambda a: _tls_exchange(client, a),
                            ssl=tls_certs.server_ctx())
    there = _asyncio_errors(caplog)
    ours = []
    srv = serve(_made_raises(ours), ssl=tls_certs.server_ctx())
    seen_here = _tls_exchange(client, srv.address)
    wait_for(lambda: ours, 10, "connection_lost")
    here = _asyncio_errors(caplog)
    # the peer never gets its echo, and connection_lost gets the exception, on both
    assert b"ping" not in (seen_there if isinstance(seen_there, bytes) else b"")
    assert b"ping" not in (seen_here if isinstance(seen_here, bytes) else b"")
    assert [type(e) for e in theirs] == [ValueError] == [type(e) for e in ours]
    # and the exception handler is told in asyncio's words
    assert here == there == ["Fatal error: protocol.buffer_updated() call failed."]


def _tls_eof(ctx, address):
    """A TLS client that sends b"ping", then its close_notify, and reads to the end."""
    with socket.create_connection(address, timeout=10) as raw:
        c = ctx.wrap_socket(raw, server_hostname="localhost")
        try:
            c.sendall(b"ping")
            c.unwrap()
        except (OSError, ssl.SSLError):
            pass
        finally:
            c.close()


@pytest.mark.parametrize("keep", [False, True], ids=["raises", "returns_true"])
def test_a_tls_eof_received_is_told_in_asyncios_words(serve, tls_certs, caplog, keep):
    def factory():
        class Eof(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport

            def eof_received(self):
                if keep:
                    return True
                raise ValueError("eof_received failed")
        return Eof

    client = tls_certs.client_ctx()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        on_asyncio(factory(), lambda a: _tls_eof(client, a), ssl=tls_certs.server_ctx())
        there = [r.getMessage().splitlines()[0] for r in caplog.records
                 if r.name == "asyncio"]
        caplog.clear()
        srv = serve(factory(), ssl=tls_certs.server_ctx())
        _tls_eof(client, srv.address)
        want = ("returning true from eof_received() has no effect when using ssl" if keep
                else "Error calling eof_received()")
        wait_for(lambda: want in caplog.text, 10, "the record")
        here = [r.getMessage().splitlines()[0] for r in caplog.records if r.name == "asyncio"]
    assert here == there == [want]


def test_a_tcp_connection_made_that_raises_is_logged_and_the_connection_goes_on(serve):
    lost = []
    srv = serve(_made_raises(lost))
    with socket.create_connection(srv.address, timeout=10) as c:
        c.sendall(b"ping")
        assert c.recv(16) == b"ping"


@pytest.mark.parametrize("error", [RuntimeError, asyncio.CancelledError])
def test_an_exception_handler_that_raises_is_one_asyncio_record(serve, caplog, error):
    class Fails(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

            def handler(loop, context):
                raise error("the handler failed")
            asyncio.get_running_loop().set_exception_handler(handler)
            raise ValueError("connection_made failed")

        def data_received(self, data):
            self.transport.write(data)

    srv = serve(Fails)
    with caplog.at_level(logging.ERROR):
        with socket.create_connection(srv.address, timeout=10):
            wait_for(lambda: "Unhandled error in exception handler" in caplog.text, 10,
                     "the record")
    recs = [r for r in caplog.records if "Unhandled error in exception handler" in
            r.getMessage()]
    assert len(recs) == 1 and recs[0].name == "asyncio"
    assert isinstance(recs[0].exc_info[1], error)
    assert "connection_made failed" in recs[0].getMessage()     # the context it handled
    with socket.create_connection(srv.address, timeout=10) as c:   # and it serves on
        c.sendall(b"ping")
        assert c.recv(16) == b"ping"


def _limits_seen(seen):
    class Limits(asyncio.Protocol):
        def connection_made(self, transport):
            seen.append(transport.get_write_buffer_limits())
            transport.set_write_buffer_limits(high=1000)
            transport.set_write_buffer_limits()
            seen.append(transport.get_write_buffer_limits())
            transport.close()
    return Limits


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_the_default_write_buffer_limits_are_asyncios(serve, tls_certs, tls):
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    client = tls_certs.client_ctx() if tls else None

    def connect(address):
        if client is None:
            with socket.create_connection(address, timeout=10) as c:
                c.recv(16)
        else:
            _tls_exchange(client, address)

    theirs = []
    on_asyncio(_limits_seen(theirs), connect, **kw)
    ours = []
    srv = serve(_limits_seen(ours), **kw)
    connect(srv.address)
    wait_for(lambda: len(ours) == 2, 10, "the limits")
    expected = [(131072, 524288) if tls else (16384, 65536)] * 2
    assert ours == theirs == expected


def test_write_eof_says_it_is_not_supported(serve):
    got = []

    class HalfClose(asyncio.Protocol):
        def connection_made(self, transport):
            got.append(transport.can_write_eof())
            try:
                transport.write_eof()
            except NotImplementedError as e:
                got.append(str(e))
            transport.close()

    srv = serve(HalfClose)
    with socket.create_connection(srv.address, timeout=10) as c:
        assert c.recv(16) == b""
    assert got[0] is False and "write_eof() is not supported" in got[1]


def test_a_task_that_swallows_its_cancellation_is_named_when_the_shutdown_drops_it(
        backend, workers, caplog):
    from aoprim.server import serve_protocol
    started = threading.Event()
    release = threading.Event()

    async def stubborn():
        started.set()
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass                        # swallowed: the shutdown's cancel too

    class Starts(asyncio.Protocol):
        def connection_made(self, transport):
            asyncio.get_running_loop().create_task(stubborn(), name="the-stubborn-one")
            transport.close()

    srv = serve_protocol(Starts, HOST, 0, backend=backend, workers=workers,
                         shutdown_timeout=0.5)
    try:
        with socket.create_connection(srv.address, timeout=10) as c:
            assert started.wait(10)
            c.recv(16)
        with caplog.at_level(logging.WARNING):
            srv.shutdown(timeout=30)
    finally:
        release.set()
    assert "1 protocol task still running at shutdown_timeout" in caplog.text
    assert "the-stubborn-one" in caplog.text


# -- a callback that raises a BaseException other than SystemExit / KeyboardInterrupt --------
# (asyncio.CancelledError, GeneratorExit, a test framework's outcome exceptions): asyncio's
# loop and transports catch those as they catch an Exception -- the exception handler, a
# fatal error for that connection -- and serve on

class _Cancels(asyncio.Protocol):
    """Echoes; raises asyncio.CancelledError from the callback named ``where``."""

    def __init__(self, where, lost):
        self.where = where
        self.lost = lost

    def _maybe(self, name):
        if self.where == name:
            raise asyncio.CancelledError(f"{name} cancelled")

    def connection_made(self, transport):
        self.transport = transport
        self._maybe("connection_made")

    def data_received(self, data):
        self.transport.write(data)
        self._maybe("data_received")

    def eof_received(self):
        self._maybe("eof_received")

    def connection_lost(self, exc):
        self.lost.append(exc)
        self._maybe("connection_lost")


def _ping_half_close(address):
    """Send b"ping", half-close, read to the end: the bytes read, or the error's name."""
    with socket.create_connection(address, timeout=10) as c:
        got = b""
        try:
            c.sendall(b"ping")
            c.shutdown(socket.SHUT_WR)
            while True:
                b = c.recv(4096)
                if not b:
                    return got
                got += b
        except OSError as e:
            return type(e).__name__


@pytest.mark.parametrize("where", ["factory", "connection_made", "data_received",
                                   "eof_received", "connection_lost"])
def test_a_callback_raising_cancelled_error_ends_that_connection_only_as_asyncio(
        serve, where, caplog):
    def factory_of(lost):
        made = []

        def make():
            made.append(1)
            if where == "factory" and len(made) == 1:
                raise asyncio.CancelledError("factory cancelled")
            return _Cancels(where, lost)
        return make

    theirs = []
    # (asyncio's accept leaves the socket of a factory that raised to the GC, whose close
    # with "ping" unread resets: ours closes it, at once)
    seen_there = (on_asyncio(factory_of(theirs), _ping_half_close) if where != "factory"
                  else None)
    ours = []
    srv = serve(factory_of(ours))
    seen_here = _ping_half_close(srv.address)
    if where != "factory":
        assert seen_here == seen_there
    else:   # closed at once: an end of stream, or a reset if it came before the half-close
        assert seen_here in (b"", "ConnectionResetError", "OSError", "BrokenPipeError")
    if where != "factory":
        wait_for(lambda: ours, 10, "connection_lost")
        assert [type(e) for e in ours] == [type(e) for e in theirs]
    if where in ("data_received", "eof_received", "connection_lost"):
        # the loop's exception handler was told, with the exception
        wait_for(lambda: any(r.name == "asyncio" and r.exc_info and
                             isinstance(r.exc_info[1], asyncio.CancelledError)
                             for r in caplog.records), 10, "the exception handler's record")
    # the server serves on, as asyncio's would
    again = _ping_half_close(srv.address)
    assert again == (b"ping" if where == "factory" else seen_there)


@pytest.mark.parametrize("where", ["pause_writing", "resume_writing"])
def test_a_flow_callback_raising_cancelled_error_is_reported_and_the_connection_goes_on(
        serve, where, caplog):
    told = []

    class Flow(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            transport.set_write_buffer_limits(high=1024, low=0)
            # a small send buffer: the kernel cannot take the whole 8 MB write at once (a
            # quiet machine's loopback, its reader keeping up, took it all: no pause came)
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                         socket.SO_SNDBUF, 65536)

        def data_received(self, data):
            self.transport.write(data * 2_000_000)  # 8 MB: more than the socket takes

        def pause_writing(self):
            told.append("pause")
            if where == "pause_writing":
                raise asyncio.CancelledError("pause_writing cancelled")

        def resume_writing(self):
            told.append("resume")
            if where == "resume_writing":
                raise asyncio.CancelledError("resume_writing cancelled")

    srv = serve(Flow)
    for _ in range(2):          # and again: the server serves on
        with socket.create_connection(srv.address, timeout=10) as c:
            c.sendall(b"ping")
            got = 0
            while got < 4 * 2_000_000:
                b = c.recv(65536)
                assert b, f"closed after {got} bytes"
                got += len(b)
    # resume_writing runs once the last byte is in the kernel: the peer may have read it first
    wait_for(lambda: "pause" in told and "resume" in told, 10, "pause and resume")
    recs = wait_for(lambda: [r for r in caplog.records if r.name == "asyncio" and
                             f"protocol.{where}() failed" in r.getMessage()],
                    10, f"the record of {where}'s exception")
    assert isinstance(recs[0].exc_info[1], asyncio.CancelledError)


@pytest.mark.parametrize("where", ["pause_writing", "resume_writing"])
def test_a_context_the_default_handler_cannot_format_is_one_record_and_nothing_else(
        serve, where, caplog):
    """asyncio guards its default exception handler: a context whose repr() fails (a
    protocol with a broken __repr__) gives one "Exception in default exception handler"
    record, and the failing callback's caller goes on -- the connection stays open."""
    lost = []

    class BrokenRepr(asyncio.Protocol):
        def __repr__(self):
            raise AttributeError("broken __repr__")

        def connection_made(self, transport):
            self.transport = transport
            transport.set_write_buffer_limits(high=1024, low=0)
            # a small send buffer: the kernel cannot take the whole 8 MB write at once (a
            # quiet machine's loopback, its reader keeping up, took it all: no pause came)
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                         socket.SO_SNDBUF, 65536)

        def data_received(self, data):
            self.transport.write(data * 2_000_000)

        def pause_writing(self):
            if where == "pause_writing":
                raised.append(where)
                raise ValueError("pause_writing failed")

        def resume_writing(self):
            if where == "resume_writing":
                raised.append(where)
                raise ValueError("resume_writing failed")

        def connection_lost(self, exc):
            lost.append(exc)

    raised = []
    srv = serve(BrokenRepr)
    for _ in range(2):
        with socket.create_connection(srv.address, timeout=10) as c:
            c.sendall(b"ping")
            got = 0
            while got < 4 * 2_000_000:
                b = c.recv(65536)
                assert b, f"closed after {got} bytes"
                got += len(b)
    wait_for(lambda: len(lost) == 2, 10, "both connection_lost")
    assert lost == [None, None]
    # (the socket takes a share of each write first: how often the mark is crossed is
    # the peer's timing; each failure is one record)
    assert raised and [r.getMessage() for r in caplog.records if r.name == "asyncio"] == \
        ["Exception in default exception handler"] * len(raised)
    assert not [r for r in caplog.records if r.name == "aoprim.server" and
                r.levelno >= logging.ERROR]


def test_get_write_buffer_size_right_after_a_write_counts_it_on_every_thread(serve):
    """A large write() to a peer that is not reading: get_write_buffer_size() right after it
    reports the backlog the socket did not take -- on asyncio, and here with workers too,
    where the bytes are still on their way to the loop thread."""
    def make(seen, written):
        class Big(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport

            def data_received(self, data):
                self.transport.write(b"x" * 8_000_000)
                seen.append(self.transport.get_write_buffer_size())
                written.set()
        return Big

    def client(written):
        def run(address):
            with socket.create_connection(address, timeout=10) as c:
                c.sendall(b"go")
                assert written.wait(10)
                got = 0
                while got < 8_000_000:
                    b = c.recv(1 << 20)
                    assert b
                    got += len(b)
            return got
        return run

    theirs, ev = [], threading.Event()
    assert on_asyncio(make(theirs, ev), client(ev)) == 8_000_000
    ours, ev = [], threading.Event()
    srv = serve(make(ours, ev))
    assert client(ev)(srv.address) == 8_000_000
    # (the kernel takes a few MB at most before the peer reads: the rest is the backlog)
    assert theirs[0] > 1_000_000 and ours[0] > 1_000_000, (theirs, ours)


def test_a_socket_shutdown_after_a_write_sends_the_write_first_as_asyncio(serve):
    """get_extra_info("socket").shutdown(SHUT_WR) right after write(): the half-close one
    reaches for (write_eof() is not supported here) -- the peer reads the reply, then the
    end of the stream, as on asyncio (whose write() has sent it already)."""
    class HalfCloses(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(b"reply:" + data)
            self.transport.get_extra_info("socket").shutdown(socket.SHUT_WR)

    def client(address):
        with socket.create_connection(address, timeout=10) as c:
            c.sendall(b"ping")
            got = b""
            while True:
                b = c.recv(4096)
                if not b:
                    return got
                got += b

    assert on_asyncio(HalfCloses, client) == b"reply:ping"
    srv = serve(HalfCloses)
    for _ in range(3):
        assert client(srv.address) == b"reply:ping"


def test_so_linger_zero_then_close_resets_as_asyncio(serve):
    """The abortive-close idiom: SO_LINGER (on, 0 s) on get_extra_info("socket"), then
    close(): the peer's stream ends with a reset, not a clean end, as on asyncio."""
    import struct

    class Resets(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(b"reply:" + data)
            self.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.close()

    def client(address):
        with socket.create_connection(address, timeout=10) as c:
            c.sendall(b"ping")
            try:
                while c.recv(4096):
                    pass
            except ConnectionResetError:
                return "reset"
            return "end of stream"

    assert on_asyncio(Resets, client) == "reset"
    srv = serve(Resets)
    for _ in range(3):
        assert client(srv.address) == "reset"


def test_debug_mode_creation_tracebacks_are_written_as_asyncio_writes_them(serve, caplog):
    """Debug mode: a failing callback's record carries where its handle was made, as
    asyncio's default handler writes it ("Object created at (most recent call last):" and
    the protocol's own line), not the repr of a list of frames."""
    class Fails(asyncio.Protocol):
        def connection_made(self, transport):
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.call_soon(self.fails)      # the line the record names
            self.transport = transport

        def fails(self):
            raise ValueError("callback failed")

        def data_received(self, data):
            self.transport.write(data)

    def client(address):
        with socket.create_connection(address, timeout=10) as c:
            c.sendall(b"x")
            assert c.recv(1) == b"x"

    def record():
        recs = [r.getMessage() for r in caplog.records if r.name == "asyncio" and
                "callback failed" in repr(r.exc_info)]
        return recs[0] if recs else None

    on_asyncio(Fails, client)
    there = record()
    caplog.clear()
    srv = serve(Fails)
    client(srv.address)
    wait_for(record, 10, "the record")
    here = record()
    for text in (there, here):
        assert "source_traceback: Object created at (most recent call last):" in text
        assert "in connection_made" in text and "FrameSummary" not in text


def _sleeps_then_answers(delay):
    """A protocol whose task sleeps ``delay`` (and arms ``call_later(delay)``) when a line
    arrives, then writes what each came back with and closes."""
    class SleepsThenAnswers(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            loop = asyncio.get_running_loop()
            fired = loop.create_future()
            loop.call_later(delay, fired.set_result, b"timer ")

            async def answer():
                try:
                    await asyncio.sleep(delay)
                    said = b"slept "
                except Exception as e:
                    said = type(e).__name__.encode() + b" "
                self.transport.write(said + await fired)
                self.transport.close()
            loop.create_task(answer())
    return SleepsThenAnswers


def _ask(address):
    with socket.create_connection(address, timeout=10) as c:
        c.sendall(b"go\n")
        got = b""
        while b := c.recv(100):
            got += b
        return got


@pytest.mark.parametrize("delay", [float("nan"), -1.0, 0.0], ids=["nan", "negative", "zero"])
def test_a_delay_asyncio_takes_as_now_is_now(serve, delay):
    # asyncio runs a timer whose time is NaN (or in the past) in its next iteration:
    # call_later(nan) fires, and sleep(nan) returns at once (from 3.13 asyncio.sleep
    # itself refuses NaN with ValueError, before it reaches the loop)
    theirs = on_asyncio(_sleeps_then_answers(delay), _ask)
    srv = serve(_sleeps_then_answers(delay))
    assert _ask(srv.address) == theirs
    assert theirs in (b"slept timer ", b"ValueError timer ")


def test_debug_mode_a_tasks_source_traceback_ends_at_the_callers_line(serve):
    """Debug mode: where a task was made (``_source_traceback``, which asyncio's messages
    about the task print) ends at the line that called ``loop.create_task``, as on
    asyncio's loop -- not a line of the loop's own ``create_task``."""
    def made_where(seen):
        class MakesATask(asyncio.Protocol):
            def connection_made(self, transport):
                loop = asyncio.get_running_loop()
                loop.set_debug(True)
                task = loop.create_task(asyncio.sleep(0))
                seen.append([(f.name, f.line) for f in task._source_traceback[-2:]])
                transport.write(b"x")
        return MakesATask

    def client(address):
        with socket.create_connection(address, timeout=10) as c:
            assert c.recv(1) == b"x"

    there, here = [], []
    on_asyncio(made_where(there), client)
    srv = serve(made_where(here))
    client(srv.address)
    wait_for(lambda: here, 10, "the protocol's connection_made")
    assert there[0][-1] == ("connection_made", "task = loop.create_task(asyncio.sleep(0))")
    assert here[0][-1] == there[0][-1]


class _RaisesToItsHandler(asyncio.Protocol):
    """Sets its own exception handler, then raises in data_received."""

    def __init__(self, seen, lost):
        self.seen, self.lost = seen, lost

    def connection_made(self, transport):
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: self.seen.append(ctx["message"]))

    def data_received(self, data):
        raise ValueError("bad request")

    def connection_lost(self, exc):
        self.lost.append(type(exc).__name__)


def test_an_exception_the_exception_handler_took_is_not_logged_again(serve, caplog):
    def run(address):
        with socket.create_connection(address[:2], timeout=10) as c:
            c.sendall(b"x")
            return recv_until_closed(c)[0]

    seen, lost = [], []
    caplog.set_level(logging.DEBUG)
    assert on_asyncio(lambda: _RaisesToItsHandler(seen, lost), run) == b""
    wait_for(lambda: lost, 10, "connection_lost on asyncio")
    there = [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    want = (list(seen), list(lost))
    seen.clear()
    lost.clear()
    srv = serve(lambda: _RaisesToItsHandler(seen, lost))
    assert run(srv.address) == b""
    wait_for(lambda: lost, 10, "connection_lost")
    assert (seen, lost) == want == (["Fatal error: protocol.data_received() call failed."],
                                    ["ValueError"])
    assert srv.stats()["handler_errors"] == 1
    # the user's handler had it: nothing more at WARNING or above, as on asyncio
    here = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert here == there == []
    # the close is still told, at DEBUG
    assert any("bad request" in r.getMessage() for r in caplog.records
               if r.name.startswith("aoprim"))


class _WritesAfterClose(asyncio.Protocol):
    """close(), then writes on: seven times in the callback, seven more after
    connection_lost."""

    def __init__(self, lost):
        self.lost = lost

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.t.close()
        for _ in range(7):
            self.t.write(b"late")

    def connection_lost(self, exc):
        for _ in range(7):
            self.t.write(b"later")
        self.lost.append(exc)


def _poke_until_closed(address, ctx=None):
    raw = socket.create_connection(address[:2], timeout=10)
    c = raw if ctx is None else ctx.wrap_socket(raw, server_hostname="localhost")
    try:
        c.sendall(b"x")
        while c.recv(100):
            pass
    except (OSError, ssl.SSLError):
        pass
    finally:
        c.close()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_writes_after_close_are_told_as_asyncio_tells_them(serve, caplog, tls, tls_certs):
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    ctx = tls_certs.client_ctx() if tls else None
    want = "SSL connection is closed" if tls else "socket.send() raised exception."

    def told():
        return sum(r.getMessage() == want for r in caplog.records if r.name == "asyncio")

    lost = []
    caplog.set_level(logging.WARNING, logger="asyncio")
    on_asyncio(lambda: _WritesAfterClose(lost), lambda a: _poke_until_closed(a, ctx), **kw)
    wait_for(lambda: lost, 10, "connection_lost on asyncio")
    there = told()
    caplog.clear()
    lost.clear()
    srv = serve(lambda: _WritesAfterClose(lost), **kw)
    _poke_until_closed(srv.address, ctx)
    wait_for(lambda: lost, 10, "connection_lost")
    assert told() == there > 0
