# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""SendBatch: gather small writes and send them with one system call.

One idea, the send batch (over 800 lines): its layout, pinning and the sendmsg path share
the invariants below.

Layout (fields are documented one by one in _sendbatch.pxd):

    iov[head:nseg]   the unsent segments, ready to hand to sendmsg()/writev()
    own[head:nseg]   what keeps each segment's memory alive
    cbuf[...:cused]  the coalescing buffer small messages are copied into
    ends[mhead:mtail] the length of each pending message (4 bytes a message)

A message of at most ``copy_max`` bytes is copied to the end of ``cbuf``; when the last
segment is a copy segment ending exactly there, it just grows, so any run of small messages
is ONE segment.  A larger message becomes its own segment by reference: a bytes object is
INCREF'd, a bytearray/memoryview export is held (so a bytearray cannot be resized while
queued), a slot-like object is exported and retain()'d.

Invariants (hold whenever no thread is inside the batch, i.e. ``busy == 0``):
  I1  0 <= head <= nseg <= segcap; every segment in [head, nseg) has iov_len > 0.
  I2  sum(iov[k].iov_len for k in [head, nseg)) == added - sent == pend_bytes.
  I3  ends[mhead:mtail] holds the pending messages' lengths in order, each > 0: one entry a
      message, or -- longer than MSG_LEN -- several, all but the last flagged MSG_CONT
      (lengths masked by MSG_LEN); their sum == added - (stream offset where the message at
      mhead starts) and mfront == that start + ends[mhead] & MSG_LEN > sent; the entries
      without MSG_CONT number pend_msgs.  (Empty messages are not recorded at all.)  4
      bytes a message, not an 8-byte offset: a backlog of small messages costs half the
      bookkeeping (16-byte messages: 1.25x their bytes, not 1.5x).
  I4  copy segments are contiguous in cbuf and in segment order: the live copied bytes are
      cbuf[base of the first live copy segment : cused], and the last copy segment ends at
      cused.  So compaction is one memmove plus a rebase of the copy segments' pointers.
  I5  own[k] for k in [head, nseg) holds exactly one reference/export/retain; segments
      outside [head, nseg) hold nothing.  Each owner is released exactly once: when its
      segment is fully written, or by clear() / deallocation.
  I6  head == nseg implies head == nseg == 0 and cused == 0 (reset as soon as drained);
      then the arrays grown past their KEEP sizes are given back (_shrink_drained).

Partial writes: _advance(n) walks from ``head`` over the n written bytes, stepping past
fully written segments and trimming the first partly written one in place (iov_base += k,
iov_len -= k).  Nothing is copied again; the owners of the fully written segments are then
released (a slot's export is released BEFORE slot.release(), since a slot refuses to drop
its last reference while a view of it lives).

A flush issues one system call for up to AOP_SB_IOV_MAX (IOV_MAX, 1024) segments, and
another only if the kernel took everything offered and segments remain; a short write or
EAGAIN ends it.  So a flush is one syscall unless more than 1024 segments are pending.

FlushGroup (aoprim/_flushgroup.pyx): batches attached to a group queue themselves there
when an add leaves them with pending data, and the group's flush() writes them all with
one GIL release -- the per-iteration flush of an event loop.  It drives the batches'
internals (cursor, owners, claim) through _sendbatch.pxd; a batch sees its group only as
a _GroupBase (below), so this module does not depend on that one.

Threads: a batch belongs to one thread at a time (like the write side of a socket).  Every
entry point claims ``busy`` with an atomic exchange (acquire) and frees it with a release
store, so the next owner sees every field the previous one wrote; a second thread entering
meanwhile gets RuntimeError (Python) or -EBUSY (C) and changes nothing.  The GIL is released
during the system call, so this guard -- not the GIL -- is what keeps another thread from
reallocating the iovec array under the kernel's feet.  Counters read by other threads
(pending_*, stats) are relaxed atomics: exact when the batch is idle, approximate during.
"""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memmove, strerror
from libc.errno cimport EINTR, ENOTSOCK, ENOMEM, EBUSY, EBADF
from posix.uio cimport iovec
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.object cimport PyTypeObject
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_GET_SIZE,
                            PyBytes_FromStringAndSize)
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.number cimport PyNumber_Index
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.buffer cimport PyBUF_READ

from aoprim.atomic_h cimport (
    aop_load_i64, aop_store_i64, aop_exchange_u32, aop_store_u32, AOP_RELAXED, AOP_ACQUIRE,
    AOP_RELEASE, aop_spin_init, aop_spin_lock, aop_spin_unlock,
)
cimport cython

import socket as _socket

# Copy cut-off: messages up to this many bytes are copied into the coalescing buffer; larger
# ones go by reference as their own segment.  Chosen by bench/bench_sendbatch.py
# (test_cutoff_*): see the README section "Send batching" for the figures.
DEFAULT_COPY_MAX = 2048
IOV_MAX = AOP_SB_IOV_MAX

cdef size_t CBUF_INIT = 16384          # initial coalescing buffer
cdef size_t CBUF_KEEP = 1 << 20        # a drained buffer larger than this shrinks back
cdef Py_ssize_t SEG_INIT = 32
cdef Py_ssize_t MSG_INIT = 64
# A drained batch gives back segment and message arrays longer than these (back to *_INIT),
# as the coalescing buffer does above CBUF_KEEP: a backlog (a slow reader) must not pin its
# peak for the connection's life.  The band between INIT and KEEP is the hysteresis: a load
# that drains with fewer entries never reallocates, and one that needs more pays a shrink
# and its regrowth (a few reallocs, pages touched anew) once per drain of more than KEEP
# entries: measured, 16500 16-byte messages per drain cost 8.0 ns/msg, as 16000 (no
# shrink) do -- docs/sendbatch.md.
cdef Py_ssize_t SEG_KEEP = 1024        # 1024 x (iovec + owner) = 112 KiB
cdef Py_ssize_t MSG_KEEP = 16384       # 16384 message lengths = 64 KiB
cdef extern from *:
    """
    #define AOP_SB_MSG_CONT 0x80000000u  /* ends[k]: the message goes on in entry k + 1 */
    #define AOP_SB_MSG_LEN 0x7FFFFFFFu   /* ends[k] & MSG_LEN: the bytes of entry k */
    """
    const uint32_t MSG_CONT "AOP_SB_MSG_CONT"
    const uint32_t MSG_LEN "AOP_SB_MSG_LEN"


cdef int _c_queue(SendBatch b, int r) noexcept nogil:
    """c_add_*: queue an attached batch in its group (busy held).  Takes the GIL, only on
    the add that queues the batch.  Out of memory: returns 1, "flush now", so the data is
    not forgotten."""
    cdef int q
    with gil:
        q = b.group._queue(b)
    return 1 if q < 0 else r


# ---- the one frame-header encoder ---------------------------------------------------------
# add_frame builds every header the server sends; SendBatch.frame_header gives the same
# bytes to Python callers (aoprim.server.framing.Framing).  Both go through _put_header.

cdef Py_ssize_t _header_size(object header_size) except -1:
    if type(header_size) is not int:
        raise TypeError("header_size must be an int (2 or 4)")
    if header_size != 2 and header_size != 4:
        raise ValueError(f"header_size must be 2 or 4, not {header_size}")
    return header_size


cdef int _put_header(unsigned char *hdr, Py_ssize_t hs, Py_ssize_t n) except -1:
    """Write the hs-byte (2 or 4) big-endian length n into hdr; ValueError if n does not fit
    (n >= 0: a byte count)."""
    cdef Py_ssize_t limit = 0xFFFF if hs == 2 else 0xFFFFFFFF
    if n > limit:
        raise ValueError(f"payload of {n} bytes is too long for "
                         f"{'u16' if hs == 2 else 'u32'} framing (at most {limit})")
    if hs == 2:
        hdr[0] = (n >> 8) & 0xFF
        hdr[1] = n & 0xFF
    else:
        hdr[0] = (n >> 24) & 0xFF
        hdr[1] = (n >> 16) & 0xFF
        hdr[2] = (n >> 8) & 0xFF
        hdr[3] = n & 0xFF
    return 0


cdef int _raise_busy() except -1:
    raise RuntimeError("SendBatch is in use by another thread (a batch belongs to one thread "
                       "at a time)")


# ---- pinning a socket across a GIL-free write ----------------------------------------------
# socket.socket.close() closes the fd at once unless `_io_refs` > 0 (makefile()'s files):
# then it only sets `_closed` and the last _decref_socketios() closes it.  A flush takes such
# a reference before it reads the fd and drops it after its last write, so a close() from
# any thread meanwhile is deferred until the write is done: the number cannot be reused by
# another socket under the write.  Pin: _io_refs += 1, THEN read _closed; close(): _closed =
# True, THEN read _io_refs.  The pin's read-modify-write and its read of _closed are ONE
# critical section on the socket object (aop_sockpin.h: with the GIL, the GIL; on a
# free-threaded build Py_BEGIN_CRITICAL_SECTION(sock), the mutex every store to a slot of
# the socket holds, close()'s `_closed = True` included).  So two pins/unpins (two batches on
# one socket, or a makefile()) never lose an update, and close()'s store lands wholly before
# the section (the pin sees _closed: the flush writes nothing) or wholly after it (close()'s
# later read of _io_refs sees the pin: it defers).  The slots are read and written directly
# at socket.socket's own offsets; SendBatch.__init__ refuses a subclass whose attribute access
# would not reach them.  Not covered: socket.detach() / os.close() of the number (the
# caller's to avoid).

cdef extern from "Python.h":
    void PyErr_WriteUnraisable(object o)

cdef extern from "aop_sockpin.h":
    int aop_sockpin_init(object d_refs, object d_closed) except -1
    int aop_sockpin_type_ok(PyTypeObject *t, PyObject *io_refs, PyObject *closed) noexcept
    int aop_sock_pin(object sock) except -1
    int aop_sock_unpin(object sock) except -1
    bint aop_sock_closing(object sock) noexcept

aop_sockpin_init(_socket.socket.__dict__["_io_refs"], _socket.socket.__dict__["_closed"])


cdef object _mro_lookup(type t, str name):
    """What attribute lookup on an instance of `t` finds for `name` in the type (None:
    nothing): the first class of the MRO whose own dict has it."""
    cdef object d
    for k in t.__mro__:
        d = k.__dict__
        if name in d:
            return d[name]
    return None


cdef bint _pinnable(object sock) except -1:
    """socket.socket, or a subclass that reaches `_io_refs` / `_closed` through
    socket.socket's own slots (what close() reads is what the pin writes)."""
    cdef type t = type(sock)
    cdef object refs, closed
    if t is _socket.socket:
        return True
    refs = _mro_lookup(t, "_io_refs")
    closed = _mro_lookup(t, "_closed")
    return aop_sockpin_type_ok(<PyTypeObject *>t, <PyObject *>refs, <PyObject *>closed) != 0


