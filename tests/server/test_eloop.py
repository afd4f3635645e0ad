"""The compiled Layer 1 core (aoprim.server._eloop.EpollCore, the server's ``epoll``
backend): what the shared contract tests in test_loop.py do not reach -- the C dispatch's
corner cases, signals during the GIL-free wait, the fd table, the close/call_soon_threadsafe
race and the GC."""
import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest

import aoprim
from aoprim.server._eloop import EpollCore, EpollTimer
from aoprim.server.backends import create_loop
from aoprim.server.loop import EventLoop, Timer

from support import run_threads, skip_nomemory_on_free_threaded

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(aoprim.__file__)))


@pytest.fixture
def loop():
    lp = create_loop("epoll")
    yield lp
    lp.close()


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_it_is_the_compiled_core_behind_the_interface(loop):
    assert isinstance(loop, EpollCore) and isinstance(loop, EventLoop)
    t = loop.call_later(10, print)
    assert isinstance(t, EpollTimer) and isinstance(t, Timer)
    assert loop.pending_timers == 1
    t.cancel()
    assert t.cancelled


def test_close_returns_both_fds_and_call_soon_threadsafe_is_refused():
    before = open_fds()
    lp = create_loop("epoll")
    assert open_fds() == before + 2          # the epoll fd and the eventfd
    lp.call_soon(lp.stop)
    lp.run()
    lp.close()
    assert open_fds() == before
    assert lp.closed
    assert lp.call_soon_threadsafe(print) is False
    lp.close()                               # idempotent


def test_bad_registrations_raise_clearly(loop):
    with pytest.raises(ValueError):
        loop.set_callbacks(-1, print, None)
    r, w = socket.socketpair()
    fd = r.fileno()
    r.close()
    w.close()
    with pytest.raises(OSError):             # EBADF from epoll_ctl, nothing registered
        loop.set_callbacks(fd, print, None)
    assert loop.reader_of(fd) is None
    loop.remove(fd)                          # forgetting an unknown fd is harmless
    loop.set_callbacks(10 ** 6, None, None)  # unregistering beyond the table: nothing to do


def test_a_high_fd_grows_the_table(loop):
    r, w = socket.socketpair()
    high = os.dup2(r.fileno(), 900)
    got = []
    try:
        def on_read():
            got.append(os.read(high, 10))
            loop.stop()
        loop.add_reader(high, on_read)
        assert loop.reader_of(high) is on_read
        w.send(b"hi")
        loop.run()
        assert got == [b"hi"]
    finally:
        loop.remove(high)
        os.close(high)
        r.close()
        w.close()


def test_a_callback_that_unregisters_a_later_ready_fd_keeps_it_from_running(loop):
    """Two fds ready in one wait; the first callback forgets the second: it must not run
    (its entry in the C array of events is stale)."""
    a, a2 = socket.socketpair()
    b, b2 = socket.socketpair()
    calls = []
    try:
        def on_a():
            calls.append("a")
            a.recv(10)
            loop.remove(b.fileno())
            loop.remove(a.fileno())

        def on_b():
            calls.append("b")
            b.recv(10)
            loop.remove(b.fileno())
            loop.remove(a.fileno())
        loop.add_reader(a.fileno(), on_a)
        loop.add_reader(b.fileno(), on_b)
        a2.send(b"1")
        b2.send(b"2")
        loop.call_later(0.05, loop.stop)
        loop.run()
        assert calls in (["a"], ["b"])
    finally:
        for s in (a, a2, b, b2):
            s.close()


def test_a_read_callback_that_drops_its_writer_stops_the_write_callback(loop):
    r, w = socket.socketpair()
    calls = []
    try:
        def on_read():
            calls.append("r")
            r.recv(10)
            loop.set_callbacks(r.fileno(), None, None)
            loop.stop()

        def on_write():
            calls.append("w")
        loop.set_callbacks(r.fileno(), on_read, on_write)   # writable at once, readable too
        w.send(b"x")
        loop.run()
        assert calls == ["r"]
        # and a callback that replaces itself costs no epoll_ctl but takes effect
        loop.set_callbacks(r.fileno(), None, lambda: (calls.append("w2"), loop.stop()))
        loop.run()
        assert calls[-1] == "w2"
    finally:
        loop.remove(r.fileno())
        r.close()
        w.close()


