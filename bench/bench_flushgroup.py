"""FlushGroup vs the Python end-of-iteration flush loop it replaces.

Scenario "100 x 4" (group flushgroup-100x4; per_call = 100, so the table reports ns per
batch): one event-loop iteration's send side for 100 sessions, each over its own socketpair,
each sending 4 small messages (16..40 B) and then flushed:
  - python_loop (baseline): add_copy() x 4 per session with the server's dirty-list
    bookkeeping (flag + list append), then a Python loop calling b.flush() per dirty batch
    (try/except, pending check), as Server._flush_dirty does
  - flushgroup: add_copy() x 4 per session (the batch queues itself), then ONE g.flush()
    (all 100 syscalls with the GIL released once)
Both write 100 syscalls per call (checked from stats); the peers are drained between rounds,
outside the timing (pedantic setup), so every call really reaches the kernel.

The two sides one at a time are the flushgroup-100x4 group (aoprim/benchmarks/cases.py's
cases, which `python -m aoprim bench --only flushgroup` runs and bench/bench_cases.py times
with pytest-benchmark).  This file times them interleaved: each round runs the Python loop
and the group back to back, so load drifting on a shared machine hits both sides alike
(pytest-benchmark times one callable, so it times the pair and reports the ratio).

Run:  pytest bench/bench_flushgroup.py --benchmark-enable
"""
import statistics
import time

import pytest

from aoprim import FlushGroup
from aoprim.benchmarks import cases

N = cases.FG_N


# ---- interleaved A/B: the ratio under drifting load --------------------------------------

@pytest.mark.benchmark(group="flushgroup-100x4-interleaved")
def test_interleaved_ab(benchmark):
    """The machines are shared: load drifts between two sequential benchmarks.  Here each
    round times the Python loop and the group back to back (same data, same peers), and the
    ratio of the medians is reported as ``ratio`` (> 1: the group is faster).  The timed
    figure itself is the pair's sum."""
    with cases.socketpairs(N) as socks:
        _interleaved(benchmark, socks)


def _interleaved(benchmark, socks):
    drain = cases.drainer(socks)
    py_b = [cases.new_batch(a) for a, _ in socks]
    g = FlushGroup()
    g_b = []
    for i, (a, _) in enumerate(socks):
        b = cases.new_batch(a)
        g.attach(b, i)
        g_b.append(b)
    t_py, t_g = [], []
    clock = time.perf_counter_ns

    def pair():
        drain()
        for b in py_b:
            b.add_many(cases.FG_MSGS)
        dirty = list(py_b)
        t0 = clock()
        for b in dirty:
            try:
                b.flush()
            except (BlockingIOError, InterruptedError):
                pass
        t1 = clock()
        drain()
        for b in g_b:
            b.add_many(cases.FG_MSGS)
        t2 = clock()
        g.flush()
        t3 = clock()
        t_py.append(t1 - t0)
        t_g.append(t3 - t2)

    benchmark.pedantic(pair, rounds=600, iterations=1, warmup_rounds=20)
    ratio = statistics.median(t_py) / statistics.median(t_g)
    benchmark.extra_info.update(
        per_call=N, ratio=round(ratio, 3),
        py_loop_ns_per_batch=round(statistics.median(t_py) / N, 1),
        group_ns_per_batch=round(statistics.median(t_g) / N, 1))
    assert all(b.pending_bytes == 0 for b in py_b + g_b)
