"""Layer 1: readiness callbacks, call_soon(_threadsafe) wake-ups, timers, backends."""
import functools
import os
import socket
import threading
import time

import pytest

from aoprim.server.backends import create_loop
from aoprim.server.loop import BACKENDS, BackendUnavailable, EventLoop, Timer
from support import run_threads


@pytest.fixture(params=BACKENDS)
def loop(request):
    """Every test of the contract runs on every backend."""
    lp = create_loop(request.param)
    assert lp.backend == request.param
    yield lp
    lp.close()


def run_in_thread(lp):
    t = threading.Thread(target=lp.run, daemon=True)
    t.start()
    return t


def test_call_soon_threadsafe_wakes_a_blocked_loop(loop):
    t = run_in_thread(loop)
    got = []
    done = threading.Event()
    n = 2000

    def producer(k):
        for i in range(n):
            loop.call_soon_threadsafe(got.append, (k, i))

    ps = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(10)
    loop.call_soon_threadsafe(done.set)
    assert done.wait(10), "the loop was not woken"
    loop.stop()
    t.join(10)
    assert not t.is_alive()
    assert len(got) == 4 * n
    for k in range(4):      # per-producer FIFO
        assert [i for kk, i in got if kk == k] == list(range(n))


def test_wake_ups_from_idle_by_several_threads_at_once_are_never_lost(loop):
    # Each producer waits for its callback before the next: the loop goes idle between them
    # over and over, while the others' calls land anywhere in its iteration (between its
    # clear of the pending flag and its count of the queue, too).  A lost wake-up is a
    # callback that never runs: its wait times out.
    t = run_in_thread(loop)
    rounds = 1000
    done = [0] * 4
    lost = []

    def producer(k):
        for i in range(rounds):
            ev = threading.Event()
            loop.call_soon_threadsafe(ev.set)
            if not ev.wait(5):
                lost.append((k, i))
                return
            done[k] += 1

    run_threads([functools.partial(producer, k) for k in range(4)])
    assert not lost, f"callbacks never run (producer, round): {lost}"
    assert done == [rounds] * 4
    loop.stop()
    t.join(10)
    assert not t.is_alive()


def test_stop_from_another_thread_while_idle(loop):
    t = run_in_thread(loop)
    time.sleep(0.05)        # let it block in select with no timers: only a wake-up ends it
    loop.stop()
    t.join(5)
    assert not t.is_alive()


def test_timers_run_in_order_and_cancel(loop):
    order = []
    loop.call_later(0.03, order.append, 3)
    loop.call_later(0.01, order.append, 1)
    cancelled = loop.call_later(0.02, order.append, 2)
    cancelled.cancel()
    loop.call_later(0.01, order.append, 1.5)     # same time: FIFO by sequence
    loop.call_later(0.05, loop.stop)
    t0 = time.monotonic()
    loop.run()
    assert order == [1, 1.5, 3]
    assert time.monotonic() - t0 >= 0.045


@pytest.mark.timeout(10)
def test_timers_in_the_past_run_at_once_and_never_block_the_wait(loop):
    # a negative epoll timeout would mean "wait forever": timers already due -- set before
    # run(), or from a callback -- must run in the next iteration without any fd activity
    order = []

    def from_callback():
        order.append("cb")
        loop.call_at(time.monotonic() - 5, order.append, "past-from-callback")
        loop.call_at(time.monotonic() - 5, loop.stop)

    loop.call_at(time.monotonic() - 10, order.append, "past")
    loop.call_later(0.01, from_callback)
    t0 = time.monotonic()
    loop.run()
    assert order == ["past", "cb", "past-from-callback"]
    assert time.monotonic() - t0 < 2
    # a second run() of the same loop works too (the sentinel timer is re-armed)
    loop.call_later(0.01, loop.stop)
    loop.run()
    assert loop.iterations >= 2


def test_several_iteration_hooks_run_in_order(loop):
    seen = []
    loop.add_iteration_hook(lambda: seen.append(1))
    loop.add_iteration_hook(lambda: seen.append(2))
    loop.call_soon(loop.stop)
    loop.run()
    assert seen[:2] == [1, 2]


