"""The queues' C-level API (raw 64-bit words, no GIL), from a Cython module compiled against
the installed package: producers and consumers loop in ``with nogil`` blocks in several
Python threads at once (true parallelism), and every word is accounted for exactly.
Also: a queue's mode (objects vs raw words) is fixed by its first use and cannot be mixed."""
import threading

import pytest

from aoprim import MPMCQueue, SPSCQueue
from support import run_threads, scaled

SOURCE = r'''
# cython: language_level=3
from libc.stdint cimport uint64_t, int64_t
from libc.stdlib cimport malloc, free
from aoprim._qwait cimport AOP_Q_OK, AOP_Q_RETRY, AOP_Q_CLOSED, AOP_Q_BADMODE
from aoprim._mpmc cimport (MPMCQueue, aop_mpmc_t, aop_mpmc_try_push_u64, aop_mpmc_try_pop_u64,
                           aop_mpmc_push_u64, aop_mpmc_pop_u64, aop_mpmc_push_many_u64,
                           aop_mpmc_pop_many_u64, aop_mpmc_close)
from aoprim._spsc cimport (SPSCQueue, aop_spsc_t, aop_spsc_try_push_u64, aop_spsc_try_pop_u64,
                           aop_spsc_push_u64, aop_spsc_pop_u64, aop_spsc_push_many_u64,
                           aop_spsc_pop_many_u64)

def codes():
    return AOP_Q_OK, AOP_Q_RETRY, AOP_Q_CLOSED, AOP_Q_BADMODE

def mpmc_produce(MPMCQueue q, uint64_t pid, uint64_t n, bint batched):
    """Push (pid << 40) | i for i in 1..n, in order; returns the number of failed pushes."""
    cdef aop_mpmc_t *c = q.q
    cdef uint64_t i = 1, k, pushed, fails = 0
    cdef uint64_t buf[8]
    with nogil:
        while i <= n:
            if batched:
                k = 0
                while k < 8 and i + k <= n:
                    buf[k] = (pid << 40) | (i + k)
                    k += 1
                aop_mpmc_push_many_u64(c, buf, k, &pushed)
                if pushed == 0:
                    if aop_mpmc_push_u64(c, buf[0], -1) != AOP_Q_OK:
                        fails += 1
                        break
                    pushed = 1
                i += pushed
            else:
                if aop_mpmc_try_push_u64(c, (pid << 40) | i) == AOP_Q_OK:
                    i += 1
                elif aop_mpmc_push_u64(c, (pid << 40) | i, -1) == AOP_Q_OK:
                    i += 1
                else:
                    fails += 1
                    break
    return fails

def mpmc_consume(MPMCQueue q, int nprod):
    """Pop until closed and drained; check per-producer order.
    Returns (count, sum of values, order violations)."""
    cdef aop_mpmc_t *c = q.q
    cdef uint64_t v, count = 0, total = 0, bad = 0, p, i, k, popped
    cdef uint64_t buf[8]
    cdef uint64_t *last = <uint64_t *>malloc(nprod * sizeof(uint64_t))
    cdef int r
    for p in range(nprod):
        last[p] = 0
    with nogil:
        while True:
            if count & 1:
                r = aop_mpmc_pop_many_u64(c, buf, 8, &popped)
                if r != AOP_Q_OK:
                    r = aop_mpmc_pop_u64(c, &buf[0], -1)
                    popped = 1
            else:
                r = aop_mpmc_pop_u64(c, &buf[0], -1)
                popped = 1
            if r == AOP_Q_CLOSED:
                break
            if r != AOP_Q_OK:
                bad += 1000000
                break
            for k in range(popped):
                v = buf[k]
                p = v >> 40
                i = v & ((<uint64_t>1 << 40) - 1)
                if p >= <uint64_t>nprod or i <= last[p]:
                    bad += 1
                else:
                    last[p] = i
                count += 1
                total += v
    free(last)
    return count, total, bad

def mpmc_close(MPMCQueue q):
    with nogil:
        aop_mpmc_close(q.q)

def spsc_produce(SPSCQueue q, uint64_t n):
    cdef aop_spsc_t *c = q.q
    cdef uint64_t i = 1, fails = 0
    with nogil:
        while i <= n:
            if aop_spsc_try_push_u64(c, i) == AOP_Q_OK or aop_spsc_push_u64(c, i, -1) == AOP_Q_OK:
                i += 1
            else:
                fails += 1
                break
    return fails

def spsc_consume(SPSCQueue q):
    cdef aop_spsc_t *c = q.q
    cdef uint64_t v, expect = 1, count = 0, bad = 0
    cdef int r
    with nogil:
        while True:
            r = aop_spsc_try_pop_u64(c, &v)
            if r == AOP_Q_RETRY:
                r = aop_spsc_pop_u64(c, &v, -1)
            if r == AOP_Q_CLOSED:
                break
            if r != AOP_Q_OK:
                bad += 1000000
                break
            if v != expect:
                bad += 1
            expect = v + 1
            count += 1
    return count, bad

def mpmc_try_push(MPMCQueue q, uint64_t v):
    return aop_mpmc_try_push_u64(q.q, v)

def mpmc_try_pop(MPMCQueue q):
    cdef uint64_t v = 0
    cdef int r = aop_mpmc_try_pop_u64(q.q, &v)
    return r, v

def mpmc_pop_timeout(MPMCQueue q, int64_t ns):
    cdef uint64_t v = 0
    cdef int r
    with nogil:
        r = aop_mpmc_pop_u64(q.q, &v, ns)
    return r, v

def spsc_try_push(SPSCQueue q, uint64_t v):
    return aop_spsc_try_push_u64(q.q, v)

def spsc_try_pop(SPSCQueue q):
    cdef uint64_t v = 0
    cdef int r = aop_spsc_try_pop_u64(q.q, &v)
    return r, v
'''


