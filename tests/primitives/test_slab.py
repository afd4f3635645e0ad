"""SlabPool and Slot: every semantic and error case of docs/buffers.md, threaded stress,
and the no-allocation steady state."""
import ctypes
import gc
import time
import tracemalloc
import warnings

import pytest

from aoprim import PoolExhausted, RefCountError
from aoprim._slab import SlabPool, Slot
from support import run_threads, scaled


def addr(slot):
    return ctypes.addressof(ctypes.c_char.from_buffer(slot))


# ---- construction ----------------------------------------------------------------------

def test_defaults_and_properties():
    p = SlabPool()
    assert (p.slot_size, p.slots) == (4096, 16)
    assert (p.available, p.in_use, p.high_water, p.failed_acquires) == (16, 0, 0, 0)
    p2 = SlabPool(slot_size=100, slots=3)
    assert (p2.slot_size, p2.slots, p2.available) == (100, 3, 3)


@pytest.mark.parametrize("bad", [1.0, "4", None, 2.5])
def test_constructor_type_errors(bad):
    with pytest.raises(TypeError):
        SlabPool(bad, 4)
    with pytest.raises(TypeError):
        SlabPool(64, bad)


@pytest.mark.parametrize("size,n", [(0, 4), (-1, 4), (64, 0), (64, -3), (64, 2**31)])
def test_constructor_value_errors(size, n):
    with pytest.raises(ValueError):
        SlabPool(size, n)


@pytest.mark.parametrize("size,align", [(1, 64), (100, 64), (4095, 64), (4096, 4096),
                                        (5000, 4096), (65536, 4096)])
def test_alignment(size, align):
    p = SlabPool(size, 5)
    assert p.alignment == align
    slots = [p.acquire() for _ in range(5)]
    addrs = sorted(addr(s) for s in slots)
    assert all(a % align == 0 for a in addrs)
    # slots do not overlap
    assert all(b - a >= size for a, b in zip(addrs, addrs[1:]))
    for s in slots:
        s.release()


# ---- acquire / release ------------------------------------------------------------------

def test_acquire_release_stats_and_exhaustion():
    p = SlabPool(64, 3)
    a, b, c = p.acquire(), p.acquire(), p.acquire()
    assert sorted([a.index, b.index, c.index]) == [0, 1, 2]
    assert (p.available, p.in_use, p.high_water) == (0, 3, 3)
    with pytest.raises(PoolExhausted):
        p.acquire()
    assert issubclass(PoolExhausted, RuntimeError)
    assert p.try_acquire() is None
    assert p.failed_acquires == 2
    b.release()
    assert (p.available, p.in_use, p.high_water) == (1, 2, 3)
    d = p.try_acquire()
    assert isinstance(d, Slot) and d.index == b.index
    for s in (a, c, d):
        s.release()
    assert (p.available, p.in_use, p.high_water) == (3, 0, 3)
    assert p.stats == {"slot_size": 64, "slots": 3, "available": 3, "in_use": 0,
                       "high_water": 3, "failed_acquires": 2}


def test_slot_attributes_and_buffer():
    p = SlabPool(32, 2)
    s = p.acquire()
    assert s.size == 32 and s.index in (0, 1) and s.length == 0 and s.refs == 1
    m = memoryview(s)
    assert (m.readonly, m.ndim, m.format, m.itemsize, m.nbytes, m.shape) == \
        (False, 1, "B", 1, 32, (32,))
    assert s.views == 1
    m[:5] = b"hello"
    m.release()
    assert s.views == 0
    s.length = 5
    assert s.data.tobytes() == b"hello"
    assert bytes(s)[:5] == b"hello"
    s.release()


def test_length_validation():
    p = SlabPool(16, 1)
    s = p.acquire()
    for ok in (0, 16, 7, True):
        s.length = ok
        assert s.length == int(ok)
    for bad in (-1, 17, 2**70, -2**70):
        with pytest.raises(ValueError):
            s.length = bad
    for bad in (1.0, "3", None):
        with pytest.raises(TypeError):
            s.length = bad
    s.release()
    with pytest.raises(ValueError):          # RefCountError is a ValueError
        s.length = 1


def test_double_release_raises_refcounterror():
    p = SlabPool(16, 2)
    s = p.acquire()
    s.release()
    with pytest.raises(RefCountError):
        s.release()
    with pytest.raises(RefCountError):
        s.retain()
    assert p.available == 2


