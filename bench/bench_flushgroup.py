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

Run:  pytest bench/bench_flushgroup.py --benchmark-enable
"""
import socket

import pytest

from aoprim import FlushGroup, SendBatch

N = 100
MSGS = [b"m%02d" % i * (4 + i % 7) for i in range(4)]     # 12..40 B
PER_ROUND = sum(map(len, MSGS))


@pytest.fixture(scope="module")
def socks():
    pairs = []
    for _ in range(N):
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        pairs.append((a, b))
    yield pairs
    for a, b in pairs:
        a.close()
        b.close()


def _drainer(socks):
    peers = [b for _, b in socks]
    buf = bytearray(1 << 16)

    def drain():
        for p in peers:
            try:
                while p.recv_into(buf):
                    pass
            except BlockingIOError:
                pass
    return drain


class _Sess:
    __slots__ = ("batch", "dirty")

    def __init__(self, batch):
        self.batch = batch
        self.dirty = False


def _run(benchmark, socks, fn, batches):
    drain = _drainer(socks)
    benchmark.extra_info["per_call"] = N
    benchmark.pedantic(fn, setup=drain, rounds=400, iterations=1, warmup_rounds=20)
    drain()
    calls = batches[0].stats["syscalls"]
    for b in batches:
        assert b.pending_bytes == 0
        assert b.stats["syscalls"] == calls          # one syscall per batch per call
        assert b.stats["bytes"] == calls * PER_ROUND
    benchmark.extra_info["syscalls_per_batch_per_call"] = 1


@pytest.mark.benchmark(group="flushgroup-100x4")
def test_python_dirty_loop_baseline(benchmark, socks):
    sessions = [_Sess(SendBatch(a, max_msgs=1024, max_bytes=256 << 10, auto_flush=False))
                for a, _ in socks]
    dirty = []
    m0, m1, m2, m3 = MSGS

    def iteration():
        for s in sessions:                  # what the handlers send this iteration
            add = s.batch.add_copy
            add(m0)
            add(m1)
            add(m2)
            add(m3)
            if not s.dirty:
                s.dirty = True
                dirty.append(s)
        for s in dirty:                     # Server._flush_dirty's fast path
            s.dirty = False
            b = s.batch
            try:
                b.flush()
            except (BlockingIOError, InterruptedError):
                pass
            if b:
                raise AssertionError("short write")
        dirty.clear()

    benchmark.extra_info["baseline"] = True
    _run(benchmark, socks, iteration, [s.batch for s in sessions])


@pytest.mark.benchmark(group="flushgroup-100x4")
def test_flushgroup(benchmark, socks):
    g = FlushGroup()
    batches = []
    for i, (a, _) in enumerate(socks):
        b = SendBatch(a, max_msgs=1024, max_bytes=256 << 10, auto_flush=False)
        g.attach(b, i)
        batches.append(b)
    adders = [b.add_copy for b in batches]
    flush = g.flush
    m0, m1, m2, m3 = MSGS

    def iteration():
        for add in adders:
            add(m0)
            add(m1)
            add(m2)
            add(m3)
        if flush() is not None:
            raise AssertionError("a batch needs attention")

    _run(benchmark, socks, iteration, batches)
    assert g.stats["gil_releases"] == g.stats["flushes"]


@pytest.mark.benchmark(group="flushgroup-100x4-flush-only")
def test_flush_only_python_loop_baseline(benchmark, socks):
    """The flush step alone: the adds happen in the (untimed) setup."""
    batches = [SendBatch(a, max_msgs=1024, max_bytes=256 << 10, auto_flush=False)
               for a, _ in socks]
    drain = _drainer(socks)
    dirty = []

    def setup():
        drain()
        for b in batches:
            b.add_many(MSGS)
            dirty.append(b)

    def flush_all():
        for b in dirty:
            try:
                b.flush()
            except (BlockingIOError, InterruptedError):
                pass
        dirty.clear()

    benchmark.extra_info.update(baseline=True, per_call=N)
    benchmark.pedantic(flush_all, setup=setup, rounds=400, iterations=1, warmup_rounds=20)
    assert all(b.pending_bytes == 0 for b in batches)


@pytest.mark.benchmark(group="flushgroup-100x4-flush-only")
def test_flush_only_flushgroup(benchmark, socks):
    g = FlushGroup()
    batches = []
    for i, (a, _) in enumerate(socks):
        b = SendBatch(a, max_msgs=1024, max_bytes=256 << 10, auto_flush=False)
        g.attach(b, i)
        batches.append(b)
    drain = _drainer(socks)

    def setup():
        drain()
        for b in batches:
            b.add_many(MSGS)

    benchmark.extra_info["per_call"] = N
    benchmark.pedantic(g.flush, setup=setup, rounds=400, iterations=1, warmup_rounds=20)
    assert all(b.pending_bytes == 0 for b in batches)


# ---- interleaved A/B: the ratio under drifting load --------------------------------------

@pytest.mark.benchmark(group="flushgroup-100x4-interleaved")
def test_interleaved_ab(benchmark, socks):
    """The machines are shared: load drifts between two sequential benchmarks.  Here each
    round times the Python loop and the group back to back (same data, same peers), and the
    ratio of the medians is reported as ``ratio`` (> 1: the group is faster).  The timed
    figure itself is the pair's sum."""
    import statistics
    import time
    drain = _drainer(socks)
    py_b = [SendBatch(a, max_msgs=1024, max_bytes=256 << 10, auto_flush=False)
            for a, _ in socks]
    g = FlushGroup()
    g_b = []
    for i, (a, _) in enumerate(socks):
        b = SendBatch(a, max_msgs=1024, max_bytes=256 << 10, auto_flush=False)
        g.attach(b, i)
        g_b.append(b)
    t_py, t_g = [], []
    clock = time.perf_counter_ns

    def pair():
        drain()
        for b in py_b:
            b.add_many(MSGS)
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
            b.add_many(MSGS)
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
