"""Buffers: SlabPool acquire+release vs allocating a bytearray and vs Python free lists; the
BlockTable receive path vs the bytearray receive-buffer idiom; SlabPool at C level.

Groups (the cases are aoprim/benchmarks/cases.py's, the same ones `python -m aoprim bench`
runs; baseline marked):
- slab-4KiB, slab-64KiB: acquire+release (10 per loop turn, unrolled, the same for every
  entry) vs bytearray(size), a list free list (GIL-only) and a lock-guarded free list.
- receive-buffer: u16-framed messages of mixed small sizes in 1400-byte reads, per frame:
  BlockTable append/frame/consume vs `buf += data; slice; del buf[:n]`.
- c-slab: aop_slab_acquire + aop_slab_release in a nogil loop, beside a bare loop.

Run:  pytest bench/bench_buffers.py --benchmark-enable
"""
import pytest

from aoprim.benchmarks import cases


@pytest.mark.parametrize("group,case", cases.pytest_params(
    "slab-4KiB", "slab-64KiB", "receive-buffer", "c-slab"))
def test_buffers(benchmark, group, case):
    cases.pytest_run(benchmark, group, case)
