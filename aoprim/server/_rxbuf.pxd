# cython: language_level=3
"""The receive path's buffers, for ``cimport``: RxArena (the scratch every Receiver of one
event-loop thread reads into, the raw read slot, the frame cache), the heap buffers behind
frame views and the exporter that makes them, and the inline helpers both _rxbuf.pyx and
_receiver.pyx use on them.  Who owns which buffer, when it goes back and why no view ever
sees rewritten memory is argued once, at the top of aoprim/server/_receiver.pyx.

    from aoprim.server._rxbuf cimport RxArena
"""
from libc.stdint cimport int64_t, uint64_t
from cpython.ref cimport PyObject
from aoprim.atomic_h cimport (
    AOP_RELAXED, AOP_ACQUIRE, AOP_RELEASE, aop_load_i64, aop_fetch_add_i64, aop_fetch_sub_i64,
    aop_atomic_i64, aop_spinlock_t, aop_load_u64p, aop_store_u64p,
)
from aoprim._slab cimport SlabPool, Slot
from aoprim._index cimport as_index as _as_index


cdef class _FrameCache:
    # Large frame buffers kept resident for reuse: the memory of a dead
    # _HeapBuf whose home this is comes back here instead of to free() -- from any thread
    # (the last frame view may die anywhere), hence the spin lock.  Bounded by count and
    # bytes; close() frees what it holds and refuses later returns.
    cdef aop_spinlock_t lock
    cdef char *ptrs[16]
    cdef Py_ssize_t sizes[16]
    cdef int n                   # entries held (under lock)
    cdef Py_ssize_t held         # bytes held (under lock)
    cdef Py_ssize_t cap          # most bytes held
    cdef bint closed             # (under lock)
    cdef aop_atomic_i64 out      # buffers of this home alive now (atomic: any thread)
    cdef aop_atomic_i64 reuses   # buffers handed out from the cache (atomic: read anywhere)
    cdef bint c_put(self, char *p, Py_ssize_t size) noexcept
    cdef char *c_take(self, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t *size) noexcept
    cdef void c_close(self) noexcept


cdef class _HeapBuf:
    # Memory from malloc for when a pool slot will not do.  Frame views hold a strong
    # reference to it, so the memory is freed (in __dealloc__) only after the last view --
    # or, with a home, handed back to that _FrameCache for reuse.
    cdef char *ptr               # owned (malloc); freed by __dealloc__
    cdef Py_ssize_t size         # bytes at ptr
    cdef aop_atomic_i64 views    # live frame views (atomic: a view may die in another thread)
    cdef _FrameCache home        # where the memory goes at dealloc (None: free())


cdef class _RxExporter:
    # One per Receiver.  Set right before PyMemoryView_FromObject(self) and read only inside
    # that call's getbuffer; each exported view then pins `pin` by itself (a view count on
    # it plus a strong reference in Py_buffer.internal), so the exporter holds nothing.
    cdef PyObject *pin           # borrowed for the one getbuffer: the Slot or _HeapBuf
    cdef char *ptr               # first byte of the view (a frame, or a burst's window)
    cdef Py_ssize_t len          # bytes in the view


