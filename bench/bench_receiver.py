"""Receive path: Receiver.on_readable (one compiled recv + cut + deliver) vs the Python
path it replaced (sock.recv_into + a Python scan + one mv[a:b] slice per frame), same no-op
handler.

The cases (group receive-path) are aoprim/benchmarks/cases.py's, the same ones
`python -m aoprim bench --only receiver` runs.

Run:  AOPRIM_ALLOW_CHECKOUT=1 python3 -m pytest bench/bench_receiver.py --benchmark-enable -q

Scenario: u16 frames of 64 payload bytes, 16 per read, over a socketpair.  Before each
round the socket is filled with READS bursts of 16 frames (not timed); each round then does
READS reads of exactly one burst (the read size is one burst: 16 * 66 = 1056 bytes, the
Receiver's slot size and the Python path's buffer), so both sides do the same syscalls and
deliver the same frames.  Reported per frame.
"""
import pytest

from aoprim.benchmarks import cases


@pytest.mark.parametrize("group,case", cases.pytest_params("receive-path"))
def test_receiver(benchmark, group, case):
    cases.pytest_run(benchmark, group, case)