@pytest.fixture(scope="module")
def cq(cybuild):
    return cybuild("queue_nogil_hammer", SOURCE)


def test_c_api_basics_and_modes(cq):
    OK, RETRY, CLOSED, BADMODE = cq.codes()
    q = MPMCQueue(2)
    assert cq.mpmc_try_pop(q) == (RETRY, 0)
    assert cq.mpmc_try_push(q, 2 ** 64 - 1) == OK           # any 64-bit word
    assert cq.mpmc_try_push(q, 0) == OK
    assert cq.mpmc_try_push(q, 5) == RETRY                   # full
    assert len(q) == 2 and q.full()                          # size queries work in any mode
    with pytest.raises(TypeError):                           # raw queue: no Python objects
        q.put(1)
    with pytest.raises(TypeError):
        q.get_nowait()
    with pytest.raises(TypeError):
        q.get_many(1)
    assert cq.mpmc_try_pop(q) == (OK, 2 ** 64 - 1)
    assert cq.mpmc_try_pop(q) == (OK, 0)
    q.close()
    assert cq.mpmc_try_push(q, 1) == CLOSED
    assert cq.mpmc_try_pop(q) == (CLOSED, 0)
    assert cq.mpmc_pop_timeout(q, 10_000_000) == (CLOSED, 0)

    p = MPMCQueue(4)
    p.put("object")                                          # object queue: no raw words
    assert cq.mpmc_try_push(p, 1) == BADMODE
    assert cq.mpmc_try_pop(p) == (BADMODE, 0)
    assert p.get() == "object"

    s = SPSCQueue(1)
    assert cq.spsc_try_push(s, 7) == OK
    assert cq.spsc_try_push(s, 8) == RETRY
    with pytest.raises(TypeError):
        s.put_nowait(1)
    assert cq.spsc_try_pop(s) == (OK, 7)
    assert cq.spsc_try_pop(s) == (RETRY, 0)
    s2 = SPSCQueue(2)
    s2.put(1)
    assert cq.spsc_try_push(s2, 1) == BADMODE


def test_c_api_timeout(cq):
    import time
    OK, RETRY, CLOSED, BADMODE = cq.codes()
    q = MPMCQueue(4)
    t0 = time.monotonic()
    assert cq.mpmc_pop_timeout(q, 50_000_000) == (RETRY, 0)
    assert 0.045 <= time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("capacity,batched", [(8, False), (64, True)])
