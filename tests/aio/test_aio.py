"""aoprim.aio: the loop's batched stream transports -- one sendmsg per transport per
iteration, asyncio's flow control and close semantics, partial writes, TLS, and that nothing
is kept after close / abort / reset / exception.

No sleeps stand for synchronisation: a loop iteration is deterministic (the flush runs at
the end of the iteration in which the writes were made, before run_until_complete returns),
and the peers are plain blocking sockets read with timeouts (or by a joined thread).
"""
import asyncio
import gc
import selectors
import signal
import socket
import subprocess
import time
import sys
import threading
import weakref

import pytest

import aoprim.aio  # noqa: E402
from aoprim.aio import SocketTransport  # noqa: E402

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def loop():
    yield from _checked_loop(aoprim.aio.new_event_loop())


@pytest.fixture(params=["own", "caller's"])
def any_selector_loop(request):
    """The loop with its own selector, and with one the caller passes (asyncio's
    ``SelectorEventLoop(selector)`` argument)."""
    sel = None if request.param == "own" else selectors.DefaultSelector()
    yield from _checked_loop(aoprim.aio.Loop(sel))


def _checked_loop(lp):
    # an assert that fails inside a loop callback reaches the loop's exception handler, not
    # the test: record every such report and fail the test with it at teardown (a test that
    # expects errors sets its own handler)
    unexpected = []
    lp.set_exception_handler(lambda _lp, ctx: unexpected.append(ctx))
    yield lp
    # every transport the test made is gone: the group holds no batch
    lp.run_until_complete(asyncio.sleep(0))
    assert len(lp._aio_group) == 0
    lp.close()
    assert not unexpected, [(c.get("message"), c.get("exception")) for c in unexpected]


class Rec(asyncio.Protocol):
    """Records every callback; ``lost`` resolves at connection_lost."""

    def __init__(self, loop, on_made=None, on_data=None):
        self.events = []
        self.data = bytearray()
        self.lost = loop.create_future()
        self.made = loop.create_future()
        self.on_made = on_made
        self.on_data = on_data
        self.sizes_at = {}
        self.transport = None

    def connection_made(self, tr):
        self.transport = tr
        self.events.append("made")
        if self.on_made:
            self.on_made(tr)
        self.made.set_result(tr)

    def data_received(self, data):
        assert type(data) is bytes
        self.data += data
        if self.on_data:
            self.on_data(self.transport, data)

    def eof_received(self):
        self.events.append("eof")

    def pause_writing(self):
        self.events.append("pause")
        self.sizes_at["pause"] = self.transport.get_write_buffer_size()

    def resume_writing(self):
        self.events.append("resume")
        self.sizes_at["resume"] = self.transport.get_write_buffer_size()

    def connection_lost(self, exc):
        self.events.append("lost")
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(exc)


def connect_pair(loop, proto, family=socket.AF_UNIX, sndbuf=None):
    """(transport, protocol, peer): a transport of aoprim's loop over one end of a connected
    pair; ``peer`` is the other end, a plain blocking socket with a timeout."""
    if family == socket.AF_UNIX:
        a, b = socket.socketpair()
        if sndbuf:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    else:
        # buffer sizes set before the connection exists (TCP fixes its window scale then)
        lsn = socket.socket()
        if sndbuf:
            lsn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
        lsn.bind(("127.0.0.1", 0))
        lsn.listen()
        a = socket.socket()
        if sndbuf:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        a.connect(lsn.getsockname())
        b, _ = lsn.accept()
        lsn.close()
    a.setblocking(False)
    b.settimeout(10)
    tr, pr = loop.run_until_complete(loop.create_connection(lambda: proto, sock=a))
    assert type(tr) is SocketTransport
    return tr, pr, b


def recv_exactly(sock, n):
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(1 << 20, n - len(out)))
        assert chunk, f"EOF after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def recv_all(sock):
    out = bytearray()
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return bytes(out)
        out += chunk


def frames(n, size=40):
    return [bytes([(i + k) & 0xFF for k in range(size)]) for i in range(n)]


# ---- the batching itself ------------------------------------------------------------------

@pytest.mark.parametrize("family", [socket.AF_UNIX, socket.AF_INET])
def test_n_writes_in_one_callback_leave_in_one_sendmsg(loop, family):
    msgs = frames(200)
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, family)
    before = tr.send_stats["syscalls"]
    fstats = loop.flush_stats()

    def burst():
        for m in msgs:
            tr.write(m)
        tr.writelines([b"x" * 10, bytearray(b"y" * 5000), memoryview(b"z" * 3)])
        assert tr._batch.pending_bytes == 200 * 40 + 5013      # batched, not yet sent
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert tr.send_stats["syscalls"] - before == 1
    assert loop.flush_stats()["flushes"] > fstats["flushes"]
    assert tr.get_write_buffer_size() == 0
    assert recv_exactly(peer, 200 * 40 + 5013) == b"".join(msgs) + b"x" * 10 + b"y" * 5000 + b"z" * 3
    tr.close()
    assert loop.run_until_complete(p.lost) is None
    peer.close()


def test_every_transport_written_in_one_iteration_is_flushed_once(loop):
    pairs = [connect_pair(loop, Rec(loop)) for _ in range(5)]
    before = loop.flush_stats()

    def burst():
        for tr, _, _ in pairs:
            for m in frames(20):
                tr.write(m)
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    after = loop.flush_stats()
    assert after["batches_flushed"] - before["batches_flushed"] == 5
    assert after["syscalls"] - before["syscalls"] == 5
    for tr, p, peer in pairs:
        assert recv_exactly(peer, 800) == b"".join(frames(20))
        tr.close()
        loop.run_until_complete(p.lost)
        peer.close()


def test_write_outside_the_loop_is_sent_before_it_selects(loop):
    """A write made while the loop is not running must not wait in the batch while the loop
    blocks in select() for the reply it should cause."""
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    tr.write(b"ping")                        # outside any callback

    def echo():
        peer.sendall(recv_exactly(peer, 4))
    t = threading.Thread(target=echo)
    t.start()
    while len(p.data) < 4:
        loop.run_until_complete(_one_read(loop, p))
    t.join()
    assert bytes(p.data) == b"ping"
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


