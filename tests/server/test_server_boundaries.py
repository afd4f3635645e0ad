"""The server at its trust boundaries: what a caller passes (ports, seconds, a listening
socket), what a hook raises on a worker, and the promises a worker's sends keep (one frame
encoder, order, the clocks, max_pending, nothing leaked when a session cannot register).
Each test sets up one scenario the server could get wrong and fails if it does."""
import array
import logging
import math
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from aoprim.server import Handler, Server
from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS

from server_support import (HOST, assert_no_leaks, connect, frame, make_server,  # noqa: F401
                                 open_fds, read_frame, recv_exact, recv_until_closed,
                                 wait_for)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


# -- ports out of range -----------------------------------------------------------------------

@pytest.mark.parametrize("port", [99999, 65536, -1])
def test_port_out_of_range_is_refused(port):
    fds = open_fds()
    with pytest.raises(ValueError, match="port must be"):
        Server(Echo(), HOST, port)
    assert open_fds() == fds


def test_port_of_wrong_type_is_refused():
    with pytest.raises(TypeError, match="port must be"):
        Server(Echo(), HOST, True)


def test_cli_port_out_of_range_is_a_usage_error():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--port", "99999"],
                       capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "listening" not in r.stdout
    assert "65535" in r.stderr and "Traceback" not in r.stderr


# -- shutdown() while serve_forever() runs in a caller's thread -------------------------------

def test_shutdown_stops_and_waits_for_serve_forever_in_a_caller_thread(backend):
    srv = Server(Echo(), HOST, 0, backend=backend)
    t = threading.Thread(target=srv.serve_forever)
    t.start()
    c = socket.create_connection(srv.address, timeout=10)
    c.sendall(b"hi")
    assert recv_exact(c, 2) == b"hi"
    srv.shutdown(timeout=15)
    # returned only once the loop has stopped and cleaned up
    assert srv.stats()["connections"] == 0
    assert srv.live_sessions == 0
    t.join(10)
    assert not t.is_alive()
    c.close()
    assert_no_leaks(srv)


# -- a listening AF_UNIX socket passed as sock= -----------------------------------------------

def test_unix_listener_reports_its_path(tmp_path, caplog):
    path = str(tmp_path / "t")
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(8)
    srv = Server(Echo(), sock=ls)
    assert srv.address == path
    with caplog.at_level(logging.INFO, logger="aoprim.server"):
        srv.start()
    try:
        assert any(f"listening on {path} " in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(10)
        c.connect(path)
        c.sendall(b"x")
        assert recv_exact(c, 1) == b"x"
        c.close()
    finally:
        srv.shutdown(timeout=15)
    assert_no_leaks(srv)


# -- non-finite seconds -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["shutdown_timeout", "close_linger", "idle_timeout",
                                  "frame_timeout"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_seconds_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        Server(Echo(), HOST, 0, **{name: value})


# -- what a hook raises on a worker -------------------------------------------------------------

class Raiser(Handler):
    """Frame b"boom": wait until more frames of this session are queued behind it, then do
    ``action`` (raise something, or abort()).  Records every frame delivered."""

    def __init__(self, action):
        self.action = action
        self.got = []
        self.closed = []
        self.lock = threading.Lock()

    def on_read(self, session, data):
        data = bytes(data)
        with self.lock:
            self.got.append((session.id, data))
        if data == b"boom":
            # more frames of this session are queued behind this one (white box: the
            # worker backlog), so that delivery after the failure would show
            wait_for(lambda: len(session.work.backlog) >= 3, 10, "frames queued")
            self.action(session)
        else:
            session.send(data)

    def on_close(self, session, exc):
        with self.lock:
            self.closed.append((session.id, type(exc)))


def _raise(exc_type):
    def act(session):
        raise exc_type("from on_read")
    return act


def _abort(session):
    session.abort()


def _close(session):
    session.close()


@pytest.mark.parametrize("action,exc", [
    (_raise(SystemExit), SystemExit),
    (_raise(__import__("asyncio").CancelledError), __import__("asyncio").CancelledError),
    (_raise(KeyboardInterrupt), KeyboardInterrupt),
    (_raise(RuntimeError), RuntimeError),
    (_abort, type(None)),
    (_close, type(None)),
], ids=["SystemExit", "CancelledError", "KeyboardInterrupt", "RuntimeError", "abort", "close"])
def test_worker_failure_closes_that_session_only_and_stops_its_delivery(make_server, action,
                                                                       exc):
    h = Raiser(action)
    srv = make_server(h, framing="u16", workers=1)
    a = socket.create_connection(srv.address, timeout=10)
    a.sendall(b"".join(frame(p) for p in (b"boom", b"f1", b"f2", b"f3", b"f4")))
    data, how = recv_until_closed(a)
    assert data == b""                      # nothing delivered after the failure was echoed
    wait_for(lambda: h.closed, 10, "on_close")
    a.close()
    assert [d for sid, d in h.got] == [b"boom"]
    assert h.closed == [(1, exc)]
    # the worker lives on: the next client is served
    b = socket.create_connection(srv.address, timeout=10)
    b.sendall(frame(b"next"))
    assert read_frame(b) == b"next"
    b.close()
    srv.shutdown(timeout=15)
    assert srv.live_sessions == 0
    assert_no_leaks(srv)


# -- one encoder -- a worker's frame header counts bytes, not items -------------------------

class SendWhat(Handler):
    """On any frame, send each payload of ``payloads`` (from wherever on_read runs)."""

    def __init__(self, payloads):
        self.payloads = payloads

    def on_read(self, session, data):
        for p in self.payloads:
            session.send(p)


def _typed_payloads():
    base = bytes(range(48))
    return [b"ab", bytearray(b"cde"), memoryview(base)[3:9], memoryview(base)[::2],
            memoryview(base).cast("B", (6, 8)), array.array("I", [1, 2]),
            array.array("H", [7]), array.array("d", [1.5, -2.0]), b""]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["u16", "u32"])
