"""PROXY protocol: the parser (sans I/O: whole, byte by byte, with trailing data,
fuzzed), the compiled receive path (Receiver(proxy=...)), the server (peer / proxy_peer,
every malformed form closed and counted, untrusted peers refused, the header timeout,
resources back), the CLI, and the real thing: HAProxy with send-proxy-v2 in front of two
servers."""
import functools
import ipaddress
import logging
import os
import socket
import ssl
import struct
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from aoprim import SlabPool
from aoprim.server._proxyproto import ProxyParser
from aoprim.server._receiver import RX_EOF, RX_PROXY, RX_PROXY_ERROR, Receiver
from aoprim.server._rxbuf import RxArena
from aoprim.server._proxyproto import PP_DONE, PP_ERROR, PP_MORE, V2_SIGNATURE
from aoprim.server import Handler, Server
from aoprim.server.cli import build_parser

from haproxy_support import haproxy_v2, needs_haproxy
from support import run_threads
from tlscerts import tls_certs  # noqa: F401  (fixture)
from server_support import (HOST, frame, make_server, read_frame, recv_exact,  # noqa: F401
                                 recv_until_closed, wait_for)

IDLE_RX = 1     # the arena's scratch slot


# ---- encoders (what a balancer sends) ------------------------------------------------------

def v1(family, src=None, dst=None, tail=""):
    if family == "UNKNOWN":
        return f"PROXY UNKNOWN{tail}\r\n".encode()
    return f"PROXY {family} {src[0]} {dst[0]} {src[1]} {dst[1]}\r\n".encode()


_FAM = {"UNSPEC": 0x00, "TCP4": 0x11, "UDP4": 0x12, "TCP6": 0x21, "UDP6": 0x22,
        "UNIX_STREAM": 0x31, "UNIX_DGRAM": 0x32}


def v2(command="PROXY", family="TCP4", src=None, dst=None, tlvs=(), famcode=None,
       version=2, length=None):
    if family in ("TCP4", "UDP4"):
        block = (socket.inet_pton(socket.AF_INET, src[0]) +
                 socket.inet_pton(socket.AF_INET, dst[0]) + struct.pack(">HH", src[1], dst[1]))
    elif family in ("TCP6", "UDP6"):
        block = (socket.inet_pton(socket.AF_INET6, src[0]) +
                 socket.inet_pton(socket.AF_INET6, dst[0]) + struct.pack(">HH", src[1], dst[1]))
    elif family.startswith("UNIX"):
        block = src.encode().ljust(108, b"\0") + dst.encode().ljust(108, b"\0")
    else:
        block = b""
    for t, v in tlvs:
        block += struct.pack(">BH", t, len(v)) + v
    cmd = 1 if command == "PROXY" else 0
    fam = _FAM[family] if famcode is None else famcode
    n = len(block) if length is None else length
    return V2_SIGNATURE + bytes([(version << 4) | cmd, fam]) + struct.pack(">H", n) + block


C4, D4 = ("203.0.113.7", 51234), ("198.51.100.1", 7000)
C6, D6 = ("2001:db8::7", 40000), ("2001:db8:1::1", 443)
TLVS = [(0x01, b"h2"), (0x02, b"game.example"), (0x05, b"unique-id-123"),
        (0xEA, b"\x01vpce-0123456789abcdef")]

# name -> (header bytes, the parser's result)
VALID = {
    "v1 TCP4": (v1("TCP4", C4, D4), (1, "PROXY", "TCP4", C4, D4)),
    "v1 TCP6": (v1("TCP6", C6, D6), (1, "PROXY", "TCP6", C6, D6)),
    "v1 UNKNOWN": (v1("UNKNOWN"), (1, "PROXY", "UNKNOWN", None, None)),
    "v1 UNKNOWN with addresses": (v1("UNKNOWN", tail=" 1.2.3.4 5.6.7.8 1 2"),
                                  (1, "PROXY", "UNKNOWN", None, None)),
    "v2 PROXY TCP4": (v2("PROXY", "TCP4", C4, D4), (2, "PROXY", "TCP4", C4, D4)),
    "v2 PROXY TCP6": (v2("PROXY", "TCP6", C6, D6), (2, "PROXY", "TCP6", C6, D6)),
    "v2 PROXY TCP4 + TLVs": (v2("PROXY", "TCP4", C4, D4, TLVS), (2, "PROXY", "TCP4", C4, D4)),
    "v2 PROXY TCP6 + TLVs": (v2("PROXY", "TCP6", C6, D6, TLVS), (2, "PROXY", "TCP6", C6, D6)),
    "v2 PROXY UDP4": (v2("PROXY", "UDP4", C4, D4), (2, "PROXY", "UDP4", C4, D4)),
    "v2 PROXY UNSPEC": (v2("PROXY", "UNSPEC"), (2, "PROXY", "UNSPEC", None, None)),
    "v2 PROXY UNIX": (v2("PROXY", "UNIX_STREAM", "/run/c.sock", "/run/s.sock"),
                      (2, "PROXY", "UNIX_STREAM", "/run/c.sock", "/run/s.sock")),
    "v2 PROXY UNIX dgram": (v2("PROXY", "UNIX_DGRAM", "/run/c.sock", "/run/s.sock"),
                            (2, "PROXY", "UNIX_DGRAM", "/run/c.sock", "/run/s.sock")),
    "v2 PROXY UNIX abstract": (v2("PROXY", "UNIX_STREAM", "\0lb-client", "\0srv\0x"),
                               (2, "PROXY", "UNIX_STREAM", "\0lb-client", "\0srv\0x")),
    "v2 PROXY UNIX unnamed": (v2("PROXY", "UNIX_DGRAM", "", "/s"),
                              (2, "PROXY", "UNIX_DGRAM", "", "/s")),
    "v2 LOCAL": (v2("LOCAL", "UNSPEC"), (2, "LOCAL", "UNSPEC", None, None)),
    "v2 LOCAL over IPv4 + TLVs": (v2("LOCAL", "TCP4", C4, D4, TLVS),
                                  (2, "LOCAL", "UNSPEC", None, None)),
    "v2 LOCAL over IPv6": (v2("LOCAL", "TCP6", C6, D6), (2, "LOCAL", "UNSPEC", None, None)),
}

