"""SendBatch's C API (``from aoprim._sendbatch cimport SendBatch``) used without the GIL.

- c_add_copy / c_add_ptr / c_flush from a compiled module, outside the package: cimport works.
- c_add_ptr sends by reference (the caller's lifetime rule: memory read at send time).
- True parallelism: several threads each pump their own batch without the GIL, and several
  threads share ONE batch (the busy guard turns collisions into -EBUSY retries); a reader
  checks every record exactly once and in per-thread order.
"""
import os
import socket
import struct
import threading

import pytest

from aoprim import SendBatch
from support import run_threads, scaled

SRC = r'''
# cython: language_level=3
from libc.errno cimport EBUSY
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from aoprim._sendbatch cimport SendBatch
from aoprim.atomic_h cimport aop_cpu_relax, aop_yield, aop_load_i64, AOP_RELAXED

cdef char PAYLOAD[100000]

def set_payload(bytes b):
    memcpy(PAYLOAD, <char *>b, len(b))

def add_static(SendBatch sb, Py_ssize_t n):
    """by reference: PAYLOAD[0:n]"""
    cdef int r
    with nogil:
        r = sb.c_add_ptr(PAYLOAD, <size_t>n)
    return r

def add_copy(SendBatch sb, bytes b):
    cdef int r
    cdef const char *p = b
    cdef size_t n = len(b)
    with nogil:
        r = sb.c_add_copy(p, n)
    return r

def flush(SendBatch sb):
    cdef Py_ssize_t r
    with nogil:
        r = sb.c_flush()
    return r

cdef inline void _flush_all(SendBatch sb) noexcept nogil:
    cdef Py_ssize_t r
    cdef int spins = 0
    while aop_load_i64(&sb.pend_bytes, AOP_RELAXED) > 0:
        r = sb.c_flush()
        if r == -EBUSY or r == 0:
            spins += 1
            if spins & 63:
                aop_cpu_relax()
            else:
                aop_yield()
        elif r < 0:
            return

def pump(SendBatch sb, uint32_t tid, uint64_t n):
    """Add n 16-byte records (tid, seq, ~seq) by copy, flushing when a threshold is hit;
    without the GIL.  Returns how many -EBUSY collisions it retried."""
    cdef uint64_t i
    cdef uint64_t busy = 0
    cdef int r
    cdef Py_ssize_t f
    cdef uint32_t rec[4]
    with nogil:
        for i in range(n):
            rec[0] = tid
            rec[1] = <uint32_t>i
            rec[2] = <uint32_t>(i >> 32)
            rec[3] = ~(<uint32_t>i)
            while True:
                r = sb.c_add_copy(rec, 16)
                if r != -EBUSY:
                    break
                busy += 1
                aop_cpu_relax()
            if r == 1:
                while True:
                    f = sb.c_flush()
                    if f != -EBUSY:
                        break
                    busy += 1
                    aop_cpu_relax()
        _flush_all(sb)
    return busy
'''


@pytest.fixture(scope="module")
def mod(cybuild):
    return cybuild("sb_nogil", SRC)


def recv_exact(sock, n):
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(1 << 20, n - len(out)))
        assert chunk
        out += chunk
    return bytes(out)


def test_c_api_copy_ptr_flush(mod):
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, max_msgs=3, auto_flush=False)
        payload = os.urandom(100000)
        mod.set_payload(payload)
        assert mod.add_copy(sb, b"hdr:") == 0
        assert mod.add_static(sb, 5000) == 0
        assert mod.add_copy(sb, b"") == 0            # empty: nothing added
        assert mod.add_copy(sb, b"end") == 1         # max_msgs reached: the caller flushes
        assert len(sb) == 3 and sb.pending_bytes == 5007
        # the pointer is read at send time (c_add_ptr does not copy): lifetime rule
        mod.set_payload(b"X" * 10)
        assert mod.flush(sb) == 5007
        assert recv_exact(b, 5007) == b"hdr:" + b"X" * 10 + payload[10:5000] + b"end"
        assert mod.flush(sb) == 0
        st = sb.stats
        assert st["syscalls"] == 1 and st["messages"] == 3
        # mixing Python-owned messages (released by c_flush, which takes the GIL for it)
        big = bytearray(os.urandom(50000))
        sb.add(big)
        mod.add_copy(sb, b"!")
        assert mod.flush(sb) == 50001
        big += b"resizable again"                     # the export was released
        assert recv_exact(b, 50001) == bytes(big[:50000]) + b"!"
        # errors come back as -errno with pending intact
        b.close()
        mod.add_copy(sb, b"lost peer")
        r = mod.flush(sb)
        assert r in (-32, -104) and sb.pending_bytes == 9    # -EPIPE / -ECONNRESET
    finally:
        a.close()
        b.close()


