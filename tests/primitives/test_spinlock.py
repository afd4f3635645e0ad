"""SpinLock: threading.Lock's behaviour and argument rules, Condition, threaded stress."""
import threading
import time

import pytest

from aoprim import SpinLock
from support import run_threads, scaled

try:
    from test import lock_tests
except ImportError:  # pragma: no cover - CPython's own test package is not always shipped
    lock_tests = None


def test_basic_acquire_release():
    lk = SpinLock()
    assert lk.locked() is False
    assert lk.acquire() is True
    assert lk.locked() is True
    assert lk.acquire(False) is False
    assert lk.acquire(blocking=False) is False
    lk.release()
    assert lk.locked() is False


def test_release_unlocked_raises():
    lk = SpinLock()
    with pytest.raises(RuntimeError):
        lk.release()
    with lk:
        pass
    with pytest.raises(RuntimeError):
        lk.release()


def test_context_manager():
    lk = SpinLock()
    with lk as entered:
        assert entered is True
        assert lk.locked()
    assert not lk.locked()
    with pytest.raises(KeyError):
        with lk:
            raise KeyError
    assert not lk.locked()


class _BoolRaises:
    def __bool__(self):
        raise ZeroDivisionError("truth value refused")


class _Index:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v

    def __bool__(self):
        return not self.v      # the opposite of the integer: which one the lock reads shows


def test_argument_rules_match_threading_lock():
    cases = [
        ((), {}), ((True,), {}), ((False,), {}), ((1,), {}), ((0,), {}),
        ((False, -1), {}), ((False, 0.5), {}), ((True, -2), {}), ((True, -1.0), {}),
        ((True, 0), {}), ((True, 0.0), {}), ((), {"timeout": 0.01}),
        ((True, float("nan")), {}), ((True, threading.TIMEOUT_MAX * 2), {}),
        ((True, 10**30), {}), ((True, "1"), {}), ((True, None), {}), (("yes",), {}),
        ((1.5,), {}), ((), {"blocking": False, "timeout": 1}),
        # 3.12+ reads `blocking` as a truth value, 3.11 as an integer: these split the two
        ((None,), {}), (([],), {}), ((0.0,), {}), (("",), {}), (([], 1), {}),
        ((_BoolRaises(),), {}), ((_Index(0),), {}), ((_Index(3), 0.01), {}),
    ]
    for args, kwargs in cases:
        outcome = []
        for lk in (threading.Lock(), SpinLock()):
            try:
                r = lk.acquire(*args, **kwargs)
                outcome.append(("ok", r))
                if r:
                    lk.release()
            except Exception as e:
                outcome.append(("raise", type(e)))
        ref, ours = outcome
        # threading.Lock says OverflowError for a timeout that doesn't fit its clock
        # type; both must at least agree on the exception class.
        assert ref == ours, (args, kwargs, ref, ours)


def test_timeout_when_held():
    lk = SpinLock()
    lk.acquire()
    t0 = time.monotonic()
    assert lk.acquire(timeout=0.05) is False
    dt = time.monotonic() - t0
    assert 0.04 <= dt < 2.0
    assert lk.acquire(True, 0) is False
    lk.release()


def test_release_from_another_thread():
    lk = SpinLock()
    lk.acquire()
    t = threading.Thread(target=lk.release)
    t.start()
    t.join(10)
    assert not lk.locked()


def test_blocked_acquire_wakes_on_release():
    lk = SpinLock()
    lk.acquire()
    got = threading.Event()
    started = threading.Event()

    def waiter():
        started.set()
        if lk.acquire(timeout=30):
            got.set()
            lk.release()

    t = threading.Thread(target=waiter)
    t.start()
    started.wait(10)
    assert not got.is_set()
    lk.release()
    assert got.wait(10)
    t.join(10)


def test_as_condition_lock():
    lk = SpinLock()
    cond = threading.Condition(lk)
    items = []
    n = 2000

    def producer():
        for i in range(n):
            with cond:
                items.append(i)
                cond.notify()

    seen = []

    def consumer():
        while len(seen) < n:
            with cond:
                while not items:
                    assert cond.wait(30)
                seen.extend(items)
                items.clear()

    run_threads([producer, consumer])
    assert seen == list(range(n))
    assert not lk.locked()