def test_a_timer_never_fires_before_it_is_due(loop):
    seen = []
    for d in (0.001, 0.0105, 0.03):
        t0 = loop.clock()
        loop.call_at(t0 + d, lambda t0=t0, d=d: seen.append(loop.time() - (t0 + d)))
    loop.call_later(0.05, loop.stop)
    loop.run()
    assert len(seen) == 3
    assert min(seen) >= 0, seen


@pytest.mark.timeout(30)
def test_sigint_during_the_gil_free_wait_ends_run_with_keyboardinterrupt(loop):
    """The wait releases the GIL with no timer due: SIGINT must still end run() (epoll_wait
    returns EINTR, the handlers run, KeyboardInterrupt propagates: a BaseException)."""
    assert threading.current_thread() is threading.main_thread()
    main = threading.get_ident()
    started = threading.Event()
    loop.call_soon(started.set)

    def kicker():
        started.wait(10)
        while loop.running and loop.sleeps == 0:
            os.sched_yield()
        signal.pthread_kill(main, signal.SIGINT)
    t = threading.Thread(target=kicker)
    # (SIGINT may have been inherited ignored: a background job of a non-interactive shell)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t.start()
        with pytest.raises(KeyboardInterrupt):
            loop.run()
    finally:
        t.join(10)
        signal.signal(signal.SIGINT, old)
    assert not loop.running


@pytest.mark.timeout(30)
def test_a_signal_delivered_to_another_thread_still_wakes_the_loop(loop):
    """The signal lands on a worker thread: the main thread's epoll_wait gets no EINTR, and
    with no timer and no event it would sleep for ever.  run() sets Python's signal wake-up
    fd to a pipe it watches, so the loop wakes, runs the handler and ends run().  The
    previous wake-up fd is back afterwards, and the pipe is closed."""
    before = open_fds()
    got = []

    def handler(signum, frame):
        got.append(threading.get_ident())
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGUSR1, handler)
    prev = signal.set_wakeup_fd(-1)
    try:
        def kicker():
            while loop.sleeps == 0:
                os.sched_yield()
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)   # to this thread
        t = threading.Thread(target=kicker)
        t.start()
        with pytest.raises(KeyboardInterrupt):
            loop.run()
        t.join(10)
        assert got == [threading.get_ident()]       # the handler ran on the main thread
        assert signal.set_wakeup_fd(-1) == -1       # ours was taken away again
        assert open_fds() == before
    finally:
        signal.signal(signal.SIGUSR1, old)
        signal.set_wakeup_fd(prev)


@pytest.mark.timeout(30)
def test_a_signal_whose_handler_returns_does_not_end_the_wait(loop):
    """PEP 475: EINTR with a handler that does not raise retries the wait (with the time
    left), and the loop goes on to its timer."""
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append("usr1"))
    try:
        main = threading.get_ident()
        fired = []
        t0 = loop.clock()       # before call_later: the deadline is measured from its clock
        loop.call_later(0.3, lambda: (fired.append(loop.time()), loop.stop()))

        def kicker():
            while loop.sleeps == 0:
                os.sched_yield()
            signal.pthread_kill(main, signal.SIGUSR1)
        t = threading.Thread(target=kicker)
        t.start()
        loop.run()
        t.join(10)
        assert got == ["usr1"]
        assert fired and fired[0] - t0 >= 0.3 - 1e-3
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.timeout(60)
def test_call_soon_threadsafe_racing_close_never_loses_a_promise_or_an_fd():
    """Producers hammer call_soon_threadsafe while the loop runs, stops and closes: a call
    that returned True was queued before close (it ran, or close dropped it with the queue),
    a call after close returns False, nothing raises, and both fds are gone after close --
    no producer ever writes into an fd number the process reused."""
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)     # hand the GIL around often: more interleavings per round
    try:
        for _ in range(6):
            _race_round()
    finally:
        sys.setswitchinterval(old_switch)