async def _one_read(loop, p):
    fut = loop.create_future()
    old = p.on_data
    p.on_data = lambda tr, d: fut.done() or fut.set_result(None)
    try:
        await asyncio.wait_for(fut, 10)
    finally:
        p.on_data = old


def test_reads_are_bytes_from_the_loop_buffer(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    before = loop.read_stats()
    peer.sendall(b"a" * 1000)
    loop.run_until_complete(_one_read(loop, p))
    peer.sendall(b"b" * 10)
    loop.run_until_complete(_one_read(loop, p))
    assert bytes(p.data) == b"a" * 1000 + b"b" * 10    # Rec asserts each read is bytes
    after = loop.read_stats()
    assert after["reads"] - before["reads"] == 2       # both through the loop's buffer
    assert after["bytes"] - before["bytes"] == 1010
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_read_buffer_is_one_thread_at_a_time():
    from aoprim.aio._readbuf import ReadBuffer
    rb = ReadBuffer(64)
    a, b = socket.socketpair()
    a.setblocking(False)
    b.sendall(b"x" * 100)
    assert rb.recv_bytes(a) == b"x" * 64 and rb.recv_bytes(a) == b"x" * 36
    with pytest.raises(BlockingIOError):
        rb.recv_bytes(a)
    b.close()
    assert rb.recv_bytes(a) == b""
    a.close()
    with pytest.raises(OSError):
        rb.recv_bytes(a)
    assert rb.stats == {"reads": 3, "bytes": 100}
    with pytest.raises(ValueError):
        ReadBuffer(0)


# ---- large reads land in the buffer's pooled, resident bytes objects -----------------------

def _pool_max():
    from aoprim.aio._readbuf import POOL_MAX
    return POOL_MAX


# On a free-threaded build the pool is off: a pooled bytes object is reused when its
# reference count reads 1, and without the GIL that read does not prove another thread is
# not taking a reference at that moment.  The tests of the pool's reuse run where it is on;
# test_the_read_pool_is_off_without_the_gil proves it off where it is not.
needs_pool = pytest.mark.skipif(
    _pool_max() == 0, reason="the read pool is off on a free-threaded build (POOL_MAX == 0)")


def test_the_read_pool_is_off_without_the_gil():
    """POOL_MAX is 0 exactly on a free-threaded build; there, large reads are fresh bytes
    objects every time (none handed out as a slot, no slot created), and right."""
    import sysconfig
    from aoprim.aio._readbuf import ReadBuffer
    ft = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    assert (_pool_max() == 0) == ft
    rb = ReadBuffer(64)
    a, b = socket.socketpair()
    a.setblocking(False)
    got = []
    for i in range(4):
        b.sendall(bytes([65 + i]) * 40)             # >= size/4: a slot where the pool is on
        got.append(rb.recv_bytes(a))
    assert got == [bytes([65 + i]) * 40 for i in range(4)]
    if ft:
        assert rb.pool_stats == {"slots": 0, "free": 0, "handed_out": 0}
        assert len({id(g) for g in got}) == 4
    else:
        assert rb.pool_stats["handed_out"] == 4
    a.close()
    b.close()


@needs_pool
def test_large_reads_allocate_nothing_in_the_steady_state():
    """A read of at least size/4 bytes is handed out as a pooled slot: once the slot exists,
    reading (and dropping) large messages allocates no new memory for them (asyncio's
    recv() allocates one bytes object per read)."""
    import tracemalloc
    from aoprim.aio._readbuf import ReadBuffer
    rb = ReadBuffer(256 * 1024)
    a, b = socket.socketpair()
    a.setblocking(False)
    msg = bytes(range(256)) * 256                   # 64 KiB
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)

    def read_one():
        b.sendall(msg)
        got = rb.recv_bytes(a)
        assert got == msg
        return len(got)

    read_one()                                      # creates the slot
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        total = sum(read_one() for _ in range(50))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == 50 * len(msg)
    assert peak - base < len(msg) // 2, (base, peak)
    assert rb.pool_stats["slots"] == 1 and rb.pool_stats["handed_out"] == 51
    a.close()
    b.close()


@needs_pool
def test_pooled_reads_bytes_order_hash_and_held_slots():
    """Every read's bytes are right and stay right while held, whatever is read after
    them: a held slot is never reused, a dropped one is (its length and hash reset);
    small reads are copies; at most POOL_MAX slots exist, reads beyond them are copies."""
    from aoprim.aio._readbuf import ReadBuffer, POOL_MAX
    rb = ReadBuffer(64)                             # slots of 64 bytes, handed out from 16
    a, b = socket.socketpair()
    a.setblocking(False)

    def read(payload):
        b.sendall(payload)
        got = rb.recv_bytes(a)
        assert type(got) is bytes and got == payload
        return got

    x = read(b"x" * 40)
    assert hash(x) == hash(b"x" * 40)               # hash cached in the slot
    y = read(b"y" * 30)
    assert rb.pool_stats == {"slots": 2, "free": 0, "handed_out": 2}
    assert x == b"x" * 40                           # held: not overwritten by the 2nd read
    del x
    assert rb.pool_stats["free"] == 1
    z = read(b"z" * 64)                             # reuses x's slot, full length
    assert rb.pool_stats["slots"] == 2
    assert hash(z) == hash(b"z" * 64) and len(z) == 64 and z[-1:] == b"z"
    del z
    w = read(b"w" * 17)                             # reuses it again, shorter
    assert hash(w) == hash(b"w" * 17) and w + b"!" == b"w" * 17 + b"!"
    s = read(b"s" * 5)                              # small: a copy, the slot stays free
    assert rb.pool_stats["handed_out"] == 4
    held = [read(bytes([65 + i]) * (16 + i)) for i in range(POOL_MAX + 4)]
    assert rb.pool_stats["slots"] == POOL_MAX
    assert [h for h in held] == [bytes([65 + i]) * (16 + i) for i in range(POOL_MAX + 4)]
    assert y == b"y" * 30 and w == b"w" * 17 and s == b"sssss"
    del held, y, w
    assert rb.pool_stats["free"] == POOL_MAX
    b.close()
    assert rb.recv_bytes(a) == b""
    a.close()