def test_condition_wait_timeout_and_notify_all():
    cond = threading.Condition(SpinLock())
    with cond:
        t0 = time.monotonic()
        assert cond.wait(0.05) is False
        assert time.monotonic() - t0 >= 0.04
    woken = []
    waiting = [0]
    flag = []

    def waiter():
        with cond:
            waiting[0] += 1      # counted under the lock, then wait() releases it atomically
            assert cond.wait_for(lambda: flag, 30)
            woken.append(1)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while True:                  # under the lock, waiting == 3 means all three are in wait()
        with cond:
            if waiting[0] == 3:
                flag.append(1)
                cond.notify_all()
                break
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for t in threads:
        t.join(30)
    assert woken == [1, 1, 1]


def test_guards_plain_int_four_threads():
    lk = SpinLock()
    box = [0]
    n = scaled(50_000)

    def work():
        for _ in range(n):
            with lk:
                v = box[0]
                box[0] = v + 1

    def work_explicit():
        for _ in range(n):
            lk.acquire()
            v = box[0]
            box[0] = v + 1
            lk.release()

    run_threads([work, work, work_explicit, work_explicit])
    assert box[0] == 4 * n


def test_holder_blocked_in_c_while_python_waits():
    # a waiter must release the GIL: otherwise the holder (needing the GIL to release)
    # would never progress and this would hang until the timeout
    lk = SpinLock()
    lk.acquire()
    done = threading.Event()

    def waiter():
        assert lk.acquire(timeout=20)
        lk.release()
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(1000):   # keep this thread busy in Python while the waiter waits
        sum(range(100))
    lk.release()
    assert done.wait(20)
    t.join(10)


if lock_tests is not None:
    class TestCPythonLockSuite(lock_tests.LockTests):
        """CPython's own threading.Lock test-suite, run against SpinLock."""
        locktype = staticmethod(SpinLock)

        def test_repr(self):   # SpinLock's repr says SpinLock, not _thread.lock
            lk = self.locktype()
            assert "unlocked" in repr(lk)
            lk.acquire()
            assert "locked" in repr(lk)
            lk.release()

        def test_locked_repr(self):
            self.test_repr()


def test_parked_waiter_burns_no_core():
    """A waiter blocked for a long time must park (futex), not spin: its own thread CPU
    time stays a small fraction of the time it waited."""
    lk = SpinLock()
    lk.acquire()
    started = threading.Event()
    result = {}

    def waiter():
        c0, w0 = time.thread_time(), time.monotonic()
        started.set()
        assert lk.acquire(timeout=30)
        result["cpu"], result["wall"] = time.thread_time() - c0, time.monotonic() - w0
        lk.release()

    t = threading.Thread(target=waiter)
    t.start()
    assert started.wait(10)
    time.sleep(0.3)     # hold the lock: the waiter must be parked meanwhile, not spinning
    lk.release()
    t.join(10)
    assert result["wall"] >= 0.25
    assert result["cpu"] < 0.1 * result["wall"], result


def test_timed_wait_burns_no_core():
    lk = SpinLock()
    lk.acquire()
    c0 = time.thread_time()
    assert lk.acquire(timeout=0.3) is False
    assert time.thread_time() - c0 < 0.05
    lk.release()


# ---- waiting forever, and Ctrl-C ---------------------------------------------------------

LOCKWORD = r'''
# cython: language_level=3
from aoprim._spinlock cimport SpinLock
from aoprim.atomic_h cimport aop_load_u32, AOP_RELAXED

def word(SpinLock lk):
    """The lock word: 0 free, 1 held, 2 held and a waiter parked (or about to)."""
    return aop_load_u32(&lk.lock.state, AOP_RELAXED)   # relaxed: a snapshot to poll
'''


@pytest.fixture(scope="module")
def lockword(cybuild):
    return cybuild("spinlock_word", LOCKWORD).word


def _wait_until_parked(lockword, lk, thread, limit=30.0):
    """Until the lock word says a waiter is parked (2), or the waiting thread has ended."""
    deadline = time.monotonic() + limit
    while lockword(lk) != 2 and thread.is_alive():
        assert time.monotonic() < deadline, "the waiter never parked"
        thread.join(0.001)


@pytest.mark.parametrize("timeout", [threading.TIMEOUT_MAX, threading.TIMEOUT_MAX / 2, 1e9])
def test_huge_timeout_waits_for_the_release(lockword, timeout):
    """now + timeout must saturate, not wrap: a huge timeout is a long wait, not an instant
    timeout.  The holder releases only once the waiter is seen parked."""
    lk = SpinLock()
    lk.acquire()
    entering = threading.Event()
    result = []

    def waiter():
        entering.set()
        result.append(lk.acquire(timeout=timeout))

    t = threading.Thread(target=waiter)
    t.start()
    assert entering.wait(10)
    _wait_until_parked(lockword, lk, t)
    assert t.is_alive(), f"acquire(timeout={timeout!r}) gave up at once: {result}"
    lk.release()
    t.join(10)
    assert result == [True]
    lk.release()


