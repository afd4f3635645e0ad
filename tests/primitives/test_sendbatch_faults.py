"""SendBatch under injected faults, against a model (hypothesis).

Faults, without touching the batch's code:
- short writes: the ``_write_limit`` test hook (a kernel that takes at most N bytes);
- EAGAIN: small socket / pipe buffers and a peer that reads random amounts;
- ENOTSOCK: an int fd that is a pipe (the batch falls back to writev);
- EINTR: SIGALRM (setitimer) while a flush blocks on a full blocking pipe; the Python flush
  runs the handler and retries, and an exception from the handler propagates with the data
  intact; the C flush (c_flush, from a module built by the cybuild fixture) retries silently.
Model: the stream of bytes added, cut into what the peer must receive (in order) and what
is pending; pending_bytes / pending_msgs exact after every step; every Slot added is
retained while pending and released exactly once (refs back to the caller's 1; a second
release would raise inside the batch and fail the test as an unraisable exception).

Mutations this catches (each tried on a scratch build, see the commit message): _advance not
trimming a partly written segment (bytes sent twice) and the message count not retired.
"""
import errno
import fcntl
import os
import signal
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from aoprim import SendBatch, SlabPool

EXAMPLES = int(os.environ.get("AOPRIM_MODEL_EXAMPLES", "100"))
PATTERN = bytes(range(251))          # no two nearby bytes alike: a resent or skipped byte shows


def pattern(n, c):
    return (PATTERN * (n // 251 + 2))[c % 251:c % 251 + n]


def _nonblocking(fd):
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)


def _blocking(fd):
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)


class Peer:
    """The reading end: a socket or a pipe, read in random amounts without blocking."""

    def __init__(self, kind):
        if kind == "pipe":
            r, w = os.pipe()
            _nonblocking(r)
            _nonblocking(w)
            fcntl.fcntl(w, 1031, 4096)           # F_SETPIPE_SZ: one page, EAGAIN comes soon
            self.rfd, self.wfd, self.socks = r, w, None
            self.target = w
        else:
            a, b = socket.socketpair()
            for s in (a, b):
                s.setblocking(False)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.socks = (a, b)
            self.rfd = b.fileno()
            self.target = a if kind == "socket" else a.fileno()
        self.got = bytearray()

    def read(self, n):
        try:
            self.got += os.read(self.rfd, max(1, n))
        except BlockingIOError:
            pass

    def drain(self):
        while True:
            try:
                chunk = os.read(self.rfd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.got += chunk

    def close(self):
        if self.socks:
            for s in self.socks:
                s.close()
        else:
            os.close(self.rfd)
            os.close(self.wfd)


class Model:
    def __init__(self, kind, copy_max):
        self.peer = Peer(kind)
        self.b = SendBatch(self.peer.target, auto_flush=False, copy_max=copy_max)
        self.pool = SlabPool(512, 8)
        self.sent = bytearray()          # what the peer must have received, in order
        self.pending = bytearray()
        self.msgs = []                   # lengths of the pending messages (first may be cut)
        self.slots = []                  # [slot, stream offset just past it]
        self.added = 0

    def check(self):
        b = self.b
        assert b.pending_bytes == len(self.pending)
        assert b.pending_msgs == len(self.msgs) == len(b)
        for s, end in self.slots:
            # retained while any of its bytes is unsent, released exactly once after
            assert s.refs == (2 if end > self.added - len(self.pending) else 1), (s, end)

    def add(self, kind, n, c):
        data = pattern(n, c)
        if kind == "slot":
            s = self.pool.try_acquire()
            if s is None:
                return
            n = min(n, s.size)
            data = data[:n]
            memoryview(s)[:n] = data
            s.length = n
            self.b.add(s)
            if n:
                self.slots.append([s, self.added + n])
            else:
                s.release()
        elif kind == "bytearray":
            self.b.add(bytearray(data))
        elif kind == "memoryview":
            self.b.add(memoryview(bytearray(data))[1:] if n else memoryview(b""))
            data = data[1:]
        else:
            self.b.add(data)
        n = len(data)
        if n:
            self.pending += data
            self.msgs.append(n)
            self.added += n

    def flush(self):
        n = self.b.flush()
        assert 0 <= n <= len(self.pending)
        self.took(n)
        return n

    def took(self, n):
        self.sent += self.pending[:n]
        del self.pending[:n]
        while n and self.msgs:
            if n >= self.msgs[0]:
                n -= self.msgs.pop(0)
            else:
                self.msgs[0] -= n
                n = 0

    def clear(self):
        # cleared bytes are never sent; every slot pending is released (refs back to 1)
        self.b.clear()
        self.pending.clear()
        self.msgs.clear()

    def finish(self):
        for _ in range(10000):
            if not self.pending:
                break
            self.flush()
            self.peer.drain()
        self.peer.drain()
        assert not self.pending
        assert bytes(self.peer.got) == bytes(self.sent), "the peer got other bytes than added"
        self.check()
        for s, _ in self.slots:
            s.release()
        assert self.pool.in_use == 0
        self.peer.close()


STEP = st.tuples(st.sampled_from(["add", "add", "add", "flush", "flush", "read", "limit",
                                  "clear"]),
                 st.sampled_from(["bytes", "bytearray", "memoryview", "slot"]),
                 st.integers(0, 6000), st.integers(0, 255))


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(["socket", "fd", "pipe"]), st.sampled_from([0, 64, 2048]),
       st.lists(STEP, min_size=5, max_size=60))
