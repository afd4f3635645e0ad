"""The measured bodies: every primitive beside its baselines, as groups of cases.

One idea, the table of measured cases (over 800 lines): each group is short; they are kept
together so that both harnesses time the same list.

This module is the one copy of what is measured.  ``python -m aoprim bench`` times these cases
with its own interleaved harness (``runner.py``); the checkout's bench/bench_cases.py times the
very same cases with pytest-benchmark.

A :class:`Case` is one entry of a group: ``setup(n)`` is a context manager that builds what the
case needs, yields ``fn`` -- a callable with no arguments that performs ``n`` operations -- and
on exit checks what it must (every item counted, every slot back) and tears down.  When
``fn.prepare`` exists it is called, untimed, before every timed call (refill a socket, drain
a peer).  ``n``
defaults to ``Case.n``; the command scales it down for ``--quick``.  A case that cannot run
here raises :class:`Unavailable` from ``setup`` (an optional peer library that is missing).

Roles: ``baseline`` -- the entry every ratio in the group is taken against: what a user would
otherwise write (the stdlib or the obvious Python idiom; for the C-level groups, a pthread
mutex, malloc + free, one write() per message); ``candidate`` -- an entry that competes
(aoprim's, and other ways to do the same thing); ``reference`` -- shown for scale, never the
winner and never a ratio (the empty loop, the bare hardware loop: a floor).
"""
import collections
import contextlib
import itertools
import os
import queue
import random
import socket
import struct
import threading
import time

from aoprim import (AtomicInt, BlockTable, MPMCQueue, RefCount, SendBatch, SlabPool,
                    SPSCQueue, SpinLock)
from aoprim.server.framing import Framing

__all__ = ["Case", "Group", "Unavailable", "GROUPS", "FAMILIES", "group", "by_id",
           "LockedCounter", "bytearray_receive", "blocktable_receive"]


class Unavailable(Exception):
    """This case cannot run here; the message says why."""


class Case:
    __slots__ = ("name", "setup", "n", "role", "heavy", "rounds")

    def __init__(self, name, setup, n, role="candidate", heavy=False, rounds=None):
        self.name = name
        self.setup = setup        # setup(n) -> context manager yielding fn (n operations)
        self.n = n                # operations per call of fn, at full scale
        self.role = role          # "baseline" | "candidate" | "reference"
        self.heavy = heavy        # one call is a whole threaded run: time it once per sample
        self.rounds = rounds      # pytest-benchmark rounds for heavy / prepared cases

    def __repr__(self):
        return f"Case({self.name!r}, n={self.n}, role={self.role!r})"


class Group:
    """Cases measured side by side; ``unit`` is what one sample is (``ns/op``: wall time per
    operation, lower is better)."""
    __slots__ = ("id", "family", "kind", "title", "cases", "compete", "default", "params",
                 "series", "unit", "note")

    def __init__(self, id, family, title, cases, kind="python", compete=True, default=True,
                 params=None, series=None, unit="ns/op", note=None):
        self.id = id
        self.family = family      # what --only selects by: atomic, lock, queue, slab, ...
        self.kind = kind          # "python" | "c" | "contention"
        self.title = title
        self.cases = cases
        self.compete = compete    # mark a winner among the baseline and candidates
        self.default = default    # run by `bench` unless --only names it
        self.params = params or {}
        self.series = series      # curves: groups of one series differ only by params
        self.unit = unit
        self.note = note          # printed under the table: what the rows measure, if not plain

    @property
    def baseline(self):
        return next((c for c in self.cases if c.role == "baseline"), None)


GROUPS = []


def group(*a, **kw):
    g = Group(*a, **kw)
    GROUPS.append(g)
    return g


def _plain(make_fn):
    """setup for a case with nothing to tear down: make_fn(n) -> fn."""
    @contextlib.contextmanager
    def setup(n):
        yield make_fn(n)
    return setup


# == atomics ====================================================================================

class LockedCounter:
    """What one writes without atomics: an int behind a threading.Lock."""

    def __init__(self):
        self.v = 0
        self.lock = threading.Lock()

    def fetch_add(self, d=1):
        with self.lock:
            v = self.v
            self.v = v + d
        return v

    def load(self):
        with self.lock:
            return self.v


def _locked_fetch_add(n):
    c = LockedCounter()

    def run():
        for _ in range(n):
            c.fetch_add(1)
    return run


def _atomic_fetch_add(n):
    a = AtomicInt()

    def run():
        for _ in range(n):
            a.fetch_add(1)
    return run


def _count_next(n):
    c = itertools.count()

    def run():
        for _ in range(n):
            next(c)
    return run


