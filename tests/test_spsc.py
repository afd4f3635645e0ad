"""SPSCQueue under one producer thread and one consumer thread: 1 x 1 x 1M with every item
checked, the blocking paths with a tiny ring, close() from the producer side, references.
(The API.md semantics shared with MPMCQueue are tested for both in test_mpmc.py.)"""
import gc
import sys
import threading

from aoprim import Closed, Full, SPSCQueue
from support import run_threads, scaled


def test_spsc_1x1_1m_every_item_in_order_refcounts_restored():
    N = scaled(1_000_000)
    items = [object() for _ in range(N)]
    sample = items[:: max(1, N // 50)]
    base = [sys.getrefcount(x) for x in sample]
    q = SPSCQueue(1024)
    received = []

    def producer():
        i = 0
        while i < N:
            n = q.put_many(items[i:i + 64])    # batches, falling back to a blocking put
            if n == 0:
                q.put(items[i], timeout=30)
                n = 1
            i += n
        q.close()

    def consumer():
        out = received
        while True:
            try:
                got = q.get_many(64)         # raises Closed too, once drained
                if got:
                    out.extend(got)
                else:
                    out.append(q.get(timeout=30))
            except Closed:
                return

    run_threads([producer, consumer], timeout=120)
    assert len(received) == N
    assert all(a is b for a, b in zip(received, items))   # order: exactly the sent sequence
    del received
    del q
    gc.collect()
    assert [sys.getrefcount(x) for x in sample] == base


def test_spsc_tiny_ring_blocking_both_sides():
    # capacity 2 forces both sides through the spin / yield / park path constantly
    N = scaled(100_000)
    q = SPSCQueue(2)
    got = []

    def producer():
        for i in range(N):
            q.put(i, timeout=30)
        q.close()

    def consumer():
        while True:
            try:
                got.append(q.get(timeout=30))
            except Closed:
                return

    run_threads([producer, consumer], timeout=120)
    assert got == list(range(N))


def test_spsc_capacity_one():
    q = SPSCQueue(1)
    assert q.capacity == 1
    for i in range(100):
        q.put_nowait(i)
        assert q.full()
        try:
            q.put_nowait(-1)
            raise AssertionError("put into a full ring")
        except Full:
            pass
        assert q.get_nowait() == i
        assert q.empty()


def test_spsc_close_from_producer_while_consumer_waits():
    q = SPSCQueue(8)
    seen = []
    ready = threading.Event()

    def consumer():
        ready.set()
        while True:
            try:
                seen.append(q.get(timeout=30))
            except Closed:
                seen.append("closed")
                return

    t = threading.Thread(target=consumer)
    t.start()
    assert ready.wait(10)
    for i in range(5):
        q.put(i)
    q.close()
    t.join(10)
    assert not t.is_alive()
    assert seen == [0, 1, 2, 3, 4, "closed"]


def test_spsc_wraps_indices_many_times():
    q = SPSCQueue(4)
    expect = 0
    nxt = 0
    for rnd in range(2000):
        k = rnd % 5
        nxt += q.put_many(range(nxt, nxt + k))
        for x in q.get_many(rnd % 3 + 1):
            assert x == expect
            expect += 1
    assert q.get_many(10) == list(range(expect, nxt))
