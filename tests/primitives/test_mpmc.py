"""MPMCQueue (and, for the semantics docs/api.md gives both, SPSCQueue): every documented behaviour
and error, close() waking blocked threads, timeouts, reference counts, and a 4 x 4 stress
run with every item checked."""
import gc
import queue
import sys
import threading
import time
import weakref

import pytest

from aoprim import Closed, Empty, Full, MPMCQueue, SPSCQueue
from support import run_threads, scaled, skip_nomemory_on_free_threaded

QUEUES = [MPMCQueue, SPSCQueue]


@pytest.fixture(params=QUEUES, ids=lambda c: c.__name__)
def Q(request):
    return request.param


# ---- construction ----------------------------------------------------------------------

@pytest.mark.parametrize("asked,real", [(1, 1), (2, 2), (3, 4), (5, 8), (1000, 1024),
                                        (1024, 1024), (True, 1)])
def test_capacity_rounded_to_power_of_two(Q, asked, real):
    q = Q(asked)
    assert q.capacity == real
    for i in range(real):
        q.put_nowait(i)
    assert q.full()
    with pytest.raises(Full):
        q.put_nowait("one too many")


@pytest.mark.parametrize("bad", [0, -1, -(2 ** 70), 2 ** 40])
def test_capacity_value_error(Q, bad):
    with pytest.raises(ValueError):
        Q(bad)


@pytest.mark.parametrize("bad", [1.0, 4.5, "4", None, [4], b"4"])
def test_capacity_type_error(Q, bad):
    with pytest.raises(TypeError):
        Q(bad)


def test_capacity_required(Q):
    name = Q.__name__
    with pytest.raises(TypeError, match=rf"^{name}\(\) needs a capacity \(e\.g\. {name}\(1024\)\)$"):
        Q()


def test_maxsize_is_an_alias_of_capacity(Q):
    q = Q(maxsize=8)
    assert q.capacity == q.maxsize == 8
    assert Q(maxsize=5).capacity == 8             # rounded up as a capacity is


@pytest.mark.parametrize("bad", [0, -1])
def test_maxsize_unbounded_refused(Q, bad):
    with pytest.raises(ValueError, match=rf"maxsize={bad}.*unbounded.*bounded ring"):
        Q(maxsize=bad)


@pytest.mark.parametrize("args,kwargs,words", [
    ((8,), {"maxsize": 8}, "capacity or maxsize, not both"),
    ((), {"capacity": 8, "maxsize": 8}, "capacity or maxsize, not both"),
    ((8, 8), {}, "takes 1 positional argument (2 given)"),
    ((), {"size": 8}, "unexpected keyword argument 'size'"),
])
def test_constructor_misuse_names_the_class(Q, args, kwargs, words):
    with pytest.raises(TypeError) as e:
        Q(*args, **kwargs)
    msg = str(e.value)
    assert msg.startswith(f"{Q.__name__}()") and words in msg and "__cinit__" not in msg


def test_capacity_keyword(Q):
    assert Q(capacity=3).capacity == 4


def test_exceptions_are_queue_exceptions():
    assert issubclass(Full, queue.Full) and issubclass(Empty, queue.Empty)


# ---- put / get ---------------------------------------------------------------------------

def test_fifo_and_sizes(Q):
    q = Q(8)
    assert q.empty() and not q.full() and q.qsize() == 0 and len(q) == 0
    for i in range(5):
        q.put(i)
    assert q.qsize() == 5 and len(q) == 5 and not q.empty()
    assert [q.get() for _ in range(5)] == list(range(5))
    assert q.empty()
    # wrap around the ring many times
    for lap in range(50):
        for i in range(7):
            q.put_nowait((lap, i))
        assert [q.get_nowait() for _ in range(7)] == [(lap, i) for i in range(7)]


