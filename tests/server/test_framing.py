"""Framing: the one compiled cutter (the Receiver's step, behind Framing.scan and
FrameDecoder) and the one compiled encoder (SendBatch.add_frame's header code, behind
Framing.header/encode) against the Python model of the framing, which lives only here.  Fed
whole, one byte at a time, and split at every point, the result must be the same; a header
above max_frame is refused before any payload memory is reserved."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from aoprim.server.framing import FrameDecoder, FrameTooLarge, Framing

KINDS = ["u16", "u32"]
HS = {"u16": 2, "u32": 4}


# -- the Python model of the framing: the only Python encoder and cutter ----------------------

def model_frame(payload, hs):
    """The framing model: big-endian byte count of the payload's C-order bytes, then them."""
    body = memoryview(payload).tobytes()
    if len(body) >= 1 << (8 * hs):
        raise ValueError("too long")
    return len(body).to_bytes(hs, "big") + body


def model_scan(buf, pos, end, hs, max_frame):
    """(spans, pos, need, too_large) -- what Framing.scan must find, written plainly."""
    data = bytes(buf)
    spans = []
    while True:
        if end - pos < hs:
            return spans, pos, (hs if end > pos else 0), None
        n = int.from_bytes(data[pos:pos + hs], "big")
        if n > max_frame:
            return spans, pos, hs, n
        if end - pos - hs < n:
            return spans, pos, hs + n, None
        spans.append((pos + hs, pos + hs + n))
        pos += hs + n


def enc(kind, payload):
    return model_frame(payload, HS[kind])


PAYLOADS = [b"", b"a", b"hello", bytes(range(256)) * 3, b"\x00" * 1000, b"z" * 65535]


@pytest.mark.parametrize("kind", KINDS)
def test_whole_stream(kind):
    stream = b"".join(enc(kind, p) for p in PAYLOADS)
    d = FrameDecoder(kind, max_frame=65535)
    assert d.feed(stream) == PAYLOADS
    assert d.pending == 0


@pytest.mark.parametrize("kind", KINDS)
def test_byte_by_byte(kind):
    payloads = PAYLOADS[:5]
    stream = b"".join(enc(kind, p) for p in payloads)
    d = FrameDecoder(kind)
    out = []
    for i in range(len(stream)):
        out += d.feed(stream[i:i + 1])
    assert out == payloads
    assert d.pending == 0


@pytest.mark.parametrize("kind", KINDS)
def test_split_at_every_point(kind):
    payloads = [b"abc", b"", b"defgh", bytes(range(40))]
    stream = b"".join(enc(kind, p) for p in payloads)
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            d = FrameDecoder(kind)
            out = d.feed(stream[:i]) + d.feed(stream[i:j]) + d.feed(stream[j:])
            assert out == payloads, (i, j)
            assert d.pending == 0


@pytest.mark.parametrize("kind", KINDS)
def test_trailing_partial_is_kept(kind):
    d = FrameDecoder(kind)
    full = enc(kind, b"one") + enc(kind, b"two")
    assert d.feed(full + enc(kind, b"three")[:-1]) == [b"one", b"two"]
    assert d.pending == len(enc(kind, b"three")) - 1
    assert d.feed(b"e") == [b"three"]


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(KINDS),
       payloads=st.lists(st.binary(max_size=300), max_size=20),
       cuts=st.lists(st.integers(min_value=0, max_value=10000), max_size=10))
def test_any_split_gives_the_same_frames(kind, payloads, cuts):
    stream = b"".join(enc(kind, p) for p in payloads)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    d = FrameDecoder(kind)
    out = []
    for a, b in zip(points, points[1:]):
        out += d.feed(stream[a:b])
    assert out == payloads


@pytest.mark.parametrize("kind", KINDS)
def test_header_above_max_frame_is_refused_before_the_payload(kind):
    d = FrameDecoder(kind, max_frame=100)
    good = enc(kind, b"x" * 100)
    bad_header = (101).to_bytes(HS[kind], "big")
    # the bad header alone (no payload bytes at all) is enough to refuse it
    with pytest.raises(FrameTooLarge) as ei:
        d.feed(good + bad_header)
    assert ei.value.length == 101 and ei.value.max_frame == 100
    assert ei.value.frames == [b"x" * 100]        # the frame before it was complete
    assert isinstance(ei.value, ValueError)
    with pytest.raises(FrameTooLarge):             # poisoned: the stream lost its framing
        d.feed(b"")


