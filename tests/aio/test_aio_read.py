"""The stream transport's read path (aoprim.aio's reader is compiled,
``aoprim.aio._aiotransport.TransportReader``) against asyncio's selector transport and uvloop.

Every scenario runs on a fresh loop of each kind ("asyncio" is the baseline and is asserted
too, so each test can fail for every loop): what the protocol sees (its callbacks, in
order), what the loop's exception handler gets (message, exception, transport, protocol) and
what connection_lost() is given.  The peer is a plain socket; the loop waits on futures
with timeouts, and "nothing more was delivered" is checked after a counted number of loop
iterations with the data already in the kernel -- no sleep stands in for synchronisation.
Where uvloop's own transport differs from asyncio's (its exception-handler messages, the hint
it passes get_buffer(), how it wraps a get_buffer() error) the test asserts uvloop's value
for uvloop (``on(kind, asyncio=..., uvloop=...)``); aoprim.aio is held to asyncio's.
"""
import asyncio
import gc
import os
import socket
import sys
import weakref

import pytest

import aoprim

from test_aio_dropin import kinds, loop_of  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)


class Rec(asyncio.Protocol):
    """Records its callbacks; ``on_data(self, data)`` / ``on_eof(self)`` run inside them."""

    def __init__(self, loop, on_data=None, on_eof=None):
        self.events = []
        self.data = bytearray()
        self.on_data = on_data
        self.on_eof = on_eof
        self.transport = None
        self.lost = loop.create_future()
        self.got = loop.create_future()

    def connection_made(self, transport):
        self.transport = transport
        self.events.append("made")

    def data_received(self, data):
        self.events.append("data")
        self.data += data
        if not self.got.done():
            self.got.set_result(None)
        if self.on_data is not None:
            self.on_data(self, data)

    def eof_received(self):
        self.events.append("eof")
        if self.on_eof is not None:
            return self.on_eof(self)
        return None

    def connection_lost(self, exc):
        self.events.append("lost")
        if not self.lost.done():
            self.lost.set_result(exc)


async def iterations(n):
    for _ in range(n):
        await asyncio.sleep(0)


def on(kind, asyncio, uvloop):
    """What asyncio's transport does (also aoprim.aio's), or uvloop's where it differs."""
    return uvloop if kind == "uvloop" else asyncio


_PEERS = []


@pytest.fixture(autouse=True)
def _close_peers():
    """Every peer socket setup() made is closed when the test ends, passed or failed."""
    yield
    while _PEERS:
        _PEERS.pop().close()


def setup(loop, factory, tcp=False):
    """(transport, protocol, peer, handler contexts) for a loop transport on one end of a
    socketpair (tcp: a loopback TCP connection); every exception-handler call is
    recorded."""
    errors = []
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx))
    if tcp:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            a = socket.create_connection(srv.getsockname())
            b, _ = srv.accept()
    else:
        a, b = socket.socketpair()
    _PEERS.append(b)
    a.setblocking(False)
    tr, pr = loop.run_until_complete(loop.create_connection(factory, sock=a))
    return tr, pr, b, errors


def wait(loop, fut, timeout=10):
    return loop.run_until_complete(asyncio.wait_for(asyncio.shield(fut), timeout))


def contexts(errors):
    return [(c["message"], type(c["exception"]).__name__, str(c["exception"]))
            for c in errors]


