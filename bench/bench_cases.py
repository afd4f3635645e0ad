"""Every primitive group of ``python -m aoprim bench`` -- the cases of
aoprim/benchmarks/cases.py, each primitive beside its baselines at Python level and C level --
timed by pytest-benchmark instead of the command's own interleaved harness: one
pytest-benchmark group per bench group, its baseline marked, so bench/conftest.py's table at
the end gives every entry's ratio to its group's baseline (same run).

    pytest bench/bench_cases.py --benchmark-enable                   (every group)
    pytest bench/bench_cases.py --benchmark-enable -k "atomic or c-lock"

A test id is ``GROUP::CASE`` (``python -m aoprim bench --list`` names the groups; -k picks
by group id, family or case name).  Groups the command runs only when named (the
sendbatch copy cut-off sizes, the 2-thread lock) are here too.  A case whose optional peer
is missing (cereggii) is skipped with the reason.

This file is the adapter from the command's cases to pytest-benchmark: ``case.setup(n)``
yields the timed callable; ``fn.prepare`` (refill a socket, drain a peer) runs untimed
before every call through ``benchmark.pedantic``; heavy cases run a few rounds of one call.
"""
import sys

import pytest

from aoprim.benchmarks import cases


def params(*group_ids):
    """``pytest.param(group, case, id="GROUP::CASE")`` for every case of the named groups
    (all of them when none is named)."""
    groups = [cases.by_id(gid) for gid in group_ids] if group_ids else cases.GROUPS
    return [pytest.param(g, c, id=f"{g.id}::{c.name}") for g in groups for c in g.cases]


def run_case(benchmark, grp, case, rounds=5):
    """Time one case in ``grp``'s pytest-benchmark group, with the per-call count and the
    baseline flag bench/conftest.py's ratio table reads."""
    benchmark.group = grp.id
    benchmark.extra_info["per_call"] = case.n
    if case.role == "baseline":
        benchmark.extra_info["baseline"] = True
    try:
        cm = case.setup(case.n)
        fn = cm.__enter__()
    except cases.Unavailable as e:
        pytest.skip(str(e))
    try:
        prepare = getattr(fn, "prepare", None)
        if prepare is not None:
            benchmark.pedantic(fn, setup=prepare, rounds=case.rounds or 300, iterations=1,
                               warmup_rounds=20)
        elif case.heavy:
            benchmark.pedantic(fn, rounds=case.rounds or rounds, iterations=1)
        else:
            benchmark(fn)
    except BaseException:
        if not cm.__exit__(*sys.exc_info()):
            raise
    else:
        cm.__exit__(None, None, None)


@pytest.mark.parametrize("group,case", params())
def test_case(benchmark, group, case):
    run_case(benchmark, group, case)
