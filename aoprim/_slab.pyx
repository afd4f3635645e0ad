# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""SlabPool and Slot: one preallocated arena cut into fixed-size, reference-counted slots.

The free list is C (aop_slab.h): a bounded MPMC ring of slot indices (Vyukov), one CAS per
acquire and per release, ABA-safe because its 64-bit positions never repeat, and in front of
it a stash word per thread, which keeps a thread that acquires and releases in turn off the
ring's shared lines (argued at the top of the header).  This module adds the Python
objects.

Slot objects and pool indices (the generation question)
- A ``Slot`` object is one *tenure* of an index: from the acquire that hands it out to the
  release that brings its reference count to 0.  Its count and view count live in the object
  (``state``), so a stale Python reference from an earlier tenure can only ever touch its own,
  dead, counters: every operation on it raises (RefCountError / BufferError).
- Objects are recycled to make steady-state acquire/release allocate nothing: a released Slot
  parks in ``pool.cache[index]``.  The next acquire of that index reuses the parked object
  only if the cache holds its *sole* reference (``aop_sole_reference``: ``Py_REFCNT == 1``
  under the GIL; on a free-threaded build, owned by the acquiring thread with local count 1
  and shared count 0, the one exact test there): then no stale reference
  exists anywhere, nobody can observe the reuse, and object identity acts as the generation.
  Otherwise the parked object is retired for good (its stale holders keep a dead Slot) and a
  fresh object is made.  So a stale reference can never reach the next holder's slot.
- An idle (parked) Slot holds no reference to the pool; a held Slot does (the pool and its
  arena outlive every Slot that is out).  The pool holds only idle Slots.  No cycles.
- A held Slot that is garbage-collected gives its index back and warns once (ResourceWarning).

State word of a Slot (one atomic 64-bit word, so that "last release" and "new view" cannot
race): bits 0-30 references, bit 31 DEFER, bits 32-63 exported buffer views.
- getbuffer adds a view only while references > 0;
- release() refuses (BufferError) to drop the last reference while views > 0;
- c_release_deferred() (BlockTable, Receiver) drops it anyway and sets DEFER: the slot goes back to the
  pool when the last view is released.  Either way no view ever outlives its slot's tenure.