def test_sendbatch_faults_match_model(kind, copy_max, steps):
    m = Model(kind, copy_max)
    for op, what, n, c in steps:
        if op == "add":
            m.add(what, n % (3000 if c % 4 else 40), c)
        elif op == "flush":
            m.flush()
        elif op == "read":
            m.peer.read(n)
        elif op == "limit":
            m.b._write_limit = 0 if c % 3 == 0 else 1 + n % 700
        elif op == "clear":
            m.clear()
        m.check()
    m.finish()


def test_bytearray_pinned_while_pending_released_after():
    """A bytearray sent by reference cannot be resized while pending (its export is held)."""
    m = Model("socket", 0)
    data = bytearray(b"x" * 100000)
    m.b.add(data)
    m.b._write_limit = 1000
    assert m.b.flush() == 1000
    with pytest.raises(BufferError):
        data.append(1)
    m.b._write_limit = 0
    while m.b.pending_bytes:
        m.b.flush()
        m.peer.drain()
    data.append(1)                       # the export is gone
    m.peer.drain()
    assert bytes(m.peer.got) == b"x" * 100000
    m.peer.close()


# ---- EINTR --------------------------------------------------------------------------------

def _full_blocking_pipe():
    r, w = os.pipe()
    _nonblocking(w)
    while True:                                  # fill it: the next write blocks
        try:
            os.write(w, b"f" * 4096)
        except BlockingIOError:
            break
    prefill = 0
    _nonblocking(r)
    while True:                                  # how much is in it
        try:
            n = len(os.read(r, 1 << 20))
        except BlockingIOError:
            break
        prefill += n
    while True:                                  # and fill it again (same amount)
        try:
            os.write(w, b"f" * 4096)
        except BlockingIOError:
            break
    _blocking(r)
    _blocking(w)
    return r, w, prefill


def _reader(r, total, after, out):
    # SIGALRM must interrupt the writer (the main thread), never this reader
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(after)
    got = bytearray()
    while len(got) < total:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        got += chunk
    out.append(bytes(got))


@pytest.fixture
def alarm():
    calls = []
    raise_next = []

    def handler(signum, frame):
        calls.append(signum)
        if raise_next:
            raise raise_next.pop()
    old = signal.signal(signal.SIGALRM, handler)
    signal.siginterrupt(signal.SIGALRM, True)      # no SA_RESTART: a blocked write sees EINTR
    try:
        yield calls, raise_next
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.timeout(60)
def test_eintr_python_flush_retries_and_keeps_order(alarm):
    calls, _ = alarm
    r, w, prefill = _full_blocking_pipe()
    payload = bytes(range(256)) * 800              # 200 KiB: several pipe-fulls
    b = SendBatch(w, auto_flush=False)
    b.add(b"head")
    b.add(payload)
    out = []
    t = threading.Thread(target=_reader, args=(r, prefill + 4 + len(payload), 0.3, out))
    t.start()
    signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
    try:
        while b.pending_bytes:
            b.flush()                              # blocks; SIGALRM interrupts it (EINTR)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        t.join(30)
    assert out and out[0] == b"f" * prefill + b"head" + payload
    assert calls, "no SIGALRM arrived during the flush"
    # ~15 alarms while the write was blocked: each is one interrupted (EINTR) syscall that
    # was retried; without EINTR this flush takes a handful of writes
    assert b.stats["syscalls"] >= 8, (b.stats, len(calls))
    assert b.pending_bytes == 0 and b.pending_msgs == 0
    os.close(r)
    os.close(w)


