# cython: language_level=3
"""The C-level (nogil) loops that ``python -m aoprim bench`` and ``bench/bench_*.py`` time.

Each ``*_loop(obj, n)`` runs ``n`` operations through a primitive's C API (its ``.pxd``) with
the GIL released and returns nothing; the caller times the call (``n`` is large, so the one
Python call around the loop is noise).  The ``floor_*`` / ``bare_loop`` functions are the
same loops with no aoprim code in them -- the hardware floor, timed beside aoprim's loops in
the same run.  Shipped compiled with the package (setup.py picks up every aoprim/*.pyx), so an
installed aoprim can measure itself without a compiler.

``compiler_info()`` says what the compiler saw when it built this module (the package's other
extensions are built with the same flags by setup.py).
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t

from aoprim._atomic cimport AtomicInt, RefCount
from aoprim._spinlock cimport SpinLock
from aoprim._mpmc cimport MPMCQueue, aop_mpmc_try_push_u64, aop_mpmc_try_pop_u64
from aoprim._spsc cimport SPSCQueue, aop_spsc_try_push_u64, aop_spsc_try_pop_u64
from aoprim._slab cimport SlabPool, aop_slab_acquire, aop_slab_release
from aoprim._sendbatch cimport SendBatch
from aoprim.atomic_h cimport aop_fetch_add_i64, aop_spin_lock, aop_spin_unlock, AOP_SEQ_CST

cdef extern from *:
    """
    #include <pthread.h>
    #include <stdlib.h>
    static int64_t aop_bc_word;
    static uint32_t aop_bc_lockword;
    static volatile uint64_t aop_bc_sink;
    /* one locked instruction per iteration */
    static void aop_bc_floor_fetch_add(int64_t n) {
        for (int64_t i = 0; i < n; i++)
            __atomic_fetch_add(&aop_bc_word, 1, __ATOMIC_SEQ_CST);
    }
    /* a CAS + exchange pair: the two locked instructions any lock/unlock needs */
    static void aop_bc_floor_cas_xchg(int64_t n) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t e = 0;
            __atomic_compare_exchange_n(&aop_bc_lockword, &e, 1, 0,
                                        __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
            __atomic_exchange_n(&aop_bc_lockword, 0, __ATOMIC_RELEASE);
        }
    }
    /* a loop that stores and loads a volatile word: the cost of the loop itself */
    static void aop_bc_bare_loop(int64_t n) {
        uint64_t acc = 0;
        for (int64_t i = 0; i < n; i++) {
            aop_bc_sink = (uint64_t)i;
            acc += aop_bc_sink;
        }
        aop_bc_sink = acc;
    }
    /* the baselines: what C code without aoprim writes for the same job */
    static pthread_mutex_t aop_bc_mutex = PTHREAD_MUTEX_INITIALIZER;
    static volatile int64_t aop_bc_guarded;
    /* an int64 counter behind a mutex: lock, +1, unlock */
    static void aop_bc_mutex_add(int64_t n) {
        for (int64_t i = 0; i < n; i++) {
            pthread_mutex_lock(&aop_bc_mutex);
            aop_bc_guarded = aop_bc_guarded + 1;
            pthread_mutex_unlock(&aop_bc_mutex);
        }
    }
    /* a reference count behind a mutex: +1 and -1, each under the lock */
    static void aop_bc_mutex_incdec(int64_t n) {
        for (int64_t i = 0; i < n; i++) {
            pthread_mutex_lock(&aop_bc_mutex);
            aop_bc_guarded = aop_bc_guarded + 1;
            pthread_mutex_unlock(&aop_bc_mutex);
            pthread_mutex_lock(&aop_bc_mutex);
            aop_bc_guarded = aop_bc_guarded - 1;
            pthread_mutex_unlock(&aop_bc_mutex);
        }
    }
    /* an uncontended lock + unlock pair */
    static void aop_bc_mutex_lock(int64_t n) {
        for (int64_t i = 0; i < n; i++) {
            pthread_mutex_lock(&aop_bc_mutex);
            pthread_mutex_unlock(&aop_bc_mutex);
        }
    }
    /* a bounded ring of words behind a mutex (each push and pop takes the lock, as a
       thread-safe queue must): n push + pop pairs on an empty ring; returns the sum popped */
    #define AOP_BC_RING 1024
    static uint64_t aop_bc_ring[AOP_BC_RING];
    static uint64_t aop_bc_ring_head, aop_bc_ring_tail;
    static uint64_t aop_bc_mutex_ring(int64_t n) {
        uint64_t acc = 0;
        for (int64_t i = 0; i < n; i++) {
            pthread_mutex_lock(&aop_bc_mutex);
            if (aop_bc_ring_tail - aop_bc_ring_head < AOP_BC_RING) {
                aop_bc_ring[aop_bc_ring_tail % AOP_BC_RING] = (uint64_t)i;
                aop_bc_ring_tail++;
            }
            pthread_mutex_unlock(&aop_bc_mutex);
            pthread_mutex_lock(&aop_bc_mutex);
            if (aop_bc_ring_tail != aop_bc_ring_head) {
                acc += aop_bc_ring[aop_bc_ring_head % AOP_BC_RING];
                aop_bc_ring_head++;
            }
            pthread_mutex_unlock(&aop_bc_mutex);
        }
        return acc;
    }
    /* malloc(size) + free, the block touched once; the pointer passes through a volatile
       so the compiler cannot drop the pair.  Returns -1 if malloc fails. */
    static void *volatile aop_bc_block;
    static int aop_bc_malloc_free(int64_t n, size_t size) {
        for (int64_t i = 0; i < n; i++) {
            char *p = (char *)malloc(size);
            if (p == NULL)
                return -1;
            p[0] = (char)i;
            aop_bc_block = p;
            free(aop_bc_block);
        }
        return 0;
    }
    #ifdef __VERSION__
    #define AOP_BC_COMPILER __VERSION__
    #else
    #define AOP_BC_COMPILER "unknown"
    #endif
    #ifdef __OPTIMIZE__
    #define AOP_BC_OPTIMIZE 1
    #else
    #define AOP_BC_OPTIMIZE 0
    #endif
    #if defined(__SANITIZE_ADDRESS__)
    #define AOP_BC_ASAN 1
    #else
    #define AOP_BC_ASAN 0
    #endif
    """
    void aop_bc_floor_fetch_add(int64_t n) nogil
    void aop_bc_floor_cas_xchg(int64_t n) nogil
    void aop_bc_bare_loop(int64_t n) nogil
    void aop_bc_mutex_add(int64_t n) nogil
    void aop_bc_mutex_incdec(int64_t n) nogil
    void aop_bc_mutex_lock(int64_t n) nogil
    uint64_t aop_bc_mutex_ring(int64_t n) nogil
    int aop_bc_malloc_free(int64_t n, size_t size) nogil
    ssize_t write(int fd, const void *buf, size_t n) nogil
    const char *AOP_BC_COMPILER
    int AOP_BC_OPTIMIZE
    int AOP_BC_ASAN


def compiler_info():
    """{'compiler': the compiler's version string, 'optimized': built with -O1 or more,
    'asan': built with AddressSanitizer}."""
    return {"compiler": AOP_BC_COMPILER.decode("utf-8", "replace"),
            "optimized": bool(AOP_BC_OPTIMIZE), "asan": bool(AOP_BC_ASAN)}


# -- floors --------------------------------------------------------------------------------

def floor_fetch_add(int64_t n):
    """n bare __atomic_fetch_add (seq_cst) on a static word."""
    with nogil:
        aop_bc_floor_fetch_add(n)


def floor_cas_xchg(int64_t n):
    """n bare CAS(0 -> 1, acquire) + exchange(0, release) pairs."""
    with nogil:
        aop_bc_floor_cas_xchg(n)


def bare_loop(int64_t n):
    """n turns of a loop that stores and loads a volatile word."""
    with nogil:
        aop_bc_bare_loop(n)


# -- baselines: the same job without aoprim ------------------------------------------------

def mutex_add_loop(int64_t n):
    """n pthread_mutex_lock; +1; pthread_mutex_unlock on a static int64."""
    with nogil:
        aop_bc_mutex_add(n)


def mutex_incdec_loop(int64_t n):
    """n (+1, then -1) on a static int64, each under pthread_mutex_lock / unlock."""
    with nogil:
        aop_bc_mutex_incdec(n)


def mutex_lock_loop(int64_t n):
    """n uncontended pthread_mutex_lock + pthread_mutex_unlock pairs."""
    with nogil:
        aop_bc_mutex_lock(n)


def mutex_ring_loop(int64_t n):
    """n push + pop pairs of a u64 on a 1024-word ring behind a pthread mutex (each push and
    each pop takes the lock); returns the sum of the words popped."""
    cdef uint64_t acc
    with nogil:
        acc = aop_bc_mutex_ring(n)
    return acc


def malloc_loop(int64_t n, size_t size):
    """n malloc(size) + free pairs, each block touched once."""
    cdef int r
    with nogil:
        r = aop_bc_malloc_free(n, size)
    if r < 0:
        raise MemoryError(f"malloc({size}) failed")


# -- primitives ----------------------------------------------------------------------------

def atomic_add_loop(AtomicInt a, int64_t n):
    """n aop_fetch_add_i64(&a.cell, 1, seq_cst)."""
    cdef int64_t i
    with nogil:
        for i in range(n):
            aop_fetch_add_i64(&a.cell, 1, AOP_SEQ_CST)


def refcount_loop(RefCount r, int64_t n):
    """n c_incref + c_decref pairs (the count never reaches 0: r starts at >= 1)."""
    cdef int64_t i
    with nogil:
        for i in range(n):
            r.c_incref()
            r.c_decref()


def spin_loop(SpinLock lk, int64_t n):
    """n uncontended aop_spin_lock + aop_spin_unlock pairs."""
    cdef int64_t i
    with nogil:
        for i in range(n):
            aop_spin_lock(&lk.lock)
            aop_spin_unlock(&lk.lock)


def mpmc_loop(MPMCQueue q, int64_t n):
    """n try_push + try_pop pairs of a u64 (raw-word mode) on an empty queue."""
    cdef int64_t i
    cdef uint64_t v = 0, acc = 0
    with nogil:
        for i in range(n):
            aop_mpmc_try_push_u64(q.q, <uint64_t>i)
            aop_mpmc_try_pop_u64(q.q, &v)
            acc += v
    return acc


def spsc_loop(SPSCQueue q, int64_t n):
    """n try_push + try_pop pairs of a u64 (raw-word mode) on an empty queue."""
    cdef int64_t i
    cdef uint64_t v = 0, acc = 0
    with nogil:
        for i in range(n):
            aop_spsc_try_push_u64(q.q, <uint64_t>i)
            aop_spsc_try_pop_u64(q.q, &v)
            acc += v
    return acc


def slab_loop(SlabPool pool, int64_t n):
    """n aop_slab_acquire + aop_slab_release pairs."""
    cdef int64_t i, k, s = 0
    with nogil:
        for i in range(n):
            k = aop_slab_acquire(pool.slab)
            s += k
            aop_slab_release(pool.slab, k)
    return s


def write_loop(int fd, int64_t n, size_t size):
    """n write() calls of ``size`` bytes to ``fd`` (one syscall per message: what a batch
    saves); returns the bytes written, or a negative count at the first failure."""
    cdef char buf[65536]
    cdef int64_t i
    cdef ssize_t r, total = 0
    if size > sizeof(buf):
        raise ValueError("size > 65536")
    with nogil:
        for i in range(n):
            r = write(fd, buf, size)
            if r < 0:
                total = -1
                break
            total += r
    return total


def sendbatch_loop(SendBatch b, int64_t n, int64_t per_flush, size_t size):
    """n messages of ``size`` bytes added with c_add_copy, flushed every ``per_flush``
    (c_flush: one write/writev).  ``b`` should target a sink that never blocks (an fd of
    /dev/null); returns the bytes written, or a negative errno."""
    cdef char buf[65536]
    cdef int64_t i
    cdef Py_ssize_t r, total = 0
    if size > sizeof(buf):
        raise ValueError("size > 65536")
    with nogil:
        for i in range(n):
            b.c_add_copy(buf, size)
            if (i + 1) % per_flush == 0:
                r = b.c_flush()
                if r < 0:
                    total = r
                    break
                total += r
        else:
            r = b.c_flush()
            if r > 0:
                total += r
    return total