def test_reader_and_writer_callbacks(loop):
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    got = bytearray()

    def on_read():
        got.extend(a.recv(100))
        if got == b"ping":
            loop.remove_reader(a.fileno())
            loop.add_writer(a.fileno(), on_write)

    def on_write():
        a.send(b"pong")
        loop.remove_writer(a.fileno())
        loop.stop()

    loop.add_reader(a.fileno(), on_read)
    b.send(b"ping")
    loop.run()
    b.settimeout(5)
    assert b.recv(10) == b"pong"
    a.close()
    b.close()


def test_iteration_hook_runs_after_callbacks(loop):
    seen = []
    loop.add_iteration_hook(lambda: seen.append("hook"))
    loop.call_soon(seen.append, "cb")
    loop.call_soon(loop.stop)
    loop.run()
    assert seen[:2] == ["cb", "hook"]


def test_backends():
    with pytest.raises(BackendUnavailable, match="io_uring"):
        create_loop("uring")
    assert BACKENDS == ("selectors", "epoll")
    assert create_loop().backend == "selectors"         # the default (docs/server.md)
    for name in BACKENDS:
        lp = create_loop(name)
        assert lp.backend == name
        assert isinstance(lp, EventLoop)
        assert isinstance(lp.call_later(5, print), Timer)
        lp.close()
    for bad in ("auto", "kqueue-please"):
        with pytest.raises(ValueError, match="selectors"):
            create_loop(bad)


def test_close_rules(loop):
    loop.call_soon(loop.stop)
    loop.run()
    loop.close()
    loop.close()        # idempotent
    with pytest.raises(RuntimeError):
        loop.run()
    # after close: refused (the caller keeps what it meant to hand over)
    assert loop.call_soon_threadsafe(print) is False


def test_an_exception_in_a_callback_is_logged_and_the_loop_goes_on(loop, caplog):
    """One failing callback (fd, timer, call_soon, hook) must not end run(): asyncio
    isolates callbacks the same way.  (The old loop let it escape and abort every session.)"""
    seen = []
    r, w = socket.socketpair()
    try:
        def bad():
            raise RuntimeError("callback bug")

        def bad_reader():
            r.recv(10)
            raise ValueError("reader bug")

        loop.add_reader(r.fileno(), bad_reader)
        w.send(b"x")
        loop.call_soon(bad)
        loop.call_later(0, bad)
        hook_calls = []

        def hook():
            hook_calls.append(1)
            if len(hook_calls) == 1:
                raise KeyError("hook bug")
        loop.add_iteration_hook(hook)
        loop.call_later(0.05, seen.append, "timer after the errors")
        loop.call_later(0.06, loop.stop)
        loop.run()
        assert seen == ["timer after the errors"]
        assert len(hook_calls) >= 2
        assert loop.errors == 4
        for msg in ("callback bug", "reader bug", "hook bug"):
            assert msg in caplog.text
    finally:
        loop.remove(r.fileno())
        r.close()
        w.close()


def test_a_timer_that_schedules_now_runs_it_next_iteration(loop):
    """call_at(now) from a timer runs in the next pass, not the same one: otherwise a timer
    re-arming itself for 'now' livelocks the loop (no I/O, no hooks, no stop)."""
    hooks = []
    fired = []

    def again():
        fired.append(loop.iterations)
        if len(fired) < 50:
            loop.call_at(loop.time(), again)
        else:
            loop.stop()
    loop.add_iteration_hook(lambda: hooks.append(loop.iterations))
    loop.call_soon(again)
    loop.run()
    assert len(fired) == 50
    assert len(set(fired)) == 50            # one per iteration, never two in one pass
    assert len(hooks) >= 50


def test_cancelled_timers_are_compacted(loop):
    ts = [loop.call_later(1000 + i, print) for i in range(5000)]
    assert loop.pending_timers == 5000
    for t in ts:
        t.cancel()
    assert loop.pending_timers < 600        # rebuilt once cancelled timers are the majority
    keep = loop.call_later(0.01, loop.stop)
    loop.run()
    assert not keep.cancelled


