"""get_async() / put_async(): coroutines and threads sharing one MPMCQueue or SPSCQueue.  A
thread's put wakes a waiting coroutine through its loop (no polling), a registration that
races with a put is never left asleep, close() wakes every coroutine, and cancelling one
takes no item and leaves nothing registered.  Real threads; every item counted; every wait
bounded."""
import asyncio
import gc
import sys
import threading
import weakref

import pytest

from aoprim import Closed, MPMCQueue, SPSCQueue
from support import scaled

pytestmark = pytest.mark.timeout(120)

BOUND = 30          # seconds: a lost wake-up shows as a TimeoutError, not a hang


@pytest.fixture(params=[MPMCQueue, SPSCQueue], ids=lambda c: c.__name__)
def Q(request):
    return request.param


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND))


def test_fast_paths(Q):
    async def main():
        q = Q(2)
        await q.put_async("a")
        await q.put_async("b")
        assert q.qsize() == 2
        assert await q.get_async() == "a"
        assert await q.get_async() == "b"
    run(main())


def test_thread_put_wakes_a_waiting_coroutine(Q):
    n = scaled(5000)

    async def main():
        q = Q(8)
        started = threading.Event()

        def producer():
            started.set()
            for i in range(n):
                q.put(i, timeout=BOUND)

        t = threading.Thread(target=producer, daemon=True)
        loop = asyncio.get_running_loop()
        t.start()
        await loop.run_in_executor(None, started.wait, BOUND)
        got = [await q.get_async() for _ in range(n)]
        t.join(BOUND)
        assert got == list(range(n))
        assert q.qsize() == 0
    run(main())


def test_thread_get_wakes_a_coroutine_waiting_for_room(Q):
    n = scaled(5000)

    async def main():
        q = Q(4)
        got = []

        def consumer():
            for _ in range(n):
                got.append(q.get(timeout=BOUND))

        t = threading.Thread(target=consumer, daemon=True)
        t.start()
        for i in range(n):
            await q.put_async(i)
        await asyncio.get_running_loop().run_in_executor(None, t.join, BOUND)
        assert got == list(range(n))
    run(main())


def test_registration_racing_a_put_is_not_lost(Q):
    """Each round a thread puts one item at the moment the coroutine starts waiting for it;
    many rounds cover the window between the coroutine's first try and its registration.
    A lost wake-up leaves get_async asleep: wait_for turns that into a failure.  (In a GIL
    build the window is compiled code that holds the GIL, so only a free-threaded build can
    hit it here; the two tests below put the other side's operation into it on purpose.)
    A tiny switch interval makes the GIL change hands as often as it can meanwhile."""
    rounds = scaled(2000)

    async def main():
        q = Q(1)
        go = threading.Semaphore(0)
        stop = []

        def producer():
            for i in range(rounds):
                go.acquire(timeout=BOUND)
                if stop:
                    return
                q.put(i, timeout=BOUND)

        t = threading.Thread(target=producer, daemon=True)
        t.start()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for i in range(rounds):
                go.release()
                assert await asyncio.wait_for(q.get_async(), 10) == i
        finally:
            sys.setswitchinterval(interval)
            stop.append(1)
            go.release()
            t.join(BOUND)
    run(main())


async def _with_op_in_the_window(coro, fn):
    """Run coro (a get_async / put_async) so that the running loop's next create_future() --
    which the coroutine calls after its first try failed and before it registers -- first
    runs fn in another thread to the end: the other side's operation lands exactly in that
    window.  Returns coro's result, or fails if it is still waiting after 5 s."""
    loop = asyncio.get_running_loop()
    make = loop.create_future
    called = []

    def create_future():
        loop.create_future = make           # once
        called.append(1)
        t = threading.Thread(target=fn)
        t.start()
        t.join(BOUND)
        return make()

    loop.create_future = create_future
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)                  # the task's first step: the hook runs in it
    assert called, "the coroutine never reached create_future()"
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done, "a lost wake-up: the coroutine still waits for what landed in the window"
    return task.result()


def test_put_between_first_try_and_registration_is_seen(Q):
    """Register, then re-check: the put that landed before the registration (so it found
    nobody to wake) is found by the re-check."""
    async def main():
        q = Q(1)
        assert await _with_op_in_the_window(q.get_async(), lambda: q.put("x")) == "x"
    run(main())


def test_get_between_first_try_and_registration_is_seen(Q):
    async def main():
        q = Q(1)
        q.put("first")
        await _with_op_in_the_window(q.put_async("second"), q.get)
        assert q.get_nowait() == "second"
    run(main())


