"""The compiled core under hostile input: hostile offsets, counts and failure paths in the compiled
modules change nothing and raise a clear exception (never a crash, a leak or a half-done
operation)."""
import pytest

from aoprim import BlockTable, SlabPool

pytestmark = pytest.mark.timeout(60)

HUGE = [2**63 - 1, 2**63 - 8, 2**63, 2**64 + 5, 10**30, -1, -2**63, -2**63 - 1, -10**30]


@pytest.fixture
def table():
    pool = SlabPool(64, 8)
    t = BlockTable(pool)
    t.append(bytes(range(100)))
    yield t
    t.release()


@pytest.mark.parametrize("pos", HUGE)
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_blocktable_uint_huge_or_negative_pos_raises(table, pos, size):
    # p + n > nbytes overflows for p near 2**63: the check must not let a read go out of bounds
    with pytest.raises(ValueError):
        table.uint(pos, size)
    assert table.uint(100 - size, size) == int.from_bytes(bytes(range(100 - size, 100)), "big")
    with pytest.raises(ValueError):
        table.uint(101 - size, size)


@pytest.mark.parametrize("pos", HUGE)
def test_blocktable_frame_huge_or_negative_pos_raises(table, pos):
    with pytest.raises(ValueError):
        table.frame(pos, 8)


@pytest.mark.parametrize("n", HUGE)
def test_blocktable_consume_commit_huge_raise_and_change_nothing(table, n):
    with pytest.raises(ValueError):
        table.consume(n)
    with pytest.raises(ValueError):
        table.commit(n)
    assert len(table) == 100 and table.read() == bytes(range(100))


@pytest.mark.parametrize("a", HUGE + [0, 50, 100])
@pytest.mark.parametrize("b", HUGE + [None, 0, 50, 100])
def test_blocktable_view_read_clamp_like_slices(table, a, b):
    ref = bytes(range(100))[a:b]
    assert table.read(a, b) == ref
    assert bytes(table.view(a, b)) == ref


# ---- RefCount at INT64_MAX ---------------------------------------------------------------

def test_refcount_incref_at_int64_max_changes_nothing():
    from aoprim import RefCount
    r = RefCount(2**63 - 1)
    with pytest.raises(OverflowError):
        r.incref()
    assert r.count == 2**63 - 1            # unchanged: one more would wrap to -2**63
    with pytest.raises(OverflowError):
        r.try_incref()
    assert r.count == 2**63 - 1
    assert r.decref() == 2**63 - 2
    assert r.incref() == 2**63 - 1
    assert RefCount(0).try_incref() is False


def test_refcount_incref_at_max_from_threads_never_wraps():
    import threading
    from aoprim import RefCount
    r = RefCount(2**63 - 100)
    ok = [0] * 4
    over = [0] * 4

    def worker(i):
        for _ in range(200):
            try:
                r.incref()
                ok[i] += 1
            except OverflowError:
                over[i] += 1

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert sum(ok) == 99 and sum(over) == 800 - 99
    assert r.count == 2**63 - 1


# ---- a failed SendBatch.add_frame adds nothing -------------------------------------------

import socket
import sys

from aoprim import SendBatch


class _SlotLike(bytearray):
    """A slot-like object (buffer + retain/release/length) whose hooks can fail."""

    def __init__(self, data, retain_exc=None, length_seq=None):
        super().__init__(data)
        self._retain_exc = retain_exc
        self._lengths = list(length_seq) if length_seq else None
        self.length_reads = 0
        self.refs = 1

    @property
    def length(self):
        self.length_reads += 1
        if self._lengths:
            return self._lengths.pop(0)
        return len(self)

    def retain(self):
        if self._retain_exc is not None:
            raise self._retain_exc
        self.refs += 1

    def release(self):
        self.refs -= 1


