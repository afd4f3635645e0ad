# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""BlockTable: a growable byte sequence stored in SlabPool slots (a logical -> physical block
table, as in paged KV caches), and the receive-buffer fast path built on it.

Layout and invariants (bsize = pool.slot_size, nb = len(_blocks))
- logical byte k lives in _blocks[(start + k) // bsize] at offset (start + k) % bsize;
- 0 <= start < bsize; nb == 0 implies start == 0 and nbytes == 0;
- the last block holds fill = start + nbytes - (nb - 1) * bsize bytes, 0 <= fill <= bsize
  (fill is 0 only for a block that tail() reserved before anything was committed to it);
- every block in _blocks holds one reference of this table; a block with refs > 1 is shared
  (by fork()) and is never written: an append or tail() first copies a shared last block
  (copy on write).  Bytes before `fill` are never rewritten, so views of them stay valid;
- consume() moves `start` forward and returns whole blocks as they empty (no memmove of
  data); when the table becomes empty every block goes back;
- mutations are refused (BufferError) while a view of tail() is exported, as bytearray
  refuses to resize while exported.

Views of blocks (view()) are memoryviews of the block's Slot: they pin the block.  When the
table drops a block that still has views, the block goes back to the pool when the last view
is released (Slot.c_release_deferred), so a frame view stays valid as long as it is held and
no view ever sees a reused slot.

Threads: reads from any threads at once (``len``, ``bytes``, ``read``, ``blocks``,
``tail_room``); anything else by one owner at a time (a receive buffer belongs to one
session), enforced rather than assumed.  ``busy`` is a readers-writer claim
(aoprim/_owner.pxd: ``rclaim`` counts readers, ``wclaim`` takes it for one writer with a
compare-exchange from 0; acquire to take, release to give back), so a writer meeting
anyone, or a reader meeting a writer, gets RuntimeError and changes nothing -- on a
free-threaded build a reader beside a writer would otherwise race on ``_blocks`` and the
block reference counts, and two writers would free a slot twice.  A claim rather than a critical section: the type is documented as one
owner's, a second thread is a bug to report, not to serialise, and the claim costs one
exchange per call and never waits.  Arguments are converted (``__index__``, the buffer
export of ``append``'s data) before the claim, so a callback they run can use the table.
The tail buffer's export claims the table too; the release of an export (any thread, at
any time) only decrements the atomic ``exports``.  A fork is a separate table and may be
used in another thread: shared blocks are only read, and the block reference counts are
atomic.
"""
cimport cython
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBuffer_FillInfo
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.ref cimport PyObject, Py_INCREF
from cpython.memoryview cimport PyMemoryView_FromObject
from cpython.number cimport PyNumber_Index
from cpython.ref cimport PyObject as _PyObj

cdef extern from "Python.h":
    # exc NULL: an out-of-range integer is clamped, no exception
    Py_ssize_t PyNumber_AsSsize_t(object o, _PyObj *exc) except? -1
from cpython.long cimport PyLong_CheckExact, PyLong_AsSsize_t
from libc.string cimport memcpy
from libc.stdint cimport int64_t

from aoprim.atomic_h cimport (AOP_ACQUIRE, AOP_ACQ_REL, AOP_RELAXED, aop_load_i64,
                             aop_store_i64, aop_fetch_add_i64, aop_fetch_sub_i64)
from aoprim._owner cimport wclaim, rclaim, runclaim, unclaim, owner_busy
from aoprim._slab cimport SlabPool, Slot, aop_slab_take, AOP_SLOT_REF_MASK
from aoprim.errors import PoolExhausted

cdef extern from "Python.h":
    int PyBUF_SIMPLE
    void Py_DECREF_p "Py_DECREF"(PyObject *o)


cdef inline Py_ssize_t _as_index(object v, str what) except? -1:
    """operator.index(v): TypeError for non-integers (a float is never truncated).  An
    integer beyond Py_ssize_t is clamped to PY_SSIZE_T_MIN/MAX (as slicing does), so it
    fails the caller's range check with the same ValueError as any other bad offset.
    Every range check below is written so that no sum can overflow: p > nbytes - n with
    0 <= n <= 8 and nbytes >= 0, never p + n > nbytes (which
    overflows for p near 2**63 and would let a read go far out of bounds)."""
    if not PyLong_CheckExact(v):
        if isinstance(v, float) or not hasattr(type(v), "__index__"):
            raise TypeError(f"{what} must be an integer, not {type(v).__name__}")
        v = PyNumber_Index(v)
    return PyNumber_AsSsize_t(v, NULL)


cdef inline object _pre_index(object v, str what):
    """None, or ``v`` as an exact int (its __index__ runs here, before the table is
    claimed, so a callback in it may use the table)."""
    if v is None or PyLong_CheckExact(v):
        return v
    if isinstance(v, float) or not hasattr(type(v), "__index__"):
        raise TypeError(f"{what} must be an integer, not {type(v).__name__}")
    return PyNumber_Index(v)


cdef inline int _enter(BlockTable t) except -1:
    # a method that changes the table (or exports its memory): one owner, nobody reading
    if not wclaim(&t.busy):
        owner_busy("BlockTable")
    return 0


cdef inline int _enter_read(BlockTable t) except -1:
    # a read: shared with other readers, refused only beside a writer; runclaim() after
    if not rclaim(&t.busy):
        raise RuntimeError("BlockTable is being changed by another thread (reads may be "
                           "shared; a change needs the table to itself)")
    return 0


cdef inline bint _shared(Slot s) noexcept:
    # acquire: if another holder just dropped its reference (refs now 1), we see its last
    # writes before writing in place (pairs with the acq_rel decrement in Slot release)
    return (aop_load_i64(&s.state, AOP_ACQUIRE) & AOP_SLOT_REF_MASK) > 1


# GC: not tracked (no_gc).  Every field is a final aoprim type that cannot reach back to a
# table (pool, a private list of Slots, the two exporters), so no cycle can pass through
# one; the GC therefore never clears it, and __dealloc__ always finds _tail intact to reset
# its borrowed pointer (a tp_clear that set _tail to None first left that pointer dangling).
@cython.final
@cython.no_gc
cdef class BlockTable:
    """BlockTable(pool): a byte sequence stored in blocks (slots) of ``pool``.

    Python slice semantics for ranges (read, view): negative positions count from the end,
    out-of-range positions are clamped, an empty or reversed range gives b"".
    """

    def __cinit__(self, SlabPool pool not None):
        self.pool = pool
        self._blocks = []
        self.bsize = pool.slab.slot_size
        self.start = 0
        self.nbytes = 0
        # relaxed: the table is not published to another thread yet
        aop_store_i64(&self.exports, 0, AOP_RELAXED)
        self._tail = None

    def __dealloc__(self):
        # Dropping a table returns its blocks, quietly (like freeing a bytearray).
        cdef Slot s
        if self._tail is not None:
            self._tail.table = NULL
        if self._blocks:
            for s in self._blocks:
                try:
                    s.c_release_deferred()
                except Exception:
                    pass
            self._blocks = None

    # ---- internals -------------------------------------------------------------------------

    cdef Py_ssize_t _fill_last(self):
        cdef Py_ssize_t nb = len(self._blocks)
        if nb == 0:
            return self.bsize
        return self.start + self.nbytes - (nb - 1) * self.bsize

    cdef int _check_unexported(self) except -1:
        # acquire: pairs with the acq_rel decrement in _TailBuffer.__releasebuffer__ (any
        # thread), so whatever the releasing thread did with the tail bytes happened before
        # we write there again
        if aop_load_i64(&self.exports, AOP_ACQUIRE):
            raise BufferError("the table's tail buffer is exported (release the view first)")
        return 0

    cdef Slot _take1(self):
        cdef int64_t i = aop_slab_take(self.pool.slab)
        if i < 0:
            raise PoolExhausted(f"all {self.pool.slab.nslots} slots of the pool are in use")
        return self.pool._bind(i)

    cdef int _prepare_tail(self) except -1:
        cdef Py_ssize_t nb = len(self._blocks)
        cdef Py_ssize_t fill = self._fill_last()
        cdef Slot last, c
        if nb == 0 or fill == self.bsize:
            self._blocks.append(self._take1())
            return 0
        last = <Slot>self._blocks[nb - 1]
        if _shared(last):
            c = self._take1()
            memcpy(c.ptr, last.ptr, fill)
            self._blocks[nb - 1] = c
            last.c_release_deferred()
        return 0

    cdef int _write(self, const char *src, Py_ssize_t n) except -1:
        cdef Py_ssize_t B = self.bsize
        cdef Py_ssize_t nb = len(self._blocks)
        cdef Py_ssize_t fill = self._fill_last()
        cdef Py_ssize_t room = B - fill
        cdef Py_ssize_t need, total, m, k, written = n
        cdef bint cow
        cdef Slot last = None, c, one = None
        cdef list fresh = None
        if n <= 0:
            return 0
        if nb:
            last = <Slot>self._blocks[nb - 1]
        cow = room > 0 and last is not None and _shared(last)
        need = (n - room + B - 1) // B if n > room else 0
        total = need + (1 if cow else 0)
        # take every block first: PoolExhausted leaves the table unchanged
        if total == 1:
            one = self._take1()
        elif total > 1:
            fresh = []
            try:
                for k in range(total):
                    fresh.append(self._take1())
            except BaseException:
                for c in fresh:
                    c.c_release_deferred()
                raise
        # from here on nothing can fail
        k = 0
        if cow:
            if one is not None:
                c = one
                one = None
            else:
                c = <Slot>fresh[0]
                k = 1
            memcpy(c.ptr, last.ptr, fill)
            self._blocks[nb - 1] = c
            last.c_release_deferred()
            last = c
        if room > 0 and last is not None:
            m = room if n > room else n
            memcpy(last.ptr + fill, src, m)
            src += m
            n -= m
        while n > 0:
            if one is not None:
                c = one
                one = None
            else:
                c = <Slot>fresh[k]
                k += 1
            m = B if n > B else n
            memcpy(c.ptr, src, m)
            self._blocks.append(c)
            src += m
            n -= m
        self.nbytes += written
        return 0

    cdef int _copy_out(self, char *dst, Py_ssize_t pos, Py_ssize_t n) except -1:
        cdef Py_ssize_t B = self.bsize
        cdef Py_ssize_t p = self.start + pos
        cdef Py_ssize_t bi = p // B, off = p % B, m
        cdef Slot s
        while n > 0:
            s = <Slot>self._blocks[bi]
            m = B - off
            if m > n:
                m = n
            memcpy(dst, s.ptr + off, m)
            dst += m
            n -= m
            bi += 1
            off = 0
        return 0

    cdef int _drop_front(self, Py_ssize_t k) except -1:
        cdef Py_ssize_t j
        cdef Slot s
        if k <= 0:
            return 0
        for j in range(k):
            s = <Slot>self._blocks[j]
            s.c_release_deferred()
        del self._blocks[:k]
        return 0

    cdef int _range(self, object start, object stop, Py_ssize_t *a, Py_ssize_t *b) except -1:
        cdef Py_ssize_t n = self.nbytes, x, y
        x = 0 if start is None else _as_index(start, "start")
        y = n if stop is None else _as_index(stop, "stop")
        if x < 0:
            x += n
            if x < 0:
                x = 0
        elif x > n:
            x = n
        if y < 0:
            y += n
            if y < 0:
                y = 0
        elif y > n:
            y = n
        if y < x:
            y = x
        a[0] = x
        b[0] = y
        return 0

    # ---- public API ----------------------------------------------------------------------

    def append(self, data):
        """Append the bytes of ``data`` (any C-contiguous bytes-like object).

        Fills the last block before taking new ones; a shared last block is copied first.
        PoolExhausted leaves the table unchanged (no partial append)."""
        cdef Py_buffer buf
        PyObject_GetBuffer(data, &buf, PyBUF_SIMPLE)    # before the claim: see the docstring
        try:
            _enter(self)
            try:
                self._check_unexported()
                self._write(<const char *>buf.buf, buf.len)
            finally:
                unclaim(&self.busy)
        finally:
            PyBuffer_Release(&buf)

    def __len__(self):
        _enter_read(self)
        n = self.nbytes
        runclaim(&self.busy)
        return n

    def __bytes__(self):
        _enter_read(self)
        try:
            out = PyBytes_FromStringAndSize(NULL, self.nbytes)
            self._copy_out(PyBytes_AS_STRING(out), 0, self.nbytes)
            return out
        finally:
            runclaim(&self.busy)

    def read(self, start=0, stop=None):
        """bytes of the range [start:stop), with Python slice semantics."""
        cdef Py_ssize_t a, b
        start = _pre_index(start, "start")
        stop = _pre_index(stop, "stop")
        _enter_read(self)
        try:
            self._range(start, stop, &a, &b)
            out = PyBytes_FromStringAndSize(NULL, b - a)
            self._copy_out(PyBytes_AS_STRING(out), a, b - a)
            return out
        finally:
            runclaim(&self.busy)

    @property
    def blocks(self):
        """Physical slot indices of the blocks, in logical order."""
        _enter_read(self)
        try:
            return self._indices()
        finally:
            runclaim(&self.busy)

    cdef tuple _indices(self):
        cdef Slot s
        return tuple([s._index for s in self._blocks])

    @property
    def pool(self):
        """The SlabPool the blocks come from."""
        return self.pool            # set once in __cinit__: no claim needed

    def fork(self):
        """A new table sharing every block (each retained; nothing copied).  A later write to
        either side copies a shared last block first, so neither sees the other's writes."""
        cdef BlockTable t = BlockTable(self.pool)
        cdef Slot s
        _enter(self)
        try:
            self._check_unexported()
            for s in self._blocks:
                s.c_retain()
            t._blocks = list(self._blocks)
            t.start = self.start
            t.nbytes = self.nbytes
        finally:
            unclaim(&self.busy)
        return t

    def consume(self, n):
        """Drop the first ``n`` bytes (0 <= n <= len), returning whole blocks to the pool as
        they empty; when the table becomes empty every block goes back."""
        cdef Py_ssize_t k = _as_index(n, "n")
        _enter(self)
        try:
            if k < 0 or k > self.nbytes:
                raise ValueError(f"consume({k}) out of range 0..{self.nbytes}")
            if k == 0:
                return
            self._check_unexported()
            self.nbytes -= k
            if self.nbytes == 0:
                self._drop_front(len(self._blocks))
                self.start = 0
                return
            self.start += k
            k = self.start // self.bsize
            if k:
                self._drop_front(k)
                self.start -= k * self.bsize
        finally:
            unclaim(&self.busy)

    def release(self):
        """Give back every block reference; the table is then empty and reusable."""
        _enter(self)
        try:
            self._check_unexported()
            self._drop_front(len(self._blocks))
            self.start = 0
            self.nbytes = 0
        finally:
            unclaim(&self.busy)

    # ---- receive fast path (beyond the public API) ---------------------------------------

    def tail(self):
        """The free tail of the last block, as a writable bytes-like object to receive into:
        ``n = sock.recv_into(t.tail()); t.commit(n)``.

        Takes a new block if the last one is full (or there is none) and copies a shared last
        block first, so the region is this table's alone; PoolExhausted if no slot is free.
        Always the same object (nothing is allocated per read); each buffer export re-points
        it at the current tail.  Its length is the free room (1..slot_size).  While a view of
        it is alive, append/commit/consume/fork/release raise BufferError."""
        _enter(self)
        try:
            self._prepare_tail()
            if self._tail is None:
                self._tail = _TailBuffer.__new__(_TailBuffer)
                self._tail.table = <PyObject *>self
            return self._tail
        finally:
            unclaim(&self.busy)

    @property
    def tail_room(self):
        """Free bytes at the end of the last block (0 when there is no block or it is full)."""
        _enter_read(self)
        try:
            return self._tail_room()
        finally:
            runclaim(&self.busy)

    cdef Py_ssize_t _tail_room(self):
        if not self._blocks:
            return 0
        return self.bsize - self._fill_last()

    def commit(self, n):
        """Claim ``n`` bytes written into the tail (0 <= n <= tail_room) as part of the table."""
        cdef Py_ssize_t k = _as_index(n, "n")
        cdef Py_ssize_t room
        _enter(self)
        try:
            room = self._tail_room()
            if k < 0 or k > room:
                raise ValueError(f"commit({k}) out of range 0..{room}")
            self._check_unexported()
            self.nbytes += k
        finally:
            unclaim(&self.busy)

    def view(self, start=0, stop=None):
        """The range [start:stop) (slice semantics) without copying when it lies within one
        block: a read-only memoryview of that block (it pins the block: the slot returns to
        the pool only after the view is released, even if the table drops it first).  A
        range that spans blocks is copied into bytes; an empty range gives b""."""
        cdef Py_ssize_t a, b
        start = _pre_index(start, "start")
        stop = _pre_index(stop, "stop")
        _enter(self)
        try:
            self._range(start, stop, &a, &b)
            return self._view(a, b)
        finally:
            unclaim(&self.busy)

    cdef object _view(self, Py_ssize_t a, Py_ssize_t b):
        cdef Py_ssize_t p, q
        cdef _FrameExporter fx
        if a == b:
            return b""
        p = self.start + a
        q = self.start + b - 1
        if p // self.bsize == q // self.bsize:
            fx = self._fx
            if fx is None:
                fx = self._fx = _FrameExporter.__new__(_FrameExporter)
            fx.slot = <Slot>self._blocks[q // self.bsize]
            fx.off = p % self.bsize
            fx.len = b - a
            try:
                return PyMemoryView_FromObject(fx)
            finally:
                fx.slot = None
        out = PyBytes_FromStringAndSize(NULL, b - a)
        self._copy_out(PyBytes_AS_STRING(out), a, b - a)
        return out

    cdef unsigned long long _uint(self, Py_ssize_t p, Py_ssize_t n):
        cdef Py_ssize_t B = self.bsize, q = self.start + p, j
        cdef unsigned long long v = 0
        cdef Slot blk
        cdef Py_ssize_t off
        blk = <Slot>self._blocks[q // B]
        off = q % B
        if off + n <= B:                    # header inside one block: the common case
            for j in range(n):
                v = (v << 8) | <unsigned char>blk.ptr[off + j]
            return v
        for j in range(n):
            blk = <Slot>self._blocks[(q + j) // B]
            v = (v << 8) | <unsigned char>blk.ptr[(q + j) % B]
        return v

    def frame(self, pos, header):
        """The payload of the length-prefixed frame at ``pos``: a ``header``-byte (1..8)
        big-endian length, then that many bytes.  Returns the payload as view() does
        (zero-copy memoryview within a block, bytes across blocks), or None while the header
        or the payload is incomplete.  The frame ends at pos + header + len(payload)."""
        cdef Py_ssize_t p = _as_index(pos, "pos"), h = _as_index(header, "header")
        cdef unsigned long long size
        if h < 1 or h > 8:
            raise ValueError(f"header must be in 1..8, got {h}")
        _enter(self)
        try:
            if p < 0 or p > self.nbytes:
                raise ValueError(f"pos {p} out of range 0..{self.nbytes}")
            if h > self.nbytes - p:             # 0 <= p <= nbytes: no overflow
                return None
            size = self._uint(p, h)
            if size > <unsigned long long>(self.nbytes - p - h):
                return None
            return self._view(p + h, p + h + <Py_ssize_t>size)
        finally:
            unclaim(&self.busy)

    def uint(self, pos, size):
        """The big-endian unsigned integer of ``size`` bytes (1..8) at ``pos`` (0 <= pos and
        pos + size <= len), read across blocks without allocating (for length headers)."""
        cdef Py_ssize_t p = _as_index(pos, "pos"), n = _as_index(size, "size")
        cdef unsigned long long v
        if n < 1 or n > 8:
            raise ValueError(f"size must be in 1..8, got {n}")
        _enter(self)
        try:
            if p < 0 or p > self.nbytes - n:    # 1 <= n <= 8: nbytes - n cannot overflow
                raise ValueError(f"uint({p}, {n}) out of range for length {self.nbytes}")
            v = self._uint(p, n)
        finally:
            unclaim(&self.busy)
        return v

    def __repr__(self):
        _enter(self)
        try:
            return f"<BlockTable len={self.nbytes} blocks={self._indices()} start={self.start}>"
        finally:
            unclaim(&self.busy)

    def __reduce__(self):
        raise TypeError("BlockTable objects cannot be pickled")


# GC: not tracked (it holds no strong reference; `table` is borrowed).  Safe because the
# table, itself never cleared by the GC, resets `table` in its __dealloc__.
@cython.final
@cython.no_gc
cdef class _TailBuffer:
    """The writable free tail of a BlockTable's last block (see BlockTable.tail())."""

    def __init__(self, *args, **kwargs):
        raise TypeError("use BlockTable.tail()")

    def __getbuffer__(self, Py_buffer *view, int flags):
        cdef BlockTable t
        cdef Slot last
        cdef Py_ssize_t fill
        if self.table == NULL:
            raise BufferError("the BlockTable is gone")
        t = <BlockTable>self.table
        _enter(t)                         # the export re-points the tail: the table's owner
        try:
            t._prepare_tail()
            fill = t._fill_last()
            last = <Slot>t._blocks[len(t._blocks) - 1]
            PyBuffer_FillInfo(view, self, last.ptr + fill, t.bsize - fill, 0, flags)
            # relaxed: under the claim, whose release store publishes it with the rest
            aop_fetch_add_i64(&t.exports, 1, AOP_RELAXED)
        finally:
            unclaim(&t.busy)
        Py_INCREF(t)                      # the table lives while its tail is exported
        view.internal = <void *>t

    def __releasebuffer__(self, Py_buffer *view):
        # any thread, claimed or not: only the atomic count changes.  acq_rel: release so
        # this thread's use of the tail bytes happens-before the owner's next write there
        # (its acquire load in _check_unexported)
        cdef BlockTable t = <BlockTable>view.internal
        aop_fetch_sub_i64(&t.exports, 1, AOP_ACQ_REL)
        Py_DECREF_p(<PyObject *>t)

    def __len__(self):
        if self.table == NULL:
            return 0
        return (<BlockTable>self.table).tail_room


# GC: not tracked (no_gc).  `slot` is a Slot (no references of its own) and is set only
# for the length of one view() call; each exported view pins its Slot through
# Py_buffer.internal, which no tp_clear could reach anyway.
@cython.final
@cython.no_gc
cdef class _FrameExporter:
    """Exports the block range that BlockTable.view() set just before (see the .pxd)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("use BlockTable.view()")

    def __getbuffer__(self, Py_buffer *view, int flags):
        cdef Slot s = self.slot
        if s is None:
            raise BufferError("use BlockTable.view()")
        s.c_view_acquired()                 # pins the block (counts as a view of the Slot)
        # read-only: a block may be shared with a fork, and committed bytes never change
        PyBuffer_FillInfo(view, self, s.ptr + self.off, self.len, 1, flags)
        Py_INCREF(s)
        view.internal = <void *>s

    def __releasebuffer__(self, Py_buffer *view):
        cdef Slot s = <Slot>view.internal     # +1 (local)
        Py_DECREF_p(<PyObject *>s)            # the reference taken in getbuffer
        s.c_view_released()                   # may give a dropped block back to the pool
