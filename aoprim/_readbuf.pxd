# cython: language_level=3
"""ReadBuffer, for ``cimport``: one reusable receive buffer (aoprim.aio's loop owns one)."""
from aoprim.atomic_h cimport aop_atomic_i64, aop_atomic_u32

cdef class ReadBuffer:
    cdef char *buf               # the reusable memory every recv() lands in (malloc'd)
    cdef size_t cap              # its size in bytes: the most one recv() reads
    cdef aop_atomic_u32 busy     # 1 while a thread is inside recv_bytes() (claimed by exchange)
    cdef aop_atomic_i64 st_reads # recv() calls that returned data or EOF (relaxed: a counter)
    cdef aop_atomic_i64 st_bytes # bytes received (relaxed)