def _cereggii_increment(n):
    try:
        import cereggii
    except ImportError:
        raise Unavailable("cereggii is not installed (pip install cereggii)") from None
    a = cereggii.AtomicInt64(0)

    def run():
        for _ in range(n):
            a.increment_and_get()
    return run


def _empty_loop(n):
    def run():
        for _ in range(n):
            pass
    return run


def _locked_read(n):
    c = LockedCounter()

    def run():
        for _ in range(n):
            c.load()
    return run


def _atomic_load(n):
    a = AtomicInt(5)

    def run():
        for _ in range(n):
            a.load()
    return run


def _atomic_value(n):
    a = AtomicInt(5)

    def run():
        for _ in range(n):
            a.value
    return run


def _locked_incref_decref(n):
    c = LockedCounter()

    def run():
        for _ in range(n):
            c.fetch_add(1)
            c.fetch_add(-1)
    return run


def _refcount_incref_decref(n):
    r = RefCount(1)

    def run():
        for _ in range(n):
            r.incref()
            r.decref()
    return run


N_PY = 1000      # Python-level operations per call (the `for` loop's own cost included)

group("atomic-increment", "atomic", "AtomicInt.fetch_add(1) vs an int behind threading.Lock", [
    Case("int + threading.Lock", _plain(_locked_fetch_add), N_PY, "baseline"),
    Case("AtomicInt.fetch_add", _plain(_atomic_fetch_add), N_PY),
    Case("itertools.count (GIL-atomic, increment only)", _plain(_count_next), N_PY),
    Case("cereggii.AtomicInt64.increment_and_get", _plain(_cereggii_increment), N_PY),
    Case("empty loop (the loop's own cost)", _plain(_empty_loop), N_PY, "reference"),
])
group("atomic-read", "atomic", "AtomicInt.load() / .value vs a lock-guarded read", [
    Case("int + threading.Lock read", _plain(_locked_read), N_PY, "baseline"),
    Case("AtomicInt.load", _plain(_atomic_load), N_PY),
    Case("AtomicInt.value", _plain(_atomic_value), N_PY),
])
group("refcount", "atomic", "RefCount incref+decref vs a lock-guarded int pair", [
    Case("int + threading.Lock +1/-1", _plain(_locked_incref_decref), N_PY, "baseline"),
    Case("RefCount.incref+decref", _plain(_refcount_incref_decref), N_PY),
])


# == lock =======================================================================================

def _with_loop(make_lock):
    def make(n):
        lk = make_lock()

        def run():
            for _ in range(n):
                with lk:
                    pass
        return run
    return _plain(make)


def _acq_rel_loop(make_lock):
    def make(n):
        lk = make_lock()

        def run():
            acq = lk.acquire
            rel = lk.release
            for _ in range(n):
                acq()
                rel()
        return run
    return _plain(make)


def lock_contended(lk, threads, n):
    """``threads`` threads doing ``with lk: counter += 1``, n acquisitions in all; returns
    (wall seconds, process CPU seconds).  Every increment is counted."""
    box = [0]
    per = n // threads
    go = threading.Barrier(threads + 1)

    def work():
        go.wait()
        for _ in range(per):
            with lk:
                box[0] += 1

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    c0, t0 = time.process_time(), time.perf_counter()
    go.wait()
    for t in ts:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert box[0] == per * threads, (box[0], per * threads)
    return wall, cpu


def _contended_lock(make_lock, threads):
    def make(n):
        lk = make_lock()
        return lambda: lock_contended(lk, threads, n)
    return _plain(make)


group("lock-with", "lock", "`with lock: pass`: SpinLock vs threading.Lock", [
    Case("threading.Lock", _with_loop(threading.Lock), N_PY, "baseline"),
    Case("SpinLock", _with_loop(SpinLock), N_PY),
    Case("threading.RLock", _with_loop(threading.RLock), N_PY),
])
group("lock-acquire-release", "lock", "lock.acquire(); lock.release()", [
    Case("threading.Lock", _acq_rel_loop(threading.Lock), N_PY, "baseline"),
    Case("SpinLock", _acq_rel_loop(SpinLock), N_PY),
])
CONTENDED = 100_000
# the command measures this as part of the contention curves (contention.py)
group("lock-contended-2threads", "lock", "two threads doing `with lock: n += 1`", [
    Case("threading.Lock", _contended_lock(threading.Lock, 2), CONTENDED, "baseline", True),
    Case("SpinLock", _contended_lock(SpinLock, 2), CONTENDED, heavy=True),
], default=False)


# == queues =====================================================================================

PAIRS = 2000          # put+get pairs per call
THREAD_ITEMS = 1_000_000


def _pairs(put, get, n):
    item = object()
    r = range(n)

    def run():
        for _ in r:
            put(item)
            get()
    return run


