"""SendBatch vs the ways Python code sends 16 small messages, over a socketpair whose peer is
drained by a reader thread (every call really reaches the kernel).

Groups (the cases are aoprim/benchmarks/cases.py's, the same ones `python -m aoprim bench`
runs; per message):
- sendbatch-16x64B: 16 x socket.send (baseline), b"".join + socket.send (one copy, one
  syscall), socket.sendmsg(list), and SendBatch: add() x 16 + flush(), add_many + flush(),
  add() x 16 with the default auto_flush.  Each SendBatch case checks, from ``stats``, at
  most one syscall per 16 messages.
- sendbatch-cutoff-<size>: 16 messages of 256 B .. 8 KiB through SendBatch by copy
  (copy_max huge) vs by reference (copy_max=0, one iovec each; baseline).  A ratio > 1 means
  copying is faster at that size; DEFAULT_COPY_MAX is set from this.  (`python -m aoprim
  bench` runs these only when named: --only sendbatch-cutoff.)
- c-sendbatch: 64 B messages to /dev/null: c_add_copy x16 + c_flush vs write() per message.

Run:  pytest bench/bench_sendbatch.py --benchmark-enable
"""
import pytest

from aoprim.benchmarks import cases


@pytest.mark.parametrize("group,case", cases.pytest_params(
    "sendbatch-16x64B", *(f"sendbatch-cutoff-{s:05d}B" for s in cases.CUTOFF_SIZES),
    "c-sendbatch"))
def test_sendbatch(benchmark, group, case):
    cases.pytest_run(benchmark, group, case)
