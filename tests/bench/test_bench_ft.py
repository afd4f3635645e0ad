"""``python -m aoprim bench --only ft``: the free-threaded scaling groups, run as a user runs
them (a subprocess).  On a free-threaded interpreter every group prints its table with the
aoprim rows and their baselines; under the GIL the groups are left out with one line that
says why."""
import json
import os
import subprocess
import sys

import pytest

from aoprim.benchmarks import ft, schema

from proc_support import NEUTRAL_CWD, child_env

FREE_THREADED = ft.available()

# group id -> (the baseline, aoprim's rows)
EXPECTED = {
    "ft-atomic-shared": ("threading.Lock + int", ["AtomicInt.fetch_add", "AtomicInt +="]),
    "ft-atomic-own": ("threading.Lock + int", ["AtomicInt.fetch_add", "AtomicInt +="]),
    "ft-lock-counter": ("threading.Lock + int", ["SpinLock + int",
                                                 "no lock (the floor; updates lost)"]),
    "ft-slab": ("bytearray(4096)", ["SlabPool.acquire().release()"]),
    "ft-mpmc-1p1c": ("queue.Queue(1024)", ["MPMCQueue(1024)", "MPMCQueue(n): never full",
                                           "MPMCQueue(1024), batches of 64",
                                           "queue.SimpleQueue"]),
    "ft-mpmc-2p2c": ("queue.Queue(1024)", ["MPMCQueue(1024)", "MPMCQueue(n): never full",
                                           "MPMCQueue(1024), batches of 64",
                                           "queue.SimpleQueue"]),
    "ft-spsc-1p1c": ("queue.Queue(1024)", ["SPSCQueue(1024)", "SPSCQueue(1024), batches of 64",
                                           "queue.SimpleQueue"]),
    "ft-queue-immortal": ("queue.Queue(1024)", ["MPMCQueue(1024)", "MPMCQueue(n): never full",
                                                "SPSCQueue(1024)", "queue.SimpleQueue"]),
    # workers=1 against workers=2 beside the handler's work in plain threads
    "ft-server-400": ("the loop alone, in threads", ["Server(workers=N)"]),
    "ft-server-2000": ("the loop alone, in threads", ["Server(workers=N)"]),
    "ft-server-10000": ("the loop alone, in threads", ["Server(workers=N)"]),
}


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "aoprim", "bench", *args],
                          capture_output=True, text=True, cwd=NEUTRAL_CWD, env=child_env(),
                          timeout=timeout)


def test_the_groups_are_the_documented_ones():
    assert [g.id for g in ft.groups("tiny")] == list(EXPECTED)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not FREE_THREADED, reason="the ft groups run only on a free-threaded "
                    f"interpreter: {ft.skip_reason()}")
def test_ft_groups_print_every_row_at_1_and_2_threads(tmp_path):
    path = str(tmp_path / "ft.json")
    r = bench("--tiny", "--only", "ft", "--no-progress", "--json", path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(path) as f:
        doc = json.load(f)
    assert schema.validate(doc) == []
    groups = {g["id"]: g for g in doc["groups"]}
    assert set(groups) == set(EXPECTED)
    for gid, (baseline, ours) in EXPECTED.items():
        g = groups[gid]
        assert f"[{gid}]" in r.stdout
        assert g["baseline"] == baseline and g["better"] == "higher"
        rows = {e["name"]: e for e in g["entries"]}
        for name in [baseline] + ours:
            e = rows[name]                   # measured, not skipped
            assert e["median"] > 0 and e["metrics"]["solo_mops"]["median"] > 0
            # the 2/1 column is the entry's own parallel over solo figure
            assert e["metrics"]["scaling"]["median"] == pytest.approx(
                e["samples"][0] / e["metrics"]["solo_mops"]["median"], rel=1e-3)
            # the cores the run kept busy: at least part of one, at most the machine's
            # (and some slack: the process's CPU clock and the wall clock tick apart)
            for key in ("cores_solo", "cores"):
                assert 0 < e["metrics"][key]["median"] <= (os.cpu_count() or 1) + 0.5
            assert name in r.stdout
        # a peer that cannot be installed here is named with the reason, never silently gone
        for s in g["skipped"]:
            assert s["reason"] and s["name"] in r.stdout
    assert "2/1" in r.stdout and "4/1" in r.stdout      # 2P2C runs 4 threads
    assert "ft (free-threaded scaling) groups" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 100


@pytest.mark.timeout(300)
@pytest.mark.skipif(FREE_THREADED, reason="checks the GIL build's skip line")
def test_under_the_gil_the_ft_groups_are_skipped_with_one_line(tmp_path):
    path = str(tmp_path / "ft.json")
    r = bench("--tiny", "--only", "ft", "--no-progress", "--json", path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(path) as f:
        doc = json.load(f)
    assert doc["groups"] == []
    (skip,) = [s for s in doc["skipped"] if s["what"].startswith("ft ")]
    assert skip["reason"] == ft.skip_reason()
    flat = " ".join(r.stdout.split())
    assert "ft (free-threaded scaling) groups: " + skip["reason"] in flat


@pytest.mark.parametrize("kind", ["MPMCQueue", "MPMCQueue(n)", "SPSCQueue", "SimpleQueue",
                                  "Queue"])
def test_a_queue_groups_solo_run_is_one_thread_putting_then_getting(monkeypatch, kind):
    """The 1-thread column of the queue groups is one thread doing put then get (their
    title says so), the parallel one the producer and consumer threads."""
    started = []
    real = ft._run_threads
    monkeypatch.setattr(ft, "_run_threads", lambda bodies: started.append(len(bodies))
                        or real(bodies))
    for producers in (1, 2):
        make = ft._queue(kind, producers, producers) if kind != "SPSCQueue" or producers == 1 \
            else None
        if make is None:
            continue
        wall, ops = make(1, 512)()
        assert ops == 512 and wall > 0 and started == []
        wall, ops = make(2 * producers, 512)()
        assert ops == 512 and started == [2 * producers]
        started.clear()