def test_release_with_live_view_raises_buffererror_and_keeps_reference():
    p = SlabPool(16, 2)
    s = p.acquire()
    m = memoryview(s)
    with pytest.raises(BufferError):
        s.release()
    assert s.refs == 1 and p.in_use == 1            # reference kept, nothing returned
    with pytest.raises(BufferError):
        s.release()
    m.release()
    s.release()
    assert p.in_use == 0


def test_release_with_live_data_view_and_slices():
    p = SlabPool(16, 1)
    s = p.acquire()
    s.length = 4
    d = s.data
    sub = d[1:3]
    del d
    with pytest.raises(BufferError):
        s.release()
    sub.release()
    s.release()
    assert p.available == 1


def test_views_refused_after_release():
    p = SlabPool(16, 1)
    s = p.acquire()
    s.release()
    with pytest.raises(BufferError):
        memoryview(s)
    with pytest.raises(BufferError):
        s.data


def test_fan_out_with_retain():
    p = SlabPool(16, 1)
    s = p.acquire()
    assert s.retain() is s and s.retain() is s
    assert s.refs == 3
    m = memoryview(s)
    s.release()                     # not the last: a live view does not matter
    s.release()
    assert p.in_use == 1 and s.refs == 1
    with pytest.raises(BufferError):
        s.release()
    m.release()
    s.release()
    assert p.available == 1 and s.refs == 0


def test_context_manager():
    p = SlabPool(16, 1)
    with p.acquire() as s:
        assert isinstance(s, Slot) and p.in_use == 1
    assert p.in_use == 0
    with pytest.raises(KeyError):
        with p.acquire():
            raise KeyError
    assert p.in_use == 0


def test_slot_cannot_be_made_directly():
    with pytest.raises(TypeError):
        Slot()


def test_gc_of_held_slot_returns_it_with_one_resourcewarning():
    p = SlabPool(16, 2)
    s = p.acquire()
    s.retain()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del s
        gc.collect()
    rw = [x for x in w if issubclass(x.category, ResourceWarning)]
    assert len(rw) == 1
    assert p.available == 2


def test_gc_of_released_slot_is_silent():
    p = SlabPool(16, 2)
    s = p.acquire()
    s.release()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del s
        gc.collect()
    assert not [x for x in w if issubclass(x.category, ResourceWarning)]
    assert p.available == 2


def test_pool_outlives_its_slots():
    p = SlabPool(16, 2)
    s = p.acquire()
    memoryview(s)[:3] = b"abc"
    del p
    gc.collect()
    assert bytes(s)[:3] == b"abc"     # the arena is still there
    s.release()


def test_stale_reference_cannot_touch_the_next_holder():
    p = SlabPool(16, 1)
    old = p.acquire()
    old.release()
    new = p.acquire()                 # same index, but `old` is still referenced
    assert new.index == old.index and new is not old
    with pytest.raises(RefCountError):
        old.release()
    with pytest.raises(RefCountError):
        old.retain()
    with pytest.raises(BufferError):
        memoryview(old)
    assert new.refs == 1 and p.in_use == 1
    new.release()
    assert p.available == 1


def test_unreferenced_slot_objects_are_reused():
    p = SlabPool(16, 1)
    p.acquire().release()
    ids = set()
    for _ in range(10):
        s = p.acquire()
        ids.add(id(s))
        s.release()
        del s
    assert len(ids) == 1


def test_length_resets_on_acquire():
    p = SlabPool(16, 1)
    s = p.acquire()
    s.length = 9
    s.release()
    del s
    assert p.acquire().length == 0


# ---- memory ----------------------------------------------------------------------------

def test_steady_state_allocates_nothing():
    p = SlabPool(4096, 16)
    acq = p.acquire
    for _ in range(1000):
        acq().release()
    tracemalloc.start()
    try:
        snap0 = tracemalloc.take_snapshot()
        for _ in range(100_000):
            acq().release()
        for _ in range(1000):
            with acq() as s:
                s.length = 3
        del s
        snap1 = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    growth = sum(st.size_diff for st in snap1.compare_to(snap0, "filename"))
    assert growth < 2048, f"grew by {growth} bytes over 100k cycles"


# ---- threads ---------------------------------------------------------------------------