def _race_round():
    before = open_fds()
    lp = create_loop("epoll")
    ran = []
    accepted = [0] * 4
    refused = [0] * 4

    def producer(k):           # runs until the loop has refused it 50 times
        while True:
            if lp.call_soon_threadsafe(ran.append, k):
                accepted[k] += 1
            else:
                refused[k] += 1
                if refused[k] > 50:
                    return
    ts = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    lp.call_later(0.005, lp.stop)
    lp.run()
    lp.close()
    for t in ts:
        t.join(10)
    assert all(not t.is_alive() for t in ts)
    assert len(ran) <= sum(accepted)
    assert refused == [51] * 4
    assert lp.call_soon_threadsafe(print) is False
    assert open_fds() == before


@pytest.mark.timeout(60)
def test_wakeups_from_many_threads_count_every_item():
    """4 threads x 5000 call_soon_threadsafe onto a loop that sleeps in between: every item
    runs exactly once, in each producer's order (the Dekker pair loses no wake-up)."""
    lp = create_loop("epoll")
    n = 5000
    got = []
    done = threading.Event()
    t = threading.Thread(target=lp.run)
    t.start()
    try:
        def producer(k):
            for i in range(n):
                lp.call_soon_threadsafe(got.append, (k, i))
                if i % 512 == 0:
                    os.sched_yield()     # let the loop drain and go back to sleep
        run_threads([lambda k=k: producer(k) for k in range(4)])
        lp.call_soon_threadsafe(done.set)
        assert done.wait(20), "a wake-up was lost"
    finally:
        lp.stop()
        t.join(10)
        lp.close()
    assert len(got) == 4 * n
    for k in range(4):
        assert [i for kk, i in got if kk == k] == list(range(n))


def test_a_loop_in_a_garbage_cycle_is_collected_and_gives_its_fds_back():
    """The loop sits in cycles (fd table -> bound method -> object -> loop; timer -> loop);
    unclosed and dropped, the GC frees it and __dealloc__ closes its fds."""
    before = open_fds()
    r, w = socket.socketpair()

    class Owner:
        def on_read(self):
            pass
    o = Owner()
    lp = create_loop("epoll")
    o.loop = lp
    lp.add_reader(r.fileno(), o.on_read)
    lp.call_later(5, o.on_read)
    lp.call_soon(o.on_read)
    lp.add_iteration_hook(o.on_read)
    ref = weakref.ref(lp)
    del lp, o
    gc.collect()
    assert ref() is None
    r.close()
    w.close()
    assert open_fds() == before


def run_debug(code):
    env = dict(os.environ, PYTHONMALLOC="debug", PYTHONPATH=PKG_PARENT)
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr
    return r.stdout


@pytest.mark.timeout(150)
def test_gc_clearing_the_cycle_first_leaves_a_usable_loop():
    """STYLE habit 13: cycles through the loop (fd table, timers, ready queue, hooks ->
    an object -> the loop) are collected, whatever the GC's order; finalizers that run
    during the collection may use the loop (register, schedule, cancel, unregister) and
    find it whole.  EpollCore is no_gc_clear -- the cycle is broken at its containers --
    so no teardown order can leave a loop with its lists gone.  Under the debug allocator,
    in a fresh process (a use-after-free crashes visibly)."""
    run_debug("""
        import gc, socket
        from aoprim.server.backends import create_loop
        seen = []

        class Finalizer:
            def __init__(self, loop):
                self.loop = loop
                self.me = self                       # in the cycle itself
            def __del__(self):
                lp = self.loop
                # touch everything the GC might have cleared
                seen.append((lp.pending_timers, lp.reader_of(3), lp.closed))
                lp.call_soon(print)
                t = lp.call_later(1, print)
                t.cancel()
                lp.set_callbacks(r.fileno(), None, None)

        r, w = socket.socketpair()
        for round in range(30):
            lp = create_loop("epoll")
            f = Finalizer(lp)
            lp.add_reader(r.fileno(), f.__del__)
            timers = [lp.call_later(100 + i, f.__del__) for i in range(5)]
            lp.call_soon(f.__del__)
            lp.add_iteration_hook(f.__del__)
            f.timers = timers                        # timers <-> loop <-> finalizer
            del lp, f, timers
            gc.collect()
        assert len(seen) == 30, seen
        print("OK")
    """)