def test_worker_and_loop_thread_frame_typed_payloads_alike(make_server, workers, kind):
    payloads = _typed_payloads()
    srv = make_server(SendWhat(payloads), framing=kind, workers=workers)
    c = socket.create_connection(srv.address, timeout=10)
    c.sendall(frame(b"go", kind))
    for p in payloads:
        assert read_frame(c, kind) == memoryview(p).tobytes()
    c.close()


# -- send, broadcast, send from one thread leave in that order --------------------------------

class Interleave(Handler):
    def __init__(self):
        self.n = 0

    def on_read(self, session, data):
        if bytes(data) != b"go":
            return
        for i in range(30):
            session.send(b"s%d" % (3 * i))
            session.server.broadcast(b"b%d" % (3 * i + 1))
            session.send(b"s%d" % (3 * i + 2))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["raw", "u16"])
def test_send_broadcast_send_from_one_thread_keep_their_order(make_server, workers, kind):
    srv = make_server(Interleave(), framing=kind, workers=workers)
    c = socket.create_connection(srv.address, timeout=10)
    wait_for(lambda: len(srv.sessions) == 1, 10, "session")
    want = [(b"s%d" if i % 3 != 1 else b"b%d") % i for i in range(90)]
    if kind == "raw":
        c.sendall(b"go")
        got = recv_exact(c, len(b"".join(want)))
        assert got == b"".join(want)
    else:
        c.sendall(frame(b"go"))
        assert [read_frame(c) for _ in want] == want
    c.close()


def test_broadcast_from_a_worker_of_a_big_payload_and_a_slot(make_server):
    from aoprim import SlabPool
    pool = SlabPool(4096, 2)

    class Big(Handler):
        def on_read(self, session, data):
            session.send(b"1")
            session.server.broadcast(b"x" * 3000)
            slot = pool.acquire()
            memoryview(slot)[:5] = b"slot!"
            slot.length = 5
            session.server.broadcast(slot)
            slot.release()
            session.send(b"3")

    srv = make_server(Big(), framing="u32", workers=1)
    c = socket.create_connection(srv.address, timeout=10)
    wait_for(lambda: len(srv.sessions) == 1, 10, "session")
    c.sendall(frame(b"go", "u32"))
    assert [read_frame(c, "u32") for _ in range(4)] == [b"1", b"x" * 3000, b"slot!", b"3"]
    c.close()
    wait_for(lambda: pool.in_use == 0, 10, "the broadcast slot back")