@pytest.mark.parametrize("kind", kinds())
def test_pause_reading_inside_data_received(loop_of, kind):
    loop = loop_of(kind)

    def pause(pr, data):
        pr.transport.pause_reading()
    tr, pr, peer, errors = setup(loop, lambda: Rec(loop, on_data=pause))
    peer.sendall(b"one")
    wait(loop, pr.got)
    assert not tr.is_reading()
    peer.sendall(b"two")                         # in the kernel, readable, not read
    loop.run_until_complete(iterations(10))
    assert (pr.events, bytes(pr.data)) == (["made", "data"], b"one")
    pr.on_data = None
    tr.resume_reading()
    assert tr.is_reading()
    loop.run_until_complete(iterations(10))
    assert (pr.events, bytes(pr.data)) == (["made", "data", "data"], b"onetwo")
    tr.close()
    wait(loop, pr.lost)
    assert pr.events[-1] == "lost" and errors == []
    peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_close_inside_data_received_reads_nothing_more(loop_of, kind):
    loop = loop_of(kind)

    def close(pr, data):
        pr.transport.close()
    tr, pr, peer, errors = setup(loop, lambda: Rec(loop, on_data=close))
    peer.sendall(b"first")
    assert wait(loop, pr.lost) is None
    assert pr.events == ["made", "data", "lost"] and bytes(pr.data) == b"first"
    assert tr.is_closing() and errors == []
    try:
        peer.sendall(b"late")                    # after close: never delivered
    except OSError:
        pass
    loop.run_until_complete(iterations(5))
    assert pr.events == ["made", "data", "lost"]
    peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_a_read_queued_in_the_same_iteration_is_dropped_by_close(loop_of, kind):
    # two transports readable in the same iteration, each closing the other from its
    # data_received: whichever runs first, the other's read (already queued) never runs
    loop = loop_of(kind)
    prs = []

    def close_other(pr, data):
        for other in prs:
            if other is not pr:
                other.transport.close()
    t1, p1, peer1, errors = setup(loop, lambda: Rec(loop, on_data=close_other))
    t2, p2, peer2, _ = setup(loop, lambda: Rec(loop, on_data=close_other))
    errors2 = []
    loop.set_exception_handler(lambda lp, ctx: errors2.append(ctx))
    prs += [p1, p2]
    peer1.sendall(b"a")
    peer2.sendall(b"b")
    loop.run_until_complete(asyncio.wait_for(
        asyncio.wait([p1.lost, p2.lost], return_when=asyncio.FIRST_COMPLETED), 10))
    loop.run_until_complete(iterations(5))
    # the first one read closed the other; the other's queued read was dropped
    assert sorted([p1.events, p2.events]) == [["made", "data"], ["made", "lost"]]
    assert errors2 == []
    for t in (t1, t2):
        t.close()
    wait(loop, p1.lost)
    wait(loop, p2.lost)
    peer1.close()
    peer2.close()


@pytest.mark.parametrize("kind", kinds())
def test_exception_in_data_received_is_a_fatal_error(loop_of, kind):
    loop = loop_of(kind)
    boom = ValueError("protocol bug")

    def fail(pr, data):
        raise boom
    tr, pr, peer, errors = setup(loop, lambda: Rec(loop, on_data=fail))
    peer.sendall(b"x")
    assert wait(loop, pr.lost) is boom
    assert pr.events == ["made", "data", "lost"]
    assert contexts(errors) == [
        (on(kind, "Fatal error: protocol.data_received() call failed.",
            "Fatal error on transport UnixTransport"), "ValueError", "protocol bug")]
    assert errors[0]["exception"] is boom
    assert errors[0]["transport"] is tr and errors[0]["protocol"] is pr
    peer.close()