@needs_pool
def test_a_64k_read_is_handed_out_whatever_the_buffer_size():
    """A read of 64 KiB is handed out as a pool slot also from a buffer larger than 256 KiB
    (the threshold is min(size // 4, 64 KiB), not size // 4): copied out of a 512 KiB
    buffer into a fresh bytes, it cost a malloc'd copy (and page faults once the heap is
    trimmed) on every read of a 64 KiB echo."""
    from aoprim.aio._readbuf import ReadBuffer
    assert ReadBuffer(64).handout_min == 16
    assert ReadBuffer(256 * 1024).handout_min == 65536
    assert ReadBuffer(4 << 20).handout_min == 65536
    rb = ReadBuffer(512 * 1024)
    a, b = socket.socketpair()
    a.setblocking(False)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    msg = bytes(range(256)) * 256                   # 64 KiB
    for _ in range(3):
        b.sendall(msg)
        got = rb.recv_bytes(a)
        assert got == msg
        del got
    assert rb.pool_stats == {"slots": 1, "free": 1, "handed_out": 3}
    small = msg[:65535]
    b.sendall(small)
    assert rb.recv_bytes(a) == small                # below the threshold: a copy
    assert rb.pool_stats["handed_out"] == 3
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_a_queued_1mib_message_is_two_reads(loop):
    """The loop reads at most READ_BUFFER_SIZE = 512 KiB per recv: a 1 MiB message already
    queued in the socket is two reads (and the echo two sends), not asyncio's four of
    256 KiB."""
    from aoprim.aio.loop import READ_BUFFER_SIZE
    assert READ_BUFFER_SIZE == 512 * 1024
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen()
    a = socket.socket()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)   # before connect: the window
    if a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < 3 << 20:
        lsn.close()
        a.close()
        pytest.skip("net.core.rmem_max below 3 MiB: 1 MiB cannot wait unread")
    a.connect(lsn.getsockname())
    b, _ = lsn.accept()
    lsn.close()
    b.settimeout(10)
    msg = bytes(range(256)) * 4096                  # 1 MiB
    b.sendall(msg)
    import fcntl
    import struct
    import termios
    deadline = time.monotonic() + 10
    while struct.unpack("i", fcntl.ioctl(a, termios.FIONREAD, b"\0" * 4))[0] < len(msg):
        assert time.monotonic() < deadline, "the 1 MiB never arrived"
        time.sleep(0.001)                           # polls the kernel's count (bounded)
    a.setblocking(False)
    p = Rec(loop)
    before = loop.read_stats()
    tr, _ = loop.run_until_complete(loop.create_connection(lambda: p, sock=a))

    async def until_all():
        while len(p.data) < len(msg):
            await _one_read(loop, p)
    loop.run_until_complete(asyncio.wait_for(until_all(), 10))
    after = loop.read_stats()
    assert bytes(p.data) == msg
    assert after["bytes"] - before["bytes"] == len(msg)
    assert after["reads"] - before["reads"] == 2
    tr.close()
    loop.run_until_complete(p.lost)
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep", [False, True])
def test_large_echo_all_bytes_in_order(loop, keep):
    """asyncio's echo protocol shape on aoprim's loop, 4 MiB each way in 1 MiB messages:
    every byte comes back in order, whether the protocol keeps each data_received bytes
    (holding pool slots) or passes it to write() and drops it."""
    kept = []
    done = loop.create_future()
    msgs = [bytes([i]) * 7 + bytes(range(256)) * 4096 + bytes([i]) * 9 for i in range(4)]
    total = sum(map(len, msgs))

    def on_data(tr, data):
        if keep:
            kept.append(data)
        tr.write(data)
        if len(p.data) >= total and not done.done():
            done.set_result(None)

    p = Rec(loop, on_data=on_data)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET)
    got = bytearray()

    def client():
        for m in msgs:
            peer.sendall(m)

    echoed = loop.create_future()

    def reader():
        try:
            while len(got) < total:
                chunk = peer.recv(1 << 20)
                if not chunk:
                    break
                got.extend(chunk)
        finally:
            loop.call_soon_threadsafe(echoed.set_result, None)

    ts = [threading.Thread(target=client), threading.Thread(target=reader)]
    for t in ts:
        t.start()

    loop.run_until_complete(asyncio.wait_for(done, 40))
    # the loop runs on until the peer has read everything: what the kernel did not take
    # yet is sent by the transport's writer, which only a running loop calls
    loop.run_until_complete(asyncio.wait_for(echoed, 40))
    for t in ts:
        t.join(40)
    assert bytes(got) == b"".join(msgs) == bytes(p.data)
    if keep:
        assert b"".join(kept) == b"".join(msgs)
    # large reads are handed out as pool slots where the pool is on (none without the GIL)
    assert (loop._aio_rbuf.pool_stats["handed_out"] >= 1) == (_pool_max() > 0)
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


# ---- flow control, partial writes ---------------------------------------------------------