@pytest.mark.parametrize("workers", [0, 1])
def test_too_long_payload_raises_in_the_sending_thread(make_server, workers):
    errors = []

    class TooLong(Handler):
        def on_read(self, session, data):
            for fn in (lambda: session.send(b"x" * 65536),
                       lambda: session.server.broadcast(b"x" * 65536),
                       lambda: session.send(5)):
                try:
                    fn()
                except (ValueError, TypeError) as e:
                    errors.append(type(e))
            session.send(b"ok")

    srv = make_server(TooLong(), framing="u16", workers=workers)
    c = socket.create_connection(srv.address, timeout=10)
    c.sendall(frame(b"go"))
    assert read_frame(c) == b"ok"
    assert errors == [ValueError, ValueError, TypeError]
    c.close()


# -- the frame and idle clocks stop while the server holds a session --------------------------

class Gate(Handler):
    """Frame b"hold": pause_reading (inline) or block the worker until ``release`` is set
    (workers, with a small backlog: the backlog pauses reading).  Echoes the rest."""

    def __init__(self, workers):
        self.workers = workers
        self.release = threading.Event()
        self.held = threading.Event()

    def on_read(self, session, data):
        data = bytes(data)
        if data == b"hold":
            if self.workers:
                self.held.set()
                assert self.release.wait(30)
            else:
                session.pause_reading()
                self.held.set()
                session.server.loop.call_later(0, lambda: None)
            return
        session.send(data)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("which", ["frame", "idle"])
def test_timeouts_do_not_cut_a_session_the_server_holds(make_server, workers, which):
    h = Gate(workers)
    kw = ({"frame_timeout": 0.3} if which == "frame" else
          {"idle_timeout": 0.3, "frame_timeout": None})
    srv = make_server(h, framing="u16", workers=workers, worker_backlog=2, **kw)
    c = socket.create_connection(srv.address, timeout=10)
    # "hold", then frames that fill the worker backlog, then half a frame -- in one read
    tail = frame(b"late")
    burst = frame(b"hold") + b"".join(frame(b"q%d" % i) for i in range(4))
    c.sendall(burst + (tail[:3] if which == "frame" else b""))
    assert h.held.wait(10)
    time.sleep(1.0)         # the subject of the test: > 3x the timeout while held
    assert srv.stats()["closes"].get("timeout") is None, srv.stats()["closes"]
    if workers:
        h.release.set()
    else:
        s = srv.sessions[0]
        srv.loop.call_soon_threadsafe(s.resume_reading)
    c.sendall(tail[3:] if which == "frame" else tail)
    assert [read_frame(c) for _ in range(5)] == [b"q0", b"q1", b"q2", b"q3", b"late"]
    c.close()


def test_a_peer_that_reads_nothing_is_still_cut_under_back_pressure(make_server):
    """Back-pressure from a peer that takes none of our bytes does not stop its clocks."""
    class Flood(Handler):
        def on_read(self, session, data):
            for _ in range(64):
                session.send(b"z" * 60000)

    srv = make_server(Flood(), framing="u16", idle_timeout=0.3, frame_timeout=None,
                      max_pending=64 << 20)
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.settimeout(10)
    c.connect(srv.address)
    c.sendall(frame(b"go"))
    wait_for(lambda: srv.stats()["closes"].get("timeout") == 1, 10, "the idle timeout")
    c.close()


# -- a session that cannot register with the loop leaks nothing ------------------------------

class Counting(Echo):
    def __init__(self):
        self.connected = 0
        self.closed = 0

    def on_connect(self, session):
        self.connected += 1

    def on_close(self, session, exc):
        self.closed += 1