@pytest.mark.timeout(30)
def test_stop_after_run_ready_still_wakes_the_loop(loop):
    """A call_soon_threadsafe before run() leaves a wake-up pending;
    run_ready() drains its queue, so it must clear that flag too (before draining, as the
    loop does) -- otherwise every later call_soon_threadsafe, stop() included, believes a
    wake-up is on its way and skips the write, and run() sleeps for a day."""
    got = []
    assert loop.call_soon_threadsafe(got.append, 1)
    loop.run_ready()
    assert got == [1]
    woke = threading.Event()
    loop.add_iteration_hook(woke.set)   # (not call_soon: a queued callback clears the flag)
    t = run_in_thread(loop)
    assert woke.wait(10)            # the loop ran one iteration (the stale wake-up) and sleeps
    loop.call_soon_threadsafe(got.append, 2)
    loop.stop()
    t.join(5)
    alive = t.is_alive()
    if alive:                       # unstick the daemon thread with a timer-free wake-up
        loop.call_soon_threadsafe(loop.stop)
    assert not alive, "stop() after run_ready() never woke the loop"
    assert got == [1, 2]


@pytest.mark.timeout(30)
def test_selectors_call_soon_threadsafe_racing_close_never_writes_into_a_reused_fd():
    """A producer that passed the closed test and is about to write the
    eventfd is held there (a trace hook) while another thread closes the loop and a new
    socket takes the eventfd's number.  The write must not reach that socket: close() waits
    for a producer inside call_soon_threadsafe (the epoll backend counts them in _inflight;
    selectors holds a lock across check, append and write, and close() takes it)."""
    import sys
    lp = create_loop("selectors")
    evfd = lp._wfd
    at_write = threading.Event()
    go = threading.Event()
    result = []

    def tracer(frame, event, arg):
        if frame.f_code.co_name != "call_soon_threadsafe":
            return None

        def local(frame, event, arg):
            if event == "line":
                import linecache
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
                if "eventfd_write" in line and not at_write.is_set():
                    at_write.set()
                    go.wait(10)
            return local
        return local

    def producer():
        sys.settrace(tracer)
        try:
            result.append(lp.call_soon_threadsafe(print))
        finally:
            sys.settrace(None)
    p = threading.Thread(target=producer)
    p.start()
    assert at_write.wait(10)
    closer = threading.Thread(target=lp.close)
    closer.start()
    closer.join(0.5)    # a fixed loop keeps close() waiting for the producer: bounded wait
    socks = []
    try:
        while not closer.is_alive() and len(socks) < 8:     # the old code: fd freed already
            a, b = socket.socketpair()
            socks.append((a, b))
            if evfd in (a.fileno(), b.fileno()):
                break
        go.set()
        p.join(10)
        closer.join(10)
        assert not p.is_alive() and not closer.is_alive()
        assert result == [True]     # queued before close (and dropped by it)
        for a, b in socks:
            for s in (a, b):
                s.setblocking(False)
                with pytest.raises(BlockingIOError):
                    data = s.recv(64)
                    pytest.fail(f"the loop's wake-up wrote {data!r} into a reused fd")
    finally:
        go.set()
        for a, b in socks:
            a.close()
            b.close()
    assert lp.closed and lp.call_soon_threadsafe(print) is False


def test_nan_deadlines_are_refused_inf_never_fires_negative_runs_next(loop):
    """NaN compares false with every deadline -- a heap may run it at once, or park it on
    top where it keeps every later timer from firing.  The contract (loop.py):
    NaN raises ValueError on both; -inf / negative run like 0; inf never fires."""
    nan, inf = float("nan"), float("inf")
    with pytest.raises(ValueError):
        loop.call_later(nan, print)
    with pytest.raises(ValueError):
        loop.call_at(nan, print)
    assert loop.pending_timers == 0
    order = []
    never = loop.call_later(inf, order.append, "inf")
    loop.call_at(float("-inf"), order.append, "-inf")
    loop.call_later(-5, order.append, "neg")
    loop.call_later(0, order.append, "zero")
    loop.call_later(0.01, order.append, "later")
    loop.call_later(0.02, loop.stop)
    loop.run()
    assert order == ["-inf", "neg", "zero", "later"]
    assert not never.cancelled and never.when == inf
    never.cancel()