def _frames_after_failure(make_bad):
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, auto_flush=False, copy_max=16)
        sb.add_frame(b"first", 2)
        before = (sb.pending_bytes, sb.pending_msgs)
        bad = make_bad()
        with pytest.raises(BaseException) as ei:
            sb.add_frame(bad, 4)
        assert (sb.pending_bytes, sb.pending_msgs) == before     # nothing added
        big = bytes(range(40))
        sb.add_frame(big, 2)
        sb.flush()
        b.settimeout(5)
        got = b.recv(1000)
        assert got == b"\x00\x05first" + b"\x00\x28" + big         # no orphan header
        return ei.value, bad
    finally:
        a.close()
        b.close()


def test_add_frame_released_slot_adds_nothing():
    pool = SlabPool(64, 2)
    s = pool.acquire()
    memoryview(s)[:40] = bytes(40)
    s.length = 40
    s.release()
    exc, _ = _frames_after_failure(lambda: s)
    assert isinstance(exc, (BufferError, ValueError))


@pytest.mark.parametrize("exc_type", [MemoryError, KeyError, KeyboardInterrupt])
def test_add_frame_slot_retain_raising_adds_nothing(exc_type):
    exc, bad = _frames_after_failure(lambda: _SlotLike(bytes(40), retain_exc=exc_type()))
    assert isinstance(exc, exc_type)
    assert bad.refs == 1


def test_add_frame_reads_slot_length_once():
    # the header says what is sent: a length that changes between reads cannot split them
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, auto_flush=False, copy_max=0)
        # (the slot-like check's hasattr() reads it too, before anything is decided)
        s = _SlotLike(bytes(range(40)), length_seq=[30, 20, 10, 5])
        sb.add_frame(s, 2)
        sb.flush()
        b.settimeout(5)
        got = b.recv(1000)
        k = got[0] << 8 | got[1]
        assert got == got[:2] + bytes(range(k))             # header and payload agree
    finally:
        a.close()
        b.close()


def test_add_frame_slot_bad_length_adds_nothing():
    exc, bad = _frames_after_failure(lambda: _SlotLike(bytes(40), length_seq=[-1, -1]))
    assert isinstance(exc, ValueError) and bad.refs == 1
    exc, bad = _frames_after_failure(lambda: _SlotLike(bytes(40), length_seq=[2**70, 2**70]))
    assert isinstance(exc, (ValueError, OverflowError)) and bad.refs == 1


# ---- a socket closed (and its number reused) during the GIL-free write -------------------

import select
import threading


def test_no_group_write_reaches_a_reused_fd_number():
    """One group flush writes batch 1 (a blocking socket whose peer is not reading: the
    write blocks, the GIL released) then batch 2.  Meanwhile another thread closes batch 2's
    socket and opens sockets until one takes its fd number, then lets batch 1's write finish.
    Batch 2's bytes must never reach the new socket (a cross-connection leak): the pin makes
    that close wait until the flush is done."""
    from aoprim import FlushGroup
    s1, p1 = socket.socketpair()
    s2, p2 = socket.socketpair()
    s1.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s1.setblocking(True)
    s2.setblocking(False)
    fd2 = s2.fileno()
    g = FlushGroup()
    b1 = SendBatch(s1, auto_flush=False)
    b2 = SendBatch(s2, auto_flush=False)
    g.attach(b1, "b1")
    g.attach(b2, "b2")
    big = b"B" * (1 << 20)
    b1.add(big)                          # fills s1's buffer: the write blocks
    b2.add(b"SECRET" * 10)
    taken = []
    got1 = bytearray()
    done = threading.Event()

    def closer():
        # wait until the flush is inside batch 1's write (blocked: p1 has bytes waiting)
        select.select([p1], [], [], 10)
        s2.close()
        for _ in range(8):
            x, y = socket.socketpair()
            taken.append((x, y))
            if fd2 in (x.fileno(), y.fileno()):
                break
        p1.settimeout(10)
        while len(got1) < len(big):
            got1.extend(p1.recv(1 << 16))
        done.set()

    import select
    t = threading.Thread(target=closer)
    t.start()
    g.flush()
    t.join(30)
    assert done.is_set()
    leaked = 0
    for x, y in taken:
        for s in (x, y):
            s.setblocking(False)
            try:
                leaked += len(s.recv(1 << 16))
            except BlockingIOError:
                pass
            s.close()
    assert leaked == 0
    assert s2.fileno() == -1             # the deferred close happened after the flush
    for s in (s1, p1, p2):
        s.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["flush", "group"])
