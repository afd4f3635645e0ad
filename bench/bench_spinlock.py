"""SpinLock against threading.Lock, and the C-level cost of an uncontended lock/unlock.

Groups (baseline marked):
- lock-with: `with lock: pass` -- SpinLock vs threading.Lock (baseline) vs threading.RLock.
- lock-acquire-release: lock.acquire(); lock.release().
- c-lock-unlock: ns per aop_spin_lock+aop_spin_unlock pair in a nogil loop, against the
  hardware floor measured in the same run: a bare __atomic_fetch_add loop (one locked
  instruction), and a bare CAS + exchange pair (the two locked instructions any lock needs).
- lock-contended-2threads: two threads each doing `with lock: counter += 1`; wall time per
  acquisition and the process CPU time per acquisition (a lock that burns a core while
  parked shows up as CPU time far above wall time x 1 thread).
"""
import os
import threading
import time

import pytest

from aoprim import SpinLock
from floors import FLOORS

N = 1000


def _with_loop(lk):
    def run():
        for _ in range(N):
            with lk:
                pass
    return run


def _acq_rel_loop(lk):
    def run():
        acq = lk.acquire
        rel = lk.release
        for _ in range(N):
            acq()
            rel()
    return run


@pytest.mark.benchmark(group="lock-with")
def test_with_threading_lock(benchmark):
    benchmark.extra_info.update(per_call=N, baseline=True)
    benchmark(_with_loop(threading.Lock()))


@pytest.mark.benchmark(group="lock-with")
def test_with_spinlock(benchmark):
    benchmark.extra_info["per_call"] = N
    benchmark(_with_loop(SpinLock()))


@pytest.mark.benchmark(group="lock-with")
def test_with_threading_rlock(benchmark):
    benchmark.extra_info["per_call"] = N
    benchmark(_with_loop(threading.RLock()))


@pytest.mark.benchmark(group="lock-acquire-release")
def test_acquire_release_threading_lock(benchmark):
    benchmark.extra_info.update(per_call=N, baseline=True)
    benchmark(_acq_rel_loop(threading.Lock()))


@pytest.mark.benchmark(group="lock-acquire-release")
def test_acquire_release_spinlock(benchmark):
    benchmark.extra_info["per_call"] = N
    benchmark(_acq_rel_loop(SpinLock()))


# ---- contention -------------------------------------------------------------------------

CONTENDED = 50_000


def _contended(lk):
    """Two threads, CONTENDED acquisitions each; returns (wall, cpu) seconds."""
    box = [0]
    go = threading.Barrier(3)

    def work():
        go.wait()
        for _ in range(CONTENDED):
            with lk:
                box[0] += 1

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    c0, t0 = time.process_time(), time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert box[0] == 2 * CONTENDED
    return wall, cpu


def _bench_contended(benchmark, lk, baseline=False):
    cpu = []

    def run():
        w, c = _contended(lk)
        cpu.append(c / w)
    benchmark.extra_info["per_call"] = 2 * CONTENDED
    if baseline:
        benchmark.extra_info["baseline"] = True
    benchmark.pedantic(run, rounds=5, iterations=1)
    benchmark.extra_info["cpu_per_wall"] = round(sum(cpu) / len(cpu), 2)


@pytest.mark.benchmark(group="lock-contended-2threads")
def test_contended_threading_lock(benchmark):
    _bench_contended(benchmark, threading.Lock(), baseline=True)


@pytest.mark.benchmark(group="lock-contended-2threads")
def test_contended_spinlock(benchmark):
    _bench_contended(benchmark, SpinLock())


# ---- C level ----------------------------------------------------------------------------

C_SOURCE = FLOORS + r"""
from aoprim._spinlock cimport SpinLock
from aoprim.atomic_h cimport aop_spin_lock, aop_spin_unlock

def spin_pairs(SpinLock lk, int64_t n):
    cdef int64_t i
    with nogil:
        for i in range(n):
            aop_spin_lock(&lk.lock)
            aop_spin_unlock(&lk.lock)
"""
CN = 100_000


@pytest.fixture(scope="module")
def cmod(cybuild):
    return cybuild("aop_bench_spin", C_SOURCE)


@pytest.mark.benchmark(group="c-lock-unlock")
def test_c_bare_fetch_add(benchmark, cmod):
    benchmark.extra_info.update(per_call=CN, baseline=True)
    benchmark(cmod.bare_fetch_add, CN)


@pytest.mark.benchmark(group="c-lock-unlock")
def test_c_bare_cas_xchg_pair(benchmark, cmod):
    benchmark.extra_info["per_call"] = CN
    benchmark(cmod.bare_cas_xchg, CN)


@pytest.mark.benchmark(group="c-lock-unlock")
def test_c_spin_lock_unlock_pair(benchmark, cmod):
    benchmark.extra_info["per_call"] = CN
    benchmark(cmod.spin_pairs, SpinLock(), CN)
