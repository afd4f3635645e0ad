"""SendBatch (docs/sendbatch.md): order and integrity, one syscall per flush, auto-flush
thresholds, clear(), partial writes (real kernel and a write-limit hook), would-block,
EINTR, errors, bad input, slot-like objects, mutation rules, and a hypothesis model test."""
import array
import errno
import gc
import os
import random
import select
import signal
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import aoprim
from aoprim import SendBatch
from support import scaled


# ---- helpers ------------------------------------------------------------------------------

class FakeSlot(bytearray):
    """A slot-like object for tests: a bytearray (so it has the buffer protocol on 3.11)
    with retain()/release()/length, refusing (like aoprim.Slot) to drop its last
    reference while a buffer export of it is alive."""

    def __init__(self, data, length=None):
        super().__init__(data)
        self.length = len(data) if length is None else length
        self.refs = 1
        self.log = []

    def _exported(self):
        try:
            self.append(0)          # a bytearray with a live export cannot be resized
        except BufferError:
            return True
        self.pop()
        return False

    def retain(self):
        assert self.refs > 0, "retain() of a returned slot"
        self.refs += 1
        self.log.append("retain")
        return self

    def release(self):
        if self.refs <= 0:
            raise aoprim.RefCountError("slot already returned")
        if self.refs == 1 and self._exported():
            self.log.append("refused")
            raise BufferError("last reference dropped while a view is alive")
        self.refs -= 1
        self.log.append("release")


def recv_exact(sock, n, timeout=10):
    out = bytearray()
    sock.settimeout(timeout)
    try:
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            assert chunk, "peer closed early"
            out += chunk
    finally:
        sock.settimeout(None)
    return bytes(out)


def recv_nowait(sock):
    out = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


# ---- the API section, case by case ------------------------------------------------------

