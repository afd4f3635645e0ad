# cython: language_level=3
"""_Events, for ``cimport``: the epoll_event array aoprim.aio's compiled iteration waits
into (one per loop selector, grown to the number of registered fds)."""

cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void *ptr
        int fd
        unsigned int u32
        unsigned long long u64
    struct epoll_event:
        unsigned int events
        epoll_data_t data

cdef class _Events:
    cdef epoll_event *ev         # malloc'd array of cap events (NULL until the first wait)
    cdef int cap                 # its length
    cdef int reserve(self, int n) except -1
