"""Queue benchmarks: MPMCQueue and SPSCQueue beside queue.SimpleQueue, queue.Queue and
collections.deque, all in the same run (ratios are what we report; the machine is shared).

    pytest bench/bench_queues.py --benchmark-enable

Scenarios (issue 3):
- queue-1thread:   put+get pairs from one thread (fast path, nothing ever waits)
- queue-batch16:   put_many / get_many of 16, per item, beside single put/get
- queue-2p2c:      2 producer + 2 consumer threads, items/s (blocking put/get, sentinels)
- queue-spsc-1p1c: 1 producer + 1 consumer thread, items/s
- queue-c-level:   enqueue+dequeue through the nogil C API, beside a bare loop
"""
import collections
import queue
import threading

import pytest

from aoprim import MPMCQueue, SPSCQueue

PAIRS = 2000            # put+get pairs per timed call (per_call)
THREAD_ITEMS = 1_000_000  # items per timed call in the threaded scenarios (steady state, not thread start-up)


def _pairs(put, get):
    item = object()
    r = range(PAIRS)

    def run():
        for _ in r:
            put(item)
            get()
    return run


# ---- single thread ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["MPMCQueue.put+get", "SPSCQueue.put+get",
                                  "MPMCQueue.put_nowait+get_nowait",
                                  "SimpleQueue.put+get", "Queue(1024).put_nowait+get_nowait",
                                  "deque.append+popleft"])
def test_single_thread_put_get(benchmark, name):
    benchmark.group = "queue-1thread"
    if name == "MPMCQueue.put+get":
        q = MPMCQueue(1024)
        fn = _pairs(q.put, q.get)
    elif name == "SPSCQueue.put+get":
        q = SPSCQueue(1024)
        fn = _pairs(q.put, q.get)
    elif name == "MPMCQueue.put_nowait+get_nowait":
        q = MPMCQueue(1024)
        fn = _pairs(q.put_nowait, q.get_nowait)
    elif name == "SimpleQueue.put+get":
        q = queue.SimpleQueue()
        fn = _pairs(q.put, q.get)
        benchmark.extra_info["baseline"] = True
    elif name == "Queue(1024).put_nowait+get_nowait":
        q = queue.Queue(1024)
        fn = _pairs(q.put_nowait, q.get_nowait)
    else:
        q = collections.deque()
        fn = _pairs(q.append, q.popleft)
    benchmark.extra_info["per_call"] = PAIRS
    benchmark(fn)


# ---- batches of 16 -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["MPMCQueue.put+get (single)", "MPMCQueue.put_many+get_many(16)",
                                  "SPSCQueue.put_many+get_many(16)", "SimpleQueue.put+get"])
def test_batch16(benchmark, name):
    benchmark.group = "queue-batch16"
    batch = [object() for _ in range(16)]
    rounds = PAIRS // 16
    if name == "MPMCQueue.put+get (single)":
        q = MPMCQueue(1024)
        fn = _pairs(q.put, q.get)
        benchmark.extra_info["baseline"] = True
        per = PAIRS
    elif name == "SimpleQueue.put+get":
        q = queue.SimpleQueue()
        fn = _pairs(q.put, q.get)
        per = PAIRS
    else:
        q = (MPMCQueue if name.startswith("MPMC") else SPSCQueue)(1024)
        put_many, get_many, r = q.put_many, q.get_many, range(rounds)

        def fn():
            for _ in r:
                put_many(batch)
                get_many(16)
        per = rounds * 16
    benchmark.extra_info["per_call"] = per
    benchmark(fn)


# ---- threads -------------------------------------------------------------------------------

def _threaded(q, producers, consumers, n):
    """Move n items from `producers` threads to `consumers` threads through q (blocking
    put/get, one None sentinel per consumer); returns the number received."""
    per = n // producers
    counts = [0] * consumers
    put, get = q.put, q.get

    def produce():
        item = 1
        for _ in range(per):
            put(item)

    def consume(i):
        c = 0
        while get() is not None:
            c += 1
        counts[i] = c

    ps = [threading.Thread(target=produce) for _ in range(producers)]
    cs = [threading.Thread(target=consume, args=(i,)) for i in range(consumers)]
    for t in cs + ps:
        t.start()
    for t in ps:
        t.join(120)
    for _ in cs:
        put(None)
    for t in cs:
        t.join(120)
    assert sum(counts) == per * producers
    return sum(counts)


# SimpleQueue is unbounded and never makes a producer wait; a bounded queue under the GIL
# pays two GIL hand-overs each time it runs full / empty, so we also show a capacity that
# the run rarely fills.
QUEUES_2P2C = {
    "MPMCQueue(1024) 2P+2C": lambda: MPMCQueue(1024),
    "MPMCQueue(65536) 2P+2C": lambda: MPMCQueue(65536),
    "SimpleQueue 2P+2C": queue.SimpleQueue,
    "Queue(1024) 2P+2C": lambda: queue.Queue(1024),
}


