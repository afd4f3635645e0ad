"""Receiver / RxArena: the compiled receive path, driven over real sockets by calling
on_readable() directly (no event loop).  Every test counts pool slots at the end: the idle
value is 1 (the arena's scratch) and 0 once the arena is closed."""
import errno
import gc
import pickle
import select
import socket
import struct
import sys
import threading
import time
import warnings
import weakref

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from aoprim import SlabPool
from aoprim.server._receiver import RX_EOF, RX_ERROR, RX_HANDLER, RX_TOO_LARGE, Receiver
from aoprim.server._rxbuf import RxArena
from aoprim.server.framing import FrameDecoder, FrameTooLarge
from support import skip_nomemory_on_free_threaded

KIND = {0: "raw", 2: "u16", 4: "u32"}


def enc(hs, payload):
    if hs == 0:
        return bytes(payload)
    return (struct.pack(">H", len(payload)) if hs == 2 else
            struct.pack(">I", len(payload))) + bytes(payload)


class Rig:
    """A socketpair (read side non-blocking), a pool, an arena and one receiver whose owner
    is the rig itself (a session<->receiver cycle, as in the server)."""

    def __init__(self, hs=2, max_frame=65536, slot_size=256, slots=8, copy=False,
                 on_frame=None, pool=None, arena=None, max_reads=1):
        self.pool = pool if pool is not None else SlabPool(slot_size, slots)
        self.arena = arena if arena is not None else RxArena(self.pool)
        self.r, self.w = socket.socketpair()
        self.r.setblocking(False)
        self.frames = []
        self.events = []
        self.rx = Receiver(self.arena, self.r.fileno(), hs, max_frame,
                           on_frame or self.on_frame, self.on_event, self, copy,
                           max_reads=max_reads)

    def on_frame(self, owner, data):
        assert owner is self
        self.frames.append(bytes(data))

    def on_event(self, owner, code, arg):
        assert owner is self
        self.events.append((code, arg))

    def send(self, data):
        self.w.sendall(data)

    def pump(self, limit=100000):
        """on_readable() until a call reads nothing (and nothing is pending)."""
        rx = self.rx
        for _ in range(limit):
            before = rx.reads
            n_ev = len(self.events)
            rx.on_readable()
            if rx.reads == before and not rx.pending or len(self.events) != n_ev:
                return
        raise AssertionError("pump did not settle")

    def close(self):
        self.rx.close()
        self.r.close()
        self.w.close()
        assert self.pool.in_use == 1, "a receive slot leaked"
        self.arena.close()
        assert self.pool.in_use == 0, "the scratch leaked"


@pytest.fixture
def rigs():
    made = []

    def make(**kw):
        r = Rig(**kw)
        made.append(r)
        return r
    yield make
    for r in made:
        if not r.rx.closed or not r.arena.closed:
            r.close()
        r.r.close()                     # a test that closed rx and arena itself: the sockets
        r.w.close()


def tcp_pair():
    lst = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(lst.getsockname())
    s, _ = lst.accept()
    lst.close()
    return s, c


def test_public_names():
    from aoprim.server import _receiver, _rxbuf
    for name in ("Receiver", "RX_EOF", "RX_ERROR", "RX_TOO_LARGE", "RX_HANDLER"):
        assert getattr(_receiver, name) is not None
    assert _rxbuf.RxArena is RxArena
    assert len({RX_EOF, RX_ERROR, RX_TOO_LARGE, RX_HANDLER}) == 4


# ---- framing ------------------------------------------------------------------------------

@pytest.mark.parametrize("hs", [2, 4], ids=["u16", "u32"])
def test_many_frames_in_one_read(rigs, hs):
    g = rigs(hs=hs, slot_size=4096)
    payloads = [bytes([i]) * i for i in range(40)]
    g.send(b"".join(enc(hs, p) for p in payloads))
    g.rx.on_readable()
    assert g.frames == payloads
    assert g.rx.reads == 1 and g.rx.frames_in == 40
    assert g.rx.buffered == 0 and not g.rx.holds_slot
    assert g.pool.in_use == 1
    g.close()


@pytest.mark.parametrize("hs", [2, 4], ids=["u16", "u32"])
def test_one_frame_byte_by_byte(rigs, hs):
    g = rigs(hs=hs, slot_size=64)
    payloads = [b"hello world", b"", b"x" * 50, b"y" * 200]   # 200: larger than a slot
    stream = b"".join(enc(hs, p) for p in payloads)
    for i, byte in enumerate(stream):
        g.send(bytes([byte]))
        g.rx.on_readable()
        assert g.rx.reads == i + 1
    assert g.frames == payloads
    assert g.rx.buffered == 0 and not g.rx.holds_slot and g.pool.in_use == 1
    g.close()


def test_unfinished_frame_holds_a_slot(rigs):
    g = rigs(hs=2, slot_size=64)
    g.send(enc(2, b"abc") + enc(2, b"0123456789")[:5])
    g.rx.on_readable()
    assert g.frames == [b"abc"]
    assert g.rx.buffered == 5 and g.rx.holds_slot and g.pool.in_use == 2
    g.send(enc(2, b"0123456789")[5:])
    g.rx.on_readable()
    assert g.frames == [b"abc", b"0123456789"]
    assert g.rx.buffered == 0 and not g.rx.holds_slot and g.pool.in_use == 1
    g.close()


def test_raw_chunks_are_frames(rigs):
    g = rigs(hs=0, slot_size=64)
    g.send(b"hello")
    g.rx.on_readable()
    g.send(b"x" * 150)              # more than a slot: cut into slot-size reads
    g.pump()
    assert g.frames[0] == b"hello"
    assert b"".join(g.frames[1:]) == b"x" * 150
    assert [len(f) for f in g.frames[1:]] == [64, 64, 22]
    assert not g.rx.holds_slot and g.pool.in_use == 1
    g.close()


def test_raw_byte_by_byte(rigs):
    g = rigs(hs=0, slot_size=64)
    for b in b"abc":
        g.send(bytes([b]))
        g.rx.on_readable()
    assert g.frames == [b"a", b"b", b"c"]
    g.close()


@pytest.mark.parametrize("hs", [2, 4], ids=["u16", "u32"])
def test_zero_length_frames(rigs, hs):
    g = rigs(hs=hs)
    g.send(enc(hs, b"") * 5 + enc(hs, b"a") + enc(hs, b""))
    g.rx.on_readable()
    assert g.frames == [b""] * 5 + [b"a", b""]
    g.close()


@pytest.mark.parametrize("hs", [2, 4], ids=["u16", "u32"])
def test_exactly_max_frame(rigs, hs):
    g = rigs(hs=hs, max_frame=100)
    g.send(enc(hs, b"m" * 100))
    g.pump()
    assert g.frames == [b"m" * 100] and g.events == []
    g.close()


@pytest.mark.parametrize("hs", [2, 4], ids=["u16", "u32"])
def test_max_frame_plus_one(rigs, hs):
    g = rigs(hs=hs, max_frame=100)
    idle = g.pool.in_use
    g.send(enc(hs, b"a") + enc(hs, b"b") + enc(hs, b"z" * 101) + enc(hs, b"late"))
    g.rx.on_readable()
    assert g.frames == [b"a", b"b"]
    assert g.events == [(RX_TOO_LARGE, 101)]
    assert g.pool.in_use == idle and g.rx.buffered == 0   # nothing reserved for it
    g.send(enc(hs, b"more"))
    g.rx.on_readable()                  # the stream lost its framing: nothing more
    assert g.frames == [b"a", b"b"] and len(g.events) == 1
    g.close()