cdef class RxArena:
    cdef SlabPool pool           # where scratch and receivers' slots come from
    cdef object scratch          # Slot or _HeapBuf, one reference of ours; None once closed
    cdef char *sptr              # first byte of the scratch (NULL once closed)
    cdef Py_ssize_t size         # scratch size == pool.slot_size
    cdef int64_t swaps           # scratch replaced because views of it escaped (accessed as
                                 #   relaxed atomics: written by the owner, read by any
                                 #   thread's stats; _receiver.pyx's _bump/_count)
    cdef int64_t fallbacks       # heap buffers used because the pool was exhausted (idem)
    cdef aop_atomic_i64 tid      # the owning thread's ident while claimed, else 0
    cdef bint closed             # close() ran: the scratch is given back
    cdef bint busy               # a burst is parsing the scratch in place (a nested burst
                                 #   of another receiver must swap before reading)

    # Replace the scratch (the old one goes back when its last view dies).
    cdef SlabPool raw_pool       # raw receivers' read slots, or None
    cdef object big              # the raw_pool slot raw receivers read into (a _HeapBuf of
                                 # bsize when raw_pool was exhausted), one reference of
                                 # ours; None without raw_pool or once closed
    cdef char *bptr              # first byte of big (NULL when none)
    cdef Py_ssize_t bsize        # raw_pool.slot_size (0: raw receivers read into scratch)
    cdef bint bbusy              # as busy, for big
    cdef _FrameCache frames      # large frame buffers for reuse, or None
    cdef object _frame_buf(self, Py_ssize_t need, Py_ssize_t most)
    cdef int _swap(self) except -1
    cdef int _swap_big(self) except -1
    # A buffer of slot size: a pool slot, else a heap buffer (counted in fallbacks).
    cdef object _slot_or_heap(self)


# A heap buffer of n bytes (MemoryError when malloc fails).
cdef _HeapBuf _heap(Py_ssize_t n)


# ---- counters: relaxed atomics written by one owner, read by any thread ---------------------

cdef inline void _bump(int64_t *c, int64_t n) noexcept nogil:
    # relaxed load and store, not an RMW: only the claimed owner writes a counter; other
    # threads read it relaxed (statistics), and an aligned atomic store is never torn.  The
    # fields stay int64_t (cimporters read them as such); the access is atomic.
    cdef uint64_t *u = <uint64_t *>c
    aop_store_u64p(u, aop_load_u64p(u, AOP_RELAXED) + <uint64_t>n, AOP_RELAXED)


cdef inline int64_t _count(int64_t *c) noexcept nogil:
    return <int64_t>aop_load_u64p(<uint64_t *>c, AOP_RELAXED)   # relaxed: statistics


# ---- buffers: a pool Slot or a _HeapBuf, behind four helpers ------------------------------

cdef inline char *_bptr(object b) noexcept:
    if type(b) is Slot:
        return (<Slot>b).ptr
    return (<_HeapBuf>b).ptr


cdef inline int _bpin(object b) except -1:
    """One more view of b (its memory must stay and stay unchanged)."""
    if type(b) is Slot:
        (<Slot>b).c_view_acquired()
    else:
        # relaxed: a count; the memory itself is kept alive by the view's strong reference
        aop_fetch_add_i64(&(<_HeapBuf>b).views, 1, AOP_RELAXED)
    return 0


cdef inline int _bunpin(object b) except -1:
    """One view fewer (a Slot released deferred goes back with its last view)."""
    if type(b) is Slot:
        (<Slot>b).c_view_released()
    else:
        # release: the view's reads happen before a writer that sees the count drop
        aop_fetch_sub_i64(&(<_HeapBuf>b).views, 1, AOP_RELEASE)
    return 0


cdef inline int64_t _bviews(object b) noexcept:
    """Views of b alive now.  acquire: pairs with the release of _bunpin / c_view_released,
    so once we see 0 every reader is done before we write."""
    if type(b) is Slot:
        return aop_load_i64(&(<Slot>b).state, AOP_ACQUIRE) >> 32
    return aop_load_i64(&(<_HeapBuf>b).views, AOP_ACQUIRE)


cdef inline int _bhold(object b) except -1:
    """One more reference of a Slot (a burst holds one while it parses the slot, so that no
    close() inside a handler returns it under the burst).  A heap buffer needs none: the
    burst's local Python reference keeps it."""
    if type(b) is Slot:
        (<Slot>b).c_retain()
    return 0


cdef inline int _bgive(object b) except -1:
    """Drop our one reference to b: a Slot goes back to the pool (deferred while views
    live); a heap buffer is freed with its last Python reference (views hold one)."""
    if type(b) is Slot:
        (<Slot>b).c_release_deferred()
    return 0