@pytest.mark.parametrize("name", list(QUEUES_2P2C))
def test_2p2c_items_per_second(benchmark, name):
    benchmark.group = "queue-2p2c"
    if name.startswith("SimpleQueue"):
        benchmark.extra_info["baseline"] = True
    n = THREAD_ITEMS if not name.startswith("Queue(") else THREAD_ITEMS // 4
    benchmark.extra_info["per_call"] = n
    make = QUEUES_2P2C[name]
    benchmark.pedantic(lambda: _threaded(make(), 2, 2, n), rounds=5, iterations=1)


QUEUES_1P1C = {
    "SPSCQueue(1024) 1P+1C": lambda: SPSCQueue(1024),
    "SPSCQueue(65536) 1P+1C": lambda: SPSCQueue(65536),
    "MPMCQueue(1024) 1P+1C": lambda: MPMCQueue(1024),
    "SimpleQueue 1P+1C": queue.SimpleQueue,
}


@pytest.mark.parametrize("name", list(QUEUES_1P1C))
def test_spsc_1p1c_items_per_second(benchmark, name):
    benchmark.group = "queue-spsc-1p1c"
    if name.startswith("SimpleQueue"):
        benchmark.extra_info["baseline"] = True
    benchmark.extra_info["per_call"] = THREAD_ITEMS
    make = QUEUES_1P1C[name]
    benchmark.pedantic(lambda: _threaded(make(), 1, 1, THREAD_ITEMS), rounds=5, iterations=1)


def _threaded_batch_consumer(q, n):
    """1 producer (single put) + 1 consumer that drains what is ready: a blocking get() for
    the first item, then get_many(63) -- the IOCP worker's loop.  Returns items received."""
    got = [0]

    def produce():
        put = q.put
        for _ in range(n):
            put(1)
        put(None)

    def consume():
        get, get_many = q.get, q.get_many
        c = 0
        while True:
            if get() is None:
                break
            c += 1
            batch = get_many(63)
            if batch and batch[-1] is None:
                c += len(batch) - 1
                break
            c += len(batch)
        got[0] = c

    ts = [threading.Thread(target=consume), threading.Thread(target=produce)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got[0] == n
    return n


def test_spsc_1p1c_batch_consumer_items_per_second(benchmark):
    benchmark.group = "queue-spsc-1p1c"
    benchmark.extra_info["per_call"] = THREAD_ITEMS
    benchmark.pedantic(lambda: _threaded_batch_consumer(SPSCQueue(65536), THREAD_ITEMS),
                       rounds=5, iterations=1)


# ---- C level -------------------------------------------------------------------------------

C_SOURCE = r'''
# cython: language_level=3
from libc.stdint cimport uint64_t
from aoprim._mpmc cimport MPMCQueue, aop_mpmc_try_push_u64, aop_mpmc_try_pop_u64
from aoprim._spsc cimport SPSCQueue, aop_spsc_try_push_u64, aop_spsc_try_pop_u64

cdef volatile uint64_t sink

def mpmc_loop(MPMCQueue q, uint64_t n):
    cdef uint64_t i, v, acc = 0
    with nogil:
        for i in range(n):
            aop_mpmc_try_push_u64(q.q, i)
            aop_mpmc_try_pop_u64(q.q, &v)
            acc += v
    global sink
    sink = acc

def spsc_loop(SPSCQueue q, uint64_t n):
    cdef uint64_t i, v, acc = 0
    with nogil:
        for i in range(n):
            aop_spsc_try_push_u64(q.q, i)
            aop_spsc_try_pop_u64(q.q, &v)
            acc += v
    global sink
    sink = acc

def bare_loop(uint64_t n):
    cdef uint64_t i, acc = 0
    global sink
    with nogil:
        for i in range(n):
            sink = i
            acc += sink
    sink = acc
'''

C_N = 200_000


@pytest.fixture(scope="module")
def cmod(cybuild):
    return cybuild("bench_queue_c", C_SOURCE)


@pytest.mark.parametrize("name", ["bare loop", "MPMC try_push+try_pop (nogil)",
                                  "SPSC try_push+try_pop (nogil)"])
def test_c_level_enqueue_dequeue(benchmark, cmod, name):
    benchmark.group = "queue-c-level"
    benchmark.extra_info["per_call"] = C_N
    if name == "bare loop":
        benchmark.extra_info["baseline"] = True
        benchmark(cmod.bare_loop, C_N)
    elif name.startswith("MPMC"):
        benchmark(cmod.mpmc_loop, MPMCQueue(1024), C_N)
    else:
        benchmark(cmod.spsc_loop, SPSCQueue(1024), C_N)
