"""Shared benchmark harness.

Run:  pytest bench --benchmark-enable            (all groups)
      pytest bench/bench_cases.py --benchmark-enable -k atomic

Every benchmark belongs to a pytest-benchmark *group* that also holds its baseline (the
stdlib or peer equivalent), so the two always run side by side in one process.  Mark the
baseline with ``benchmark.extra_info["baseline"] = True`` (several entries may be marked:
each gets its own ratio column); at the end of the run this file
prints, per group, each entry's speed as a ratio against the baseline (``x2.5`` = 2.5 times
faster than the baseline) -- the figure the README reports.  Benchmarks that
move N items per call set ``benchmark.extra_info["per_call"] = N`` and are also reported
per item.  Results are also written as JSON when --benchmark-json is given.

The measured cases live in the package (aoprim/benchmarks/cases.py), shared with
``python -m aoprim bench``; bench_cases.py times every group of them.
"""
import os
import pathlib
import platform
import subprocess
import sys

import pytest

# bench/ on the path (its modules import each other), never the checkout root
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A timed run is serial: pyproject's addopts spread a run over pytest-xdist workers,
    and pytest-benchmark turns itself off under them (its timings would share the CPUs)."""
    if config.getoption("benchmark_enable") or config.getoption("benchmark_only"):
        config.option.numprocesses = 0


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                              capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        return "?"


def pytest_terminal_summary(terminalreporter, config):
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or not getattr(bs, "benchmarks", None):
        return
    tr = terminalreporter
    tr.section("aoprim: ratios against the baseline of each group (same run)")
    tr.write_line(f"machine: {platform.machine()} {os.cpu_count()} cpus, "
                  f"Python {platform.python_version()}, commit {_commit()}")
    groups = {}
    for b in bs.benchmarks:
        groups.setdefault(b.group or "(no group)", []).append(b)
    for name, items in sorted(groups.items()):
        base = [b for b in items if b.extra_info.get("baseline")]
        tr.write_line(f"[{name}]")
        for b in sorted(items, key=lambda b: b.stats.median):
            per = b.extra_info.get("per_call", 1)
            ns = b.stats.median * 1e9 / per
            line = f"  {b.name:<58} {ns:10.1f} ns/{'item' if per > 1 else 'call'}"
            for ref in base:        # a group may name several baselines (each is reported)
                ref_ns = ref.stats.median * 1e9 / ref.extra_info.get("per_call", 1)
                line += f"   x{ref_ns / ns:6.2f} vs {ref.name}"
            extra = {k: v for k, v in b.extra_info.items()
                     if k not in ("baseline", "per_call")}
            if extra:
                line += "   " + " ".join(f"{k}={v}" for k, v in extra.items())
            tr.write_line(line)
