"""Hardware floors for the C-level benchmarks: bare __atomic loops with no aoprim code in
them, to be timed beside aoprim's nogil loops in the same run.  Prepend FLOORS to a
benchmark's Cython source; it defines ``bare_fetch_add(n)`` (one locked instruction per
iteration) and ``bare_cas_xchg(n)`` (a CAS + exchange pair: the two locked instructions any
lock/unlock needs)."""

FLOORS = r"""
from libc.stdint cimport int64_t, uint32_t

cdef extern from *:
    '''
    static int64_t aop_floor_word;
    static uint32_t aop_floor_lockword;
    static void aop_floor_fetch_add(int64_t n) {
        for (int64_t i = 0; i < n; i++)
            __atomic_fetch_add(&aop_floor_word, 1, __ATOMIC_SEQ_CST);
    }
    static void aop_floor_cas_xchg(int64_t n) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t e = 0;
            __atomic_compare_exchange_n(&aop_floor_lockword, &e, 1, 0,
                                        __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
            __atomic_exchange_n(&aop_floor_lockword, 0, __ATOMIC_RELEASE);
        }
    }
    '''
    void aop_floor_fetch_add(int64_t n) nogil
    void aop_floor_cas_xchg(int64_t n) nogil

def bare_fetch_add(int64_t n):
    with nogil:
        aop_floor_fetch_add(n)

def bare_cas_xchg(int64_t n):
    with nogil:
        aop_floor_cas_xchg(n)
"""
