# cython: language_level=3
"""Cython declarations of aoprim/include/aop_atomic.h -- the C-level API.

Every function here is ``noexcept nogil``: Cython code can call it with the GIL released.
Compile against ``aoprim.get_include()`` so that the header is found.  Memory orders are
passed explicitly (AOP_RELAXED ... AOP_SEQ_CST) at every call, exactly as in the C header.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t

cdef extern from "aop_atomic.h" nogil:
    int AOP_RELAXED
    int AOP_CONSUME
    int AOP_ACQUIRE
    int AOP_RELEASE
    int AOP_ACQ_REL
    int AOP_SEQ_CST
    int AOP_CACHE_LINE

    ctypedef struct aop_atomic_i64:
        int64_t v            # the value; touch it only through the aop_* functions
    ctypedef struct aop_atomic_u32:
        uint32_t v           # a futex-sized word; touch it only through the aop_* functions

    int64_t aop_load_i64(const aop_atomic_i64 *a, int order) noexcept
    void aop_store_i64(aop_atomic_i64 *a, int64_t v, int order) noexcept
    int64_t aop_exchange_i64(aop_atomic_i64 *a, int64_t v, int order) noexcept
    int64_t aop_fetch_add_i64(aop_atomic_i64 *a, int64_t d, int order) noexcept
    int64_t aop_fetch_sub_i64(aop_atomic_i64 *a, int64_t d, int order) noexcept
    int64_t aop_fetch_and_i64(aop_atomic_i64 *a, int64_t m, int order) noexcept
    int64_t aop_fetch_or_i64(aop_atomic_i64 *a, int64_t m, int order) noexcept
    int64_t aop_fetch_xor_i64(aop_atomic_i64 *a, int64_t m, int order) noexcept
    bint aop_cas_i64(aop_atomic_i64 *a, int64_t *expected, int64_t desired,
                     int success_order, int failure_order) noexcept
    bint aop_cas_weak_i64(aop_atomic_i64 *a, int64_t *expected, int64_t desired,
                          int success_order, int failure_order) noexcept

    uint32_t aop_load_u32(const aop_atomic_u32 *a, int order) noexcept
    void aop_store_u32(aop_atomic_u32 *a, uint32_t v, int order) noexcept
    uint32_t aop_exchange_u32(aop_atomic_u32 *a, uint32_t v, int order) noexcept
    uint32_t aop_fetch_add_u32(aop_atomic_u32 *a, uint32_t d, int order) noexcept
    uint32_t aop_fetch_sub_u32(aop_atomic_u32 *a, uint32_t d, int order) noexcept
    uint32_t aop_fetch_or_u32(aop_atomic_u32 *a, uint32_t bits, int order) noexcept
    bint aop_cas_u32(aop_atomic_u32 *a, uint32_t *expected, uint32_t desired,
                     int success_order, int failure_order) noexcept

    uint64_t aop_load_u64p(const uint64_t *p, int order) noexcept
    void aop_store_u64p(uint64_t *p, uint64_t v, int order) noexcept
    uint64_t aop_fetch_add_u64p(uint64_t *p, uint64_t d, int order) noexcept
    bint aop_cas_u64p(uint64_t *p, uint64_t *expected, uint64_t desired,
                      int success_order, int failure_order) noexcept
    bint aop_cas_weak_u64p(uint64_t *p, uint64_t *expected, uint64_t desired,
                           int success_order, int failure_order) noexcept
    void *aop_load_ptr(void * const *p, int order) noexcept
    void aop_store_ptr(void **p, void *v, int order) noexcept
    void *aop_exchange_ptr(void **p, void *v, int order) noexcept
    void aop_thread_fence(int order) noexcept

    void aop_cpu_relax() noexcept
    void aop_yield() noexcept
    int64_t aop_now_ns() noexcept
    int64_t aop_deadline_ns(int64_t timeout_ns) noexcept   # now + timeout_ns, saturated
    void aop_sleep_ns(int64_t ns) noexcept
    int aop_park(aop_atomic_u32 *word, uint32_t expected, int64_t timeout_ns) noexcept
    void aop_unpark(aop_atomic_u32 *word, int n) noexcept

    ctypedef struct aop_spinlock_t:
        aop_atomic_u32 state  # 0 unlocked, 1 locked, 2 locked with possible parked waiters
    void aop_spin_init(aop_spinlock_t *l) noexcept
    bint aop_spin_trylock(aop_spinlock_t *l) noexcept
    bint aop_spin_locked(aop_spinlock_t *l) noexcept
    bint aop_spin_lock_timed(aop_spinlock_t *l, int64_t timeout_ns) noexcept
    int AOP_SPIN_INTR        # aop_spin_lock_intr's "a signal interrupted the park" (-1)
    # 1 acquired, 0 timed out, AOP_SPIN_INTR: a signal arrived (run handlers, then retry)
    int aop_spin_lock_intr(aop_spinlock_t *l, int64_t timeout_ns) noexcept
    void aop_spin_lock(aop_spinlock_t *l) noexcept
    void aop_spin_unlock(aop_spinlock_t *l) noexcept
    bint aop_spin_unlock_checked(aop_spinlock_t *l) noexcept
