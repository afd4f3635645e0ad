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
the MPMCQueue object for as long as C code uses ``q.q``.  close() applies to both modes, and
so does the task accounting: aop_mpmc_task_done(q.q) (AOP_Q_RETRY when no task is
unfinished) and aop_mpmc_all_done(q.q), from any thread.

Return codes (aoprim._qwait): AOP_Q_OK, AOP_Q_RETRY (full / empty / timed out),
AOP_Q_CLOSED, AOP_Q_BADMODE.  Blocking forms take timeout_ns (< 0 forever, 0 one try) and
park on a futex; call them inside ``with nogil``.
"""
# The C declarations (struct and functions, each commented) live in aoprim/_qcore.pxd;
# the public C API is re-exported here so that cimporters write `from aoprim._mpmc cimport ...`.
from aoprim._qcore cimport (
    aop_mpmc_t, aop_mpmc_try_push_u64, aop_mpmc_try_pop_u64,
    aop_mpmc_push_u64, aop_mpmc_pop_u64, aop_mpmc_push_many_u64,
    aop_mpmc_pop_many_u64, aop_mpmc_size, aop_mpmc_closed,
    aop_mpmc_close, aop_mpmc_task_done, aop_mpmc_all_done,
)

from aoprim.atomic_h cimport aop_atomic_u32

cdef class MPMCQueue:
    cdef aop_mpmc_t *q           # the C queue (128-byte aligned, owned; freed at dealloc)
    cdef list _agetters          # futures of coroutines waiting in get_async (_qcore.pxd)
    cdef list _aputters          # futures of coroutines waiting in put_async
    cdef aop_atomic_u32 _nagetters   # how many futures _agetters holds (a put's one check)
    cdef aop_atomic_u32 _naputters   # how many futures _aputters holds (a get's one check)
    cdef object __weakref__      # weak references work
    cdef object _gc              # makes the class GC-tracked: its queued objects are traversed