def test_too_large_header_completed_in_own_slot(rigs):
    g = rigs(hs=4, max_frame=100, slot_size=64)
    g.send(enc(4, b"ok") + b"\x00\x00")
    g.rx.on_readable()
    assert g.rx.holds_slot and g.pool.in_use == 2
    g.send(b"\x01\x00")                 # 256 > max_frame
    g.rx.on_readable()
    assert g.frames == [b"ok"] and g.events == [(RX_TOO_LARGE, 256)]
    assert not g.rx.holds_slot and g.pool.in_use == 1
    g.close()


def test_u16_max_header(rigs):
    g = rigs(hs=2, max_frame=0xFFFF, slot_size=256)
    big = bytes(range(256)) * 255 + b"q" * 255
    assert len(big) == 0xFFFF
    g.send(b"\xff\xff" + big)
    g.pump()
    assert g.frames == [big] and g.events == []
    g.close()


def test_u32_max_header(rigs):
    g = rigs(hs=4, max_frame=65536)
    g.send(enc(4, b"first") + b"\xff\xff\xff\xff" + b"junk")
    g.rx.on_readable()
    assert g.frames == [b"first"]
    assert g.events == [(RX_TOO_LARGE, 0xFFFFFFFF)]
    assert g.pool.in_use == 1
    g.close()


@pytest.mark.parametrize("hs", [2, 4], ids=["u16", "u32"])
def test_frame_larger_than_a_slot(rigs, hs):
    g = rigs(hs=hs, slot_size=64)
    big = bytes(range(256)) * 4
    g.send(enc(hs, b"a") + enc(hs, big) + enc(hs, b"after"))
    g.rx.on_readable()                  # one slot-size read: "a" and the big frame's start
    assert g.frames == [b"a"]
    assert 0 < g.rx.buffered < 64 and not g.rx.holds_slot   # a heap buffer of its size
    assert g.pool.in_use == 1
    while len(g.frames) < 2:
        g.rx.on_readable()
    # reads into the big buffer ask only for the bytes still needed: "after" was not read
    assert g.frames == [b"a", big] and g.rx.buffered == 0
    g.rx.on_readable()
    assert g.frames == [b"a", big, b"after"]
    assert g.pool.in_use == 1 and g.arena.fallbacks == 0
    g.close()


def test_header_larger_than_slot(rigs):
    # a 2-byte slot cannot hold a u32 header: exact heap buffers all the way
    g = rigs(hs=4, slot_size=2)
    g.send(enc(4, b"abcdef") + enc(4, b""))
    g.pump()
    assert g.frames == [b"abcdef", b""]
    g.close()


# ---- events -------------------------------------------------------------------------------

@pytest.mark.parametrize("hs", [0, 2, 4])
@pytest.mark.parametrize("copy", [False, True])
def test_exception_raised_after_close_in_on_frame_still_reaches_on_event(rigs, hs, copy):
    """on_frame closes the receiver (the session's close()/abort()) and then raises: the
    exception still goes to on_event as RX_HANDLER, with the owner -- the server logs and
    counts it -- and no further frame is delivered."""
    seen = []

    def on_frame(owner, data):
        seen.append(bytes(data))
        owner.rx.close()
        raise ValueError("after close")

    g = rigs(hs=hs, copy=copy, on_frame=on_frame)
    g.send(enc(hs, b"first") + enc(hs, b"second") if hs else b"first")
    g.rx.on_readable()
    assert seen == [b"first"]
    assert len(g.events) == 1
    code, exc = g.events[0]
    assert code == RX_HANDLER and isinstance(exc, ValueError) and str(exc) == "after close"
    g.rx.on_readable()
    assert seen == [b"first"] and len(g.events) == 1
    g.close()


def test_eof(rigs):
    g = rigs(hs=2)
    g.send(enc(2, b"bye"))
    g.w.shutdown(socket.SHUT_WR)
    g.rx.on_readable()
    g.rx.on_readable()
    assert g.frames == [b"bye"] and g.events == [(RX_EOF, 0)]
    g.close()


def test_eof_mid_frame_then_close_returns_the_slot(rigs):
    g = rigs(hs=2)
    g.send(enc(2, b"0123456789")[:6])
    g.rx.on_readable()
    assert g.rx.holds_slot and g.pool.in_use == 2
    g.w.close()
    g.rx.on_readable()
    assert g.events == [(RX_EOF, 0)] and g.frames == []
    g.close()


def test_would_block_is_quiet(rigs):
    g = rigs(hs=2)
    g.rx.on_readable()
    assert g.events == [] and g.rx.reads == 0
    g.close()


def test_econnreset_mid_frame():
    pool = SlabPool(256, 4)
    arena = RxArena(pool)
    s, c = tcp_pair()
    s.setblocking(False)
    events, frames = [], []
    rx = Receiver(arena, s.fileno(), 2, 65536, lambda o, d: frames.append(bytes(d)),
                  lambda o, code, arg: events.append((code, arg)), None)
    try:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.sendall(enc(2, b"one") + enc(2, b"x" * 100)[:40])
        deadline = time.monotonic() + 5
        while rx.buffered != 40 and time.monotonic() < deadline:
            select.select([s], [], [], 0.1)
            rx.on_readable()
        assert frames == [b"one"] and rx.holds_slot and pool.in_use == 2
        c.close()                       # SO_LINGER 0: RST
        while not events and time.monotonic() < deadline:
            select.select([s], [], [], 0.1)
            rx.on_readable()
        assert events == [(RX_ERROR, errno.ECONNRESET)]
        rx.close()
        assert pool.in_use == 1
        arena.close()
        assert pool.in_use == 0
    finally:
        s.close()


def test_recv_error_bad_fd():
    pool = SlabPool(64, 2)
    arena = RxArena(pool)
    a, b = socket.socketpair()
    fd = a.fileno()
    events = []
    rx = Receiver(arena, fd, 2, 100, lambda o, d: None,
                  lambda o, code, arg: events.append((code, arg)), None)
    a.close()
    b.close()
    rx.on_readable()
    assert events == [(RX_ERROR, errno.EBADF)]
    rx.close()
    arena.close()
    assert pool.in_use == 0


# ---- against the reference decoder --------------------------------------------------------

def _split(data, cuts):
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for c in cuts + [len(data)]:
        if c > prev:
            out.append(data[prev:c])
            prev = c
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(hs=st.sampled_from([2, 4]),
       payloads=st.lists(st.binary(max_size=300), max_size=25),
       cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=12),
       slot_size=st.sampled_from([3, 16, 64, 1024]),
       slots=st.sampled_from([1, 2, 8]))
