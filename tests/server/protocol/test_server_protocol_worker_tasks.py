"""Tasks a protocol creates with ``workers=N``, where its callbacks run on a worker and the
loop's task steps on the loop thread: an eager task factory (``asyncio.eager_task_factory``,
``create_eager_task_factory``) starts a worker's task on the loop thread, not eagerly on the
worker (asyncio's current task is one per loop: two threads swapping it would break every
later task step), and ``asyncio.current_task()`` in a worker's callback answers for the loop.
Both Layer 1 backends, with and without workers."""
import asyncio
import socket
import threading

import pytest

from server_support import recv_exact, wait_for
from protocol_support import backend, on_asyncio, serve, workers  # noqa: F401

pytestmark = pytest.mark.timeout(90)

needs_eager = pytest.mark.skipif(not hasattr(asyncio, "eager_task_factory"),
                                 reason="asyncio's eager tasks: Python 3.12+")

FACTORIES = ["eager_task_factory", "create_eager_task_factory"]


def _factory(kind):
    if kind == "eager_task_factory":
        return asyncio.eager_task_factory
    return asyncio.create_eager_task_factory(asyncio.Task)


class EagerReplies(asyncio.Protocol):
    """Sets an eager task factory; each message (ending in b";") is answered by a task it
    starts from data_received, after one more step.  ``first_steps`` records, per task,
    whether its first step ran inside create_task on data_received's own thread; the
    exceptions the loop reports go to ``errors``."""

    def __init__(self, kind, first_steps, errors):
        self.kind = kind
        self.first_steps = first_steps
        self.errors = errors

    def connection_made(self, transport):
        self.t = transport
        loop = asyncio.get_running_loop()
        loop.set_task_factory(_factory(self.kind))
        loop.set_exception_handler(
            lambda loop, ctx: self.errors.append(ctx.get("exception") or ctx["message"]))

    def data_received(self, data):
        me = threading.get_ident()
        ran = []
        asyncio.get_running_loop().create_task(self.answer(data, ran))
        self.first_steps.append(ran == [me])

    async def answer(self, data, ran):
        ran.append(threading.get_ident())
        await asyncio.sleep(0)
        self.t.write(b"ok:" + data)


def _ask(address, i, rounds, done):
    # one message at a time, each answered before the next: every reply is counted
    with socket.create_connection(address, timeout=20) as c:
        n = 0
        for k in range(rounds):
            m = b"%d-%d;" % (i, k)
            c.sendall(m)
            if recv_exact(c, len(m) + 3, timeout=20) != b"ok:" + m:
                break
            n += 1
        done.append(n)


@needs_eager
@pytest.mark.parametrize("kind", FACTORIES)
def test_an_eager_task_from_a_worker_starts_on_the_loop_thread(serve, workers, kind):
    """workers=0: eager as on asyncio's loop (the first step runs inside create_task);
    workers=N: the task's first step is not run on the worker, and every reply comes."""
    first_steps, errors, done = [], [], []
    srv = serve(lambda: EagerReplies(kind, first_steps, errors))
    _ask(srv.address, 0, 20, done)
    assert done == [20]
    # (with workers the last reply may reach the client before its data_received, on the
    # worker, has recorded it)
    wait_for(lambda: len(first_steps) == 20, timeout=20, what="20 data_received")
    assert first_steps == [workers == 0] * 20, first_steps
    assert errors == []


@needs_eager
@pytest.mark.parametrize("kind", FACTORIES)
def test_eager_tasks_from_workers_and_the_loop_thread_all_answer(serve, workers, kind):
    """Four clients at once, each task blocking a moment in its first step (while the loop
    thread runs other tasks' steps): every one of the 4 x 30 requests is answered, as on
    asyncio's loop, and the loop reports nothing."""
    import time

    class Slow(EagerReplies):
        async def answer(self, data, ran):
            ran.append(threading.get_ident())
            time.sleep(0.001)           # a blocking call in the first step
            await asyncio.sleep(0)
            self.t.write(b"ok:" + data)

    def clients(address):
        done = []
        ts = [threading.Thread(target=_ask, args=(address, i, 30, done)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        return sorted(done)

    errors = []
    assert on_asyncio(lambda: Slow(kind, [], errors), clients) == [30] * 4
    assert errors == []
    srv = serve(lambda: Slow(kind, [], errors))
    assert clients(srv.address) == [30] * 4
    assert errors == []


def test_current_task_in_a_callback_on_a_worker_is_the_loop_threads(serve, workers):
    """docs/server.md: ``asyncio.current_task()`` answers for the loop, not the thread --
    inside ``data_received`` on a worker it is the task the loop thread is running at that
    moment (None when it runs none); with workers=0 it is None, as on asyncio's loop.  The
    task here is started from a thread of its own, as another connection's or thread's
    code starts one: one this callback schedules would run only once it returns."""
    seen = []

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport

        def data_received(self, data):
            running, release = threading.Event(), threading.Event()
            tasks = []

            async def step():
                tasks.append(asyncio.current_task())
                running.set()
                release.wait(20)        # the loop thread stays inside this task's step

            loop = asyncio.get_running_loop()
            if workers:
                starter = threading.Thread(
                    target=asyncio.run_coroutine_threadsafe, args=(step(), loop))
                starter.start()
                starter.join(20)
                assert running.wait(20)
            seen.append((asyncio.current_task(), tasks))
            release.set()
            self.t.write(b"ok")

    srv = serve(P)
    with socket.create_connection(srv.address, timeout=20) as c:
        c.sendall(b"x")
        assert recv_exact(c, 2, timeout=20) == b"ok"
    [(current, tasks)] = seen
    if workers:
        assert current is tasks[0] and current is not None
    else:
        assert current is None
