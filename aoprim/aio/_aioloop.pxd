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

from aoprim.aio._aiowrite cimport SleepFlag

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
    cdef dict sel_dict           # the selector's __dict__: a "select" there is a patch
    cdef int reserve(self, int n) except -1


cdef class LoopCore:
    # aoprim.aio.Loop's first base: the loop state asyncio's Python code keeps as instance
    # attributes, held in C fields behind data descriptors of the same names (asyncio's
    # methods read and write ``self._ready`` unchanged; the compiled iteration reads the
    # field, no dict lookup).  Invariant: each is exactly what the last assignment stored
    # (None before BaseEventLoop.__init__ ran, or after a GC clear), or _UNSET after a
    # ``del loop._x`` (the attribute then reads as missing, as a deleted instance attribute
    # on asyncio's loop).  c_unset counts the fields that are _UNSET: the compiled
    # iteration runs only while it is 0.
    cdef object c_ready                         # _ready: collections.deque of Handles
    cdef object c_scheduled                     # _scheduled: heapq list of TimerHandles
    cdef object c_selector                      # _selector
    cdef object c_stopping                      # _stopping
    cdef object c_debug                         # _debug
    cdef object c_closed                        # _closed
    cdef object c_clock_resolution              # _clock_resolution
    cdef object c_timer_cancelled_count         # _timer_cancelled_count
    cdef int c_unset
    cdef object _evs_sel                        # the selector _evs was read from
    cdef _Events _evs                           # its _aio_events (read once per selector)
    # what the instance __dict__ overrides (_DICT_* bits), as of the dict's version tag
    # _dict_tag (CPython's ma_version_tag: a new value, unique in the process, on every
    # change of any dict): the loop thread's, like _evs
    cdef unsigned long long _dict_tag
    cdef int _dict_bits
