"""Buffers: SlabPool acquire+release vs allocating a bytearray and vs Python free lists; the
BlockTable receive path vs the bytearray receive-buffer idiom.

Run:  pytest bench/bench_buffers.py --benchmark-enable

Every benchmark runs N operations per call (10 per loop turn, unrolled, the same for every
entry, so loop overhead is shared and small) and reports per-operation figures.
"""
import random
import struct
import threading

import pytest

from aoprim import BlockTable, SlabPool

N = 1000          # operations per benchmark call (acquire+release pairs)


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


def _slab_loop(pool):
    acq = pool.acquire

    def run():
        for _ in range(N // 10):
            acq().release(); acq().release(); acq().release(); acq().release()
            acq().release(); acq().release(); acq().release(); acq().release()
            acq().release(); acq().release()
    return run


def _bytearray_loop(size):
    ba = bytearray

    def run():
        for _ in range(N // 10):
            ba(size); ba(size); ba(size); ba(size); ba(size)
            ba(size); ba(size); ba(size); ba(size); ba(size)
    return run


def _freelist_loop(fl):
    acq, rel = fl.acquire, fl.release

    def run():
        for _ in range(N // 10):
            rel(acq()); rel(acq()); rel(acq()); rel(acq()); rel(acq())
            rel(acq()); rel(acq()); rel(acq()); rel(acq()); rel(acq())
    return run


@pytest.mark.parametrize("size", [4096, 65536], ids=["4KiB", "64KiB"])
@pytest.mark.parametrize("kind", ["SlabPool.acquire+release", "bytearray(size) [baseline]",
                                  "list free list (GIL-only)", "Lock-guarded free list"])
def test_acquire_release(benchmark, size, kind):
    benchmark.group = f"slab acquire+release, {size // 1024} KiB slots"
    benchmark.extra_info["per_call"] = N
    if kind.startswith("SlabPool"):
        fn = _slab_loop(SlabPool(size, 16))
    elif kind.startswith("bytearray"):
        benchmark.extra_info["baseline"] = True
        fn = _bytearray_loop(size)
    elif kind.startswith("list"):
        fn = _freelist_loop(ListFreeList(size, 16))
    else:
        fn = _freelist_loop(LockedFreeList(size, 16))
    benchmark(fn)


# ---- receive buffer --------------------------------------------------------------------------

def _stream(seed=7, frames=2000, lo=1, hi=200, read=1400):
    """u16-framed messages of mixed small sizes, cut into `read`-byte receives (frames split
    across receives, as TCP does)."""
    rnd = random.Random(seed)
    payloads = [bytes([i % 256]) * rnd.randint(lo, hi) for i in range(frames)]
    raw = b"".join(struct.pack(">H", len(p)) + p for p in payloads)
    return [raw[i:i + read] for i in range(0, len(raw), read)], len(payloads)


CHUNKS, NFRAMES = _stream()


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
            frame = buf[pos + 2:end]
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


def test_receive_bytearray_idiom(benchmark):
    benchmark.group = "receive buffer: mixed small u16 frames (per frame)"
    benchmark.extra_info["baseline"] = True
    benchmark.extra_info["per_call"] = NFRAMES
    assert benchmark(bytearray_receive, CHUNKS) == NFRAMES


def test_receive_blocktable(benchmark):
    benchmark.group = "receive buffer: mixed small u16 frames (per frame)"
    benchmark.extra_info["per_call"] = NFRAMES
    pool = SlabPool(4096, 64)
    table = BlockTable(pool)
    assert benchmark(blocktable_receive, table, CHUNKS) == NFRAMES
    assert len(table) == 0 and pool.in_use == 0


# ---- C level ---------------------------------------------------------------------------------

C_SOURCE = r'''
from aoprim._slab cimport SlabPool, aop_slab_acquire, aop_slab_release
def slab_loop(SlabPool pool, long n):
    cdef long i
    cdef long long k, s = 0
    with nogil:
        for i in range(n):
            k = aop_slab_acquire(pool.slab)
            s += k
            aop_slab_release(pool.slab, k)
    return s
def bare_loop(long n):
    cdef long i
    cdef long long s = 0
    cdef volatile long long k = 0
    with nogil:
        for i in range(n):
            s += k
    return s
'''


@pytest.fixture(scope="module")
def cmod(cybuild):
    return cybuild("bench_slab_c", C_SOURCE)


def test_c_acquire_release(benchmark, cmod):
    benchmark.group = "slab C level (nogil) acquire+release"
    benchmark.extra_info["per_call"] = 100_000
    benchmark(cmod.slab_loop, SlabPool(4096, 16), 100_000)


def test_c_bare_loop(benchmark, cmod):
    benchmark.group = "slab C level (nogil) acquire+release"
    benchmark.extra_info["per_call"] = 100_000
    benchmark.extra_info["baseline"] = True
    benchmark(cmod.bare_loop, 100_000)
