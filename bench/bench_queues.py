"""Queue benchmarks: MPMCQueue and SPSCQueue beside queue.SimpleQueue, queue.Queue and
collections.deque, all in the same run (ratios are what we report; the machine is shared).

Groups (the cases are aoprim/benchmarks/cases.py's, the same ones `python -m aoprim bench`
runs; baseline marked):
- queue-1thread:   put+get pairs from one thread (fast path, nothing ever waits)
- queue-batch16:   put_many / get_many of 16, per item, beside single put/get
- queue-2p2c:      2 producer + 2 consumer threads, items/s (blocking put/get, sentinels)
- queue-spsc-1p1c: 1 producer + 1 consumer thread, items/s (and a get_many(63) consumer)
- c-queue:         try_push + try_pop through the nogil C API, beside a bare loop

Run:  pytest bench/bench_queues.py --benchmark-enable
"""
import pytest

from aoprim.benchmarks import cases


@pytest.mark.parametrize("group,case", cases.pytest_params(
    "queue-1thread", "queue-batch16", "queue-2p2c", "queue-spsc-1p1c", "c-queue"))
def test_queues(benchmark, group, case):
    cases.pytest_run(benchmark, group, case)