@pytest.mark.parametrize("keep_open", [True, False, None])
@pytest.mark.parametrize("kind", kinds())
def test_eof_and_what_eof_received_returns(loop_of, kind, keep_open):
    loop = loop_of(kind)
    tr, pr, peer, errors = setup(loop, lambda: Rec(loop, on_eof=lambda pr: keep_open))
    peer.sendall(b"last")
    peer.shutdown(socket.SHUT_WR)
    if keep_open:
        loop.run_until_complete(iterations(10))
        assert pr.events == ["made", "data", "eof"]
        assert not tr.is_closing()
        tr.write(b"reply")                       # the protocol may still write
        peer.settimeout(5)
        assert peer.recv(100) == b"reply"
        tr.close()
    assert wait(loop, pr.lost) is None
    assert pr.events == ["made", "data", "eof", "lost"] and bytes(pr.data) == b"last"
    assert errors == []
    peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_exception_in_eof_received_is_a_fatal_error(loop_of, kind):
    loop = loop_of(kind)

    def fail(pr):
        raise KeyError("eof bug")
    tr, pr, peer, errors = setup(loop, lambda: Rec(loop, on_eof=fail))
    peer.shutdown(socket.SHUT_WR)
    assert isinstance(wait(loop, pr.lost), KeyError)
    assert pr.events == ["made", "eof", "lost"]
    assert contexts(errors) == [
        (on(kind, "Fatal error: protocol.eof_received() call failed.",
            "Fatal error on transport UnixTransport"), "KeyError", "'eof bug'")]
    peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_reads_after_close_and_abort_deliver_nothing(loop_of, kind):
    loop = loop_of(kind)
    for how in ("close", "abort"):
        tr, pr, peer, errors = setup(loop, lambda: Rec(loop))
        peer.sendall(b"unread")                  # readable when the transport closes
        getattr(tr, how)()
        assert tr.is_closing() and not tr.is_reading()
        assert wait(loop, pr.lost) is None
        loop.run_until_complete(iterations(5))
        assert pr.events == ["made", "lost"], how
        assert errors == []
        peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_peer_reset_is_connection_lost_with_the_error(loop_of, kind):
    loop = loop_of(kind)
    tr, pr, peer, errors = setup(loop, lambda: Rec(loop), tcp=True)
    peer.sendall(b"x")
    wait(loop, pr.got)
    tr.write(b"y" * 10)                          # unread by the peer: its close resets
    loop.run_until_complete(iterations(3))
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    peer.close()
    assert isinstance(wait(loop, pr.lost), ConnectionResetError)
    assert pr.events == ["made", "data", "lost"]
    assert errors == []                          # an OSError is not reported (not debug)


class BP(asyncio.BufferedProtocol):
    """A BufferedProtocol recording its callbacks; ``buf`` is what get_buffer() returns (an
    exception instance: raised)."""

    def __init__(self, loop, buf):
        self.buf = buf
        self.events = []
        self.got = bytearray()
        self.lost = loop.create_future()
        self.fail_update = None

    def connection_made(self, transport):
        self.transport = transport
        self.events.append("made")

    def get_buffer(self, hint):
        self.events.append(("get", hint))
        if isinstance(self.buf, BaseException):
            raise self.buf
        return self.buf

    def buffer_updated(self, n):
        self.events.append(("updated", n))
        self.got += self.buf[:n]
        if self.fail_update is not None:
            raise self.fail_update

    def eof_received(self):
        self.events.append("eof")

    def connection_lost(self, exc):
        self.events.append("lost")
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.parametrize("what", ["empty bytearray", "empty memoryview", "raises"])
@pytest.mark.parametrize("kind", kinds())
def test_get_buffer_empty_or_failing_is_a_fatal_error(loop_of, kind, what):
    loop = loop_of(kind)
    buf = {"empty bytearray": bytearray(), "empty memoryview": memoryview(bytearray(8))[:0],
           "raises": OSError(5, "no buffer")}[what]
    tr, pr, peer, errors = setup(loop, lambda: BP(loop, buf))
    peer.sendall(b"data")
    exc = wait(loop, pr.lost)
    assert pr.events[0] == "made" and pr.events[-1] == "lost"
    assert "eof" not in pr.events and not any(e[0] == "updated" for e in pr.events[1:-1])
    if kind == "uvloop":
        # uvloop wraps whatever happened in a RuntimeError of its own, always reported
        assert contexts(errors) == [("Fatal error on transport UnixTransport", "RuntimeError",
                                     "unhandled error (or an empty buffer) in get_buffer()")]
    elif what == "raises":
        # asyncio: the OSError itself, a fatal error reported only in debug mode
        assert exc is buf and errors == []
    else:
        assert isinstance(exc, RuntimeError)
        assert contexts(errors) == [("Fatal error: protocol.get_buffer() call failed.",
                                     "RuntimeError", "get_buffer() returned an empty buffer")]
    peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_buffered_protocol_small_buffer_then_eof(loop_of, kind):
    loop = loop_of(kind)
    tr, pr, peer, errors = setup(loop, lambda: BP(loop, bytearray(3)))
    peer.sendall(b"abcdefgh")
    peer.shutdown(socket.SHUT_WR)
    assert wait(loop, pr.lost) is None
    assert bytes(pr.got) == b"abcdefgh"
    updates = [e[1] for e in pr.events if e[0] == "updated"]
    assert updates == [3, 3, 2]                  # never more than the buffer's size
    assert pr.events[-2:] == ["eof", "lost"] and errors == []
    assert {e[1] for e in pr.events if e[0] == "get"} == {on(kind, -1, 65536)}
    peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_exception_in_buffer_updated_is_a_fatal_error(loop_of, kind):
    loop = loop_of(kind)
    tr, pr, peer, errors = setup(loop, lambda: BP(loop, bytearray(16)))
    pr.fail_update = ZeroDivisionError("update bug")
    peer.sendall(b"data")
    assert isinstance(wait(loop, pr.lost), ZeroDivisionError)
    assert contexts(errors) == [(on(kind, "Fatal error: protocol.buffer_updated() call failed.",
                                    "Fatal error on transport UnixTransport"),
                                 "ZeroDivisionError", "update bug")]
    peer.close()


