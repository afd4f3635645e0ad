"""Leak checks: each primitive made, used and dropped N times (AOPRIM_LEAK_N, default 20000;
100000 for a thorough run).  After a warm-up round, N more rounds must not grow:
- tracemalloc's traced memory (beyond a small bound: caches, free lists, interned ints);
- the number of live objects of the primitive's types (gc.get_objects(): the types the
  collector tracks -- RefCount, queues, BlockTable, SendBatch; the others are plain memory,
  which tracemalloc sees);
- any pool's in_use, and the open file descriptors (/proc/self/fd).
Each check can fail: test_leak_check_sees_a_leak proves the harness flags a real leak.
"""
import gc
import os
import socket
import tracemalloc

import pytest

from aoprim import (AtomicInt, BlockTable, MPMCQueue, RefCount, SendBatch, SlabPool,
                    SPSCQueue, SpinLock)

N = int(os.environ.get("AOPRIM_LEAK_N", "20000"))
GROWTH = 64 * 1024            # bytes of traced growth tolerated over N rounds


def fds():
    return len(os.listdir("/proc/self/fd"))


def live(types):
    return sum(1 for o in gc.get_objects() if type(o) in types)


def measure(body, n, types=()):
    """Run body() n times after a warm-up; return (traced growth, live-object growth, fd
    growth)."""
    for _ in range(min(n, 200)):
        body()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        objs, nfd = live(types), fds()
        for _ in range(n):
            body()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return after - before, live(types) - objs, fds() - nfd


def assert_no_leak(body, types=(), n=N, pools=()):
    used = [p.in_use for p in pools]
    mem, objs, nfd = measure(body, n, types)
    assert [p.in_use for p in pools] == used, f"slots not returned: {pools}"
    assert mem < GROWTH, f"traced memory grew by {mem} bytes over {n} rounds"
    assert objs <= 0, f"{objs} more live objects of {types}"
    assert nfd <= 0, f"{nfd} more open file descriptors"


@pytest.fixture(scope="module")
def pool():
    p = SlabPool(256, 64)
    yield p
    assert p.in_use == 0


def test_atomic_and_refcount():
    def body():
        a = AtomicInt(5)
        a.fetch_add(3)
        a.compare_exchange(8, 1)
        r = RefCount(1, on_zero=lambda: a.store(0))
        r.incref()
        r.decref()
        r.decref()
        c = RefCount(2, on_zero=lambda: c)          # a cycle through on_zero
        c.decref()
    assert_no_leak(body, (AtomicInt, RefCount))


def test_spinlock():
    def body():
        lk = SpinLock()
        with lk:
            pass
        lk.acquire(False)
        lk.release()
    assert_no_leak(body, (SpinLock,))


@pytest.mark.parametrize("cls", [MPMCQueue, SPSCQueue])
def test_queues(cls):
    def body():
        q = cls(8)
        q.put_nowait(b"x" * 10)
        q.put_many([1, 2, [3]])
        q.get_nowait()
        q.get_many(2)
        q.put_nowait(q)                           # a cycle through a queued item
        q.close()
    assert_no_leak(body, (cls,))


def test_slab_pool_and_slots(pool):
    def body():
        p = SlabPool(64, 4)
        s = p.acquire()
        s.length = 10
        bytes(s.data)
        s.retain().release()
        s.release()
        with pool.acquire() as t:
            with memoryview(t) as m:
                m[0] = 1
    assert_no_leak(body, (SlabPool,), pools=(pool,))


def test_blocktable(pool):
    def body():
        t = BlockTable(pool)
        t.append(b"y" * 700)
        f = t.fork()
        f.append(b"z")
        v = t.view(0, 10)
        t.consume(300)
        with memoryview(t.tail()) as w:
            w[:1] = b"q"
        t.commit(1)
        t.read(5, 50)
        v.release()
        f.release()
        cyc = [t]
        cyc.append(cyc)
        t.release()                               # emptied before the collector sees it
    assert_no_leak(body, (BlockTable,), pools=(pool,))


def test_sendbatch(pool):
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)

    def body():
        sb = SendBatch(a, auto_flush=False)
        sb.add(b"hello")
        sb.add(bytearray(3000))
        s = pool.acquire()
        s.length = 100
        sb.add(s)
        s.release()                               # the batch holds the other reference
        sb.add(memoryview(b"abc" * 1000))
        sb.flush()
        sb.clear()
        while True:
            try:
                b.recv(1 << 16)
            except BlockingIOError:
                break
        sock = SendBatch(a.fileno())
        sock.add(b"x")
    try:
        assert_no_leak(body, (SendBatch,), pools=(pool,))
    finally:
        a.close()
        b.close()
    assert pool.in_use == 0


def test_fd_check_sees_a_leak():
    """The fd count sees leaked descriptors."""
    kept = []
    _, _, nfd = measure(lambda: kept.append(os.dup(2)), 20)
    for fd in kept:
        os.close(fd)
    assert nfd == 20


def test_leak_check_sees_a_leak(pool):
    """The harness fails on a real leak: slots never returned, objects kept."""
    kept = []

    def body():
        kept.append(bytes(100))
    with pytest.raises(AssertionError, match="grew"):
        assert_no_leak(body, n=2000)
    kept.clear()
    with pytest.raises(AssertionError, match="more live"):
        assert_no_leak(lambda: kept.append(RefCount()), (RefCount,), n=100)
    kept.clear()
    with pytest.raises(AssertionError, match="not returned"):
        assert_no_leak(lambda: kept.append(pool.try_acquire()), n=10, pools=(pool,))
    for s in kept:
        s.release()