def test_backpressure_pause_resume_at_limits_with_partial_writes(loop):
    """Tiny kernel buffers and a peer that does not read: the flush is partial, the writer
    takes over; pause_writing at the high-water mark, resume_writing at the low one, the
    bytes arrive whole and in order."""
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET, sndbuf=4096)
    tr.set_write_buffer_limits(high=64 * 1024, low=16 * 1024)
    assert tr.get_write_buffer_limits() == (16 * 1024, 64 * 1024)
    small = frames(1000, 100)                     # coalesced copies
    big = bytes(range(256)) * 2048                # 512 KiB, by reference
    expect = b"".join(small) + big + b"tail"

    def burst():
        for m in small:
            tr.write(m)
        tr.write(big)
        tr.write(b"tail")
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert p.events == ["made", "pause"]
    assert p.sizes_at["pause"] > 64 * 1024
    assert 0 < tr.get_write_buffer_size() < len(expect)    # the kernel took a part only
    st = tr.send_stats
    assert st["partial_writes"] + st["would_block"] >= 1
    got = []
    t = threading.Thread(target=lambda: got.append(recv_exactly(peer, len(expect))))
    t.start()
    resumed = loop.create_future()
    p.resume_writing = lambda: (Rec.resume_writing(p), resumed.set_result(None))
    loop.run_until_complete(asyncio.wait_for(resumed, 10))
    assert p.sizes_at["resume"] <= 16 * 1024
    while tr.get_write_buffer_size():
        loop.run_until_complete(asyncio.sleep(0))   # the writer drains the rest
    t.join(10)
    assert got == [expect]
    assert p.events == ["made", "pause", "resume"]
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_write_above_high_water_taken_whole_runs_no_python_of_the_transport(loop):
    """A bytes write above the high-water mark that the kernel takes whole (a large
    echo): sent inside write(), as asyncio's write() sends at once, by the compiled
    writer alone -- no pause; a write while the writer is registered (blocked) only pauses
    the protocol (the writer sends, in order)."""
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET)
    tr.set_write_buffer_limits(high=16 * 1024, low=4 * 1024)
    calls = []
    orig = tr._maybe_pause_protocol
    tr._maybe_pause_protocol = lambda: (calls.append(tr.get_write_buffer_size()), orig())
    big = bytes(range(256)) * 128                 # 32 KiB: above the mark, by reference
    sizes = []

    def once():
        tr.write(big)
        sizes.append(tr.get_write_buffer_size())
    loop.call_soon(once)
    loop.run_until_complete(asyncio.sleep(0))
    assert sizes == [0]                           # the kernel took it inside write()
    assert calls == []
    assert recv_exactly(peer, len(big)) == big
    assert p.events == ["made"]
    # blocked: the writer owns the batch; the protocol is paused, nothing is flushed out
    # of order
    tr._block()
    tr.write(big)
    assert calls == [len(big)]
    assert p.events == ["made", "pause"]
    assert tr.get_write_buffer_size() == len(big)
    loop.run_until_complete(asyncio.sleep(0))     # the writer sends it
    assert recv_exactly(peer, len(big)) == big
    while tr.get_write_buffer_size():
        loop.run_until_complete(asyncio.sleep(0))
    assert p.events == ["made", "pause", "resume"]
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_every_bytes_like_write_runs_no_python_of_the_transport(loop):
    """write() of a bytearray, a memoryview (contiguous or not), a subclass of bytes or of
    bytearray -- small, and SEND_NOW bytes large -- is the compiled writer's, as a bytes
    write is: while the kernel takes the data, no Python frame of aoprim/aio/transport.py
    runs (no block, no pause), and the peer gets every byte in order."""
    import aoprim.aio.transport as mod
    from aoprim.aio._aiowrite import SEND_NOW

    class BytesSub(bytes):
        pass

    class ByteArraySub(bytearray):
        pass

    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, sndbuf=4 << 20)
    tr.set_write_buffer_limits(high=4 << 20)
    items = [bytearray(b"a" * 100), memoryview(b"b" * 5000), BytesSub(b"c" * 300),
             ByteArraySub(b"d" * 70), memoryview(bytearray(b"e" * 64))[::2],
             bytearray(b"f" * SEND_NOW), memoryview(b"g" * SEND_NOW),
             BytesSub(b"h" * SEND_NOW), ByteArraySub(b"i" * SEND_NOW)]
    frames = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == mod.__file__:
            frames.append(frame.f_code.co_name)

    def once():
        sys.setprofile(prof)
        try:
            for item in items:
                tr.write(item)
        finally:
            sys.setprofile(None)
    loop.call_soon(once)
    loop.run_until_complete(asyncio.sleep(0))
    expect = b"".join(bytes(item) for item in items)
    got = recv_exactly(peer, len(expect))
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()
    assert got == expect
    assert frames == []
    assert p.events == ["made", "lost"]


def test_a_batch_of_64k_goes_to_the_kernel_at_once_whatever_the_high_water_mark(loop):
    """From aoprim.aio._aiowrite.SEND_NOW (64 KiB) pending bytes on, write() hands the batch to
    the kernel inside the call, below a high-water mark too (a large echo left
    for the iteration's end would be copied out of a cold cache); below it, batched.  The same
    for a write of bytes, of a bytearray and for writelines; in order."""
    from aoprim.aio._aiowrite import SEND_NOW
    assert SEND_NOW == 65536
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET)
    tr.set_write_buffer_limits(high=4 << 20)
    seen = []
    a, b = b"a" * 1000, b"b" * (SEND_NOW - 1001)
    c = bytearray(b"c" * SEND_NOW)
    d = [b"d" * 30000, b"e" * 40000]

    def burst():
        tr.write(a)
        tr.write(b)                              # SEND_NOW - 1 pending: batched
        seen.append(tr._batch.pending_bytes)
        tr.write(b"f")                           # SEND_NOW: to the kernel now
        seen.append(tr._batch.pending_bytes)
        tr.write(c)                              # a bytearray: by reference, sent now
        seen.append(tr._batch.pending_bytes)
        tr.writelines(d)
        seen.append(tr._batch.pending_bytes)
        tr.write(b"g" * 10)                      # small: batched again
        seen.append(tr._batch.pending_bytes)
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert seen == [SEND_NOW - 1, 0, 0, 0, 10]
    want = a + b + b"f" + bytes(c) + b"".join(d) + b"g" * 10
    assert recv_exactly(peer, len(want)) == want
    assert p.events == ["made"]                  # never paused
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_streams_drain_waits_for_resume(loop):
    async def main():
        a, b = socket.socketpair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.settimeout(10)
        r, w = await asyncio.open_connection(sock=a)
        assert type(w.transport) is SocketTransport
        payload = b"q" * (1 << 20)
        got = []
        t = threading.Thread(target=lambda: got.append(recv_exactly(b, len(payload))))
        t.start()
        w.write(payload)
        # above the high-water mark: handed to the kernel at once (as asyncio's write()
        # does); what it did not take is buffered
        assert 0 < w.transport.get_write_buffer_size() < len(payload)
        await w.drain()
        low, high = w.transport.get_write_buffer_limits()
        assert w.transport.get_write_buffer_size() <= low    # resumed at the low-water mark
        w.close()
        await w.wait_closed()
        await asyncio.get_running_loop().run_in_executor(None, t.join)
        b.close()
        return got
    assert loop.run_until_complete(main()) == [b"q" * (1 << 20)]


