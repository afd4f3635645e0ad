# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""The receive path's buffers: :class:`RxArena` -- the scratch buffer every Receiver of one
event-loop thread reads into, the raw read slot, the cache of large frame buffers -- and the
heap buffers and the exporter behind frame views (fields and helpers: _rxbuf.pxd).  Who owns
which buffer, when it goes back and why no view ever sees rewritten memory is argued once,
for the whole receive path, at the top of aoprim/server/_receiver.pyx; the thread rule (one
owner, claimed) likewise.
"""
cimport cython
from cpython.ref cimport PyObject, Py_INCREF
from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdlib cimport malloc, free

from aoprim.atomic_h cimport aop_store_i64, aop_spin_init, aop_spin_lock, aop_spin_unlock
from aoprim._slab cimport aop_slab_take
from aoprim._owner cimport tclaim, tunclaim, TCLAIM_OUTER

cdef extern from "Python.h":
    int PyBUF_WRITABLE
    void Py_DECREF_p "Py_DECREF"(PyObject *o)


cdef object _slot_or_heap_of(RxArena a, SlabPool pool, Py_ssize_t size):
    """A buffer of ``size`` bytes for arena ``a``: a slot of ``pool``, else a heap buffer
    (counted in a.fallbacks)."""
    cdef int64_t i = aop_slab_take(pool.slab)
    if i >= 0:
        return pool._bind(i)
    _bump(&a.fallbacks, 1)
    return _heap(size)


cdef int _give_bufs(RxArena a) except -1:
    """Give a's big buffer and scratch back (each when its last view dies).  The fields are
    cleared first, so each goes back exactly once; the scratch goes back even when giving
    the big buffer back raised."""
    cdef object b = a.big
    cdef object s = a.scratch
    a.big = None
    a.bptr = NULL
    a.scratch = None
    a.sptr = NULL
    try:
        if b is not None:
            _bgive(b)
    finally:
        if s is not None:
            _bgive(s)
    return 0


cdef _HeapBuf _heap(Py_ssize_t n):
    cdef _HeapBuf h = _HeapBuf.__new__(_HeapBuf)
    h.ptr = <char *>malloc(n if n > 0 else 1)
    if h.ptr == NULL:
        raise MemoryError(f"cannot allocate a receive buffer of {n} bytes")
    h.size = n
    return h


@cython.final
@cython.no_gc
cdef class _FrameCache:
    """Large frame buffers kept for reuse (see _receiver.pxd).  Not GC-tracked: it holds
    no Python object."""

    def __cinit__(self, Py_ssize_t cap):
        aop_spin_init(&self.lock)
        self.cap = cap
        self.n = 0
        self.held = 0
        self.closed = False
        aop_store_i64(&self.out, 0, AOP_RELAXED)      # relaxed: not shared yet
        aop_store_i64(&self.reuses, 0, AOP_RELAXED)

    def __init__(self, *args, **kwargs):
        raise TypeError("internal to RxArena")

    cdef bint c_put(self, char *p, Py_ssize_t size) noexcept:
        """Keep p (size bytes) for reuse; False (the caller frees it) when closed or full.
        Any thread: the lock orders the entries (its acquire/release make them visible)."""
        cdef bint ok = False
        aop_spin_lock(&self.lock)
        if not self.closed and self.n < 16 and self.held + size <= self.cap:
            self.ptrs[self.n] = p
            self.sizes[self.n] = size
            self.n += 1
            self.held += size
            ok = True
        aop_spin_unlock(&self.lock)
        return ok

    cdef char *c_take(self, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t *size) noexcept:
        """The smallest kept buffer of lo..hi bytes (removed from the cache; its size in
        *size), or NULL."""
        cdef int i, best = -1
        cdef char *p = NULL
        aop_spin_lock(&self.lock)
        for i in range(self.n):
            if lo <= self.sizes[i] <= hi and (best < 0 or self.sizes[i] < self.sizes[best]):
                best = i
        if best >= 0:
            p = self.ptrs[best]
            size[0] = self.sizes[best]
            self.held -= self.sizes[best]
            self.n -= 1
            self.ptrs[best] = self.ptrs[self.n]
            self.sizes[best] = self.sizes[self.n]
        aop_spin_unlock(&self.lock)
        return p

    cdef void c_close(self) noexcept:
        """Free what is kept; later returns are refused (their memory is freed)."""
        cdef int i, n
        cdef char *ps[16]
        aop_spin_lock(&self.lock)
        self.closed = True
        n = self.n
        for i in range(n):
            ps[i] = self.ptrs[i]
        self.n = 0
        self.held = 0
        aop_spin_unlock(&self.lock)
        for i in range(n):
            free(ps[i])

    def __dealloc__(self):
        # nobody else references us any more: no lock needed
        cdef int i
        for i in range(self.n):
            free(self.ptrs[i])
        self.n = 0


@cython.final
@cython.no_gc
cdef class _HeapBuf:
    """Receive memory from malloc (see _receiver.pxd)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("internal to Receiver")

    def __dealloc__(self):
        cdef _FrameCache home = self.home
        cdef char *p = self.ptr
        self.ptr = NULL
        if home is not None:
            # relaxed: a statistic (buffers of this home alive), read for tests and stats
            aop_fetch_sub_i64(&home.out, 1, AOP_RELAXED)
            if p != NULL and home.c_put(p, self.size):
                return          # kept, resident, for the next large frame
        free(p)


