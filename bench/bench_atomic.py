"""AtomicInt / RefCount against their baselines, and the C-level cost of an atomic add.

Scenarios (each a pytest-benchmark group, baseline marked):
- atomic-increment: AtomicInt.fetch_add(1) vs an int guarded by threading.Lock (the
  baseline), itertools.count (GIL-atomic, increment-only), and cereggii's AtomicInt64.
- atomic-read: AtomicInt.load() / .value vs a lock-guarded read.
- refcount: RefCount incref+decref vs a lock-guarded int pair.
- c-atomic-add: ns per aop_fetch_add_i64 in a nogil loop vs a bare __atomic_fetch_add loop
  (the hardware floor).
Python-level figures include the `for` loop's own cost (shown as empty-loop), the same for
every entry.
"""
import itertools
import threading

import pytest

from aoprim import AtomicInt, RefCount
from floors import FLOORS

N = 1000        # operations per benchmark call (reported per operation)


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


def _run(benchmark, fn, baseline=False):
    benchmark.extra_info["per_call"] = N
    if baseline:
        benchmark.extra_info["baseline"] = True
    benchmark(fn)


# ---- atomic-increment ---------------------------------------------------------------------

@pytest.mark.benchmark(group="atomic-increment")
def test_locked_int_fetch_add(benchmark):
    c = LockedCounter()

    def run():
        for _ in range(N):
            c.fetch_add(1)
    _run(benchmark, run, baseline=True)


@pytest.mark.benchmark(group="atomic-increment")
def test_atomicint_fetch_add(benchmark):
    a = AtomicInt()

    def run():
        for _ in range(N):
            a.fetch_add(1)
    _run(benchmark, run)


@pytest.mark.benchmark(group="atomic-increment")
def test_itertools_count_next(benchmark):
    c = itertools.count()

    def run():
        for _ in range(N):
            next(c)
    _run(benchmark, run)


@pytest.mark.benchmark(group="atomic-increment")
def test_cereggii_increment_and_get(benchmark):
    cereggii = pytest.importorskip("cereggii")
    a = cereggii.AtomicInt64(0)

    def run():
        for _ in range(N):
            a.increment_and_get()
    _run(benchmark, run)


@pytest.mark.benchmark(group="atomic-increment")
def test_empty_loop(benchmark):
    def run():
        for _ in range(N):
            pass
    _run(benchmark, run)


# ---- atomic-read --------------------------------------------------------------------------

@pytest.mark.benchmark(group="atomic-read")
def test_locked_int_read(benchmark):
    c = LockedCounter()

    def run():
        for _ in range(N):
            c.load()
    _run(benchmark, run, baseline=True)


@pytest.mark.benchmark(group="atomic-read")
def test_atomicint_load(benchmark):
    a = AtomicInt(5)

    def run():
        for _ in range(N):
            a.load()
    _run(benchmark, run)


@pytest.mark.benchmark(group="atomic-read")
def test_atomicint_value(benchmark):
    a = AtomicInt(5)

    def run():
        for _ in range(N):
            a.value
    _run(benchmark, run)


# ---- refcount -----------------------------------------------------------------------------

@pytest.mark.benchmark(group="refcount")
def test_locked_int_incref_decref(benchmark):
    c = LockedCounter()

    def run():
        for _ in range(N):
            c.fetch_add(1)
            c.fetch_add(-1)
    _run(benchmark, run, baseline=True)


@pytest.mark.benchmark(group="refcount")
def test_refcount_incref_decref(benchmark):
    r = RefCount(1)

    def run():
        for _ in range(N):
            r.incref()
            r.decref()
    _run(benchmark, run)


# ---- C level ------------------------------------------------------------------------------

C_SOURCE = FLOORS + r"""
from aoprim._atomic cimport AtomicInt
from aoprim.atomic_h cimport aop_fetch_add_i64, AOP_SEQ_CST

def aoprim_add(AtomicInt a, int64_t n):
    cdef int64_t i
    with nogil:
        for i in range(n):
            aop_fetch_add_i64(&a.cell, 1, AOP_SEQ_CST)
"""
CN = 100_000


@pytest.fixture(scope="module")
def cmod(cybuild):
    return cybuild("aop_bench_atomic", C_SOURCE)


@pytest.mark.benchmark(group="c-atomic-add")
def test_c_bare_atomic_fetch_add(benchmark, cmod):
    benchmark.extra_info.update(per_call=CN, baseline=True)
    benchmark(cmod.bare_fetch_add, CN)


@pytest.mark.benchmark(group="c-atomic-add")
def test_c_aop_fetch_add_i64(benchmark, cmod):
    a = AtomicInt()
    benchmark.extra_info["per_call"] = CN
    benchmark(cmod.aoprim_add, a, CN)