@pytest.mark.timeout(60)
def test_eintr_handler_exception_propagates_with_data_intact(alarm):
    calls, raise_next = alarm
    r, w, prefill = _full_blocking_pipe()
    b = SendBatch(w, auto_flush=False)
    b.add(b"a" * 5000)
    b.add(b"b" * 7)
    raise_next.append(KeyboardInterrupt("from the handler"))
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    with pytest.raises(KeyboardInterrupt):
        b.flush()                                  # blocked on the full pipe until SIGALRM
    assert b.pending_bytes == 5007 and b.pending_msgs == 2
    out = []
    t = threading.Thread(target=_reader, args=(r, prefill + 5007, 0.0, out))
    t.start()
    while b.pending_bytes:
        b.flush()
    t.join(30)
    assert out[0] == b"f" * prefill + b"a" * 5000 + b"b" * 7
    os.close(r)
    os.close(w)


C_SRC = '''
from aoprim._sendbatch cimport SendBatch

def add_copy(SendBatch sb, bytes data):
    cdef const char *p = data
    cdef size_t n = len(data)
    cdef int r
    with nogil:
        r = sb.c_add_copy(p, n)
    return r

def flush(SendBatch sb):
    cdef Py_ssize_t r
    with nogil:
        r = sb.c_flush()
    return r
'''


@pytest.fixture(scope="module")
def cmod(cybuild):
    return cybuild("sb_faults", C_SRC)


@settings(max_examples=max(10, EXAMPLES // 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "add", "flush", "read", "limit"]),
                          st.integers(0, 9000), st.integers(0, 255)), max_size=50))
def test_c_api_on_a_pipe_matches_model(cmod, steps):
    """c_add_copy / c_flush on a pipe fd (ENOTSOCK -> writev), short writes, EAGAIN."""
    peer = Peer("pipe")
    b = SendBatch(peer.target, auto_flush=False)
    sent, pending, nmsgs = bytearray(), bytearray(), []
    for op, n, c in steps:
        if op == "add":
            data = pattern(n % 3000, c)
            r = cmod.add_copy(b, data)
            assert r in (0, 1), r
            if data:
                pending += data
                nmsgs.append(len(data))
        elif op == "flush":
            r = cmod.flush(b)
            assert 0 <= r <= len(pending), r
            sent += pending[:r]
            del pending[:r]
            while r and nmsgs:
                if r >= nmsgs[0]:
                    r -= nmsgs.pop(0)
                else:
                    nmsgs[0] -= r
                    r = 0
        elif op == "read":
            peer.read(n)
        else:
            b._write_limit = 0 if c % 3 == 0 else 1 + n % 700
        assert b.pending_bytes == len(pending) and b.pending_msgs == len(nmsgs)
    while pending:
        r = cmod.flush(b)
        assert r >= 0, -r
        sent += pending[:r]
        del pending[:r]
        peer.drain()
    peer.drain()
    assert bytes(peer.got) == bytes(sent)
    peer.close()


@pytest.mark.timeout(60)
def test_eintr_c_flush_retries_silently(alarm, cmod):
    calls, _ = alarm
    r, w, prefill = _full_blocking_pipe()
    b = SendBatch(w, auto_flush=False)
    payload = b"c" * 100000
    assert cmod.add_copy(b, payload) in (0, 1)
    out = []
    t = threading.Thread(target=_reader, args=(r, prefill + len(payload), 0.3, out))
    t.start()
    signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
    try:
        while b.pending_bytes:
            n = cmod.flush(b)                       # nogil; EINTR retried inside
            assert n >= 0, os.strerror(-n)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        t.join(30)
    assert out[0] == b"f" * prefill + payload
    assert calls                                    # the handler ran once back in Python
    os.close(r)
    os.close(w)