def test_close_during_flush_is_deferred_then_done(kind):
    """The pin's visible effect: a socket.close() that lands while a flush is writing takes
    effect when the write returns; close() before the flush makes the flush EBADF."""
    from aoprim import FlushGroup
    a, b = socket.socketpair()
    sb = SendBatch(a, auto_flush=False)
    g = FlushGroup()
    g.attach(sb, "o")
    a.close()
    sb.add(b"x")
    if kind == "flush":
        with pytest.raises(OSError):
            sb.flush()
    else:
        import errno
        assert g.flush() == [("o", -errno.EBADF)]
    assert a.fileno() == -1
    b.close()


PIN_SRC = """
from aoprim._sendbatch cimport _sock_pin, _sock_unpin
def pin(s):
    return _sock_pin(s)
def unpin(s):
    _sock_unpin(s)
"""


def test_sock_pin_return_values_and_deferred_close(cybuild):
    """_sock_pin's contract (its docstring): 1 pinned and open, 0 pinned but close() already
    called, 2 pinning switched off (nothing taken); a failed pin changes nothing; the last
    unpin after a close() closes the fd."""
    import aoprim._sendbatch as sbm
    m = cybuild("pinprobe", PIN_SRC)
    a, b = socket.socketpair()
    assert m.pin(a) == 1 and a._io_refs == 1
    a.close()
    assert a.fileno() >= 0               # deferred: pinned
    assert m.pin(a) == 0 and a._io_refs == 2
    m.unpin(a)
    assert a.fileno() >= 0 and a._io_refs == 1
    m.unpin(a)
    assert a.fileno() == -1 and a._io_refs == 0
    c, d = socket.socketpair()
    c._io_refs = 0.5                     # not an int: refused, nothing stored
    with pytest.raises(TypeError):
        m.pin(c)
    assert c._io_refs == 0.5
    c._io_refs = 0
    sbm._set_pinning(False)
    try:
        assert m.pin(c) == 2 and c._io_refs == 0
        m.unpin(c)
        assert c._io_refs == 0
    finally:
        sbm._set_pinning(True)
    for s in (b, c, d):
        s.close()


class _RefsProperty(socket.socket):
    """close() would read this property, not the slot a pin writes."""
    @property
    def _io_refs(self):
        return 0

    @_io_refs.setter
    def _io_refs(self, v):
        pass


class _OwnSetattr(socket.socket):
    def __setattr__(self, k, v):
        object.__setattr__(self, k, v)


class _PlainSub(socket.socket):
    def describe(self):
        return "a subclass that only adds methods"


