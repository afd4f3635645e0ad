# cython: language_level=3
"""AtomicInt and RefCount, for ``cimport``.

    from aoprim._atomic cimport AtomicInt
    from aoprim.atomic_h cimport aop_fetch_add_i64, AOP_SEQ_CST

    cdef AtomicInt a = AtomicInt()
    with nogil:
        aop_fetch_add_i64(&a.cell, 1, AOP_SEQ_CST)

AtomicInt's Python methods use sequentially consistent order throughout (docs/atomics-and-lock.md); RefCount's
use Rust Arc's orders (relaxed increments, acq_rel decrements: see _atomic.pyx); C callers
of the aop_* calls choose.
"""
from libc.stdint cimport int64_t
from aoprim.atomic_h cimport aop_atomic_i64

cdef class AtomicInt:
    cdef aop_atomic_i64 cell     # the 64-bit value; read/write it only with the aop_*_i64 calls

cdef class RefCount:
    cdef aop_atomic_i64 cell     # the count, >= 0; 0 is terminal: no transition leaves it
    cdef object on_zero          # called exactly once, by the thread whose decref reached 0

    # C-level API, callable without the GIL.  Each returns the new count, or -1 when the
    # count was already 0 (the illegal transition; nothing was changed).  c_incref returns
    # -2 when the count is at INT64_MAX (nothing was changed: it never wraps).
    # c_try_incref returns False at 0 and at INT64_MAX (nothing changed).
    cdef int64_t c_incref(self) noexcept nogil
    cdef int64_t c_decref(self) noexcept nogil
    cdef bint c_try_incref(self) noexcept nogil
    # Whoever's c_decref returned 0 must call this once, with the GIL, to run on_zero.
    cdef int run_on_zero(self) except -1