INTERRUPT = r'''
import signal, sys, threading, time
from aoprim import SpinLock

how = sys.argv[1]
# Python keeps SIGINT ignored when it starts with it ignored (a background job of a
# non-interactive shell): make it raise KeyboardInterrupt whatever we inherited
signal.signal(signal.SIGINT, signal.default_int_handler)
lk = SpinLock()
lk.acquire()                          # held by ourselves: the acquire below can only end
main = threading.main_thread().ident  # by a signal

def block():
    if how == "acquire":
        lk.acquire()
    elif how == "timeout":
        lk.acquire(timeout=30)
    else:
        with lk:
            pass

entered = threading.Event()
stat = f"/proc/self/task/{threading.main_thread().native_id}/stat"

def kicker():
    # send SIGINT once the main thread sleeps in the kernel after entering block(): parked
    # in the blocking acquire (the kernel's state, read without touching the main thread's
    # Python frames, which another thread may not read safely on a free-threaded build).
    # A signal that lands earlier is still seen by a correct acquire.
    entered.wait()
    while True:
        with open(stat) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("S", "D"):
            break
        time.sleep(0.001)
    signal.pthread_kill(main, signal.SIGINT)

threading.Thread(target=kicker, daemon=True).start()
t0 = time.monotonic()
try:
    entered.set()
    block()
except KeyboardInterrupt:
    dt = time.monotonic() - t0
else:
    raise SystemExit("acquire returned instead of being interrupted")
assert dt < 10, dt
# the lock state is consistent: still held by us; a waiter gets it when we release
assert lk.locked()
got = []
def other():
    got.append(lk.acquire(timeout=30))
    lk.release()
w = threading.Thread(target=other)
w.start()
lk.release()
w.join(30)
assert got == [True], got
assert lk.acquire(blocking=False)
lk.release()
assert not lk.locked()
print("OK", round(dt, 3))
'''


@pytest.mark.parametrize("how", ["acquire", "timeout", "with"])
def test_blocked_acquire_is_interrupted_by_sigint(tmp_path, how):
    """Ctrl-C reaches a thread blocked in acquire() (as threading.Lock on POSIX): the
    KeyboardInterrupt propagates from acquire, and the lock keeps working."""
    import os
    import subprocess
    import sys
    import aoprim
    if not os.path.exists("/proc/self/task"):
        pytest.skip("needs /proc/self/task to see the main thread parked")
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(aoprim.__file__)))
    r = subprocess.run([sys.executable, str(script), how], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK"), r.stdout + r.stderr


# ---- true parallelism: mutual exclusion and exact counts from 2 to 8 threads (more threads
# than cores: waiters spin, yield and park) ------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [2, 4, 8])
def test_stress_mutual_exclusion_every_acquire_path(threads):
    """Each thread takes the lock by one of four paths (with, acquire(), acquire(timeout),
    acquire(blocking=False) retried) and, inside, checks it is alone (a counter of threads
    inside) and does a read-then-write of a plain int that a second thread inside would
    make lose an update.  The totals are exact."""
    lk = SpinLock()
    box, inside, overlaps = [0], [0], [0]
    n = scaled(20_000)

    def body():
        inside[0] += 1
        if inside[0] != 1:
            overlaps[0] += 1
        v = box[0]
        box[0] = v + 1
        inside[0] -= 1

    def with_path():
        for _ in range(n):
            with lk:
                body()

    def acquire_path():
        for _ in range(n):
            lk.acquire()
            body()
            lk.release()

    def timeout_path():
        for _ in range(n):
            assert lk.acquire(timeout=60)
            body()
            lk.release()

    def trylock_path():
        for _ in range(n):
            while not lk.acquire(blocking=False):
                time.sleep(0)   # a yield, not a wait: under the GIL the holder needs it to run
            body()
            lk.release()

    paths = [with_path, acquire_path, timeout_path, trylock_path]
    run_threads([paths[i % 4] for i in range(threads)], timeout=110)
    assert (box[0], overlaps[0], inside[0]) == (threads * n, 0, 0)
    assert not lk.locked()