# name -> (bytes, a piece of the reason); each is refused
MALFORMED = {
    "missing header (a u16 frame)": (frame(b"hello"), "stream starts with byte 0x00"),
    "missing header (HTTP)": (b"GET / HTTP/1.1\r\n\r\n", "byte 0x47"),
    "bad v1 prefix": (b"PROXZ TCP4 1.2.3.4 5.6.7.8 1 2\r\n", "not a PROXY v1 header"),
    "bad signature": (b"\r\n\r\n\x00\r\nQUIX\n" + b"\x21\x11\x00\x0c" + b"\0" * 12,
                      "not a PROXY v2 signature"),
    "bad version": (v2("PROXY", "TCP4", C4, D4, version=1), "unsupported version 1"),
    "bad version 3": (v2("PROXY", "TCP4", C4, D4, version=3), "unsupported version 3"),
    "bad command": (v2("PROXY", "TCP4", C4, D4)[:12] + b"\x22\x11\x00\x0c" + b"\0" * 12,
                    "unknown command 2"),
    "bad family": (v2("PROXY", "TCP4", C4, D4, famcode=0x41), "family/transport 0x41"),
    "bad transport": (v2("PROXY", "TCP4", C4, D4, famcode=0x13), "family/transport 0x13"),
    "length short of the addresses": (v2("PROXY", "TCP6", C6, D6, length=12),
                                      "shorter than the 36-byte address block"),
    "length beyond the limit": (v2("PROXY", "TCP4", C4, D4, [(0x20, b"x" * 5000)]),
                                "above the limit (4096)"),
    "overlong v1": (b"PROXY UNKNOWN " + b"x" * 100 + b"\r\n", "no CRLF within 107"),
    "v1 without CRLF": (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n", "LF without CR"),
    "v1 unknown protocol": (b"PROXY UDP4 1.2.3.4 5.6.7.8 1 2\r\n", "not TCP4, TCP6"),
    "v1 TCP4 with IPv6": (b"PROXY TCP4 ::1 ::2 1 2\r\n", "not an IPv4 address"),
    "v1 TCP6 with IPv4": (b"PROXY TCP6 1.2.3.4 ::2 1 2\r\n", "not an IPv6 address"),
    "v1 bad address": (b"PROXY TCP4 1.2.3.256 5.6.7.8 1 2\r\n", "not an IPv4"),
    "v1 NUL in source": (b"PROXY TCP4 1.2.3.4\x00zz 5.6.7.8 1 2\r\n", "NUL byte"),
    "v1 NUL in destination": (b"PROXY TCP6 ::1 ::2\x00 1 2\r\n", "NUL byte"),
    "v1 port too big": (b"PROXY TCP4 1.2.3.4 5.6.7.8 65536 2\r\n", "a port"),
    "v1 port leading zero": (b"PROXY TCP4 1.2.3.4 5.6.7.8 01 2\r\n", "a port"),
    "v1 double space": (b"PROXY TCP4 1.2.3.4  5.6.7.8 1 2\r\n", "single spaces"),
    "v1 missing port": (b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n", "4 fields"),
    "v1 extra field": (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 3\r\n", "4 fields"),
}


def feed_whole(data, accept=3, limit=4096):
    p = ProxyParser(accept, limit)
    return p, p.feed(data)


def feed_bytewise(data, accept=3, limit=4096):
    p = ProxyParser(accept, limit)
    used = 0
    for i in range(len(data)):
        used += p.feed(data[i:i + 1])
        if p.state != PP_MORE:
            break
    return p, used


# ---- the parser ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(VALID))
def test_parser_every_valid_form_whole_bytewise_and_with_trailing_data(name):
    hdr, want = VALID[name]
    for p, used in (feed_whole(hdr), feed_bytewise(hdr), feed_whole(hdr + frame(b"next"))):
        assert p.state == PP_DONE, p.error
        assert used == p.total == len(hdr)
        assert p.result == want
        assert p.error is None
        assert p.feed(b"more") == 0             # done: the rest is the stream's


@pytest.mark.parametrize("name", list(MALFORMED))
def test_parser_every_malformed_form_is_refused_with_a_reason(name):
    data, why = MALFORMED[name]
    p1, _ = feed_whole(data)
    p2, _ = feed_bytewise(data)
    for p in (p1, p2):
        assert p.state == PP_ERROR
        assert why in p.error, p.error
        assert p.result is None
    assert p1.error == p2.error                 # fails at the same byte, however it is fed


def test_parser_versions_accepted_and_limits():
    p, _ = feed_whole(VALID["v2 PROXY TCP4"][0], accept=1)
    assert p.failed and "only v1 is accepted" in p.error
    p, _ = feed_whole(VALID["v1 TCP4"][0], accept=2)
    assert p.failed and "only v2 is accepted" in p.error
    big = v2("PROXY", "TCP4", C4, D4, [(0x20, b"x" * 60000)])
    p, used = feed_whole(big, limit=65551)      # the format's maximum: TLVs skipped, not kept
    assert p.done and used == len(big)
    p, _ = feed_whole(v2("PROXY", "TCP4", C4, D4, [(0x20, b"x" * 300)]), limit=232)
    assert p.failed and "above the limit (232)" in p.error
    for bad in (0, 4, -1):
        with pytest.raises(ValueError):
            ProxyParser(bad)
    for bad in (231, 65552):
        with pytest.raises(ValueError):
            ProxyParser(3, bad)
    with pytest.raises(TypeError):
        ProxyParser(3.0)
    with pytest.raises(TypeError):
        ProxyParser(3, 4096.0)


def test_parser_eof_inside_a_header_is_an_error_and_before_it_is_not():
    p = ProxyParser()
    assert not p.eof() and p.state == PP_MORE   # nothing read yet: a plain EOF
    p.feed(VALID["v2 PROXY TCP4"][0][:20])
    assert p.eof() and p.failed and "after 20 bytes" in p.error


_ip4 = st.ip_addresses(v=4).map(str)
_ip6 = st.ip_addresses(v=6).map(str)
_port = st.integers(0, 65535)
_tlvs = st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=300)), max_size=5)
_path = st.binary(min_size=1, max_size=107).filter(lambda b: b"\0" not in b).map(
    lambda b: b.decode("latin-1"))