def test_mpmc_nogil_hammer_exact_totals(cq, capacity, batched):
    P, C = 3, 3
    N = scaled(200_000)
    q = MPMCQueue(capacity)
    fails = []
    results = []

    def producer(pid):
        return lambda: fails.append(cq.mpmc_produce(q, pid, N, batched))

    def consumer():
        results.append(cq.mpmc_consume(q, P))

    prod_threads = [producer(p) for p in range(P)]
    done = []

    def producers_then_close():
        run_threads(prod_threads, timeout=90)
        done.append(1)
        cq.mpmc_close(q)

    run_threads([producers_then_close] + [consumer for _ in range(C)], timeout=120)
    assert done and fails == [0] * P
    count = sum(r[0] for r in results)
    total = sum(r[1] for r in results)
    bad = sum(r[2] for r in results)
    assert bad == 0
    assert count == P * N
    expect = sum((p << 40) * N + N * (N + 1) // 2 for p in range(P))
    assert total == expect
    assert cq.mpmc_try_pop(q)[0] == cq.codes()[2]           # closed and drained


def test_spsc_nogil_1x1_exact(cq):
    N = scaled(1_000_000)
    q = SPSCQueue(256)
    out = {}

    def prod():
        out["fails"] = cq.spsc_produce(q, N)
        q.close()

    def cons():
        out["cons"] = cq.spsc_consume(q)

    run_threads([prod, cons], timeout=90)
    assert out["fails"] == 0
    assert out["cons"] == (N, 0)


# ---- huge timeouts saturate: INT64_MAX is "practically forever", not "already expired" ----

FOREVER = r'''
# cython: language_level=3
from libc.stdint cimport uint64_t, int64_t, INT64_MAX
from aoprim._qwait cimport aop_qwait_t
from aoprim.atomic_h cimport aop_load_u32, AOP_RELAXED
from aoprim._mpmc cimport MPMCQueue, aop_mpmc_push_u64, aop_mpmc_pop_u64
from aoprim._spsc cimport SPSCQueue, aop_spsc_push_u64, aop_spsc_pop_u64

# the wait sets are private to aop_queue.h; a test may look at them to see a parked waiter
cdef extern from "aop_queue.h":
    ctypedef struct mpmc_view "aop_mpmc_t":
        aop_qwait_t not_empty
        aop_qwait_t not_full
    ctypedef struct spsc_view "aop_spsc_t":
        aop_qwait_t not_empty
        aop_qwait_t not_full

def waiters(q, bint producers):
    cdef aop_qwait_t *w
    if isinstance(q, MPMCQueue):
        w = &(<mpmc_view *>(<MPMCQueue>q).q).not_full if producers else \
            &(<mpmc_view *>(<MPMCQueue>q).q).not_empty
    else:
        w = &(<spsc_view *>(<SPSCQueue>q).q).not_full if producers else \
            &(<spsc_view *>(<SPSCQueue>q).q).not_empty
    return aop_load_u32(&w.waiters, AOP_RELAXED)   # relaxed: a snapshot to poll

def pop_max(q):
    cdef uint64_t v = 0
    cdef int r
    if isinstance(q, MPMCQueue):
        with nogil:
            r = aop_mpmc_pop_u64((<MPMCQueue>q).q, &v, INT64_MAX)
    else:
        with nogil:
            r = aop_spsc_pop_u64((<SPSCQueue>q).q, &v, INT64_MAX)
    return r, v

def push_max(q, uint64_t v):
    cdef int r
    if isinstance(q, MPMCQueue):
        with nogil:
            r = aop_mpmc_push_u64((<MPMCQueue>q).q, v, INT64_MAX)
    else:
        with nogil:
            r = aop_spsc_push_u64((<SPSCQueue>q).q, v, INT64_MAX)
    return r

def push(q, uint64_t v):
    return push_max(q, v)

def pop(q):
    return pop_max(q)
'''


@pytest.fixture(scope="module")
def cforever(cybuild):
    return cybuild("queue_nogil_forever", FOREVER)


@pytest.mark.parametrize("Q", [MPMCQueue, SPSCQueue], ids=lambda c: c.__name__)
@pytest.mark.parametrize("side", ["pop", "push"])
def test_c_level_wait_with_int64_max_blocks_until_it_can_proceed(cq, cforever, Q, side):
    """timeout_ns = INT64_MAX must not wrap the deadline into the past: the call waits (it
    parks) until another thread makes room / an item, then succeeds."""
    import time
    OK = cq.codes()[0]
    q = Q(1)
    if side == "push":
        assert cforever.push(q, 1) == OK                     # full now
    entering = threading.Event()
    result = []

    def waiter():
        entering.set()
        result.append(cforever.pop_max(q) if side == "pop" else cforever.push_max(q, 2))

    t = threading.Thread(target=waiter)
    t.start()
    assert entering.wait(10)
    deadline = time.monotonic() + 30
    while cforever.waiters(q, side == "push") == 0 and t.is_alive():
        assert time.monotonic() < deadline, "the waiter never parked"
        t.join(0.001)
    assert t.is_alive(), f"{side} with INT64_MAX returned at once: {result}"
    if side == "pop":
        assert cforever.push(q, 42) == OK
        t.join(10)
        assert result == [(OK, 42)]
    else:
        assert cforever.pop(q) == (OK, 1)
        t.join(10)
        assert result == [OK]
        assert cforever.pop(q) == (OK, 2)