def test_c_api_closed_socket_gives_ebadf(mod):
    a, b = socket.socketpair()
    sb = SendBatch(a, auto_flush=False)
    mod.add_copy(sb, b"x")
    a.close()
    b.close()
    assert mod.flush(sb) == -9                               # -EBADF
    assert sb.pending_bytes == 1


def _reader(sock, total_records, seen, nthreads):
    def run():
        buf = recv_exact(sock, 16 * total_records)
        nxt = [0] * nthreads
        for off in range(0, len(buf), 16):
            tid, lo, hi, inv = struct.unpack_from("<IIII", buf, off)
            seq = lo | (hi << 32)
            assert inv == (~lo) & 0xFFFFFFFF, "torn record"
            assert seq == nxt[tid], f"thread {tid}: got {seq}, expected {nxt[tid]}"
            nxt[tid] += 1
        seen.extend(nxt)
    return run


def test_parallel_pumps_own_batches(mod):
    nthreads, n = 2, scaled(100000)
    pairs = [socket.socketpair() for _ in range(nthreads)]
    try:
        batches = [SendBatch(a, max_msgs=16) for a, _ in pairs]
        seens = [[] for _ in range(nthreads)]
        tasks = [(lambda i=i: mod.pump(batches[i], 0, n)) for i in range(nthreads)]
        tasks += [_reader(pairs[i][1], n, seens[i], 1) for i in range(nthreads)]
        run_threads(tasks, timeout=60)
        for i in range(nthreads):
            assert seens[i] == [n]
            st = batches[i].stats
            assert st["messages"] == n and st["bytes"] == 16 * n
            assert st["syscalls"] <= n // 16 + 2 * (st["would_block"] + st["partial_writes"]) + 2
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_parallel_threads_share_one_batch(mod):
    nthreads, n = 3, scaled(50000)
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, max_msgs=16)
        seen = []
        busy = []
        tasks = [(lambda t=t: busy.append(mod.pump(sb, t, n))) for t in range(nthreads)]
        tasks.append(_reader(b, nthreads * n, seen, nthreads))
        run_threads(tasks, timeout=60)
        assert seen == [n] * nthreads                # every record once, in per-thread order
        st = sb.stats
        assert st["messages"] == nthreads * n and st["bytes"] == 16 * nthreads * n
        assert sb.pending_bytes == 0 and len(sb) == 0
    finally:
        a.close()
        b.close()


def test_python_entry_refused_while_c_thread_inside(mod):
    """A Python add() while a C thread holds the batch: RuntimeError, never corruption."""
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, max_msgs=16)
        seen = []
        refused = []
        done = threading.Event()
        n = scaled(20000)       # each message contends for the batch with the Python side

        def py_side():
            while not done.is_set():
                try:
                    sb._write_limit = 0                # claims the batch briefly
                except RuntimeError:
                    refused.append(1)

        def c_side():
            try:
                mod.pump(sb, 0, n)
            finally:
                done.set()

        run_threads([c_side, py_side, _reader(b, n, seen, 1)], timeout=60)
        assert seen == [n]
    finally:
        a.close()
        b.close()


def test_c_flush_rereads_the_fd_after_taking_the_gil(mod):
    """c_flush takes the GIL to release sent objects; a release that closes the
    socket and reuses its number must end the flush with -EBADF, not write to the newcomer."""
    import errno
    import aoprim
    from test_sendbatch import _stale_fd_setup, recv_exact, recv_nowait
    a, b, c, d, slot, sb, n = _stale_fd_setup()
    iov_max = aoprim._sendbatch.IOV_MAX
    try:
        assert mod.flush(sb) == -errno.EBADF
        assert slot.refs == 1 and recv_nowait(d) == b""
        assert len(recv_exact(b, iov_max)) == iov_max
        assert sb.pending_bytes == n - iov_max and sb.stats["syscalls"] == 1
        sb.clear()
    finally:
        if slot.__dict__.get("reused") is not None:
            os.close(slot.reused)
        for s in (a, b, c, d):
            s.close()
