"""Echo benchmark as a pytest run (the same code as ``python bench/echo_compare.py``):

    pytest bench/bench_echo.py --benchmark-enable -s

For each scenario the aoprim server, an asyncio echo server and a uvloop echo server run in
turn in their own processes under the same load generator, each warmed up first by one
connection that comes and goes (the steady state; see echo_compare's docstring); the table printed at the end
gives messages/s, server CPU us/message (user+sys of the server process over the measured
window) and aoprim's send syscalls per message, plus the targets met or missed.
AOPRIM_ECHO_DURATION (seconds per run, default 3) and AOPRIM_ECHO_ROUNDS (interleaved
rounds, median reported; default 1) tune it.  Echo correctness is asserted (the load
generator checks every byte); the performance targets are reported, not asserted -- on a
shared 2-core machine they are ratios to read, not a pass/fail gate.
"""
import os

import pytest

import echo_compare as ec

DURATION = float(os.environ.get("AOPRIM_ECHO_DURATION", "3"))
ROUNDS = int(os.environ.get("AOPRIM_ECHO_ROUNDS", "1"))
_RESULTS = {}


@pytest.mark.parametrize("scenario", list(ec.SCENARIOS))
def test_echo(scenario):
    res = ec.compare(scenario, DURATION, ROUNDS)
    assert set(res) >= {"aoprim", "asyncio"}
    assert all(r["msgs_per_s"] > 0 for r in res.values())
    _RESULTS[scenario] = res
    lines = []
    ec.report(scenario, res, log=lines.append)
    print("\n".join(lines))


def test_echo_targets():
    if not _RESULTS:
        pytest.skip("no scenario ran")
    print("\nthe echo targets, same run:")
    for name, ok, detail in ec.check_targets(_RESULTS):
        print(f"  [{'met' if ok else 'MISSED'}] {name}: {detail}")