@pytest.mark.timeout(30)
def test_a_signal_delivered_to_another_thread_wakes_run_on_the_main_thread(loop):
    """Both backends set Python's signal wake-up fd while run() runs on the
    main thread.  The signal lands on another thread, so the main thread's wait gets no
    EINTR: only the wake-up fd can end it (a 5 s timer bounds the test without one)."""
    import signal
    assert threading.current_thread() is threading.main_thread()
    before = len(os.listdir("/proc/self/fd"))
    got = []

    def handler(signum, frame):
        got.append(threading.get_ident())
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGUSR1, handler)
    prev = signal.set_wakeup_fd(-1)
    try:
        started = threading.Event()
        loop.call_soon(started.set)
        loop.call_later(5, loop.stop)

        def kicker():
            started.wait(10)
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)     # to this thread
        t = threading.Thread(target=kicker)
        t0 = time.monotonic()
        t.start()
        with pytest.raises(KeyboardInterrupt):
            loop.run()
        t.join(10)
        assert time.monotonic() - t0 < 4
        assert got == [threading.get_ident()]       # the handler ran on the main thread
        assert signal.set_wakeup_fd(-1) == -1       # the loop's pipe was taken away again
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        signal.signal(signal.SIGUSR1, old)
        signal.set_wakeup_fd(prev)


def test_a_callback_that_grows_the_fd_table_and_unregisters_a_ready_fd(loop):
    """Two fds ready in one batch; the first one's callback registers a high fd (the epoll
    backend installs a new, longer table) and unregisters the second: the second's callback
    must not run from the old table."""
    a = socket.socketpair()
    b = socket.socketpair()
    hr, hw = socket.socketpair()
    high = os.dup2(hr.fileno(), 950)
    ran = []
    try:
        def first(me, other):
            ran.append(me.recv(1))
            loop.add_reader(high, lambda: None)
            loop.remove_reader(other.fileno())
            loop.stop()
        loop.add_reader(a[0].fileno(), lambda: first(a[0], b[0]))
        loop.add_reader(b[0].fileno(), lambda: first(b[0], a[0]))
        a[1].send(b"x")
        b[1].send(b"x")
        loop.run()
        assert len(ran) == 1, ran
    finally:
        loop.remove(high)
        os.close(high)
        for s in (*a, *b, hr, hw):
            s.close()


# -- defects of one backend only: the contract both must keep -------------------------------

def test_a_read_callback_that_drops_the_writer_stops_it_in_the_same_dispatch(loop):
    # fd both readable and writable; the read callback forgets the fd (a session closing):
    # the writer looked up before the read callback ran must not be called (look it up again)
    a, b = socket.socketpair()
    a.setblocking(False)
    b.send(b"x")
    calls = []

    def on_read():
        calls.append("R")
        a.recv(10)
        loop.remove(a.fileno())
        loop.stop()

    loop.set_callbacks(a.fileno(), on_read, lambda: calls.append("W"))
    try:
        loop.run()
    finally:
        a.close()
        b.close()
    assert calls == ["R"]


@pytest.mark.timeout(30)
def test_a_signal_handler_calling_call_soon_threadsafe_inside_the_loops_section(loop):
    # The server's SIGINT/SIGTERM handler calls call_soon_threadsafe on the loop's (main)
    # thread.  Python runs it between any two bytecodes -- selectors' loop could be inside
    # its `with _lock:` (clearing _wake_pending) and the handler's acquire deadlocked.  A
    # trace hook raises the signal exactly there (a no-op on epoll, whose section is C).
    import signal
    import sys
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread")
    fired = []

    def handler(signum, frame):
        loop.call_soon_threadsafe(loop.stop)

    def tracer(frame, event, arg):
        if event == "line" and frame.f_code.co_name == "_run" and not fired:
            import linecache
            if "_wake_pending = False" in linecache.getline(frame.f_code.co_filename,
                                                            frame.f_lineno):
                fired.append(1)
                signal.raise_signal(signal.SIGUSR1)
                for _ in range(3):      # a backward jump: the handler runs here
                    pass
        return tracer

    old = signal.signal(signal.SIGUSR1, handler)
    done = threading.Event()
    # a watchdog: without the fix the loop thread is stuck in lock.acquire for good
    threading.Thread(target=lambda: done.wait(5) or os.kill(os.getpid(), signal.SIGUSR1),
                     daemon=True).start()
    loop.call_soon(lambda: None)
    if loop.backend == "epoll":
        loop.call_soon(loop.stop)       # nothing of it is Python: the hook never fires
    sys.settrace(tracer)
    try:
        loop.run()
    finally:
        sys.settrace(None)
        done.set()
        signal.signal(signal.SIGUSR1, old)
    assert fired or loop.backend == "epoll"