@st.composite
def headers(draw):
    """(bytes, expected result) for any valid header."""
    kind = draw(st.sampled_from(["v1 TCP4", "v1 TCP6", "v1 UNKNOWN", "v2 IP4", "v2 IP6",
                                 "v2 UNIX", "v2 UNSPEC", "v2 LOCAL"]))
    if kind.startswith("v1 TCP"):
        ip = _ip4 if kind == "v1 TCP4" else _ip6
        src, dst = (draw(ip), draw(_port)), (draw(ip), draw(_port))
        fam = kind[3:]
        return v1(fam, src, dst), (1, "PROXY", fam, src, dst)
    if kind == "v1 UNKNOWN":
        tail = draw(st.text(st.characters(min_codepoint=32, max_codepoint=126),
                            max_size=90))
        return v1("UNKNOWN", tail=" " + tail if tail else ""), (1, "PROXY", "UNKNOWN",
                                                                None, None)
    tlvs = draw(_tlvs)
    if kind in ("v2 IP4", "v2 IP6"):
        ip = _ip4 if kind == "v2 IP4" else _ip6
        fam = draw(st.sampled_from(["TCP4", "UDP4"] if kind == "v2 IP4" else ["TCP6", "UDP6"]))
        src, dst = (draw(ip), draw(_port)), (draw(ip), draw(_port))
        return v2("PROXY", fam, src, dst, tlvs), (2, "PROXY", fam, src, dst)
    if kind == "v2 UNIX":
        a, b = draw(_path), draw(_path)
        hdr = (V2_SIGNATURE + b"\x21\x31" + struct.pack(">H", 216) +
               a.encode("latin-1").ljust(108, b"\0") + b.encode("latin-1").ljust(108, b"\0"))
        return hdr, (2, "PROXY", "UNIX_STREAM", a.encode("latin-1").decode("utf-8", "surrogateescape"),
                     b.encode("latin-1").decode("utf-8", "surrogateescape"))
    if kind == "v2 UNSPEC":
        return v2("PROXY", "UNSPEC", tlvs=tlvs), (2, "PROXY", "UNSPEC", None, None)
    fam = draw(st.sampled_from(list(_FAM)))
    famcode = draw(st.integers(0, 255))        # LOCAL ignores the family byte
    src = dst = None
    if fam in ("TCP4", "UDP4"):
        src, dst = (draw(_ip4), 1), (draw(_ip4), 2)
    elif fam in ("TCP6", "UDP6"):
        src, dst = (draw(_ip6), 1), (draw(_ip6), 2)
    elif fam.startswith("UNIX"):
        src, dst = "/a", "/b"
    return (v2("LOCAL", fam, src, dst, tlvs, famcode=famcode),
            (2, "LOCAL", "UNSPEC", None, None))


def _same(got, want):
    """Results equal, addresses compared as addresses (inet_ntop's text may differ from
    Python's for IPv4-mapped IPv6)."""
    assert got[:3] == want[:3]
    for g, w in zip(got[3:], want[3:]):
        if type(w) is tuple:
            assert ipaddress.ip_address(g[0]) == ipaddress.ip_address(w[0]) and g[1] == w[1]
        else:
            assert g == w


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers(), st.binary(max_size=40), st.lists(st.integers(1, 64), max_size=30))
def test_fuzz_valid_headers_always_parse_to_what_was_encoded(hdr_want, trailing, cuts):
    hdr, want = hdr_want
    data = hdr + trailing
    p = ProxyParser(3, 65551)
    used = pos = 0
    for c in cuts + [len(data)]:                # random split points, then the rest
        used += p.feed(data[pos:pos + c])
        pos += c
        if p.state != PP_MORE or pos >= len(data):
            break
    assert p.state == PP_DONE, p.error
    assert used == p.total == len(hdr)
    _same(p.result, want)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.binary(max_size=300),
                 st.binary(max_size=250).map(lambda b: V2_SIGNATURE + b),
                 st.binary(max_size=120).map(lambda b: b"PROXY " + b)),
       st.sampled_from([1, 2, 3]), st.integers(1, 17))
