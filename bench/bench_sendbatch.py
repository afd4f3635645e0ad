"""SendBatch vs the ways Python code sends 16 small messages, over a socketpair whose peer is
drained by a reader thread (every call really reaches the kernel).

Scenario "16 x 64 B" (group sendbatch-16x64B; per_call = 16, so the table reports ns per
message and a ratio against each of the two baselines):
  - 16 x socket.send                       (baseline)
  - b"".join(list) + socket.send           (baseline: the floor "one copy, one syscall")
  - socket.sendmsg(list) built in Python
  - SendBatch: add() x 16 + flush(), add_many(list) + flush(), and add() x 16 with the
    default auto_flush
Each SendBatch benchmark also checks syscalls per message from ``stats`` (target <= 1/16).

Copy cut-off (groups sendbatch-cutoff-<size>): 16 messages of 256 B .. 8 KiB sent through
SendBatch by copy (copy_max huge) vs by reference (copy_max=0, one iovec each; baseline).
A ratio > 1 means copying is faster at that size.  DEFAULT_COPY_MAX is set from this.

Run:  pytest bench/bench_sendbatch.py --benchmark-enable
"""
import socket
import threading

import pytest

from aoprim import SendBatch


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    total = [0]

    def drain():
        buf = bytearray(1 << 20)
        while True:
            n = b.recv_into(buf)
            if not n:
                return
            total[0] += n

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    yield a, total
    a.shutdown(socket.SHUT_WR)
    t.join(30)
    assert not t.is_alive()
    a.close()
    b.close()


MSGS_64 = [bytes([i]) * 64 for i in range(16)]


def _per_message_send(a, msgs):
    send = a.send
    for m in msgs:
        send(m)


def _py_sendmsg(a, msgs):
    a.sendmsg(msgs)


def _join_send(a, msgs):
    a.send(b"".join(msgs))


def _make_add16(sb):
    add = sb.add
    flush = sb.flush

    def run(msgs):
        for m in msgs:
            add(m)
        flush()
    return run


def _make_add_many(sb):
    add_many = sb.add_many
    flush = sb.flush

    def run(msgs):
        add_many(msgs)
        flush()
    return run


def _check_batch(benchmark, sb, a_total, nbytes):
    st = sb.stats
    assert sb.pending_bytes == 0
    assert st["bytes"] == nbytes * (st["messages"] // 16)
    per_msg = st["syscalls"] / st["messages"]
    benchmark.extra_info["syscalls_per_msg"] = per_msg
    assert per_msg <= 1 / 16, per_msg


# ---- one group, two baselines: 16 x send, and b"".join + one send (one copy, one syscall) ----

@pytest.mark.benchmark(group="sendbatch-16x64B")
def test_send_x16_baseline(benchmark, pair):
    a, _ = pair
    benchmark.extra_info.update(baseline=True, per_call=16)
    benchmark(_per_message_send, a, MSGS_64)


@pytest.mark.benchmark(group="sendbatch-16x64B")
def test_join_send_baseline(benchmark, pair):
    a, _ = pair
    benchmark.extra_info.update(baseline=True, per_call=16)
    benchmark(_join_send, a, MSGS_64)


@pytest.mark.benchmark(group="sendbatch-16x64B")
def test_py_sendmsg(benchmark, pair):
    a, _ = pair
    benchmark.extra_info["per_call"] = 16
    benchmark(_py_sendmsg, a, MSGS_64)


@pytest.mark.parametrize("way", ["add16_flush", "add_many_flush", "add16_autoflush"])
@pytest.mark.benchmark(group="sendbatch-16x64B")
def test_sendbatch(benchmark, pair, way):
    """add() x16 + flush(), add_many() + flush(), and the default auto_flush configuration
    (the 16th add() flushes by itself)."""
    a, total = pair
    sb = SendBatch(a, auto_flush=(way == "add16_autoflush"))
    if way == "add_many_flush":
        run = _make_add_many(sb)
    elif way == "add16_flush":
        run = _make_add16(sb)
    else:
        add = sb.add

        def run(msgs):
            for m in msgs:
                add(m)
    benchmark.extra_info["per_call"] = 16
    benchmark(run, MSGS_64)
    _check_batch(benchmark, sb, total, 1024)


# ---- copy cut-off: by copy vs by reference, per message size ------------------------------

CUTOFF_SIZES = [256, 1024, 2048, 3072, 4096, 8192]


@pytest.mark.parametrize("size", CUTOFF_SIZES)
def test_cutoff_by_reference(benchmark, pair, size):
    a, total = pair
    benchmark.group = f"sendbatch-cutoff-{size:05d}B"
    msgs = [bytes([i]) * size for i in range(16)]
    sb = SendBatch(a, auto_flush=False, copy_max=0)
    benchmark.extra_info.update(baseline=True, per_call=16)
    benchmark(_make_add_many(sb), msgs)
    _check_batch(benchmark, sb, total, 16 * size)


@pytest.mark.parametrize("size", CUTOFF_SIZES)
def test_cutoff_by_copy(benchmark, pair, size):
    a, total = pair
    benchmark.group = f"sendbatch-cutoff-{size:05d}B"
    msgs = [bytes([i]) * size for i in range(16)]
    sb = SendBatch(a, auto_flush=False, copy_max=1 << 30)
    benchmark.extra_info["per_call"] = 16
    benchmark(_make_add_many(sb), msgs)
    _check_batch(benchmark, sb, total, 16 * size)


@pytest.mark.parametrize("size", CUTOFF_SIZES)
def test_cutoff_join_send(benchmark, pair, size):
    a, _ = pair
    benchmark.group = f"sendbatch-cutoff-{size:05d}B"
    msgs = [bytes([i]) * size for i in range(16)]
    benchmark.extra_info["per_call"] = 16
    benchmark(_join_send, a, msgs)
