"""queue.Queue's task accounting on MPMCQueue and SPSCQueue -- task_done(), join(), maxsize --
and the generic alias (MPMCQueue[int]).  The threaded tests follow CPython's own
Lib/test/test_queue.py (queue_join_test, test_queue_task_done) with real threads; every item
is counted and every wait is bounded."""
import signal
import threading
import time
import types

import pytest

from aoprim import Closed, Full, MPMCQueue, SPSCQueue
from support import run_threads, scaled

pytestmark = pytest.mark.timeout(60)

TOO_MANY = r"^task_done\(\) called too many times$"


@pytest.fixture(params=[MPMCQueue, SPSCQueue], ids=lambda c: c.__name__)
def Q(request):
    return request.param


def unfinished(q):
    """How many task_done() calls the queue accepts now (each one is spent: count them by
    calling task_done until it refuses -- the count is then 0)."""
    n = 0
    while True:
        try:
            q.task_done()
        except ValueError:
            return n
        n += 1


def join_in_thread(q, timeout=30):
    """join() in a thread, bounded: True if it returned within timeout."""
    t = threading.Thread(target=q.join, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


# ---- maxsize -----------------------------------------------------------------------------

@pytest.mark.parametrize("asked", [1, 3, 8, 1000])
def test_maxsize_is_capacity(Q, asked):
    q = Q(asked)
    assert q.maxsize == q.capacity
    with pytest.raises(AttributeError):
        q.maxsize = 5


# ---- the unfinished-task count -----------------------------------------------------------

def test_task_done_on_a_new_queue_raises(Q):
    q = Q(4)
    with pytest.raises(ValueError, match=TOO_MANY):
        q.task_done()
    q.put(1)                        # the refused call changed nothing: one put, one done
    q.task_done()
    with pytest.raises(ValueError, match=TOO_MANY):
        q.task_done()


def test_every_successful_put_counts_once(Q):
    q = Q(8)
    q.put("a")
    q.put_nowait("b")
    q.put("c", timeout=0.01)
    assert q.put_many(["d", "e"]) == 2
    assert q.put_many(iter(["f"])) == 1
    assert q.put_many([]) == 0
    assert unfinished(q) == 6
    assert q.qsize() == 6           # task_done does not take items off the queue


def test_get_does_not_finish_a_task(Q):
    q = Q(4)
    q.put(1)
    q.put(2)
    assert q.get() == 1 and q.get_many(5) == [2]
    assert unfinished(q) == 2


def test_put_many_counts_what_it_took(Q):
    q = Q(4)
    q.put(0)
    assert q.put_many(range(10)) == 3          # any iterable: stops when full
    assert q.get_many(10) == [0, 0, 1, 2]
    assert q.put_many(list(range(10))) == 4    # a list: moved in a batch
    assert unfinished(q) == 8


def test_failed_puts_do_not_count(Q):
    q = Q(1)
    q.put(1)
    with pytest.raises(Full):
        q.put_nowait(2)
    with pytest.raises(Full):
        q.put(2, timeout=0.01)
    with pytest.raises(Full):
        q.put(2, block=False)
    assert q.put_many([2, 3]) == 0
    q.get()
    q.close()
    with pytest.raises(Closed):
        q.put(3)
    with pytest.raises(Closed):
        q.put_many([3])
    assert unfinished(q) == 1


def test_task_done_after_close_and_drain(Q):
    q = Q(4)
    q.put_many([1, 2])
    q.close()
    assert q.get_many(4) == [1, 2]
    q.task_done()
    assert not join_in_thread(q, timeout=0.05)    # one task still open: join waits
    q.task_done()
    assert join_in_thread(q)
    with pytest.raises(ValueError, match=TOO_MANY):
        q.task_done()


def test_join_returns_at_once_when_nothing_is_unfinished(Q):
    q = Q(2)
    q.join()                        # never put anything
    q.put(1)
    q.get()
    q.task_done()
    q.join()


# ---- CPython's test_queue, on our queues -------------------------------------------------

def _queue_join_test(q, workers):
    """CPython's queue_join_test: workers sum what they get and call task_done; join()
    must not return before every task is done.  Run twice on one queue."""
    lock = threading.Lock()
    cum = [0]

    def worker():
        while True:
            x = q.get(timeout=30)
            if x < 0:
                q.task_done()
                return
            with lock:
                cum[0] += x
            q.task_done()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for i in range(100):
        q.put(i, timeout=30)
    q.join()
    with lock:
        assert cum[0] == sum(range(100)), "q.join() did not block until all tasks were done"
    for _ in range(workers):
        q.put(-1, timeout=30)       # instruct the threads to close
    q.join()                        # verify that you can join twice
    for t in threads:
        t.join(30)
        assert not t.is_alive()


@pytest.mark.parametrize("capacity", [1, 4, 256])
def test_queue_join(Q, capacity):
    # CPython runs 2 workers; an SPSCQueue has exactly one consumer thread
    q = Q(capacity)
    workers = 1 if Q is SPSCQueue else 2
    _queue_join_test(q, workers)
    _queue_join_test(q, workers)
    with pytest.raises(ValueError, match=TOO_MANY):
        q.task_done()


def test_queue_task_done(Q):
    q = Q(8)
    with pytest.raises(ValueError, match=TOO_MANY):
        q.task_done()


# ---- join() waits properly ---------------------------------------------------------------

def test_join_waits_for_the_last_task_done(Q):
    """join() returns only after the last task_done(); the tasks are finished one at a time
    by another thread while join waits, so a join that returned early sees fewer."""
    n = 50
    q = Q(64)
    q.put_many(list(range(n)))
    finished = [0]
    seen_at_return = []
    joined = threading.Event()

    def joiner():
        q.join()
        seen_at_return.append(finished[0])
        joined.set()

    jt = threading.Thread(target=joiner, daemon=True)
    jt.start()
    for _ in range(n):
        q.get_nowait()
        assert not joined.is_set()
        finished[0] += 1
        q.task_done()
    assert joined.wait(30)
    jt.join(30)
    assert seen_at_return == [n]


def test_many_joiners_all_released(Q):
    q = Q(4)
    q.put(1)
    released = []
    lock = threading.Lock()
    go = threading.Barrier(5)

    def joiner():
        go.wait(30)
        q.join()
        with lock:
            released.append(1)

    ts = [threading.Thread(target=joiner, daemon=True) for _ in range(4)]
    for t in ts:
        t.start()
    go.wait(30)
    q.get()
    q.task_done()
    for t in ts:
        t.join(30)
        assert not t.is_alive()
    assert len(released) == 4


def test_parked_join_burns_no_core(Q):
    """A join() that waits long parks on a futex with the GIL released: its thread's CPU time
    stays a small fraction of the time it waited, and the main thread keeps running."""
    q = Q(2)
    q.put(1)
    started = threading.Event()
    result = {}

    def joiner():
        c0, w0 = time.thread_time(), time.monotonic()
        started.set()
        q.join()
        result["cpu"], result["wall"] = time.thread_time() - c0, time.monotonic() - w0

    t = threading.Thread(target=joiner, daemon=True)
    t.start()
    assert started.wait(10)
    # keep the task open for 0.3 s while this thread runs Python code (the joiner must not
    # hold the GIL): the loop below measures a duration, it synchronises nothing
    spins = 0
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        spins += 1
    q.get()
    q.task_done()
    t.join(10)
    assert not t.is_alive()
    assert spins > 1000
    assert result["wall"] >= 0.25
    assert result["cpu"] < 0.1 * result["wall"], result


class _Interrupted(Exception):
    pass


def test_join_is_interruptible_by_signal(Q):
    """join() in the main thread runs signal handlers (Ctrl-C works) and changes nothing."""
    def handler(signum, frame):
        raise _Interrupted()

    q = Q(2)
    q.put(1)
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        t0 = time.monotonic()
        with pytest.raises(_Interrupted):
            q.join()
        assert time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert unfinished(q) == 1


# ---- races -------------------------------------------------------------------------------

def test_racing_task_done_accepts_exactly_the_unfinished_count(Q):
    """Threads call task_done() until refused: exactly as many calls succeed as items were
    put, never one more (the count cannot go below zero under a race)."""
    for _ in range(scaled(20)):
        n = 2000
        q = Q(2048)
        assert q.put_many(list(range(n))) == n
        ok = [0] * 4

        def work(k):
            def run():
                while True:
                    try:
                        q.task_done()
                    except ValueError:
                        return
                    ok[k] += 1
            return run

        run_threads([work(k) for k in range(4)])
        assert sum(ok) == n
        q.join()


def test_mpmc_producers_consumers_join_stress():
    """4 producers, 3 consumers calling task_done, and a joiner: every item is got exactly
    once, and join() returns only after the last task_done()."""
    per = scaled(5000)
    q = MPMCQueue(64)
    done_count = [0]
    lock = threading.Lock()
    got = [[] for _ in range(3)]
    produced = threading.Barrier(5)

    def producer(k):
        def run():
            for i in range(per):
                q.put((k, i), timeout=30)
            produced.wait(30)
        return run

    def consumer(k):
        def run():
            while True:
                try:
                    x = q.get(timeout=30)
                except Closed:
                    return
                got[k].append(x)
                with lock:
                    done_count[0] += 1
                q.task_done()
        return run

    def joiner():
        produced.wait(30)           # every put has returned: join must see all of them
        q.join()
        with lock:
            assert done_count[0] == 4 * per
        q.close()

    run_threads([producer(k) for k in range(4)] + [consumer(k) for k in range(3)] + [joiner])
    items = sorted(x for g in got for x in g)
    assert items == sorted((k, i) for k in range(4) for i in range(per))
    with pytest.raises(ValueError, match=TOO_MANY):
        q.task_done()


def test_spsc_producer_consumer_join_stress():
    per = scaled(20000)
    q = SPSCQueue(32)
    got = []

    def producer():
        for i in range(per):
            q.put(i, timeout=30)
        q.join()
        assert len(got) == per      # join returned: the consumer took and finished them all
        q.close()

    def consumer():
        while True:
            try:
                got.append(q.get(timeout=30))
            except Closed:
                return
            q.task_done()

    run_threads([producer, consumer])
    assert got == list(range(per))


# ---- generic alias -----------------------------------------------------------------------

@pytest.mark.parametrize("arg", [int, bytes, "tuple[int, str]"])
def test_class_getitem_is_a_generic_alias(Q, arg):
    alias = Q[arg]
    assert isinstance(alias, types.GenericAlias)
    assert alias.__origin__ is Q
    assert alias.__args__ == (arg,)
    q = alias(4)                    # calling the alias makes an ordinary queue
    assert type(q) is Q and q.capacity == 4


def test_generic_alias_in_annotations(Q):
    def f(q: Q[int]) -> Q[bytes]:   # evaluated at definition: must not raise
        return q
    assert f.__annotations__["q"] == Q[int]