def test_fuzz_random_bytes_never_crash(data, accept, step):
    p = ProxyParser(accept, 4096)
    used = 0
    for i in range(0, len(data), step):
        k = p.feed(data[i:i + step])
        assert 0 <= k <= step
        used += k
        if p.state != PP_MORE:
            break
    assert used == p.total <= len(data)
    assert p.state in (PP_MORE, PP_DONE, PP_ERROR)
    if p.state == PP_DONE:
        assert isinstance(p.result, tuple) and len(p.result) == 5
    elif p.state == PP_ERROR:
        assert isinstance(p.error, str) and p.error
    whole, _ = feed_whole(data, accept)        # the same verdict however it is cut
    assert (whole.state, whole.error, whole.result, whole.total) == \
        (p.state, p.error, p.result, p.total)
    if p.state == PP_MORE:
        assert p.total <= 4096 and (p.total < 107 or p.version == 2)
        assert p.eof() == (p.total > 0)


# ---- the compiled receive path -------------------------------------------------------------

class Rig:
    def __init__(self, proxy=3, hs=2, limit=4096, slot_size=256):
        self.pool = SlabPool(slot_size, 8)
        self.arena = RxArena(self.pool)
        self.r, self.w = socket.socketpair()
        self.r.setblocking(False)
        self.log = []
        self.rx = Receiver(self.arena, self.r.fileno(), hs, 65536, self.on_frame,
                           self.on_event, self, False, proxy, limit)

    def on_frame(self, owner, data):
        self.log.append(("frame", bytes(data)))

    def on_event(self, owner, code, arg):
        self.log.append((code, arg))

    def pump(self):
        for _ in range(10000):
            before = self.rx.bytes_in
            self.rx.on_readable()
            if self.rx.bytes_in == before:
                return

    def close(self):
        self.rx.close()
        self.arena.close()
        self.r.close()
        self.w.close()
        assert self.pool.in_use == 0


@pytest.mark.parametrize("name", ["v1 TCP4", "v1 TCP6", "v1 UNKNOWN", "v2 PROXY TCP4 + TLVs",
                                  "v2 PROXY TCP6 + TLVs", "v2 LOCAL over IPv4 + TLVs"])
@pytest.mark.parametrize("hs", [0, 2])
def test_receiver_header_coalesced_with_frames_then_framed_in_the_same_call(name, hs):
    hdr, want = VALID[name]
    rig = Rig(hs=hs)
    body = frame(b"one") + frame(b"two") if hs else b"raw bytes"
    rig.w.sendall(hdr + body)
    rig.rx.on_readable()                        # ONE call: header, event, then the frames
    frames = [("frame", b"one"), ("frame", b"two")] if hs else [("frame", b"raw bytes")]
    assert rig.log == [(RX_PROXY, want)] + frames
    assert rig.rx.bytes_in == len(hdr + body) and rig.rx.frames_in == len(frames)
    assert not rig.rx.proxy_pending and rig.rx.buffered == 0
    rig.close()


@pytest.mark.parametrize("name", ["v1 TCP6", "v2 PROXY TCP6 + TLVs", "v2 LOCAL"])
def test_receiver_header_byte_by_byte_counts_as_buffered(name):
    hdr, want = VALID[name]
    rig = Rig(hs=2)
    assert rig.rx.proxy_pending and rig.rx.buffered == 0
    for i, b in enumerate(hdr[:-1]):
        rig.w.send(bytes([b]))
        rig.rx.on_readable()
        assert rig.rx.buffered == i + 1         # the frame timeout sees the header begun
        assert rig.pool.in_use == 1             # kept by the parser, not in a slot
    assert rig.log == []
    data = hdr[-1:] + frame(b"x" * 300)         # the rest of the header + a frame > a slot
    for b in data:
        rig.w.send(bytes([b]))
        rig.rx.on_readable()
    assert rig.log == [(RX_PROXY, want), ("frame", b"x" * 300)]
    assert rig.rx.buffered == 0
    rig.close()


@pytest.mark.parametrize("name", ["bad signature", "overlong v1", "length beyond the limit",
                                  "missing header (a u16 frame)"])
def test_receiver_refused_header_reports_once_and_reads_nothing_more(name):
    data, why = MALFORMED[name]
    rig = Rig()
    rig.w.sendall(data + frame(b"never"))
    rig.pump()
    assert len(rig.log) == 1 and rig.log[0][0] == RX_PROXY_ERROR and why in rig.log[0][1]
    reads = rig.rx.reads
    rig.rx.on_readable()
    assert rig.rx.reads == reads and rig.rx.frames_in == 0
    assert rig.pool.in_use == 1
    rig.close()


def test_receiver_eof_inside_the_header_and_before_it():
    rig = Rig()
    rig.w.sendall(VALID["v1 TCP4"][0][:10])
    rig.w.shutdown(socket.SHUT_WR)
    rig.pump()
    assert [c for c, _ in rig.log] == [RX_PROXY_ERROR] and "after 10 bytes" in rig.log[0][1]
    rig.close()
    rig = Rig()
    rig.w.shutdown(socket.SHUT_WR)
    rig.pump()
    assert rig.log == [(RX_EOF, 0)]             # a connect-and-close: a plain EOF
    rig.close()


def test_receiver_close_from_the_proxy_event_stops_framing():
    rig = Rig()
    rig.on_event = lambda owner, code, arg: (rig.log.append((code, arg)), rig.rx.close())
    rig.rx = Receiver(rig.arena, rig.r.fileno(), 2, 65536, rig.on_frame, rig.on_event, rig,
                      False, 3)
    rig.w.sendall(VALID["v1 TCP4"][0] + frame(b"a"))
    rig.rx.on_readable()
    assert [c for c, _ in rig.log] == [RX_PROXY]
    rig.close()


