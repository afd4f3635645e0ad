# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""Receiver: a session's per-read, per-frame work, compiled.

One idea, the receive path's state machine (over 800 lines): read, cut frames, deliver, keep
the tail, with the ownership argument for every buffer it touches.  The buffers themselves (RxArena, heap frame buffers, the view
exporter) are in _rxbuf.pyx.

    arena = RxArena(pool)        # one per event-loop thread
    rx = Receiver(arena, fd, header_size, max_frame, on_frame, on_event, owner)
    rx.on_readable()             # one non-blocking recv + cut + deliver
    rx.close()                   # every buffer back, exactly once

Who owns which buffer
- The arena owns one *scratch* buffer of slot size (a pool Slot; a heap buffer when the pool
  was exhausted).  A receiver with no unfinished frame reads into it, cuts every complete
  frame out of it, and moves an unfinished tail into a buffer of its own.  So between calls
  the scratch holds nothing anybody needs: the next read of any receiver may overwrite it.
- With a ``raw_pool`` (a SlabPool of large slots -- pool memory the project owns,
  never handed back to the kernel, so no page is faulted in again), the arena also holds
  one slot of it, the *big* buffer.  Raw receivers (header_size 0) read into it instead of
  the scratch -- one recv takes a whole large message, as asyncio's 256 KiB recv does --
  under the same rules as the scratch: a busy mark, and a fresh slot swapped in after a
  burst that left a view of it alive (a frame view a send holds by reference: the old
  slot goes back to raw_pool when that send is done).  Raw receivers never keep bytes, so
  it holds nothing between calls.  Framed receivers never use it: their reads stay
  slot-sized, so what a session keeps is bounded as before.
- A receiver owns at most one buffer (``own``), and only while bytes are kept in it (an
  unfinished frame, or frames a handler exception left undelivered): a pool Slot, a heap
  buffer of slot size (pool exhausted; counted in arena.fallbacks) or, for a frame larger
  than a slot, a heap buffer of exactly that frame (reserved only after its header passed
  max_frame; reads into it ask only for the bytes still missing).  When the kept bytes are
  delivered, the buffer goes back at once.
- With a ``frame_cache``, a frame buffer (larger than a slot) is not freed when
  it dies -- after our reference and its last view are gone, in whatever thread -- but kept
  by the arena (up to frame_cache bytes, 16 buffers) and handed to the next large frame of
  need..min(max_frame + header, 2 x need) bytes (a buffer is at most twice its frame, so a
  frame view sent by reference pins at most twice its bytes): its pages stay resident instead of going back to the
  kernel and being faulted in again.  So a receiver still holds at most max_frame + header
  bytes of frame buffer; arena.close() frees what is kept.