def test_set_write_buffer_limits_counts_what_the_kernel_has_not_taken(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)

    def burst():
        tr.write(b"a" * 10000)
        tr.set_write_buffer_limits(high=1000)    # pending 10000 > 1000: handed to the kernel
        assert p.events == ["made"]              # which takes it: no pause (as asyncio)
        assert tr.get_write_buffer_size() == 0
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert p.events == ["made"]
    assert recv_exactly(peer, 10000) == b"a" * 10000
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_write_is_compiled_and_follows_the_transports_state(loop):
    # write() runs without a Python frame (aoprim.aio._aiowrite.TransportWriter) and sees what
    # the transport changes: the high-water mark, then write_eof (asyncio's RuntimeError)
    import types
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    assert type(tr.write) is types.BuiltinMethodType
    tr.set_write_buffer_limits(high=100)
    assert tr._writer.high == 100

    def burst():
        tr.write(b"b" * 50)                      # below the mark: batched
        assert tr._batch.pending_bytes == 50     # batched
        SocketTransport.write(tr, b"c" * 60)     # through the class: the same path
        assert tr._batch.pending_bytes == 0      # above it: handed to the kernel at once
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert recv_exactly(peer, 110) == b"b" * 50 + b"c" * 60
    tr.write_eof()
    with pytest.raises(RuntimeError, match="write_eof"):
        tr.write(b"late")
    tr.close()
    loop.run_until_complete(p.lost)
    assert p.events == ["made", "lost"]
    peer.close()


def test_write_is_a_c_method_of_the_class_for_subclasses_keywords_and_bad_callers(loop):
    # write() is a method descriptor of SocketTransport itself (aoprim.aio._aiotransport's
    # make_write_method: no bound method in each instance's dict, so the interpreter's
    # specialised method call reaches its C function), reading the writer from the
    # `_writer` slot -- also for a subclass; asyncio's keyword spelling works; the
    # descriptor refuses any other object, so the slot is never read at a foreign offset
    import types

    class Sub(SocketTransport):
        pass

    assert type(vars(SocketTransport)["write"]) is types.MethodDescriptorType
    assert SocketTransport.write.__qualname__ == "SocketTransport.write"
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    assert "write" not in vars(tr)
    tr.write(data=b"kw")
    with pytest.raises(TypeError):
        tr.write(b"a", b"b")
    with pytest.raises(TypeError):
        tr.write(b"a", data=b"b")
    with pytest.raises(TypeError):
        tr.write(buf=b"a")
    with pytest.raises(TypeError):
        tr.write()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(10)
    p2 = Rec(loop)
    sub = Sub(loop, a, p2)
    loop.run_until_complete(p2.made)
    sub.write(b"sub")
    sub.write(bytearray(b"-slow"))              # not bytes: the same writer, the same batch
    SocketTransport.write(sub, b"!")
    loop.run_until_complete(asyncio.sleep(0))
    assert recv_exactly(peer, 2) == b"kw"
    assert recv_exactly(b, 9) == b"sub-slow!"
    with pytest.raises(TypeError):
        SocketTransport.write(object(), b"x")
    with pytest.raises(TypeError):
        SocketTransport.write(asyncio.Protocol(), b"x")
    for t in (tr, sub):
        t.close()
    loop.run_until_complete(asyncio.gather(p.lost, p2.lost))
    peer.close()
    b.close()


