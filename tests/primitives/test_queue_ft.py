"""MPMCQueue and SPSCQueue from 2-8 real threads at once: what a GIL would serialise.

These run on every build and matter most on a free-threaded one (3.13t), where the threads
really run in parallel: objects created by one thread and got by another (their reference
travels in the ring and is handed over as is), every call shape of the hot methods (the fast
entries and Cython's wrapper), task_done()/join() counted from many threads, get_async
waiters woken by threads, close() racing blocked threads, and SPSC misuse from many threads
(a RuntimeError or success, never a crash: run in a child process so that a crash is a
failure with its exit status).  Every item is counted: exactly once, in order per producer,
and every reference comes back.
"""
import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest

from aoprim import Closed, Empty, Full, MPMCQueue, SPSCQueue
from support import FREE_THREADED, run_threads, scaled

pytestmark = pytest.mark.timeout(180)


class Item:
    """A fresh object per item (not immortal, owned by the thread that made it)."""
    __slots__ = ("p", "i", "__weakref__")

    def __init__(self, p, i):
        self.p, self.i = p, i


def _check_fifo_per_producer(received, producers):
    """Each consumer's list: items of one producer appear in increasing order."""
    for out in received:
        last = [-1] * producers
        for it in out:
            assert it.i > last[it.p], f"producer {it.p}: {it.i} after {last[it.p]}"
            last[it.p] = it.i


@pytest.mark.parametrize("threads", [2, 4, 8])
def test_every_thread_puts_and_gets_its_own_objects_each_once(threads):
    # The shared-queue pattern: every thread puts objects it made and gets whatever comes
    # next, so most objects end in another thread than their maker's.  Each call shape of
    # put/get goes through the queue: put(x), put_nowait(x), put(x, True, t), put(item=x),
    # get(), get_nowait(), get(timeout=t), get_many, put_many.
    N = scaled(20_000)
    q = MPMCQueue(64)
    made = [[Item(t, i) for i in range(N)] for t in range(threads)]
    refs = [weakref.ref(x) for lst in made for x in lst]
    received = [[] for _ in range(threads)]

    def worker(t):
        # Each round puts n items (n = 1, or up to 4 through put_many) and then gets exactly
        # n, so a thread putting holds fewer than 4 items in flight (the queue, 64 >= 8 * 4,
        # never fills) and a thread getting has put more than it got (the queue is not empty
        # while every thread gets): no blocking call can wait for ever.
        def run():
            mine, out = made[t], received[t]
            i = r = 0
            while i < N:
                k = r % 5
                if k == 4:
                    n = q.put_many(mine[i:i + 4])
                    for x in mine[i + n:i + 4]:
                        q.put(x, timeout=30)
                    n = len(mine[i:i + 4])
                else:
                    x = mine[i]
                    if k == 0:
                        q.put(x)
                    elif k == 1:
                        try:
                            q.put_nowait(x)
                        except Full:
                            q.put(x, timeout=30)
                    elif k == 2:
                        q.put(x, True, 30)
                    else:
                        q.put(item=x, timeout=30)
                    n = 1
                i += n
                k = r % 3
                if k == 2:
                    got = q.get_many(n)
                    out.extend(got)
                    n -= len(got)
                for _ in range(n):
                    if k == 0:
                        try:
                            out.append(q.get_nowait())
                        except Empty:
                            out.append(q.get(timeout=30))
                    elif k == 1:
                        out.append(q.get())
                    else:
                        out.append(q.get(block=True, timeout=30))
                r += 1
        return run

    run_threads([worker(t) for t in range(threads)], timeout=150)
    assert q.qsize() == 0                            # each thread got as many as it put
    assert sum(len(r) for r in received) == threads * N
    ids = {id(x) for r in received for x in r}
    assert len(ids) == threads * N                   # nothing twice, nothing lost
    _check_fifo_per_producer(received, threads)
    # every reference came back: once the makers' lists and the received lists go, each
    # object is freed (a reference the queue kept, or dropped twice, shows here or crashes)
    del made, received, ids
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


