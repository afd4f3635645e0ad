# cython: language_level=3
"""BlockTable, for ``cimport``.

    from aoprim._blocktable cimport BlockTable
    from aoprim._slab cimport Slot

A logical byte sequence laid over pool slots: logical byte k lives in block
(start + k) // size at offset (start + k) % size.  One owner at a time, enforced: every
method claims ``busy`` (aoprim/_owner.pxd) and a second thread entering meanwhile gets
RuntimeError (forks are separate tables and may live in other threads; the blocks they
share are never written while shared, and their reference counts are atomic).
"""
from cpython.ref cimport PyObject
from aoprim.atomic_h cimport aop_atomic_i64, aop_atomic_u32
from aoprim._slab cimport SlabPool, Slot


cdef class BlockTable:
    cdef SlabPool pool          # where blocks come from (kept alive by the table)
    cdef list _blocks           # Slot objects in logical order; each holds one reference
                                # of this table (shared blocks have refs > 1)
    cdef Py_ssize_t bsize       # bytes per block (pool.slot_size)
    cdef Py_ssize_t start       # offset of logical byte 0 in the first block (< bsize)
    cdef Py_ssize_t nbytes      # logical length
    cdef aop_atomic_i64 exports # live views of the tail buffer (mutation refused while > 0;
                                # atomic: a view may be released in any thread, claim or not)
    cdef aop_atomic_u32 busy    # the one-owner claim (_owner.claim): 1 while a method runs
    cdef _TailBuffer _tail      # the reusable writable exporter returned by tail()
    cdef _FrameExporter _fx     # reusable exporter behind view(): one getbuffer per view

    cdef Py_ssize_t _fill_last(self)            # bytes used in the last block (bsize if none)
    cdef tuple _indices(self)                   # blocks' slot indices (claim held)
    cdef Py_ssize_t _tail_room(self)            # free bytes in the last block (claim held)
    cdef int _check_unexported(self) except -1
    cdef Slot _take1(self)                      # one fresh block (PoolExhausted)
    cdef int _prepare_tail(self) except -1      # last block exists, has room, unshared
    cdef int _write(self, const char *src, Py_ssize_t n) except -1
    cdef int _copy_out(self, char *dst, Py_ssize_t pos, Py_ssize_t n) except -1
    cdef int _drop_front(self, Py_ssize_t k) except -1
    cdef object _view(self, Py_ssize_t a, Py_ssize_t b)     # view(), positions resolved
    cdef unsigned long long _uint(self, Py_ssize_t p, Py_ssize_t n)   # no range check
    cdef int _range(self, object start, object stop, Py_ssize_t *a, Py_ssize_t *b) except -1


cdef class _TailBuffer:
    cdef PyObject *table        # borrowed; owned (INCREF) only while a view is exported;
                                # NULL once the table is gone


cdef class _FrameExporter:
    # Set by BlockTable.view() right before PyMemoryView_FromObject(self); read only inside
    # that call's getbuffer (the table has one owner at a time).  Each exported view pins
    # its Slot (a view count on it, plus a strong reference in Py_buffer.internal).
    cdef Slot slot               # the block the next view is cut from
    cdef Py_ssize_t off          # offset of the view in the block
    cdef Py_ssize_t len          # length of the view