@pytest.mark.parametrize("cls", [_RefsProperty, _OwnSetattr])
def test_socket_subclass_that_bypasses_the_pinned_slots_is_refused(cls):
    """The pin writes socket.socket's `_io_refs` slot in one critical section; a subclass
    whose close() would read something else (a property, its own __setattr__) cannot be
    pinned, so the batch refuses it (before: accepted, and pinned through a property whose
    Python code could let another thread in between the read and the write)."""
    s = cls(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(TypeError, match="pin"):
            SendBatch(s)
    finally:
        socket.socket.close(s)


def test_plain_socket_subclass_is_pinned():
    a, b = socket.socketpair()
    s = _PlainSub(fileno=a.detach())
    sb = SendBatch(s, auto_flush=False)
    sb.add(b"hello")
    assert sb.flush() == 5 and b.recv(10) == b"hello"
    assert s._io_refs == 0
    s.close()
    b.close()


def test_group_does_not_unpin_a_socket_it_could_not_pin(capfd):
    """A socket whose `_io_refs` is not an int cannot be pinned (nothing taken): the group
    reports it EBADF and must not 'unpin' it afterwards -- that would drop a reference it
    never held (another holder's: a makefile() file, another batch's pin); here it failed
    again and was reported as an ignored exception."""
    import errno
    from aoprim import FlushGroup
    a, b = socket.socketpair()
    sb = SendBatch(a, auto_flush=False)
    g = FlushGroup()
    g.attach(sb, "o")
    sb.add(b"x")
    a._io_refs = 0.0                     # hostile: a float
    capfd.readouterr()
    assert g.flush() == [("o", -errno.EBADF)]
    assert "Exception ignored" not in capfd.readouterr().err
    assert a._io_refs == 0.0
    a._io_refs = 0
    assert sb.flush() == 1 and b.recv(10) == b"x"
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_pins_of_many_batches_on_one_socket_never_lose_an_update():
    """Four threads, each with its own batch on ONE socket, flush concurrently (each flush
    pins and unpins it) while, with the GIL, a fifth thread makes and closes makefile()
    files on it (the same counter, from Python).  Every byte arrives, and at the end `_io_refs` is 0 and
    close() closes the fd at once: no increment or decrement was lost.  (With the GIL the
    pin was already one step; on a free-threaded build this is what the pin's critical
    section buys.)"""
    a, b = socket.socketpair()
    a.setblocking(True)
    T, N, MSG = 4, 3000, b"0123456789abcdef"
    got = [0]
    stop = threading.Event()
    errors = []

    def reader():
        want = T * N * len(MSG)
        b.settimeout(30)
        while got[0] < want:
            got[0] += len(b.recv(1 << 16))

    def writer():
        try:
            sb = SendBatch(a, auto_flush=False)
            for _ in range(N):
                sb.add(MSG)
                sb.flush()
                assert sb.pending_bytes == 0
        except BaseException as e:       # noqa: BLE001 -- reported below
            errors.append(e)

    def files():
        # makefile()'s `self._io_refs += 1` is a load, then a store, in Python: on a
        # free-threaded build a pin can land between the two and be overwritten (as a second
        # makefile() on another thread can be: CPython's socket.py), so there only the four
        # batches' pins race each other; with the GIL the two steps cannot be split
        if getattr(sys, "_is_gil_enabled", lambda: True)():
            while not stop.is_set():
                a.makefile("wb").close()

    ts = [threading.Thread(target=writer) for _ in range(T)]
    rt = threading.Thread(target=reader)
    ft = threading.Thread(target=files)
    for t in ts + [rt, ft]:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    ft.join()
    rt.join()
    assert not errors
    assert got[0] == T * N * len(MSG)
    assert a._io_refs == 0
    a.close()
    assert a.fileno() == -1
    b.close()


# ---- the lone-batch fast path must not block with the GIL held ---------------------------

@pytest.mark.timeout(30, method="thread")     # a deadlock holds the GIL: signals cannot fire
def test_group_flush_of_a_socket_switched_to_blocking_does_not_hold_the_gil():
    """Attached while non-blocking (the group may then write it alone without releasing the
    GIL), then switched to blocking: the write blocks until the reader thread -- which
    needs the GIL -- drains the peer.  Holding the GIL across it would be a deadlock."""
    from aoprim import FlushGroup
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.setblocking(False)
    g = FlushGroup()
    sb = SendBatch(a, auto_flush=False)
    g.attach(sb, "o")
    a.setblocking(True)
    data = b"z" * (1 << 20)
    sb.add(data)
    got = bytearray()

    def reader():
        b.settimeout(20)
        while len(got) < len(data):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    r = g.flush()
    while r is not None and sb.pending_bytes:
        g.requeue(sb)
        r = g.flush()
    t.join(20)
    assert bytes(got) == data
    a.close()
    b.close()


# ---- the lone write takes no pin (GIL builds): what the pin reported, it must report too ---

@pytest.mark.timeout(30)
@pytest.mark.parametrize("lone", [True, False])
def test_group_write_to_a_socket_closed_under_a_makefile_reports_ebadf(lone):
    """close() while a makefile() file holds the socket sets `_closed` but keeps the fd
    open.  A pin saw `_closed` and the flush wrote nothing (EBADF); the unpinned lone write
    (one non-blocking batch, GIL held) must read `_closed` itself -- without that check it
    wrote to the closed socket's still-open fd.  Alongside a second batch the pinned path
    runs instead, and the same must hold."""
    import errno
    from aoprim import FlushGroup
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    a.setblocking(False)
    c.setblocking(False)
    g = FlushGroup()
    sb = SendBatch(a, auto_flush=False)
    g.attach(sb, "a")
    f = a.makefile("wb")
    a.close()
    assert a.fileno() >= 0               # held open by the file
    sb.add(b"after close")
    if not lone:
        sc = SendBatch(c, auto_flush=False)
        g.attach(sc, "c")
        sc.add(b"to c")
    assert g.flush() == [("a", -errno.EBADF)]
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(100)
    if not lone:
        assert d.recv(100) == b"to c"
    assert a._io_refs == 1               # the file's reference: no pin left behind
    f.close()
    assert a.fileno() == -1
    for s in (b, c, d):
        s.close()


def test_lone_group_write_leaves_no_pin_and_a_later_close_is_immediate():
    """The lone write (one non-blocking batch): delivered, no GIL release, `_io_refs` back
    at 0, so a close() right after closes the fd at once."""
    from aoprim import FlushGroup
    a, b = socket.socketpair()
    a.setblocking(False)
    g = FlushGroup()
    sb = SendBatch(a, auto_flush=False)
    g.attach(sb, "a")
    sb.add(b"hello")
    assert g.flush() is None
    assert g.stats["gil_releases"] == 0
    assert b.recv(100) == b"hello"
    assert a._io_refs == 0
    a.close()
    assert a.fileno() == -1
    b.close()


# ---- ReadBuffer never blocks with the GIL held --------------------------------------------

@pytest.mark.timeout(30, method="thread")     # a recv blocking with the GIL held hangs all
def test_readbuffer_on_a_blocking_socket_does_not_block():
    from aoprim.aio._readbuf import ReadBuffer
    rb = ReadBuffer(4096)
    a, b = socket.socketpair()
    a.setblocking(True)
    try:
        with pytest.raises(BlockingIOError):
            rb.recv_bytes(a)                 # nothing to read: refused at once
        b.sendall(b"hello")
        assert rb.recv_bytes(a) == b"hello"
        b.close()
        assert rb.recv_bytes(a) == b""
    finally:
        a.close()


# ---- a cycle through a pending owner of a SendBatch is collected --------------------------

@pytest.mark.parametrize("target", ["batch", "session"])
def test_gc_collects_a_cycle_through_a_pending_slot(target):
    import gc
    import weakref

    class Session:
        pass

    class SlotLike(bytearray):
        length = 100

        def retain(self):
            pass

        def release(self):
            pass

    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, auto_flush=False, copy_max=0)     # the slot goes by reference
        s = SlotLike(b"x" * 100)
        if target == "batch":
            s.back = sb                                     # slot -> batch -> slot
        else:
            sess = Session()
            sess.batch = sb
            s.back = sess                                   # slot -> session -> batch -> slot
            del sess
        sb.add(s)
        assert sb.pending_bytes == 100
        wr = weakref.ref(sb)
        ws = weakref.ref(s)
        del sb, s
        gc.collect()
        assert wr() is None and ws() is None
    finally:
        a.close()
        b.close()