@pytest.mark.parametrize("producers,consumers", [(1, 1), (2, 2), (4, 4), (1, 7), (7, 1)])
def test_producer_objects_reach_consumers_exactly_once_in_order(producers, consumers):
    N = scaled(30_000)
    q = MPMCQueue(128)
    received = [[] for _ in range(consumers)]
    deaths = [0]
    lock = threading.Lock()

    class Counted(Item):
        __slots__ = ()

        def __del__(self):
            with lock:
                deaths[0] += 1

    def producer(p):
        def run():
            for i in range(N):          # made in this thread, dropped by a consumer
                q.put(Counted(p, i), timeout=30)
        return run

    def consumer(c):
        def run():
            out = received[c]
            while True:
                try:
                    out.append(q.get(timeout=30))
                except Closed:
                    return
        return run

    ps = [threading.Thread(target=producer(p), daemon=True) for p in range(producers)]
    cs = [threading.Thread(target=consumer(c), daemon=True) for c in range(consumers)]
    for t in cs + ps:
        t.start()
    for t in ps:
        t.join(120)
    assert not any(t.is_alive() for t in ps)
    q.close()
    for t in cs:
        t.join(60)
    assert not any(t.is_alive() for t in cs)
    assert sum(len(r) for r in received) == producers * N
    assert len({id(x) for r in received for x in r}) == producers * N
    _check_fifo_per_producer(received, producers)
    received.clear()
    gc.collect()
    assert deaths[0] == producers * N                # each object freed exactly once


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_task_done_from_many_threads_join_waits_for_the_last(workers):
    N = scaled(20_000)
    q = MPMCQueue(256)
    finished = [0] * workers
    joined = []

    def worker(w):
        def run():
            while True:
                try:
                    q.get(timeout=30)
                except Closed:
                    return
                finished[w] += 1
                q.task_done()
        return run

    def joiner():
        q.join()
        joined.append(sum(finished))     # every task_done happened before join returned

    ws = [threading.Thread(target=worker(w), daemon=True) for w in range(workers)]
    for t in ws:
        t.start()
    run_threads([lambda: [q.put(i, timeout=30) for i in range(N)] for _ in range(2)],
                timeout=120)
    j = threading.Thread(target=joiner, daemon=True)
    j.start()
    j.join(120)
    assert not j.is_alive()
    assert joined == [2 * N]
    q.close()
    for t in ws:
        t.join(60)
    assert sum(finished) == 2 * N
    with pytest.raises(ValueError):
        q.task_done()                    # the count is exactly 0: one more is refused


@pytest.mark.parametrize("Q", [MPMCQueue, SPSCQueue], ids=lambda c: c.__name__)
def test_get_async_woken_by_puts_from_many_threads(Q):
    # Coroutines in one loop wait in get_async while 4 threads put (SPSC: one producer
    # thread and one consumer coroutine); every item arrives once.
    producers = 4 if Q is MPMCQueue else 1
    getters = 3 if Q is MPMCQueue else 1
    N = scaled(5_000)
    q = Q(8)
    got = []

    async def getter():
        while True:
            try:
                got.append(await q.get_async())
            except Closed:
                return

    async def main():
        tasks = [asyncio.ensure_future(getter()) for _ in range(getters)]
        loop = asyncio.get_running_loop()

        def produce(p):
            for i in range(N):
                q.put((p, i), timeout=30)

        await asyncio.wait_for(asyncio.gather(*[
            loop.run_in_executor(None, produce, p) for p in range(producers)]), 120)
        q.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    asyncio.run(main())
    assert len(got) == producers * N
    assert len(set(got)) == producers * N
    last = [-1] * producers
    for p, i in got:                      # one consumer loop: FIFO per producer overall
        assert i > last[p]
        last[p] = i


