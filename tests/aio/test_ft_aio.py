"""aoprim.aio's loop under true parallelism: ``call_soon_threadsafe`` and
``run_coroutine_threadsafe`` from 2-8 threads while the loop runs (every callback exactly
once, each thread's order kept), and a transport written by the loop while other threads
schedule writes to it through ``call_soon_threadsafe`` (the peer gets every byte, each
source's in order).

These run on every build; they matter most on a free-threaded one (3.13t), where the
threads append to the loop's ready queue while the loop thread pops from it.  No sleeps
stand in for synchronisation: the threads start from inside the running loop (an event set
by a loop callback), and the loop stops on a future the last callback resolves.
"""
import asyncio
import socket
import struct
import threading

import pytest

import aoprim.aio

from support import join_all, scaled, start_threads

pytestmark = pytest.mark.timeout(180)

THREADS = [2, 4, 8]


@pytest.fixture
def loop():
    lp = aoprim.aio.new_event_loop()
    unexpected = []         # a failing callback reaches the handler, not the test
    lp.set_exception_handler(lambda _lp, ctx: unexpected.append(ctx))
    yield lp
    lp.close()
    assert not unexpected, [(c.get("message"), c.get("exception")) for c in unexpected]


async def _spin(stop):
    """Keeps the loop iterating (its own ready-queue traffic) while the threads add to it."""
    while not stop.done():
        await asyncio.sleep(0)


@pytest.mark.parametrize("nthreads", THREADS)
def test_call_soon_threadsafe_from_threads_runs_every_callback_once_in_order(loop, nthreads):
    n = scaled(5000)
    total = nthreads * n
    seen = [[] for _ in range(nthreads)]
    wrong_thread = []
    count = [0]
    done = loop.create_future()
    go = threading.Event()
    loop_tid = []

    def cb(t, i):
        if threading.get_ident() != loop_tid[0]:
            wrong_thread.append((t, i))
        seen[t].append(i)
        count[0] += 1                   # loop thread only
        if count[0] == total:
            done.set_result(None)

    def producer(t):
        def run():
            assert go.wait(60)
            for i in range(n):
                loop.call_soon_threadsafe(cb, t, i)
        return run

    def started():
        loop_tid.append(threading.get_ident())
        go.set()

    ts, errs = start_threads([producer(t) for t in range(nthreads)])
    try:
        loop.call_soon(started)
        loop.run_until_complete(asyncio.gather(done, _spin(done)))
    finally:
        go.set()
        join_all(ts)
    assert not errs, errs
    assert not wrong_thread, wrong_thread[:5]
    for t in range(nthreads):
        assert seen[t] == list(range(n)), f"thread {t}: callbacks lost, repeated or reordered"
    assert count[0] == total


@pytest.mark.parametrize("nthreads", THREADS)
def test_run_coroutine_threadsafe_from_threads_runs_each_coroutine_once(loop, nthreads):
    """Half the threads wait for each result before the next submit, half submit all then
    wait: every coroutine runs once, on the loop, and each result reaches its caller."""
    n = scaled(400)
    ran = [[] for _ in range(nthreads)]
    go = threading.Event()
    finished = loop.create_future()
    left = [nthreads]
    lock = threading.Lock()

    async def work(t, i):
        ran[t].append(i)                # loop thread: in submission order per thread
        await asyncio.sleep(0)
        return (t, i, i * i)

    def one_done():
        left[0] -= 1                    # loop thread only
        if left[0] == 0:
            finished.set_result(None)

    def client(t):
        def run():
            try:
                assert go.wait(60)
                if t % 2:
                    for i in range(n):
                        f = asyncio.run_coroutine_threadsafe(work(t, i), loop)
                        assert f.result(60) == (t, i, i * i)
                else:
                    fs = [asyncio.run_coroutine_threadsafe(work(t, i), loop)
                          for i in range(n)]
                    assert [f.result(60) for f in fs] == [(t, i, i * i) for i in range(n)]
            finally:
                with lock:
                    loop.call_soon_threadsafe(one_done)
        return run

    ts, errs = start_threads([client(t) for t in range(nthreads)])
    try:
        loop.call_soon(go.set)
        loop.run_until_complete(finished)
    finally:
        go.set()
        join_all(ts)
    assert not errs, errs
    for t in range(nthreads):
        assert ran[t] == list(range(n)), f"thread {t}: coroutines lost, repeated or reordered"