@pytest.mark.parametrize("hs", [0, 2, 4], ids=["raw", "u16", "u32"])
@pytest.mark.parametrize("size", [40, 3000], ids=["small", "above-a-slot"])
@pytest.mark.parametrize("raw_pool", [False, True], ids=["scratch", "raw-pool"])
def test_receiver_hold_set_by_the_proxy_event_keeps_the_bytes_after_the_header(hs, size,
                                                                              raw_pool):
    """The owner pauses reading in its RX_PROXY handler (the server's on_connect) while the
    header and the first request came in ONE read: nothing is delivered until hold is
    cleared, then everything, once, in order -- raw framing as u16/u32."""
    hdr, want = VALID["v2 PROXY TCP4 + TLVs"]
    rig = Rig(hs=hs)
    rig.rx.close()
    big = None
    if raw_pool:
        rig.arena.close()
        big = SlabPool(8192, 2)
        rig.arena = RxArena(rig.pool, big)

    def on_event(owner, code, arg):
        rig.log.append((code, arg))
        if code == RX_PROXY:
            rig.rx.hold = True

    rig.rx = Receiver(rig.arena, rig.r.fileno(), hs, 65536, rig.on_frame, on_event, rig,
                      False, 3)
    try:
        payloads = [bytes([65 + i]) * size for i in range(3)]
        body = (b"".join(frame(x, "u16" if hs == 2 else "u32") for x in payloads) if hs
                else b"".join(payloads))
        rig.w.sendall(hdr + body)
        for _ in range(3):      # however often the socket is reported readable meanwhile
            rig.rx.on_readable()
        assert rig.log == [(RX_PROXY, want)]
        assert rig.rx.frames_in == 0 and rig.rx.reads == 1
        assert rig.rx.pending and rig.rx.buffered == rig.rx.bytes_in - len(hdr) > 0
        rig.rx.hold = False
        rig.pump()              # the held bytes first, then the rest of the socket's
        got = [d for k, d in rig.log[1:] if k == "frame"]
        assert len(got) == len(rig.log) - 1 == rig.rx.frames_in
        if hs:
            assert got == payloads
        else:
            assert b"".join(got) == body        # nothing lost, nothing twice, in order
        assert rig.rx.bytes_in == len(hdr + body)
        assert not rig.rx.pending and rig.rx.buffered == 0
    finally:
        rig.close()
    if big is not None:
        assert big.in_use == 0


def test_receiver_off_by_default_and_argument_checks():
    pool = SlabPool(256, 4)
    arena = RxArena(pool)
    rx = Receiver(arena, 0, 2, 10, print, print, None)
    assert not rx.proxy_pending and rx.buffered == 0
    for bad in (4, -1):
        with pytest.raises(ValueError):
            Receiver(arena, 0, 2, 10, print, print, None, False, bad)
    with pytest.raises(ValueError):
        Receiver(arena, 0, 2, 10, print, print, None, False, 3, 100)
    rx.close()
    arena.close()


# ---- the server ----------------------------------------------------------------------------

class Who(Handler):
    """Echo; records (peer, proxy_peer) at on_connect and counts on_close."""

    def __init__(self):
        self.lock = threading.Lock()
        self.connected = []
        self.closed = 0
        self.early = []

    def on_connect(self, session):
        with self.lock:
            self.connected.append((session.peer, session.proxy_peer))

    def on_read(self, session, data):
        session.send(b"%s:%d|" % (session.peer[0].encode(), session.peer[1]) + bytes(data))

    def on_close(self, session, exc):
        with self.lock:
            self.closed += 1