@pytest.mark.parametrize("kind", kinds())
def test_switching_to_a_buffered_protocol_inside_data_received(loop_of, kind):
    # set_protocol() from data_received: the next read goes through get_buffer()
    loop = loop_of(kind)
    bp = BP(loop, bytearray(64))

    def switch(pr, data):
        pr.transport.set_protocol(bp)
    tr, pr, peer, errors = setup(loop, lambda: Rec(loop, on_data=switch))
    peer.sendall(b"plain")
    wait(loop, pr.got)
    peer.sendall(b"buffered")
    peer.shutdown(socket.SHUT_WR)
    assert wait(loop, bp.lost) is None
    assert (pr.events, bytes(pr.data)) == (["made", "data"], b"plain")
    assert bytes(bp.got) == b"buffered" and bp.events[-2:] == ["eof", "lost"]
    assert errors == []
    peer.close()


# ---- aoprim.aio only: the compiled reader itself --------------------------------------------

def _aoprim_loop():
    aio = pytest.importorskip("aoprim.aio")
    return aio.new_event_loop()


def test_the_reader_is_compiled_and_runs_no_python_frame_of_aoprims():
    from aoprim.aio._aiotransport import TransportReader
    loop = _aoprim_loop()
    try:
        tr, pr, peer, errors = setup(loop, lambda: Rec(loop))
        assert type(tr._read_ready) is TransportReader
        assert tr._read_ready.protocol is pr and tr._protocol is pr and not tr._buffered
        frames = []
        # a frame of the installed package's own Python; the folder, not a substring of the
        # path: a checkout cloned as .../aoprim/ holds this test file too
        pkg = os.path.join(os.path.dirname(os.path.abspath(aoprim.__file__)), "")

        def prof(frame, event, arg):
            if event == "call" and os.path.abspath(frame.f_code.co_filename).startswith(pkg):
                frames.append(frame.f_code.co_name)
        peer.sendall(b"x" * 1000)
        sys.setprofile(prof)
        try:
            wait(loop, pr.got)
        finally:
            sys.setprofile(None)
        assert bytes(pr.data) == b"x" * 1000
        # the loop's own Python (run_forever, _run_once) may run; no transport code does
        assert not [f for f in frames if "read" in f or f == "data_received"], frames
        tr.close()
        wait(loop, pr.lost)
        # every close path leaves the reader idle: no socket, no protocol, no more reads
        r = tr._read_ready
        assert (r.sock, r.protocol, r.conn_lost >= 1) == (None, None, True)
        r()                                      # a stray call reads nothing, raises nothing
        assert errors == []
        peer.close()
    finally:
        loop.close()


def test_reader_and_transport_cycle_is_collected():
    # the reader and its transport reference each other; the collector frees both (it
    # clears the transport's __dict__, never the reader's fields)
    loop = _aoprim_loop()
    try:
        tr, pr, peer, errors = setup(loop, lambda: Rec(loop))
        tr.close()
        wait(loop, pr.lost)
        wr = weakref.ref(tr)
        reader = tr._read_ready
        reader()                     # after close: reads nothing, raises nothing
        del tr, pr, reader
        gc.collect()
        assert wr() is None
        peer.close()
    finally:
        loop.close()