def test_threaded_stress_no_slot_shared():
    n = scaled(100_000)
    p = SlabPool(64, 16)
    counts = [0] * 4

    def worker(tid):
        pat = bytes([tid + 1]) * 64

        def run():
            acq = p.acquire
            for _ in range(n):
                s = acq()
                m = memoryview(s)
                m[:] = pat
                # nobody else may hold it: the pattern must stay ours
                if m != pat:
                    raise AssertionError("slot handed to two holders")
                m.release()
                s.release()
                counts[tid] += 1
        return run

    run_threads([worker(t) for t in range(4)], timeout=120)
    assert counts == [n] * 4
    assert p.available == 16 and p.in_use == 0
    assert 1 <= p.high_water <= 4
    assert p.failed_acquires == 0


def test_threaded_fan_out_with_retain():
    """One producer fills a slot, retains it once per consumer thread and hands it over;
    each consumer checks the bytes and releases once; the last release returns it."""
    import queue
    import threading
    rounds = scaled(20_000)
    p = SlabPool(64, 4)
    qs = [queue.SimpleQueue() for _ in range(3)]
    seen = [0, 0, 0]
    # back-pressure: one token per slot; the consumer whose release was the last of a round
    # (after the slot is back) returns the token, so acquire() can never fail
    tokens = threading.Semaphore(4)
    left = {}
    lock = threading.Lock()

    def producer():
        for r in range(rounds):
            assert tokens.acquire(timeout=60)
            with lock:
                left[r] = 3
            s = p.acquire()
            pat = bytes([r % 251]) * 64
            memoryview(s)[:] = pat
            s.length = 64
            for q in qs:
                q.put((s.retain(), pat, r))
            s.release()
        for q in qs:
            q.put(None)

    def consumer(k):
        def run():
            while (item := qs[k].get(timeout=60)) is not None:
                s, pat, r = item
                with s.data as d:
                    if d != pat:
                        raise AssertionError("fan-out slot changed under a reader")
                s.release()
                with lock:
                    left[r] -= 1
                    last = left[r] == 0
                if last:
                    tokens.release()
                seen[k] += 1
        return run

    run_threads([producer] + [consumer(k) for k in range(3)], timeout=120)
    assert seen == [rounds] * 3
    assert p.available == 4 and p.in_use == 0


# ---- true parallelism: 2 to 8 threads on one pool (free-threaded builds run them at once) --

@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [2, 4, 8])
def test_stress_two_slots_never_handed_out_twice(threads):
    """More threads than slots, all on try_acquire: a holder stamps its slot, does a little
    work and checks the stamp is still its own (a double hand-out overwrites it).  Exact
    accounting: hits + misses == attempts, misses == failed_acquires, everything back."""
    p = SlabPool(64, 2)
    n = scaled(20_000)
    hits, misses = [0] * threads, [0] * threads

    def worker(tid):
        pat = bytes([tid + 1]) * 64

        def run():
            take = p.try_acquire
            for _ in range(n):
                s = take()
                if s is None:
                    misses[tid] += 1
                    continue
                with memoryview(s) as m:
                    m[:] = pat
                    s.length = tid + 1
                    if m != pat or s.length != tid + 1:
                        raise AssertionError(f"slot {s.index} handed to two holders")
                s.release()
                hits[tid] += 1
        return run

    run_threads([worker(t) for t in range(threads)], timeout=110)
    assert [h + m for h, m in zip(hits, misses)] == [n] * threads
    assert p.failed_acquires == sum(misses)
    assert (p.available, p.in_use) == (2, 0)
    assert p.high_water == (2 if sum(misses) else p.high_water)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [2, 4, 8])
def test_stress_a_stale_slot_never_reaches_the_next_tenure(threads):
    """Slot objects are recycled, so each thread keeps its previous (released) Slot while
    the other threads take and release the same few indices: the stale object must stay
    dead (refs 0, retain/release/views refused), and no acquire may return it."""
    p = SlabPool(32, 4)
    n = scaled(10_000)
    done = [0] * threads

    def worker(tid):
        def run():
            take = p.try_acquire
            prev = None
            for _ in range(n):
                s = take()
                if s is None:
                    continue
                if s is prev:
                    raise AssertionError("a released Slot that is still referenced was reused")
                s.release()
                if prev is not None:
                    if prev.refs != 0:
                        raise AssertionError(f"stale slot shows {prev.refs} reference(s)")
                    with pytest.raises(RefCountError):
                        prev.retain()
                    with pytest.raises(RefCountError):
                        prev.release()
                    with pytest.raises(BufferError):
                        memoryview(prev)
                prev = s
                done[tid] += 1
        return run

    run_threads([worker(t) for t in range(threads)], timeout=110)
    assert sum(done) >= n     # at least one thread's worth of tenures went round
    assert (p.available, p.in_use) == (4, 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [2, 4])