def test_full_and_empty_errors(Q):
    q = Q(2)
    with pytest.raises(Empty):
        q.get_nowait()
    with pytest.raises(Empty):
        q.get(False)
    with pytest.raises(Empty):
        q.get(block=False, timeout=5)      # block=False ignores timeout, as queue.Queue
    with pytest.raises(Empty):
        q.get(timeout=0)
    q.put(1)
    q.put(2)
    assert q.full()
    with pytest.raises(Full):
        q.put_nowait(3)
    with pytest.raises(Full):
        q.put(3, False)
    with pytest.raises(Full):
        q.put(3, block=False, timeout=5)
    with pytest.raises(Full):
        q.put(3, timeout=0)
    assert [q.get(), q.get()] == [1, 2]


def test_none_and_any_object(Q):
    q = Q(4)
    objs = [None, 0, "s", object()]
    for o in objs:
        q.put(o)
    assert [q.get() is o for o in objs] == [True] * 4


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan")])
def test_timeout_value_error(Q, bad):
    q = Q(1)
    with pytest.raises(ValueError):
        q.get(timeout=bad)
    with pytest.raises(ValueError):
        q.put(1, timeout=bad)          # checked even when there is room
    assert q.qsize() == 0


@pytest.mark.parametrize("bad", ["1", [1], b"x"])
def test_timeout_type_error(Q, bad):
    q = Q(1)
    with pytest.raises(TypeError):
        q.get(timeout=bad)
    with pytest.raises(TypeError):
        q.put(1, timeout=bad)
    assert q.qsize() == 0


@pytest.mark.parametrize("timeout", [0.05, 0.2])
def test_timeouts_return_in_time(Q, timeout):
    q = Q(1)
    t0 = time.monotonic()
    with pytest.raises(Empty):
        q.get(timeout=timeout)
    dt = time.monotonic() - t0
    assert timeout * 0.9 <= dt < timeout + 1.0
    q.put(0)
    t0 = time.monotonic()
    with pytest.raises(Full):
        q.put(1, timeout=timeout)
    dt = time.monotonic() - t0
    assert timeout * 0.9 <= dt < timeout + 1.0
    assert q.get_nowait() == 0


def test_blocked_get_wakes_on_put(Q):
    q = Q(4)
    got = []
    started = threading.Event()

    def consumer():
        started.set()
        got.append(q.get(timeout=30))

    t = threading.Thread(target=consumer)
    t.start()
    assert started.wait(10)
    time.sleep(0.05)          # let it reach the park phase (correct either way)
    q.put("x")
    t.join(10)
    assert not t.is_alive() and got == ["x"]


def test_blocked_put_wakes_on_get(Q):
    q = Q(1)
    q.put("first")
    done = threading.Event()

    def producer():
        q.put("second", timeout=30)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.05)
    assert not done.is_set()          # the queue is full: it must still be waiting
    assert q.get() == "first"
    t.join(10)
    assert not t.is_alive() and done.is_set()
    assert q.get_nowait() == "second"


# ---- batches -----------------------------------------------------------------------------

def test_put_many_sequences(Q):
    q = Q(8)
    assert q.put_many([1, 2, 3]) == 3
    assert q.put_many((4, 5)) == 2
    assert q.put_many([]) == 0
    assert q.put_many(range(6, 100)) == 3          # stops when full
    assert q.full()
    assert q.put_many([0]) == 0
    assert q.get_many(100) == list(range(1, 9))


def test_put_many_iterator_loses_nothing(Q):
    q = Q(4)
    it = iter(range(10))
    assert q.put_many(it) == 4
    assert next(it) == 4                            # the rest is still in the iterator
    assert q.get_many(10) == [0, 1, 2, 3]
    gen = (x * 2 for x in range(3))
    assert q.put_many(gen) == 3
    assert q.get_many(3) == [0, 2, 4]


def test_put_many_large_list_chunks(Q):
    q = Q(512)
    data = [object() for _ in range(300)]
    assert q.put_many(data) == 300
    out = q.get_many(1000)
    assert len(out) == 300 and all(a is b for a, b in zip(out, data))
    assert q.put_many(data * 2) == 512
    assert q.get_many(200) == data[:200]
    assert q.get_many(10 ** 9) == data[200:] + data[:212]


