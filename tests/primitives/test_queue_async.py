"""get_async() / put_async(): coroutines and threads sharing one MPMCQueue or SPSCQueue.  A
thread's put wakes a waiting coroutine through its loop (no polling), a registration that
races with a put is never left asleep, close() wakes every coroutine, and cancelling one
takes no item and leaves nothing registered.  Real threads; every item counted; every wait
bounded."""
import asyncio
import gc
import inspect
import sys
import threading
import weakref
from unittest.mock import create_autospec

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
    """Two coroutines wait; a thread puts one item, which wakes the first; that one is
    cancelled before its wake-up reaches it (the loop is held meanwhile).  The wake-up goes
    to the other one, which gets the item."""
    async def main():
        q = MPMCQueue(2)
        a = asyncio.ensure_future(q.get_async())
        b = asyncio.ensure_future(q.get_async())
        await asyncio.sleep(0)
        t = threading.Thread(target=q.put, args=("x",))
        t.start()
        t.join(BOUND)                 # blocks the loop: a's wake-up waits in its queue
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


# ---- coroutine functions to inspect, asyncio and unittest.mock ---------------------------

def test_async_methods_are_coroutine_functions(Q):
    q = Q(2)
    for f in (Q.get_async, Q.put_async, q.get_async, q.put_async):
        assert inspect.iscoroutinefunction(f), f
    coro = q.put_async(1)
    assert inspect.iscoroutine(coro)
    coro.close()
    assert q.qsize() == 0                 # a coroutine never started did nothing


def test_autospec_makes_awaitable_mocks(Q):
    m = create_autospec(Q, instance=True)
    m.get_async.return_value = "item"

    async def main():
        assert await m.get_async() == "item"
        await m.put_async("x")
        m.put_async.assert_awaited_once_with("x")
    run(main())


# ---- a put wakes one waiting coroutine, not all of them -----------------------------------

def _count_wake_ups(counter):
    """Make the running loop's call_soon_threadsafe() count the calls (a put wakes a
    waiting coroutine through it)."""
    loop = asyncio.get_running_loop()
    call = loop.call_soon_threadsafe

    def call_soon_threadsafe(*args, **kwargs):
        counter.append(1)
        return call(*args, **kwargs)
    loop.call_soon_threadsafe = call_soon_threadsafe


@pytest.mark.parametrize("waiters", [1, 10, 50])
def test_one_item_wakes_one_waiter(waiters):
    async def main():
        q = MPMCQueue(4)
        wakes = []
        _count_wake_ups(wakes)
        tasks = [asyncio.ensure_future(q.get_async()) for _ in range(waiters)]
        await asyncio.sleep(0)                        # every one of them registered
        t = threading.Thread(target=q.put, args=("x",))
        t.start()
        t.join(BOUND)
        done, pending = await asyncio.wait(tasks, timeout=10,
                                           return_when=asyncio.FIRST_COMPLETED)
        assert [d.result() for d in done] == ["x"]
        assert len(wakes) == 1
        q.close()                                     # wakes all: each raises Closed
        for p in pending:
            with pytest.raises(Closed):
                await p
        assert len(wakes) == waiters
    run(main())


def test_one_free_slot_wakes_one_putter():
    async def main():
        q = MPMCQueue(1)
        q.put_nowait("full")
        wakes = []
        _count_wake_ups(wakes)
        tasks = [asyncio.ensure_future(q.put_async(i)) for i in range(10)]
        await asyncio.sleep(0)
        t = threading.Thread(target=q.get)
        t.start()
        t.join(BOUND)
        done, pending = await asyncio.wait(tasks, timeout=10,
                                           return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(wakes) == 1
        for p in pending:
            p.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert q.qsize() == 1
    run(main())


def test_cancelled_woken_waiter_passes_its_wake_up_on():
    """Of three waiters the put wakes the first; it is cancelled after its wake-up was
    delivered (its future done) but before it ran: the wake-up goes to the next one."""
    async def main():
        q = MPMCQueue(2)
        a, b, c = (asyncio.ensure_future(q.get_async()) for _ in range(3))
        await asyncio.sleep(0)
        t = threading.Thread(target=q.put, args=("x",))
        t.start()
        t.join(BOUND)
        await asyncio.sleep(0)                        # the loop ran the wake-up callback
        a.cancel()
        done, _ = await asyncio.wait([b, c], timeout=10,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert [d.result() for d in done] == ["x"]
        with pytest.raises(asyncio.CancelledError):
            await a
        q.close()
        await asyncio.gather(b, c, return_exceptions=True)
    run(main())


def test_waiter_of_a_closed_loop_passes_its_wake_up_on():
    """The first waiter's loop was closed while it waited: the put's wake-up goes to the
    next waiter (of a running loop) instead of being lost."""
    q = MPMCQueue(2)
    dead = asyncio.new_event_loop()
    stuck = dead.create_task(q.get_async())
    dead.run_until_complete(asyncio.sleep(0))           # it registered
    dead.close()

    async def main():
        b = asyncio.ensure_future(q.get_async())
        await asyncio.sleep(0)
        t = threading.Thread(target=q.put, args=("x",))
        t.start()
        t.join(BOUND)
        assert await b == "x"
    run(main())
    assert not stuck.done()
    stuck._log_destroy_pending = False                   # it can never run: no warning


@pytest.mark.parametrize("loops", [1, 2])
def test_many_waiters_thread_producers_every_item_once(loops):
    """40 consumer coroutines (on one loop, or spread over two loops in two threads) and 3
    producer threads through a small queue; consumers are cancelled and replaced meanwhile.
    Every item is got exactly once and nobody is left asleep while items wait."""
    per = scaled(2000)
    n_cons = 40
    q = MPMCQueue(8)
    got = []                       # list.append is atomic: shared by both loops

    async def consumer():
        try:
            while True:
                got.append(await q.get_async())
        except Closed:
            pass

    async def churn(tasks):
        # cancel and replace a consumer now and then while the items flow
        k = 0
        while len(got) < 3 * per // 2:
            await asyncio.sleep(0)
            k += 1
            if k % 50 == 0:
                i = k % len(tasks)
                tasks[i].cancel()
                tasks[i] = asyncio.ensure_future(consumer())
        return tasks

    async def side(n):
        tasks = [asyncio.ensure_future(consumer()) for _ in range(n)]
        tasks = await churn(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)

    def producer(k):
        for i in range(per):
            q.put((k, i), timeout=BOUND)

    other = None
    if loops == 2:
        other = threading.Thread(target=lambda: run(side(n_cons // 2)), daemon=True)
        other.start()

    async def main():
        producers = [threading.Thread(target=producer, args=(k,), daemon=True)
                     for k in range(3)]
        for t in producers:
            t.start()
        here = asyncio.ensure_future(side(n_cons // loops))
        loop = asyncio.get_running_loop()
        for t in producers:
            await loop.run_in_executor(None, t.join, BOUND)
        # every item put: wait until the consumers took them all, then release them
        while len(got) < 3 * per:
            await asyncio.sleep(0.001)
        q.close()
        await here
    run(main())
    if other is not None:
        other.join(BOUND)
        assert not other.is_alive()
    assert sorted(got) == sorted((k, i) for k in range(3) for i in range(per))
