"""Sessions used from threads other than the loop's: framing stays intact, nothing retained
is lost after shutdown, worker back-pressure never blocks the loop, a stuck worker does not
keep buffers forever."""
import re
import socket
import struct
import sys
import threading
import time

import pytest

from aoprim import SlabPool
from aoprim.server import Handler, Server

from server_support import (HOST, assert_no_leaks, connect, frame, make_server,  # noqa: F401
                                 read_frame, wait_for)
from aoprim.server.loop import BACKENDS


class Ignore(Handler):
    """Reads and ignores every frame (the tests send from outside the hooks)."""

    def on_read(self, session, data):
        pass


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test here runs on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)         # make every bytecode boundary a chance to interleave
    yield
    sys.setswitchinterval(old)


def run_threads(fns, timeout=60):
    ts = [threading.Thread(target=f) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts)


@pytest.mark.timeout(120)
def test_slots_sent_from_several_threads_keep_u16_framing(make_server, connect, fast_switching):
    """A Slot sent off the loop thread with u16/u32 framing is queued as one item: queued as
    two, header then payload, two threads could interleave them and corrupt the stream
    (this test then sees a header followed by another thread's header)."""
    pool = SlabPool(64, 4096)
    srv = make_server(Ignore(), framing="u16")
    s = connect(srv)
    wait_for(lambda: srv.sessions)
    sess = srv.sessions[0]
    n, k = 5000, 4

    def sender(t):
        def run():
            for i in range(n):
                while True:
                    slot = pool.try_acquire()
                    if slot is not None:
                        break
                    time.sleep(0)       # the pool is the back-pressure here
                body = struct.pack(">II", t, i) * (1 + (i + t) % 5)
                mv = memoryview(slot)
                mv[:len(body)] = body
                mv.release()
                slot.length = len(body)
                sess.send(slot)
                slot.release()
        return run

    got = {t: [] for t in range(k)}
    errs = []

    def reader():
        try:
            for _ in range(n * k):
                body = read_frame(s, "u16")
                t, i = struct.unpack_from(">II", body)
                assert body == struct.pack(">II", t, i) * (len(body) // 8)
                got[t].append(i)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    rt = threading.Thread(target=reader)
    rt.start()
    run_threads([sender(t) for t in range(k)])
    rt.join(60)
    assert not rt.is_alive() and not errs, errs
    assert all(got[t] == list(range(n)) for t in range(k))
    wait_for(lambda: pool.in_use == 0, what="every sent slot released")


def test_send_and_broadcast_after_shutdown_release_what_they_retained():
    pool = SlabPool(64, 8)
    srv = Server(Ignore(), HOST, 0, framing="u16").start()
    c = socket.create_connection(srv.address, timeout=5)
    wait_for(lambda: srv.sessions)
    sess = srv.sessions[0]
    srv.shutdown()
    c.close()
    slot = pool.acquire()
    slot.length = 4
    sess.send(slot)             # dropped: the session is closed
    slot.release()
    assert pool.in_use == 0
    srv.broadcast(b"late")      # off the loop thread, the loop is gone
    assert srv.stats()["tx_slots_in_use"] == 0
    assert_no_leaks(srv)


def test_foreign_send_racing_teardown_never_strands_a_slot(fast_switching):
    """Sends from another thread while the session closes: every retained slot is released
    exactly once, whether it made it into the batch or not."""
    pool = SlabPool(64, 64)
    srv = Server(Ignore(), HOST, 0, framing="u16").start()
    try:
        for _ in range(20):
            c = socket.create_connection(srv.address, timeout=5)
            wait_for(lambda: srv.sessions)
            sess = srv.sessions[0]
            stop = threading.Event()

            def spam():
                while not stop.is_set():
                    slot = pool.try_acquire()
                    if slot is None:
                        time.sleep(0)
                        continue
                    slot.length = 8
                    sess.send(slot)
                    slot.release()

            t = threading.Thread(target=spam)
            t.start()
            time.sleep(0.002)
            sess.abort()
            wait_for(lambda: not srv.sessions, what="the session to go")
            stop.set()
            t.join(10)
            c.close()
            wait_for(lambda: pool.in_use == 0, what="every slot back")
    finally:
        srv.shutdown()
    assert_no_leaks(srv)


def test_worker_backlog_pauses_reading_and_never_blocks_the_loop(make_server, connect):
    """workers=N: a session's queued frames are bounded (its reading pauses), and a full
    completion queue does not block the loop thread in put() -- other sessions (and the loop's
    timers) keep running while every worker is stuck."""
    gate = threading.Event()
    seen = []

    class Slow(Handler):
        def on_read(self, session, data):
            if bytes(data) == b"block":
                gate.wait(30)
            seen.append(bytes(data))
            session.send(data)

    srv = make_server(Slow(), framing="u16", workers=1, worker_backlog=8, worker_queue=1,
                      rx_slot_size=4096)
    a = connect(srv)
    a.sendall(frame(b"block"))
    wait_for(lambda: seen == [] and srv.stats()["frames_in"] >= 1)
    n = 2000
    msgs = [b"a%05d" % i + b"." * 194 for i in range(n)]     # 400 KB: many reads' worth
    sender = threading.Thread(target=a.sendall, args=(b"".join(frame(m) for m in msgs),))
    sender.start()                      # blocks once the server stops reading
    others = [connect(srv) for _ in range(5)]
    for o in others:
        o.sendall(frame(b"hi"))
    # the loop is alive: it accepts, reads, and answers stats while the worker is stuck
    wait_for(lambda: srv.stats()["connections"] == 6, what="accepts while workers stuck")
    time.sleep(0.2)     # give the loop time to read more if it (wrongly) kept reading
    fin = srv.stats()["frames_in"]
    # bounded by the backlog limit plus one read's worth of frames (4096 / 202)
    assert fin <= 1 + 8 + 4096 // 202 + 5, f"reading did not pause: {fin} frames read"
    gate.set()
    assert read_frame(a) == b"block"
    for m in msgs:
        assert read_frame(a) == m
    sender.join(30)
    for o in others:
        assert read_frame(o) == b"hi"


def test_the_shutdown_timeout_says_what_each_session_it_cut_lost(caplog):
    # the bytes still owed to the peer and the frames its worker never ran, each named
    gate = threading.Event()
    entered = threading.Event()

    class Stuck(Handler):
        def on_read(self, session, data):
            for _ in range(256):                # 16 MiB; the peer reads none of it
                session.send(b"r" * 65535)
            entered.set()
            gate.wait(30)

    srv = Server(Stuck(), HOST, 0, framing="u16", workers=1, shutdown_timeout=0.3,
                 max_pending=64 << 20).start()
    try:
        c = socket.create_connection(srv.address, timeout=5)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.sendall(b"".join(frame(b"x%d" % i) for i in range(6)))
        assert entered.wait(10)
        wait_for(lambda: srv.stats()["frames_in"] == 6, 10, "every frame queued")
        srv.shutdown(timeout=20)
    finally:
        gate.set()
    m = re.search(r"shutdown timeout: (\d+) unsent bytes dropped, (\d+) frames queued for "
                  r"the handler dropped", caplog.text)
    assert m, caplog.text
    assert 0 < int(m[1]) <= 256 * 65537 and int(m[2]) == 5
    assert "a worker still busy with it" in caplog.text      # (its on_read still runs)
    for t in list(threading.enumerate()):
        if t.name.startswith("aoprim-worker"):
            t.join(10)
    c.close()
    assert_no_leaks(srv)


def test_a_worker_stuck_past_shutdown_gives_buffers_back_when_it_returns(caplog):
    gate = threading.Event()
    entered = threading.Event()

    class Stuck(Handler):
        def on_read(self, session, data):
            entered.set()
            gate.wait(30)

    srv = Server(Stuck(), HOST, 0, framing="u16", workers=1, shutdown_timeout=0.3).start()
    c = socket.create_connection(srv.address, timeout=5)
    c.sendall(frame(b"x") + struct.pack(">H", 100) + b"partial")
    assert entered.wait(10)
    srv.shutdown(timeout=20)
    assert "worker threads did not exit" in caplog.text
    gate.set()
    for t in list(threading.enumerate()):
        if t.name.startswith("aoprim-worker"):
            t.join(10)
    c.close()
    assert_no_leaks(srv)


class StartsAThread(Handler):
    """Starts a plain ``threading.Thread`` per message and answers whether it is a daemon;
    the thread runs until ``release`` is set (counted in ``finished``)."""

    def __init__(self):
        self.release = threading.Event()
        self.finished = []
        self.threads = []

    def _job(self):
        self.release.wait(30)
        self.finished.append(1)

    def on_read(self, session, data):
        t = threading.Thread(target=self._job)
        t.start()
        self.threads.append(t)
        session.send(b"daemon=%d" % t.daemon)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_thread_a_handler_starts_is_not_made_a_daemon(make_server, connect, workers):
    """As in a plain program or under asyncio: a thread handler code starts is a daemon only
    if asked, whichever thread of the server's it starts on (Thread() copies the daemon flag
    of the thread that creates it, and the server's own threads are daemons) -- so the
    interpreter waits for it at exit instead of killing its job.  The server's threads stay
    daemons to everyone else."""
    h = StartsAThread()
    srv = make_server(h, workers=workers)
    try:
        c = connect(srv)
        c.sendall(b"x")
        assert c.recv(16) == b"daemon=0"
        own = [t for t in threading.enumerate() if t.name.startswith("aoprim-")]
        assert own and all(t.daemon for t in own), [(t.name, t.daemon) for t in own]
    finally:
        h.release.set()
        for t in h.threads:
            t.join(30)
    assert h.finished == [1]


def test_an_idle_worker_takes_a_waiting_session_while_another_worker_is_busy(make_server,
                                                                             connect):
    """workers=2 with sessions waiting in the completion queue while both workers are busy:
    once each worker is free, each takes a session -- neither takes them all in one go and
    runs them one after the other while the other worker sits idle.  Each of the four
    waiting sessions' handlers meets another at a barrier: it passes only if two of them
    run at once."""
    release = [threading.Event(), threading.Event()]
    meet = threading.Barrier(2, timeout=10)
    met = []

    class Gated(Handler):
        def on_read(self, session, data):
            d = bytes(data)
            if d.startswith(b"hold"):
                release[int(d[4:])].wait(30)
            else:
                try:
                    meet.wait()
                    met.append(d)
                except threading.BrokenBarrierError:
                    met.append(b"alone " + d)
            session.send(data)

    srv = make_server(Gated(), framing="u16", workers=2)
    held = [connect(srv) for _ in range(2)]
    for i, c in enumerate(held):
        c.sendall(frame(b"hold%d" % i))
    waiting = [connect(srv) for _ in range(4)]
    wait_for(lambda: srv.stats()["frames_in"] == 2)
    for i, c in enumerate(waiting):
        c.sendall(frame(b"meet%d" % i))
    # (both workers are inside a held frame: the four sessions wait in the queue)
    wait_for(lambda: srv.stats()["frames_in"] == 6)
    release[0].set()
    release[1].set()
    for i, c in enumerate(held):
        assert read_frame(c) == b"hold%d" % i
    for i, c in enumerate(waiting):
        assert read_frame(c) == b"meet%d" % i
    assert sorted(met) == [b"meet%d" % i for i in range(4)], met