def test_put_many_not_iterable(Q):
    q = Q(4)
    with pytest.raises(TypeError):
        q.put_many(5)
    assert q.qsize() == 0


def test_put_many_iterator_error_keeps_taken(Q):
    q = Q(8)

    def gen():
        yield 1
        yield 2
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        q.put_many(gen())
    assert q.get_many(8) == [1, 2]


def test_get_many_arguments(Q):
    q = Q(8)
    assert q.get_many(0) == [] and q.get_many(5) == []
    q.put_many([1, 2, 3])
    assert q.get_many(0) == []
    assert q.get_many(2) == [1, 2]
    assert q.get_many(True) == [3]
    for bad in (1.0, "2", None):
        with pytest.raises(TypeError):
            q.get_many(bad)
    with pytest.raises(ValueError):
        q.get_many(-1)


# ---- close -------------------------------------------------------------------------------

def test_close_semantics(Q):
    q = Q(4)
    q.put_many([1, 2, 3])
    q.close()
    q.close()                                   # idempotent
    for call in (lambda: q.put(9), lambda: q.put_nowait(9), lambda: q.put(9, timeout=1),
                 lambda: q.put_many([9]), lambda: q.put_many([])):
        with pytest.raises(Closed):
            call()
    assert q.get() == 1
    assert q.get_nowait() == 2
    assert q.get_many(5) == [3]
    for call in (q.get, q.get_nowait, lambda: q.get(timeout=1), lambda: q.get(False),
                 lambda: q.get_many(3), lambda: q.get_many(0)):
        with pytest.raises(Closed):
            call()
    assert q.qsize() == 0 and q.empty()


def test_close_full_queue_put_raises_closed(Q):
    q = Q(1)
    q.put(1)
    q.close()
    with pytest.raises(Closed):
        q.put_nowait(2)
    assert q.get() == 1


@pytest.mark.parametrize("side", ["get", "put"])
def test_close_wakes_blocked_thread(Q, side):
    q = Q(1)
    if side == "put":
        q.put("fill")
    result = []
    started = threading.Event()

    def blocked():
        started.set()
        try:
            if side == "get":
                q.get()
            else:
                q.put("more")
        except Closed:
            result.append("closed")

    t = threading.Thread(target=blocked)
    t.start()
    assert started.wait(10)
    time.sleep(0.05)              # let it park (the outcome is the same if it has not yet)
    t0 = time.monotonic()
    q.close()
    t.join(10)
    assert not t.is_alive()
    assert result == ["closed"]
    assert time.monotonic() - t0 < 5
    if side == "put":
        assert q.get() == "fill"


def test_close_wakes_many_waiters():
    q = MPMCQueue(2)
    results = []
    lock = threading.Lock()

    def waiter():
        try:
            q.get()
        except Closed:
            with lock:
                results.append(1)

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    q.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == 4


# ---- references --------------------------------------------------------------------------

def test_refcounts_balanced(Q):
    item = object()
    base = sys.getrefcount(item)
    q = Q(2)
    q.put(item)
    assert sys.getrefcount(item) == base + 1          # the queue holds one strong reference
    q.put(item)
    with pytest.raises(Full):
        q.put_nowait(item)
    with pytest.raises(Full):
        q.put(item, timeout=0.01)
    assert q.put_many([item, item]) == 0
    assert sys.getrefcount(item) == base + 2
    assert q.get() is item
    assert q.get_many(4) == [item]
    assert sys.getrefcount(item) == base
    q.put(item)
    q.close()
    with pytest.raises(Closed):
        q.put(item)
    assert sys.getrefcount(item) == base + 1
    del q                                               # leftovers released at dealloc
    gc.collect()
    assert sys.getrefcount(item) == base


def test_queue_keeps_items_alive_and_releases_them(Q):
    class Thing:
        pass

    q = Q(8)
    t = Thing()
    w = weakref.ref(t)
    q.put(t)
    del t
    gc.collect()
    assert w() is not None
    got = q.get()
    assert got is w()
    q.put(got)
    del got
    del q
    gc.collect()
    assert w() is None


