# cython: language_level=3
"""FlushGroup, for ``cimport``: ``from aoprim._flushgroup cimport FlushGroup``.

A SendBatch attached to a group queues itself there when an add leaves it with pending
data (the C adds included: see aoprim/_sendbatch.pxd).  ``c_flush_all()`` is ``flush()``
without the Python call; it needs the GIL (it takes and drops references and reads
fileno() from socket objects) and releases it at most once for all the system calls (not
at all when the one batch to write targets a non-blocking socket: MSG_DONTWAIT).
"""
from libc.stdint cimport uint64_t
from cpython.ref cimport PyObject
from aoprim.atomic_h cimport aop_atomic_i64, aop_atomic_u32, aop_spinlock_t
from aoprim._sendbatch cimport SendBatch, _GroupBase, aop_sb_owner


# One queue entry of a FlushGroup.  Outside a flush only `batch` means anything; the other
# fields are the flush's scratch for that entry.
ctypedef struct aop_fg_item:
    PyObject *batch          # a SendBatch (strong reference, owned by the array holding it)
    PyObject *owner          # flush: the batch's owner, taken under its claim (strong ref)
    int kind                 # flush: FG_DROP, FG_MOVED, FG_HELD or FG_WRITE (_flushgroup.pyx)
    int fd                   # flush: the fd read before the GIL was released (-1: none)
    int status               # flush: what flush() reports: 0, 1 or -errno
    bint watch               # flush: the batch's `watch`, taken under its claim
    PyObject *sock           # flush: the socket pinned for the write (strong ref), or NULL
    Py_ssize_t rel_a         # flush, out of memory only: fully written owned segments
    Py_ssize_t rel_b         #   [rel_a, rel_b) neither handed over nor committed yet


cdef class FlushGroup(_GroupBase):
    cdef object _gc_anchor           # always None: an object field gives the type GC support
    cdef object __weakref__          # sessions may refer to their group weakly
    cdef readonly Py_ssize_t budget  # bytes one batch may write per flush (>= 1)
    cdef public object notify        # None, or notify(owner, status) called by flush() for
                                     # each batch needing attention (flush then returns None)

    # the live queue: q[0:qlen], one strong reference per entry (batches mark themselves
    # `queued`).  Guarded by qlock, which is never held across a Python call or a DECREF.
    cdef aop_spinlock_t qlock
    cdef aop_fg_item *q              # grows by doubling; shrinks back when large and empty
    cdef Py_ssize_t qlen             # entries in q
    cdef Py_ssize_t qcap             # allocated length of q

    # the flush's own arrays (touched only by the thread inside flush(); `flushing` guards)
    cdef aop_fg_item *w              # the queue taken by this flush (swapped with q)
    cdef Py_ssize_t wcap             # allocated length of w
    cdef aop_sb_owner *rel           # owners of sent segments, released once the GIL is back
    cdef Py_ssize_t nrel             # entries in rel
    cdef Py_ssize_t relcap           # allocated length of rel
    cdef aop_atomic_u32 flushing     # 1 while a flush() runs: a second one is refused
    cdef uint64_t serial             # flushes started (marks the batches each one claims)
    cdef size_t rot                  # fairness: flush k starts at entry k mod n

    # counters: written by the flushing thread (and st_high under qlock), read relaxed
    cdef aop_atomic_i64 st_flushes   # flush() calls
    cdef aop_atomic_i64 st_batches   # batches written to (one count per batch per flush)
    cdef aop_atomic_i64 st_syscalls  # write system calls issued
    cdef aop_atomic_i64 st_bytes     # bytes written
    cdef aop_atomic_i64 st_gil       # GIL releases (at most one per flush)
    cdef aop_atomic_i64 st_pending   # batches reported with status 1
    cdef aop_atomic_i64 st_budget    # of those, stopped by the budget
    cdef aop_atomic_i64 st_errors    # batches reported with -errno
    cdef aop_atomic_i64 st_busy      # entries put back because another thread held the batch
    cdef aop_atomic_i64 st_high      # most entries ever queued at once

    # C-level API (GIL held; see the module docstring)
    cdef object c_flush_all(self)
    cdef int c_requeue(self, SendBatch b) except -1

    # internals
    cdef int _push(self, PyObject *b) noexcept
    cdef int _queue(self, SendBatch b) noexcept
    cdef PyObject *_unqueue(self, SendBatch b) noexcept
    cdef int _take_owners(self, SendBatch b, Py_ssize_t a, Py_ssize_t e) noexcept nogil
    cdef void _release_taken(self) noexcept
    cdef object _flush_all(self)