def _pair():
    """A connected TCP pair: (loop end, non-blocking; peer end, blocking with a timeout)."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen()
    a = socket.create_connection(lsn.getsockname())
    b, _ = lsn.accept()
    lsn.close()
    a.setblocking(False)
    b.settimeout(60)
    return a, b


def _record(src, i):
    """Source src's i-th record: a length, its tag and index, a body whose bytes and
    length depend on both (a record cut or spliced anywhere does not parse as another)."""
    body = bytes([(src * 37 + i) & 0xFF]) * ((src * 11 + i * 7) % 301)
    head = struct.pack(">BI", src, i)
    return struct.pack(">I", len(head) + len(body)) + head + body


@pytest.mark.parametrize("nthreads", THREADS)
def test_a_transport_written_by_the_loop_and_by_threads_through_the_loop(loop, nthreads):
    """The loop writes its own records (source 0) while ``nthreads`` threads schedule
    ``write``/``writelines`` of theirs with ``call_soon_threadsafe``; the peer, read by a
    thread, gets every record exactly once, each source's in order, then EOF."""
    n = scaled(1500)
    loop_n = scaled(3000)
    a, peer = _pair()
    got = {}
    rerr = []

    def reader():
        try:
            buf = bytearray()
            while True:
                chunk = peer.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
            off = 0
            while off < len(buf):
                (ln,) = struct.unpack_from(">I", buf, off)
                src, i = struct.unpack_from(">BI", buf, off + 4)
                rec = bytes(buf[off:off + 4 + ln])
                assert rec == _record(src, i), f"record {src}/{i} corrupt"
                got.setdefault(src, []).append(i)
                off += 4 + ln
        except BaseException as e:  # noqa: BLE001 - re-raised in the test
            rerr.append(e)

    rt = threading.Thread(target=reader)
    rt.start()
    try:
        lost = loop.create_future()

        class Proto(asyncio.Protocol):
            def connection_lost(self, exc):
                lost.set_result(exc)

        tr, _ = loop.run_until_complete(loop.create_connection(Proto, sock=a))
        go = threading.Event()

        def writer(src):
            def run():
                assert go.wait(60)
                i = 0
                while i < n:
                    if i % 4 == 3 and i + 1 < n:        # two records in one callback
                        loop.call_soon_threadsafe(
                            tr.writelines, [_record(src, i), _record(src, i + 1)])
                        i += 2
                    else:
                        loop.call_soon_threadsafe(tr.write, _record(src, i))
                        i += 1
            return run

        async def own_writes():
            go.set()                    # the threads start while the loop runs
            for i in range(loop_n):
                tr.write(_record(0, i))
                if i % 16 == 15:
                    await asyncio.sleep(0)      # the threads' callbacks run in between

        ts, errs = start_threads([writer(src) for src in range(1, nthreads + 1)])
        try:
            loop.run_until_complete(own_writes())
        finally:
            go.set()
            join_all(ts)
        assert not errs, errs
        # every thread's call_soon_threadsafe returned before this one is made: its
        # callback runs after theirs (the ready queue is FIFO), and close() flushes first
        loop.call_soon_threadsafe(tr.close)
        assert loop.run_until_complete(lost) is None
    finally:
        rt.join(120)
        peer.close()
    assert not rt.is_alive()
    assert not rerr, rerr
    assert got.get(0) == list(range(loop_n)), "the loop's own records"
    for src in range(1, nthreads + 1):
        assert got.get(src) == list(range(n)), f"thread {src}'s records lost or reordered"
