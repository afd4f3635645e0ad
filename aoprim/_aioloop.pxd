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

from aoprim._aiowrite cimport SleepFlag

cdef class _Events:
    cdef epoll_event *ev         # malloc'd array of cap events (NULL until the first wait)
    cdef int cap                 # its length
    # what the iteration reads of the selector and the loop, kept here once (set by
    # wait_state(): one attribute lookup per iteration, the selector's _aio_events, instead
    # of seven); never cleared by the GC (no_gc_clear), so never None while the loop runs
    cdef int epfd                # the epoll fd (-1: not an EpollSelector)
    cdef dict fd_to_key          # the selector's _fd_to_key (created once by selectors)
    cdef SleepFlag sleep         # the loop's SleepFlag (the selector's _sleep)
    cdef object group            # the loop's FlushGroup (the selector's _group)
    cdef object flush            # its flush (the loop's _aio_flush)
    cdef int reserve(self, int n) except -1