def test_slot_release_raising_keyboardinterrupt_is_reported_unraisable():
    """Documented: a slot's release() that raises -- KeyboardInterrupt too -- is reported to
    sys.unraisablehook; the flush completes, every other release runs, nothing is lost."""
    import sys

    class SlotLike(bytearray):
        length = 50

        def __init__(self, data, exc):
            super().__init__(data)
            self.exc = exc
            self.released = 0

        def retain(self):
            pass

        def release(self):
            self.released += 1
            if self.exc is not None:
                raise self.exc

    seen = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_type)
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, auto_flush=False, copy_max=0)
        s1 = SlotLike(b"1" * 50, KeyboardInterrupt())
        s2 = SlotLike(b"2" * 50, None)
        sb.add(s1)
        sb.add(s2)
        assert sb.flush() == 100
        assert s1.released == 1 and s2.released == 1 and sb.pending_bytes == 0
        assert seen == [KeyboardInterrupt]
        b.settimeout(5)
        assert b.recv(1000) == b"1" * 50 + b"2" * 50
    finally:
        sys.unraisablehook = old
        a.close()
        b.close()


# ---- a flush reads the socket's fd and mode from its struct --------------------------------

class _SockSub(socket.socket):
    __slots__ = ()


def test_flush_reads_fd_and_mode_from_the_socket_struct_as_the_methods_report_them():
    """FlushGroup reads a socket's fd and blocking mode from socket.socket's C struct
    (aop_sockfd.h) instead of calling fileno() / gettimeout(); differential against those
    methods over every state a socket passes through (families, a subclass, every kind of
    timeout, detach(), close(), close() under a makefile()).  The import-time layout check
    must pass on every CPython this package supports (else the flush is back on the
    methods, and slower)."""
    from aoprim._flushgroup import _sock_view
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM),
             socket.socket(socket.AF_INET6, socket.SOCK_STREAM) if socket.has_ipv6 else None,
             _SockSub(socket.AF_UNIX, socket.SOCK_STREAM), *socket.socketpair()]
    socks = [s for s in socks if s is not None]

    def check(s):
        direct, fd, nonblocking = _sock_view(s)
        assert direct, "the socket struct's layout check failed: flushes call fileno()"
        assert fd == s.fileno()
        assert nonblocking == (s.gettimeout() == 0.0)

    for s in socks:
        for t in (0.0, None, 1.5, 1e-9, 0.0, 3600.0):
            s.settimeout(t)
            check(s)
        s.setblocking(False)
        check(s)
        s.setblocking(True)
        check(s)
    f = socks[-1].makefile("wb")
    socks[-1].close()
    check(socks[-1])                     # _closed, the fd still open
    f.close()
    check(socks[-1])                     # -1 now
    __import__("os").close(socks[0].detach())
    check(socks[0])
    for s in socks:
        s.close()
        check(s)
    assert _sock_view(3) == (False, None, None)       # an int fd: not a socket object
    assert _sock_view(object()) == (False, None, None)


def test_readbuffer_reads_the_fd_from_the_socket_struct_closed_is_ebadf():
    """ReadBuffer.recv_bytes reads the socket's fd from its struct (aop_sockfd.h) as
    fileno() returns it: a subclass reads, a closed or detached socket is EBADF (never a
    recv on fd -1 or a reused number)."""
    import errno
    from aoprim.aio._readbuf import ReadBuffer
    rb = ReadBuffer(4096)
    a, b = _SockSub(socket.AF_UNIX, socket.SOCK_STREAM), None
    a.close()
    a, b = socket.socketpair()
    s = _SockSub(socket.AF_UNIX, socket.SOCK_STREAM, 0, a.detach())
    b.sendall(b"sub")
    assert rb.recv_bytes(s) == b"sub"
    with pytest.raises(OSError) as e:
        rb.recv_bytes(a)                  # detached: fileno() -1
    assert e.value.errno == errno.EBADF
    s.close()
    with pytest.raises(OSError) as e:
        rb.recv_bytes(s)
    assert e.value.errno == errno.EBADF
    b.close()