@pytest.mark.parametrize("workers", [0, 1])
def test_registration_failure_at_accept_leaks_nothing(make_server, workers):
    import errno
    h = Counting()
    srv = make_server(h, workers=workers)
    loop = srv.loop
    real = loop.set_callbacks
    fail = {"n": 1}
    listen_fd = srv._lsock.fileno()

    def set_callbacks(fd, r, w):    # epoll_ctl(ADD) at max_user_watches
        if fd != listen_fd and r is not None and fail["n"]:
            fail["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, r, w)

    loop.set_callbacks = set_callbacks
    try:
        a = socket.create_connection(srv.address, timeout=10)
        assert recv_until_closed(a)[0] == b""       # closed at once, nothing read
        a.close()
        wait_for(lambda: srv.stats()["connections"] == 0 and srv.live_sessions == 0, 10,
                 "the failed session to be gone")
        st = srv.stats()
        assert st["rx_slots_in_use"] == 1 and st["tx_slots_in_use"] == 0   # idle: scratch
        assert st["closes"].get("register") == 1
        assert h.connected == 0 and h.closed == 0   # the handler never met it
        b = socket.create_connection(srv.address, timeout=10)   # the next one is served
        b.sendall(b"ok")
        assert recv_exact(b, 2) == b"ok"
        b.close()
    finally:
        del loop.set_callbacks


# -- max_pending is checked where a worker's send is queued -----------------------------------

def test_max_pending_bounds_a_workers_sends_while_the_loop_is_busy(make_server):
    loop_busy = threading.Event()
    loop_free = threading.Event()
    accepted = []

    class Flood(Handler):
        def on_read(self, session, data):
            srv.loop.call_soon_threadsafe(block_loop)
            assert loop_busy.wait(10)
            n = 0
            for _ in range(200):
                session.send(b"z" * 60000)
                if session.closed:
                    break
                n += 1
            accepted.append(n)
            loop_free.set()

    def block_loop():               # the loop thread stays here until the worker is done
        loop_busy.set()
        assert loop_free.wait(30)

    srv = make_server(Flood(), framing="u32", workers=1, max_pending=1 << 20)
    c = socket.create_connection(srv.address, timeout=10)
    c.sendall(frame(b"go", "u32"))
    wait_for(lambda: accepted, 30, "the worker to finish")
    # at most max_pending bytes (plus one send's worth) were ever queued for the session
    assert accepted[0] * 60004 <= (1 << 20), accepted
    wait_for(lambda: srv.stats()["closes"].get("max_pending") == 1, 10, "the cut")
    c.close()


# -- shutdown from a handler, a start that fails, back-pressure and a worker's backlog ---------

@pytest.mark.parametrize("workers", [0, 1])
def test_shutdown_from_a_handler_starts_it_without_waiting_for_itself(make_server, workers):
    done = threading.Event()

    class Stopper(Handler):
        def on_read(self, session, data):
            session.server.shutdown()
            done.set()

    srv = make_server(Stopper(), workers=workers, shutdown_timeout=30)
    c = socket.create_connection(srv.address, timeout=10)
    t0 = time.monotonic()
    c.sendall(b"stop")
    assert done.wait(10)
    assert time.monotonic() - t0 < 5    # (before: a worker waited for the shutdown, which
    srv.shutdown(timeout=15)            # waited for the worker: shutdown_timeout, then
    c.close()                           # an error)
    assert_no_leaks(srv)


def test_a_half_closed_peer_is_not_idle_cut_while_workers_owe_it_replies(make_server):
    release = threading.Event()

    class Slow(Handler):
        def on_read(self, session, data):
            release.wait(30)
            session.send(data)

    srv = make_server(Slow(), framing="u16", workers=1, idle_timeout=0.3, frame_timeout=None)
    c = socket.create_connection(srv.address, timeout=10)
    c.sendall(frame(b"a") + frame(b"b"))
    c.shutdown(socket.SHUT_WR)
    time.sleep(1.0)                 # the subject: > 3x idle_timeout while the worker works
    release.set()
    assert [read_frame(c), read_frame(c)] == [b"a", b"b"]
    c.close()


def test_a_start_that_fails_leaves_a_stopped_server(monkeypatch):
    from aoprim.server import server as server_mod
    fds = open_fds()
    srv = Server(Echo(), HOST, 0)

    def boom(*a, **k):
        raise MemoryError("injected")

    monkeypatch.setattr(server_mod, "RxArena", boom)
    with pytest.raises(MemoryError):
        srv.start()
    t0 = time.monotonic()
    srv.shutdown(timeout=30)            # returns at once: nothing is running
    assert time.monotonic() - t0 < 1
    assert open_fds() == fds


@pytest.mark.parametrize("st,timeout", [(threading.TIMEOUT_MAX, None), (5.0, math.inf),
                                        (5.0, 1e300)])
def test_huge_finite_shutdown_timeouts_wait_instead_of_overflowing(st, timeout):
    """The largest shutdown_timeout a thread join takes (larger ones are refused when the
    Settings are built: tests/server/test_settings.py), and any shutdown(timeout=) however large."""
    srv = Server(Echo(), HOST, 0, shutdown_timeout=st).start()
    srv.shutdown(timeout=timeout)
    assert_no_leaks(srv)


@pytest.mark.parametrize("workers", [0, 1])
def test_raw_sends_take_and_refuse_the_same_types_on_every_thread(make_server, workers):
    results = []

    class Types(Handler):
        def on_read(self, session, data):
            out = []
            for v in (5, "s", None, [1], array.array("I", [1]), memoryview(b"abcdef")[::2],
                      b""):
                try:
                    session.send(v)
                    out.append("ok")
                except TypeError:
                    out.append("TypeError")
            results.append(out)
            session.send(b"!")

    srv = make_server(Types(), workers=workers)
    c = socket.create_connection(srv.address, timeout=10)
    c.sendall(b"x")
    assert recv_exact(c, 8) == b"\x01\x00\x00\x00ace!"
    assert results == [["TypeError"] * 4 + ["ok"] * 3]
    c.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_frames_held_back_by_back_pressure_are_delivered_after_it(make_server, workers):
    """Inline: a reply over high_water pauses reading between two frames of one read; the
    rest of that read must be delivered once the peer has drained the replies."""
    class Big(Handler):
        def on_read(self, session, data):
            session.send(bytes(data) * 2000)     # 2000x the frame: over high_water at once

    srv = make_server(Big(), framing="u32", workers=workers, high_water=4096, low_water=1024,
                      max_pending=64 << 20)
    c = socket.create_connection(srv.address, timeout=10)
    frames = [b"%03d" % i for i in range(50)]
    c.sendall(b"".join(frame(f, "u32") for f in frames))
    for f in frames:
        assert read_frame(c, "u32") == f * 2000
    c.close()


@pytest.mark.timeout(60)
def test_worker_backlog_is_bounded_within_one_read(make_server):
    """worker_backlog=4 let one read of 2000 small frames all queue for a blocked worker
    (the pause applied only after the read's last frame)."""
    go = threading.Event()
    got = []

    class Blocked(Handler):
        def on_read(self, session, data):
            if not got:
                assert go.wait(30)
            got.append(bytes(data))

    srv = make_server(Blocked(), framing="u16", workers=1, worker_backlog=4)
    c = socket.create_connection(srv.address, timeout=10)
    try:
        frames = [b"%d" % i for i in range(2000)]
        c.sendall(b"".join(frame(f) for f in frames))
        wait_for(lambda: srv.sessions and srv.sessions[0].work.backlog, 10, "frames queued")
        s = srv.sessions[0]
        # loopback: every byte is in the server's receive queue once sendall() returned, so
        # a few whole loop iterations give the receiver every chance to read and deliver
        # all it would (an iteration ends when the callback below runs)
        for _ in range(3):
            seen = threading.Event()
            srv.loop.call_soon_threadsafe(seen.set)
            assert seen.wait(10)
        backlog = len(s.work.backlog)
        go.set()
        wait_for(lambda: len(got) == 2000, 20, "every frame")
        assert got == frames
        assert backlog <= 5, backlog
    finally:
        go.set()
        c.close()
