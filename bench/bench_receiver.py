"""Receive path: Receiver.on_readable (one compiled recv + cut + deliver) vs the server's
Python path (sock.recv_into + Framing.scan + one mv[a:b] slice per frame), same no-op
handler.

Run:  AOPRIM_ALLOW_CHECKOUT=1 python3 -m pytest bench/bench_receiver.py --benchmark-enable -q

Scenario: u16 frames of 64 payload bytes, 16 per read, over a socketpair.  Before each
round the socket is filled with READS bursts of 16 frames (not timed); each round then does
READS reads of exactly one burst (the read size is one burst: 16 * 66 = 1056 bytes, the
Receiver's slot size and the Python path's buffer), so both sides do the same syscalls and
deliver the same frames.  Reported per frame.
"""
import socket
import struct

import pytest

from aoprim import Receiver, RxArena, SlabPool
from aoprim.server.framing import Framing

PAYLOAD = 64
PER_READ = 16
READS = 64                              # reads per round (64 KiB queued: fits the socketpair)
BURST = (struct.pack(">H", PAYLOAD) + b"p" * PAYLOAD) * PER_READ
ROUNDS = 300
GROUP = f"receive path: u16 {PAYLOAD}-byte frames x{PER_READ} per read (per frame)"


def handler(owner, data):
    pass


def event(owner, code, arg):
    raise AssertionError(f"unexpected event {code} {arg!r}")


@pytest.fixture
def pair():
    r, w = socket.socketpair()
    r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    r.setblocking(False)
    yield r, w
    r.close()
    w.close()


def _fill(w):
    data = BURST * READS

    def setup():
        w.sendall(data)
    return setup


def python_path(sock, mv, scan, owner, reads):
    """What aoprim/server/session.py does today for a u16 read into the scratch slot."""
    recv_into = sock.recv_into
    for _ in range(reads):
        n = recv_into(mv)
        spans, pos, need = scan(mv, 0, n)
        for a, b in spans:
            handler(owner, mv[a:b])


def receiver_path(on_readable, reads):
    for _ in range(reads):
        on_readable()


def test_python_recv_into_scan_slice(benchmark, pair):
    r, w = pair
    benchmark.group = GROUP
    benchmark.extra_info["baseline"] = True
    benchmark.extra_info["per_call"] = READS * PER_READ
    pool = SlabPool(len(BURST), 2)
    slot = pool.acquire()
    mv = memoryview(slot)
    scan = Framing("u16", 65536).scan
    benchmark.pedantic(python_path, args=(r, mv, scan, None, READS), setup=_fill(w),
                       rounds=ROUNDS, iterations=1, warmup_rounds=5)
    with pytest.raises(BlockingIOError):
        r.recv(1)                       # every byte was read
    mv.release()
    slot.release()


@pytest.mark.parametrize("copy", [False, True], ids=["views", "copy_frames"])
def test_receiver_on_readable(benchmark, pair, copy):
    r, w = pair
    benchmark.group = GROUP
    benchmark.extra_info["per_call"] = READS * PER_READ
    pool = SlabPool(len(BURST), 4)
    arena = RxArena(pool)
    rx = Receiver(arena, r.fileno(), 2, 65536, handler, event, None, copy)
    benchmark.pedantic(receiver_path, args=(rx.on_readable, READS), setup=_fill(w),
                       rounds=ROUNDS, iterations=1, warmup_rounds=5)
    assert rx.frames_in == (ROUNDS + 5) * READS * PER_READ
    assert rx.reads == (ROUNDS + 5) * READS and rx.buffered == 0
    assert arena.scratch_swaps == 0
    rx.close()
    arena.close()
    assert pool.in_use == 0