def test_stress_slots_released_by_another_thread(threads):
    """Producers acquire and fill slots and hand them (their only reference) to consumer
    threads, which check the bytes and release them there: the Slot objects are freed,
    parked and reused across threads (the biased reference counts' cross-thread path).
    Every slot arrives exactly once with its producer's bytes, and all come back."""
    import queue
    p = SlabPool(64, 8)
    n = scaled(10_000)
    q = queue.SimpleQueue()
    got = [0] * threads

    def producer(tid):
        def run():
            for k in range(n):
                while (s := p.try_acquire()) is None:
                    time.sleep(0)    # a yield: the consumers give the slots back
                memoryview(s)[:] = bytes([tid + 1, k % 256]) * 32
                q.put((tid, k, s))
                del s                # the consumer holds the only reference
            q.put(None)
        return run

    def consumer(i):
        def run():
            while (item := q.get(timeout=60)) is not None:
                tid, k, s = item
                if bytes(memoryview(s)) != bytes([tid + 1, k % 256]) * 32:
                    raise AssertionError("a slot's bytes changed between two threads")
                s.release()
                got[i] += 1
        return run

    run_threads([producer(t) for t in range(threads)] + [consumer(i) for i in range(threads)],
                timeout=110)
    assert sum(got) == threads * n
    assert (p.available, p.in_use) == (8, 0)


# ---- the per-thread stash: a thread's give-back waits in a word of its own ---------------

def test_stats_stay_exact_through_the_stash_single_threaded():
    """Random acquires and releases on one thread (a release goes to the thread's stash word
    when it is empty, else to the ring): available, in_use and high_water match a model after
    every step, and every slot can be taken once all are back."""
    import random
    rnd = random.Random(7)
    for n in (1, 2, 3, 5, 16):
        p = SlabPool(32, n)
        held, top = [], 0
        for _ in range(2000):
            if held and (len(held) == n or rnd.random() < 0.5):
                held.pop(rnd.randrange(len(held))).release()
            else:
                held.append(p.acquire())
                top = max(top, len(held))
            assert (p.in_use, p.available, p.high_water) == (len(held), n - len(held), top)
            assert len({s.index for s in held}) == len(held)
        for s in held:
            s.release()
        every = [p.acquire() for _ in range(n)]
        assert sorted(s.index for s in every) == list(range(n))
        with pytest.raises(PoolExhausted):
            p.acquire()
        for s in every:
            s.release()


def test_slots_other_threads_gave_back_are_found_when_the_ring_is_empty():
    """Four threads each take four slots and give them back (each keeps one in its stash
    word), and stay alive; another thread then takes all sixteen: none is reported
    exhausted while one is free, wherever it waits."""
    import threading
    p = SlabPool(32, 16)
    gave, done = threading.Barrier(5, timeout=30), threading.Event()
    got = []

    def giver():
        for s in [p.acquire() for _ in range(4)]:
            s.release()
        gave.wait()
        done.wait(30)           # alive (its thread id and word its own) until the taker ran

    def taker():
        gave.wait()
        try:
            got.extend(p.acquire() for _ in range(16))
        finally:
            done.set()

    run_threads([giver] * 4 + [taker])
    assert sorted(s.index for s in got) == list(range(16))
    assert p.try_acquire() is None and p.failed_acquires == 1
    for s in got:
        s.release()
    assert (p.available, p.in_use) == (16, 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [2, 4, 8])
def test_stress_an_acquire_never_fails_while_a_slot_is_free(threads):
    """At most slots - 1 holders at any instant (a semaphore of slots - 1 permits around
    each tenure), so at every instant a slot is free somewhere -- the ring or a stash word --
    and no acquire may report the pool exhausted, however the indices move between the
    threads' words."""
    import threading
    n = 4
    p = SlabPool(32, n)
    permits = threading.Semaphore(n - 1)
    rounds = scaled(20_000)
    done = [0] * threads

    def worker(tid):
        def run():
            for _ in range(rounds):
                with permits:
                    s = p.acquire()         # PoolExhausted fails the test
                    s.release()
                done[tid] += 1
        return run

    run_threads([worker(t) for t in range(threads)], timeout=110)
    assert done == [rounds] * threads
    assert p.failed_acquires == 0
    assert (p.available, p.in_use) == (n, 0)