def test_get_write_buffer_size_from_another_thread_never_flushes_there(loop):
    # read from a monitoring thread while the loop thread is inside a callback that wrote:
    # the count as it is (nothing sent from that thread, no writer registered there, the
    # transport intact); the loop's own end-of-iteration flush then sends it
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    seen = []

    def monitor():
        seen.append((tr.get_write_buffer_size(), tr.send_stats["syscalls"]))

    def burst():
        before = tr.send_stats["syscalls"]
        tr.write(b"m" * 1000)
        t = threading.Thread(target=monitor)
        t.start()
        t.join(10)
        seen.append(before)
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    (size, syscalls), before = seen
    assert (size, syscalls - before) == (1000, 0)
    assert not tr.is_closing()
    assert recv_exactly(peer, 1000) == b"m" * 1000
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_writelines_type_error_writes_nothing(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    with pytest.raises(TypeError):
        tr.writelines([b"ok", "not bytes", b"ok"])
    with pytest.raises(TypeError):
        tr.write("text")
    assert tr.get_write_buffer_size() == 0
    tr.writelines(iter([b"a", bytearray(b"b"), memoryview(b"c")]))
    # the loop is not running: sent at once, as asyncio's write() sends them
    assert tr._batch.pending_bytes == 0
    tr.close()
    loop.run_until_complete(p.lost)
    assert recv_all(peer) == b"abc"
    peer.close()


# ---- close, abort, write_eof, errors ------------------------------------------------------

def test_close_flushes_everything_first(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET, sndbuf=4096)
    payload = bytes(range(256)) * 4096            # 1 MiB: far beyond the kernel buffers
    got = []

    def burst():
        tr.write(payload)
        tr.write(b"end")
        tr.close()
        assert tr.is_closing()
        assert tr.get_write_buffer_size() > 0    # not all accepted: the writer finishes it
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert "lost" not in p.events
    t = threading.Thread(target=lambda: got.append(recv_all(peer)))
    t.start()
    assert loop.run_until_complete(asyncio.wait_for(p.lost, 10)) is None
    t.join(10)
    assert got == [payload + b"end"]
    peer.close()


def test_abort_drops_pending_and_releases_it(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET, sndbuf=4096)
    big = b"\x01" * (4 << 20)
    base = sys.getrefcount(big)

    def burst():
        tr.write(big)                             # held by reference in the batch
        assert sys.getrefcount(big) == base + 1
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert tr.get_write_buffer_size() > 0
    tr.abort()
    assert tr.get_write_buffer_size() == 0
    assert sys.getrefcount(big) == base          # released at once
    assert loop.run_until_complete(p.lost) is None
    assert len(recv_all(peer)) < len(big)
    peer.close()


def test_abort_after_close_with_data_left_drops_it_once(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET, sndbuf=4096)
    big = b"\x04" * (4 << 20)
    base = sys.getrefcount(big)

    def burst():
        tr.write(big)
        tr.close()                               # the writer will finish it...
        tr.close()                               # (a second close is a no-op)
        assert tr.get_write_buffer_size() > 0
        tr.abort()                               # ...unless aborted: dropped at once
        assert tr.get_write_buffer_size() == 0
    loop.call_soon(burst)
    assert loop.run_until_complete(asyncio.wait_for(p.lost, 10)) is None
    assert p.events.count("lost") == 1
    assert sys.getrefcount(big) == base
    assert len(recv_all(peer)) < len(big)
    peer.close()


def test_write_eof_after_flush_then_still_reads(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    assert tr.can_write_eof()

    def burst():
        tr.write(b"last words")
        tr.write_eof()
        with pytest.raises(RuntimeError):
            tr.write(b"more")
    loop.call_soon(burst)
    loop.run_until_complete(asyncio.sleep(0))
    assert recv_all(peer) == b"last words"       # the data, then EOF
    peer.sendall(b"reply")
    loop.run_until_complete(_one_read(loop, p))
    assert bytes(p.data) == b"reply"
    peer.close()
    loop.run_until_complete(p.lost)


def test_write_error_is_fatal_and_releases(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    peer.close()
    big = b"\x02" * 100000
    base = sys.getrefcount(big)
    loop.call_soon(tr.write, big)
    exc = loop.run_until_complete(p.lost)
    assert isinstance(exc, (BrokenPipeError, ConnectionResetError)) or exc is None
    assert sys.getrefcount(big) == base
    assert tr.get_write_buffer_size() == 0
    tr.write(b"after")                           # counted and dropped, as asyncio does


def test_reset_by_peer_and_exception_in_protocol_leave_nothing(loop):
    # reset: the peer closes with RST while we hold unsent data
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET, sndbuf=4096)
    big = b"\x03" * (2 << 20)
    base = sys.getrefcount(big)
    loop.call_soon(tr.write, big)
    loop.run_until_complete(asyncio.sleep(0))
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    peer.close()
    loop.run_until_complete(asyncio.wait_for(p.lost, 10))
    assert sys.getrefcount(big) == base
    wr = weakref.ref(tr)
    del tr

    # an exception in data_received: a fatal error, the transport is closed
    def boom(tr, data):
        raise ValueError("protocol bug")
    q = Rec(loop, on_data=boom)
    errors = []
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx))
    tr2, _, peer2 = connect_pair(loop, q)
    loop.call_soon(tr2.write, big)
    peer2.sendall(b"x")
    exc = loop.run_until_complete(asyncio.wait_for(q.lost, 10))
    assert isinstance(exc, ValueError)
    assert [type(c["exception"]) for c in errors] == [ValueError]
    assert sys.getrefcount(big) == base
    peer2.close()
    assert tr2._batch.group is None              # out of the loop's FlushGroup
    assert tr2.get_write_buffer_size() == 0
    del tr2, p
    gc.collect()
    assert wr() is None                          # no cycle of ours keeps a transport alive


# ---- TLS, extra info, Unix sockets, entry points -------------------------------------------

def _tls_contexts():
    from test.test_asyncio import utils as test_utils
    return test_utils.simple_server_sslcontext(), test_utils.simple_client_sslcontext()


def test_tls_records_of_one_iteration_are_batched(loop):
    srv_ctx, cli_ctx = _tls_contexts()

    async def main():
        server_proto = []

        def factory():
            server_proto.append(Rec(loop))
            return server_proto[-1]
        server = await loop.create_server(factory, "127.0.0.1", 0, ssl=srv_ctx)
        port = server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=cli_ctx)
        await server_proto[0].made
        str_ = server_proto[0].transport
        before = loop.flush_stats()["syscalls"]
        for m in frames(100):
            str_.write(m)                        # 100 TLS records
        got = await asyncio.wait_for(r.readexactly(4000), 10)
        after = loop.flush_stats()["syscalls"]
        assert got == b"".join(frames(100))
        assert after - before == 1               # all the records in one sendmsg
        w.close()
        await w.wait_closed()
        await server_proto[0].lost
        server.close()
        await server.wait_closed()
    loop.run_until_complete(main())


def test_extra_info_as_asyncio(loop):
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_INET)
    assert tr.get_extra_info("peername") == peer.getsockname()
    assert tr.get_extra_info("sockname") == peer.getpeername()
    assert tr.get_extra_info("socket").fileno() >= 0
    assert tr.get_extra_info("nope", 7) == 7
    assert tr.get_protocol() is p
    tr.pause_reading()
    assert not tr.is_reading()
    tr.resume_reading()
    assert tr.is_reading()
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_unix_server_and_streams(loop, tmp_path):
    path = str(tmp_path / "s")

    async def handle(r, w):
        assert type(w.transport) is SocketTransport
        while line := await r.readline():
            for _ in range(3):
                w.write(line)
            await w.drain()
        w.close()

    async def main():
        server = await asyncio.start_unix_server(handle, path)
        r, w = await asyncio.open_unix_connection(path)
        w.write(b"hello\n")
        assert await r.readexactly(18) == b"hello\n" * 3
        w.write_eof()
        assert await r.read() == b""
        w.close()
        await w.wait_closed()
        server.close()
        await server.wait_closed()
    loop.run_until_complete(main())