def test_scan_reports_spans_and_need():
    fr = Framing("u16", 1000)
    buf = bytearray(enc("u16", b"ab") + enc("u16", b"cde") + enc("u16", b"0123456789")[:5])
    spans, pos, need = fr.scan(buf, 0, len(buf))
    assert [bytes(buf[a:b]) for a, b in spans] == [b"ab", b"cde"]
    assert pos == 9 and need == 12
    spans, pos, need = fr.scan(buf, 9, 10)       # one header byte only
    assert spans == [] and pos == 9 and need == 2
    spans, pos, need = fr.scan(buf, 0, 9)        # exactly at a boundary
    assert len(spans) == 2 and pos == 9 and need == 0
    big = bytearray((1001).to_bytes(2, "big"))
    with pytest.raises(FrameTooLarge) as ei:
        fr.scan(big, 0, 2)
    assert ei.value.spans == [] and ei.value.pos == 0


def test_scan_with_offset_and_memoryview():
    fr = Framing("u32", 64)
    data = b"junk" + enc("u32", b"hi") + enc("u32", b"")
    mv = memoryview(bytearray(data))
    spans, pos, need = fr.scan(mv, 4, len(data))
    assert [bytes(mv[a:b]) for a, b in spans] == [b"hi", b""]
    assert pos == len(data) and need == 0


def test_encode_and_header_limits():
    assert Framing("u16").encode(b"abc") == b"\x00\x03abc"
    assert Framing("u32").encode(memoryview(b"abc")) == b"\x00\x00\x00\x03abc"
    assert Framing("raw").encode(bytearray(b"abc")) == b"abc"
    assert Framing("raw").header(5) == b""
    with pytest.raises(ValueError):
        Framing("u16").header(65536)
    with pytest.raises(ValueError):
        Framing("u16").encode(b"x" * 65536)
    assert Framing("u16").header(65535) == b"\xff\xff"
    assert Framing("u32").header(2 ** 32 - 1) == b"\xff\xff\xff\xff"
    with pytest.raises(ValueError):
        Framing("u32").header(2 ** 32)


def test_raw_passes_chunks_through():
    d = FrameDecoder("raw")
    assert d.feed(b"abc") == [b"abc"]
    assert d.feed(b"") == []


def test_bad_arguments():
    with pytest.raises(ValueError):
        Framing("u8")
    with pytest.raises(TypeError):
        Framing("u16", 10.0)
    with pytest.raises(TypeError):
        Framing("u16", True)
    with pytest.raises(ValueError):
        Framing("u16", 0)


def test_random_streams_against_a_model():
    rng = random.Random(7)
    for _ in range(200):
        kind = rng.choice(KINDS)
        payloads = [rng.randbytes(rng.randrange(0, 70)) for _ in range(rng.randrange(0, 30))]
        stream = b"".join(enc(kind, p) for p in payloads)
        d = FrameDecoder(kind)
        out, i = [], 0
        while i < len(stream):
            k = rng.randrange(1, 50)
            out += d.feed(stream[i:i + k])
            i += k
        assert out == payloads


# -- the one cutter: Framing.scan is the compiled Receiver's step ------------------------------

@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(KINDS),
       payloads=st.lists(st.binary(max_size=200), max_size=12),
       junk=st.binary(max_size=6),
       max_frame=st.integers(1, 300) | st.just(2**70),
       lo=st.integers(0, 3000), hi=st.integers(0, 3000))
def test_scan_agrees_with_the_model(kind, payloads, junk, max_frame, lo, hi):
    """Random streams (garbage included: a junk tail reads as some header), any window
    [pos, end), any max_frame: spans, stop position, need and the too-large verdict are the
    model's."""
    hs = HS[kind]
    stream = bytearray(b"".join(enc(kind, p) for p in payloads) + junk)
    pos, end = sorted((lo % (len(stream) + 1), hi % (len(stream) + 1)))
    want = model_scan(stream, pos, end, hs, max_frame)
    fr = Framing(kind, max_frame)
    try:
        got = fr.scan(stream, pos, end) + (None,)
    except FrameTooLarge as e:
        got = (e.spans, e.pos, hs, e.length)
    assert got == want


def test_scan_rejects_a_bad_window_and_raw():
    fr = Framing("u16")
    for pos, end in ((-1, 2), (3, 2), (0, 5), (2**70, 2**70)):
        with pytest.raises((ValueError, OverflowError)):
            fr.scan(b"\x00\x01a", pos, end)
    with pytest.raises(ValueError):
        Framing("raw").scan(b"abc", 0, 3)
    with pytest.raises(TypeError):
        fr.scan("text", 0, 1)