cdef bint _pin_on = True


def _set_pinning(bint on):
    """Benchmark hook: turn the pin off (True: on, the default).  Off, a close() from
    another thread during a flush is NOT deferred (the fd may be reused under the write).
    A plain global: switch it only while no flush runs."""
    global _pin_on
    _pin_on = on


cdef int _sock_pin(object sock) except -1:
    """Take a close-deferring reference on socket.socket `sock` (GIL held; one critical
    section on `sock`, see above).  Returns 1 when pinned and open; 0 when pinned but close()
    was already called (_sock_unpin must still be called, and nothing written); 2 when
    pinning is turned off by _set_pinning(False) (nothing taken; _sock_unpin is then a
    no-op too).  Raises (nothing taken) if `_io_refs` is unset or not an int."""
    if not _pin_on:
        return 2
    return aop_sock_pin(sock)


cdef bint _sock_closing(object sock) noexcept:
    """close() was called on socket.socket `sock` (its `_closed` slot is True; the fd may
    still be open, held by a pin or a makefile() file).  One pointer load, no Python code:
    read here because aop_sockpin.h's slot offsets are this module's (set at import)."""
    return aop_sock_closing(sock)


cdef void _sock_unpin(object sock) noexcept:
    """Drop the reference _sock_pin took (one critical section on `sock`); if close() was
    called meanwhile, call it again now (socket.socket._decref_socketios' logic: it closes
    the fd unless another pin is still held).  An error is reported as unraisable."""
    if not _pin_on:
        return
    try:
        if aop_sock_unpin(sock):
            sock.close()
    except BaseException:
        PyErr_WriteUnraisable(sock)


cdef void _slot_release(object s) noexcept:
    # noexcept: ANY exception from a slot's release() -- KeyboardInterrupt and SystemExit
    # included -- goes to sys.unraisablehook and is not raised by the flush/clear that ran
    # it: the bytes were sent and the batch must stay consistent whatever the slot says,
    # and the releases of one flush all run (tests/primitives/test_core_hostile_input.py
    # checks this).
    s.release()


cdef void _release_owner(aop_sb_owner *o) noexcept:
    """Release what one segment owner holds (GIL held).  The entry is cleared first, so it
    is released exactly once whatever the release runs."""
    cdef int kind = o.kind
    cdef PyObject *obj = o.obj
    if kind < SB_BYTES:
        return
    o.kind = SB_COPY
    o.obj = NULL
    if kind == SB_BYTES:
        Py_DECREF(<object>obj)
    elif kind == SB_VIEW:
        PyBuffer_Release(&o.view)
    else:
        # the export first: a slot refuses to drop its last reference while a view of it
        # is alive
        PyBuffer_Release(&o.view)
        _slot_release(<object>obj)
        Py_DECREF(<object>obj)


cdef inline bint _is_slot_like(object o):
    cdef type t = type(o)
    if t is memoryview or t is bytes or t is bytearray:
        return False        # no attribute can be added to these: three failed hasattr()
                            # lookups less per frame (~90 instructions)
    return hasattr(o, "retain") and hasattr(o, "release") and hasattr(o, "length")


cdef Py_ssize_t _positive(object v, str name) except -1:
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    cdef object i = PyNumber_Index(v)
    if i < 1:
        raise ValueError(f"{name} must be >= 1")
    if i > (1 << 62):
        raise OverflowError(f"{name} is too large")
    return <Py_ssize_t>i


cdef inline void _end_msg(SendBatch b, size_t n) noexcept nogil:
    """Close the message whose n bytes (1 .. MSG_LEN) were just appended (busy held, room
    for one entry in ends[] checked): its length, and the pending counts."""
    if b.mhead == b.mtail:
        b.mfront = b.added + n
    b.added += n
    b.ends[b.mtail] = <uint32_t>n
    b.mtail += 1
    _add(&b.pend_bytes, <int64_t>n)
    _add(&b.pend_msgs, 1)


