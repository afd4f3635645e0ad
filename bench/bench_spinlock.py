"""SpinLock against threading.Lock, and the C-level cost of an uncontended lock/unlock.

Groups (the cases are aoprim/benchmarks/cases.py's, the same ones `python -m aoprim bench`
runs; baseline marked):
- lock-with: `with lock: pass` -- SpinLock vs threading.Lock (baseline) vs threading.RLock.
- lock-acquire-release: lock.acquire(); lock.release().
- lock-contended-2threads: two threads each doing `with lock: counter += 1`; wall time per
  acquisition (the command's contention curves run 1, 2, 4 and 8 threads, with the process
  CPU time over wall time).
- c-lock: ns per aop_spin_lock + aop_spin_unlock pair in a nogil loop, against the hardware
  floor measured in the same run: a bare __atomic_fetch_add loop (one locked instruction),
  and a bare CAS + exchange pair (the two locked instructions any lock needs).

Run:  pytest bench/bench_spinlock.py --benchmark-enable
"""
import pytest

from aoprim.benchmarks import cases


@pytest.mark.parametrize("group,case", cases.pytest_params(
    "lock-with", "lock-acquire-release", "lock-contended-2threads", "c-lock"))
def test_spinlock(benchmark, group, case):
    cases.pytest_run(benchmark, group, case)