def _q_pairs(make_q, put="put", get="get"):
    def make(n):
        q = make_q()
        return _pairs(getattr(q, put), getattr(q, get), n)
    return _plain(make)


def _q_batch(make_q):
    def make(n):
        q = make_q()
        batch = [object() for _ in range(16)]
        put_many, get_many, r = q.put_many, q.get_many, range(max(1, n // 16))

        def run():
            for _ in r:
                put_many(batch)
                get_many(16)
        return run
    return _plain(make)


def threaded(q, producers, consumers, n):
    """Move n items from ``producers`` threads to ``consumers`` threads through q (blocking
    put/get, one None sentinel per consumer); asserts every item arrived; returns n."""
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
    assert sum(counts) == per * producers, (sum(counts), per * producers)
    return sum(counts)


def threaded_batch_consumer(q, n):
    """1 producer (single put) + 1 consumer that drains what is ready: a blocking get() for
    the first item, then get_many(63).  Returns the items received (== n, asserted)."""
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
    assert got[0] == n, (got[0], n)
    return n


def _q_threaded(make_q, producers, consumers):
    return _plain(lambda n: (lambda: threaded(make_q(), producers, consumers, n)))


group("queue-1thread", "queue", "put+get pairs from one thread (nothing ever waits)", [
    Case("SimpleQueue.put+get", _q_pairs(queue.SimpleQueue), PAIRS, "baseline"),
    Case("MPMCQueue.put+get", _q_pairs(lambda: MPMCQueue(1024)), PAIRS),
    Case("SPSCQueue.put+get", _q_pairs(lambda: SPSCQueue(1024)), PAIRS),
    Case("MPMCQueue.put_nowait+get_nowait",
         _q_pairs(lambda: MPMCQueue(1024), "put_nowait", "get_nowait"), PAIRS),
    Case("Queue(1024).put_nowait+get_nowait",
         _q_pairs(lambda: queue.Queue(1024), "put_nowait", "get_nowait"), PAIRS),
    Case("deque.append+popleft", _q_pairs(collections.deque, "append", "popleft"), PAIRS),
])
group("queue-batch16", "queue", "put_many/get_many of 16, per item, beside single put/get", [
    Case("MPMCQueue.put+get (single)", _q_pairs(lambda: MPMCQueue(1024)), PAIRS, "baseline"),
    Case("MPMCQueue.put_many+get_many(16)", _q_batch(lambda: MPMCQueue(1024)), PAIRS),
    Case("SPSCQueue.put_many+get_many(16)", _q_batch(lambda: SPSCQueue(1024)), PAIRS),
    Case("SimpleQueue.put+get", _q_pairs(queue.SimpleQueue), PAIRS),
])
# SimpleQueue is unbounded and never makes a producer wait; a bounded queue under the GIL
# pays two GIL hand-overs each time it runs full / empty, so a capacity the run rarely fills
# is shown too.
group("queue-2p2c", "queue", "2 producer + 2 consumer threads, blocking put/get", [
    Case("SimpleQueue 2P+2C", _q_threaded(queue.SimpleQueue, 2, 2), THREAD_ITEMS,
         "baseline", True),
    Case("MPMCQueue(1024) 2P+2C", _q_threaded(lambda: MPMCQueue(1024), 2, 2), THREAD_ITEMS,
         heavy=True),
    Case("MPMCQueue(65536) 2P+2C", _q_threaded(lambda: MPMCQueue(65536), 2, 2), THREAD_ITEMS,
         heavy=True),
    Case("Queue(1024) 2P+2C", _q_threaded(lambda: queue.Queue(1024), 2, 2),
         THREAD_ITEMS // 4, heavy=True),
])
group("queue-spsc-1p1c", "queue", "1 producer + 1 consumer thread, blocking put/get", [
    Case("SimpleQueue 1P+1C", _q_threaded(queue.SimpleQueue, 1, 1), THREAD_ITEMS,
         "baseline", True),
    Case("SPSCQueue(1024) 1P+1C", _q_threaded(lambda: SPSCQueue(1024), 1, 1), THREAD_ITEMS,
         heavy=True),
    Case("SPSCQueue(65536) 1P+1C", _q_threaded(lambda: SPSCQueue(65536), 1, 1), THREAD_ITEMS,
         heavy=True),
    Case("MPMCQueue(1024) 1P+1C", _q_threaded(lambda: MPMCQueue(1024), 1, 1), THREAD_ITEMS,
         heavy=True),
    Case("SPSCQueue(65536) 1P+1C, get_many(63) consumer",
         _plain(lambda n: (lambda: threaded_batch_consumer(SPSCQueue(65536), n))),
         THREAD_ITEMS, heavy=True),
])


# == buffers: SlabPool ==========================================================================

class ListFreeList:
    """Pure-Python free list of bytearrays: fast under the GIL, unsafe without it."""

    def __init__(self, size, n):
        self.free = [bytearray(size) for _ in range(n)]
        self.acquire = self.free.pop
        self.release = self.free.append


class LockedFreeList:
    """The thread-safe Python equivalent: a free list guarded by a threading.Lock."""

    def __init__(self, size, n):
        self.free = [bytearray(size) for _ in range(n)]
        self.lock = threading.Lock()

    def acquire(self):
        with self.lock:
            return self.free.pop()

    def release(self, b):
        with self.lock:
            self.free.append(b)


# 10 operations per loop turn, unrolled, the same for every entry (the loop's cost is shared)
def _slab(size):
    @contextlib.contextmanager
    def setup(n):
        pool = SlabPool(size, 16)
        acq = pool.acquire

        def run():
            for _ in range(n // 10):
                acq().release(); acq().release(); acq().release(); acq().release()  # noqa: E702
                acq().release(); acq().release(); acq().release(); acq().release()  # noqa: E702
                acq().release(); acq().release()                                    # noqa: E702
        yield run
        assert pool.in_use == 0
    return setup


def _bytearray(size):
    def make(n):
        ba = bytearray

        def run():
            for _ in range(n // 10):
                ba(size); ba(size); ba(size); ba(size); ba(size)   # noqa: E702
                ba(size); ba(size); ba(size); ba(size); ba(size)   # noqa: E702
        return run
    return _plain(make)


def _freelist(cls, size):
    def make(n):
        fl = cls(size, 16)
        acq, rel = fl.acquire, fl.release

        def run():
            for _ in range(n // 10):
                rel(acq()); rel(acq()); rel(acq()); rel(acq()); rel(acq())   # noqa: E702
                rel(acq()); rel(acq()); rel(acq()); rel(acq()); rel(acq())   # noqa: E702
        return run
    return _plain(make)


for _size in (4096, 65536):
    group(f"slab-{_size // 1024}KiB", "slab",
          f"a {_size // 1024} KiB buffer: SlabPool acquire+release vs allocating it", [
              Case(f"bytearray({_size})", _bytearray(_size), N_PY, "baseline"),
              Case("SlabPool.acquire+release", _slab(_size), N_PY),
              Case("list free list (GIL-only)", _freelist(ListFreeList, _size), N_PY),
              Case("Lock-guarded free list", _freelist(LockedFreeList, _size), N_PY),
          ], params={"size": _size})


# == buffers: BlockTable as a receive buffer ====================================================

def receive_stream(seed=7, frames=2000, lo=1, hi=200, read=1400):
    """u16-framed messages of mixed small sizes, cut into ``read``-byte receives (frames split
    across receives, as TCP does).  Returns (chunks, number of frames)."""
    rnd = random.Random(seed)
    payloads = [bytes([i % 256]) * rnd.randint(lo, hi) for i in range(frames)]
    raw = b"".join(map(Framing("u16").encode, payloads))
    return [raw[i:i + read] for i in range(0, len(raw), read)], len(payloads)


def bytearray_receive(chunks):
    """The idiom: buf += data; slice each complete frame out; del buf[:n]."""
    buf = bytearray()
    unpack = struct.Struct(">H").unpack_from
    frames = 0
    for chunk in chunks:
        buf += chunk
        pos = 0
        n = len(buf)
        while pos + 2 <= n:
            size = unpack(buf, pos)[0]
            end = pos + 2 + size
            if end > n:
                break
            buf[pos + 2:end]      # the frame, as the handler would get it
            frames += 1
            pos = end
        del buf[:pos]
    return frames


def blocktable_receive(table, chunks):
    """BlockTable: append each read, cut frames as views (zero-copy within a block; frame()
    parses the u16 header and returns the payload, or None if incomplete), consume."""
    append, frame, consume = table.append, table.frame, table.consume
    frames = 0
    for chunk in chunks:
        append(chunk)
        pos = 0
        while (f := frame(pos, 2)) is not None:
            frames += 1
            pos += 2 + len(f)
        consume(pos)
    return frames


def _rx_bytearray():
    @contextlib.contextmanager
    def setup(n):
        chunks, frames = receive_stream(frames=n)

        def run():
            assert bytearray_receive(chunks) == frames
        yield run
    return setup


def _rx_blocktable():
    @contextlib.contextmanager
    def setup(n):
        chunks, frames = receive_stream(frames=n)
        pool = SlabPool(4096, 64)
        table = BlockTable(pool)

        def run():
            assert blocktable_receive(table, chunks) == frames
        yield run
        assert len(table) == 0
        table.release()
        assert pool.in_use == 0
    return setup


group("receive-buffer", "blocktable",
      "receive buffer, mixed small u16 frames (1-200 B) in 1400 B reads, per frame", [
          Case("bytearray += / slice / del", _rx_bytearray(), 2000, "baseline"),
          Case("BlockTable append / frame / consume", _rx_blocktable(), 2000),
      ])


# == SendBatch ==================================================================================

@contextlib.contextmanager
def drained_socketpair():
    """A socketpair whose peer a reader thread drains (every send really reaches the kernel);
    yields (sending socket, [bytes received so far])."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    total = [0]

    def drain():
        buf = bytearray(1 << 20)
        while True:
            n = b.recv_into(buf)
            if not n:
                return
            total[0] += n

    t = threading.Thread(target=drain, daemon=True, name="aoprim-bench-drain")
    t.start()
    try:
        yield a, total
    finally:
        a.shutdown(socket.SHUT_WR)
        t.join(30)
        a.close()
        b.close()
    assert not t.is_alive()


MSGS_64 = [bytes([i]) * 64 for i in range(16)]


def _sock_case(make_run, msgs=MSGS_64):
    """A socketpair case: make_run(sock) -> run(msgs); n is rounded to whole batches of 16."""
    @contextlib.contextmanager
    def setup(n):
        with drained_socketpair() as (a, _):
            run = make_run(a)
            r = range(max(1, n // len(msgs)))

            def fn():
                for _ in r:
                    run(msgs)
            yield fn
    return setup


def per_message_send(a):
    send = a.send

    def run(msgs):
        for m in msgs:
            send(m)
    return run


def join_send(a):
    send = a.send

    def run(msgs):
        send(b"".join(msgs))
    return run


def py_sendmsg(a):
    sendmsg = a.sendmsg

    def run(msgs):
        sendmsg(msgs)
    return run


def _sendbatch_case(way, msgs=MSGS_64, **kw):
    """SendBatch ways of sending a batch: add() x len + flush(), add_many + flush(), or add()
    with the default auto_flush (the 16th add flushes by itself).  On exit: nothing pending
    and at most one syscall per 16 messages (from stats)."""
    @contextlib.contextmanager
    def setup(n):
        with drained_socketpair() as (a, _):
            sb = SendBatch(a, auto_flush=(way == "autoflush"), **kw)
            add, add_many, flush = sb.add, sb.add_many, sb.flush
            if way == "add":
                def run(ms):
                    for m in ms:
                        add(m)
                    flush()
            elif way == "add_many":
                def run(ms):
                    add_many(ms)
                    flush()
            else:
                def run(ms):
                    for m in ms:
                        add(m)
            r = range(max(1, n // len(msgs)))

            def fn():
                for _ in r:
                    run(msgs)
            yield fn
            st = sb.stats
            assert sb.pending_bytes == 0
            if st["messages"]:
                per_msg = st["syscalls"] / st["messages"]
                assert per_msg <= 1 / 16, per_msg
    return setup


group("sendbatch-16x64B", "sendbatch",
      "16 messages of 64 B to a socket: SendBatch vs one send per message", [
          Case("16 x socket.send", _sock_case(per_message_send), 16 * 64, "baseline"),
          Case('b"".join + socket.send', _sock_case(join_send), 16 * 64),
          Case("socket.sendmsg(list)", _sock_case(py_sendmsg), 16 * 64),
          Case("SendBatch add x16 + flush", _sendbatch_case("add"), 16 * 64),
          Case("SendBatch add_many + flush", _sendbatch_case("add_many"), 16 * 64),
          Case("SendBatch add x16, auto_flush", _sendbatch_case("autoflush"), 16 * 64),
      ])

# copy cut-off: 16 messages of 256 B .. 8 KiB sent by copy (copy_max huge) vs by reference
# (copy_max=0, one iovec each; the baseline).  A ratio > 1 means copying is faster there.
CUTOFF_SIZES = (256, 1024, 2048, 3072, 4096, 8192)
for _size in CUTOFF_SIZES:
    _msgs = [bytes([i]) * _size for i in range(16)]
    group(f"sendbatch-cutoff-{_size:05d}B", "sendbatch-cutoff",
          f"SendBatch copy cut-off: 16 x {_size} B by copy vs by reference", [
              Case("by reference (copy_max=0)",
                   _sendbatch_case("add_many", _msgs, copy_max=0), 16 * 64, "baseline"),
              Case("by copy", _sendbatch_case("add_many", _msgs, copy_max=1 << 30), 16 * 64),
              Case('b"".join + socket.send', _sock_case(join_send, _msgs), 16 * 64),
          ], default=False, params={"size": _size})


# == FlushGroup: every dirty batch flushed at once ==============================================

FG_MSGS = [b"m%02d" % i * (4 + i % 7) for i in range(4)]     # 12..40 B
FG_BYTES = sum(map(len, FG_MSGS))


@contextlib.contextmanager
def socketpairs(n):
    """n non-blocking socketpairs with 1 MiB buffers; yields [(a, b)] and closes them."""
    pairs = []
    try:
        for _ in range(n):
            a, b = socket.socketpair()
            pairs.append((a, b))
            for s in (a, b):
                s.setblocking(False)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        yield pairs
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def drainer(pairs):
    """drain(): read everything waiting at every peer (b of each pair)."""
    peers = [b for _, b in pairs]
    buf = bytearray(1 << 16)

    def drain():
        for p in peers:
            try:
                while p.recv_into(buf):
                    pass
            except BlockingIOError:
                pass
    return drain


def new_batch(sock):
    return SendBatch(sock, max_msgs=1024, max_bytes=256 << 10, auto_flush=False)


class _DirtySession:
    __slots__ = ("batch", "dirty")

    def __init__(self, batch):
        self.batch = batch
        self.dirty = False


def _check_one_syscall_each(batches):
    calls = batches[0].stats["syscalls"]
    for b in batches:
        assert b.pending_bytes == 0
        assert b.stats["syscalls"] == calls          # one syscall per batch per call
        assert b.stats["bytes"] == calls * FG_BYTES


def _fg_python_loop():
    """The Python end-of-iteration flush: add_copy() x 4 per session with the server's
    dirty-list bookkeeping, then a loop calling b.flush() per dirty batch."""
    @contextlib.contextmanager
    def setup(n):
        with socketpairs(n) as pairs:
            sessions = [_DirtySession(new_batch(a)) for a, _ in pairs]
            dirty = []
            m0, m1, m2, m3 = FG_MSGS

            def iteration():
                for s in sessions:
                    add = s.batch.add_copy
                    add(m0)
                    add(m1)
                    add(m2)
                    add(m3)
                    if not s.dirty:
                        s.dirty = True
                        dirty.append(s)
                for s in dirty:
                    s.dirty = False
                    b = s.batch
                    try:
                        b.flush()
                    except (BlockingIOError, InterruptedError):
                        pass
                    if b:
                        raise AssertionError("short write")
                dirty.clear()
            iteration.prepare = drainer(pairs)
            yield iteration
            iteration.prepare()
            _check_one_syscall_each([s.batch for s in sessions])
    return setup


def _fg_group():
    """FlushGroup: add_copy() x 4 per session (the batch queues itself), then ONE g.flush()
    (every syscall with the GIL released once)."""
    @contextlib.contextmanager
    def setup(n):
        from aoprim import FlushGroup
        with socketpairs(n) as pairs:
            g = FlushGroup()
            batches = []
            for i, (a, _) in enumerate(pairs):
                b = new_batch(a)
                g.attach(b, i)
                batches.append(b)
            adders = [b.add_copy for b in batches]
            flush = g.flush
            m0, m1, m2, m3 = FG_MSGS

            def iteration():
                for add in adders:
                    add(m0)
                    add(m1)
                    add(m2)
                    add(m3)
                if flush() is not None:
                    raise AssertionError("a batch needs attention")
            iteration.prepare = drainer(pairs)
            yield iteration
            iteration.prepare()
            _check_one_syscall_each(batches)
            assert g.stats["gil_releases"] == g.stats["flushes"]
    return setup


def _fg_flush_only(grouped):
    """The flush step alone: the adds happen in the untimed prepare()."""
    @contextlib.contextmanager
    def setup(n):
        from aoprim import FlushGroup
        with socketpairs(n) as pairs:
            batches = [new_batch(a) for a, _ in pairs]
            drain = drainer(pairs)
            if grouped:
                g = FlushGroup()
                for i, b in enumerate(batches):
                    g.attach(b, i)
                flush_all = g.flush
            else:
                dirty = []

                def flush_all():
                    for b in dirty:
                        try:
                            b.flush()
                        except (BlockingIOError, InterruptedError):
                            pass
                    dirty.clear()

            def prepare():
                drain()
                for b in batches:
                    b.add_many(FG_MSGS)
                    if not grouped:
                        dirty.append(b)

            def fn():
                flush_all()
            fn.prepare = prepare
            yield fn
            assert all(b.pending_bytes == 0 for b in batches)
    return setup


FG_N = 100      # sessions, each over its own socketpair (per op: one session's batch)

group("flushgroup-100x4", "flushgroup",
      "one loop iteration's send side: 100 sessions x 4 small messages, then the flush", [
          Case("Python dirty-list loop", _fg_python_loop(), FG_N, "baseline", rounds=400),
          Case("FlushGroup", _fg_group(), FG_N, rounds=400),
      ])
group("flushgroup-100x4-flush-only", "flushgroup",
      "the flush step alone, 100 batches of 4 small messages", [
          Case("Python loop of flush()", _fg_flush_only(False), FG_N, "baseline", rounds=400),
          Case("FlushGroup.flush", _fg_flush_only(True), FG_N, rounds=400),
      ])


# == the receive path: Receiver vs the Python read + scan + slice ===============================

RX_PAYLOAD = 64
RX_PER_READ = 16
RX_BURST = Framing("u16").encode(b"p" * RX_PAYLOAD) * RX_PER_READ


def _rx_handler(owner, data):
    pass


def _rx_event(owner, code, arg):
    raise AssertionError(f"unexpected receive event {code} {arg!r}")


@contextlib.contextmanager
def rx_socketpair():
    r, w = socket.socketpair()
    try:
        r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        r.setblocking(False)
        yield r, w
    finally:
        r.close()
        w.close()


def py_scan_u16(buf, pos, end, unpack=struct.Struct(">H").unpack_from):
    """The baseline's cutter, in Python: the u16 frame spans of buf[pos:end) and where the
    unfinished tail starts.  Not aoprim's framing (that is the compiled Receiver's, behind
    aoprim.server.framing): the loop a Python receive path runs, which the Receiver replaced."""
    spans = []
    while end - pos >= 2:
        n = unpack(buf, pos)[0]
        if end - pos - 2 < n:
            break
        spans.append((pos + 2, pos + 2 + n))
        pos += 2 + n
    return spans, pos


def rx_python_path(sock, mv, scan, owner, reads):
    """The Python receive path the compiled Receiver replaced, for a u16 read into a
    scratch slot: recv_into, a Python scan (py_scan_u16), one mv[a:b] slice per frame to the
    handler."""
    recv_into = sock.recv_into
    for _ in range(reads):
        n = recv_into(mv)
        spans, pos = scan(mv, 0, n)
        for a, b in spans:
            _rx_handler(owner, mv[a:b])


def _rx_python():
    @contextlib.contextmanager
    def setup(n):
        reads = max(1, n // RX_PER_READ)
        with rx_socketpair() as (r, w):
            pool = SlabPool(len(RX_BURST), 2)
            slot = pool.acquire()
            mv = memoryview(slot)
            scan = py_scan_u16
            data = RX_BURST * reads

            def fn():
                rx_python_path(r, mv, scan, None, reads)
            fn.prepare = lambda: w.sendall(data)
            try:
                yield fn
                try:
                    r.recv(1)
                    raise AssertionError("bytes left unread")
                except BlockingIOError:
                    pass
            finally:
                mv.release()
                slot.release()
    return setup


def _rx_receiver(copy):
    @contextlib.contextmanager
    def setup(n):
        from aoprim.server._receiver import Receiver
        from aoprim.server._rxbuf import RxArena
        reads = max(1, n // RX_PER_READ)
        with rx_socketpair() as (r, w):
            pool = SlabPool(len(RX_BURST), 4)
            arena = RxArena(pool)
            rx = Receiver(arena, r.fileno(), 2, 65536, _rx_handler, _rx_event, None, copy)
            on_readable = rx.on_readable
            data = RX_BURST * reads

            def fn():
                for _ in range(reads):
                    on_readable()
            fn.prepare = lambda: w.sendall(data)
            try:
                yield fn
                assert rx.buffered == 0 and arena.scratch_swaps == 0
                assert rx.frames_in == rx.reads * RX_PER_READ
            finally:
                rx.close()
                arena.close()
            assert pool.in_use == 0
    return setup


RX_FRAMES = 64 * RX_PER_READ      # frames per call: 64 reads of one 16-frame burst

group("receive-path", "receiver",
      f"receive path: u16 {RX_PAYLOAD} B frames, {RX_PER_READ} per read, per frame", [
          Case("recv_into + scan + slices (Python)", _rx_python(), RX_FRAMES,
               "baseline", rounds=300),
          Case("Receiver.on_readable (views)", _rx_receiver(False), RX_FRAMES, rounds=300),
          Case("Receiver.on_readable (copy_frames)", _rx_receiver(True), RX_FRAMES,
               rounds=300),
      ])


# == C level (nogil), through aoprim.benchmarks._benchcore =======================================

def _core():
    try:
        from aoprim.benchmarks import _benchcore
    except ImportError as e:      # a build from before _benchcore existed
        raise Unavailable(f"aoprim.benchmarks._benchcore is not built ({e}); "
                          "rebuild the package") from None
    return _benchcore


def _c(fn_name, make_obj=None, *extra):
    """A C-level case: _benchcore.<fn_name>([obj,] n, *extra)."""
    @contextlib.contextmanager
    def setup(n):
        f = getattr(_core(), fn_name)
        if make_obj is None:
            yield lambda: f(n, *extra)
        else:
            obj = make_obj()
            yield lambda: f(obj, n, *extra)
    return setup


@contextlib.contextmanager
def _devnull():
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _c_write(size):
    @contextlib.contextmanager
    def setup(n):
        core = _core()
        with _devnull() as fd:
            yield lambda: core.write_loop(fd, n, size)
    return setup


def _c_sendbatch(size, per_flush):
    @contextlib.contextmanager
    def setup(n):
        core = _core()
        with _devnull() as fd:
            sb = SendBatch(fd, auto_flush=False)
            yield lambda: core.sendbatch_loop(sb, n, per_flush, size)
            assert sb.pending_bytes == 0
    return setup


def _threads_started():
    """Start and join one thread, once: glibc's pthread_mutex_lock skips its atomic
    instructions in a process that has never started a thread, and a mutex that guards data
    shared between threads lives in a process that has started them."""
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()


def _c_mutex(fn_name):
    """A C-level baseline that takes a pthread mutex: _benchcore.<fn_name>(n), timed in a
    process that has started a thread."""
    @contextlib.contextmanager
    def setup(n):
        f = getattr(_core(), fn_name)
        _threads_started()
        yield lambda: f(n)
    return setup


def _c_malloc(size):
    @contextlib.contextmanager
    def setup(n):
        f = _core().malloc_loop
        _threads_started()
        yield lambda: f(n, size)
    return setup


CN = 200_000      # C-level operations per call

# Each C-level group's baseline is what C code without aoprim writes for the same job (a
# pthread mutex around an int64 or a ring of words, malloc + free, one write() per message);
# the bare hardware loop is shown beside it as a floor (role "reference": never a winner, no
# ratio printed), the least any implementation could cost.
group("c-atomic", "atomic", "C level: aop_fetch_add_i64 (seq_cst) on AtomicInt.cell", [
    Case("int64 + pthread_mutex", _c_mutex("mutex_add_loop"), CN, "baseline"),
    Case("AtomicInt: aop_fetch_add_i64", _c("atomic_add_loop", AtomicInt), CN),
    Case("bare __atomic_fetch_add (floor)", _c("floor_fetch_add"), CN, "reference"),
], kind="c")
group("c-refcount", "atomic", "C level: RefCount c_incref + c_decref", [
    Case("int64 + pthread_mutex +1/-1", _c_mutex("mutex_incdec_loop"), CN, "baseline"),
    Case("RefCount: c_incref + c_decref", _c("refcount_loop", RefCount), CN),
    Case("bare __atomic_fetch_add (floor)", _c("floor_fetch_add"), CN, "reference"),
], kind="c")
group("c-lock", "lock", "C level: uncontended aop_spin_lock + aop_spin_unlock", [
    Case("pthread_mutex lock + unlock", _c_mutex("mutex_lock_loop"), CN, "baseline"),
    Case("SpinLock: aop_spin_lock + unlock", _c("spin_loop", SpinLock), CN),
    Case("bare CAS + exchange pair (floor)", _c("floor_cas_xchg"), CN, "reference"),
], kind="c")
group("c-queue", "queue", "C level: try_push + try_pop of one u64 (raw-word mode)", [
    Case("ring + pthread_mutex: push + pop", _c_mutex("mutex_ring_loop"), CN, "baseline"),
    Case("MPMCQueue: try_push + try_pop", _c("mpmc_loop", lambda: MPMCQueue(1024)), CN),
    Case("SPSCQueue: try_push + try_pop", _c("spsc_loop", lambda: SPSCQueue(1024)), CN),
    Case("bare loop (floor)", _c("bare_loop"), CN, "reference"),
], kind="c")
group("c-slab", "slab", "C level: a 4 KiB buffer, aop_slab_acquire + aop_slab_release", [
    Case("malloc(4096) + free", _c_malloc(4096), CN, "baseline"),
    Case("SlabPool: acquire + release", _c("slab_loop", lambda: SlabPool(4096, 16)), CN),
    Case("bare loop (floor)", _c("bare_loop"), CN, "reference"),
], kind="c")
group("c-sendbatch", "sendbatch", "C level: 64 B messages to /dev/null, per message", [
    Case("write() per message", _c_write(64), 20_000, "baseline"),
    Case("SendBatch: c_add_copy x16 + c_flush", _c_sendbatch(64, 16), 20_000),
], kind="c")

# what cannot be measured at C level, and why (reported as skipped)
C_SKIPPED = {"blocktable": "BlockTable has no nogil C API (its .pxd exposes no C-level "
                           "calls); its Python-level cost is in receive-buffer"}

FAMILIES = sorted({g.family for g in GROUPS})


def by_id(gid):
    for g in GROUPS:
        if g.id == gid:
            return g
    raise KeyError(gid)
