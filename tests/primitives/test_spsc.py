"""SPSCQueue under one producer thread and one consumer thread: 1 x 1 x 1M with every item
checked, the blocking paths with a tiny ring, close() from the producer side, references.
(The docs/api.md semantics shared with MPMCQueue are tested for both in test_mpmc.py.)"""
import gc
import sys
import threading
import time

import pytest

from aoprim import Closed, Empty, Full, SPSCQueue
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


# ---- misuse: two threads on one side are detected, never corrupting ----------------------

def _until(cond, what, timeout=10.0):
    """Poll cond() (which performs the operation under test) until it holds or time runs
    out: the state we wait for -- another thread parked in a blocking call -- has no event
    to wait on."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _refused(fn, not_yet):
    """True when fn() is refused as a second thread on a side (RuntimeError); False when it
    ran as the only one and found the ring empty or full (not_yet: the other thread has not
    claimed the side yet).  On a free-threaded build every operation claims its side, so this
    probe can also be the claim the other thread runs into: that thread retries (_claiming)."""
    try:
        fn()
    except RuntimeError:
        return True
    except not_yet:
        return False
    raise AssertionError(f"{fn!r} neither refused nor found the ring {not_yet.__name__}")


def _claiming(op):
    """Run op() in the thread that owns a side, again when the probe held the side at the
    instant op() claimed it (free-threaded builds)."""
    while True:
        try:
            return op()
        except RuntimeError:
            time.sleep(0.001)


@pytest.mark.timeout(30)
def test_second_producer_during_a_blocking_put_gets_runtimeerror():
    q = SPSCQueue(1)
    q.put("first")                              # full
    done = threading.Event()

    def producer():
        _claiming(lambda: q.put("second", timeout=20))  # waits without the GIL, side claimed
        done.set()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    # while the first producer waits, a second one is refused (not Full, not a corrupt ring)
    _until(lambda: _refused(lambda: q.put_nowait("intruder"), Full),
           "the producer to park")
    with pytest.raises(RuntimeError, match="one producer"):
        q.put("intruder", timeout=0.01)
    with pytest.raises(RuntimeError):
        q.put_many(["intruder"])
    assert q.get() == "first"                   # room: the waiting put completes
    assert done.wait(10)
    t.join(10)
    assert q.get_nowait() == "second" and q.qsize() == 0
    q.put_nowait("third")                       # the side is free again
    assert q.get_nowait() == "third"


@pytest.mark.timeout(30)
def test_second_consumer_during_a_blocking_get_gets_runtimeerror():
    q = SPSCQueue(4)
    got = []

    def consumer():
        got.append(_claiming(lambda: q.get(timeout=20)))

    t = threading.Thread(target=consumer, daemon=True)
    t.start()
    _until(lambda: _refused(q.get_nowait, Empty), "the consumer to park")
    with pytest.raises(RuntimeError, match="one consumer"):
        q.get(timeout=0.01)
    with pytest.raises(RuntimeError):
        q.get_many(4)
    q.put("x")
    t.join(10)
    assert got == ["x"]
    q.put("y")
    assert q.get_many(4) == ["y"]


@pytest.mark.timeout(60)
def test_two_producers_misusing_it_lose_nothing_and_leak_nothing():
    # A misuse stress: two producers push through a tiny ring with blocking puts.  Each put
    # either lands or raises RuntimeError; the consumer must receive exactly the items whose
    # put returned, each once, and every reference must come back.
    q = SPSCQueue(2)
    N = scaled(20_000)
    items = [[object() for _ in range(N)] for _ in range(2)]
    sample = [x for lst in items for x in lst[:: max(1, N // 20)]]
    base = [sys.getrefcount(x) for x in sample]
    landed = [[], []]
    refused = [0, 0]
    received = []

    def producer(k):
        for x in items[k]:
            try:
                q.put(x, timeout=20)
            except RuntimeError:
                refused[k] += 1
                continue
            landed[k].append(x)

    def consumer():
        while True:
            x = q.get(timeout=20)
            if x is None:
                return
            received.append(x)

    c = threading.Thread(target=consumer, daemon=True)
    c.start()
    run_threads([lambda: producer(0), lambda: producer(1)], timeout=50)
    q.put(None, timeout=20)
    c.join(20)
    assert not c.is_alive()
    assert len(received) == len(landed[0]) + len(landed[1])
    assert len({id(x) for x in received}) == len(received)          # nothing twice
    assert {id(x) for x in received} == {id(x) for x in landed[0] + landed[1]}
    assert len(received) + sum(refused) == 2 * N
    received.clear()
    landed[0].clear()
    landed[1].clear()
    gc.collect()
    assert [sys.getrefcount(x) for x in sample] == base              # no leak, no double free
