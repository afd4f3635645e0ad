"""The nogil C-level API of SlabPool, under true parallelism (a cybuild module whose loops run
without the GIL, called from several threads at once), and its coexistence with Slots."""
import pytest

from aoprim import RefCountError
from aoprim._slab import SlabPool
from support import run_threads, scaled

SOURCE = r'''
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memset
from aoprim._slab cimport (SlabPool, Slot, aop_slab_acquire, aop_slab_release,
                          aop_slab_ptr)

def hammer(SlabPool pool, int tid, long n):
    """n times: acquire an index, fill the slot with tid, check every byte, release.
    Returns (done, torn, failed_acquires, bad_releases)."""
    cdef long i, done = 0, torn = 0, failed = 0, bad = 0
    cdef int64_t k, j
    cdef unsigned char *p
    cdef int64_t size = pool.slab.slot_size
    with nogil:
        for i in range(n):
            k = aop_slab_acquire(pool.slab)
            if k < 0:
                failed += 1
                continue
            p = <unsigned char *>aop_slab_ptr(pool.slab, k)
            memset(p, tid, size)
            for j in range(size):
                if p[j] != tid:
                    torn += 1
                    break
            if aop_slab_release(pool.slab, k) != 0:
                bad += 1
            done += 1
    return done, torn, failed, bad

def methods(SlabPool pool):
    """The cdef nogil methods: acquire, ptr, double release, adopt."""
    cdef int64_t k
    cdef int r1, r2
    with nogil:
        k = pool.c_acquire()
        pool.c_ptr(k)[0] = 65
        r1 = pool.c_release(k)
        r2 = pool.c_release(k)
    return k, r1, r2

def acquire_raw(SlabPool pool):
    cdef int64_t k
    with nogil:
        k = pool.c_acquire()
    return k

def release_raw(SlabPool pool, int64_t k):
    cdef int r
    with nogil:
        r = pool.c_release(k)
    return r

def adopt(SlabPool pool, int64_t k):
    return pool.c_adopt(k)
'''


@pytest.fixture(scope="module")
def mod(cybuild):
    return cybuild("slab_nogil_mod", SOURCE)


def test_nogil_parallel_hammer(mod):
    n = scaled(100_000)
    p = SlabPool(256, 8)
    results = [None] * 4

    def worker(t):
        def run():
            results[t] = mod.hammer(p, t + 1, n)
        return run

    run_threads([worker(t) for t in range(4)], timeout=120)
    for done, torn, failed, bad in results:
        assert torn == 0 and bad == 0 and failed == 0
        assert done == n
    assert p.available == 8 and p.in_use == 0
    assert 1 <= p.high_water <= 4


def test_nogil_exhaustion_under_contention(mod):
    # 2 slots, 4 threads: some acquires fail, none is handed out twice
    n = scaled(50_000)
    p = SlabPool(64, 2)
    results = [None] * 4

    def worker(t):
        def run():
            results[t] = mod.hammer(p, t + 1, n)
        return run

    run_threads([worker(t) for t in range(4)], timeout=120)
    assert all(r[1] == 0 and r[3] == 0 for r in results)
    total_failed = sum(r[2] for r in results)
    assert sum(r[0] for r in results) + total_failed == 4 * n
    assert p.failed_acquires == total_failed
    assert p.available == 2
    # a failed acquire means the ring was empty: every slot was in use at that instant
    assert p.high_water == (2 if total_failed else p.high_water)
    assert 1 <= p.high_water <= 2


def test_c_methods_and_double_release(mod):
    p = SlabPool(16, 2)
    k, r1, r2 = mod.methods(p)
    assert k in (0, 1) and r1 == 0 and r2 == -1
    assert p.available == 2
    assert mod.release_raw(p, 99) == -1
    assert mod.release_raw(p, -1) == -1


def test_c_and_python_coexist(mod):
    p = SlabPool(16, 3)
    s = p.acquire()
    # C code cannot release an index a Python Slot holds
    assert mod.release_raw(p, s.index) == -1
    k = mod.acquire_raw(p)
    assert k >= 0 and k != s.index and p.in_use == 2
    a = mod.adopt(p, k)              # the Slot now owns k
    assert a.index == k and a.refs == 1
    assert mod.release_raw(p, k) == -1
    with pytest.raises(ValueError):
        mod.adopt(p, k)              # not held by C any more
    a.release()
    s.release()
    assert p.available == 3
    with pytest.raises(RefCountError):
        a.release()
    # exhaust at C level: Python sees it
    ks = [mod.acquire_raw(p) for _ in range(3)]
    assert sorted(ks) == [0, 1, 2] and mod.acquire_raw(p) == -1
    assert p.try_acquire() is None
    assert all(mod.release_raw(p, x) == 0 for x in ks)
    assert p.available == 3


CIMPORT_SOURCE = r'''
from aoprim._blocktable cimport BlockTable
from aoprim._slab cimport Slot
def logical_length(BlockTable t):
    return t.nbytes, t.start, t.bsize
def first_byte(BlockTable t):
    cdef Slot s = t._blocks[0]
    return (<unsigned char *>s.ptr)[t.start]
'''


def test_blocktable_cimport(cybuild):
    from aoprim import BlockTable
    mod = cybuild("blocktable_cimport_mod", CIMPORT_SOURCE)
    p = SlabPool(8, 4)
    t = BlockTable(p)
    t.append(b"hello world")
    t.consume(3)
    assert mod.logical_length(t) == (8, 3, 8)
    assert mod.first_byte(t) == ord("l")
    t.release()