def test_run_policy_install():
    async def main():
        return type(asyncio.get_running_loop())
    assert aoprim.aio.run(main()) is aoprim.aio.Loop
    old = asyncio.get_event_loop_policy()
    try:
        aoprim.aio.install()
        assert isinstance(asyncio.get_event_loop_policy(), aoprim.aio.EventLoopPolicy)
        lp = asyncio.new_event_loop()
        assert type(lp) is aoprim.aio.Loop
        assert isinstance(lp, asyncio.AbstractEventLoop)
        lp.close()
        assert asyncio.run(main()) is aoprim.aio.Loop
    finally:
        asyncio.set_event_loop_policy(old)


def test_an_unknown_python_version_imports_with_a_warning_a_known_one_silently():
    import subprocess
    for fake, warns in (("(3, 99, 0)", True), ("(3, 12, 5)", False), ("(3, 13, 1)", False),
                        ("(3, 11, 2)", False)):
        code = (f"import sys; sys.version_info = {fake}; "
                "import aoprim.aio")
        r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code],
                           capture_output=True, text=True, timeout=30)
        if warns:
            assert r.returncode != 0 and "RuntimeWarning" in r.stderr, r.stderr
            assert "tested on Python 3.11, 3.12, 3.13; this is 3.99" in r.stderr
        else:
            assert r.returncode == 0, r.stderr


# ---- writes, flushes and flow control, each against the behaviour of asyncio's own loop ----

class Producer(asyncio.Protocol):
    """The classic producer: writes chunks until pause_writing(), goes on in
    resume_writing(); ``done`` resolves once all ``n`` chunks were written."""

    def __init__(self, loop, n, chunk):
        self.n, self.chunk, self.sent = n, chunk, 0
        self.paused = False
        self.done = loop.create_future()
        self.lost = loop.create_future()

    def connection_made(self, tr):
        self.tr = tr
        self.produce()

    def produce(self):
        while self.sent < self.n and not self.paused:
            self.tr.write(self.chunk)
            self.sent += 1
        if self.sent == self.n and not self.done.done():
            self.done.set_result(None)

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        self.produce()

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)


def _reader_thread(sock, n):
    got = []
    t = threading.Thread(target=lambda: got.append(len(recv_exactly(sock, n))))
    t.start()
    return t, got


@pytest.mark.timeout(60)
def test_producer_writing_from_resume_writing_does_not_stall(loop):
    # a write from resume_writing() during a flush must not sit in the batch
    # while select() sleeps (asyncio: 40 x 70 kB in well under a second)
    chunk = b"p" * 70000
    pr = Producer(loop, 40, chunk)
    tr, _, peer = connect_pair(loop, pr, socket.AF_INET, sndbuf=65536)
    t, got = _reader_thread(peer, 40 * len(chunk))
    t0 = time.monotonic()
    loop.run_until_complete(asyncio.wait_for(pr.done, 30))
    while tr.get_write_buffer_size():
        loop.run_until_complete(asyncio.sleep(0.01))
    t.join(30)
    assert got == [40 * len(chunk)]
    assert time.monotonic() - t0 < 5
    tr.close()
    loop.run_until_complete(pr.lost)
    peer.close()


@pytest.mark.timeout(60)
def test_tls_producer_writing_from_resume_writing_does_not_stall(loop):
    srv_ctx, cli_ctx = _tls_contexts()
    chunk = b"t" * 70000
    total = 40 * len(chunk)

    async def main():
        prod = []
        got = loop.create_future()

        def factory():
            prod.append(Producer(loop, 40, chunk))
            return prod[-1]
        server = await loop.create_server(factory, "127.0.0.1", 0, ssl=srv_ctx)
        port = server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=cli_ctx)
        n = 0
        while n < total:
            data = await asyncio.wait_for(r.read(1 << 20), 10)
            assert data
            n += len(data)
        got.set_result(n)
        w.close()
        await w.wait_closed()
        server.close()
        await server.wait_closed()
        return await got
    t0 = time.monotonic()
    assert loop.run_until_complete(main()) == total
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("how", ["abort", "raise"])
def test_write_then_abort_or_fatal_error_delivers_the_write(loop, how):
    # asyncio's write() hands the bytes to the kernel before abort() / the fatal
    # error, so the peer gets them
    def on_data(tr, data):
        tr.write(b"ERR bad command\r\n")
        if how == "abort":
            tr.abort()
        else:
            raise ValueError("bad command")
    p = Rec(loop, on_data=on_data)
    loop.set_exception_handler(lambda lp, ctx: None)
    tr, _, peer = connect_pair(loop, p)
    peer.sendall(b"bogus")
    loop.run_until_complete(asyncio.wait_for(p.lost, 10))
    assert recv_all(peer) == b"ERR bad command\r\n"
    peer.close()


def test_abort_during_a_flush_notification_leaves_no_writer(loop):
    # a transport aborted by an earlier notification of the same flush gets no
    # writer registered; the next connection on the same fd number works
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_UNIX, sndbuf=4096)
    fd = tr.get_extra_info("socket").fileno()
    group = loop._aio_group
    orig = group.notify

    seen = []

    def notify(t, status):
        if t is tr and status > 0:
            seen.append(status)
            tr.abort()              # as another transport's notification might
        return orig(t, status)
    group.notify = notify
    try:
        # below the high-water mark (a write above it is sent at once and blocks without a
        # notification), more than the 4 KiB send buffer takes: the iteration's flush
        # leaves data and notifies with status 1
        assert len(b"z" * 60_000) < tr.get_write_buffer_limits()[1]
        loop.call_soon(tr.write, b"z" * 60_000)
        loop.run_until_complete(asyncio.wait_for(p.lost, 10))
    finally:
        group.notify = orig
    assert seen == [1]              # the flush-notification path ran
    assert loop._selector.get_map().get(fd) is None
    peer.close()
    q = Rec(loop)
    tr2, _, peer2 = connect_pair(loop, q)
    assert tr2.get_extra_info("socket").fileno() == fd     # the number is reused
    peer2.sendall(b"ping")
    while bytes(q.data) != b"ping":
        loop.run_until_complete(asyncio.sleep(0.01))
    tr2.write(b"pong")
    loop.run_until_complete(asyncio.sleep(0))
    assert recv_exactly(peer2, 4) == b"pong"
    tr2.close()
    loop.run_until_complete(q.lost)
    peer2.close()


