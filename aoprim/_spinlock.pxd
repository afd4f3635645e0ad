# cython: language_level=3
"""SpinLock, for ``cimport``.

    from aoprim._spinlock cimport SpinLock
    from aoprim.atomic_h cimport aop_spin_lock, aop_spin_unlock

    cdef SpinLock lk = SpinLock()
    with nogil:
        aop_spin_lock(&lk.lock)
        ...                       # critical section, no GIL
        aop_spin_unlock(&lk.lock)

The C lock and the Python methods are the same lock: code holding it in C excludes Python
callers and vice versa.
"""
from aoprim.atomic_h cimport aop_spinlock_t

cdef class SpinLock:
    cdef aop_spinlock_t lock     # the lock word: 0 free, 1 held, 2 held and a waiter may be parked
    cdef object __weakref__      # weak references work, as on threading.Lock