def test_matches_reference_decoder(hs, payloads, cuts, slot_size, slots):
    stream = b"".join(enc(hs, p) for p in payloads)
    g = Rig(hs=hs, max_frame=300, slot_size=slot_size, slots=slots)
    try:
        ref = FrameDecoder(KIND[hs], max_frame=300)
        expect = []
        for chunk in _split(stream, cuts):
            expect += ref.feed(chunk)
            g.send(chunk)
            g.pump()
        assert g.frames == expect == payloads
        assert g.events == []
        assert g.rx.buffered == 0 and not g.rx.holds_slot
    finally:
        g.close()


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(hs=st.sampled_from([2, 4]),
       before=st.lists(st.binary(max_size=80), max_size=10),
       bad=st.integers(min_value=101, max_value=0xFFFF),
       cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=8),
       slot_size=st.sampled_from([5, 32, 512]))
def test_too_large_matches_reference_decoder(hs, before, bad, cuts, slot_size):
    stream = (b"".join(enc(hs, p) for p in before) +
              (struct.pack(">H", bad) if hs == 2 else struct.pack(">I", bad)) + b"tail" * 3)
    g = Rig(hs=hs, max_frame=100, slot_size=slot_size, slots=4)
    try:
        ref = FrameDecoder(KIND[hs], max_frame=100)
        expect, err = [], None
        for chunk in _split(stream, cuts):
            try:
                expect += ref.feed(chunk)
            except FrameTooLarge as e:
                if err is None:
                    expect += e.frames
                err = e
            g.send(chunk)
            g.pump()
        assert err is not None and err.length == bad
        assert g.frames == expect == before
        assert g.events == [(RX_TOO_LARGE, bad)]
        assert g.rx.buffered == 0 and g.pool.in_use == 1
    finally:
        g.close()


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(hs=st.sampled_from([2, 4]),
       payloads=st.lists(st.binary(min_size=1, max_size=120), min_size=1, max_size=30),
       keep=st.lists(st.booleans(), min_size=30, max_size=30),
       cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=12),
       slot_size=st.sampled_from([8, 48, 256]),
       slots=st.sampled_from([1, 3, 16]))
def test_kept_views_never_see_rewritten_memory(hs, payloads, keep, cuts, slot_size, slots):
    """Handlers keep sub-views of random frames while the stream goes on (frames split
    anywhere, unfinished tails moved, scratch reused, pool exhausted or not): every kept
    view still shows its frame's bytes at the end, and dropping them returns every slot."""
    kept = []
    count = [0]

    def on_frame(owner, data):
        i = count[0]
        count[0] += 1
        if keep[i % len(keep)]:
            kept.append((data[:], payloads[i]))

    stream = b"".join(enc(hs, p) for p in payloads)
    g = Rig(hs=hs, max_frame=200, slot_size=slot_size, slots=slots, on_frame=on_frame)
    try:
        for chunk in _split(stream, cuts):
            g.send(chunk)
            g.pump()
        assert count[0] == len(payloads)
        assert [bytes(v) for v, _ in kept] == [w for _, w in kept]
        del kept[:]
        assert g.rx.buffered == 0 and not g.rx.holds_slot
        # 1 (the scratch), or 0 if an exhausted pool made the arena read into heap memory
        assert g.pool.in_use <= 1
    finally:
        del kept[:]
        g.rx.close()
        g.arena.close()
        g.r.close()
        g.w.close()
    assert g.pool.in_use == 0


# ---- views --------------------------------------------------------------------------------

def test_frame_view_shape_and_release(rigs):
    kept = []

    def on_frame(owner, data):
        assert isinstance(data, memoryview)
        assert data.readonly and data.format == "B" and data.ndim == 1
        kept.append(data)

    g = rigs(hs=2, on_frame=on_frame)
    g.send(enc(2, b"abc"))
    g.rx.on_readable()
    with pytest.raises(ValueError):
        kept[0][0]
    with pytest.raises(ValueError):
        bytes(kept[0])
    assert g.arena.scratch_swaps == 0     # nothing escaped
    g.close()


def test_frame_views_within_one_burst_stay_distinct(rigs):
    """Whatever the handler does to one frame's view (hash it, weak-reference it, release
    it, keep a slice of it) never shows up in another frame's view of the same read."""
    hashes, refs, slices, seen = [], [], [], []

    def on_frame(owner, data):
        seen.append(bytes(data))
        k = len(seen) % 5
        if k == 0:
            hashes.append((hash(data), hash(bytes(data))))
        elif k == 1:
            refs.append(weakref.ref(data))
        elif k == 2:
            data.release()
        elif k == 3:
            slices.append((data[:], bytes(data)))

    g = rigs(hs=2, slot_size=4096, on_frame=on_frame)
    payloads = [bytes([65 + i % 26]) * (1 + i % 7) for i in range(60)]
    g.send(b"".join(enc(2, p) for p in payloads))
    g.rx.on_readable()
    assert seen == payloads
    assert all(a == b for a, b in hashes) and len(hashes) == 12
    assert all(r() is None for r in refs)        # those views were dropped, not re-used
    assert all(bytes(v) == b for v, b in slices) and len(slices) == 12
    del slices[:]
    assert g.pool.in_use == 1
    g.close()


def test_frame_views_are_not_writable(rigs):
    seen = []

    def on_frame(owner, data):
        with pytest.raises(TypeError):
            data[0] = 1
        seen.append(bytes(data))

    g = rigs(hs=2, on_frame=on_frame)
    g.send(enc(2, b"abc"))
    g.rx.on_readable()
    assert seen == [b"abc"]
    g.close()


@pytest.mark.parametrize("how", ["slice", "memoryview", "export"])
def test_kept_subview_pins_the_scratch(rigs, how):
    kept = []

    def on_frame(owner, data):
        if not kept:
            if how == "slice":
                kept.append(data[1:])
            elif how == "memoryview":
                kept.append(memoryview(data))
            else:       # a buffer export of data itself: data cannot be released, stays valid
                kept.append(pickle.PickleBuffer(data))
                kept.append(data)

    g = rigs(hs=2, slot_size=64, on_frame=on_frame)
    g.send(enc(2, b"Xkeep-me-intact"))
    g.rx.on_readable()
    want = b"keep-me-intact" if how == "slice" else b"Xkeep-me-intact"
    assert bytes(kept[0]) == want
    if how == "export":
        assert bytes(kept[1]) == want   # not released: an export of it is alive
    assert g.arena.scratch_swaps == 1
    assert g.pool.in_use == 2            # the old scratch is pinned, a fresh one in place
    for i in range(50):
        g.send(enc(2, bytes([i]) * 40))
        g.rx.on_readable()
        assert bytes(kept[0]) == want
    assert g.arena.scratch_swaps == 1
    assert g.pool.in_use == 2
    del kept[:]
    assert g.pool.in_use == 1            # the pinned slot went back with its last view
    g.close()


