# cython: language_level=3
"""MPMCQueue, for ``cimport``: a bounded lock-free multi-producer multi-consumer queue.

C-level use (no GIL, no Python objects)::

    from libc.stdint cimport uint64_t
    from aoprim._mpmc cimport MPMCQueue, aop_mpmc_try_push_u64, aop_mpmc_try_pop_u64
    from aoprim._qwait cimport AOP_Q_OK

    cdef MPMCQueue q = MPMCQueue(1024)
    cdef uint64_t v
    with nogil:
        if aop_mpmc_try_push_u64(q.q, 42) == AOP_Q_OK: ...
        if aop_mpmc_try_pop_u64(q.q, &v) == AOP_Q_OK: ...

Objects or raw words, never both: a queue's first operation fixes its mode for good.  The
``*_u64`` functions move plain 64-bit words (integers, or pointers the C code owns) and
claim RAW mode; the Python methods move strong references to Python objects and claim OBJ
mode.  An operation of the other mode fails (AOP_Q_BADMODE from C, TypeError from Python)
and changes nothing, so a raw word is never mistaken for an object.  Keep a reference to
the MPMCQueue object for as long as C code uses ``q.q``.  close() applies to both modes.

Return codes (aoprim._qwait): AOP_Q_OK, AOP_Q_RETRY (full / empty / timed out),
AOP_Q_CLOSED, AOP_Q_BADMODE.  Blocking forms take timeout_ns (< 0 forever, 0 one try) and
park on a futex; call them inside ``with nogil``.
"""
from libc.stdint cimport int64_t, uint64_t
from aoprim.atomic_h cimport aop_atomic_u32
from aoprim._qwait cimport aop_qwait_t

cdef extern from "aop_queue.h" nogil:
    ctypedef struct aop_mpmc_t:
        uint64_t cap             # real capacity (a power of two); read-only
        aop_atomic_u32 mode      # AOP_Q_MODE_NONE until the first operation fixes it
        # (the rest -- cells, padded tail/head, wait sets -- is private to aop_queue.h)

    # public C API: raw 64-bit words, RAW mode
    int aop_mpmc_try_push_u64(aop_mpmc_t *q, uint64_t v) noexcept
    int aop_mpmc_try_pop_u64(aop_mpmc_t *q, uint64_t *out) noexcept
    int aop_mpmc_push_u64(aop_mpmc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_mpmc_pop_u64(aop_mpmc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_mpmc_push_many_u64(aop_mpmc_t *q, const uint64_t *v, uint64_t n,
                               uint64_t *pushed) noexcept
    int aop_mpmc_pop_many_u64(aop_mpmc_t *q, uint64_t *out, uint64_t n,
                              uint64_t *popped) noexcept
    uint64_t aop_mpmc_size(aop_mpmc_t *q) noexcept          # approximate item count
    bint aop_mpmc_closed(aop_mpmc_t *q) noexcept
    void aop_mpmc_close(aop_mpmc_t *q) noexcept             # wakes every waiter

    # mode-less internals used by the Python methods (OBJ mode); not for C callers
    aop_mpmc_t *aop_mpmc_new(uint64_t capacity) noexcept
    void aop_mpmc_free(aop_mpmc_t *q) noexcept
    int aop_mpmc_push_(aop_mpmc_t *q, uint64_t v) noexcept
    int aop_mpmc_pop_(aop_mpmc_t *q, uint64_t *out) noexcept
    int aop_mpmc_push_wait_(aop_mpmc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_mpmc_pop_wait_(aop_mpmc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_mpmc_push_wait_p(void *q, uint64_t *v, int64_t timeout_ns) noexcept
    int aop_mpmc_pop_wait_p(void *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_mpmc_push_many_(aop_mpmc_t *q, const uint64_t *v, uint64_t n,
                            uint64_t *pushed) noexcept
    int aop_mpmc_pop_many_(aop_mpmc_t *q, uint64_t *out, uint64_t n,
                           uint64_t *popped) noexcept


cdef class MPMCQueue:
    cdef aop_mpmc_t *q           # the C queue (128-byte aligned, owned; freed at dealloc)
    cdef object __weakref__      # weak references work