@cython.final
@cython.no_gc
cdef class _RxExporter:
    """Exports the window that Receiver._view set just before (pin, ptr, len; see
    _receiver.pxd)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("internal to Receiver")

    def __getbuffer__(self, Py_buffer *view, int flags):
        cdef PyObject *pin = self.pin
        if pin == NULL:
            raise BufferError("frame views come from Receiver.on_readable()")
        if flags & PyBUF_WRITABLE:
            raise BufferError("frame views are read-only")
        _bpin(<object>pin)                  # pins the buffer: a view count on it ...
        PyBuffer_FillInfo(view, self, self.ptr, self.len, 1, flags)
        Py_INCREF(<object>pin)              # ... and a strong reference
        view.internal = <void *>pin

    def __releasebuffer__(self, Py_buffer *view):
        cdef object b = <object>view.internal     # +1 (local)
        Py_DECREF_p(<PyObject *>view.internal)    # the reference taken in getbuffer
        _bunpin(b)                                 # may give a released Slot back


# ---- the arena ----------------------------------------------------------------------------

@cython.final
@cython.no_gc
cdef class RxArena:
    """RxArena(pool, raw_pool=None, frame_cache=0): the scratch buffer every Receiver of one event-loop
    thread reads into.

    Acquires one slot of ``pool`` at construction (an idle server shows 1 slot in use).
    ``raw_pool``: a SlabPool of large slots; the arena also holds one of them, which raw
    receivers read into, so a large raw message is one recv (not one per slot).
    ``frame_cache``: bytes of large frame buffers (a frame above slot size) kept resident
    for the next large frame instead of freed (0: none; see ``frame_cache``).
    ``close()`` gives them back (deferred while views of them live); idempotent.  Receivers
    of a closed arena return from on_readable() without reading.  One thread.
    """

    def __cinit__(self, SlabPool pool not None, SlabPool raw_pool=None, frame_cache=0):
        cdef Py_ssize_t fc = _as_index(frame_cache, "frame_cache")
        if fc < 0:
            raise ValueError(f"frame_cache must be >= 0, got {fc}")
        self.frames = _FrameCache.__new__(_FrameCache, fc) if fc else None
        self.pool = pool
        self.scratch = pool.acquire()            # PoolExhausted: no arena without one
        self.sptr = (<Slot>self.scratch).ptr
        self.size = pool.slab.slot_size
        self.bbusy = False
        self.bsize = 0
        self.bptr = NULL
        if raw_pool is not None:
            try:
                self.big = raw_pool.acquire()
            except BaseException:
                _give_bufs(self)
                raise
            self.raw_pool = raw_pool
            self.bptr = (<Slot>self.big).ptr
            self.bsize = raw_pool.slab.slot_size
        # relaxed: the arena is not published to another thread yet
        aop_store_u64p(<uint64_t *>&self.swaps, 0, AOP_RELAXED)
        aop_store_u64p(<uint64_t *>&self.fallbacks, 0, AOP_RELAXED)
        aop_store_i64(&self.tid, 0, AOP_RELAXED)
        self.closed = False
        self.busy = False

    def __dealloc__(self):
        try:
            _give_bufs(self)
        except Exception:
            pass

    cdef object _slot_or_heap(self):
        return _slot_or_heap_of(self, self.pool, self.size)

    cdef int _swap(self) except -1:
        cdef object old = self.scratch
        if self.closed:
            return 0        # never take a slot for a closed arena: nothing would return it
        cdef object new = self._slot_or_heap()
        self.scratch = new
        self.sptr = _bptr(new)
        _bump(&self.swaps, 1)
        self.busy = False   # the flag describes the scratch in place
        _bgive(old)         # goes back when its last view dies
        return 0

    cdef object _frame_buf(self, Py_ssize_t need, Py_ssize_t most):
        """A buffer for one frame of ``need`` bytes: a kept one of need..most bytes from the
        frame cache, else a new one of exactly need (whose memory goes to the cache when it
        dies, if there is one).  MemoryError when malloc fails."""
        cdef _FrameCache fc = self.frames
        cdef _HeapBuf h
        cdef char *p
        cdef Py_ssize_t sz = 0
        if fc is None:
            return _heap(need)
        p = fc.c_take(need, most if most > need else need, &sz)
        if p != NULL:
            h = _HeapBuf.__new__(_HeapBuf)
            h.ptr = p
            h.size = sz
            # relaxed: statistics
            aop_fetch_add_i64(&fc.reuses, 1, AOP_RELAXED)
        else:
            h = _heap(need)
        h.home = fc
        aop_fetch_add_i64(&fc.out, 1, AOP_RELAXED)
        return h

    cdef int _swap_big(self) except -1:
        """A fresh big buffer: another raw_pool slot (a heap buffer of that size when the
        pool is exhausted: counted in fallbacks); the old one goes back with its last
        view."""
        cdef object old = self.big
        cdef object new
        if self.closed:
            return 0
        new = _slot_or_heap_of(self, self.raw_pool, self.bsize)
        self.big = new
        self.bptr = _bptr(new)
        _bump(&self.swaps, 1)
        self.bbusy = False
        _bgive(old)
        return 0

    def close(self):
        """Give the scratch and the big buffer back (each when its last view dies, if views
        are alive).  Idempotent."""
        cdef int t = tclaim(&self.tid, "RxArena")
        try:
            if self.closed:
                return
            self.closed = True
            if self.frames is not None:
                self.frames.c_close()
            _give_bufs(self)
        finally:
            if t == TCLAIM_OUTER:
                tunclaim(&self.tid)

    @property
    def pool(self):
        """The SlabPool scratch and receive slots come from."""
        return self.pool

    @property
    def slot_size(self):
        """Bytes per read into the scratch (== pool.slot_size)."""
        return self.size

    @property
    def frame_cache(self):
        """Frame buffer reuse: {"cap": bytes it may keep, "kept": buffers kept
        now, "kept_bytes", "in_use": large frame buffers alive now (held by receivers or
        frame views), "reuses": buffers handed out again}; None without a frame cache."""
        cdef _FrameCache fc = self.frames
        cdef int n
        cdef Py_ssize_t held
        if fc is None:
            return None
        aop_spin_lock(&fc.lock)
        n = fc.n
        held = fc.held
        aop_spin_unlock(&fc.lock)
        # relaxed: statistics
        return {"cap": fc.cap, "kept": n, "kept_bytes": held,
                "in_use": aop_load_i64(&fc.out, AOP_RELAXED),
                "reuses": aop_load_i64(&fc.reuses, AOP_RELAXED)}

    @property
    def raw_pool(self):
        """The SlabPool raw receivers read into (None: they read into the scratch)."""
        return self.raw_pool

    @property
    def raw_read_size(self):
        """Bytes per recv of a raw receiver: raw_pool's slot size, or slot_size without
        raw_pool."""
        return self.bsize if self.bsize else self.size

    @property
    def scratch_swaps(self):
        """Times the scratch (or the big buffer) was replaced because a frame view of it
        escaped."""
        return _count(&self.swaps)

    @property
    def fallbacks(self):
        """Times a heap buffer of slot size was used because the pool was exhausted."""
        return _count(&self.fallbacks)

    @property
    def closed(self):
        """True once close() ran."""
        cdef int t = tclaim(&self.tid, "RxArena")
        c = self.closed
        if t == TCLAIM_OUTER:
            tunclaim(&self.tid)
        return c

    def __repr__(self):
        return (f"<RxArena slot_size={self.size} closed={self.closed} "
                f"scratch_swaps={_count(&self.swaps)} fallbacks={_count(&self.fallbacks)}>")

    def __reduce__(self):
        raise TypeError("RxArena objects cannot be pickled")