def test_kept_subview_pins_the_own_slot(rigs):
    kept = []

    def on_frame(owner, data):
        if bytes(data[:1]) == b"K":
            kept.append(data[1:])

    g = rigs(hs=2, slot_size=64, on_frame=on_frame)
    # the K frame completes inside the receiver's own slot, followed by an unfinished frame
    g.send(enc(2, b"K0123456789")[:4])
    g.rx.on_readable()
    assert g.rx.holds_slot
    g.send(enc(2, b"K0123456789")[4:] + enc(2, b"z" * 30)[:10])
    g.rx.on_readable()
    assert bytes(kept[0]) == b"0123456789"
    for i in range(50):                  # many unfinished frames through the receive path
        g.send(enc(2, b"z" * 30)[10:] + enc(2, bytes([i]) * 30)[:10])
        g.rx.on_readable()
        assert bytes(kept[0]) == b"0123456789"
    g.send(enc(2, b"z" * 30)[10:])
    g.rx.on_readable()
    assert g.rx.buffered == 0
    assert g.pool.in_use == 2            # the pinned slot
    del kept[:]
    assert g.pool.in_use == 1
    g.close()


def test_kept_subview_of_a_big_frame(rigs):
    kept = []
    g = rigs(hs=2, slot_size=32, on_frame=lambda o, d: kept.append(d[:]))
    big = bytes(range(200))
    g.send(enc(2, big))
    g.pump()
    g.send(enc(2, b"x" * 200))
    g.pump()
    assert [bytes(k) for k in kept] == [big, b"x" * 200]
    del kept[:]
    g.close()


def test_view_released_in_another_thread(rigs):
    import threading
    kept = []
    g = rigs(hs=2, slot_size=64, on_frame=lambda o, d: kept.append(d[2:]))
    g.send(enc(2, b"abcdef"))
    g.rx.on_readable()
    assert g.pool.in_use == 2
    t = threading.Thread(target=kept.clear)
    t.start()
    t.join()
    assert g.pool.in_use == 1
    g.close()


def test_handler_exception(rigs):
    class Boom(Exception):
        pass

    def on_frame(owner, data):
        if bytes(data) == b"bad":
            raise Boom("no")
        owner.frames.append(bytes(data))

    g = rigs(hs=2, on_frame=on_frame)
    g.send(enc(2, b"a") + enc(2, b"bad") + enc(2, b"c") + enc(2, b"d"))
    g.rx.on_readable()
    assert g.frames == [b"a"]
    assert len(g.events) == 1
    code, exc = g.events[0]
    assert code == RX_HANDLER and isinstance(exc, Boom)
    assert g.rx.pending and g.rx.buffered == 2 * (2 + 1)
    g.rx.on_readable()                   # the next call delivers what was left, in order
    assert g.frames == [b"a", b"c", b"d"] and not g.rx.pending
    assert g.pool.in_use == 1
    g.close()


def test_keyboard_interrupt_propagates_consistently(rigs):
    calls = []

    def on_frame(owner, data):
        calls.append(bytes(data))
        if len(calls) == 2:
            raise KeyboardInterrupt

    g = rigs(hs=2, on_frame=on_frame)
    g.send(enc(2, b"a") + enc(2, b"b") + enc(2, b"c") + enc(2, b"dd")[:3])
    with pytest.raises(KeyboardInterrupt):
        g.rx.on_readable()
    assert calls == [b"a", b"b"] and g.rx.pending
    g.send(enc(2, b"dd")[3:])
    g.pump()
    assert calls == [b"a", b"b", b"c", b"dd"]
    assert g.pool.in_use == 1
    g.close()


def test_close_inside_on_frame_stops_delivery(rigs):
    def on_frame(owner, data):
        owner.frames.append(bytes(data))
        if bytes(data) == b"stop":
            owner.rx.close()

    g = rigs(hs=2, slot_size=64, on_frame=on_frame)
    g.send(enc(2, b"go") + enc(2, b"x" * 20)[:5])
    g.rx.on_readable()                  # leaves an unfinished frame in an own slot
    assert g.rx.holds_slot
    g.send(enc(2, b"x" * 20)[5:] + enc(2, b"stop") + enc(2, b"never") + b"\x00")
    g.rx.on_readable()
    assert g.frames == [b"go", b"x" * 20, b"stop"]
    assert g.rx.closed and not g.rx.holds_slot and g.rx.buffered == 0
    assert g.pool.in_use == 1
    g.rx.on_readable()
    assert g.frames == [b"go", b"x" * 20, b"stop"]
    g.close()


def test_close_inside_on_event(rigs):
    """What a session does: a handler error or the peer's EOF closes it from on_event."""
    def on_frame(owner, data):
        if bytes(data) == b"bad":
            raise RuntimeError("handler bug")
        owner.frames.append(bytes(data))

    g = rigs(hs=2, slot_size=64, on_frame=on_frame)
    g.rx.close()
    closed = []

    def on_event(owner, code, arg):
        closed.append(code)
        owner.rx.close()

    g.rx = Receiver(g.arena, g.r.fileno(), 2, 100, on_frame, on_event, g)
    g.send(enc(2, b"ok")[:3])
    g.rx.on_readable()
    assert g.rx.holds_slot
    g.send(enc(2, b"ok")[3:] + enc(2, b"bad") + enc(2, b"never") + enc(2, b"y" * 9)[:4])
    g.rx.on_readable()
    assert g.frames == [b"ok"] and closed == [RX_HANDLER]
    assert g.rx.closed and g.rx.buffered == 0 and not g.rx.holds_slot
    assert g.pool.in_use == 1
    g.close()


def test_arena_close_inside_on_frame(rigs):
    def on_frame(owner, data):
        owner.frames.append(bytes(data))
        owner.arena.close()

    g = rigs(hs=2, on_frame=on_frame)
    g.send(enc(2, b"a") + enc(2, b"b"))
    g.rx.on_readable()                  # the burst keeps the scratch pinned until it ends
    assert g.frames == [b"a", b"b"]
    assert g.arena.closed and g.pool.in_use == 0
    g.send(enc(2, b"c"))
    g.rx.on_readable()                  # a closed arena: nothing is read
    assert g.frames == [b"a", b"b"] and g.rx.reads == 1
    g.rx.close()
    assert g.pool.in_use == 0


def test_pool_exhaustion_falls_back_to_heap(rigs):
    g = rigs(hs=2, slot_size=32, slots=1)   # the scratch takes the only slot
    g.send(enc(2, b"a" * 10) + enc(2, b"b" * 20)[:7])
    g.rx.on_readable()
    assert g.rx.buffered == 7 and not g.rx.holds_slot
    assert g.arena.fallbacks == 1
    g.send(enc(2, b"b" * 20)[7:])
    g.rx.on_readable()
    assert g.frames == [b"a" * 10, b"b" * 20]
    assert g.pool.in_use == 1
    g.close()


def test_scratch_swap_with_pool_exhausted(rigs):
    kept = []
    g = rigs(hs=2, slot_size=32, slots=1, on_frame=lambda o, d: kept.append(d[:]))
    g.send(enc(2, b"first"))
    g.rx.on_readable()                   # kept: the scratch must go, no slot left
    assert g.arena.scratch_swaps == 1 and g.arena.fallbacks == 1
    kept.append(bytes(kept[0]))
    g.send(enc(2, b"second"))
    g.rx.on_readable()                   # read into the heap scratch
    assert bytes(kept[0]) == b"first" and bytes(kept[1]) == b"first"
    assert bytes(kept[2]) == b"second"
    del kept[:]
    assert g.pool.in_use == 0            # the arena now reads into heap memory
    g.rx.close()
    g.arena.close()
    assert g.pool.in_use == 0