Ordering: as Rust's Arc -- reference increments relaxed (a new reference is made from an
existing one), decrements acq_rel (each holder's writes are released; the one reaching 0
acquires them all before the index goes back to the free list, published by a release
store or CAS).  A view is added with acquire (it reads what holders wrote) and dropped acq_rel (its
writes reach whoever gives the slot back; on the DEFER path that is the view's releaser).
"""
cimport cython
from cpython.ref cimport PyObject, Py_INCREF
from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdint cimport int64_t, uint32_t
from libc.stdlib cimport calloc, free
from libc.errno cimport ENOMEM

from aoprim._index cimport as_index as _as_index
from aoprim.atomic_h cimport (
    AOP_RELAXED, AOP_ACQUIRE, AOP_RELEASE, AOP_ACQ_REL,
    aop_load_i64, aop_store_i64, aop_exchange_u32, aop_cas_weak_i64, aop_fetch_sub_i64, aop_fetch_add_i64,
)
from aoprim.errors import PoolExhausted, RefCountError

import warnings as _warnings

cdef extern from "Python.h":
    void Py_DECREF_p "Py_DECREF"(PyObject *o)

cdef extern from *:
    """
    /* 1 when `o` holds exactly one reference and no other thread can hold or take one
     * (the caller holds that reference).
     * GIL build: Py_REFCNT(o) == 1 (the GIL makes the read exact).
     * Free-threaded build: the count is split in two fields (biased reference counting), a
     * local one only the owning thread writes and a shared one other threads change
     * atomically; their sum read field by field can miss a reference that moves from one to
     * the other between the two reads.  So the object must be owned by this thread (its
     * local field is then ours alone: stable while we read it), local == 1 and shared == 0
     * (relaxed: no other thread holds a reference, so no write to order against).  Objects
     * owned by another thread answer 0, which only costs a fresh object (CPython's own
     * uniqueness test, _PyObject_IsUniquelyReferenced in 3.14, is the same). */
    static inline int aop_sole_reference(PyObject *o) {
    #ifdef Py_GIL_DISABLED
        return _Py_IsOwnedByCurrentThread(o)
            && _Py_atomic_load_uint32_relaxed(&o->ob_ref_local) == 1
            && _Py_atomic_load_ssize_relaxed(&o->ob_ref_shared) == 0;
    #else
        return Py_REFCNT(o) == 1;
    #endif
    }
    """
    bint aop_sole_reference(PyObject *o) noexcept nogil

# state-word constants come from aop_slab.h (compile-time)
cdef extern from "aop_slab.h":
    int64_t REF_MASK "AOP_SLOT_REF_MASK"
    int64_t DEFER "AOP_SLOT_DEFER"
    int64_t VIEW_ONE "AOP_SLOT_VIEW_ONE"


# GC: not tracked.  Its only references are the parked (idle) Slots in `cache`, which hold
# nothing, so no cycle can pass through a pool; a held Slot keeps its pool alive by an owned
# pointer, so the arena outlives every Slot that is out, cycles or not.
@cython.final
cdef class SlabPool:
    """SlabPool(slot_size=4096, slots=16): one preallocated, aligned arena of ``slots`` slots.

    ``acquire()`` -> Slot (PoolExhausted when none is free), ``try_acquire()`` -> Slot | None.
    Thread-safe without a lock; the arena never grows.

    Threads: shared -- acquire/try_acquire/the statistics from any threads at once, on a
    free-threaded build too; a slot is never handed out twice (docs/threads.md).
    """

    def __cinit__(self, slot_size=4096, slots=16):
        cdef Py_ssize_t size = _as_index(slot_size, "slot_size")
        cdef Py_ssize_t n = _as_index(slots, "slots")
        cdef int err = 0
        if size < 1:
            raise ValueError(f"slot_size must be >= 1, got {size}")
        if n < 1 or n > AOP_SLAB_MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{AOP_SLAB_MAX_SLOTS}, got {n}")
        self.cache = <PyObject **>calloc(n, sizeof(PyObject *))
        if self.cache == NULL:
            raise MemoryError()
        self.slab = aop_slab_new(size, n, &err)
        if self.slab == NULL:
            if err == ENOMEM:
                raise MemoryError(f"cannot allocate {n} slots of {size} bytes")
            raise ValueError(f"bad pool size: {n} slots of {size} bytes")

    def __dealloc__(self):
        # No Slot is out (each held Slot keeps us alive); C callers keep us alive too.
        cdef Py_ssize_t i
        cdef PyObject *o
        if self.cache != NULL:
            for i in range(self.slab.nslots if self.slab != NULL else 0):
                o = self.cache[i]
                if o != NULL:
                    self.cache[i] = NULL
                    Py_DECREF_p(o)   # parked objects: idle, they reference nothing of ours
            free(self.cache)
            self.cache = NULL
        aop_slab_destroy(self.slab)
        self.slab = NULL

    # ---- C-level API ---------------------------------------------------------------------

    cdef int64_t c_acquire(self) noexcept nogil:
        return aop_slab_acquire(self.slab)

    cdef int c_release(self, int64_t index) noexcept nogil:
        return aop_slab_release(self.slab, index)

    cdef char *c_ptr(self, int64_t index) noexcept nogil:
        return aop_slab_ptr(self.slab, index)

    cdef Slot c_adopt(self, int64_t index):
        if index < 0 or index >= self.slab.nslots:
            raise ValueError(f"slot index {index} out of range")
        # relaxed exchange: of two racing adopts/releases of one index exactly one sees 1;
        # from here on the index belongs to the Slot, and C-level release refuses it
        if aop_exchange_u32(&self.slab.busy[index], 0, AOP_RELAXED) != 1:
            raise ValueError(f"slot index {index} is not held by C code")
        return self._bind(index)

    cdef Slot _bind(self, int64_t index):
        """Make the Slot object for a tenure of ``index`` (which this thread now owns)."""
        cdef PyObject *o = self.cache[index]
        cdef Slot s
        if o != NULL:
            self.cache[index] = NULL
            if aop_sole_reference(o):
                # the cache holds the only reference: nobody can see this object, reuse it
                s = <Slot>o          # +1
                Py_DECREF_p(o)       # -1: the cache's reference is now ours
            else:
                # stale references exist: retire the object (it stays dead: refs == 0)
                Py_DECREF_p(o)
                s = None
        else:
            s = None
        if s is None:
            s = Slot.__new__(Slot)
            s._index = index
            s._size = self.slab.slot_size
            s.ptr = aop_slab_ptr(self.slab, index)
        # relaxed: nobody else can reach s yet; the caller publishes it
        aop_store_i64(&s._length, 0, AOP_RELAXED)
        aop_store_i64(&s.state, 1, AOP_RELAXED)
        Py_INCREF(self)
        s.pool = <PyObject *>self
        return s

    # ---- Python API ----------------------------------------------------------------------

    def acquire(self):
        """Take a free slot (refcount 1).  PoolExhausted when none is free."""
        cdef int64_t i = aop_slab_take(self.slab)
        if i < 0:
            raise PoolExhausted(f"all {self.slab.nslots} slots of the pool are in use")
        return self._bind(i)

    def try_acquire(self):
        """Take a free slot (refcount 1), or return None when none is free."""
        cdef int64_t i = aop_slab_take(self.slab)
        if i < 0:
            return None
        return self._bind(i)

    @property
    def slot_size(self):
        """Bytes per slot."""
        return self.slab.slot_size

    @property
    def slots(self):
        """Number of slots."""
        return self.slab.nslots

    @property
    def available(self):
        """Free slots now (a snapshot)."""
        return aop_slab_free_count(self.slab)

    @property
    def in_use(self):
        """Slots held now (a snapshot)."""
        return self.slab.nslots - aop_slab_free_count(self.slab)

    @property
    def high_water(self):
        """Most slots ever held at once: exact single-threaded and once the pool ran dry;
        with concurrent acquires a lower bound (see aop_slab.h)."""
        return aop_load_i64(&self.slab.high_water, AOP_RELAXED)   # relaxed: statistic

    @property
    def failed_acquires(self):
        """How many acquires (acquire, try_acquire, C-level, BlockTable, RxArena/Receiver)
        found no free slot."""
        return aop_load_i64(&self.slab.failed, AOP_RELAXED)   # relaxed: statistic

    @property
    def alignment(self):
        """Alignment in bytes of the arena and of every slot (64, or a page for slots of at
        least a page)."""
        return self.slab.align

    @property
    def stats(self):
        """dict: slot_size, slots, available, in_use, high_water, failed_acquires."""
        return {"slot_size": self.slot_size, "slots": self.slots,
                "available": self.available, "in_use": self.in_use,
                "high_water": self.high_water, "failed_acquires": self.failed_acquires}

    def __repr__(self):
        return (f"<SlabPool slot_size={self.slab.slot_size} slots={self.slab.nslots} "
                f"in_use={self.in_use} high_water={self.high_water}>")


# GC: not tracked.  Its one reference (the pool, owned while held) leads to nothing that can
# reach a held Slot, so no cycle passes through it; a Slot only garbage reaches dies by
# reference count and __del__ gives its index back.  Views pin it (Py_buffer.obj).
@cython.final
cdef class Slot:
    """One slot of a SlabPool, with its own atomic reference count (1 when acquired).

    Buffer protocol: a writable 1-D 'B' view of ``size`` bytes.  ``release()`` drops one
    reference; the last one returns the slot to the pool (BufferError while a view lives).

    Threads: the count is shared (retain/release from any thread: a slot acquired in one
    thread may be released in another); the bytes have one writer at a time, published to
    readers by whatever hands the slot over (a queue, a lock).
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("Slot objects come from SlabPool.acquire()")

    cdef int c_retain(self) except -1:
        # relaxed: a guess for the CAS
        cdef int64_t w = aop_load_i64(&self.state, AOP_RELAXED)
        while True:
            if (w & REF_MASK) == 0:
                raise RefCountError("retain() of a slot that is back in the pool")
            if (w & REF_MASK) == REF_MASK:
                raise OverflowError("too many references to one slot")
            # relaxed: a new reference is made from one we hold; publishes nothing.  The CAS
            # (not an add) keeps 0 terminal for this tenure
            if aop_cas_weak_i64(&self.state, &w, w + 1, AOP_RELAXED, AOP_RELAXED):
                return 0

    def retain(self):
        """Add a reference (one per extra holder); return this slot."""
        self.c_retain()
        return self

    def release(self):
        """Drop one reference; at 0 the slot goes back to the pool.

        RefCountError if it is already back; BufferError (reference kept) if this is the last
        reference and a memoryview of the slot is alive.
        """
        cdef int64_t w = aop_load_i64(&self.state, AOP_RELAXED)   # relaxed: a guess, see CAS
        while True:
            if (w & REF_MASK) == 0:
                raise RefCountError("release() of a slot that is already back in the pool")
            if (w & REF_MASK) == 1 and (w >> 32) != 0:
                raise BufferError(f"cannot release slot {self._index}: "
                                  f"{w >> 32} memoryview(s) of it still alive")
            # acq_rel: release publishes this holder's writes; acquire (on 1 -> 0) sees
            # every other holder's before the slot goes back
            if aop_cas_weak_i64(&self.state, &w, w - 1, AOP_ACQ_REL, AOP_RELAXED):
                break
        if (w & REF_MASK) == 1:
            self._give_back()

    cdef int c_release_deferred(self) except -1:
        cdef int64_t w = aop_load_i64(&self.state, AOP_RELAXED)   # relaxed: a guess, see CAS
        cdef int64_t nw
        while True:
            if (w & REF_MASK) == 0:
                raise RefCountError("release of a slot that is already back in the pool")
            nw = w - 1
            if (w & REF_MASK) == 1 and (w >> 32) != 0:
                nw = nw | DEFER            # views alive: the last one gives the slot back
            # acq_rel: as in release()
            if aop_cas_weak_i64(&self.state, &w, nw, AOP_ACQ_REL, AOP_RELAXED):
                break
        if nw == 0:
            self._give_back()
        return 0

    cdef int _give_back(self) except -1:
        """The tenure is over (refs 0, no views): park this object and push the index."""
        cdef PyObject *p = self.pool         # our reference: keeps the pool alive until done
        cdef SlabPool pool = <SlabPool>p
        cdef int64_t i = self._index
        self.pool = NULL                     # idle objects hold no pool reference
        # we own index i: the cache entry is ours to write (it is NULL: we are i's object);
        # the push below (release store of the cell) publishes it to the next acquirer of i
        Py_INCREF(self)
        pool.cache[i] = <PyObject *>self
        aop_slab_push(pool.slab, i)
        Py_DECREF_p(p)                       # may free the pool (it then drops the cache)
        return 0

    def __del__(self):
        # Garbage-collected while still held: give the index back, and say so once.
        # (No view can be alive: a memoryview keeps its Slot alive.)
        cdef int64_t w = aop_load_i64(&self.state, AOP_ACQUIRE)   # acquire: see holders' writes
        cdef SlabPool pool
        if (w & REF_MASK) == 0 or self.pool == NULL:
            return
        aop_store_i64(&self.state, 0, AOP_RELAXED)   # relaxed: the object is unreachable
        pool = <SlabPool>self.pool
        Py_DECREF_p(self.pool)                       # `pool` holds it now
        self.pool = NULL
        aop_slab_push(pool.slab, self._index)        # not parked: this object is dying
        if _warnings is None:                        # interpreter shutdown
            return
        _warnings.warn(f"Slot {self._index} of {pool!r} was garbage-collected while still "
                       f"holding {w & REF_MASK} reference(s); returned to the pool",
                       ResourceWarning, stacklevel=1)

    def __dealloc__(self):
        if self.pool != NULL:          # only if __del__ could not run (interpreter exit)
            Py_DECREF_p(self.pool)
            self.pool = NULL

    cdef int c_view_acquired(self) except -1:
        cdef int64_t w = aop_load_i64(&self.state, AOP_RELAXED)   # relaxed: a guess, see CAS
        while True:
            if (w & REF_MASK) == 0:
                raise BufferError(f"slot {self._index} is back in the pool")
            # acquire: the view reads bytes that holders wrote before their release
            if aop_cas_weak_i64(&self.state, &w, w + VIEW_ONE, AOP_ACQUIRE, AOP_RELAXED):
                return 0

    cdef int c_view_released(self) except -1:
        # acq_rel: the view's writes are released to whoever returns the slot; on the
        # DEFER path we are that one and acquire every holder's writes
        cdef int64_t w = aop_fetch_sub_i64(&self.state, VIEW_ONE, AOP_ACQ_REL) - VIEW_ONE
        if w == DEFER:
            # refs 0, views 0, deferred: nobody can add a view or a reference any more
            aop_store_i64(&self.state, 0, AOP_RELAXED)   # relaxed: we are the only actor
            self._give_back()
        return 0

    def __getbuffer__(self, Py_buffer *view, int flags):
        self.c_view_acquired()
        PyBuffer_FillInfo(view, self, self.ptr, self._size, 0, flags)

    def __releasebuffer__(self, Py_buffer *view):
        self.c_view_released()

    @property
    def index(self):
        """Position of this slot in its pool."""
        return self._index

    @property
    def size(self):
        """Bytes in the slot (== pool.slot_size)."""
        return self._size

    @property
    def length(self):
        """Valid bytes, 0..size (``data`` shows them)."""
        return aop_load_i64(&self._length, AOP_RELAXED)   # relaxed: a plain value

    @length.setter
    def length(self, value):
        cdef Py_ssize_t n
        try:
            n = _as_index(value, "length")
        except OverflowError:
            raise ValueError(f"length must be in 0..{self._size}, got {value}") from None
        if n < 0 or n > self._size:
            raise ValueError(f"length must be in 0..{self._size}, got {n}")
        if (aop_load_i64(&self.state, AOP_RELAXED) & REF_MASK) == 0:   # relaxed: a check
            raise RefCountError("the slot is back in the pool")
        aop_store_i64(&self._length, n, AOP_RELAXED)   # relaxed: a plain value

    @property
    def data(self):
        """memoryview of the first ``length`` bytes (counts as a view of the slot)."""
        # relaxed: length is a plain value, published to other threads (if at all) by
        # whatever hands them the slot; it guards no other memory
        return memoryview(self)[:aop_load_i64(&self._length, AOP_RELAXED)]

    @property
    def refs(self):
        """Current reference count (0 once back in the pool); a snapshot."""
        return aop_load_i64(&self.state, AOP_RELAXED) & REF_MASK   # relaxed: snapshot

    @property
    def views(self):
        """Exported buffer views alive now; a snapshot."""
        return aop_load_i64(&self.state, AOP_RELAXED) >> 32   # relaxed: snapshot

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, tb):
        self.release()

    def __repr__(self):
        w = aop_load_i64(&self.state, AOP_RELAXED)   # relaxed: snapshot
        return (f"<Slot index={self._index} size={self._size} length={self.length} "
                f"refs={w & REF_MASK} views={w >> 32}>")

    def __reduce__(self):
        raise TypeError("Slot objects cannot be pickled")