def test_an_unclosed_loop_collected_by_the_gc_leaks_no_fd():
    import gc
    for backend in BACKENDS:
        n0 = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            lp = create_loop(backend)
            lp.call_soon(lambda lp=lp: None)   # a cycle through the ready queue
            del lp
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == n0, backend


def test_run_puts_no_wakeup_fd_back_that_was_closed_meanwhile(loop, caplog):
    # the wake-up fd set before run() is closed by a callback: putting it back fails
    # (EBADF); run() raised that and leaked its signal pipe, left installed as the wake-up fd
    import signal
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the signal wake-up fd is the main thread's")
    a, b = socket.socketpair()
    a.setblocking(False)
    prev = signal.set_wakeup_fd(a.fileno())
    try:
        n0 = len(os.listdir("/proc/self/fd"))

        def cb():
            a.close()
            loop.stop()
        loop.call_soon(cb)
        loop.run()                      # returns normally; the failure is logged
        assert len(os.listdir("/proc/self/fd")) == n0 - 1     # a, and nothing of ours
        assert signal.set_wakeup_fd(-1) == -1
        assert "wake-up fd" in caplog.text
    finally:
        signal.set_wakeup_fd(prev)
        a.close()
        b.close()


def test_deadlines_and_fds_are_numbers_on_both_backends(loop):
    # selectors took float("1.5") for a deadline and a socket object for an fd (keyed by
    # the object: never dispatched, while epoll reported it ready every wait)
    for bad in ("1.5", b"1"):
        with pytest.raises(TypeError):
            loop.call_at(bad, print)
        with pytest.raises(TypeError):
            loop.call_later(bad, print)
    a, b = socket.socketpair()
    try:
        with pytest.raises(TypeError):
            loop.set_callbacks(a, print, None)
        # a float fd: EpollCore's C int parameter truncated 3.0 to 3 (selectors refused it)
        with pytest.raises(TypeError):
            loop.set_callbacks(float(a.fileno()), print, None)
        assert loop.reader_of(a.fileno()) is None
    finally:
        a.close()
        b.close()


def test_an_fd_closed_without_remove_and_reused_can_be_forgotten_and_registered(loop):
    # selectors kept its table entry when the selector's modify failed (ENOENT: the old file
    # is gone from epoll), so unregistering raised KeyError for good; epoll recovers
    a, b = socket.socketpair()
    fd = a.fileno()
    loop.set_callbacks(fd, print, None)
    a.close()                                   # no remove(): a caller's bug
    c, d = socket.socketpair()
    if c.fileno() != fd:
        c, d = d, c
    try:
        assert c.fileno() == fd
        with pytest.raises(OSError):
            loop.set_callbacks(fd, print, print)    # MOD of a file epoll never had
        loop.set_callbacks(fd, None, None)          # forgotten
        assert loop.reader_of(fd) is None
        got = []

        def on_read():
            got.append(c.recv(10))
            loop.stop()
        loop.set_callbacks(fd, on_read, None)       # registered afresh: it works
        d.send(b"hi")
        loop.run()
        assert got == [b"hi"]
        loop.remove(fd)
    finally:
        for s in (b, c, d):
            s.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loop_that_cannot_be_created_leaves_no_fd_behind(backend):
    # selectors: os.eventfd failing (EMFILE) left the selector's epoll fd open until the GC
    import errno
    import gc
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    gc.collect()
    gc.disable()
    hold = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with pytest.raises(OSError) as ei:     # fill the table: every fd number taken
            while True:
                hold.append(os.open(os.devnull, os.O_RDONLY))
        assert ei.value.errno == errno.EMFILE
        os.close(hold.pop())                   # exactly one free: the epoll fd, no eventfd
        with pytest.raises(OSError):
            create_loop(backend)
        hold.append(os.open(os.devnull, os.O_RDONLY))    # the slot is free again
    finally:
        for fd in hold:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        gc.enable()