def test_copy_frames(rigs):
    kept = []
    g = rigs(hs=2, slot_size=32, copy=True, on_frame=lambda o, d: kept.append(d))
    g.send(enc(2, b"abc") + enc(2, b"y" * 40)[:10])
    g.rx.on_readable()
    g.send(enc(2, b"y" * 40)[10:])
    g.pump()
    assert kept == [b"abc", b"y" * 40] and all(type(k) is bytes for k in kept)
    assert not g.rx.holds_slot and g.arena.scratch_swaps == 0
    assert g.pool.in_use == 1
    g.close()


def test_nested_reads_of_one_arena(rigs):
    g1 = rigs(hs=2, slot_size=64)
    g2 = rigs(hs=2, pool=g1.pool, arena=g1.arena)

    def on_frame(owner, data):
        owner.frames.append(bytes(data))
        g2.rx.on_readable()              # another receiver reads into the same arena
        g1.rx.on_readable()              # and a re-entrant call does nothing

    g1.rx.close()
    g1.rx = Receiver(g1.arena, g1.r.fileno(), 2, 100, on_frame, g1.on_event, g1)
    g1.send(enc(2, b"a1") + enc(2, b"a2"))
    g2.send(enc(2, b"b1"))
    g1.rx.on_readable()
    assert g1.frames == [b"a1", b"a2"] and g2.frames == [b"b1"]
    g2.rx.close()
    g1.rx.close()
    assert g1.pool.in_use == 1
    g1.arena.close()
    assert g1.pool.in_use == 0
    for g in (g1, g2):
        g.r.close()
        g.w.close()