FAULT_SCRIPT = textwrap.dedent("""
    import os, socket, _testcapi
    from aoprim.server.backends import create_loop
    r, w = socket.socketpair()
    high = os.dup2(r.fileno(), 900)
    failed = 0
    for k in range(40):
        lp = create_loop("epoll")
        cb = lambda: None
        _testcapi.set_nomemory(k, k + 1)     # the k-th allocation from here fails
        try:
            lp.set_callbacks(high, cb, None)
        except MemoryError:
            failed += 1
        finally:
            _testcapi.remove_mem_hooks()
        # whatever failed, the table is whole: register, read back, replace, forget
        lp.set_callbacks(high, cb, cb)
        assert lp.reader_of(high) is cb and lp.writer_of(high) is cb
        lp.set_callbacks(high, None, cb)
        assert lp.reader_of(high) is None and lp.writer_of(high) is cb
        lp.remove(high)
        assert lp.writer_of(high) is None
        lp.close()
    print("ok", failed)
""")


@pytest.mark.timeout(120)
def test_set_callbacks_growing_the_table_fails_whole_under_memory_faults():
    """The fd table grows ``_rd`` and ``_wr`` together or not at all.  A MemoryError
    injected at each allocation of set_callbacks in turn (``_testcapi``) must leave two
    tables of one length: were ``_rd`` to grow while ``_wr`` did not, the next call would
    read and write ``_wr`` past its end (bounds checks are off) -- a crash."""
    skip_nomemory_on_free_threaded()
    pytest.importorskip("_testcapi")
    p = subprocess.run([sys.executable, "-c", FAULT_SCRIPT], capture_output=True, text=True,
                       timeout=100, env={**os.environ, "PYTHONPATH": PKG_PARENT})
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.startswith("ok ")
    assert int(p.stdout.split()[1]) > 0      # some allocations did fail


@pytest.mark.timeout(60)
def test_a_ping_pong_load_makes_one_epoll_wait_per_iteration(loop):
    """An iteration that polled epoll with a zero timeout before it slept would make a loop
    that waits for its peer (a ping-pong load: nothing is ready when the iteration starts)
    do two epoll_wait per iteration -- one syscall per message above asyncio's.  Once a
    poll finds nothing, the loop blocks directly (one wait, GIL released) until it is busy
    again.  Counted: every zero-timeout poll (``polls``) and every blocking wait
    (``sleeps``) over 300 round trips, against the iterations."""
    a, b = socket.socketpair()
    a.setblocking(True)
    b.setblocking(False)
    rounds = 300

    def on_read():
        d = b.recv(64)
        if d:
            b.send(d)
    loop.set_callbacks(b.fileno(), on_read, None)
    errs = []

    def client():
        try:
            for i in range(rounds):
                a.send(b"x")
                assert a.recv(64) == b"x"
        except BaseException as e:  # noqa: BLE001 - reported below
            errs.append(e)
        finally:
            loop.stop()
    t = threading.Thread(target=client)
    try:
        t.start()
        loop.run()
        t.join(30)
    finally:
        loop.remove(b.fileno())
        a.close()
        b.close()
    assert not errs
    assert loop.iterations >= rounds
    # one epoll_wait per iteration, plus a few zero-timeout polls (a stop() that queued a
    # callback); before: a poll and a sleep for nearly every iteration
    assert loop.polls + loop.sleeps <= loop.iterations + 5, (loop.polls, loop.sleeps,
                                                              loop.iterations)


def test_a_busy_loop_polls_without_releasing_the_gil(loop):
    """The other side of the same rule: with callbacks queued the wait is a zero-timeout
    poll (no GIL hand-off, no sleep); 64 fds ready at once (a full array) make the next
    iteration poll first too."""
    n = [0]

    def again():
        n[0] += 1
        if n[0] < 100:
            loop.call_soon(again)
        else:
            loop.stop()
    loop.call_soon(again)
    loop.run()
    assert loop.sleeps == 0 and loop.polls >= 100
    pairs = [socket.socketpair() for _ in range(70)]
    seen = []
    try:
        for x, y in pairs:
            x.send(b"x")
            loop.set_callbacks(y.fileno(), lambda y=y: seen.append(y.recv(1)), None)
        polls, sleeps = loop.polls, loop.sleeps
        loop.call_later(0.001, loop.stop)       # a wait that may sleep: the timer's
        loop.run()
        # the first wait took 64 of the 70 (the array is full), so the next polled first
        assert len(seen) == 70
        assert loop.polls > polls
    finally:
        for x, y in pairs:
            loop.remove(y.fileno())
            x.close()
            y.close()
