# cython: language_level=3
"""Shared pieces of MPMCQueue and SPSCQueue: the parts of aoprim/include/aop_queue.h that
both queues use (status codes, modes, wait sets), and the small Python-level helpers that
both classes call on their slow paths (timeout parsing, raising, reference hand-over).

Status codes returned by every C-level queue function:
    AOP_Q_OK       done
    AOP_Q_RETRY    full (push) / empty (pop), or a blocking call timed out
    AOP_Q_CLOSED   push on a closed queue; pop on a closed *and drained* queue
    AOP_Q_BADMODE  the queue carries the other kind of payload (objects vs raw words)

The algorithms, invariants and the no-lost-wake-up argument are at the top of
aop_queue.h.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from libc.math cimport isnan
from cpython.ref cimport PyObject
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.number cimport PyNumber_Index
from cpython.exc cimport PyErr_CheckSignals

from aoprim.atomic_h cimport aop_atomic_u32, aop_now_ns, aop_deadline_ns

cdef extern from "aop_queue.h" nogil:
    int AOP_Q_OK
    int AOP_Q_RETRY
    int AOP_Q_CLOSED
    int AOP_Q_BADMODE
    int AOP_Q_BUSY           # internal (MPMC): full/empty because the other side is mid-operation
    uint32_t AOP_Q_MODE_NONE
    uint32_t AOP_Q_MODE_OBJ
    uint32_t AOP_Q_MODE_RAW
    uint64_t AOP_Q_MAX_CAPACITY

    ctypedef struct aop_qwait_t:
        aop_atomic_u32 seq       # futex word, bumped by a notifier that saw waiters != 0
        aop_atomic_u32 waiters   # threads in the park phase

    bint aop_q_mode_ok(aop_atomic_u32 *mode, uint32_t want) noexcept
    ctypedef int (*aop_q_wait_fn)(void *q, uint64_t *v, int64_t timeout_ns) noexcept nogil
    uint64_t aop_q_round_capacity(uint64_t n) noexcept


cdef extern from *:
    """
    /* The queue's strong reference, handed over as is: declared to Cython as returning a new
     * reference, so taking the word costs no reference-count operation at all. */
    #define aop_q_take_ref(v) ((PyObject *)(uintptr_t)(v))
    """
    object aop_q_take_ref(uint64_t v)


cdef inline object q_steal(uint64_t v):
    """The object whose strong reference travelled in v; the reference passes to the caller
    unchanged.  No reference count is touched: on a free-threaded build an item put by
    another thread is not owned by the getter, and each count change on it would be an
    atomic operation on a cache line its owner writes too (biased reference counting)."""
    return aop_q_take_ref(v)


cdef inline uint64_t q_word(object o) noexcept:
    return <uint64_t><uintptr_t><PyObject *>o


cdef inline uint64_t q_capacity(object capacity) except 0:
    """Validate a capacity argument (docs/queues.md): int >= 1, else TypeError / ValueError."""
    if isinstance(capacity, float) or not hasattr(type(capacity), "__index__"):
        raise TypeError(f"capacity must be an int, not {type(capacity).__name__}")
    n = PyNumber_Index(capacity)
    if n < 1:
        raise ValueError(f"capacity must be >= 1, got {n}")
    if n > AOP_Q_MAX_CAPACITY:
        raise ValueError(f"capacity must be <= {AOP_Q_MAX_CAPACITY}, got {n}")
    return aop_q_round_capacity(<uint64_t>n)


cdef inline int64_t q_timeout_ns(object block, object timeout) except -2:
    """queue.Queue's rules: not block -> 0 (one try); timeout None -> -1 (forever); else a
    non-negative number of seconds (0 tries once).  TypeError / ValueError otherwise."""
    cdef double t
    if not block:
        return 0
    if timeout is None:
        return -1
    if isinstance(timeout, float):
        t = PyFloat_AS_DOUBLE(timeout)
    elif isinstance(timeout, (int, float)) or hasattr(type(timeout), "__float__"):
        t = float(timeout)
    else:
        raise TypeError(f"timeout must be a number or None, not {type(timeout).__name__}")
    if isnan(t):
        raise ValueError("timeout must not be NaN")
    if t < 0:
        raise ValueError("'timeout' must be a non-negative number")
    if t > 1e9:                  # ~31 years: treat as forever
        return -1
    return <int64_t>(t * 1e9) if t > 0 else 0


cdef inline uint64_t q_max_items(object max_items) except? 0xFFFFFFFFFFFFFFFF:
    if isinstance(max_items, float) or not hasattr(type(max_items), "__index__"):
        raise TypeError(f"max_items must be an int, not {type(max_items).__name__}")
    n = PyNumber_Index(max_items)
    if n < 0:
        raise ValueError(f"max_items must be >= 0, got {n}")
    if n > 0xFFFFFFFFFFFFFFFE:
        n = 0xFFFFFFFFFFFFFFFE
    return <uint64_t>n


cdef inline int q_raise(int r, bint put) except -1:
    """Raise the exception for a failed status (slow path only)."""
    from aoprim.errors import Closed, Empty, Full
    if r == AOP_Q_CLOSED:
        raise Closed("queue is closed")
    if r == AOP_Q_BADMODE:
        raise TypeError("this queue carries raw C-level words (its *_u64 C API was used "
                        "first); it cannot also carry Python objects")
    if put:
        raise Full
    raise Empty


cdef inline int q_obj_mode(aop_atomic_u32 *mode) except -1:
    """Claim (or check) OBJ mode for a Python-level operation; TypeError on a RAW queue."""
    if not aop_q_mode_ok(mode, AOP_Q_MODE_OBJ):
        q_raise(AOP_Q_BADMODE, True)
    return 0


cdef enum:
    Q_SLICE_NS = 50000000     # a Python-level wait re-checks signals every 50 ms


cdef inline int q_wait_interruptible(aop_q_wait_fn fn, void *q, uint64_t *v,
                                     int64_t timeout_ns) except -1:
    """Wait (GIL released) in slices, running signal handlers between slices so that Ctrl-C
    interrupts a blocked put/get as it does queue.Queue's.  Returns the status; raises
    whatever a signal handler raises (the caller then undoes its own work)."""
    cdef int64_t deadline = 0, step, left
    cdef int r
    if timeout_ns > 0:
        deadline = aop_deadline_ns(timeout_ns)     # saturates: INT64_MAX never wraps
    while True:
        step = Q_SLICE_NS
        if timeout_ns > 0:
            left = deadline - aop_now_ns()
            if left <= 0:
                return AOP_Q_RETRY
            if left < step:
                step = left
        with nogil:
            r = fn(q, v, step)
        if r != AOP_Q_RETRY:
            return r
        PyErr_CheckSignals()      # raises (e.g. KeyboardInterrupt) -> except -1
