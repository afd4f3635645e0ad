"""A Slot broadcast to N TLS sessions is encrypted once per session (it must be), but never
copied more than that.

What is proven here, through the real server: the buffer each session's TLS object encrypts
a broadcast payload from (the pointer ``SSLObject.write`` is given) is the SAME memory for
every session -- the one pool Slot (or, above the send pool's slot size, the caller's own
``bytes``) that every session's batch retained.  A per-session copy anywhere between
``Server.broadcast`` and the cipher (into a batch, a bytes(), a join of segments) gives each
session a different address and fails the test.

The spy: an ``SSLContext`` whose ``sslobject_class`` wraps the C ``_ssl`` object of each
server-side ``SSLObject`` in a proxy whose ``write`` records the address and length of the
buffer it is handed (``PyObject_GetBuffer`` through ctypes) and the bytes there, then calls
the real ``write`` -- the same call the compiled ``TLSConn`` makes."""
import ctypes
import socket
import ssl
import struct

import pytest

from aoprim import SlabPool
from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS

from tlscerts import tls_certs  # noqa: F401  (fixture)
from server_support import HOST, make_server, recv_exact, wait_for  # noqa: F401

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p),
                ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(obj):
    """(address, length) of the memory ``obj``'s buffer protocol exposes."""
    b = _PyBuffer()
    if _get_buffer(obj, ctypes.byref(b), 0):      # PyBUF_SIMPLE
        raise BufferError("no buffer")
    try:
        return b.buf, b.len
    finally:
        _release_buffer(ctypes.byref(b))


class _SpyCore:
    """The C ``_ssl`` object, its ``write`` recorded: (address, length, the bytes there)."""

    def __init__(self, real, log):
        self._real = real
        self._log = log

    def write(self, data):
        addr, n = buffer_address(data)
        self._log.append((addr, n, ctypes.string_at(addr, n)))
        return self._real.write(data)

    def __getattr__(self, name):
        return getattr(self._real, name)


def spy_context(ctx, logs):
    """``ctx``, its server-side SSLObjects spied on: one write log per object in ``logs``."""
    class SpyObject(ssl.SSLObject):
        @classmethod
        def _create(cls, *a, **kw):
            obj = super()._create(*a, **kw)
            log = []
            logs.append(log)
            obj._sslobj = _SpyCore(obj._sslobj, log)
            return obj
    ctx.sslobject_class = SpyObject
    return ctx


PAYLOAD = bytes(range(256)) * 47            # 12032 bytes: above copy_max, one tx slot
BIG = bytes(range(251)) * 160               # 40160 bytes: above tx_slot_size: by reference


class Broadcaster(Echo):
    def __init__(self, pool):
        self.pool = pool

    def on_read(self, session, data):
        d = bytes(data)
        if d == b"slot":
            with self.pool.acquire() as s:          # the caller's Slot: released after
                memoryview(s)[:len(PAYLOAD)] = PAYLOAD
                s.length = len(PAYLOAD)
                session.server.broadcast(s)
        elif d == b"big":
            session.server.broadcast(BIG)
        else:
            session.send(data)


def _frame(framing, p):
    return struct.pack(">H", len(p)) + p if framing == "u16" else p


def _read(framing, s, want):
    if framing == "u16":
        n = struct.unpack(">H", recv_exact(s, 2))[0]
        assert n == len(want)
    return recv_exact(s, len(want))


def _arena(pool):
    """[start, end) of ``pool``'s slots (addresses), from one slot's address and index."""
    with pool.acquire() as s:
        mv = memoryview(s)
        try:
            addr = buffer_address(mv)[0]
        finally:
            mv.release()
        base = addr - s.index * pool.slot_size
    return base, base + pool.slots * pool.slot_size


def _sources(log, payload):
    """The (address, length) of each write that carried a piece of ``payload`` (writes of
    at least 1000 bytes: the pings and headers are smaller), checked to add up to it."""
    pieces = [(a, n, b) for a, n, b in log if n >= 1000]
    assert b"".join(b for _, _, b in pieces) == payload
    return [(a, n) for a, n, _ in pieces]


@pytest.mark.parametrize("framing", ["u16", "raw"])
def test_broadcast_is_encrypted_from_one_shared_buffer(make_server, tls_certs, framing):
    logs = []
    pool = SlabPool(16384, 2)
    srv = make_server(Broadcaster(pool), framing=framing,
                      ssl=spy_context(tls_certs.server_ctx(), logs))
    cctx = tls_certs.client_ctx()
    socks = []
    try:
        for _ in range(4):
            raw = socket.create_connection(srv.address, timeout=10)
            s = cctx.wrap_socket(raw, server_hostname="localhost")
            socks.append(s)
            s.sendall(_frame(framing, b"ping"))
            assert _read(framing, s, b"ping") == b"ping"
        assert len(logs) == 4
        for log in logs:
            log.clear()
        for word, payload in ((b"slot", PAYLOAD), (b"big", BIG)):
            socks[0].sendall(_frame(framing, word))
            for s in socks:
                assert _read(framing, s, payload) == payload
            wait_for(lambda: all(sum(n for _, n, _ in log if n >= 1000) >= len(payload)
                                 for log in logs), what="every session's writes recorded")
            sources = [_sources(log, payload) for log in logs]
            # one shared buffer: every session encrypted from the same addresses
            assert all(src == sources[0] for src in sources), sources
            start, end = sources[0][0][0], sources[0][-1][0] + sources[0][-1][1]
            assert end - start == len(payload)      # one contiguous buffer, read once each
            if payload is BIG:
                # above the send pool's slot size: the caller's bytes themselves
                assert start == buffer_address(BIG)[0]
            else:
                # the one copy Server.broadcast makes: into a slot of the send pool (a
                # transient per-session copy could reuse a freed address: not the pool's)
                lo, hi = _arena(srv.tx_pool)
                assert lo <= start and end <= hi, (hex(start), hex(lo), hex(hi))
            for log in logs:
                log.clear()
        assert pool.in_use == 0
        wait_for(lambda: srv.stats()["tx_slots_in_use"] == 0, what="tx slot back")
    finally:
        for s in socks:
            s.close()