def test_order_and_integrity_over_socketpair(pair):
    a, b = pair
    rng = random.Random(1)
    sb = SendBatch(a, auto_flush=False)
    expect = bytearray()
    for i in range(200):
        n = rng.choice([1, 7, 64, 500, 2048, 2049, 5000, 40000])
        raw = bytes(rng.getrandbits(8) for _ in range(min(n, 64))) * (n // 64 + 1)
        raw = raw[:n]
        kind = i % 3
        data = raw if kind == 0 else bytearray(raw) if kind == 1 else memoryview(raw)
        sb.add(data)
        expect += raw
        if i % 10 == 9:
            total = sb.pending_bytes
            assert sb.flush() == total
            assert recv_exact(b, total) == bytes(expect[-total:]) if total else True
    total = sb.pending_bytes
    assert sb.flush() == total
    got = recv_exact(b, total)
    assert got == bytes(expect[len(expect) - total:])
    assert sb.stats["bytes"] == len(expect)
    assert sb.stats["messages"] == 200
    assert sb.pending_bytes == 0 and sb.pending_msgs == 0 and len(sb) == 0


def test_one_syscall_for_a_flush_of_16(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    msgs = [bytes([i]) * 64 for i in range(16)]
    for m in msgs:
        sb.add(m)
    assert len(sb) == sb.pending_msgs == 16 and sb.pending_bytes == 1024
    assert sb.stats["syscalls"] == 0
    assert sb.flush() == 1024
    st = sb.stats
    assert st["syscalls"] == 1 and st["messages"] == 16 and st["bytes"] == 1024
    assert st["partial_writes"] == 0
    assert recv_exact(b, 1024) == b"".join(msgs)
    # a mix of copied and referenced messages (several segments) is still one sendmsg
    big = os.urandom(10000)
    for m in msgs[:8] + [big] + msgs[8:] + [bytearray(big)]:
        sb.add(m)
    n = 1024 + 20000
    assert sb.flush() == n
    assert sb.stats["syscalls"] == 2
    assert recv_exact(b, n) == b"".join(msgs[:8]) + big + b"".join(msgs[8:]) + big


def test_add_many_matches_add(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    items = [b"a" * 10, bytearray(b"b" * 3000), memoryview(b"c" * 20), b"", b"d" * 5000]
    assert sb.add_many(items) == 5
    assert sb.add_many(iter([b"e", b"f"])) == 2
    assert sb.add_many((b"g",)) == 1
    assert len(sb) == 7          # the empty message is not counted
    n = sb.flush()
    assert recv_exact(b, n) == b"a" * 10 + b"b" * 3000 + b"c" * 20 + b"d" * 5000 + b"efg"


def test_auto_flush_on_max_msgs(pair):
    a, b = pair
    sb = SendBatch(a, max_msgs=4)
    for i in range(3):
        sb.add(b"x" * 10)
    assert len(sb) == 3 and sb.stats["syscalls"] == 0
    sb.add(b"y" * 10)
    assert len(sb) == 0 and sb.pending_bytes == 0
    assert sb.stats["syscalls"] == 1
    assert recv_exact(b, 40) == b"x" * 30 + b"y" * 10
    # add_many flushes at each threshold: 10 messages with max_msgs=4 -> 2 flushes, 2 left
    sb.add_many([b"z"] * 10)
    assert sb.stats["syscalls"] == 3 and len(sb) == 2
    assert recv_exact(b, 8) == b"z" * 8


def test_auto_flush_on_max_bytes(pair):
    a, b = pair
    sb = SendBatch(a, max_msgs=1000, max_bytes=100)
    sb.add(b"a" * 40)
    sb.add(b"b" * 40)
    assert sb.pending_bytes == 80 and sb.stats["syscalls"] == 0
    sb.add(b"c" * 20)                      # exactly max_bytes
    assert sb.pending_bytes == 0 and sb.stats["syscalls"] == 1
    sb.add(b"d" * 500)                     # one message above the threshold goes at once
    assert sb.pending_bytes == 0 and sb.stats["syscalls"] == 2
    assert recv_exact(b, 600) == b"a" * 40 + b"b" * 40 + b"c" * 20 + b"d" * 500


def test_no_auto_flush(pair):
    a, b = pair
    sb = SendBatch(a, max_msgs=2, max_bytes=10, auto_flush=False)
    for _ in range(50):
        sb.add(b"0123456789")
    assert sb.stats["syscalls"] == 0 and len(sb) == 50 and sb.pending_bytes == 500
    assert sb.flush() == 500
    assert sb.flush() == 0                 # nothing pending: no syscall
    assert sb.stats["syscalls"] == 1
    assert recv_exact(b, 500) == b"0123456789" * 50


def test_clear_drops_pending(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    s = FakeSlot(b"S" * 100)
    sb.add(b"x" * 10)
    sb.add(b"y" * 9000)
    sb.add(s)
    assert s.refs == 2
    sb.clear()
    assert s.refs == 1 and s.log == ["retain", "release"]
    assert len(sb) == 0 and sb.pending_bytes == 0
    assert sb.flush() == 0
    assert recv_nowait(b) == b""
    sb.add(b"after")
    assert sb.flush() == 5 and recv_exact(b, 5) == b"after"
    assert sb.stats["messages"] == 1


def test_properties_and_repr(pair):
    a, _ = pair
    sb = SendBatch(a)
    assert (sb.max_msgs, sb.max_bytes, sb.auto_flush) == (16, 65536, True)
    assert sb.target is a
    assert set(sb.stats) >= {"syscalls", "messages", "bytes", "partial_writes"}
    assert "SendBatch" in repr(sb)
    sb2 = SendBatch(a.fileno(), 3, 7, False, copy_max=10)
    assert (sb2.max_msgs, sb2.max_bytes, sb2.auto_flush, sb2.copy_max) == (3, 7, False, 10)
    assert sb2.target == a.fileno()


# ---- slots (slot-like objects) ----------------------------------------------------------

@pytest.mark.parametrize("size", [100, 50000])
def test_slot_retained_until_sent_then_released(pair, size):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    s = FakeSlot(os.urandom(size), length=size - 10)
    sb.add(s)
    assert s.refs == 2 and s.log == ["retain"]
    s.release()                            # the caller's reference: the batch keeps the slot
    assert s.refs == 1
    assert sb.flush() == size - 10
    assert s.refs == 0 and s.log == ["retain", "release", "release"]  # no "refused"
    assert recv_exact(b, size - 10) == bytes(s[:size - 10])


def test_slot_kept_across_partial_writes(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    s = FakeSlot(os.urandom(3000))
    sb.add(b"head")
    sb.add(s)
    sb.add(b"tail")
    sb._write_limit = 1000
    got = bytearray()
    while sb.pending_bytes:
        n = sb.flush()
        got += recv_exact(b, n)
        if sb.pending_bytes > 4:           # the slot is still (partly) pending
            assert s.refs == 2
    assert s.refs == 1 and s.log == ["retain", "release"]
    assert bytes(got) == b"head" + bytes(s) + b"tail"
    assert sb.stats["partial_writes"] >= 3


def test_slot_released_on_dealloc(pair):
    a, _ = pair
    sb = SendBatch(a, auto_flush=False)
    s = FakeSlot(b"z" * 5000)
    sb.add(s)
    assert s.refs == 2
    del sb
    gc.collect()
    assert s.refs == 1 and s.log == ["retain", "release"]
    assert not s._exported()


def test_slot_bad_length_and_failed_retain(pair):
    a, _ = pair
    sb = SendBatch(a, auto_flush=False)
    s = FakeSlot(b"abc", length=4)
    with pytest.raises(ValueError):
        sb.add(s)
    s.length = 1.0
    with pytest.raises(TypeError):
        sb.add(s)
    s.length = 0                           # nothing to send: not retained
    sb.add(s)
    assert s.refs == 1 and len(sb) == 0
    s.length = 3
    s.refs = 0                             # "already returned": retain() raises
    with pytest.raises(AssertionError):
        sb.add(s)
    assert len(sb) == 0 and not s._exported()   # the export taken for add() was released


@pytest.mark.skipif(not hasattr(aoprim, "SlabPool"), reason="aoprim has no SlabPool")
def test_real_slot_returns_to_pool_after_send(pair):
    a, b = pair
    pool = aoprim.SlabPool(slot_size=4096, slots=4)
    sb = SendBatch(a, auto_flush=False)
    expect = b""
    for size in (10, 4000):
        s = pool.acquire()
        memoryview(s)[:size] = bytes([size % 251]) * size
        s.length = size
        sb.add(s)
        s.release()                        # only the batch holds it now
        expect += bytes([size % 251]) * size
    assert pool.available == 2
    assert sb.flush() == len(expect)
    assert pool.available == 4
    assert recv_exact(b, len(expect)) == expect
    s = pool.acquire()
    s.length = 100
    sb.add(s)
    s.release()
    sb.clear()
    assert pool.available == 4


# ---- caller mutation after add ----------------------------------------------------------

def test_small_writable_buffer_is_copied(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    ba = bytearray(b"a" * 100)
    sb.add(ba)
    ba[:] = b"b" * 100                     # later mutation is not seen
    ba += b"more"                          # and resizing is allowed (no export held)
    assert sb.flush() == 100
    assert recv_exact(b, 100) == b"a" * 100


def test_large_writable_buffer_is_referenced(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    n = sb.copy_max + 1000
    ba = bytearray(b"a" * n)
    sb.add(ba)
    with pytest.raises(BufferError):       # the held export forbids resizing while queued
        ba += b"x"
    ba[0:1] = b"Z"                         # in-place writes before the send ARE sent
    assert sb.flush() == n
    assert recv_exact(b, n) == b"Z" + b"a" * (n - 1)
    ba += b"x"                             # sent: the export is gone
    mv = memoryview(bytearray(n))
    sb.add(mv)
    with pytest.raises(BufferError):
        mv.release()                       # an exported memoryview cannot be released
    sb.clear()
    mv.release()


def test_non_contiguous_memoryview_is_copied(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    raw = bytes(range(256)) * 40
    mv = memoryview(raw)[::2]
    sb.add(mv)
    n = sb.flush()
    assert n == len(raw) // 2 and recv_exact(b, n) == raw[::2]


# ---- add_copy (aoprim extension): the caller may reuse its buffer at once ----------------

@pytest.mark.parametrize("extra", [0, 1000])
def test_add_copy_copies_writable_buffers_of_any_size(pair, extra):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    n = sb.copy_max + extra
    ba = bytearray(b"a" * n)
    assert sb.add_copy(ba) == n                # returns pending_bytes
    ba[0:1] = b"Z"                             # not seen: copied at add time
    ba += b"x"                                 # resizing allowed: no export held
    buf = bytearray(b"m" * n)
    mv = memoryview(buf)
    assert sb.add_copy(mv) == 2 * n
    mv.release()                               # releasable: not exported
    buf[:] = b"q" * n
    assert sb.pending_msgs == 2
    assert sb.flush() == 2 * n
    assert recv_exact(b, 2 * n) == b"a" * n + b"m" * n


def test_add_copy_keeps_bytes_by_reference_and_retains_a_slot(pair):
    import sys
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    big = os.urandom(sb.copy_max + 1)
    base = sys.getrefcount(big)
    sb.add_copy(big)
    assert sys.getrefcount(big) == base + 1    # immutable: referenced, not copied
    slot = FakeSlot(b"slot-data-" * 10, length=50)
    assert sb.add_copy(slot) == len(big) + 50
    assert slot.log == ["retain"]
    assert sb.flush() == len(big) + 50
    assert recv_exact(b, len(big) + 50) == big + bytes(slot[:50])
    assert slot.log == ["retain", "release"]
    assert sys.getrefcount(big) == base


def test_add_copy_odd_inputs(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    assert sb.add_copy(b"") == 0 and sb.add_copy(memoryview(b"")) == 0
    assert sb.pending_msgs == 0                # empty messages are ignored
    raw = bytes(range(256)) * 40
    assert sb.add_copy(memoryview(raw)[::2]) == len(raw) // 2     # non-contiguous: gathered
    arr = array.array("i", range(1000))        # any buffer: copied as bytes
    assert sb.add_copy(arr) == len(raw) // 2 + arr.itemsize * 1000
    for bad in ("text", 5, None, [b"x"]):
        with pytest.raises(TypeError):
            sb.add_copy(bad)
    n = sb.flush()
    assert recv_exact(b, n) == raw[::2] + arr.tobytes()


def test_add_copy_auto_flushes_like_add(pair):
    a, b = pair
    sb = SendBatch(a, max_msgs=4, auto_flush=True)
    for i in range(3):
        assert sb.add_copy(memoryview(b"%d" % i)) == i + 1
    assert sb.add_copy(bytearray(b"3")) == 0   # the 4th message reached max_msgs: flushed
    assert sb.stats["syscalls"] == 1 and recv_exact(b, 4) == b"0123"


@pytest.mark.parametrize("hs", [2, 4])
def test_add_frame_writes_header_and_payload_as_one_message(pair, hs):
    import struct
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    fmt = ">H" if hs == 2 else ">I"
    small = bytearray(b"abc")
    big = os.urandom(sb.copy_max + 10)
    slot = FakeSlot(b"slot-data-" * 10, length=30)
    p = sb.add_frame(small, hs)
    assert p == hs + 3 and sb.pending_msgs == 1       # header and payload: ONE message
    small[0:1] = b"Z"                                  # copied at add time
    sb.add_frame(memoryview(b""), hs)                  # an empty frame is its header
    sb.add_frame(big, hs)                              # large bytes: referenced after it
    sb.add_frame(slot, hs)                             # a Slot: retained, its length
    sb.add_frame(memoryview(bytes(range(200)))[::2], hs)   # non-contiguous: gathered
    assert slot.log == ["retain"]
    want = (struct.pack(fmt, 3) + b"abc" + struct.pack(fmt, 0) +
            struct.pack(fmt, len(big)) + big + struct.pack(fmt, 30) + bytes(slot[:30]) +
            struct.pack(fmt, 100) + bytes(range(200))[::2])
    assert sb.pending_bytes == len(want)
    assert sb.flush() == len(want)
    assert recv_exact(b, len(want)) == want
    assert slot.log == ["retain", "release"]


def test_add_frame_rejects_what_does_not_fit(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    with pytest.raises(ValueError, match="too long for u16"):
        sb.add_frame(b"x" * 65536, 2)
    assert sb.add_frame(b"x" * 65535, 2) == 65537
    for bad in (0, 1, 3, 8):
        with pytest.raises(ValueError):
            sb.add_frame(b"x", bad)
    for bad in (2.0, "2", None):
        with pytest.raises(TypeError):
            sb.add_frame(b"x", bad)
    with pytest.raises(TypeError):
        sb.add_frame("text", 2)
    assert sb.pending_msgs == 2 and sb.pending_bytes == 65537     # nothing else added
    sb.clear()


# ---- partial writes, would-block, EINTR -------------------------------------------------

def test_partial_writes_slow_reader_random_sizes():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.setblocking(False)
    rng = random.Random(5)
    n_msgs = scaled(150)
    sizes = [min(1 << 18, max(1, int(2 ** rng.uniform(0, 18)))) for _ in range(n_msgs)]
    sizes[:3] = [1, 1 << 18, 1]
    block = os.urandom(1 << 18)
    msgs = []
    for i, n in enumerate(sizes):
        off = rng.randrange(0, (1 << 18) - n + 1)
        m = block[off:off + n]
        msgs.append(m if i % 3 == 0 else bytearray(m) if i % 3 == 1 else FakeSlot(m))
    expect = b"".join(bytes(m) for m in msgs)
    got = bytearray()

    def reader():
        r = random.Random(7)
        while True:
            chunk = b.recv(r.choice([1, 100, 1000, 3000]))   # small reads: a slow peer
            if not chunk:
                return
            got.extend(chunk)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        sb = SendBatch(a, auto_flush=False)
        sent = 0
        for i, m in enumerate(msgs):
            sb.add(m)
            if i % 4 == 3:
                sent += sb.flush()
            while sb.pending_bytes > 300000:            # back-pressure
                select.select([], [a], [], 5)
                sent += sb.flush()
        while sb.pending_bytes:
            select.select([], [a], [], 5)
            sent += sb.flush()
        a.shutdown(socket.SHUT_WR)
        t.join(60)
        assert not t.is_alive()
    finally:
        a.close()
        b.close()
    assert sent == len(expect)
    assert bytes(got) == expect
    st = sb.stats
    assert st["partial_writes"] > 0 and st["would_block"] > 0
    assert st["messages"] == n_msgs and st["bytes"] == len(expect)
    for m in msgs:
        if isinstance(m, FakeSlot):
            assert m.refs == 1 and m.log == ["retain", "release"]


def test_would_block_keeps_everything():
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        try:                                            # fill the kernel's buffers
            while True:
                a.send(b"\0" * 65536)
        except BlockingIOError:
            pass
        sb = SendBatch(a, auto_flush=False)
        s = FakeSlot(b"s" * 10000)
        sb.add(b"m" * 100)
        sb.add(s)
        assert sb.flush() == 0
        assert sb.pending_bytes == 10100 and len(sb) == 2 and s.refs == 2
        assert sb.stats["would_block"] == 1 and sb.stats["bytes"] == 0
        sb.clear()
        assert s.refs == 1
    finally:
        a.close()
        b.close()


def test_eintr_is_retried_and_handler_exceptions_propagate():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are handled in the main thread only")
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    hits = []
    go = threading.Event()
    stop = threading.Event()
    raise_now = []
    got = bytearray()

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        if raise_now:
            raise_now.clear()              # raise once; later signals only count
            raise Interrupted("from handler")
        hits.append(signum)
        if len(hits) >= 3:
            go.set()                       # the reader starts only after 3 interruptions

    main = threading.main_thread().ident

    def kicker():                          # keep interrupting the main thread's blocked send
        while not stop.is_set():
            signal.pthread_kill(main, signal.SIGUSR1)
            stop.wait(0.005)

    def reader():
        go.wait(30)
        while True:
            chunk = b.recv(65536)
            if not chunk:
                return
            got.extend(chunk)

    kick = threading.Thread(target=kicker, daemon=True)
    read = threading.Thread(target=reader, daemon=True)
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        a.setblocking(False)
        try:                               # fill the buffers: the next send must block
            while True:
                a.send(b"\1" * 4096)
        except BlockingIOError:
            pass
        a.setblocking(True)
        sb = SendBatch(a, auto_flush=False)
        payload = os.urandom(200000)
        sb.add(payload)
        kick.start()
        # 1) a handler that raises: its exception propagates, nothing is lost
        with pytest.raises(Interrupted):
            raise_now.append(True)         # armed inside the block: any raise is caught
            sb.flush()
        # it came out of the blocked flush (a syscall was made), nothing was lost
        assert sb.stats["syscalls"] >= 1
        assert sb.pending_bytes == len(payload) and sb.stats["bytes"] == 0
        # 2) a handler that returns: the interrupted send is retried until data flows
        read.start()
        while sb.pending_bytes:
            sb.flush()
        assert len(hits) >= 3
        stop.set()
        kick.join(10)
        a.shutdown(socket.SHUT_WR)
        read.join(30)
        assert not read.is_alive()
    finally:
        stop.set()
        go.set()
        if kick.ident:
            kick.join(10)
        signal.signal(signal.SIGUSR1, old)
        a.close()
        if read.ident:
            read.join(10)
        b.close()
    assert bytes(got).endswith(payload)
    assert set(got[:len(got) - len(payload)]) <= {1}


def test_more_than_iov_max_segments(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    sb = SendBatch(a, auto_flush=False, copy_max=0)     # every message its own segment
    n = aoprim._sendbatch.IOV_MAX + 500
    msgs = [b"%06d" % i for i in range(n)]
    sb.add_many(msgs)
    assert sb.flush() == 6 * n
    assert sb.stats["syscalls"] == 2                    # 1024 segments, then the rest
    assert recv_exact(b, 6 * n) == b"".join(msgs)


def test_steady_state_does_not_grow(pair):
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    msgs = [b"x" * 64] * 16
    for _ in range(10):
        sb.add_many(msgs)
        sb.flush()
        recv_exact(b, 1024)
    cap = sb._capacity
    for _ in range(2000):
        sb.add_many(msgs)
        sb.flush()
        recv_exact(b, 1024)
    assert sb._capacity == cap
    # a permanent backlog with partial writes: the coalescing buffer is compacted, not grown
    sb._write_limit = 1000
    for _ in range(3000):
        sb.add_many(msgs[:15])
        n = sb.flush()
        recv_exact(b, n)
        if sb.pending_bytes > 20000:
            sb._write_limit = 0
            recv_exact(b, sb.flush())
            sb._write_limit = 1000
    assert sb._capacity[1] <= 4 * cap[1]


def _drain(sb, peer, expect):
    """Flush sb into the non-blocking socket until nothing is pending, reading the peer
    meanwhile; returns what the peer got (must be ``expect`` bytes long)."""
    got = bytearray()
    a = sb.target
    a.setblocking(False)
    peer.settimeout(10)
    try:
        while sb.pending_bytes or len(got) < expect:
            if sb.pending_bytes:
                sb.flush()
            if len(got) < expect:
                got += peer.recv(1 << 20)
    finally:
        peer.settimeout(None)
    assert len(got) == expect
    return bytes(got)


def test_drained_arrays_shrink_back(pair):
    # A backlog (a slow reader) grows the message-end array, the segment arrays and the
    # coalescing buffer to its peak; once drained, all three go back to their initial size
    # instead of pinning the peak until the batch is freed.
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    initial = sb._capacity
    a.setblocking(False)
    small = [b"%015d\n" % i for i in range(200_000)]      # 16 B each: copied, one segment
    big = [bytes([65 + i % 26]) * 3000 for i in range(3000)]   # by reference: a segment each
    sb.add_many(small)
    sb.add_many(big)
    sb.flush()                                              # a socketpair takes ~200 KB
    grown = sb._capacity
    assert grown[0] >= 3000 and grown[1] >= 16 * 200_000 and grown[2] >= 203_000
    data = _drain(sb, b, 16 * 200_000 + 3000 * 3000)
    assert data == b"".join(small) + b"".join(big)
    assert sb._capacity == initial
    # the same for a batch emptied by clear(), and by a FlushGroup's flush
    sb.add_many(small)
    sb.add_many(big)
    assert sb._capacity[2] >= 203_000
    sb.clear()
    assert sb._capacity == initial
    g = aoprim.FlushGroup()
    g.attach(sb, "owner")
    sb.add_many(small)
    assert sb._capacity[2] >= 200_000
    got = bytearray()
    b.settimeout(10)
    while sb.pending_bytes or len(got) < 16 * 200_000:
        r = g.flush()
        if r:
            g.requeue(sb)
        got += b.recv(1 << 20)
    b.settimeout(None)
    assert bytes(got) == b"".join(small)
    assert sb._capacity == initial
    g.detach(sb)


def test_messages_longer_than_2_gib_are_counted_once(pair):
    # a message's length takes one 4-byte entry up to 2**31 - 1 bytes, several beyond: it
    # is still ONE pending message until its last byte is written, however it is split
    import mmap
    a, _ = pair
    sb = SendBatch(a, auto_flush=False)
    big = 5 * (1 << 30) + 123                 # three entries; the pages are never touched
    try:
        m = mmap.mmap(-1, big)
    except (OSError, OverflowError, ValueError) as exc:
        pytest.skip(f"cannot map {big} bytes: {exc}")
    view = memoryview(m)
    try:
        sb.add(b"head")
        sb.add(view)                          # by reference
        sb.add(b"tail")
        assert (sb.pending_msgs, sb.pending_bytes) == (3, big + 8)
        # the big message's bytes: 2**31 - 1 (one entry), 1 (into the second), 2**31,
        # all but its last byte, its last byte; then the tail
        steps = [4, (1 << 31) - 1, 1, 1 << 31, big - (1 << 32) - 1, 1, 4]
        msgs_after = [2, 2, 2, 2, 2, 1, 0]
        for n, left in zip(steps, msgs_after):
            sb.consume(n)
            assert sb.pending_msgs == left, (n, left)
        assert sb.pending_bytes == 0 and sb.stats["messages"] == 3
        sb.add(view)
        sb.add(b"x")
        assert (sb.pending_msgs, sb.pending_bytes) == (2, big + 1)
    finally:
        sb.clear()                            # releases the export before the unmap
        view.release()
        m.close()


def test_drained_arrays_kept_below_keep_size(pair):
    # Hysteresis: a load that drains with fewer entries than the KEEP sizes keeps its grown
    # arrays from one drain to the next (no reallocation per flush).
    a, b = pair
    sb = SendBatch(a, auto_flush=False)
    msgs = [b"y" * 16] * 8000
    big = [b"z" * 4000] * 600
    sb.add_many(msgs)
    sb.add_many(big)
    _drain(sb, b, 16 * 8000 + 4000 * 600)
    cap = sb._capacity
    assert cap[0] >= 600 and cap[2] >= 8600            # grown, and kept once drained
    for _ in range(5):
        sb.add_many(msgs)
        sb.add_many(big)
        _drain(sb, b, 16 * 8000 + 4000 * 600)
        assert sb._capacity == cap


# ---- errors --------------------------------------------------------------------------------

def test_closed_peer_raises_and_keeps_pending():
    a, b = socket.socketpair()
    b.close()
    try:
        sb = SendBatch(a, auto_flush=False)
        s = FakeSlot(b"q" * 5000)
        sb.add(b"hello")
        sb.add(s)
        for _ in range(2):
            with pytest.raises(OSError) as ei:
                sb.flush()
            assert ei.value.errno in (errno.EPIPE, errno.ECONNRESET)
            assert sb.pending_bytes == 5005 and len(sb) == 2 and s.refs == 2
        st = sb.stats
        assert st["bytes"] == 0 and st["messages"] == 0 and st["syscalls"] == 2
        with pytest.raises(OSError):       # auto-flush errors come out of add()
            SendBatch(a, max_msgs=1).add(b"x")
        sb.clear()
        assert s.refs == 1
    finally:
        a.close()


def test_closed_peer_tcp():
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        c = socket.create_connection(srv.getsockname(), timeout=10)
        p, _ = srv.accept()
        p.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        p.close()                          # RST
        sb = SendBatch(c, auto_flush=False)
        errs = set()
        for _ in range(50):
            sb.add(b"x" * 100)
            before = sb.pending_bytes
            try:
                sb.flush()
            except OSError as e:
                errs.add(e.errno)
                assert sb.pending_bytes == before
                break
            select.select([c], [], [], 0.05)   # let the RST arrive
        assert errs and errs <= {errno.EPIPE, errno.ECONNRESET}
        c.close()
    finally:
        srv.close()


def _unused_fd():
    for fd in range(4000, 5000):
        try:
            os.fstat(fd)
        except OSError:
            return fd
    pytest.skip("no free fd number")


def test_closed_fd_raises_ebadf(pair):
    a, _ = pair
    sb = SendBatch(_unused_fd(), auto_flush=False)
    sb.add(b"x")
    with pytest.raises(OSError) as ei:
        sb.flush()
    assert ei.value.errno == errno.EBADF and sb.pending_bytes == 1
    c, d = socket.socketpair()
    sb = SendBatch(c, auto_flush=False)
    sb.add(b"y")
    c.close()
    d.close()
    with pytest.raises(OSError) as ei:
        sb.flush()
    assert ei.value.errno == errno.EBADF and len(sb) == 1
    with pytest.raises(OSError):
        SendBatch(c)


def test_pipe_target_uses_writev():
    r, w = os.pipe()
    try:
        sb = SendBatch(w, auto_flush=False)
        big = os.urandom(5000)
        sb.add_many([b"a" * 10, big, b"b" * 10])
        assert sb.flush() == 5020
        assert sb.stats["syscalls"] == 2                 # ENOTSOCK once, then writev
        sb.add(b"c")
        assert sb.flush() == 1
        assert sb.stats["syscalls"] == 3
        data = b""
        while len(data) < 5021:
            data += os.read(r, 10000)
        assert data == b"a" * 10 + big + b"b" * 10 + b"c"
        os.close(r)
        r = -1
        sb.add(b"d")
        with pytest.raises(OSError) as ei:
            sb.flush()
        assert ei.value.errno == errno.EPIPE and sb.pending_bytes == 1
    finally:
        if r >= 0:
            os.close(r)
        os.close(w)


def test_bad_types(pair):
    a, _ = pair
    sb = SendBatch(a, auto_flush=False)
    for bad in ["text", 5, None, 1.5, array.array("b", b"xy"), [b"x"], object()]:
        with pytest.raises(TypeError):
            sb.add(bad)
    assert len(sb) == 0 and sb.pending_bytes == 0
    with pytest.raises(TypeError):
        sb.add_many([b"ok", "bad", b"never"])
    assert len(sb) == 1 and sb.pending_bytes == 2       # items before the bad one stay
    with pytest.raises(TypeError):
        sb.add_many(5)
    released = memoryview(b"x")
    released.release()
    with pytest.raises(ValueError):
        sb.add(released)


def test_bad_constructor_arguments(pair):
    a, _ = pair
    for args, exc in [(("x",), TypeError), ((1.0,), TypeError), ((None,), TypeError),
                      ((True,), TypeError), ((-1,), ValueError),
                      ((a, 1.5), TypeError), ((a, 0), ValueError), ((a, "3"), TypeError),
                      ((a, 16, 0), ValueError), ((a, 16, 2.0), TypeError),
                      ((a, 16, 10, "yes"), TypeError)]:
        with pytest.raises(exc):
            SendBatch(*args)
    with pytest.raises(TypeError):
        SendBatch(a, copy_max=1.0)
    import ssl
    ctx = ssl.create_default_context()
    tls = ctx.wrap_socket(socket.socket(), do_handshake_on_connect=False,
                          server_hostname="x")
    with pytest.raises(TypeError):         # raw writes would bypass TLS
        SendBatch(tls)
    tls.close()
    with pytest.raises(ValueError):
        SendBatch(a, copy_max=-1)
    sb = SendBatch(a)
    with pytest.raises(TypeError):
        sb._write_limit = 1.5


def test_concurrent_use_is_refused_not_corrupting():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    try:
        sb = SendBatch(a, auto_flush=False)
        payload = os.urandom(1 << 20)
        sb.add(payload)
        errors = []

        def flusher():                     # a blocking flush: busy, GIL released
            try:
                while sb.pending_bytes:
                    sb.flush()
            except BaseException as e:     # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=flusher, daemon=True)
        t.start()
        refused = 0
        for _ in range(100000):
            try:
                sb.add(b"x")
            except RuntimeError:
                refused += 1
                break
        got = recv_exact(b, len(payload))
        t.join(30)
        assert not t.is_alive() and not errors
        assert refused == 1 and got == payload
    finally:
        a.close()
        b.close()


# ---- hypothesis: a model of the stream over random writes and partial-write limits ---------

message = st.tuples(st.integers(0, 6000), st.sampled_from(["b", "ba", "mv", "slot"]))
step = st.one_of(
    st.tuples(st.just("add"), message),
    st.tuples(st.just("flush"), st.integers(0, 9000)),   # write limit for that flush (0=none)
    st.tuples(st.just("many"), st.lists(message, max_size=6)),
)


@settings(max_examples=scaled(150), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(step, max_size=40), copy_max=st.sampled_from([0, 1, 64, 2048, 100000]),
       seed=st.integers(0, 2 ** 16))
def test_hypothesis_stream_model(ops, copy_max, seed):
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    a.setblocking(False)
    rng = random.Random(seed)
    try:
        sb = SendBatch(a, auto_flush=False, copy_max=copy_max)
        stream = bytearray()            # everything added, in order
        ends = []                       # stream offset where each non-empty message ends
        slots = []
        received = 0

        def make(n, kind):
            raw = rng.randbytes(n)
            if kind == "slot":
                s = FakeSlot(raw + b"#" * 7, length=n)
                slots.append((s, len(stream) + n))  # stream end of its bytes (added next)
                return s, raw
            return {"b": raw, "ba": bytearray(raw), "mv": memoryview(raw)}[kind], raw

        for op, arg in ops:
            if op == "flush":
                sb._write_limit = arg
                n = sb.flush()
                assert 0 <= n <= (arg or n)
                got = recv_exact(b, n)
                assert got == bytes(stream[received:received + n])
                received += n
            else:
                items = [arg] if op == "add" else arg
                objs = []
                for n, kind in items:
                    obj, raw = make(n, kind)
                    objs.append(obj)
                    stream += raw
                    if n:
                        ends.append(len(stream))
                if op == "add":
                    sb.add(objs[0])
                else:
                    assert sb.add_many(objs) == len(objs)
            assert sb.pending_bytes == len(stream) - received
            assert sb.pending_msgs == len(sb) == sum(1 for e in ends if e > received)
            for s, end in slots:        # retained exactly while some of it is unsent
                assert s.refs == (2 if s.length and end > received else 1)
        sb._write_limit = 0
        while sb.pending_bytes:
            n = sb.flush()
            assert n > 0
            assert recv_exact(b, n) == bytes(stream[received:received + n])
            received += n
        assert received == len(stream)
        st_ = sb.stats
        assert st_["bytes"] == len(stream) and st_["messages"] == len(ends)
        for s, _ in slots:
            assert s.refs == 1 and "refused" not in s.log
            assert s.log == ([] if s.length == 0 else ["retain", "release"])
    finally:
        a.close()
        b.close()


# ---- lifetimes: references, failing release(), uninitialised objects ---------------------

def test_bytes_reference_released_after_send_clear_and_dealloc(pair):
    import sys
    a, b = pair
    big = os.urandom(50000)
    base = sys.getrefcount(big)
    sb = SendBatch(a, auto_flush=False)
    sb.add(big)
    assert sys.getrefcount(big) == base + 1           # by reference
    assert sb.flush() == 50000
    assert sys.getrefcount(big) == base
    recv_exact(b, 50000)
    sb.add(big)
    sb.clear()
    assert sys.getrefcount(big) == base
    sb.add(big)
    small = os.urandom(100)
    sb.add(small)
    assert sys.getrefcount(small) == base             # copied: no reference kept
    del sb
    gc.collect()
    assert sys.getrefcount(big) == base


def test_failing_slot_release_is_reported_not_fatal(pair, monkeypatch):
    import sys
    a, b = pair
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))

    class Grumpy(FakeSlot):
        def release(self):
            super().release()
            raise ValueError("grumpy")

    s = Grumpy(b"g" * 3000)
    sb = SendBatch(a, auto_flush=False)
    sb.add(s)
    sb.add(b"after")
    assert sb.flush() == 3005                          # the batch carries on
    assert seen == [ValueError] and s.refs == 1 and not s._exported()
    assert recv_exact(b, 3005) == b"g" * 3000 + b"after"
    assert len(sb) == 0 and sb.stats["messages"] == 2


def test_uninitialised_and_reinitialised(pair):
    a, _ = pair
    sb = SendBatch.__new__(SendBatch)
    sb.add(b"x")
    with pytest.raises(OSError) as ei:
        sb.flush()
    assert ei.value.errno == errno.EBADF and len(sb) == 1
    sb.clear()
    sb = SendBatch(a)
    with pytest.raises(RuntimeError):
        sb.__init__(a)


# ---- a flush never writes to an fd number read before the GIL was re-taken -----------------

class _SwapOnRelease(FakeSlot):
    """A slot whose release (run by the batch, GIL held, between two system calls of one
    flush) closes the batch's socket and puts another socket on the same fd number."""

    def __init__(self, data, victim, intruder):
        super().__init__(data)
        self.victim, self.intruder = victim, intruder

    def release(self):
        super().release()
        if self.refs == 1:                       # the batch's reference: the bytes are sent
            fd = self.victim.fileno()
            self.victim.close()
            os.dup2(self.intruder.fileno(), fd)  # the number now names another socket
            self.reused = fd


def _stale_fd_setup():
    a, b = socket.socketpair()
    c, d = socket.socketpair()                   # c's fd is duplicated onto a's number
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    slot = _SwapOnRelease(b"S", a, c)
    sb = SendBatch(a, auto_flush=False, copy_max=0)      # every message its own segment
    sb.add(slot)
    n = aoprim._sendbatch.IOV_MAX + 100                  # two system calls' worth
    sb.add_many([bytes([65 + i % 26]) for i in range(n - 1)])
    return a, b, c, d, slot, sb, n


def test_flush_rereads_the_fd_after_releasing_sent_objects():
    a, b, c, d, slot, sb, n = _stale_fd_setup()
    try:
        with pytest.raises(OSError) as ei:
            sb.flush()          # syscall 1 sends 1024 segments; their release swaps the fd
        assert ei.value.errno == errno.EBADF
        assert slot.refs == 1 and slot.log == ["retain", "release"]
        assert recv_nowait(d) == b""                      # nothing reached the intruder
        assert len(recv_exact(b, aoprim._sendbatch.IOV_MAX)) == aoprim._sendbatch.IOV_MAX
        assert sb.pending_bytes == n - aoprim._sendbatch.IOV_MAX   # the rest kept, intact
        assert sb.stats["syscalls"] == 1
        sb.clear()
    finally:
        if slot.__dict__.get("reused") is not None:
            try:
                os.close(slot.reused)
            except OSError:
                pass    # the flush pinned `a`: its deferred close closed the number
        for s in (a, b, c, d):
            s.close()


def test_owner_thread_makes_add_copy_and_add_frame_refuse_other_threads():
    """owner_thread set: add_copy()/add_frame() from another thread add nothing and return -1
    (the server's sessions take their thread-safe path on it); from the owner they add; 0
    turns the check off.  add() is not affected."""
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, auto_flush=False)
        assert sb.owner_thread == 0
        sb.owner_thread = threading.get_ident()
        assert sb.add_copy(b"mine") == 4
        got = []

        def other():
            got.append(sb.add_copy(b"theirs"))
            got.append(sb.add_frame(b"theirs", 2))
            sb.add(b"+")                     # add() keeps its own rules
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert got == [-1, -1]
        assert sb.pending_bytes == 5
        assert sb.add_frame(b"ab", 2) == 9
        sb.owner_thread = 0
        got.clear()
        t = threading.Thread(target=lambda: got.append(sb.add_copy(b"x")))
        t.start()
        t.join(10)
        assert got == [10]
        sb.flush()
        assert b.recv(100) == b"mine+\x00\x02abx"
    finally:
        a.close()
        b.close()
