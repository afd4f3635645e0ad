# cython: language_level=3
"""SPSCQueue, for ``cimport``: a bounded lock-free single-producer single-consumer ring.

One producer thread and one consumer thread (in C or Python, not both at once on one side).

C-level use (no GIL, no Python objects)::

    from libc.stdint cimport uint64_t
    from aoprim._spsc cimport SPSCQueue, aop_spsc_try_push_u64, aop_spsc_try_pop_u64
    from aoprim._qwait cimport AOP_Q_OK

    cdef SPSCQueue q = SPSCQueue(1024)
    cdef uint64_t v
    with nogil:
        if aop_spsc_try_push_u64(q.q, 42) == AOP_Q_OK: ...
        if aop_spsc_try_pop_u64(q.q, &v) == AOP_Q_OK: ...

Objects or raw words, never both: a queue's first operation fixes its mode for good.  The
``*_u64`` functions move plain 64-bit words (integers, or pointers the C code owns) and
claim RAW mode; the Python methods move strong references to Python objects and claim OBJ
mode.  An operation of the other mode fails (AOP_Q_BADMODE from C, TypeError from Python)
and changes nothing, so a raw word is never mistaken for an object.  Keep a reference to
the SPSCQueue object for as long as C code uses ``q.q``.  close() applies to both modes.

Return codes (aoprim._qwait): AOP_Q_OK, AOP_Q_RETRY (full / empty / timed out),
AOP_Q_CLOSED, AOP_Q_BADMODE.  Blocking forms take timeout_ns (< 0 forever, 0 one try) and
park on a futex; call them inside ``with nogil``.
"""
from libc.stdint cimport int64_t, uint64_t
from aoprim.atomic_h cimport aop_atomic_u32
from aoprim._qwait cimport aop_qwait_t

cdef extern from "aop_queue.h" nogil:
    ctypedef struct aop_spsc_t:
        uint64_t cap             # real capacity (a power of two); read-only
        aop_atomic_u32 mode      # AOP_Q_MODE_NONE until the first operation fixes it
        # (the rest -- ring, padded tail/head with cached copies, wait sets -- is private)

    # public C API: raw 64-bit words, RAW mode
    int aop_spsc_try_push_u64(aop_spsc_t *q, uint64_t v) noexcept
    int aop_spsc_try_pop_u64(aop_spsc_t *q, uint64_t *out) noexcept
    int aop_spsc_push_u64(aop_spsc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_spsc_pop_u64(aop_spsc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_spsc_push_many_u64(aop_spsc_t *q, const uint64_t *v, uint64_t n,
                               uint64_t *pushed) noexcept
    int aop_spsc_pop_many_u64(aop_spsc_t *q, uint64_t *out, uint64_t n,
                              uint64_t *popped) noexcept
    uint64_t aop_spsc_size(aop_spsc_t *q) noexcept          # approximate item count
    bint aop_spsc_closed(aop_spsc_t *q) noexcept
    void aop_spsc_close(aop_spsc_t *q) noexcept             # wakes every waiter

    # mode-less internals used by the Python methods (OBJ mode); not for C callers
    aop_spsc_t *aop_spsc_new(uint64_t capacity) noexcept
    void aop_spsc_free(aop_spsc_t *q) noexcept
    int aop_spsc_push_(aop_spsc_t *q, uint64_t v) noexcept
    int aop_spsc_pop_(aop_spsc_t *q, uint64_t *out) noexcept
    int aop_spsc_push_wait_(aop_spsc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_spsc_pop_wait_(aop_spsc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_spsc_push_wait_p(void *q, uint64_t *v, int64_t timeout_ns) noexcept
    int aop_spsc_pop_wait_p(void *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_spsc_push_many_(aop_spsc_t *q, const uint64_t *v, uint64_t n,
                            uint64_t *pushed) noexcept
    int aop_spsc_pop_many_(aop_spsc_t *q, uint64_t *out, uint64_t n,
                           uint64_t *popped) noexcept


cdef class SPSCQueue:
    cdef aop_spsc_t *q           # the C queue (128-byte aligned, owned; freed at dealloc)
    cdef object __weakref__      # weak references work