def _connect(srv):
    s = socket.create_connection(srv.address, timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bytewise", [False, True], ids=["coalesced", "bytewise"])
def test_server_every_form_sets_peer_and_proxy_peer(make_server, workers, bytewise):
    h = Who()
    srv = make_server(h, framing="u16", proxy_protocol="any", workers=workers)
    names = ["v1 TCP4", "v1 TCP6", "v1 UNKNOWN", "v2 PROXY TCP4 + TLVs",
             "v2 PROXY TCP6 + TLVs", "v2 LOCAL", "v2 LOCAL over IPv6", "v2 PROXY UNIX"]
    for name in names:
        hdr, want = VALID[name]
        c = _connect(srv)
        balancer = c.getsockname()[:2]
        data = hdr + frame(b"hi")
        if bytewise:
            for b in data:
                c.send(bytes([b]))
                time.sleep(0.0005)
        else:
            c.sendall(data)
        src = want[3] if type(want[3]) is tuple else balancer
        assert read_frame(c) == b"%s:%d|hi" % (src[0].encode(), src[1]), name
        assert h.connected[-1] == (src, balancer), name
        c.close()
    wait_for(lambda: srv.stats()["connections"] == 0)
    wait_for(lambda: h.closed == len(names))
    st = srv.stats()
    assert st["rx_slots_in_use"] == IDLE_RX
    assert "proxy" not in st["closes"]


@pytest.mark.parametrize("name", list(MALFORMED) + ["truncated then EOF"])
def test_server_every_malformed_form_is_closed_and_counted(make_server, caplog, name):
    caplog.set_level(logging.INFO, logger="aoprim.server")
    h = Who()
    srv = make_server(h, framing="u16", proxy_protocol="any")
    c = _connect(srv)
    if name == "truncated then EOF":
        c.sendall(VALID["v2 PROXY TCP4 + TLVs"][0][:30])
        c.shutdown(socket.SHUT_WR)
        why = "ended inside the PROXY header (after 30 bytes)"
    else:
        data, why = MALFORMED[name]
        c.sendall(data + frame(b"never delivered"))
    assert recv_until_closed(c)[0] == b""
    c.close()
    wait_for(lambda: srv.stats()["closes"].get("proxy") == 1, what="closes['proxy']")
    wait_for(lambda: srv.stats()["connections"] == 0)
    st = srv.stats()
    assert st["frames_in"] == 0 and st["rx_slots_in_use"] == IDLE_RX
    assert h.connected == [] and h.closed == 0          # the handler never met it
    recs = [r for r in caplog.records if "PROXY protocol" in r.getMessage()]
    assert recs and why in recs[0].getMessage() and recs[0].levelno == logging.WARNING
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_server_raw_framing_gets_the_bytes_after_the_header(make_server):
    class RawEcho(Handler):
        def on_read(self, session, data):
            session.send(bytes(data))

    srv = make_server(RawEcho(), framing="raw", proxy_protocol="any")
    c = _connect(srv)
    c.sendall(VALID["v2 PROXY TCP4 + TLVs"][0] + b"raw payload")
    assert recv_exact(c, 11) == b"raw payload"         # not a header byte echoed
    c.close()


class PauseInConnect(Handler):
    """on_connect pauses reading (to look the client up first, say); on_read echoes and
    records what it got while the session was paused."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions = []
        self.got = []
        self.while_paused = []
        self.paused = set()

    def on_connect(self, session):
        session.pause_reading()
        with self.lock:
            self.paused.add(session.id)
            self.sessions.append(session)

    def on_read(self, session, data):
        with self.lock:
            if session.id in self.paused:
                self.while_paused.append(bytes(data))
            self.got.append(bytes(data))
        session.send(bytes(data))

    def resume(self, session):
        with self.lock:
            self.paused.discard(session.id)
        session.resume_reading()


def _loop_ran(srv):
    """Wait until the loop thread has finished what it was doing (its current read burst
    included): a callback queued now runs after it."""
    done = threading.Event()
    srv.loop.call_soon_threadsafe(done.set)
    assert done.wait(10), "the loop thread did not come round"


@pytest.mark.parametrize("backend", ["selectors", "epoll"])
@pytest.mark.parametrize("framing", ["raw", "u16", "u32"])
@pytest.mark.parametrize("workers", [0, 2])
def test_server_pause_in_on_connect_holds_the_request_sent_with_the_header(
        make_server, backend, framing, workers):
    """HAProxy sends the header and the first request in ONE write; on_connect pauses
    reading: no on_read until resume_reading(), then the request, once, in order."""
    h = PauseInConnect()
    srv = make_server(h, framing=framing, proxy_protocol="any", workers=workers)
    hdr = VALID["v2 PROXY TCP4 + TLVs"][0]
    reqs = [b"first request %d " % i * 20 for i in range(3)]
    if framing == "raw":
        body = b"".join(reqs)
    else:
        body = b"".join(frame(r, framing) for r in reqs)
    with _connect(srv) as c:
        c.sendall(hdr + body)
        wait_for(lambda: h.sessions, what="on_connect")
        _loop_ran(srv)              # the burst that read the header is over
        _loop_ran(srv)
        assert h.got == [] and h.while_paused == []
        h.resume(h.sessions[0])     # from this (another) thread
        if framing == "raw":
            assert recv_exact(c, len(body)) == body
        else:
            assert [read_frame(c, framing) for _ in reqs] == reqs
        c.sendall(b"more" if framing == "raw" else frame(b"more", framing))
        assert (recv_exact(c, 4) if framing == "raw" else read_frame(c, framing)) == b"more"
        assert h.while_paused == []
        assert b"".join(h.got) == b"".join(reqs) + b"more"     # nothing lost or twice
    wait_for(lambda: srv.stats()["connections"] == 0)
    st = srv.stats()
    assert st["rx_slots_in_use"] == IDLE_RX and st["rx_frame_buffers_in_use"] == 0
    assert st["rx_raw_slots_in_use"] == (1 if framing == "raw" else 0)


@pytest.mark.parametrize("backend", ["selectors", "epoll"])
@pytest.mark.parametrize("workers", [0, 2])
def test_server_tls_pause_in_on_connect_holds_the_request_of_the_last_flight(
        make_server, tls_certs, backend, workers):
    """PROXY header and ClientHello in one write, then the handshake's last flight and the
    first request in one write; on_connect pauses: no on_read until resume_reading()."""
    h = PauseInConnect()
    srv = make_server(h, framing="u16", proxy_protocol="any", workers=workers,
                      ssl=tls_certs.server_ctx())
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = tls_certs.client_ctx().wrap_bio(inc, out, server_hostname="localhost")
    hdr = VALID["v1 TCP4"][0]
    with _connect(srv) as c:
        first = True
        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            if out.pending:
                c.sendall((hdr if first else b"") + out.read())
                first = False
            inc.write(c.recv(65536))
        obj.write(frame(b"held request"))
        c.sendall(out.read())           # Finished + the request: one write
        wait_for(lambda: h.sessions, what="on_connect")
        _loop_ran(srv)
        _loop_ran(srv)
        assert h.got == []
        h.resume(h.sessions[0])
        got = b""
        while len(got) < 14:
            d = c.recv(65536)
            assert d, "EOF before the reply"
            inc.write(d)
            try:
                got += obj.read(65536)
            except ssl.SSLWantReadError:
                pass
        assert got == frame(b"held request")
        assert h.got == [b"held request"] and h.while_paused == []
    wait_for(lambda: srv.stats()["connections"] == 0)
    assert srv.stats()["rx_slots_in_use"] == IDLE_RX


def test_server_on_a_unix_socket_trusts_the_local_balancer(tmp_path):
    path = str(tmp_path / "s.sock")
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(8)
    h = Who()
    srv = Server(h, sock=ls, framing="u16", proxy_protocol="v1",
                 trusted_proxies=("192.0.2.0/24",)).start()
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(10)
        c.connect(path)
        c.sendall(VALID["v1 TCP4"][0] + frame(b"u"))
        assert read_frame(c) == b"%s:%d|u" % (C4[0].encode(), C4[1])
        assert h.connected == [(C4, "")]                # proxy_peer: the unix peer's name
        c.close()
    finally:
        srv.shutdown()


def test_server_version_mismatch_is_refused(make_server):
    for mode, other in (("v1", "v2 PROXY TCP4"), ("v2", "v1 TCP4")):
        srv = make_server(Who(), framing="u16", proxy_protocol=mode)
        c = _connect(srv)
        c.sendall(VALID[other][0] + frame(b"x"))
        assert recv_until_closed(c)[0] == b""
        c.close()
        wait_for(lambda: srv.stats()["closes"].get("proxy") == 1)


def test_server_untrusted_peer_is_closed_before_reading(make_server, caplog):
    caplog.set_level(logging.INFO, logger="aoprim.server")
    h = Who()
    srv = make_server(h, framing="u16", proxy_protocol="v2",
                      trusted_proxies=("10.0.0.0/8", "192.0.2.1"))
    c = _connect(srv)
    c.sendall(VALID["v2 PROXY TCP4"][0] + frame(b"x"))
    data, how = recv_until_closed(c)
    assert data == b""
    c.close()
    wait_for(lambda: srv.stats()["closes"].get("proxy_untrusted") == 1)
    st = srv.stats()
    assert st["bytes_in"] == 0 and st["connections"] == 0 and st["rx_slots_in_use"] == IDLE_RX
    assert h.connected == [] and h.closed == 0
    assert "not in trusted_proxies" in caplog.text


@pytest.mark.parametrize("frame_timeout", [None, 30.0])
def test_server_header_timeout_partial_and_silent(make_server, frame_timeout):
    # the header has its own deadline (proxy_header_timeout), whatever frame_timeout is:
    # with frame_timeout=None a silent connection would otherwise be kept forever
    h = Who()
    srv = make_server(h, framing="u16", proxy_protocol="any", frame_timeout=frame_timeout,
                      proxy_header_timeout=0.2)
    partial = _connect(srv)
    partial.sendall(VALID["v1 TCP4"][0][:12])
    silent = _connect(srv)
    ok = _connect(srv)
    ok.sendall(VALID["v1 TCP4"][0])
    t0 = time.monotonic()
    assert recv_until_closed(partial)[0] == b""
    assert recv_until_closed(silent)[0] == b""
    assert time.monotonic() - t0 < 3
    ok.sendall(frame(b"still here"))
    assert read_frame(ok).endswith(b"|still here")     # a completed header is not cut
    for c in (partial, silent, ok):
        c.close()
    wait_for(lambda: srv.stats()["connections"] == 0)
    assert srv.stats()["closes"].get("timeout") == 2
    assert srv.stats()["rx_slots_in_use"] == IDLE_RX


def test_server_broadcast_skips_sessions_before_their_header(make_server):
    h = Who()
    srv = make_server(h, framing="u16", proxy_protocol="v1")
    waiting = _connect(srv)
    ready = _connect(srv)
    ready.sendall(VALID["v1 TCP4"][0])
    wait_for(lambda: len(h.connected) == 1)
    srv.broadcast(b"news")
    assert read_frame(ready) == b"news"
    waiting.sendall(VALID["v1 TCP6"][0] + frame(b"q"))
    assert read_frame(waiting) == b"%s:%d|q" % (C6[0].encode(), C6[1])   # no "news" first
    waiting.close()
    ready.close()


def test_settings_validation():
    for bad in ("v3", "V1", "", 1):
        with pytest.raises((ValueError, TypeError)):
            Server(Who(), proxy_protocol=bad)
    for bad in (("10.0.0.0/33",), ("example.com",), (None,)):
        with pytest.raises(ValueError):
            Server(Who(), proxy_protocol="v2", trusted_proxies=bad)
    with pytest.raises(ValueError):
        Server(Who(), proxy_protocol="v2", trusted_proxies=())
    for bad in (100, 70000):
        with pytest.raises(ValueError):
            Server(Who(), proxy_protocol="v2", proxy_max_header=bad)
    srv = Server(Who(), proxy_protocol="any", trusted_proxies="10.1.2.3/8")
    assert srv.settings.trusted_proxies == (ipaddress.ip_network("10.0.0.0/8"),)
    assert srv.settings.proxy_mode == 3
    srv.shutdown()


def test_cli_options_reach_the_server_and_the_procs_children():
    p = build_parser()
    a = p.parse_args(["serve", "--proxy-protocol", "v2", "--trusted-proxy", "10.0.0.0/8",
                      "--trusted-proxy", "::1", "--proxy-max-header", "1024", "--procs", "2"])
    argv = a.child_argv(a, port=1234, procs=1, reuse_port=True)
    i = argv.index("--proxy-protocol")
    assert argv[i + 1] == "v2"
    assert [argv[j + 1] for j, x in enumerate(argv) if x == "--trusted-proxy"] == \
        ["10.0.0.0/8", "::1"]
    assert argv[argv.index("--proxy-max-header") + 1] == "1024"
    a = p.parse_args(["serve"])
    argv = a.child_argv(a, port=1234, procs=1, reuse_port=True)
    assert "--proxy-protocol" not in argv and "--trusted-proxy" not in argv
    help_text = p._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--proxy-protocol" in help_text and "(default: off)" in help_text
    assert "127.0.0.0/8, ::1/128" in help_text


# ---- the real thing: HAProxy with send-proxy-v2 --------------------------------------------

@needs_haproxy
def test_behind_haproxy_send_proxy_v2(make_server, tmp_path):
    class Recorder(Handler):
        def __init__(self):
            self.lock = threading.Lock()
            self.peers = {}                 # peer -> (proxy_peer, bytes echoed)
            self.checks = 0

        def on_connect(self, session):
            with self.lock:
                if session.peer == session.proxy_peer:
                    self.checks += 1        # a health check (v2 LOCAL)

        def on_read(self, session, data):
            with self.lock:
                pp, n = self.peers.get(session.peer, (session.proxy_peer, 0))
                self.peers[session.peer] = (pp, n + len(data))
            session.send(data)

    handlers = [Recorder(), Recorder()]
    servers = [make_server(h, framing="u16", proxy_protocol="v2") for h in handlers]
    with haproxy_v2(tmp_path, [srv.address[1] for srv in servers]) as (front, proc):
        nclients, nframes = 6, 200
        clients = [socket.create_connection((HOST, front), timeout=10)
                   for _ in range(nclients)]
        names = [c.getsockname()[:2] for c in clients]

        def run(i, c):
            sent = bytearray()
            for k in range(nframes):
                payload = os.urandom(1 + (k * 37 + i) % 3000)
                sent += payload
                c.sendall(frame(payload))
            got = bytearray()
            for _ in range(nframes):
                got += read_frame(c)
            assert got == sent, f"client {i}: echo differs"

        run_threads([functools.partial(run, i, c) for i, c in enumerate(clients)], timeout=30)
        for c in clients:
            c.close()
        # HAProxy's health checks (check-send-proxy) arrive as v2 LOCAL: peer == proxy_peer
        wait_for(lambda: sum(h.checks for h in handlers) >= 2, timeout=5,
                 what="HAProxy health checks (v2 LOCAL)")
        proc.terminate()                        # no more health checks from here
        proc.wait(5)
        seen = {}
        for h in handlers:
            seen.update(h.peers)
        for name in names:
            assert name in seen, f"no session saw client {name} as its peer: {sorted(seen)}"
            proxy_peer, n = seen[name]
            assert proxy_peer[0] == HOST and proxy_peer != name   # HAProxy's own socket
            assert n > 0
        assert all(h.peers for h in handlers), "roundrobin: both servers must serve clients"
        for srv in servers:
            wait_for(lambda: srv.stats()["connections"] == 0, timeout=10)
            st = srv.stats()
            assert "proxy" not in st["closes"] and "proxy_untrusted" not in st["closes"], st
            assert st["rx_slots_in_use"] == IDLE_RX


@pytest.mark.parametrize("nets,trusted", [
    (("::ffff:127.0.0.1/128",), True),      # exactly the IPv4-mapped peer
    (("127.0.0.0/8",), True),               # as its IPv4 address
    (("::ffff:127.0.0.2/128",), False),
    (("::1/128",), False),
])
def test_server_ipv4_mapped_peer_on_a_dual_stack_listener(make_server, nets, trusted):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    h = Who()
    try:
        srv = make_server(h, host="::", framing="u16", proxy_protocol="v1",
                          trusted_proxies=nets)
    except OSError as e:
        pytest.skip(f"no dual-stack listener here: {e}")
    c = socket.create_connection(("127.0.0.1", srv.address[1]), timeout=10)
    c.sendall(VALID["v1 TCP4"][0] + frame(b"q"))
    if trusted:
        assert read_frame(c).endswith(b"|q")
    else:
        assert recv_until_closed(c)[0] == b""
    c.close()


def test_proxy_header_timeout_setting():
    from aoprim.server import Settings
    assert Settings().proxy_header_timeout == 10.0
    assert Settings(proxy_protocol="v1", frame_timeout=None).sweep_every == 1.0
    assert Settings(frame_timeout=None).sweep_every is None        # PROXY off: no sweep
    for bad in (0, -1, float("inf"), "1"):
        with pytest.raises((ValueError, TypeError), match="proxy_header_timeout"):
            Settings(proxy_header_timeout=bad)


def test_trusted_peers_ipv4_mapped_networks_match_the_ipv4_peer_either_way():
    from aoprim.server.proxy import TrustedPeers, parse_trusted
    t = TrustedPeers(parse_trusted(("::ffff:10.0.0.0/104", "::ffff:127.0.0.1/128")))
    for addr, want in [(("127.0.0.1", 1), True), (("::ffff:127.0.0.1", 1, 0, 0), True),
                       (("127.0.0.2", 1), False), (("10.9.9.9", 1), True),
                       (("::ffff:10.1.2.3", 1, 0, 0), True), (("11.0.0.1", 1), False),
                       (("::1", 1, 0, 0), False)]:
        assert t(addr) is want, addr