- Frame views pin their buffer: an export of a Slot counts as a view on the Slot
  (c_view_acquired, as BlockTable's _FrameExporter does) and holds a strong reference to it;
  a heap buffer counts its views the same way and is freed only when the last view is gone.
  A burst makes one such export of its whole window at its first frame and hands out each
  frame as a memoryview registered on that export's managed buffer (narrowed to the frame),
  so the export -- and the pin -- lasts exactly as long as any frame view or sub-view of it.
  A frame view the handler left untouched (only our reference, not released, no export,
  weak reference or hash of it) is re-pointed at the next frame instead of making another:
  nobody can tell, and the common burst allocates one view object, not one per frame.
  The burst itself holds one more *reference* (Slot.c_retain) on the buffer it parses,
  from before the first frame until its bytes are settled, so no handler (close(),
  arena.close()) can return that buffer under it; and while it parses the scratch the arena
  is marked busy, so a nested read of another receiver swaps in a fresh scratch first.

When a slot returns
- Our own reference is dropped with Slot.c_release_deferred: at once if no view of the slot
  is alive, otherwise when the last view is released (Slot's DEFER bit).  That happens on
  close(), on deallocation, when the kept bytes are all delivered, when they move to
  another buffer, and when the stream fails (RX_TOO_LARGE, ENOMEM).  The arena's scratch
  likewise, on close() and on a swap.

Why no view ever sees rewritten memory
- Memory is written only by recv and by the memmove/memcpy that keeps an unfinished tail.
- recv writes into the scratch only after checking that no view of it is alive (a view left
  by the previous burst made the arena swap in a fresh scratch at the end of that burst; a
  burst still running up the stack is caught by the busy mark at the start), and into
  ``own`` only at [end, capacity): bytes after every frame delivered from it.
- The tail is slid down inside ``own`` (memmove) only when no view of it is alive; otherwise
  it is copied into a fresh buffer and the old one is released deferred.
- A view we hand out is released right after on_frame returns (a kept ``data`` raises
  ValueError afterwards, as a released memoryview does).  A sub-view or an export the
  handler keeps shares the export, so the pin lives exactly as long as the memory is visible.
- With copy_frames=True the handler gets bytes copies and nothing is pinned.

Frames are delivered in stream order; a receiver stops delivering at once when close() was
called (even from inside on_frame; an exception that on_frame raises after closing the
receiver still goes to on_event as RX_HANDLER) and after a handler exception (RX_HANDLER);
the frames of that read that were not delivered stay buffered (``pending``) and are
delivered first by the next on_readable().  A too-large header (RX_TOO_LARGE) ends the
stream's framing: the receiver drops what it kept and reads nothing more.  A BaseException
from on_frame (KeyboardInterrupt) propagates; the frame it interrupted counts as delivered
and the rest stays pending, as after RX_HANDLER.  If on_frame forked the process and the
fork comes back -- on_frame returns or raises there, a BaseException too (the fork's
``sys.exit()``) -- the fork gets on_event RX_FORKED (arg None or the exception) and nothing
else: no further frame, no RX_HANDLER (the owner ends the fork, with the status a
``sys.exit()`` asked for, whichever thread this is: the stream is the parent's).  If a heap buffer for a kept tail cannot
be allocated, on_event gets RX_ERROR with ENOMEM and the receiver reads nothing more.  An
exception from on_event itself goes to sys.unraisablehook: on_readable() never raises but a
BaseException.

Closed arena: on_readable() of a receiver whose arena was closed returns without reading.

PROXY protocol (``proxy=1|2|3``: v1, v2, either; 0 off).  The header is the stream's first
bytes: each burst first feeds its bytes to a ProxyParser (aoprim.server._proxyproto), which keeps
at most 232 bytes of its own and skips TLVs, so an unfinished header holds no buffer of ours
(``buffered`` counts its bytes, for the frame timeout).  When it completes, on_event gets
RX_PROXY with the parsed header, and -- unless that closed the receiver or set ``hold``
(the server's on_connect paused reading: then they stay ``pending``, raw framing included)
-- the bytes after it in the same read are framed at once.  A refused header (or EOF
inside one) gives RX_PROXY_ERROR with the reason, and nothing more is read.  Off, the only cost is one test
of ``pp`` per burst.

GC.  RxArena is not tracked by the cyclic GC (@no_gc): it references only its pool and its
scratch, neither of which can reference back, so it can never be part of a cycle.  A
Receiver is tracked (it holds the owner and the callbacks, which usually hold it: a cycle);
the GC may clear it, which drops only arena, callbacks, owner and exporter -- what close()
drops too.  Its buffer is held through a C pointer the clear never sees, and __dealloc__
returns it properly (c_release_deferred), so a collected cycle returns every slot without
the Slot's ResourceWarning path.  A cleared receiver reads nothing more.

Threads: one event-loop thread uses a receiver and its arena (no locking, like a socket),
and that is enforced rather than assumed.  Every entry of a Receiver claims it, and
on_readable() claims its arena too, with aoprim/_owner.pxd's tclaim: a compare-exchange of
the owner's thread ident (acquire), given back by the outermost entry with a release
store.  A second thread entering meanwhile gets RuntimeError naming the type and changes
nothing; on a free-threaded build it would otherwise read into the same scratch and free
the same buffer twice.  A claim, not a critical section: the types are documented as one
thread's, a second thread is a bug to report, and a critical section would be suspended
whenever a handler blocks -- exactly when the second thread would get in.  The claim is
re-entrant for the owning thread, because a handler legitimately calls back: on_frame may
close() its receiver, set ``hold``, close the arena or read another receiver of the same
arena (the ``busy`` marks then do what they did).  The counters (reads, bytes_in,
frames_in, scratch_swaps, fallbacks) are relaxed atomics written by the owner only, so a
stats reader on any thread needs no claim and never sees a torn value; fd, header_size,
max_frame, max_reads and copy_frames are fixed at construction.  Views handed out may be
released in any thread: pins are atomic counts.
"""
cimport cython
from cpython.ref cimport PyObject, Py_INCREF
from cpython.buffer cimport (PyBuffer_FillInfo, PyObject_GetBuffer, PyBuffer_Release,
                             PyBUF_SIMPLE)
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.memoryview cimport PyMemoryView_FromObject, PyMemoryView_FromMemory
from cpython.buffer cimport PyBUF_WRITE
from cpython.number cimport PyNumber_Index
from cpython.long cimport PyLong_CheckExact, PyLong_AsSsize_t
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memmove
from libc.errno cimport errno, EAGAIN, EINTR, ENOMEM, EIO
from libc.limits cimport INT_MAX

from aoprim.atomic_h cimport (
    AOP_RELAXED, AOP_ACQUIRE, AOP_RELEASE, aop_load_i64, aop_store_i64, aop_fetch_add_i64,
    aop_fetch_sub_i64, aop_spin_init, aop_spin_lock, aop_spin_unlock,
)
from aoprim._slab cimport SlabPool, Slot, aop_slab_take
from aoprim.server._proxyproto cimport ProxyParser, AOP_PP_MORE, AOP_PP_DONE
from aoprim._owner cimport tclaim, tunclaim, TCLAIM_OUTER
from aoprim._index cimport as_index as _as_index
from aoprim.server._rxbuf cimport (
    RxArena, _HeapBuf, _RxExporter, _heap, _bump, _count, _bptr, _bviews, _bhold, _bgive,
)
from aoprim.atomic_h cimport aop_atomic_i64, aop_load_u64p, aop_store_u64p


cdef extern from "Python.h":
    int PyBUF_WRITABLE
    Py_buffer *PyMemoryView_GET_BUFFER(object mview)
    # CPython's memoryview object (Include/cpython/memoryobject.h), read by _reusable
    ctypedef struct PyMemoryViewObject:
        Py_hash_t hash
        int flags
        Py_ssize_t exports
        PyObject *weakreflist
    int _Py_MEMORYVIEW_RELEASED
    Py_ssize_t Py_REFCNT(PyObject *o)
    void Py_DECREF_p "Py_DECREF"(PyObject *o)

cdef extern from "<errno.h>":
    int EWOULDBLOCK

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int MSG_DONTWAIT

RX_EOF = AOP_RX_EOF
RX_ERROR = AOP_RX_ERROR
RX_TOO_LARGE = AOP_RX_TOO_LARGE
RX_HANDLER = AOP_RX_HANDLER
RX_PROXY = AOP_RX_PROXY
RX_PROXY_ERROR = AOP_RX_PROXY_ERROR
RX_FORKED = AOP_RX_FORKED

# forks this process descends through, counted in each child: a receiver built before a
# fork sees the count changed once on_frame comes back in the child.  Written only in the
# child right after the fork, while it has one thread; read after on_frame, an opaque call
# the compiler cannot move the load across.
cdef unsigned long _forks = 0


def _count_fork():
    global _forks
    _forks += 1


import os as _os
_os.register_at_fork(after_in_child=_count_fork)

# _cut's verdict on the bytes left at its stop position
cdef enum:
    CUT_MORE = 0        # the rest is one unfinished frame (Receiver.need bytes once complete)
    CUT_STOP = 1        # delivery stopped early (close(), handler exception, BaseException)
    CUT_TOO_LARGE = 2   # a header above max_frame starts at the stop position

# max_frame is clamped here: a frame buffer's size must fit Py_ssize_t with room to spare
cdef uint64_t MAX_FRAME_CAP = (<uint64_t>1) << 62

cdef enum:
    FRAME_OK = 3        # _frame_at: a whole frame is there (its payload length in *n)


cdef inline int _frame_at(const unsigned char *q, Py_ssize_t avail, Py_ssize_t hs,
                          uint64_t max_frame, uint64_t *n, Py_ssize_t *need) noexcept nogil:
    """THE frame cutter's step (one cutter, so the two cannot disagree): the Receiver and _scan_frames (behind
    aoprim.server.framing) both call it.  q[0:avail) is where a frame starts; hs is 2 or 4
    (a big-endian length, then that many payload bytes).  Returns FRAME_OK with *n the
    payload length when the whole frame is there; CUT_MORE with *need its total size once
    complete (hs while the header itself is incomplete); CUT_TOO_LARGE with *n the announced
    length when the header announces more than max_frame -- decided as soon as the header is
    complete, before any payload byte is waited for or any memory reserved."""
    cdef uint64_t k
    if avail < hs:
        need[0] = hs
        return CUT_MORE
    if hs == 2:
        k = (<uint64_t>q[0] << 8) | q[1]
    else:
        k = ((<uint64_t>q[0] << 24) | (<uint64_t>q[1] << 16) |
             (<uint64_t>q[2] << 8) | q[3])
    n[0] = k
    if k > max_frame:
        return CUT_TOO_LARGE
    if <uint64_t>(avail - hs) < k:
        need[0] = hs + <Py_ssize_t>k        # k <= 2**32 - 1: no overflow
        return CUT_MORE
    return FRAME_OK


cdef object _scan_frames(object buf, object pos, object end, object header_size,
                         object max_frame):
    """Receiver.scan_frames (see there): the one cutter's loop for Python callers."""
    cdef Py_buffer view
    cdef Py_ssize_t p, e, hs, nd = 0
    cdef uint64_t mf, n = 0
    cdef int r
    cdef list spans = []
    hs = _as_index(header_size, "header_size")
    if hs != 2 and hs != 4:
        raise ValueError(f"header_size must be 2 or 4, not {hs}")
    if not PyLong_CheckExact(max_frame):
        _as_index(max_frame, "max_frame")          # TypeError for a float or a non-integer
        max_frame = PyNumber_Index(max_frame)
    if max_frame < 1:
        raise ValueError(f"max_frame must be >= 1, got {max_frame}")
    mf = min(max_frame, 0xFFFFFFFF)     # no header announces more than 2**32 - 1
    p = _as_index(pos, "pos")
    e = _as_index(end, "end")
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if p < 0 or p > e or e > view.len:
            raise ValueError(f"need 0 <= pos <= end <= len(buf), got pos={p} end={e} "
                             f"len={view.len}")
        while p < e:
            r = _frame_at(<const unsigned char *>view.buf + p, e - p, hs, mf, &n, &nd)
            if r == CUT_TOO_LARGE:
                return spans, p, hs, n
            if r == CUT_MORE:
                return spans, p, nd, None
            spans.append((p + hs, p + hs + <Py_ssize_t>n))
            p += hs + <Py_ssize_t>n
        return spans, p, 0, None
    finally:
        PyBuffer_Release(&view)


cdef inline bint _reusable(object mv) noexcept:
    """True if nobody but us can ever observe memoryview `mv` again, so that re-pointing it
    at the next frame is invisible: only our reference (checked by the caller), never
    released, no export of it, no weak reference, no cached hash."""
    cdef PyMemoryViewObject *m = <PyMemoryViewObject *>mv
    return (not (m.flags & _Py_MEMORYVIEW_RELEASED) and m.exports == 0 and
            m.weakreflist == NULL and m.hash == -1)


cdef void _report(object exc) noexcept:
    # a `noexcept` function that raises hands the exception to sys.unraisablehook
    raise exc


# ---- the receiver -------------------------------------------------------------------------

cdef class _RxSource:
    """Base of a compiled ``Receiver.source`` (see _receiver.pxd): the Receiver calls its
    C-level c_read instead of calling it.  Calling one from Python reads into a writable
    buffer through the same c_read (what a Python source returns)."""

    cdef ssize_t c_read(self, char *p, Py_ssize_t room, int *err) except -2:
        err[0] = EIO
        return -1

    def __call__(self, view):
        cdef Py_buffer b
        cdef int err = 0
        cdef ssize_t n
        PyObject_GetBuffer(view, &b, PyBUF_WRITABLE)
        try:
            n = self.c_read(<char *>b.buf, b.len, &err)
        finally:
            PyBuffer_Release(&b)
        if n >= 0:
            return n
        return None if err == EAGAIN else -err


@cython.final
cdef class Receiver:
    """Receiver(arena, fd, header_size, max_frame, on_frame, on_event, owner,
    copy_frames=False, proxy=0, proxy_limit=4096, max_reads=1): one connection's receive
    path.

    ``on_readable()`` does one recv and delivers every complete frame with
    ``on_frame(owner, data)``; while a recv fills all the room it was offered (more is
    probably waiting: a message larger than a slot), it reads again, up to ``max_reads``
    recvs per call -- unless the owner set ``hold`` (it paused reading) meanwhile; events go to ``on_event(owner, code, arg)`` (RX_EOF,
    RX_ERROR, RX_TOO_LARGE, RX_HANDLER, RX_PROXY, RX_PROXY_ERROR).  ``proxy``: expect a
    PROXY protocol header first (1 v1, 2 v2, 3 either; 0 none), at most ``proxy_limit``
    bytes (see ProxyParser).  ``close()`` gives every buffer back.  See the module
    docstring for the buffer rules.  One thread.
    """

    @staticmethod
    def scan_frames(buf, pos, end, header_size, max_frame):
        """The complete frames of ``buf[pos:end)`` cut by the receiver's own code, for
        Python callers (``aoprim.server.framing``'s ``Framing.scan`` and ``FrameDecoder``).
        Returns ``(spans, pos, need, too_large)``: ``spans`` the ``(start, stop)`` payload
        offsets in stream order; ``pos`` where the first incomplete frame begins (``end``
        when none); ``need`` its total size once complete (header included; the header size
        while the header is incomplete; 0 when nothing is pending); ``too_large`` None, or
        the length the header at ``pos`` announced above ``max_frame`` (nothing after it
        was looked at).  ``buf``: any buffer, exported (not copied) for the call;
        header_size 2 or 4; 0 <= pos <= end <= len(buf); max_frame >= 1."""
        return _scan_frames(buf, pos, end, header_size, max_frame)

    @staticmethod
    def is_frame_view(obj):
        """True if ``obj`` is a frame view a Receiver handed out (or one made from it): a
        read-only memoryview whose memory is never written while any export of it lives --
        so a sender may hold an export of it instead of copying it."""
        return type(obj) is memoryview and type(obj.obj) is _RxExporter

    def __cinit__(self, RxArena arena not None, fd, header_size, max_frame, on_frame,
                  on_event, owner, copy_frames=False, proxy=0, proxy_limit=4096,
                  max_reads=1):
        cdef Py_ssize_t f = _as_index(fd, "fd")
        cdef Py_ssize_t h = _as_index(header_size, "header_size")
        cdef object mf
        if f < 0 or f > INT_MAX:
            raise ValueError(f"fd must be a file descriptor >= 0, got {f}")
        if h != 0 and h != 2 and h != 4:
            raise ValueError(f"header_size must be 0 (raw), 2 (u16) or 4 (u32), got {h}")
        if not PyLong_CheckExact(max_frame):
            _as_index(max_frame, "max_frame")
            max_frame = PyNumber_Index(max_frame)
        if max_frame < 1:
            raise ValueError(f"max_frame must be >= 1, got {max_frame}")
        if not callable(on_frame):
            raise TypeError("on_frame must be callable")
        if not callable(on_event):
            raise TypeError("on_event must be callable")
        cdef Py_ssize_t mr = _as_index(max_reads, "max_reads")
        if mr < 1 or mr > 1024:
            raise ValueError(f"max_reads must be in 1..1024, got {mr}")
        mf = min(max_frame, MAX_FRAME_CAP)
        self.max_reads = <int>mr
        self.arena = arena
        self.fd = <int>f
        self.hs = <int>h
        self.max_frame = mf
        self.on_frame = on_frame
        self.on_event = on_event
        self.owner = owner
        self.copy_frames = bool(copy_frames)
        self.fx = _RxExporter.__new__(_RxExporter)
        self.forks = _forks
        self.fview = NULL
        self.own = NULL
        self.optr = NULL
        self.ocap = self.pos = self.end = self.want = self.need = 0
        # PROXY protocol: the parser validates proxy / proxy_limit (TypeError, ValueError)
        self.pp = None if proxy == 0 else ProxyParser(proxy, proxy_limit)

    def __dealloc__(self):
        # GC clear (if any) already dropped arena/callbacks/owner; `own` it never sees
        cdef PyObject *o = self.fview
        self.fview = NULL
        if o != NULL:               # only set during a burst (which holds a reference to us)
            Py_DECREF_p(o)
        o = self.own
        self.own = NULL
        if o != NULL:
            try:
                _bgive(<object>o)
            except Exception:
                pass
            Py_DECREF_p(o)

    # ---- buffer bookkeeping ------------------------------------------------------------------

    cdef int _adopt(self, object b, char *p, Py_ssize_t cap) except -1:
        Py_INCREF(b)
        self.own = <PyObject *>b
        self.optr = p
        self.ocap = cap
        return 0

    cdef int _drop_own(self) except -1:
        cdef PyObject *o = self.own
        cdef object b
        self.optr = NULL
        self.ocap = self.pos = self.end = self.want = 0
        self.pending = False
        if o == NULL:
            return 0
        self.own = NULL
        b = <object>o            # +1 (local)
        Py_DECREF_p(o)           # our stored reference
        _bgive(b)
        return 0

    # ---- the read path -----------------------------------------------------------------------

    cdef int c_on_readable(self) except -1:
        cdef int t = tclaim(&self.tid, "Receiver")
        cdef int ta = 0
        cdef RxArena arena
        try:
            arena = self.arena
            if arena is not None:
                ta = tclaim(&arena.tid, "RxArena")
                try:
                    self._on_readable(arena)
                finally:
                    if ta == TCLAIM_OUTER:
                        tunclaim(&arena.tid)
        finally:
            if t == TCLAIM_OUTER:
                tunclaim(&self.tid)
        return 0

    cdef int _on_readable(self, RxArena arena) except -1:
        # both claims held (see c_on_readable)
        if (self.closed or self.busy or self.failed or self.hold or arena is None
                or arena.closed):
            return 0            # hold: the owner paused reading -- no recv, no delivery
        if self.on_frame is None:          # cleared by the GC
            return 0
        cdef int k = 0
        self.busy = True
        try:
            if self.pending:
                self._burst(False)
                if self.pending or self.closed or self.failed or self.hold or arena.closed:
                    return 0
            while True:
                self.filled = False
                self._burst(True)
                k += 1
                # a recv that filled its room left more waiting (probably): read on,
                # within max_reads, unless a frame stopped us (close, handler exception,
                # too-large header), the owner paused reading, or the arena closed
                if (not self.filled or k >= self.max_reads or self.hold or self.pending
                        or self.closed or self.failed or arena.closed):
                    break
        finally:
            self.busy = False
        return 0

    def on_readable(self):
        """One non-blocking recv (MSG_DONTWAIT, GIL held) into the scratch or the
        unfinished frame's buffer, then every complete frame to on_frame in stream order;
        again while a recv fills its room (up to max_reads).  Would-block is quiet; EOF,
        errors, a too-large header and handler exceptions go to on_event.  Does nothing
        once closed, once the stream failed (RX_TOO_LARGE, RX_PROXY_ERROR, RX_ERROR ENOMEM),
        once the arena is closed, or while ``hold`` is set (which also stops it between two
        frames)."""
        self.c_on_readable()

    @property
    def hold(self):
        """Set by the owner while it has paused reading.  Takes effect at once, between
        frames: once set (by on_frame, say), no further frame is delivered and no further
        recv is made in the call that is running, and on_readable() does nothing while it
        stays set.  Frames already received stay buffered (``pending``): after clearing it,
        call on_readable() to deliver them -- the socket may have nothing new to report."""
        cdef int t = tclaim(&self.tid, "Receiver")
        h = self.hold
        if t == TCLAIM_OUTER:
            tunclaim(&self.tid)
        return h

    @hold.setter
    def hold(self, v):
        cdef bint h = bool(v)         # (its __bool__ runs before the claim)
        cdef int t = tclaim(&self.tid, "Receiver")
        self.hold = h
        if t == TCLAIM_OUTER:
            tunclaim(&self.tid)

    @property
    def source(self):
        """None (the default): each read is a non-blocking recv() on ``fd``.  Else a
        callable ``source(view)`` that does the read instead (the server's TLS sessions:
        ciphertext from the fd, decrypted into the slot): it fills the writable memoryview
        ``view`` (the room offered: the scratch or the unfinished frame's buffer) from the
        front and returns the bytes written, 0 at the end of the stream, None when nothing
        is there now, or -errno for an error (given to on_event as RX_ERROR).  The view is
        released when it returns; it must not be kept.  The source may close the receiver.
        A PROXY header (``proxy``) is looked for in what the source returns."""
        cdef int t = tclaim(&self.tid, "Receiver")
        try:
            return self.source
        finally:
            if t == TCLAIM_OUTER:
                tunclaim(&self.tid)

    @source.setter
    def source(self, v):
        if v is not None and not callable(v):
            raise TypeError("source must be callable or None")
        cdef int t = tclaim(&self.tid, "Receiver")
        try:
            self.source = v
            self.csource = v if isinstance(v, _RxSource) else None
        finally:
            if t == TCLAIM_OUTER:
                tunclaim(&self.tid)

    @property
    def max_reads(self):
        """recv calls one on_readable may make while each fills the room offered."""
        return self.max_reads

    cdef int _burst(self, bint do_read) except -1:
        cdef RxArena arena = self.arena
        cdef object buf
        cdef char *p
        cdef Py_ssize_t pos, end, room
        cdef ssize_t n
        cdef int err = 0, why, fail
        cdef object err_obj
        cdef bint in_own = self.own != NULL
        cdef bint in_big = False       # reading into arena.big (a raw receiver)
        if in_own:
            buf = <object>self.own
            p = self.optr
            pos = self.pos
            end = self.end
            room = (self.want if self.want else self.ocap) - end
            if room <= 0:
                do_read = False     # only a buffer of pending frames can be full, and those
                                    # are delivered by a non-reading burst first; an
                                    # unfinished frame always leaves room (see _settle).
                                    # A 0-byte recv would read as EOF
        else:
            if not do_read:
                self.pending = False
                return 0
            if arena.closed:
                # closed by a handler earlier in this on_readable (its scratch is None):
                # read nothing, take nothing for it
                return 0
            if self.hs == 0 and arena.bsize:
                # raw: one recv of up to raw_read_size bytes into the big buffer,
                # under the scratch's rules
                in_big = True
                buf = arena.big
                if arena.bbusy or _bviews(buf) != 0:
                    arena._swap_big()
                    buf = arena.big
                p = arena.bptr
                room = arena.bsize
            else:
                buf = arena.scratch
                if arena.busy or _bviews(buf) != 0:
                    # a burst further up the stack (a handler reading another receiver) is
                    # still parsing it, or a view of it lives: never read over it
                    arena._swap()
                    buf = arena.scratch
                p = arena.sptr
                room = arena.size
            pos = end = 0
        if do_read:
            # MSG_DONTWAIT: this recv never blocks, whatever the fd's mode, so it runs with
            # the GIL held -- releasing and re-taking the GIL around a non-blocking syscall
            # costs about as much as the syscall's own user-space work (a mutex and a condvar
            # signal each way: ~1000 instructions, measured with callgrind)
            if self.source is None:
                n = recv(self.fd, p + end, <size_t>room, MSG_DONTWAIT)
                if n < 0:
                    err = errno
            else:
                n = self._pull(p + end, room, &err)     # (TLS: decrypted bytes)
                if self.closed:
                    return 0    # the source closed us (nothing of buf is ours any more)
            if n <= 0:
                if n == 0:
                    if self.pp is not None and self.pp.c_eof():   # inside a PROXY header
                        self.failed = True
                        err_obj = self.pp.error
                        self.pp = None
                        self._event(AOP_RX_PROXY_ERROR, err_obj)
                    else:
                        self._event(AOP_RX_EOF, 0)
                elif err != EAGAIN and err != EWOULDBLOCK and err != EINTR:
                    self._event(AOP_RX_ERROR, err)
                return 0
            _bump(&self.reads, 1)
            _bump(&self.bytes_in, n)
            self.filled = n == room
            end += n
        self.pending = False
        _bhold(buf)                 # the burst's own reference: nobody returns buf under us
        if in_big:
            arena.bbusy = True      # (one flag per big buffer: _swap_big clears it)
        elif not in_own:
            arena.busy = True       # (one flag per scratch: _swap clears it)
        why = CUT_STOP              # what a BaseException leaves: the rest is kept pending
        fail = 0
        try:
            if self.pp is not None and self._proxy(p, &pos, end):
                why = CUT_MORE      # PROXY header unfinished or refused, or nothing after it
            elif self.hs == 0:      # raw: the chunk is the frame
                if self.hold:
                    # the RX_PROXY handler (on_connect) paused reading: the bytes that came
                    # with the header stay pending, delivered by the first on_readable()
                    # after hold is cleared -- as the framed path does between frames
                    why = CUT_STOP
                else:
                    n = pos         # (0, or where a PROXY header ended)
                    self._deliver(buf, None, p + n, end - n, &pos, end)  # pos = end, once built
                    why = CUT_MORE
            else:
                why = self._cut(buf, p, &pos, end)
        finally:
            try:
                fail = self._settle(buf, p, pos, end, why)
            finally:
                if in_big:
                    if arena.big is buf:
                        arena.bbusy = False
                elif not in_own and arena.scratch is buf:
                    arena.busy = False
                _bgive(buf)
        if why == CUT_TOO_LARGE:
            self._event(AOP_RX_TOO_LARGE, self.announced)
        elif fail:
            self._event(AOP_RX_ERROR, ENOMEM)
        return 0

    cdef ssize_t _pull(self, char *p, Py_ssize_t room, int *err) except -2:
        """recv() from ``source`` instead of the fd: source(view) with a writable view of
        p[0:room) (released right after: the source must not keep it).  Returns the bytes
        written (0: EOF), or -1 with *err set: EAGAIN for None, the errno for -errno, EIO
        for an exception of the source (reported to sys.unraisablehook)."""
        cdef object v
        cdef object r
        cdef Py_ssize_t n
        if self.csource is not None:     # compiled: no view, no Python call
            try:
                return self.csource.c_read(p, room, err)
            except Exception as e:
                _report(e)
                err[0] = EIO
                return -1
        v = PyMemoryView_FromMemory(p, room, PyBUF_WRITE)
        try:
            r = self.source(v)
        except Exception as e:
            _report(e)
            err[0] = EIO
            return -1
        finally:
            v.release()
        if r is None:
            err[0] = EAGAIN
            return -1
        n = r
        if n < 0:
            err[0] = <int>-n
            return -1
        if n > room:
            _report(ValueError(f"Receiver source returned {n} > {room} bytes offered"))
            err[0] = EIO
            return -1
        return n

    cdef int _proxy(self, char *p, Py_ssize_t *ppos, Py_ssize_t end) except -1:
        """Feed p[pos:end) to the PROXY parser.  0: the header is done and frames start at
        *ppos; 1: nothing to frame (*ppos == end): the header is unfinished (its bytes are
        the parser's now), refused (RX_PROXY_ERROR, nothing more is read), or done with no
        byte after it, or RX_PROXY's handler closed us."""
        cdef ProxyParser pp = self.pp
        cdef Py_ssize_t pos = ppos[0]
        pos += pp.c_feed(<const unsigned char *>p + pos, end - pos)
        if pp.state == AOP_PP_MORE:
            ppos[0] = end
            return 1
        self.pp = None
        if pp.state != AOP_PP_DONE:
            ppos[0] = end
            self.failed = True
            self._event(AOP_RX_PROXY_ERROR, pp.error)
            return 1
        ppos[0] = pos
        self._event(AOP_RX_PROXY, pp.result)
        if pos == end or self.closed:
            ppos[0] = end
            return 1
        return 0

    cdef int _cut(self, object buf, char *p, Py_ssize_t *ppos, Py_ssize_t end) except -1:
        # One pinned view of the whole window (`base`, made at the first frame) per burst;
        # each frame is a memoryview registered on base's managed buffer and re-pointed at
        # the frame: one object per frame, no getbuffer.  The pin lasts while base or any
        # frame view (or a sub-view a handler kept) lives: dropping base at the end leaves
        # exactly the escaped views holding it, which is what _settle checks.
        cdef PyObject *base = NULL
        cdef PyObject *f
        try:
            return self._cut_frames(buf, p, ppos, end, &base)
        finally:
            f = self.fview
            if f != NULL:
                self.fview = NULL
                Py_DECREF_p(f)           # the spare frame view (nobody else holds it)
            if base != NULL:
                Py_DECREF_p(base)        # the pin goes with the last view on base's buffer

    cdef int _cut_frames(self, object buf, char *p, Py_ssize_t *ppos, Py_ssize_t end,
                         PyObject **pbase) except -1:
        cdef Py_ssize_t pos = ppos[0]
        cdef Py_ssize_t hs = self.hs
        cdef uint64_t n = 0
        cdef int r
        cdef object base
        while True:
            if self.hold:
                # the owner paused reading (in on_frame, or in the RX_PROXY handler): no
                # further frame of these bytes is delivered; they stay pending until an
                # on_readable() after hold is cleared (the server's pause)
                return CUT_STOP
            r = _frame_at(<const unsigned char *>p + pos, end - pos, hs, self.max_frame, &n,
                          &self.need)
            if r == CUT_MORE:
                return CUT_MORE
            if r == CUT_TOO_LARGE:         # before any memory is reserved for it
                self.announced = n
                return CUT_TOO_LARGE
            pos += hs + <Py_ssize_t>n
            if not self.copy_frames and pbase[0] == NULL:
                base = self._view(buf, p, end)   # a MemoryError here consumes nothing
                Py_INCREF(base)              # owned by _cut's `base` from here
                pbase[0] = <PyObject *>base
            # _deliver consumes the frame (ppos, frames_in) once its object exists, before
            # on_frame runs: a MemoryError building it keeps the frame, an exception from
            # the handler (or a BaseException) does not deliver it twice
            if (self._deliver(buf, <object>pbase[0] if pbase[0] != NULL else None,
                              p + pos - <Py_ssize_t>n, <Py_ssize_t>n, ppos, pos)
                    or self.closed):
                return CUT_STOP

    cdef object _view(self, object buf, char *p, Py_ssize_t n):
        """A new read-only memoryview of p[0:n] that pins buf (see _RxExporter)."""
        cdef _RxExporter fx = self.fx
        fx.pin = <PyObject *>buf
        fx.ptr = p
        fx.len = n
        try:
            return PyMemoryView_FromObject(fx)
        finally:
            fx.pin = NULL

    cdef int _deliver(self, object buf, object base, char *p, Py_ssize_t n,
                      Py_ssize_t *ppos, Py_ssize_t newpos) except -1:
        """on_frame(owner, data): 0, or 1 after a handler exception (reported).  data is a
        bytes copy (copy_frames), a view registered on `base` re-pointed at p[0:n], or (no
        base) a view of its own.  Once data exists (and only then) the frame is consumed:
        *ppos = newpos, frames_in += 1 -- so a MemoryError building it loses nothing."""
        cdef object data
        cdef object exc = None
        cdef Py_buffer *v
        # taken before on_frame: a close() inside it drops the callbacks, and an exception
        # raised after that close must still be reported (logged and counted by the owner)
        cdef object on_event = self.on_event
        cdef object owner = self.owner
        if self.copy_frames:
            data = PyBytes_FromStringAndSize(p, n)
        elif base is not None:
            # a memoryview on base's managed buffer (no getbuffer) that nobody else holds:
            # the previous frame's if the handler left it untouched (_reusable), else a new
            # one.  Narrow it to this frame (1-D, 'B', itemsize 1: buf, len, shape[0]).
            if self.fview != NULL:
                data = <object>self.fview          # +1 (local)
                Py_DECREF_p(self.fview)            # the field's reference is now the local's
                self.fview = NULL
            else:
                data = PyMemoryView_FromObject(base)
            v = PyMemoryView_GET_BUFFER(data)
            v.buf = <void *>p
            v.len = n
            v.shape[0] = n
        else:
            data = self._view(buf, p, n)
        ppos[0] = newpos
        _bump(&self.frames_in, 1)
        try:
            self.on_frame(self.owner, data)
        except BaseException as e:
            if self.forks == _forks and not isinstance(e, Exception):
                raise           # KeyboardInterrupt & co propagate (in a fork: RX_FORKED)
            exc = e
        finally:
            if not self.copy_frames:
                if Py_REFCNT(<PyObject *>data) > 1:
                    # the handler kept it: release it now, so using it later raises
                    # ValueError (sub-views and exports it made keep the pin alive) --
                    # unless an export of it is alive (a send holding it by reference):
                    # then release() would only raise BufferError, and it stays valid
                    # (and pinned).  Tested first: raising and catching that error cost
                    # about a microsecond per large echo
                    if (<PyMemoryViewObject *>data).exports == 0:
                        try:
                            data.release()
                        except BufferError:
                            pass
                elif base is not None and exc is None and _reusable(data):
                    Py_INCREF(data)                # kept for the next frame of this burst
                    self.fview = <PyObject *>data
        if self.forks != _forks:
            # on_frame forked and this is the fork, come back: the owner ends it (the
            # view and the buffers go with the process), a BaseException -- the fork's
            # sys.exit() -- included: propagated, it would end only this thread
            data = None
            if on_event is not None:
                on_event(owner, AOP_RX_FORKED, exc)
            return 1
        if exc is not None:
            data = None
            if self.closed:
                if on_event is not None:
                    try:
                        on_event(owner, AOP_RX_HANDLER, exc)
                    except Exception as e:
                        _report(e)
            else:
                self._event(AOP_RX_HANDLER, exc)
            return 1
        return 0

    cdef int _event(self, int code, object arg) except -1:
        cdef object cb = self.on_event
        if cb is None:
            return 0
        try:
            cb(self.owner, code, arg)
        except Exception as e:
            _report(e)          # on_event must not fail; never raise into the loop
        return 0

    cdef int _settle(self, object buf, char *p, Py_ssize_t pos, Py_ssize_t end,
                     int why) except -1:
        """Keep what is left of buf[pos:end) and retire what is not; 1 if memory ran out.
        Runs while the burst still holds its reference to buf."""
        cdef RxArena arena = self.arena
        cdef bint in_own = self.own != NULL and self.own == <PyObject *>buf
        cdef Py_ssize_t rest = end - pos
        cdef Py_ssize_t need
        cdef int fail = 0
        cdef object nb
        cdef char *np
        if self.closed:
            return 0            # close() already gave own back; nothing is kept
        if why == CUT_TOO_LARGE:
            self.failed = True
            if in_own:
                self._drop_own()
        elif rest == 0:
            if in_own:
                self._drop_own()
        else:
            need = rest if why == CUT_STOP else self.need
            if in_own and pos + need <= self.ocap:
                # it fits where it is: keep reading after it (an exact buffer: up to its end)
                self.pos = pos
                self.end = end
                if self.want:
                    self.want = pos + need
            elif in_own and not self.want and need <= arena.size and _bviews(buf) == 0:
                # slot-size buffer, no view of it alive: slide the tail down
                memmove(p, p + pos, rest)
                self.pos = 0
                self.end = rest
            else:
                try:
                    if need > arena.size:
                        # one frame's buffer (its header passed max_frame): exactly need
                        # bytes, or a kept one of at most max_frame + header and at most
                        # twice need: a frame view sent by reference pins its
                        # whole buffer while the send is pending, so a 40 KiB frame must
                        # not pin a kept 1 MiB one
                        nb = arena._frame_buf(need, min(<Py_ssize_t>self.max_frame + self.hs,
                                                        2 * need))
                    else:
                        nb = arena._slot_or_heap()
                except MemoryError:
                    nb = None
                if nb is None:
                    self.failed = True
                    fail = 1
                    if in_own:
                        self._drop_own()
                else:
                    np = _bptr(nb)
                    memcpy(np, p + pos, rest)
                    if in_own:
                        self._drop_own()       # deferred while views of it live
                    self._adopt(nb, np, (<_HeapBuf>nb).size if type(nb) is _HeapBuf
                                else arena.size)
                    self.pos = 0
                    self.end = rest
                    self.want = need if need > arena.size else 0
            if why == CUT_STOP and not fail:
                self.pending = True
        if not in_own and _bviews(buf) != 0:
            # a view escaped: never read over it again
            if arena.scratch is buf:
                arena._swap()
            elif arena.big is buf:
                arena._swap_big()
        return fail

    # ---- API -----------------------------------------------------------------------------------

    def close(self):
        """Give every buffer back (a slot with live views goes back with its last view), stop
        delivering, drop the callbacks and the owner.  Exactly once; idempotent."""
        cdef int t = tclaim(&self.tid, "Receiver")
        try:
            if self.closed:
                return
            self.closed = True
            self.pp = None              # (a PROXY header still expected: no longer)
            self.source = None
            self.csource = None
            try:
                self._drop_own()
            finally:
                self.on_frame = None
                self.on_event = None
                self.owner = None
                self.arena = None
        finally:
            if t == TCLAIM_OUTER:
                tunclaim(&self.tid)

    cdef object _locked(self, int what):
        # the properties that read several fields or an object field, under the claim
        cdef int t = tclaim(&self.tid, "Receiver")
        try:
            if what == 0:
                return self.closed
            if what == 1:               # buffered
                if self.own != NULL:
                    return self.end - self.pos
                return self.pp.total if self.pp is not None else 0
            if what == 2:
                return self.pp is not None
            if what == 3:
                return self.own != NULL and type(<object>self.own) is Slot
            if what == 4:
                return self.pending
            return (f"<Receiver fd={self.fd} header_size={self.hs} closed={self.closed} "
                    f"reads={_count(&self.reads)} frames_in={_count(&self.frames_in)} "
                    f"buffered={self.end - self.pos if self.own != NULL else 0}>")
        finally:
            if t == TCLAIM_OUTER:
                tunclaim(&self.tid)

    @property
    def fd(self):
        """The socket's file descriptor (the caller owns the socket)."""
        return self.fd

    @property
    def closed(self):
        """True once close() ran."""
        return self._locked(0)

    @property
    def reads(self):
        """recv calls that returned data (any thread: a relaxed atomic)."""
        return _count(&self.reads)

    @property
    def bytes_in(self):
        """Bytes received (any thread: a relaxed atomic)."""
        return _count(&self.bytes_in)

    @property
    def frames_in(self):
        """Frames handed to on_frame (any thread: a relaxed atomic)."""
        return _count(&self.frames_in)

    @property
    def buffered(self):
        """Bytes kept for an unfinished frame (or undelivered frames), or of an unfinished
        PROXY header; 0 when none."""
        return self._locked(1)

    @property
    def proxy_pending(self):
        """True while a PROXY header is expected and not yet complete."""
        return self._locked(2)

    @property
    def holds_slot(self):
        """True while this receiver owns a pool slot."""
        return self._locked(3)

    @property
    def pending(self):
        """True while received bytes wait -- left by a handler exception, a BaseException,
        or ``hold`` set between frames -- for the next on_readable(), which delivers them
        before reading."""
        return self._locked(4)

    @property
    def header_size(self):
        """0 (raw), 2 (u16) or 4 (u32)."""
        return self.hs

    @property
    def max_frame(self):
        """Largest payload accepted (a larger header gives RX_TOO_LARGE)."""
        return self.max_frame

    @property
    def copy_frames(self):
        """True: frames are bytes copies; False: pinned, read-only memoryviews."""
        return self.copy_frames

    def __repr__(self):
        return self._locked(5)

    def __reduce__(self):
        raise TypeError("Receiver objects cannot be pickled")