@pytest.mark.parametrize("Q", [MPMCQueue, SPSCQueue], ids=lambda c: c.__name__)
def test_close_wakes_every_blocked_thread_of_both_sides(Q):
    # MPMC: 4 getters block on an empty queue, 4 putters on a full one; one close() wakes
    # all eight (SPSC: one of each side).  Each blocked call ends in Closed.
    n = 4 if Q is MPMCQueue else 1
    empty, full = Q(1), Q(1)
    full.put(0)
    outcomes = []
    lock = threading.Lock()
    ready = threading.Barrier(2 * n + 1)

    def getter():
        ready.wait(30)
        try:
            empty.get(timeout=60)
            r = "item"
        except Closed:
            r = "closed"
        with lock:
            outcomes.append(r)

    def putter():
        ready.wait(30)
        try:
            full.put(1, timeout=60)
            r = "put"
        except Closed:
            r = "closed"
        with lock:
            outcomes.append(r)

    ts = [threading.Thread(target=f, daemon=True) for f in [getter] * n + [putter] * n]
    for t in ts:
        t.start()
    ready.wait(30)
    # close while they wait or are about to: either way each one ends in Closed
    empty.close()
    full.close()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    assert outcomes == ["closed"] * (2 * n)
    assert full.get() == 0                # what was queued before close still drains
    with pytest.raises(Closed):
        full.get_nowait()


SPSC_MISUSE = textwrap.dedent("""
    import gc, sys, threading
    from aoprim import SPSCQueue, Closed
    P, C, N = {producers}, {consumers}, {n}
    q = SPSCQueue(4)
    items = [[object() for _ in range(N)] for _ in range(P)]
    base = [sys.getrefcount(x) for lst in items for x in lst[::97]]
    landed, refused, got = [[] for _ in range(P)], [0] * (P + C), [[] for _ in range(C)]
    go = threading.Barrier(P + C)

    def producer(k):
        go.wait()
        for x in items[k]:
            try:
                q.put(x, timeout=60)
            except RuntimeError:              # another producer holds the side
                refused[k] += 1
            else:
                landed[k].append(x)

    def consumer(k):
        go.wait()
        n = 0
        while True:
            n += 1
            try:
                batch = q.get_many(3) if n % 2 else []
                got[k].extend(batch or [q.get(timeout=60)])
            except Closed:                    # (a RuntimeError too: caught first)
                return
            except RuntimeError:              # another consumer holds the side
                refused[P + k] += 1

    ps = [threading.Thread(target=producer, args=(k,)) for k in range(P)]
    cs = [threading.Thread(target=consumer, args=(k,)) for k in range(C)]
    for t in ps + cs:
        t.start()
    for t in ps:
        t.join()
    q.close()                                 # consumers drain what is left, then stop
    for t in cs:
        t.join()
    recv = [x for g in got for x in g]
    put = [x for lst in landed for x in lst]
    assert len(recv) == len(put), (len(recv), len(put))
    assert {{id(x) for x in recv}} == {{id(x) for x in put}}
    assert len({{id(x) for x in recv}}) == len(recv)
    assert len(put) + sum(refused[:P]) == P * N
    del recv, put, got, landed
    gc.collect()
    assert [sys.getrefcount(x) for lst in items for x in lst[::97]] == base
    print("ok", sum(refused))
""")


@pytest.mark.parametrize("producers,consumers", [(2, 1), (4, 2), (1, 4)])
def test_spsc_misuse_from_many_threads_raises_or_succeeds_never_crashes(producers, consumers):
    # SPSCQueue allows one producer and one consumer thread.  More threads on a side is
    # misuse: each call either completes or raises RuntimeError, nothing is lost, taken
    # twice or leaked.  In a child process, so that a crash is a failure with its status.
    code = SPSC_MISUSE.format(producers=producers, consumers=consumers, n=scaled(2_000))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=150, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.startswith("ok"), r.stdout


def test_gil_stays_disabled_with_the_queues_imported():
    if not FREE_THREADED:
        pytest.skip("GIL build: nothing to check (the GIL is always enabled here)")
    code = ("import sys, aoprim._mpmc, aoprim._spsc, aoprim._qasync; "
            "from aoprim import MPMCQueue, SPSCQueue; "
            "q = MPMCQueue(4); q.put(1); q.get(); "
            "print(sys._is_gil_enabled())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", (r.stdout, r.stderr)
