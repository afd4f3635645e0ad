# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""SpinLock: a non-reentrant test-and-test-and-set lock with backoff; a drop-in for
threading.Lock.

The lock itself is aop_spinlock_t in aop_atomic.h (its invariants and memory orders are
documented there).  This module adds threading.Lock's Python surface:
- the uncontended acquire is one CAS with the GIL held: no syscall, no GIL release;
- a contended acquire releases the GIL, then spins, yields and parks (futex) in C, so a
  holder in another Python thread always progresses and no core burns while we wait;
- a blocked acquire is interruptible, as threading.Lock's is on POSIX: it waits in slices
  of at most SLICE_NS and returns to Python (with the GIL) when a slice ends or a signal
  interrupts the park, runs the signal handlers (PyErr_CheckSignals), and propagates what
  they raise (KeyboardInterrupt) without owning the lock; otherwise it waits again for
  what is left of the timeout.  Only the waiting path pays for this.
"""
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.number cimport PyNumber_Index
from cpython.object cimport PyObject_IsTrue
from libc.math cimport isnan
from libc.stdint cimport int64_t, INT64_MAX

from cpython.exc cimport PyErr_CheckSignals
from aoprim.atomic_h cimport (
    aop_spin_init, aop_spin_trylock, aop_spin_locked, aop_spin_lock_intr, aop_spin_unlock_checked,
    aop_now_ns, aop_deadline_ns, aop_cpu_relax,
)

cdef extern from *:
    """
    /* 1 on a free-threaded build: a waiter may spin while attached to the interpreter
     * (another thread can hold the lock and run at the same time).  0 under the GIL: the
     * holder needs the GIL we would be spinning with, so we release it at once. */
    #ifdef Py_GIL_DISABLED
    #define AOP_SPIN_ATTACHED 1
    #else
    #define AOP_SPIN_ATTACHED 0
    #endif
    """
    int AOP_SPIN_ATTACHED

import threading as _threading

cdef double TIMEOUT_MAX = _threading.TIMEOUT_MAX

cdef enum:
    SLICE_NS = 50000000     # a blocked acquire runs signal handlers at least every 50 ms
    ATTACHED_FIRST = 6      # attached spin: 64, 128, 256, 512 pause hints between
    ATTACHED_LAST = 9       # re-reads (960 in all: about 24 us at 25 ns a pause)


# GC: not tracked: the lock word and the weakref list are all it holds (a waiter in another
# thread holds the lock object itself, so it cannot be garbage while anyone waits).
cdef class SpinLock:
    """A non-reentrant lock; same methods and argument rules as threading.Lock.

    Threads: shared -- acquire/release/locked/with from any threads at once (release from a
    thread other than the holder's is allowed, as for threading.Lock).  On a free-threaded
    build a waiter spins a few microseconds before it sleeps (docs/atomics-and-lock.md).
    """

    def __cinit__(self):
        aop_spin_init(&self.lock)

    def acquire(self, blocking=True, timeout=-1):
        """Acquire the lock; True if acquired.  Same rules as threading.Lock.acquire()."""
        cdef double t
        cdef int64_t ns
        # fast path, GIL held: the overwhelmingly common uncontended case costs one CAS.
        # (`timeout is -1` holds for the default; any other -1 takes the general path.)
        if timeout is -1 and (blocking is True or blocking is False):
            if aop_spin_trylock(&self.lock):
                return True
            if blocking is False:
                return False
            if _spin_attached(self):
                return True
            ns = -1
        else:
            blocking = _flag(blocking)
            t = _seconds(timeout)
            if not blocking:
                if t != -1:
                    raise ValueError("can't specify a timeout for a non-blocking call")
                return bool(aop_spin_trylock(&self.lock))
            if t < 0 and t != -1:
                raise ValueError("timeout value must be a non-negative number")
            if t == -1:
                ns = -1
            else:
                if t > TIMEOUT_MAX:
                    raise OverflowError("timeout value is too large")
                # saturate: t * 1e9 at or above 2**63 does not fit (casting it is undefined)
                ns = INT64_MAX if t * 1e9 >= 9.2e18 else <int64_t>(t * 1e9)
            if aop_spin_trylock(&self.lock):
                return True
            if ns == 0:
                return False
        return _wait(self, ns)

    def release(self):
        """Release the lock.  RuntimeError if it is not locked."""
        if not aop_spin_unlock_checked(&self.lock):
            raise RuntimeError("release unlocked lock")

    def locked(self):
        """True if the lock is held (by anyone)."""
        return aop_spin_locked(&self.lock)

    def __enter__(self):
        if not aop_spin_trylock(&self.lock) and not _spin_attached(self):
            _wait(self, -1)
        return True

    def __exit__(self, exc_type, exc_value, tb):
        if not aop_spin_unlock_checked(&self.lock):
            raise RuntimeError("release unlocked lock")

    # threading.Lock's old aliases, kept for drop-in compatibility
    acquire_lock = acquire
    release_lock = release
    locked_lock = locked

    def _at_fork_reinit(self):
        """After fork(), the child starts with a fresh, unlocked lock (as threading.Lock)."""
        aop_spin_init(&self.lock)

    def __repr__(self):
        state = "locked" if aop_spin_locked(&self.lock) else "unlocked"
        return f"<{state} aoprim.SpinLock object at {id(self):#x}>"


cdef inline bint _spin_attached(SpinLock self) noexcept:
    """Free-threaded builds: a spin, still attached to the interpreter, before _wait.
    A `with lock:` body of a few hundred nanoseconds ends within it, and the waiter then
    takes the lock without detaching and re-attaching its thread state (two atomic
    read-modify-writes on the thread state plus the slice loop).  Reads, not writes,
    between tries (aop_spin_trylock's relaxed pre-read): waiting costs no cache-line
    ping-pong with the holder.
    The first re-read comes only after 64 pauses, and the gaps double: a holder that
    releases and takes the lock again within a loop (the common contended case: several
    threads each running short critical sections) keeps it for several rounds, on a warm
    cache line, before the waiter competes.  A waiter re-reading every few nanoseconds
    took the lock in the holder's gap between release and re-acquire at nearly every
    round, and the lock word, the data it guards and their reference counts then moved
    between the cores at every acquisition: `with lock: n += 1` from 2 threads ran at
    2.8 M/s with re-reads from 1 pause up, 5.4 M/s with these (threading.Lock 4.3:
    `python -m aoprim bench --only ft-lock-counter`).  At most 960 pauses (about 24 us
    here): a stop-the-world request waits no longer than that.
    Under the GIL: False at once (see AOP_SPIN_ATTACHED)."""
    cdef int step, i
    if not AOP_SPIN_ATTACHED:
        return False
    for step in range(ATTACHED_FIRST, ATTACHED_LAST + 1):
        for i in range(1 << step):
            aop_cpu_relax()
        if aop_spin_trylock(&self.lock):
            return True
    return False


cdef bint _wait(SpinLock self, int64_t ns) except -1:
    """The contended acquire: wait (GIL released) at most ns (< 0: forever), in slices, and
    run signal handlers between slices.  True if acquired, False on timeout; raises what a
    handler raises (then the lock is not ours)."""
    cdef int64_t deadline = 0, step
    cdef int r
    if ns > 0:
        deadline = aop_deadline_ns(ns)             # saturates: TIMEOUT_MAX never wraps
    while True:
        step = SLICE_NS
        if ns > 0:
            step = deadline - aop_now_ns()
            if step <= 0:
                return False
            if step > SLICE_NS:
                step = SLICE_NS
        with nogil:
            r = aop_spin_lock_intr(&self.lock, step)
        if r == 1:
            return True
        PyErr_CheckSignals()   # a handler's exception (KeyboardInterrupt) -> except -1


cdef extern from "Python.h":
    # the interpreter this module is compiled for (the .so is built per CPython version)
    const long PY_VERSION_HEX


cdef bint _flag(object blocking) except -1:
    """``blocking`` as the running interpreter's threading.Lock reads it: up to 3.11 a C int
    (any integer, bool included; anything else is a TypeError), from 3.12 a truth value
    (``"p"``: any object, ``bool(blocking)``; an exception from ``__bool__`` propagates)."""
    if PY_VERSION_HEX >= 0x030C0000:
        return PyObject_IsTrue(blocking)     # -1 with an exception set -> except -1
    return PyNumber_Index(blocking) != 0


cdef double _seconds(object timeout) except? -2:
    """A timeout in seconds, as threading.Lock reads it: a float, or an integer (anything
    with __index__); NaN is refused, as are strings and None."""
    cdef double t
    if isinstance(timeout, float):
        t = PyFloat_AS_DOUBLE(timeout)
    else:
        t = <double>PyNumber_Index(timeout)   # TypeError for non-integers
    if isnan(t):
        raise ValueError("Invalid value NaN (not a number)")
    return t
