"""Contention curves: the lock and the queues at 1, 2, 4 and 8 threads.

- ``contention-lock``: T threads each doing ``with lock: counter += 1`` (n acquisitions in
  all, every increment counted); wall time per acquisition, and the process CPU time over
  wall time (a lock that burns a core while waiting shows CPU/wall far above 1).
- ``contention-queue``: T threads each doing put(item) then get() on one shared queue (the
  MPMC pattern: everyone produces and consumes; n pairs in all, every item got back).  A get
  never waits for ever: each thread puts before it gets.  SPSCQueue is not in the curve (it
  allows one producer and one consumer thread only; see the queue-spsc-1p1c group).

Each thread count is one group (``series`` + ``params.threads``); the baseline of every
group is the stdlib (threading.Lock, queue.SimpleQueue).  Under the GIL these are not
parallel speed-ups: they show what each primitive costs as more threads fight over it.
"""
import collections
import contextlib
import queue
import threading
import time

from aoprim import MPMCQueue, SpinLock

from .cases import Case, Group, lock_contended

__all__ = ["THREADS", "groups", "queue_contended"]

THREADS = (1, 2, 4, 8)
LOCK_N = 200_000
QUEUE_N = 200_000


def _lock_case(make_lock, threads):
    @contextlib.contextmanager
    def setup(n):
        lk = make_lock()

        def fn():
            wall, cpu = lock_contended(lk, threads, n)
            return {"cpu_per_wall": cpu / wall if wall else 0.0}
        yield fn
    return setup


def queue_contended(q, threads, n, put="put", get="get"):
    """``threads`` threads each doing put(item); get() on q, n pairs in all; asserts every
    item came back out.  Returns (wall seconds, process CPU seconds)."""
    per = n // threads
    got = [0] * threads
    go = threading.Barrier(threads + 1)

    def work(i):
        p, g = getattr(q, put), getattr(q, get)
        go.wait()
        c = 0
        for _ in range(per):
            p(i)
            g()
            c += 1
        got[i] = c

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    c0, t0 = time.process_time(), time.perf_counter()
    go.wait()
    for t in ts:
        t.join(120)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert sum(got) == per * threads, (sum(got), per * threads)
    return wall, cpu


def _queue_case(make_q, threads, put="put", get="get"):
    @contextlib.contextmanager
    def setup(n):
        def fn():
            wall, cpu = queue_contended(make_q(), threads, n, put, get)
            return {"cpu_per_wall": cpu / wall if wall else 0.0}
        yield fn
    return setup


# Printed under each table: these rows answer a different question from the single-thread
# groups (lock-acquire-release, queue-1thread, queue-2p2c) the README's headline figures come
# from, and their ratios are smaller and noisier; the note says why, beside the rows.
LOCK_NOTE = (
    "{t} thread(s) taking turns (the GIL) at `with lock: n += 1`: the `with` and the += cost "
    "every lock alike, so the ratios are smaller than lock-acquire-release's (the headline's: "
    "one thread, acquire + release alone).  One threaded run per sample: the noisiest rows.")
QUEUE_NOTE = (
    "{t} thread(s), each putting then getting on one shared queue (no get waits): not the "
    "headline's queue-1thread (one thread) or queue-2p2c (MPMCQueue(65536), 2 producer + 2 "
    "consumer threads).  One threaded run per sample: the noisiest rows.")


def groups():
    out = []
    for t in THREADS:
        out.append(Group(
            f"contention-lock-{t}t", "contention", f"lock, {t} thread(s): `with lock: n += 1`",
            [Case("threading.Lock", _lock_case(threading.Lock, t), LOCK_N, "baseline", True),
             Case("SpinLock", _lock_case(SpinLock, t), LOCK_N, heavy=True),
             Case("threading.RLock", _lock_case(threading.RLock, t), LOCK_N, heavy=True)],
            kind="contention", params={"threads": t}, series="contention-lock",
            note=LOCK_NOTE.format(t=t)))
    for t in THREADS:
        out.append(Group(
            f"contention-queue-{t}t", "contention",
            f"queue, {t} thread(s), each put + get on one shared queue",
            [Case("SimpleQueue", _queue_case(queue.SimpleQueue, t), QUEUE_N, "baseline", True),
             Case("MPMCQueue(1024)", _queue_case(lambda: MPMCQueue(1024), t), QUEUE_N,
                  heavy=True),
             Case("Queue(1024)", _queue_case(lambda: queue.Queue(1024), t), QUEUE_N,
                  heavy=True),
             Case("deque (append/popleft)",
                  _queue_case(collections.deque, t, "append", "popleft"), QUEUE_N,
                  heavy=True)],
            kind="contention", params={"threads": t}, series="contention-queue",
            note=QUEUE_NOTE.format(t=t)))
    return out