def test_dealloc_runs_item_del(Q):
    freed = []

    class D:
        def __del__(self):
            freed.append(1)

    q = Q(64)
    q.put_many([D() for _ in range(40)])
    del q
    gc.collect()
    assert len(freed) == 40


def test_weakref_and_repr(Q):
    q = Q(4)
    assert weakref.ref(q)() is q
    q.put(1)
    r = repr(q)
    assert Q.__name__ in r and "capacity=4" in r and "size=1" in r
    q.close()
    assert "closed" in repr(q)


# ---- stress: 4 producers x 4 consumers ----------------------------------------------------

def test_mpmc_stress_4x4_every_item_once_in_order():
    P, C = 4, 4
    N = scaled(100_000)                    # per producer
    q = MPMCQueue(256)
    items = [[(p, i) for i in range(N)] for p in range(P)]
    sample = [items[p][i] for p in range(P) for i in (0, N // 2, N - 1)]
    base = [sys.getrefcount(x) for x in sample]
    received = [[] for _ in range(C)]
    done_producers = []
    lock = threading.Lock()

    def producer(p):
        def run():
            mine = items[p]
            i = 0
            while i < N:
                if i % 3 == 0:                # mix single puts and batches
                    q.put(mine[i], timeout=30)
                    i += 1
                else:
                    n = q.put_many(mine[i:i + 16])
                    if n == 0:
                        q.put(mine[i], timeout=30)
                        n = 1
                    i += n
            with lock:
                done_producers.append(p)
                if len(done_producers) == P:
                    q.close()                 # the last producer closes: consumers drain
        return run

    def consumer(c):
        def run():
            out = received[c]
            last = [-1] * P
            while True:
                try:
                    if len(out) % 2:
                        got = q.get_many(16)
                        if not got:
                            got = [q.get(timeout=30)]
                    else:
                        got = [q.get(timeout=30)]
                except Closed:
                    return
                for it in got:
                    p, i = it
                    assert i > last[p], f"producer {p}: {i} after {last[p]}"
                    last[p] = i
                out.extend(got)
        return run

    run_threads([producer(p) for p in range(P)] + [consumer(c) for c in range(C)],
                timeout=120)
    total = sum(len(r) for r in received)
    assert total == P * N
    seen = set()
    for r in received:
        for it in r:
            seen.add(it)
    assert len(seen) == P * N                # nothing duplicated, nothing lost
    assert q.qsize() == 0
    del received, seen, r, it
    del q
    gc.collect()
    assert [sys.getrefcount(x) for x in sample] == base


# ---- signals -----------------------------------------------------------------------------

class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("side", ["get", "put"])
def test_blocked_wait_is_interruptible_by_signal(Q, side):
    """A blocked put/get in the main thread runs signal handlers (Ctrl-C works), and an
    interrupted put leaves no reference behind."""
    import signal

    def handler(signum, frame):
        raise _Interrupted()

    q = Q(1)
    item = object()
    base = sys.getrefcount(item)
    if side == "put":
        q.put("fill")
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        t0 = time.monotonic()
        with pytest.raises(_Interrupted):
            if side == "get":
                q.get()
            else:
                q.put(item)
        assert time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert sys.getrefcount(item) == base
    assert q.qsize() == (1 if side == "put" else 0)


# ---- the cyclic GC sees queued objects ---------------------------------------------------

class _Node:
    """A weak-referenceable object that can hold a reference to anything."""
    __slots__ = ("ref", "tag", "__weakref__")


def test_cycle_through_a_queued_item_is_collected(Q):
    q = Q(4)
    for i in range(7):                 # wrap the ring: positions beyond the capacity
        q.put(i)
        assert q.get() == i
    node = _Node()
    node.ref = q                       # queue -> node -> queue
    q.put(node)
    q.put("other")
    wn, wq = weakref.ref(node), weakref.ref(q)
    del node, q
    gc.collect()
    assert wn() is None and wq() is None


def test_gc_referents_are_exactly_the_queued_items(Q):
    q = Q(8)
    items = [_Node() for _ in range(6)]
    for x in items:
        q.put(x)
    q.get()
    q.get()                            # two taken: only the last four are the queue's
    refs = [r for r in gc.get_referents(q) if isinstance(r, _Node)]
    assert refs == items[2:]
    q.get_many(10)
    assert not [r for r in gc.get_referents(q) if isinstance(r, _Node)]


def test_tp_clear_empties_a_garbage_queue_and_runs_nothing_twice(Q):
    released = []

    class Tracked:
        def __init__(self, i):
            self.i = i
            self.q = None

        def __del__(self):
            released.append(self.i)

    q = Q(16)
    for i in range(5):
        t = Tracked(i)
        t.q = q                        # every item in a cycle with the queue
        q.put(t)
    del t, q
    gc.collect()
    assert sorted(released) == [0, 1, 2, 3, 4]


_GC_STRESS = r"""
import gc, sys, threading
from aoprim import MPMCQueue

class Node:
    __slots__ = ("ref", "tag", "__weakref__")

q = MPMCQueue(2)
P, C, N = 2, 2, int(sys.argv[1])
got = [[] for _ in range(C)]
stop = threading.Event()
errors = []

def produce(k):
    for i in range(N):
        n = Node()
        n.ref = n
        n.tag = (k, i)
        q.put(n, timeout=30)

def consume(j):
    try:
        while True:
            n = q.get(timeout=30)
            if n is None:
                return
            got[j].append(n.tag)          # AttributeError if the GC had cleared it
            n.ref = None
    except BaseException as e:
        errors.append(repr(e))

def collector():
    while not stop.is_set():
        gc.collect()

g = threading.Thread(target=collector)
ps = [threading.Thread(target=produce, args=(k,)) for k in range(P)]
cs = [threading.Thread(target=consume, args=(j,)) for j in range(C)]
for t in [g] + cs + ps:
    t.start()
for t in ps:
    t.join()
for _ in range(C):
    q.put(None, timeout=30)
for t in cs:
    t.join()
stop.set()
g.join()
assert not errors, errors
tags = [tag for lst in got for tag in lst]
assert len(tags) == P * N, len(tags)
assert set(tags) == {(k, i) for k in range(P) for i in range(N)}
for lst in got:                          # per-producer order as each consumer saw it
    for k in range(P):
        seq = [i for (kk, i) in lst if kk == k]
        assert seq == sorted(seq)
print("ok", len(tags))
"""


@pytest.mark.timeout(150)
def test_gc_during_blocking_traffic_loses_and_clears_nothing(tmp_path):
    # Producers and consumers through a tiny ring, so nearly every put/get blocks, while
    # another thread runs the cyclic GC flat out.  Every item is in a cycle with itself, so
    # a GC that counted a reference the ring no longer holds would find the item unreachable
    # and clear it (tag gone) -- or free it under a consumer.  A fresh interpreter keeps each
    # full collection cheap (in the test process one takes tens of milliseconds).
    import subprocess
    script = tmp_path / "gc_stress.py"
    script.write_text(_GC_STRESS)
    n = scaled(1_000)         # ~10 s: every full collection of a busy process is costly
    r = subprocess.run([sys.executable, str(script), str(n)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=140)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["ok", str(2 * n)]


# ---- get_many under allocation failure ---------------------------------------------------

@pytest.mark.parametrize("n,want", [(8, 8), (5, 8), (150, 200), (150, 150)])
def test_get_many_memory_error_loses_no_item(Q, n, want):
    """Make the k-th allocation inside get_many fail, for every k until a call succeeds:
    each call either raises MemoryError or returns a list, and every item is then either in
    that list or still in the queue, in order, with exact reference counts."""
    skip_nomemory_on_free_threaded()
    _testcapi = pytest.importorskip("_testcapi")
    if not hasattr(_testcapi, "set_nomemory"):
        pytest.skip("_testcapi.set_nomemory is not available")
    items = [_Node() for _ in range(n)]
    base = [sys.getrefcount(x) for x in items]
    q = Q(256)
    failures = 0
    for k in range(200):
        assert q.put_many(items) == n
        got = None
        _testcapi.set_nomemory(k, k + 1)       # only the k-th allocation from here fails
        try:
            got = q.get_many(want)
        except MemoryError:
            pass
        finally:
            _testcapi.remove_mem_hooks()
        rest = q.get_many(1000)
        taken = (got or []) + rest
        assert len(taken) == n and all(a is b for a, b in zip(taken, items)), (k, len(taken))
        del taken, rest
        if got is None:
            failures += 1
        elif len(got) == min(n, want):
            del got
            break
        del got
    assert failures >= 1                       # the fault did hit get_many
    assert [sys.getrefcount(x) for x in items] == base


# ---- put_many from an iterable that changes while it is read -----------------------------

def test_put_many_from_a_list_subclass_that_shrinks_while_iterated(Q):
    class Shrinking(list):
        def __iter__(self):
            i = 0
            while i < len(self):
                if i == 3:
                    del self[6:]               # drop the tail mid-iteration
                    self.pop(0)                # and shift what is left
                yield self[i]
                i += 1

    items = [_Node() for _ in range(10)]
    base = [sys.getrefcount(x) for x in items]
    src = Shrinking(items)
    q = Q(16)
    taken = q.put_many(src)
    out = q.get_many(100)
    expect = [items[0], items[1], items[2], items[4], items[5]]
    assert taken == len(expect) and len(out) == len(expect)
    assert all(a is b for a, b in zip(out, expect))
    del src, out, expect
    assert [sys.getrefcount(x) for x in items] == base


def test_put_many_from_a_generator_that_empties_its_source(Q):
    items = [_Node() for _ in range(100)]
    base = [sys.getrefcount(x) for x in items]
    src = list(items)

    def gen():
        while src:
            x = src.pop(0)
            if len(src) % 7 == 0:
                del src[:3]                     # the source shrinks under the iteration
            yield x
            del x

    q = Q(128)
    taken = q.put_many(gen())
    out = q.get_many(1000)
    assert taken == len(out)
    assert len({id(x) for x in out}) == len(out)                 # nothing twice
    assert [items.index(x) for x in out] == sorted(items.index(x) for x in out)
    del out, src
    gc.collect()
    assert [sys.getrefcount(x) for x in items] == base


def test_put_many_of_a_list_another_thread_shrinks(Q):
    """In a GIL build each batch is read under the GIL; in a free-threaded one, from a
    snapshot of the list taken under its own lock.  Either way: exact reference counts,
    every queued item is one of the list's, none twice."""
    items = [_Node() for _ in range(300)]
    base = [sys.getrefcount(x) for x in items]
    rounds = scaled(200)
    stop = threading.Event()
    shared = []
    seen = []

    def shrinker():
        while not stop.is_set():
            try:
                shared.pop()
            except IndexError:
                time.sleep(0)

    def producer():
        q = Q(512)
        try:
            for _ in range(rounds):
                shared[:] = items
                n = q.put_many(shared)
                out = q.get_many(1000)
                assert n == len(out)
                assert len({id(x) for x in out}) == len(out)
                seen.append(len(out))
        finally:
            stop.set()

    run_threads([producer, shrinker], timeout=120)
    del shared[:]
    assert len(seen) == rounds
    assert [sys.getrefcount(x) for x in items] == base


# ---- deallocation of long chains ---------------------------------------------------------

CHAIN = r'''
import sys
from aoprim import MPMCQueue, SPSCQueue
Q = MPMCQueue if sys.argv[1] == "MPMCQueue" else SPSCQueue
q = None
for _ in range(int(sys.argv[2])):
    n = Q(1)
    if q is not None:
        n.put(q)
    q = n
del q, n            # drops the whole chain: must not recurse once per queue on the C stack
print("OK")
'''


@pytest.mark.parametrize("qname", ["MPMCQueue", "SPSCQueue"])
def test_dropping_a_long_chain_of_queues_does_not_overflow_the_stack(tmp_path, qname):
    import os
    import subprocess
    import aoprim
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(aoprim.__file__)))
    r = subprocess.run([sys.executable, str(script), qname, "1000000"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip() == "OK"