def test_scan_of_a_u32_header_at_the_limits():
    fr = Framing("u32", 2**70)                 # no header can announce more than 2**32 - 1
    spans, pos, need = fr.scan(b"\xff\xff\xff\xff", 0, 4)
    assert spans == [] and pos == 0 and need == 4 + 2**32 - 1
    with pytest.raises(FrameTooLarge) as ei:
        Framing("u32", 2**32 - 2).scan(b"\xff\xff\xff\xff", 0, 4)
    assert ei.value.length == 2**32 - 1


# -- the one encoder: the compiled SendBatch.add_frame against a Python model --------------------
# The server builds every frame header in add_frame: on the loop thread directly, and for a
# send from another thread after tx.foreign_item copied/validated the payload there;
# Framing.header/encode use the same compiled code (_frame_header).  All must agree with the
# model above.

import array as _array                                                      # noqa: E402
import socket as _socket                                                    # noqa: E402

from aoprim import SendBatch, SlabPool                                       # noqa: E402
from aoprim.server.tx import foreign_item, release_item                                   # noqa: E402


def _compiled(payloads, hs, foreign):
    a, b = _socket.socketpair()
    try:
        sb = SendBatch(a, auto_flush=False)
        for p in payloads:
            if not foreign:
                sb.add_frame(p, hs)
                continue
            item = foreign_item(p, hs)          # the sending thread's part
            try:
                sb.add_frame(item, hs)          # the loop thread's (Session._drain_foreign)
            finally:
                release_item(item)
        sb.flush()
        a.shutdown(_socket.SHUT_WR)
        out = bytearray()
        while True:
            chunk = b.recv(1 << 16)
            if not chunk:
                return bytes(out)
            out += chunk
    finally:
        a.close()
        b.close()


_ITEMSIZE_CODES = ["b", "B", "h", "H", "i", "I", "l", "q", "f", "d"]


@st.composite
def payloads(draw):
    raw = draw(st.binary(max_size=3000))
    how = draw(st.sampled_from(["bytes", "bytearray", "slice", "strided", "2d", "array"]))
    if how == "bytes":
        return raw
    if how == "bytearray":
        return bytearray(raw)
    if how == "slice":
        i = draw(st.integers(0, len(raw)))
        return memoryview(raw)[i:draw(st.integers(i, len(raw)))]
    if how == "strided":
        return memoryview(raw)[::draw(st.integers(1, 5))]
    if how == "2d":
        cols = draw(st.integers(1, 8))
        rows = max(1, len(raw) // cols)
        raw = (raw + bytes(cols))[:rows * cols]
        return memoryview(raw).cast("B", (rows, cols))
    code = draw(st.sampled_from(_ITEMSIZE_CODES))
    size = _array.array(code).itemsize
    return _array.array(code, raw[:len(raw) // size * size])


@pytest.mark.parametrize("hs", [2, 4])
@pytest.mark.parametrize("foreign", [False, True], ids=["loop-thread", "other-thread"])
@settings(max_examples=150, deadline=None)
@given(ps=st.lists(payloads(), max_size=6))
def test_compiled_encoder_agrees_with_the_model(hs, foreign, ps):
    assert _compiled(ps, hs, foreign) == b"".join(model_frame(p, hs) for p in ps)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None)
@given(ps=st.lists(payloads(), max_size=6))
def test_framing_encode_agrees_with_the_model(kind, ps):
    fr = Framing(kind)
    assert b"".join(fr.encode(p) for p in ps) == b"".join(model_frame(p, HS[kind]) for p in ps)
    for p in ps:
        n = len(memoryview(p).tobytes())
        assert fr.header(n) == n.to_bytes(HS[kind], "big")


@pytest.mark.parametrize("foreign", [False, True], ids=["loop-thread", "other-thread"])
def test_compiled_encoder_slot_and_limits(foreign):
    pool = SlabPool(70000, 1)
    slot = pool.acquire()
    memoryview(slot)[:5] = b"hello"
    slot.length = 5
    assert _compiled([slot], 2, foreign) == model_frame(b"hello", 2)
    # Framing.encode (clients, tools) frames the same bytes: the slot's first `length`, not
    # the whole slot (it encoded all 70000, stale bytes included)
    assert Framing("u16").encode(slot) == _compiled([slot], 2, foreign)
    assert Framing("raw").encode(slot) == b"hello"
    slot.length = 65536                       # too long for u16: refused, nothing retained
    with pytest.raises(ValueError, match="too long for u16"):
        _compiled([slot], 2, foreign)
    slot.release()
    assert pool.in_use == 0
    with pytest.raises(ValueError, match="too long for u16"):
        _compiled([b"x" * 65536], 2, foreign)
    for bad in (5, "text", [1, 2], None):
        with pytest.raises(TypeError):
            _compiled([bad], 2, foreign)
