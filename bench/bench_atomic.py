"""AtomicInt / RefCount against their baselines, and the C-level cost of an atomic add.

Groups (the cases are aoprim/benchmarks/cases.py's, the same ones `python -m aoprim bench`
runs; baseline marked):
- atomic-increment: AtomicInt.fetch_add(1) vs an int guarded by threading.Lock (the
  baseline), itertools.count (GIL-atomic, increment-only), and cereggii's AtomicInt64;
  the empty loop shows the `for` loop's own cost, included in every entry alike.
- atomic-read: AtomicInt.load() / .value vs a lock-guarded read.
- refcount: RefCount incref+decref vs a lock-guarded int pair.
- c-atomic / c-refcount: ns per aop_fetch_add_i64 (and per c_incref + c_decref) in a nogil
  loop (aoprim.benchmarks._benchcore) vs a bare __atomic_fetch_add loop (the hardware floor).

Run:  pytest bench/bench_atomic.py --benchmark-enable
"""
import pytest

from aoprim.benchmarks import cases


@pytest.mark.parametrize("group,case", cases.pytest_params(
    "atomic-increment", "atomic-read", "refcount", "c-atomic", "c-refcount"))
def test_atomic(benchmark, group, case):
    cases.pytest_run(benchmark, group, case)