cdef Py_ssize_t _msg_entries(size_t n) noexcept nogil:
    """Entries in ends[] an n-byte message takes."""
    return <Py_ssize_t>((n + MSG_LEN - 1) // MSG_LEN)


cdef void _end_long_msg(SendBatch b, size_t n) noexcept nogil:
    """_end_msg for a message longer than MSG_LEN (room for _msg_entries(n) checked)."""
    cdef size_t left = n
    if b.mhead == b.mtail:
        b.mfront = b.added + MSG_LEN
    while left > MSG_LEN:
        b.ends[b.mtail] = MSG_LEN | MSG_CONT
        b.mtail += 1
        left -= MSG_LEN
    b.ends[b.mtail] = <uint32_t>left
    b.mtail += 1
    b.added += n
    _add(&b.pend_bytes, <int64_t>n)
    _add(&b.pend_msgs, 1)


cdef int _room_msgs_n(SendBatch b, Py_ssize_t k) noexcept nogil:
    """Room for k more entries at mtail (slide the live ones down, then double as needed).
    -1 on ENOMEM (nothing lost)."""
    cdef Py_ssize_t live = b.mtail - b.mhead
    cdef Py_ssize_t cap = b.mcap
    if b.mcap - b.mtail >= k:
        return 0
    if b.mhead > 0:
        memmove(b.ends, b.ends + b.mhead, live * sizeof(uint32_t))
        b.mhead = 0
        b.mtail = live
    while cap - live < k:
        cap *= 2
    if cap != b.mcap:
        if _regrow(<void **>&b.ends, cap, sizeof(uint32_t)) < 0:
            return -1
        b.mcap = cap
    return 0


cdef inline int _regrow(void **arr, Py_ssize_t cap, size_t size) noexcept nogil:
    """realloc(*arr) to cap elements of size bytes.  -1 on ENOMEM (*arr left as it was)."""
    cdef void *na = realloc(arr[0], <size_t>cap * size)
    if na == NULL:
        return -1
    arr[0] = na
    return 0


cdef int _room(Py_ssize_t *head, Py_ssize_t *tail, Py_ssize_t *cap, void **a,
                      size_t sa, void **b, size_t sb) noexcept nogil:
    """Room for one more entry at tail in the array a (and the parallel array b, unless
    NULL) of cap entries, [head, tail) live: when full, slide the live entries down if they
    fill at most half of it, else double both.  -1 on ENOMEM (cap unchanged; a may be the
    larger already: harmless)."""
    cdef Py_ssize_t live
    if tail[0] < cap[0]:
        return 0
    live = tail[0] - head[0]
    if head[0] > 0 and live <= cap[0] // 2:
        memmove(a[0], <char *>a[0] + head[0] * sa, live * sa)
        if b != NULL:
            memmove(b[0], <char *>b[0] + head[0] * sb, live * sb)
        head[0] = 0
        tail[0] = live
        return 0
    if _regrow(a, cap[0] * 2, sa) < 0 or (b != NULL and _regrow(b, cap[0] * 2, sb) < 0):
        return -1
    cap[0] *= 2
    return 0


cdef void *_fresh(void *old, size_t size) noexcept nogil:
    """A new block of `size` bytes in place of the drained block `old` (freed), or `old`
    itself when there is no memory.  malloc + free, not realloc: a block freed whole goes
    back to the system (a large one is its own mapping), a realloc'd tail may not."""
    cdef void *p = malloc(size)
    if p == NULL:
        return old
    free(old)
    return p


cdef void _shrink_drained(SendBatch b) noexcept nogil:
    """A drained batch (nothing pending: head == nseg == 0, mhead == mtail == 0, busy held)
    gives back arrays grown past their KEEP size.  Out of memory: the large ones are kept."""
    cdef void *p
    cdef void *q
    if b.ccap > CBUF_KEEP:
        p = _fresh(b.cbuf, CBUF_INIT)
        if p != <void *>b.cbuf:
            b.cbuf = <char *>p
            b.ccap = CBUF_INIT
    if b.segcap > SEG_KEEP:
        p = malloc(SEG_INIT * sizeof(iovec))
        q = malloc(SEG_INIT * sizeof(aop_sb_owner))
        if p != NULL and q != NULL:
            free(b.iov)
            free(b.own)
            b.iov = <iovec *>p
            b.own = <aop_sb_owner *>q
            b.segcap = SEG_INIT
        else:
            free(p)
            free(q)
    if b.mcap > MSG_KEEP and b.mhead == b.mtail:
        p = _fresh(b.ends, MSG_INIT * sizeof(uint32_t))
        if p != <void *>b.ends:
            b.ends = <uint32_t *>p
            b.mcap = MSG_INIT


cdef inline int _c_add(SendBatch b, const void *p, size_t n, int kind) noexcept nogil:
    """c_add_ptr (SB_RAW) and c_add_copy (SB_COPY): 0, 1 (a threshold reached), -EBUSY,
    -ENOMEM; a batch in a group is queued to it."""
    cdef int r
    if n == 0:
        return 0
    if not _claim(b):
        return -EBUSY
    if b._add_raw(<const char *>p, n, kind, NULL, NULL) < 0:
        r = -ENOMEM
    else:
        r = 1 if b._over() else 0
        if b.group is not None and not b.queued:
            r = _c_queue(b, r)
    _unclaim(b)
    return r


cdef inline bint _fast_add_small_bytes(SendBatch b, object data) noexcept:
    """The common case, inlined: a small bytes object appended to a copy segment that is
    already last, with room in every array.  Returns False (nothing done) otherwise; the
    general path (_add_obj) then handles it.  Same effect as _add_raw(..., SB_COPY)."""
    cdef Py_ssize_t n
    cdef Py_ssize_t last = b.nseg - 1
    if type(data) is not bytes:
        return False
    n = PyBytes_GET_SIZE(data)
    if (n == 0 or <size_t>n > b.copy_max or b.ccap - b.cused < <size_t>n or
            b.mtail >= b.mcap or last < b.head or b.own[last].kind != SB_COPY):
        return False
    memcpy(b.cbuf + b.cused, PyBytes_AS_STRING(data), n)
    b.iov[last].iov_len += n          # I4: the last copy segment ends at cused
    b.cused += n
    _end_msg(b, <size_t>n)
    return True


cdef inline int _add_one(SendBatch b, object data, bint af) except -1:
    """add()'s body and add_many()'s per item (busy held): the fast path or _add_obj, then
    the auto-flush once a threshold is reached (``af``)."""
    if not _fast_add_small_bytes(b, data):
        b._add_obj(data)
    if af and b._over():
        b._auto_flush()
    return 0


@cython.boundscheck(True)         # items[k]: checked (a free-threaded caller's list may shrink)
cdef Py_ssize_t sb_add_bytes_run(SendBatch b, list items, Py_ssize_t i) except -1:
    """add_copy() of items[i], items[i + 1], ... while they are bytes of at most copy_max
    bytes (empty ones skipped), under ONE claim of the batch: aoprim.aio's writelines()
    (aoprim.aio._aiowrite).  Returns the index of the first item not taken; ``i`` when none was
    (the batch is busy, limited to an owner thread, or items[i] is something else: the
    caller adds it the usual way).  A batch in a group is queued, as by add_copy()."""
    cdef Py_ssize_t k = i
    cdef Py_ssize_t n
    cdef object item
    if b.owner_tid != 0 or not _claim(b):
        return i
    try:
        while k < len(items):
            item = items[k]
            if type(item) is not bytes:
                break
            n = PyBytes_GET_SIZE(item)
            if <size_t>n > b.copy_max:
                break
            if n and not _fast_add_small_bytes(b, item):
                if b._add_raw(PyBytes_AS_STRING(item), n, SB_COPY, NULL, NULL) < 0:
                    raise MemoryError()
            k += 1
        if k > i:
            b._maybe_queue()
    except BaseException:
        b._queue_quietly()               # the items added before the error are queued too
        raise
    finally:
        _unclaim(b)
    return k


cdef inline int64_t _queued_after_add(SendBatch b) except -1:
    """add_copy's and add_frame's end (busy held): the auto-flush once a threshold is
    reached, the group queueing, and the bytes now pending (what they return)."""
    if b.auto_flush and b._over():
        b._auto_flush()
    b._maybe_queue()
    return _get(&b.pend_bytes)


cdef class SendBatch:
    """SendBatch(target, max_msgs=16, max_bytes=65536, auto_flush=True, *, copy_max=None)

    Gathers small writes and sends them with one sendmsg()/writev() call.  ``target`` is a
    socket (kept alive; its fileno() is read at each flush) or an int file descriptor.
    ``copy_max`` (aoprim extension): messages up to this many bytes are copied into the
    batch's own buffer, larger ones are sent by reference (default DEFAULT_COPY_MAX).
    """

    def __cinit__(self):
        # Allocated here (always runs), so a batch made by __new__ without __init__ is still
        # memory-safe: it has no target (fd -1) and its flush() raises EBADF.
        self.fd = -1
        self.has_sock = False
        self.is_sock = True
        self.max_msgs = 16
        self.max_bytes = 65536
        self.auto_flush = True
        self.copy_max = DEFAULT_COPY_MAX
        self.iov = <iovec *>malloc(SEG_INIT * sizeof(iovec))
        self.own = <aop_sb_owner *>malloc(SEG_INIT * sizeof(aop_sb_owner))
        self.cbuf = <char *>malloc(CBUF_INIT)
        self.ends = <uint32_t *>malloc(MSG_INIT * sizeof(uint32_t))
        if self.iov == NULL or self.own == NULL or self.cbuf == NULL or self.ends == NULL:
            raise MemoryError()
        self.segcap = SEG_INIT
        self.ccap = CBUF_INIT
        self.mcap = MSG_INIT

    @staticmethod
    def frame_header(n, header_size):
        """The header ``add_frame(payload, header_size)`` puts before an ``n``-byte payload,
        as bytes (the same code: aoprim.server.framing's Framing.header/encode use it).
        ValueError if n is negative or too long for the header."""
        cdef unsigned char hdr[4]
        cdef Py_ssize_t hs = _header_size(header_size)
        cdef Py_ssize_t k
        if type(n) is not int:
            n = PyNumber_Index(n)
        if n < 0:
            raise ValueError(f"a payload length must be >= 0, not {n}")
        k = n if n <= PY_SSIZE_T_MAX else PY_SSIZE_T_MAX    # too long either way
        _put_header(hdr, hs, k)
        return PyBytes_FromStringAndSize(<char *>hdr, hs)

    def __init__(self, target, max_msgs=16, max_bytes=65536, auto_flush=True, *,
                 copy_max=None):
        cdef Py_ssize_t mm, mb
        if self.has_sock or self.fd >= 0:
            raise RuntimeError("SendBatch.__init__ called twice")
        # validate everything first: a failed __init__ leaves the batch without a target
        mm = _positive(max_msgs, "max_msgs")
        mb = _positive(max_bytes, "max_bytes")
        if not isinstance(auto_flush, (bool, int)):
            raise TypeError("auto_flush must be a bool")
        if copy_max is None:
            copy_max = DEFAULT_COPY_MAX
        if isinstance(copy_max, bool) or not isinstance(copy_max, int):
            raise TypeError("copy_max must be an int")
        if copy_max < 0 or copy_max > (1 << 30):
            raise ValueError("copy_max must be in 0 .. 2**30")
        if isinstance(target, _socket.socket):
            if hasattr(target, "do_handshake"):
                # ssl.SSLSocket: bytes written to its fd would bypass the TLS layer
                raise TypeError("SendBatch cannot write to a TLS socket (its fd carries "
                                "encrypted records); batch into it with sendall() instead")
            if not _pinnable(target):
                raise TypeError("SendBatch cannot pin this socket.socket subclass across a "
                                "write: it redefines _io_refs/_closed or attribute access")
            if target.fileno() < 0:
                raise OSError(EBADF, "the socket is closed")
            self.sock = target
            # socket.socket's own C method, called as sock_fileno(sock): reading the fd
            # runs no Python code even for a subclass that overrides fileno()
            self.sock_fileno = _socket.socket.fileno
            self.has_sock = True
            self.fd = -1
        elif isinstance(target, int) and not isinstance(target, bool):
            if target < 0:
                raise ValueError("a file descriptor must be >= 0")
            if target > 0x7fffffff:
                raise OverflowError("file descriptor out of range")
            self.sock = None
            self.sock_fileno = None
            self.fd = <int>target
        else:
            raise TypeError(f"target must be a socket or an int file descriptor, "
                            f"not {type(target).__name__}")
        self.is_sock = True           # for an int fd: until the first ENOTSOCK
        self.max_msgs = mm
        self.max_bytes = mb
        self.auto_flush = bool(auto_flush)
        self.copy_max = <size_t>copy_max

    def __dealloc__(self):
        if self.own != NULL and self.nseg > self.head:
            self._release_range(self.head, self.nseg)
        free(self.iov)
        free(self.own)
        free(self.cbuf)
        free(self.ends)

    # ---- space management (busy held) ---------------------------------------------------

    cdef int _room_segs(self) noexcept nogil:
        """Make room for one more segment: slide [head, nseg) down, or double.  -1: ENOMEM.
        Py_buffer is moved by value: exports are taken with PyBUF_SIMPLE, which makes the
        exporter leave shape/strides NULL, so a view holds no pointer to itself."""
        if self.nseg < self.segcap:        # the common case, without a call
            return 0
        return _room(&self.head, &self.nseg, &self.segcap, <void **>&self.iov, sizeof(iovec),
                     <void **>&self.own, sizeof(aop_sb_owner))

    cdef int _room_msgs(self) noexcept nogil:
        """Make room for one more message end: slide [mhead, mtail) down, or double."""
        if self.mtail < self.mcap:         # the common case, without a call
            return 0
        return _room(&self.mhead, &self.mtail, &self.mcap, <void **>&self.ends,
                     sizeof(uint32_t), NULL, 0)

    cdef int _room_copy(self, size_t n) noexcept nogil:
        """Make cbuf[cused:cused+n] available (I4 kept).  -1: ENOMEM."""
        cdef size_t live_start
        cdef size_t live
        cdef size_t cap
        cdef char *dst
        cdef char *src
        cdef Py_ssize_t k
        if self.ccap - self.cused >= n:
            return 0
        live_start = self.cused
        for k in range(self.head, self.nseg):
            if self.own[k].kind == SB_COPY:
                live_start = <size_t>(<char *>self.iov[k].iov_base - self.cbuf)
                break
        live = self.cused - live_start
        if live + n <= self.ccap and live <= self.ccap // 2:
            # compact in place: at least half the buffer is freed, so moves cost O(1) per
            # byte appended, amortised (as a deque's).
            dst = self.cbuf
        else:
            cap = self.ccap * 2
            while cap < 2 * (live + n):
                cap *= 2
            dst = <char *>malloc(cap)
            if dst == NULL:
                return -1
        src = self.cbuf + live_start
        if live:
            memmove(dst, src, live)
        for k in range(self.head, self.nseg):
            if self.own[k].kind == SB_COPY:
                self.iov[k].iov_base = dst + (<char *>self.iov[k].iov_base - src)
        if dst != self.cbuf:
            free(self.cbuf)
            self.cbuf = dst
            self.ccap = cap
        self.cused = live
        return 0

    cdef int _add_raw(self, const char *p, size_t n, int kind, PyObject *obj,
                      Py_buffer *view) noexcept nogil:
        """Append one non-empty message.  SB_COPY copies p[0:n]; other kinds take over the
        owner given (obj reference / view export).  0, or -1 on ENOMEM (nothing changed,
        the owner still belongs to the caller)."""
        cdef Py_ssize_t last
        if kind == SB_COPY:
            return self._add_copy2(p, n, NULL, 0)    # n <= copy_max <= 2**30 < MSG_LEN
        if _room_msgs_n(self, _msg_entries(n)) < 0:
            return -1
        else:
            if self._room_segs() < 0:
                return -1
            self.iov[self.nseg].iov_base = <void *>p
            self.iov[self.nseg].iov_len = n
            self.own[self.nseg].kind = kind
            self.own[self.nseg].obj = obj
            if view != NULL:
                memcpy(&self.own[self.nseg].view, view, sizeof(Py_buffer))
            self.nseg += 1
        if n > MSG_LEN:
            _end_long_msg(self, n)
        else:
            _end_msg(self, n)
        return 0

    cdef int _add_copy2(self, const char *a, size_t na, const char *b,
                        size_t nb) noexcept nogil:
        """Append ONE message of a[0:na] + b[0:nb], copied into cbuf (nb may be 0, b NULL):
        a length header and its payload leave as one message.  0, or -1 on ENOMEM (nothing
        changed)."""
        cdef Py_ssize_t last
        cdef size_t n = na + nb
        if self._room_msgs() < 0 or self._room_copy(n) < 0:
            return -1
        last = self.nseg - 1
        if last < self.head or self.own[last].kind != SB_COPY:
            if self._room_segs() < 0:
                return -1
            last = self.nseg
            self.iov[last].iov_base = self.cbuf + self.cused
            self.iov[last].iov_len = 0
            self.own[last].kind = SB_COPY
            self.own[last].obj = NULL
            self.nseg += 1
        # I4: the last copy segment ends at cused, so the new bytes extend it
        memcpy(self.cbuf + self.cused, a, na)
        if nb:
            memcpy(self.cbuf + self.cused + na, b, nb)
        self.iov[last].iov_len += n
        self.cused += n
        _end_msg(self, n)
        return 0

    cdef bint _over(self) noexcept nogil:
        return (_get(&self.pend_msgs) >= self.max_msgs or
                <Py_ssize_t>(self.added - self.sent) >= self.max_bytes)

    # ---- writing and cursor advance ----------------------------------------------------

    cdef ssize_t _write_once(self, int fd, size_t *offered) noexcept nogil:
        """One system call for iov[head : head + min(pending, IOV_MAX)] (capped to
        write_limit bytes by the test hook).  Sets *offered; returns bytes or -errno."""
        cdef Py_ssize_t cnt = self.nseg - self.head
        cdef Py_ssize_t k
        cdef size_t off
        cdef size_t saved
        cdef ssize_t r
        cdef iovec *v = self.iov + self.head
        if cnt > AOP_SB_IOV_MAX:
            cnt = AOP_SB_IOV_MAX
            off = 0
            for k in range(cnt):
                off += v[k].iov_len
        else:
            off = <size_t>(self.added - self.sent)
        offered[0] = off
        if self.write_limit and off > self.write_limit:
            # test hook: a kernel that takes at most write_limit bytes.  Offer only that
            # much, by trimming the segment that crosses the limit for the duration of the
            # call (no copy), then restoring it; *offered stays the full amount, so the
            # caller sees a short (partial) write, exactly as from a full socket buffer.
            off = 0
            k = 0
            while off + v[k].iov_len < self.write_limit:
                off += v[k].iov_len
                k += 1
            saved = v[k].iov_len
            v[k].iov_len = self.write_limit - off
            r = aop_sb_write_flags(fd, v, <int>(k + 1), self.is_sock, self.wflags)
            v[k].iov_len = saved
            return r
        return aop_sb_write_flags(fd, v, <int>cnt, self.is_sock, self.wflags)

    cdef Py_ssize_t _advance(self, size_t n) noexcept nogil:
        """Account for n written bytes: trim the first partly written segment in place and
        return the index of the first segment not fully written (segments before it are
        done; their owners are released by the caller, then _commit_head).  Also retires
        the messages that are now complete."""
        cdef Py_ssize_t k = self.head
        cdef size_t left = n
        cdef size_t l
        cdef Py_ssize_t done = 0
        cdef Py_ssize_t mh, mt
        cdef uint64_t front
        cdef uint32_t *e
        while left:
            l = self.iov[k].iov_len
            if left >= l:
                left -= l
                k += 1
            else:
                self.iov[k].iov_base = <char *>self.iov[k].iov_base + left
                self.iov[k].iov_len = l - left
                left = 0
        self.sent += n
        # retire the entries now written (locals: the compiler keeps them in registers)
        mh = self.mhead
        mt = self.mtail
        front = self.mfront
        e = self.ends
        while mh < mt and front <= self.sent:
            done += (e[mh] >> 31) ^ 1          # an entry without MSG_CONT ends a message
            mh += 1
            if mh < mt:
                front += e[mh] & MSG_LEN
        self.mhead = mh
        self.mfront = front
        if self.mhead == self.mtail:
            self.mhead = self.mtail = 0
        _add(&self.pend_bytes, -<int64_t>n)
        _add(&self.pend_msgs, -done)
        _add(&self.st_messages, done)
        _add(&self.st_bytes, <int64_t>n)
        return k

    cdef bint _range_owned(self, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
        cdef Py_ssize_t k
        for k in range(a, b):
            if self.own[k].kind >= SB_BYTES:
                return True
        return False

    cdef void _release_range(self, Py_ssize_t a, Py_ssize_t b) noexcept:
        """Release the owners of segments [a, b) (GIL held).  Each is cleared first, so an
        owner is released exactly once whatever its release() does."""
        cdef Py_ssize_t k
        for k in range(a, b):
            _release_owner(&self.own[k])

    cdef void _commit_head(self, Py_ssize_t h) noexcept nogil:
        self.head = h
        if h == self.nseg:
            # I6: drained -- reuse everything from the start
            self.head = self.nseg = 0
            self.cused = 0
            _shrink_drained(self)

    cdef int _sock_fd(self) except -2:
        """The socket's current fd, -1 when it is closed (or the batch was cleared by the
        cyclic GC).  Read through socket.socket's own C fileno(), never an override, so no
        Python code runs (and the GIL is never released) while it is read."""
        if self.sock is None or self.sock_fileno is None:     # int fd, or cleared by the GC
            return -1
        return self.sock_fileno(self.sock)

    cdef int _target_fd(self) except -2:
        cdef int fd
        if not self.has_sock:
            if self.fd < 0:
                raise OSError(EBADF, "Bad file descriptor (SendBatch.__init__ was not run)")
            return self.fd
        # read every flush, never cached: a socket closed by its owner reads -1 (EBADF here)
        # instead of letting the batch write to whatever file reuses the number
        fd = self._sock_fd()
        if fd < 0:
            raise OSError(EBADF, "Bad file descriptor (the socket is closed)")
        return fd

    cdef Py_ssize_t _flush_locked(self) except -1:
        """Write what is pending.  A socket target is pinned for the whole flush (see
        _sock_pin): a close() from another thread meanwhile takes effect when it ends."""
        cdef object sock
        if self.head == self.nseg:
            return 0
        if not self.has_sock or self.sock is None:
            return self._flush_fd()
        if not _sock_pin(self.sock):
            _sock_unpin(self.sock)
            raise OSError(EBADF, "Bad file descriptor (the socket is closed)")
        sock = self.sock                 # a GC clear of the batch cannot drop it under us
        try:
            return self._flush_fd()
        finally:
            _sock_unpin(sock)

    cdef Py_ssize_t _flush_fd(self) except -1:
        cdef Py_ssize_t total = 0
        cdef Py_ssize_t h
        cdef Py_ssize_t old
        cdef ssize_t r
        cdef size_t offered = 0
        cdef int err
        cdef int fd
        cdef bint again = False        # a syscall was issued (the GIL re-taken since)
        fd = self._target_fd()
        while self.head < self.nseg:
            if again:
                # the GIL was re-taken since fd was read (after the last syscall),
                # and what ran meanwhile -- releases of sent objects, signal handlers, other
                # threads -- may have closed the socket and reused its number.  Never write
                # to a number read before that: re-read it, stop with EBADF if it moved.
                # (pinned, a close() is deferred, not done: stop on its `_closed` flag too)
                if self.has_sock and (self._sock_fd() != fd or aop_sock_closing(self.sock)):
                    raise OSError(EBADF, "Bad file descriptor (the socket was closed during "
                                         "the flush)")
            again = True
            with nogil:
                r = self._write_once(fd, &offered)
            _add(&self.st_syscalls, 1)
            if r < 0:
                err = <int>-r
                if err == EINTR:
                    PyErr_CheckSignals()      # a handler's exception propagates, data intact
                    continue
                if aop_sb_would_block(err):
                    _add(&self.st_wouldblock, 1)
                    break
                if err == ENOTSOCK and self.is_sock and not self.has_sock:
                    self.is_sock = False      # an int fd that is a pipe/file: writev from now
                    continue
                raise OSError(err, strerror(err).decode("utf-8", "replace"))
            old = self.head
            h = self._advance(<size_t>r)
            self._release_range(old, h)
            self._commit_head(h)
            total += r
            if <size_t>r < offered:
                _add(&self.st_partial, 1)
                break
        return total

    # ---- adding from Python -------------------------------------------------------------

    cdef int _add_obj(self, object data) except -1:
        cdef type t = type(data)
        cdef Py_ssize_t n
        if t is bytes:
            n = PyBytes_GET_SIZE(data)
            if n == 0:
                return 0
            if <size_t>n <= self.copy_max:
                if self._add_raw(PyBytes_AS_STRING(data), n, SB_COPY, NULL, NULL) < 0:
                    raise MemoryError()
                return 0
            Py_INCREF(data)
            if self._add_raw(PyBytes_AS_STRING(data), n, SB_BYTES, <PyObject *>data,
                             NULL) < 0:
                Py_DECREF(data)
                raise MemoryError()
            return 0
        if t is bytearray or t is memoryview:
            return self._add_buffer(data)
        if _is_slot_like(data):
            return self._add_slot(data)
        if isinstance(data, (bytes, bytearray, memoryview)):
            return self._add_buffer(data)
        raise TypeError(f"SendBatch.add() takes bytes, bytearray, memoryview or a Slot, "
                        f"not {t.__name__}")

    cdef int _add_buffer(self, object data, bint copy_all=False) except -1:
        """A bytes-like object other than bytes.  Up to copy_max bytes: copied into cbuf.
        Larger: by reference (the export is held until sent), or -- copy_all, for add_copy
        -- copied into one new bytes object that its segment references."""
        cdef Py_buffer view
        cdef int rc
        cdef object copy
        try:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        except BufferError:
            if isinstance(data, memoryview):
                # not C-contiguous: no single span to reference; tobytes() gathers it into
                # a fresh, unshared object
                return self._add_obj(data.tobytes())
            raise
        except TypeError:
            if not copy_all:
                raise
            raise TypeError(f"SendBatch.add_copy() takes bytes, bytearray, memoryview or a "
                            f"Slot, not {type(data).__name__}") from None
        if view.len == 0:
            PyBuffer_Release(&view)
            return 0
        if <size_t>view.len <= self.copy_max:
            # small: copied now, so later changes by the caller are never seen
            rc = self._add_raw(<char *>view.buf, view.len, SB_COPY, NULL, NULL)
            PyBuffer_Release(&view)
        elif copy_all:
            try:
                copy = PyBytes_FromStringAndSize(<char *>view.buf, view.len)
            finally:
                PyBuffer_Release(&view)
            return self._add_obj(copy)
        else:
            # large: by reference; the export is held until sent (a bytearray cannot be
            # resized meanwhile: BufferError), in-place writes before the send are sent
            rc = self._add_raw(<char *>view.buf, view.len, SB_VIEW, NULL, &view)
            if rc < 0:
                PyBuffer_Release(&view)
        if rc < 0:
            raise MemoryError()
        return 0

    cdef Py_ssize_t _slot_prep(self, object s, Py_buffer *view) except -1:
        """Take a slot-like object for sending: read ``s.length`` ONCE, export ``s`` and,
        when the length is not 0, retain() it.  Returns the length; when it is > 0 the
        caller owns *view and the retain (release both, or hand them to an SB_SLOT
        segment); when it is 0 nothing is held.  On an exception nothing is held."""
        cdef object lo = s.length
        cdef Py_ssize_t length
        if isinstance(lo, bool) or not hasattr(type(lo), "__index__"):
            raise TypeError("slot.length must be an int")
        length = PyNumber_Index(lo)
        PyObject_GetBuffer(s, view, PyBUF_SIMPLE)
        if length < 0 or length > view.len:
            PyBuffer_Release(view)
            raise ValueError(f"slot.length {length} is outside 0..{view.len}")
        if length == 0:
            PyBuffer_Release(view)
            return 0
        try:
            s.retain()
        except BaseException:
            PyBuffer_Release(view)
            raise
        return length

    cdef int _add_slot(self, object s) except -1:
        cdef Py_buffer view
        cdef Py_ssize_t length = self._slot_prep(s, &view)
        if length == 0:
            return 0
        Py_INCREF(s)
        if self._add_raw(<char *>view.buf, length, SB_SLOT, <PyObject *>s, &view) < 0:
            PyBuffer_Release(&view)
            _slot_release(s)
            Py_DECREF(s)
            raise MemoryError()
        return 0

    cdef void _unadd_copy(self, size_t n) noexcept nogil:
        """Undo the latest _add_copy2 of n bytes (one message, the last bytes of the last
        copy segment, which ends at cused (I4); nothing added since -- a failed add adds
        nothing, and a compaction by one moves those bytes but keeps them last)."""
        cdef Py_ssize_t last = self.nseg - 1
        self.iov[last].iov_len -= n
        if self.iov[last].iov_len == 0:
            self.nseg = last                 # the segment was made for it (I1)
        self.cused -= n
        self.added -= n
        self.mtail -= 1
        if self.mhead == self.mtail:
            self.mhead = self.mtail = 0
        if self.head == self.nseg:
            self.head = self.nseg = 0        # I6
            self.cused = 0
        _add(&self.pend_bytes, -<int64_t>n)
        _add(&self.pend_msgs, -1)

    cdef void _queue_quietly(self) noexcept:
        """_maybe_queue on an exception path (an auto-flush that raised): best effort, the
        exception already propagating is the one the caller sees."""
        if self.group is not None and not self.queued and self.head < self.nseg:
            self.group._queue(self)

    cdef int _auto_flush(self) except -1:
        """add*'s auto-flush.  When it raises, the batch still queues itself if it has
        pending data (so an attached batch is never left pending and unqueued)."""
        try:
            self._flush_locked()
        except BaseException:
            self._queue_quietly()
            raise
        return 0

    cdef int _maybe_queue(self) except -1:
        """After an add (busy held): an attached batch left with pending data queues itself
        in its group, once (``queued`` says it is there)."""
        if self.group is not None and not self.queued and self.head < self.nseg:
            if self.group._queue(self) < 0:
                raise MemoryError("FlushGroup: no memory to queue the batch (its data stays "
                                  "pending; the next add tries again)")
        return 0

    # ---- Python API ---------------------------------------------------------------------

    def add(self, data):
        """Queue one message: bytes, bytearray, memoryview or a Slot (its first ``length``
        bytes; retained until fully sent, then released).  With auto_flush, reaching
        max_msgs messages or max_bytes bytes flushes (an OSError from that flush propagates;
        the message stays queued).  Empty messages are ignored."""
        if not _claim(self):
            _raise_busy()
        try:
            _add_one(self, data, self.auto_flush)
            self._maybe_queue()
        finally:
            _unclaim(self)

    def add_copy(self, data):
        """add() for a caller that reuses its buffer at once (aoprim extension): a mutable
        buffer (bytearray, memoryview, any other buffer) is copied whatever its size -- into
        the coalescing buffer up to copy_max bytes, into a new bytes object beyond -- so the
        batch never references it; bytes (immutable) and a Slot are taken as add() takes
        them.  Returns pending_bytes after the add, so a caller can apply its high-water
        mark without a second call.  Empty messages are ignored.  With ``owner_thread`` set,
        a call from any other thread adds nothing and returns -1."""
        cdef int64_t p
        cdef type t
        if self.owner_tid and PyThread_get_thread_ident() != self.owner_tid:
            return -1
        if not _claim(self):
            _raise_busy()
        try:
            if not _fast_add_small_bytes(self, data):
                t = type(data)
                if t is memoryview or t is bytearray:
                    self._add_buffer(data, True)
                elif t is bytes or _is_slot_like(data):
                    self._add_obj(data)
                else:
                    self._add_buffer(data, True)
            p = _queued_after_add(self)
        finally:
            _unclaim(self)
        return p

    def add_frame(self, data, header_size):
        """add_copy() of one length-prefixed frame (aoprim extension): a ``header_size``-byte
        big-endian length (2: u16, 4: u32) followed by the payload, in one call.  A payload
        that fits the copy limit with its header is copied with it as ONE message; a larger
        one follows its header as add_copy() takes it (a mutable buffer copied, bytes
        referenced, a Slot retained, its first ``length`` bytes -- ``length`` is read once).
        Atomic: a payload too long for the header raises ValueError, and any failure (a
        released slot's BufferError, MemoryError, an exception from a slot's retain())
        raises with nothing added -- never a header without its payload.  Returns
        pending_bytes after the add; with ``owner_thread`` set, -1 from any other thread
        (nothing added)."""
        cdef Py_buffer view              # non-slot payload export (held iff vheld)
        cdef Py_buffer sview             # slot export + retain (held iff sheld)
        cdef bint vheld = False
        cdef bint sheld = False
        cdef Py_ssize_t hs
        cdef Py_ssize_t n = 0
        cdef unsigned char hdr[4]
        cdef int64_t p
        cdef object payload = data
        if self.owner_tid and PyThread_get_thread_ident() != self.owner_tid:
            return -1
        hs = _header_size(header_size)
        slot = _is_slot_like(data)
        if not slot:
            try:
                PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
            except BufferError:
                if not isinstance(data, memoryview):
                    raise
                payload = data.tobytes()        # not contiguous: gather it
                PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
            except TypeError:
                raise TypeError(f"SendBatch.add_frame() takes bytes, bytearray, memoryview "
                                f"or a Slot, not {type(data).__name__}") from None
            vheld = True
            n = view.len
        if not _claim(self):
            if vheld:
                PyBuffer_Release(&view)
            _raise_busy()
        try:
            # everything that can fail happens before the header is queued, except the
            # payload's own append, which is undone with the header (_unadd_copy)
            if slot:
                n = self._slot_prep(data, &sview)    # length read once; exported + retained
                sheld = n > 0
            _put_header(hdr, hs, n)
            if not slot and <size_t>(hs + n) <= self.copy_max:
                if self._add_copy2(<char *>hdr, hs, <char *>view.buf, n) < 0:
                    raise MemoryError()
            else:
                if not slot and n and type(payload) is not bytes:
                    payload = PyBytes_FromStringAndSize(<char *>view.buf, n)   # may raise
                if self._add_copy2(<char *>hdr, hs, NULL, 0) < 0:
                    raise MemoryError()
                if sheld:
                    Py_INCREF(data)
                    if self._add_raw(<char *>sview.buf, n, SB_SLOT, <PyObject *>data,
                                     &sview) < 0:
                        Py_DECREF(data)
                        self._unadd_copy(hs)
                        raise MemoryError()
                    sheld = False                # the batch owns the export and the retain
                elif not slot:
                    try:
                        self._add_obj(payload)   # bytes: MemoryError is all it can raise
                    except BaseException:
                        self._unadd_copy(hs)
                        raise
            p = _queued_after_add(self)
        finally:
            _unclaim(self)
            if vheld:
                PyBuffer_Release(&view)
            if sheld:
                PyBuffer_Release(&sview)
                _slot_release(data)
        return p

    def add_many(self, iterable):
        """add() each item of ``iterable`` in order (one call: low per-message overhead).
        Returns how many items were taken.  On a bad item, the items before it stay added."""
        cdef Py_ssize_t count = 0
        cdef bint af = self.auto_flush
        if not _claim(self):
            _raise_busy()
        try:
            # (Cython iterates an exact list or tuple by index, without an iterator)
            for item in iterable:
                _add_one(self, item, af)
                count += 1
        except BaseException:
            self._queue_quietly()          # the items added before a bad one are queued too
            _unclaim(self)
            raise
        try:
            self._maybe_queue()
        finally:
            _unclaim(self)
        return count

    def flush(self):
        """Write what is pending; returns the bytes written by this call.  One system call
        (more only beyond IOV_MAX segments); a partial write keeps the unsent tail in
        order; a write that would block keeps everything and returns 0; EINTR is retried;
        any other error raises OSError with the pending data intact.

        Closing from another thread: a socket target is pinned for the flush (like a
        makefile() file), so a ``socket.close()`` that comes meanwhile is deferred until the
        flush ends and then done; the flush stops before its next system call (EBADF).  No
        byte can reach another socket that takes the number.  Not covered: closing the
        number by other means (``os.close``, ``detach()``) during a flush, and int-fd
        targets (the caller keeps those open)."""
        cdef Py_ssize_t n
        if not _claim(self):
            _raise_busy()
        try:
            n = self._flush_locked()
        finally:
            _unclaim(self)
        return n

    def take_view(self):
        """For a caller that writes the pending bytes somewhere other than the target (the
        server's TLS flush encrypts them): a read-only memoryview of the first unsent
        segment (a run of coalesced small messages is one segment; a message larger than
        ``copy_max`` is its own), or None when nothing is pending.  The view does not pin
        the batch's memory: it is valid only until the next call on this batch -- release
        it before then (``consume`` first, or ``view.release()``).  ``c_peek`` in C."""
        cdef char *p
        cdef Py_ssize_t n
        if not self.c_peek(&p, &n):
            return None
        return PyMemoryView_FromMemory(p, n, PyBUF_READ)

    def consume(self, n):
        """Account for the first ``n`` pending bytes as written elsewhere (after
        ``take_view``): as a flush that wrote them -- messages completed, owners released,
        ``stats`` bytes/messages counted -- without a system call.  ValueError if ``n`` is
        negative or more than is pending.  ``c_consume`` in C."""
        self.c_consume(PyNumber_Index(n))

    cdef int c_peek(self, char **p, Py_ssize_t *n) except -1:
        # take_view() without the view: the first unsent segment's address and length
        # (valid until the next call on this batch); 0 when nothing is pending, else 1
        if not _claim(self):
            _raise_busy()
        try:
            if self.head == self.nseg:
                return 0
            p[0] = <char *>self.iov[self.head].iov_base
            n[0] = <Py_ssize_t>self.iov[self.head].iov_len
        finally:
            _unclaim(self)
        return 1

    cdef int c_consume(self, Py_ssize_t k) except -1:
        # consume(k): the first k pending bytes are written elsewhere
        cdef Py_ssize_t old, h
        if not _claim(self):
            _raise_busy()
        try:
            if k < 0 or k > _get(&self.pend_bytes):
                raise ValueError(f"consume({k}): {self.pending_bytes} bytes are pending")
            if k:
                old = self.head
                h = self._advance(<size_t>k)
                self._release_range(old, h)
                self._commit_head(h)
        finally:
            _unclaim(self)
        return 0

    def clear(self):
        """Drop everything pending (retained slots are released)."""
        cdef Py_ssize_t h, t
        if not _claim(self):
            _raise_busy()
        try:
            h = self.head
            t = self.nseg
            self._release_range(h, t)
            self.head = self.nseg = 0
            self.cused = 0
            self.sent = self.added
            self.mhead = self.mtail = 0
            aop_store_i64(&self.pend_bytes, 0, AOP_RELAXED)   # relaxed: see _add()
            aop_store_i64(&self.pend_msgs, 0, AOP_RELAXED)
            _shrink_drained(self)
        finally:
            _unclaim(self)

    def _copy_views(self):
        """Copy the unsent part of every pending by-reference buffer (a bytearray or
        memoryview larger than ``copy_max`` that ``add()`` queued by reference) into a bytes
        object of its own and release the caller's buffer: from here on, changes to it are
        not sent, as if ``add_copy()`` had queued what is left.  aoprim.aio's write() of a
        large buffer on Python 3.11 (whose asyncio copies what it does not send at once):
        the caller's buffer is offered to the kernel first, only the rest is copied.
        Returns the bytes copied.  MemoryError: the segments not converted yet stay views."""
        cdef Py_ssize_t k
        cdef Py_ssize_t total = 0
        cdef object copy
        if not _claim(self):
            _raise_busy()
        try:
            for k in range(self.head, self.nseg):
                if self.own[k].kind != SB_VIEW:
                    continue
                copy = PyBytes_FromStringAndSize(<char *>self.iov[k].iov_base,
                                                 <Py_ssize_t>self.iov[k].iov_len)
                PyBuffer_Release(&self.own[k].view)
                Py_INCREF(copy)
                self.own[k].kind = SB_BYTES
                self.own[k].obj = <PyObject *>copy
                self.iov[k].iov_base = PyBytes_AS_STRING(copy)
                total += <Py_ssize_t>self.iov[k].iov_len
        finally:
            _unclaim(self)
        return total

    @property
    def pending_bytes(self):
        """Bytes added and not yet written."""
        return _get(&self.pend_bytes)

    @property
    def pending_msgs(self):
        """Messages not yet fully written (a partly written one counts)."""
        return _get(&self.pend_msgs)

    def __len__(self):
        return <Py_ssize_t>_get(&self.pend_msgs)

    @property
    def stats(self):
        """Counters since creation: syscalls, messages (fully written), bytes (written),
        partial_writes, would_block."""
        return {
            "syscalls": _get(&self.st_syscalls),
            "messages": _get(&self.st_messages),
            "bytes": _get(&self.st_bytes),
            "partial_writes": _get(&self.st_partial),
            "would_block": _get(&self.st_wouldblock),
        }

    @property
    def owner_thread(self):
        """0 (the default), or the ident (``threading.get_ident()``) of the one thread whose
        add_copy()/add_frame() calls add: from any other thread they add nothing and return
        -1, so an owner with a thread-safe slow path (the server's sessions: the event-loop
        thread adds directly, others hand their sends over) needs no thread check of its own
        in Python.  add()/add_many() are not affected."""
        return self.owner_tid

    @owner_thread.setter
    def owner_thread(self, v):
        # a plain store: set once by the owner before it shares the batch (publishing the
        # batch to another thread -- a queue, a lock -- orders it before their reads)
        cdef unsigned long t = v
        self.owner_tid = t

    @property
    def watch(self):
        """FlushGroup: while True, the group reports this batch after every flush, even when
        everything was sent (status 0).  Default False."""
        return self.watched

    @watch.setter
    def watch(self, v):
        cdef bint w = bool(v)
        if not _claim(self):
            _raise_busy()
        self.watched = w
        _unclaim(self)

    @property
    def target(self):
        """The socket, or the int file descriptor, given to the constructor."""
        return self.sock if self.has_sock else self.fd

    @property
    def _write_limit(self):
        return self.write_limit

    @_write_limit.setter
    def _write_limit(self, v):
        """Test hook: offer at most this many bytes per system call (0: no cap), so tests
        can force partial writes at chosen points through the real cursor-advance code."""
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError("_write_limit must be an int")
        if v < 0:
            raise ValueError("_write_limit must be >= 0")
        if not _claim(self):
            _raise_busy()
        self.write_limit = <size_t>v
        _unclaim(self)

    @property
    def _capacity(self):
        """Test hook: (segment slots, coalescing-buffer bytes, message slots) allocated."""
        return (self.segcap, self.ccap, self.mcap)

    def __repr__(self):
        return (f"<aoprim.SendBatch target={self.target!r} pending_msgs="
                f"{_get(&self.pend_msgs)} pending_bytes={_get(&self.pend_bytes)}>")

    # ---- C API --------------------------------------------------------------------------

    cdef int c_add_ptr(self, const void *p, size_t n) noexcept nogil:
        return _c_add(self, p, n, SB_RAW)

    cdef int c_add_copy(self, const void *p, size_t n) noexcept nogil:
        return _c_add(self, p, n, SB_COPY)

    cdef Py_ssize_t c_flush(self) noexcept nogil:
        cdef Py_ssize_t total = 0
        cdef Py_ssize_t h
        cdef Py_ssize_t old
        cdef ssize_t r
        cdef size_t offered = 0
        cdef int fd
        cdef int fd2
        cdef bint regil = False
        if not _claim(self):
            return -EBUSY
        if self.head == self.nseg:
            _unclaim(self)
            return 0
        if self.has_sock:
            with gil:
                try:
                    fd = self._sock_fd()
                except BaseException:
                    fd = -1
            if fd < 0:
                _unclaim(self)
                return -EBADF
        else:
            fd = self.fd
        while self.head < self.nseg:
            if regil:
                # the GIL was taken to release sent objects, and their release may
                # have closed the socket and reused its number: re-read it before writing
                regil = False
                with gil:
                    try:
                        fd2 = self._sock_fd()
                    except BaseException:
                        fd2 = -1
                if fd2 != fd:
                    _unclaim(self)
                    return -EBADF
            r = self._write_once(fd, &offered)
            _add(&self.st_syscalls, 1)
            if r < 0:
                if r == -EINTR:
                    continue
                if aop_sb_would_block(<int>-r):
                    _add(&self.st_wouldblock, 1)
                    break
                if r == -ENOTSOCK and self.is_sock and not self.has_sock:
                    self.is_sock = False
                    continue
                _unclaim(self)
                return r
            old = self.head
            h = self._advance(<size_t>r)
            if self._range_owned(old, h):
                with gil:
                    self._release_range(old, h)
                regil = self.has_sock      # an int fd is the caller's: nothing to re-read
            self._commit_head(h)
            total += r
            if <size_t>r < offered:
                _add(&self.st_partial, 1)
                break
        _unclaim(self)
        return total


cdef class _GroupBase:
    """What a SendBatch needs from the group it is attached to: aoprim.FlushGroup
    (aoprim/_flushgroup.pyx) is the one subclass.  Not usable on its own."""

    def __cinit__(self, *args, **kwargs):
        if type(self) is _GroupBase:
            raise TypeError("_GroupBase is an internal base class; use aoprim.FlushGroup")

    cdef int _queue(self, SendBatch b) noexcept:
        return -1


# ---- SendBatch's tp_traverse also visits its pending owners ------------------------------
# Cython generates traverse only for object fields; the slots (and buffer exporters) held by
# pending segments are strong references in a C array, so a cycle through one -- a slot-like
# object that refers back to its batch or session -- would never be found.  The owners are read
# under the batch's claim: a thread inside the batch may be reallocating the array (c_add_*
# run without the GIL); when it is busy they are skipped, which only makes the GC see them
# as referenced from outside (never collect anything live).  A FlushGroup's GIL-free pass
# may move an owner out (to its rel array, obj set to NULL after the copy): NULL is skipped,
# and a reference seen just before the move still exists (in rel), so the count is right.

ctypedef int (*_visitproc)(PyObject *, void *) noexcept
ctypedef int (*_traverseproc)(PyObject *, _visitproc, void *) noexcept

cdef extern from "Python.h":
    ctypedef struct _TypeSlots "PyTypeObject":
        _traverseproc tp_traverse
        unsigned long tp_flags
    unsigned long Py_TPFLAGS_HAVE_GC
    ctypedef struct _RawBuf "Py_buffer":
        PyObject *obj                 # the exporter (a strong reference), or NULL

cdef _traverseproc _sb_base_traverse = NULL


cdef int _sb_traverse(SendBatch b, _visitproc visit, void *arg) noexcept:
    cdef Py_ssize_t k
    cdef int r = 0
    cdef int kind
    cdef PyObject *o
    if _sb_base_traverse != NULL:
        r = _sb_base_traverse(<PyObject *>b, visit, arg)
        if r:
            return r
    if b.own == NULL or not _claim(b):
        return 0
    for k in range(b.head, b.nseg):
        kind = b.own[k].kind
        if kind != SB_SLOT and kind != SB_VIEW:
            continue                  # copies, raw pointers, bytes (bytes hold nothing)
        # SB_SLOT holds two references: its own (obj) and the export's (view.obj)
        o = b.own[k].obj if kind == SB_SLOT else NULL
        if o != NULL:
            r = visit(o, arg)
            if r:
                break
        o = (<_RawBuf *>&b.own[k].view).obj
        if o != NULL:
            r = visit(o, arg)
            if r:
                break
    _unclaim(b)
    return r


cdef _TypeSlots *_sb_type = <_TypeSlots *>SendBatch
if not (_sb_type.tp_flags & Py_TPFLAGS_HAVE_GC):
    raise ImportError("aoprim._sendbatch: SendBatch was built without GC support")
_sb_base_traverse = _sb_type.tp_traverse
_sb_type.tp_traverse = <_traverseproc>_sb_traverse
