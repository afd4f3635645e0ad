# cython: language_level=3
"""SlabPool and Slot, for ``cimport`` -- and the nogil C-level API of the pool.

    from aoprim._slab cimport SlabPool, aop_slab_acquire, aop_slab_release, aop_slab_ptr
    cdef SlabPool pool = SlabPool(4096, 64)
    cdef int64_t i
    with nogil:
        i = aop_slab_acquire(pool.slab)          # -1: exhausted
        if i >= 0:
            n = recv(fd, aop_slab_ptr(pool.slab, i), pool.slab.slot_size, 0)
            ...
            aop_slab_release(pool.slab, i)       # 0, or -1 if i was not held

How C-level indices coexist with Python Slot objects
- Both draw from the same free indices (a lock-free ring, and a stash word per thread in
  front of it: aop_slab.h); an index is held by exactly one owner at a
  time: a Python ``Slot`` (returned by ``acquire()`` or ``c_adopt()``) or C code.
- C code that acquired an index owns it outright (no reference count) and must release it
  exactly once; a second release returns -1 and changes nothing, and so does releasing an
  index a Slot holds (busy[i] marks C-held indices only).  What the C layer cannot detect is
  one piece of C code releasing an index that another piece of C code holds: don't.
- ``pool.c_adopt(i)`` (GIL held) turns an index that C code acquired into a Python ``Slot``
  that owns it (refcount 1); from then on only the Slot releases it.
- C code holding indices must keep a reference to the SlabPool (the arena dies with it).
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t
from cpython.ref cimport PyObject
from aoprim.atomic_h cimport aop_atomic_i64, aop_atomic_u32

cdef extern from "aop_slab.h" nogil:
    int64_t AOP_SLAB_MAX_SLOTS
    int64_t AOP_SLOT_REF_MASK     # Slot.state bits 0-30: references
    int64_t AOP_SLOT_DEFER        # Slot.state bit 31: give back when the last view goes
    int64_t AOP_SLOT_VIEW_ONE     # Slot.state bits 32-63: views (this is one view)
    ctypedef struct aop_slab_cell_t:
        uint64_t seq            # lap stamp: == pos empty-for-enqueue, == pos+1 full-for-dequeue
        uint64_t value          # the slot index held while full
    ctypedef struct aop_slab_t:
        aop_atomic_i64 deq      # next ring position to dequeue (own 128-byte block)
        aop_atomic_i64 enq      # next ring position to enqueue (own 128-byte block)
        aop_atomic_i64 high_water  # most slots ever held at once (statistics)
        aop_atomic_i64 failed   # acquires that found no free slot (statistics)
        char *arena             # slot i starts at arena + i * stride
        int64_t slot_size       # usable bytes per slot
        int64_t stride          # distance between slots (slot_size rounded up to align)
        int64_t nslots          # number of slots
        int64_t align           # alignment of the arena and every slot (64, or a page)
        uint64_t mask           # ring capacity - 1
        aop_slab_cell_t *cells  # the ring of free indices
        # (and stash: the per-thread words, reached only through the functions below)
        aop_atomic_u32 *busy    # busy[i] == 1 while C code holds index i
    # C API: take a free slot index, marked held by C code (-1: none free, counted).
    int64_t aop_slab_acquire(aop_slab_t *s) noexcept
    # C API: give an index back: 0, or -1 if out of range or not held by C (nothing changed).
    int aop_slab_release(aop_slab_t *s, int64_t i) noexcept
    # First byte of slot i (no check).
    char *aop_slab_ptr(aop_slab_t *s, int64_t i) noexcept
    # Free slots now (a snapshot).
    int64_t aop_slab_free_count(aop_slab_t *s) noexcept
    # Internal (the Python Slot path, which does not use busy[]): take / give back an index.
    int64_t aop_slab_take(aop_slab_t *s) noexcept
    void aop_slab_push(aop_slab_t *s, uint64_t i) noexcept
    aop_slab_t *aop_slab_new(int64_t slot_size, int64_t nslots, int *err) noexcept
    void aop_slab_destroy(aop_slab_t *s) noexcept


cdef class SlabPool:
    cdef aop_slab_t *slab       # the C pool: arena, free ring, statistics (owned)
    cdef PyObject **cache       # cache[i]: the idle Slot object of index i, or NULL (owned
                                # ref).  Touched only by the current owner of index i.
    cdef object __weakref__

    # nogil C-level API (same free indices as acquire()/Slot.release()).
    cdef int64_t c_acquire(self) noexcept nogil        # index, or -1 when exhausted
    cdef int c_release(self, int64_t index) noexcept nogil   # 0, or -1 if not held
    cdef char *c_ptr(self, int64_t index) noexcept nogil     # first byte of a slot
    # GIL held: turn an index this caller holds (from c_acquire) into a Slot that owns it
    # (ValueError if C code does not hold it).
    cdef Slot c_adopt(self, int64_t index)
    cdef Slot _bind(self, int64_t index)


cdef class Slot:
    cdef aop_atomic_i64 state   # bits 0-30: references; bit 31: DEFER (return to the pool
                                # when the last view goes); bits 32-63: exported views
    cdef aop_atomic_i64 _length # valid bytes, 0..size (relaxed: a plain value)
    cdef PyObject *pool         # owned ref to the SlabPool while held (keeps the arena
                                # alive); NULL while idle (parked objects hold nothing)
    cdef char *ptr              # first byte of this slot in the arena
    cdef Py_ssize_t _size       # == pool.slot_size
    cdef Py_ssize_t _index      # position in the pool; never changes for this object

    cdef int c_retain(self) except -1                # +1 reference; RefCountError at 0
    # -1 reference.  At 0 the slot goes back to the pool; if views are still alive it goes
    # back when the last view is released (used by BlockTable, whose views pin their block).
    cdef int c_release_deferred(self) except -1
    cdef int _give_back(self) except -1
    # Count one more exported view of this slot (BufferError if it is back in the pool) /
    # one fewer (gives the slot back if it was deferred and this was the last view).  For
    # exporters that hand out sub-ranges of the slot (BlockTable.view).
    cdef int c_view_acquired(self) except -1
    cdef int c_view_released(self) except -1