def test_on_event_failure_is_unraisable(rigs, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    g = rigs(hs=2)
    g.rx.close()

    def bad_event(owner, code, arg):
        raise RuntimeError("event handler bug")

    g.rx = Receiver(g.arena, g.r.fileno(), 2, 100, g.on_frame, bad_event, g)
    g.w.close()
    g.rx.on_readable()                   # RX_EOF -> bad_event raises: reported, not raised
    assert seen == [RuntimeError]
    g.rx.close()
    g.r.close()
    g.arena.close()
    assert g.pool.in_use == 0


# ---- no leaks, no per-read garbage --------------------------------------------------------

@pytest.mark.parametrize("mode", ["views", "copy", "handler-error", "unfinished"])
def test_no_memory_growth(rigs, mode):
    def on_frame(owner, data):
        if mode == "handler-error":
            raise ValueError("x")

    g = rigs(hs=2, slot_size=256, copy=(mode == "copy"), on_frame=on_frame)
    burst = enc(2, b"p" * 10) * 16
    if mode == "unfinished":
        burst = enc(2, b"q" * 100) + enc(2, b"q" * 100)[:50]
        tail = enc(2, b"q" * 100)[50:]

    def run(n):
        for _ in range(n):
            g.send(burst)
            g.rx.on_readable()
            if mode == "handler-error":
                g.rx.on_readable()      # the pending frames (one more error each)
                while g.rx.pending:
                    g.rx.on_readable()
            if mode == "unfinished":
                g.send(tail)
                g.rx.on_readable()
        g.events.clear()

    run(200)
    gc.collect()
    before = sys.getallocatedblocks()
    run(2000)
    gc.collect()
    assert sys.getallocatedblocks() - before < 50
    assert g.pool.in_use == 1
    g.close()


# ---- lifetime -----------------------------------------------------------------------------

def test_close_is_idempotent_and_drops_references(rigs):
    g = rigs(hs=2)
    g.send(enc(2, b"abc")[:3])
    g.rx.on_readable()
    assert g.rx.holds_slot
    rc = sys.getrefcount(g)
    g.rx.close()
    assert sys.getrefcount(g) < rc      # owner and bound method dropped
    g.rx.close()
    assert g.rx.closed and g.pool.in_use == 1
    g.send(b"c")
    g.rx.on_readable()
    assert g.rx.reads == 1
    g.arena.close()
    g.arena.close()
    assert g.pool.in_use == 0


def test_arena_idle_holds_one_slot():
    pool = SlabPool(64, 4)
    arena = RxArena(pool)
    assert pool.in_use == 1 and arena.pool is pool and arena.slot_size == 64
    assert arena.scratch_swaps == 0 and arena.fallbacks == 0 and not arena.closed
    del arena
    assert pool.in_use == 0              # dropping an open arena returns its scratch


def test_constructor_checks():
    pool = SlabPool(64, 4)
    arena = RxArena(pool)
    ok = dict(on_frame=lambda o, d: None, on_event=lambda o, c, a: None)
    with pytest.raises(TypeError):
        Receiver(arena, 3.0, 2, 100, ok["on_frame"], ok["on_event"], None)
    with pytest.raises(TypeError):
        Receiver(arena, 3, 2.0, 100, ok["on_frame"], ok["on_event"], None)
    with pytest.raises(TypeError):
        Receiver(arena, 3, 2, 100.0, ok["on_frame"], ok["on_event"], None)
    with pytest.raises(ValueError):
        Receiver(arena, 3, 3, 100, ok["on_frame"], ok["on_event"], None)
    with pytest.raises(ValueError):
        Receiver(arena, 3, 2, 0, ok["on_frame"], ok["on_event"], None)
    with pytest.raises(ValueError):
        Receiver(arena, -1, 2, 100, ok["on_frame"], ok["on_event"], None)
    with pytest.raises(TypeError):
        Receiver(arena, 3, 2, 100, None, ok["on_event"], None)
    with pytest.raises(TypeError):
        Receiver(arena, 3, 2, 100, ok["on_frame"], 5, None)
    with pytest.raises(TypeError):
        Receiver(None, 3, 2, 100, ok["on_frame"], ok["on_event"], None)
    with pytest.raises(TypeError):
        RxArena(None)
    rx = Receiver(arena, 3, 4, 1 << 70, ok["on_frame"], ok["on_event"], None)
    assert rx.fd == 3 and rx.header_size == 4 and rx.max_frame == 1 << 62
    assert not rx.copy_frames and rx.frames_in == rx.bytes_in == rx.reads == 0
    rx.close()
    arena.close()


class Session:
    """What the server does: the session holds the receiver, the receiver holds the
    session (owner) and the session's bound methods."""

    def __init__(self, arena, sock, keep=False):
        self.sock = sock
        self.keep = keep
        self.kept = []
        self.rx = Receiver(arena, sock.fileno(), 2, 65536, self.on_frame, self.on_event,
                           self)

    def on_frame(self, owner, data):
        if self.keep:
            self.kept.append(data[1:])       # a view inside the cycle

    def on_event(self, owner, code, arg):
        pass


@pytest.mark.parametrize("keep", [False, True], ids=["plain", "view-in-cycle"])
@pytest.mark.parametrize("big", [False, True], ids=["slot", "heap"])
def test_gc_collects_session_receiver_cycles(keep, big):
    pool = SlabPool(64, 16)
    arena = RxArena(pool)
    socks, unraisable = [], []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(u)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for i in range(5):
                a, b = socket.socketpair()
                a.setblocking(False)
                socks += [a, b]
                s = Session(arena, a, keep=keep)
                n = 200 if big else 30
                b.sendall(enc(2, b"done!") + enc(2, b"p" * n)[:12])
                s.rx.on_readable()           # a frame in flight: an own slot / heap buffer
                assert s.rx.buffered == 12
                assert s.rx.holds_slot == (not big)
                del s
            gc.collect()
            gc.collect()
            assert pool.in_use == 1
        assert not [x for x in w if issubclass(x.category, ResourceWarning)]
        assert unraisable == []
    finally:
        sys.unraisablehook = old_hook
        for s in socks:
            s.close()
    arena.close()
    assert pool.in_use == 0


def test_gc_cycle_through_a_container():
    pool = SlabPool(64, 4)
    arena = RxArena(pool)
    a, b = socket.socketpair()
    a.setblocking(False)
    box = []
    rx = Receiver(arena, a.fileno(), 4, 1000, lambda o, d: None, lambda o, c, x: None, box)
    box.append(rx)
    b.sendall(b"\x00\x00")
    rx.on_readable()
    assert rx.holds_slot and pool.in_use == 2
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del rx, box
        gc.collect()
    assert not [x for x in w if issubclass(x.category, ResourceWarning)]
    assert pool.in_use == 1
    arena.close()
    a.close()
    b.close()
    assert pool.in_use == 0


# ---- cimport ------------------------------------------------------------------------------

CIMPORT_SOURCE = r"""
from aoprim.server._receiver cimport Receiver, AOP_RX_EOF
from aoprim.server._rxbuf cimport RxArena

def drive(Receiver rx, int times):
    cdef int i
    for i in range(times):
        rx.c_on_readable()
    return rx.frames_in, rx.reads, rx.hs, rx.arena.size, AOP_RX_EOF
"""


def test_cimport_c_on_readable(cybuild):
    mod = cybuild("aop_rx_cimport", CIMPORT_SOURCE)
    g = Rig(hs=2, slot_size=64)
    try:
        g.send(enc(2, b"one") + enc(2, b"two") + enc(2, b"x" * 100))
        assert mod.drive(g.rx, 3) == (3, 2, 2, 64, RX_EOF)   # 112 bytes: 2 reads
        assert g.frames == [b"one", b"two", b"x" * 100]
    finally:
        g.close()


def test_gc_clears_the_receiver_first():
    """A dict holding only atomic values is untracked until the receiver goes in, so it
    joins the GC's list after the receiver: the collector calls the receiver's tp_clear
    first (arena, callbacks, owner dropped while `own` still holds an unfinished frame);
    the receiver then deallocates through the dict and returns its slot properly."""
    pool = SlabPool(64, 4)
    arena = RxArena(pool)
    a, b = socket.socketpair()
    a.setblocking(False)
    seen = []
    box = {}
    assert not gc.is_tracked(box)
    rx = Receiver(arena, a.fileno(), 2, 1000, seen.append, seen.append, box)
    box["rx"] = rx
    assert gc.is_tracked(box)
    b.sendall(b"\x00\x09abc")
    rx.on_readable()
    assert rx.holds_slot and pool.in_use == 2
    unraisable = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            del rx, box
            gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert not [x for x in w if issubclass(x.category, ResourceWarning)]
    assert unraisable == [] and seen == []
    assert pool.in_use == 1
    arena.close()
    a.close()
    b.close()
    assert pool.in_use == 0


# ---- reads per readiness event (max_reads, hold) ----------------------------------------

@pytest.mark.parametrize("max_reads", [1, 3, 8])
def test_a_read_that_fills_its_buffer_is_followed_by_another(rigs, max_reads):
    """Raw: 5 slots' worth waiting.  One on_readable reads a full slot, and again while each
    read filled its buffer, up to max_reads (a 64 KiB message costs one readiness event, not
    one per slot); a short read (the socket is empty) ends it."""
    r = rigs(hs=0, slot_size=256, max_reads=max_reads)
    assert r.rx.max_reads == max_reads
    data = bytes(range(256)) * 5
    r.send(data)
    r.rx.on_readable()
    assert r.rx.reads == min(max_reads, 5)
    assert b"".join(r.frames) == data[:256 * min(max_reads, 5)]
    r.pump()
    assert b"".join(r.frames) == data and r.events == []
    # 2.5 slots waiting: the short third read ends the call even with reads left
    r.frames.clear()
    before = r.rx.reads
    r.send(data[:640])
    r.rx.on_readable()
    assert r.rx.reads - before == min(max_reads, 3)


@pytest.mark.parametrize("hs", [0, 2])
def test_hold_set_by_the_handler_stops_the_burst_of_reads(rigs, hs):
    """The owner pausing reading inside on_frame (back-pressure) takes effect at once: no
    further recv in the running call.  Cleared, the next call reads on."""
    held = []

    def on_frame(owner, data):
        held.append(bytes(data))
        owner.rx.hold = True
    r = rigs(hs=hs, slot_size=256, max_reads=8, on_frame=on_frame)
    payload = bytes(200)
    r.send(enc(hs, payload) * 6)            # > 4 slots
    r.rx.on_readable()
    assert r.rx.reads == 1
    r.rx.hold = False
    r.rx.on_readable()
    assert r.rx.reads == 2


def test_max_reads_is_checked(rigs):
    r = rigs()
    for bad in (0, -1, 1025):
        with pytest.raises(ValueError, match="max_reads"):
            Receiver(r.arena, r.r.fileno(), 2, 100, print, print, None, max_reads=bad)
    with pytest.raises(TypeError):
        Receiver(r.arena, r.r.fileno(), 2, 100, print, print, None, max_reads=1.5)


@pytest.mark.timeout(30)
def test_arena_closed_while_delivering_pending_frames_reads_nothing(rigs):
    """Frames left pending (a handler raised) are delivered by the next on_readable; a
    handler there closes the arena.  No read may follow: it would go into the closed
    arena's scratch (None, cast to a buffer: a crash)."""
    def on_frame(owner, data):
        b = bytes(data)
        if b == b"bad":
            raise RuntimeError("handler bug")
        owner.frames.append(b)
        if b == b"last":
            owner.arena.close()

    g = rigs(hs=2, on_frame=on_frame, max_reads=4)
    g.send(enc(2, b"a") + enc(2, b"bad") + enc(2, b"last"))
    g.rx.on_readable()
    assert g.frames == [b"a"] and g.rx.pending
    g.send(enc(2, b"more"))              # readable again: the loop would recv next
    g.rx.on_readable()
    assert g.frames == [b"a", b"last"] and g.arena.closed
    assert g.rx.reads == 1               # nothing read into the closed arena
    g.rx.on_readable()
    assert g.frames == [b"a", b"last"] and g.rx.reads == 1
    g.rx.close()
    assert g.pool.in_use == 0            # no slot taken for (or left in) the closed arena


@pytest.mark.timeout(30)
def test_arena_closed_by_a_frame_from_the_own_slot(rigs):
    """The arena closed by a handler while the receiver reads into its own slot: the rest
    is kept in the receiver's own buffer, nothing is taken for the closed arena."""
    def on_frame(owner, data):
        owner.frames.append(bytes(data))
        owner.arena.close()

    g = rigs(hs=2, slot_size=64, on_frame=on_frame)
    g.send(enc(2, b"x" * 20)[:5])
    g.rx.on_readable()
    assert g.rx.holds_slot
    g.send(enc(2, b"x" * 20)[5:] + enc(2, b"y" * 3) + enc(2, b"z" * 30)[:7])
    g.rx.on_readable()
    assert g.frames[0] == b"x" * 20 and g.arena.closed
    g.rx.on_readable()
    g.rx.close()
    assert g.pool.in_use == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("copy", [False, True])
def test_memory_error_while_cutting_frames_loses_no_frame(rigs, copy):
    """A MemoryError while a frame is being built (its view, the copy) must not drop it: a
    frame counted and consumed before its object exists would be lost.
    Every allocation of one on_readable is made to fail in turn (_testcapi.set_nomemory);
    afterwards every frame arrives exactly once, in order, and frames_in counts them."""
    skip_nomemory_on_free_threaded()
    _testcapi = pytest.importorskip("_testcapi")
    frames = [bytes([65 + i]) * (i + 1) for i in range(6)]
    wire = b"".join(enc(2, f) for f in frames)
    for k in range(0, 40):
        got = []

        def on_frame(owner, data, got=got):
            # the handler's own allocations may be the failing one: it retries (only the
            # receiver's are under test; set_nomemory fails one allocation)
            for _ in range(3):
                try:
                    got.append(bytes(data))
                    return
                except MemoryError:
                    pass

        r = rigs(hs=2, slot_size=256, on_frame=on_frame, copy=copy)
        r.send(wire)
        _testcapi.set_nomemory(k, k + 1)
        try:
            r.rx.on_readable()
        except MemoryError:
            pass
        finally:
            _testcapi.remove_mem_hooks()
        for _ in range(10):
            if len(got) == len(frames) or r.rx.closed:
                break
            r.rx.on_readable()
        failed = any(code == RX_ERROR for code, _ in r.events)
        # the call into on_frame itself may be what fails: that is the handler's error
        # (RX_HANDLER), its frame was handed over -- counted, not delivered again
        handler = sum(code == RX_HANDLER for code, _ in r.events)
        if failed:
            assert got == frames[:len(got)], k   # an ENOMEM report: a prefix, in order
        elif handler:
            assert handler == 1 and len(got) == len(frames) - 1, k
            assert all(f in frames for f in got) and got == sorted(got, key=frames.index)
        else:
            assert got == frames, k
        assert r.rx.frames_in == len(got) + handler, k
        r.close()
@pytest.mark.timeout(30)
@pytest.mark.parametrize("hs", [2, 4])
@pytest.mark.parametrize("copy", [False, True])
def test_hold_set_by_the_handler_stops_delivery_between_frames(rigs, hs, copy):
    """The server pauses a session (Rx.pause sets hold) from on_frame: no further frame of
    the bytes already received is delivered until hold is cleared and on_readable() runs
    again -- so a worker backlog limit cannot be overshot by one read's worth of frames."""
    got = []

    def on_frame(owner, data):
        got.append(bytes(data))
        if len(got) % 2 == 0:
            owner.rx.hold = True

    r = rigs(hs=hs, slot_size=256, max_reads=8, on_frame=on_frame, copy=copy)
    frames = [bytes([i]) * (i + 1) for i in range(7)]
    r.send(b"".join(enc(hs, f) for f in frames))
    r.rx.on_readable()
    assert got == frames[:2] and r.rx.pending and r.rx.reads == 1
    r.rx.on_readable()                      # still held: nothing read, nothing delivered
    assert got == frames[:2] and r.rx.reads == 1
    for k in (4, 6, 7):
        r.rx.hold = False
        r.rx.on_readable()
        assert got == frames[:k]
    assert r.rx.reads == 1 and not r.rx.pending and r.rx.buffered == 0
    r.rx.hold = False
    r.send(enc(hs, b"after"))
    r.rx.on_readable()
    assert got[-1] == b"after" and r.pool.in_use == 1
    r.close()


# ---- raw_pool: raw receivers read into large pool slots ---------------------------------

def test_raw_large_message_is_one_recv_into_a_raw_pool_slot(rigs):
    pool = SlabPool(1024, 4)
    raw = SlabPool(256 << 10, 2)
    arena = RxArena(pool, raw)
    assert arena.raw_read_size == 256 << 10 and arena.slot_size == 1024
    assert arena.raw_pool is raw and pool.in_use == 1 and raw.in_use == 1
    g = rigs(hs=0, pool=pool, arena=arena, max_reads=8)
    g.r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    g.w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    msg = bytes(range(256)) * 256                 # 64 KiB
    g.send(msg)
    g.rx.on_readable()
    # one recv took all of it (1 KiB slots would need 64), and since it did not fill the
    # 256 KiB offered, no second (empty) recv followed
    assert g.rx.reads == 1 and g.frames == [msg]
    assert arena.scratch_swaps == 0 and pool.in_use == 1 and raw.in_use == 1
    g.close()
    assert raw.in_use == 0


def test_without_raw_pool_raw_reads_are_slot_sized(rigs):
    pool = SlabPool(1024, 4)
    arena = RxArena(pool)
    assert arena.raw_read_size == 1024 and arena.raw_pool is None
    g = rigs(hs=0, pool=pool, arena=arena, max_reads=64)
    g.send(b"z" * 4096)
    g.rx.on_readable()
    assert g.rx.reads == 4 and b"".join(g.frames) == b"z" * 4096
    g.close()
    with pytest.raises(TypeError):
        RxArena(pool, 4096)


def test_framed_receivers_never_read_into_the_raw_pool(rigs):
    # a u16 frame larger than a slot still goes through the slot-sized first read and its
    # own exact buffer: what a framed session keeps stays bounded by max_frame + a slot
    pool = SlabPool(256, 8)
    raw = SlabPool(64 << 10, 2)
    arena = RxArena(pool, raw)
    g = rigs(hs=2, pool=pool, arena=arena, max_reads=1)
    g.send(enc(2, b"a" * 1000))
    g.rx.on_readable()
    assert g.rx.reads == 1 and g.frames == [] and g.rx.buffered == 256
    g.pump()
    assert g.frames == [b"a" * 1000] and raw.in_use == 1
    g.close()


def test_a_view_escaping_the_raw_slot_swaps_it_and_it_returns_with_the_view(rigs):
    kept = []

    def on_frame(owner, data):
        if not kept:
            kept.append(data[1:])                 # a sub-view: pins the raw slot

    pool = SlabPool(256, 4)
    raw = SlabPool(8192, 3)
    arena = RxArena(pool, raw)
    g = rigs(hs=0, pool=pool, arena=arena, on_frame=on_frame)
    g.send(b"K" + b"k" * 4000)
    g.rx.on_readable()
    assert arena.scratch_swaps == 1 and raw.in_use == 2
    for i in range(20):
        g.send(bytes([i]) * 5000)
        g.rx.on_readable()
        assert bytes(kept[0]) == b"k" * 4000     # never read over
    assert arena.scratch_swaps == 1 and pool.in_use == 1 and raw.in_use == 2
    del kept[:]
    assert raw.in_use == 1                        # back with its last view
    g.close()
    assert raw.in_use == 0


def test_raw_pool_exhausted_falls_back_to_a_heap_buffer(rigs):
    kept = []

    def on_frame(owner, data):
        kept.append(data[:1])                     # every frame pins what it was read into

    pool = SlabPool(256, 4)
    raw = SlabPool(4096, 2)
    arena = RxArena(pool, raw)
    g = rigs(hs=0, pool=pool, arena=arena, on_frame=on_frame)
    for i in range(4):
        g.send(bytes([65 + i]) * 3000)
        g.rx.on_readable()
    assert [bytes(k) for k in kept] == [b"A", b"B", b"C", b"D"]
    assert arena.scratch_swaps == 4 and arena.fallbacks >= 2 and raw.in_use == 2
    del kept[:]
    assert raw.in_use <= 1
    g.close()
    assert raw.in_use == 0


def test_nested_raw_reads_of_one_arena_use_a_fresh_raw_slot(rigs):
    # a handler of receiver A reads receiver B of the same arena: B must not read over the
    # bytes A's burst is still delivering
    pool = SlabPool(256, 8)
    raw = SlabPool(8192, 4)
    arena = RxArena(pool, raw)
    seen = []
    b = rigs(hs=0, pool=pool, arena=arena)

    def on_frame_a(owner, data):
        before = bytes(data)
        b.rx.on_readable()
        seen.append((before, bytes(data)))

    a = rigs(hs=0, pool=pool, arena=arena, on_frame=on_frame_a)
    b.send(b"B" * 3000)
    a.send(b"A" * 3000)
    a.rx.on_readable()
    assert seen == [(b"A" * 3000, b"A" * 3000)] and b.frames == [b"B" * 3000]
    assert arena.scratch_swaps == 1
    a.rx.close()
    b.close()                                     # (closes the arena too)
    assert raw.in_use == 0


def test_arena_close_gives_the_raw_slot_back_and_raw_receivers_read_nothing(rigs):
    pool = SlabPool(256, 4)
    raw = SlabPool(8192, 2)
    arena = RxArena(pool, raw)
    g = rigs(hs=0, pool=pool, arena=arena)
    g.send(b"x" * 100)
    g.rx.on_readable()
    arena.close()
    arena.close()
    assert pool.in_use == 0 and raw.in_use == 0
    g.send(b"y" * 100)
    g.rx.on_readable()
    assert g.frames == [b"x" * 100] and g.rx.reads == 1
    g.rx.close()
    # an arena that cannot get its raw slot is not made, and leaks nothing
    full = SlabPool(8192, 1)
    hold = full.acquire()
    with pytest.raises(Exception):
        RxArena(pool, full)
    assert pool.in_use == 0
    hold.release()


def test_is_frame_view_tells_receive_memory_from_any_other_buffer(rigs):
    seen = []

    def on_frame(owner, data):
        seen.append((Receiver.is_frame_view(data), Receiver.is_frame_view(data[1:]),
                     data.readonly))

    g = rigs(hs=2, on_frame=on_frame)
    g.send(enc(2, b"hello"))
    g.rx.on_readable()
    assert seen == [(True, True, True)]
    for other in (b"x", bytearray(b"x"), memoryview(b"x"), memoryview(bytearray(3)), None):
        assert not Receiver.is_frame_view(other)
    g.close()


# ---- frame_cache: large frame buffers kept resident for reuse ------------------------------

def test_large_frame_buffers_are_reused_not_freed(rigs):
    pool = SlabPool(1024, 4)
    arena = RxArena(pool, frame_cache=1 << 20)
    assert arena.frame_cache == {"cap": 1 << 20, "kept": 0, "kept_bytes": 0, "in_use": 0,
                                 "reuses": 0}
    g = rigs(hs=4, pool=pool, arena=arena, max_frame=200_000)
    g.r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    big = enc(4, b"q" * 100_000)
    g.send(big[:50_000])
    g.pump()
    assert arena.frame_cache["in_use"] == 1 and g.rx.buffered == 50_000
    g.send(big[50_000:])
    g.pump()
    assert g.frames == [b"q" * 100_000]
    fc = arena.frame_cache
    assert fc["in_use"] == 0 and fc["kept"] == 1 and fc["kept_bytes"] == 100_004
    # the next large frame (not larger than the kept buffer) reuses it
    g.send(enc(4, b"r" * 90_000))
    g.pump()
    assert g.frames[-1] == b"r" * 90_000
    fc = arena.frame_cache
    assert fc["reuses"] == 1 and fc["kept"] == 1 and fc["in_use"] == 0
    g.close()
    assert arena.frame_cache["kept"] == 0           # arena.close() freed it


def test_a_kept_buffer_is_never_larger_than_the_receivers_max_frame(rigs):
    pool = SlabPool(1024, 4)
    arena = RxArena(pool, frame_cache=4 << 20)
    a = rigs(hs=4, pool=pool, arena=arena, max_frame=1 << 20)
    a.r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    a.send(enc(4, b"a" * 150_000))
    a.pump()
    assert a.frames == [b"a" * 150_000] and arena.frame_cache["kept"] == 1
    # a receiver of max_frame 10_000 never holds the 150 KB buffer for a 5 KB frame
    b = rigs(hs=4, pool=pool, arena=arena, max_frame=10_000)
    b.send(enc(4, b"b" * 5000)[:2000])
    b.pump()
    fc = arena.frame_cache
    assert fc["reuses"] == 0 and fc["kept"] == 1 and fc["in_use"] == 1
    b.send(enc(4, b"b" * 5000)[2000:])
    b.pump()
    assert b.frames == [b"b" * 5000]
    a.rx.close()
    b.close()


def test_a_frame_view_alive_keeps_its_buffer_out_of_the_cache_until_released(rigs):
    kept = []
    pool = SlabPool(1024, 4)
    arena = RxArena(pool, frame_cache=1 << 20)
    g = rigs(hs=4, pool=pool, arena=arena, max_frame=1 << 20,
             on_frame=lambda owner, data: kept.append(data[:]))
    g.send(enc(4, b"v" * 50_000))
    g.pump()
    assert arena.frame_cache["in_use"] == 1 and arena.frame_cache["kept"] == 0
    g.send(enc(4, b"w" * 50_000))           # must not reuse the pinned buffer
    g.pump()
    assert bytes(kept[0]) == b"v" * 50_000 and bytes(kept[1]) == b"w" * 50_000
    # the last view dies in another thread: its memory still goes back to the cache
    t = threading.Thread(target=kept.clear)
    t.start()
    t.join()
    fc = arena.frame_cache
    assert fc["in_use"] == 0 and fc["kept"] == 2
    g.close()


def test_a_buffer_returned_after_arena_close_is_freed(rigs):
    kept = []
    pool = SlabPool(1024, 4)
    arena = RxArena(pool, frame_cache=1 << 20)
    g = rigs(hs=4, pool=pool, arena=arena, max_frame=1 << 20,
             on_frame=lambda owner, data: kept.append(data[:]))
    g.send(enc(4, b"z" * 40_000))
    g.pump()
    g.close()
    assert arena.frame_cache["in_use"] == 1       # the view still holds it
    kept.clear()
    assert arena.frame_cache == {"cap": 1 << 20, "kept": 0, "kept_bytes": 0, "in_use": 0,
                                 "reuses": 0}
    with pytest.raises(ValueError):
        RxArena(pool, frame_cache=-1)
