# cython: language_level=3
"""ReadBuffer, for ``cimport``: one reusable receive buffer (aoprim.aio's loop owns one)."""
from cpython.ref cimport PyObject
from aoprim.atomic_h cimport aop_atomic_i64, aop_atomic_u32

cdef class ReadBuffer:
    cdef char *buf               # the reusable memory every recv() lands in (malloc'd)
    cdef size_t cap              # its size in bytes: the most one recv() reads
    cdef aop_atomic_u32 busy     # 1 while a thread is inside recv_bytes() (claimed by exchange)
    cdef aop_atomic_i64 st_reads # recv() calls that returned data or EOF (relaxed: a counter)
    cdef aop_atomic_i64 st_bytes # bytes received (relaxed)
    cdef aop_atomic_i64 st_pooled # reads handed out as a pool slot, no copy (relaxed)
    cdef size_t big              # a read of at least this many bytes is handed out as its slot
                                 # (min(cap // 4, 64 KiB))
    cdef int npool               # slots created so far (0 .. POOL_MAX)
    cdef PyObject *pool[16]      # the slots: bytes objects of cap bytes, one reference each
    cdef PyObject *_free_slot(self) noexcept
    cdef bytes c_recv(self, object sock)