def test_close_wakes_waiting_coroutines(Q):
    async def main():
        q = Q(1)
        getter = asyncio.ensure_future(q.get_async())
        await asyncio.sleep(0)                    # let it register
        q2 = Q(1)
        q2.put(0)
        putter = asyncio.ensure_future(q2.put_async(1))
        await asyncio.sleep(0)
        threading.Thread(target=q.close).start()
        threading.Thread(target=q2.close).start()
        with pytest.raises(Closed):
            await getter
        with pytest.raises(Closed):
            await putter
        assert q2.get() == 0                      # the put that was refused queued nothing
        with pytest.raises(Closed):
            q2.get_nowait()
    run(main())


def test_get_async_drains_then_closed(Q):
    async def main():
        q = Q(4)
        q.put_many([1, 2])
        q.close()
        assert await q.get_async() == 1
        assert await q.get_async() == 2
        with pytest.raises(Closed):
            await q.get_async()
        with pytest.raises(Closed):
            await q.put_async(3)
    run(main())


def _track_futures(created):
    """Make the running loop's create_future() record a weak reference to every future it
    makes (get_async / put_async register such futures with the queue)."""
    loop = asyncio.get_running_loop()
    make = loop.create_future

    def create_future():
        fut = make()
        created.append(weakref.ref(fut))
        return fut
    loop.create_future = create_future


def test_cancelled_get_leaves_no_waiter_and_takes_no_item(Q):
    q = Q(2)
    created = []

    async def main():
        _track_futures(created)
        task = asyncio.ensure_future(q.get_async())
        await asyncio.sleep(0)                    # it registered and awaits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    gc.collect()
    assert len(created) == 1
    # the queue is alive: a future it still held would be alive too
    assert created[0]() is None
    q.put("x")                                    # no waiter to wake
    assert q.qsize() == 1 and q.get_nowait() == "x"


def test_cancelled_put_leaves_no_waiter_and_queues_nothing(Q):
    q = Q(1)
    q.put("first")
    created = []

    async def main():
        _track_futures(created)
        task = asyncio.ensure_future(q.put_async(object()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    gc.collect()
    assert len(created) == 1 and created[0]() is None
    assert q.get_nowait() == "first"
    assert q.qsize() == 0                         # the cancelled put never landed


def test_woken_and_finished_waiters_leave_nothing(Q):
    q = Q(1)
    created = []

    async def main():
        _track_futures(created)
        loop = asyncio.get_running_loop()
        for i in range(20):
            task = asyncio.ensure_future(q.get_async())
            await asyncio.sleep(0)
            await loop.run_in_executor(None, q.put, i)
            assert await task == i

    run(main())
    gc.collect()
    assert created and all(r() is None for r in created)


def test_cancelled_waiter_swallows_no_wake_up():
    """Two coroutines wait; a thread puts one item; the coroutine the put woke is cancelled
    before it runs.  The other one still gets the item (every waiter is woken)."""
    async def main():
        q = MPMCQueue(2)
        a = asyncio.ensure_future(q.get_async())
        b = asyncio.ensure_future(q.get_async())
        await asyncio.sleep(0)
        t = threading.Thread(target=q.put, args=("x",))
        t.start()
        await asyncio.get_running_loop().run_in_executor(None, t.join, BOUND)
        a.cancel()
        assert await b == "x"
        with pytest.raises(asyncio.CancelledError):
            await a
    run(main())


def test_mpmc_threads_and_coroutines_every_item_once():
    """2 producer threads and 2 consumer threads, and 3 producer and 3 consumer coroutines
    on one loop, through one small queue: every item arrives exactly once."""
    per = scaled(3000)

    async def main():
        q = MPMCQueue(8)
        got_threads = [[], []]
        got_coros = [[], [], []]
        stop = object()

        def t_producer(k):
            for i in range(per):
                q.put(("t", k, i), timeout=BOUND)

        def t_consumer(k):
            while True:
                x = q.get(timeout=BOUND)
                if x is stop:
                    return
                got_threads[k].append(x)

        async def c_producer(k):
            for i in range(per):
                await q.put_async(("c", k, i))

        async def c_consumer(k):
            while True:
                x = await q.get_async()
                if x is stop:
                    return
                got_coros[k].append(x)

        loop = asyncio.get_running_loop()
        threads = ([threading.Thread(target=t_producer, args=(k,), daemon=True) for k in range(2)]
                   + [threading.Thread(target=t_consumer, args=(k,), daemon=True) for k in range(2)])
        for t in threads:
            t.start()
        consumers = [asyncio.ensure_future(c_consumer(k)) for k in range(3)]
        await asyncio.gather(*(c_producer(k) for k in range(3)))
        for t in threads[:2]:
            await loop.run_in_executor(None, t.join, BOUND)
        for _ in range(5):
            await q.put_async(stop)
        await asyncio.gather(*consumers)
        for t in threads[2:]:
            await loop.run_in_executor(None, t.join, BOUND)
        items = sorted(x for g in got_threads + got_coros for x in g)
        want = sorted([("t", k, i) for k in range(2) for i in range(per)]
                      + [("c", k, i) for k in range(3) for i in range(per)])
        assert items == want
    run(main())