def test_loop_close_delivers_pending_writes():
    # loop.close() flushes what the transports still hold, as asyncio's write() sent it at once
    lp = aoprim.aio.new_event_loop()
    p = Rec(lp)
    tr, _, peer = connect_pair(lp, p)
    tr.write(b"written before close")
    lp.close()
    assert recv_exactly(peer, 20) == b"written before close"
    tr._sock.close()                # the loop is closed: no connection_lost will run
    tr._sock = None
    peer.close()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_keyboardinterrupt_after_a_write_delivers_it(loop, exc):
    # the end-of-iteration flush runs when a callback raises out of the loop
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)

    def cb():
        tr.write(b"last words")
        raise exc()
    loop.call_soon(cb)
    with pytest.raises(exc):
        loop.run_forever()
    assert recv_exactly(peer, 10) == b"last words"
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_no_resume_writing_after_abort(loop):
    # asyncio: pause_writing, then connection_lost, never a resume
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p, socket.AF_UNIX, sndbuf=4096)

    def cb():
        tr.write(b"r" * (4 << 20))
        assert p.events == ["made", "pause"]
        tr.abort()
    loop.call_soon(cb)
    loop.run_until_complete(asyncio.wait_for(p.lost, 10))
    for _ in range(3):
        loop.run_until_complete(asyncio.sleep(0))
    assert p.events == ["made", "pause", "lost"]
    peer.close()


def test_socket_shutdown_after_write_does_not_overtake_it(loop):
    # get_extra_info("socket").shutdown(SHUT_WR) right after write()
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)

    def cb():
        tr.write(b"before shutdown")
        tr.get_extra_info("socket").shutdown(socket.SHUT_WR)
    loop.call_soon(cb)
    loop.run_until_complete(asyncio.sleep(0))
    assert recv_all(peer) == b"before shutdown"
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


@pytest.mark.timeout(60)
def test_high_water_zero_pauses_about_as_often_as_asyncio():
    # flow control counts what the kernel has not taken
    def run(lp):
        async def main():
            a, b = socket.socketpair()
            b.settimeout(10)
            r, w = await asyncio.open_connection(sock=a)
            proto = w.transport.get_protocol()
            pauses = [0]
            orig = proto.pause_writing

            def counting():
                pauses[0] += 1
                orig()
            proto.pause_writing = counting
            w.transport.set_write_buffer_limits(high=0)
            n = 5000
            t, got = _reader_thread(b, n * 100)
            for _ in range(n):
                w.write(b"x" * 100)
                await w.drain()
            await lp.run_in_executor(None, t.join)
            assert got == [n * 100]
            w.close()
            await w.wait_closed()
            b.close()
            return pauses[0]
        try:
            return lp.run_until_complete(main())
        finally:
            lp.close()
    base = run(asyncio.SelectorEventLoop())
    ours = run(aoprim.aio.new_event_loop())
    assert ours <= 10 * max(base, 1), (ours, base)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["signal", "thread"])
def test_write_while_the_loop_sleeps_wakes_it(any_selector_loop, source):
    # a write from a signal.signal handler or another thread while the loop
    # sleeps in select() is delivered at once (asyncio sends it from write()), whoever
    # made the loop's selector
    loop = any_selector_loop
    p = Rec(loop)
    tr, _, peer = connect_pair(loop, p)
    arrived = loop.create_future()
    stamps = {}

    def reader():
        data = peer.recv(100)
        stamps["recv"] = time.monotonic()
        loop.call_soon_threadsafe(arrived.set_result, data)
    t = threading.Thread(target=reader)
    t.start()

    def do_write(*_):
        stamps["write"] = time.monotonic()
        tr.write(b"wake")
    if source == "signal":
        old = signal.signal(signal.SIGALRM, do_write)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
    else:
        threading.Timer(0.1, do_write).start()
    try:
        assert loop.run_until_complete(asyncio.wait_for(arrived, 10)) == b"wake"
    finally:
        if source == "signal":
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    t.join(10)
    assert stamps["recv"] - stamps["write"] < 0.2
    tr.close()
    loop.run_until_complete(p.lost)
    peer.close()


def test_nest_asyncio_style_patching_is_refused(loop, tmp_path):
    # nest_asyncio replaces _run_once on the loop's class (no flush would ever
    # run again); refused with uvloop's message
    with pytest.raises(ValueError, match="Can't patch loop of type"):
        type(loop)._run_once = lambda self: None
    assert type(loop)._run_once is aoprim.aio.Loop.__dict__["_run_once"]
    pytest.importorskip("nest_asyncio")
    # nest_asyncio.apply() patches asyncio itself (asyncio.run, get_event_loop, Task) before
    # it reaches the loop, for the whole process: run it in a child so no later test meets a
    # patched asyncio
    code = (
        "import nest_asyncio, aoprim.aio\n"
        "loop = aoprim.aio.new_event_loop()\n"
        "try:\n"
        "    nest_asyncio.apply(loop)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
        "finally:\n"
        "    loop.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)   # (not the checkout: no shadowing)
    assert out.returncode == 0, out.stderr
    assert "refused: Can't patch loop of type" in out.stdout, out.stdout + out.stderr


def test_run_sets_the_policys_current_loop_like_asyncio_run():
    # aoprim.aio.run() makes its loop the policy's current loop while main() runs, as
    # asyncio.run() does (get_event_loop() inside a coroutine is the running loop)
    async def main():
        return asyncio.get_event_loop_policy().get_event_loop() is asyncio.get_running_loop()
    assert asyncio.run(main()) is True
    assert aoprim.aio.run(main()) is True
    assert asyncio.run(main()) is True
