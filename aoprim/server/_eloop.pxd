# cython: language_level=3
"""EpollCore, for ``cimport``: the compiled hot path of the ``epoll`` Layer 1 backend.

    from aoprim.server._eloop cimport EpollCore

The loop is used from Python through :class:`aoprim.server.loop_epoll.EpollLoop` (which adds
the :class:`aoprim.server.loop.EventLoop` interface); its invariants are argued at the top of
``_eloop.pyx``.  One thread runs it; ``call_soon_threadsafe`` and ``stop`` are for any thread.
The fields are private: a Cython caller uses the Python-visible methods.
"""
cimport cython
from aoprim.atomic_h cimport aop_atomic_u32, aop_atomic_i64


cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void *ptr
        int fd
        unsigned long long u64
    struct epoll_event:
        unsigned int events
        epoll_data_t data


@cython.final
cdef class EpollTimer:
    cdef readonly double when
    cdef readonly long long seq
    cdef object callback
    cdef object args
    cdef readonly bint cancelled
    cdef EpollCore _loop


@cython.no_gc_clear
cdef class EpollCore:
    cdef int _epfd
    cdef int _evfd
    cdef int _sigfd
    cdef aop_atomic_u32 _wake_pending
    cdef aop_atomic_u32 _closed
    cdef aop_atomic_u32 _inflight
    cdef aop_atomic_u32 _running   # 1 while run() or close() runs: the one-runner claim
    cdef aop_atomic_i64 _loop_tid  # the ident of the thread inside run(), 0 outside it
    cdef bint _stopping
    cdef list _rd
    cdef list _wr
    cdef list _timers
    cdef Py_ssize_t _ncancelled
    cdef long long _seq
    cdef object _ready
    cdef list _hooks
    cdef double _now
    cdef epoll_event _events[64]
    cdef public object thread_id
    # the loop's counters: written by the loop thread only, read by any (Server.stats()):
    # relaxed atomics (see _bump)
    cdef aop_atomic_i64 _iterations
    cdef aop_atomic_i64 _errors
    cdef aop_atomic_i64 _sleeps
    cdef aop_atomic_i64 _polls
    cdef bint _hot
    cdef object _fork_end           # forked(end): None, or what ends a fork come back

    cdef int _loop_thread_only(self, str what) except -1
    cdef int _heap_push(self, EpollTimer t) except -1
    cdef EpollTimer _heap_pop(self)
    cdef int _sift_down(self, EpollTimer t, Py_ssize_t i, Py_ssize_t n) except -1
    cdef int _timer_cancelled(self) except -1
    cdef void _close_fds(self) noexcept nogil
    cdef int _fork_returned(self, object cb) except -1
    cdef void _wake(self) noexcept nogil
    cdef void _drain_wakeup(self) noexcept nogil
    cdef void _drain_sigfd(self) noexcept nogil
    cdef int _wait(self, int timeout_ms) except -1
    cdef int _run(self) except -1
    cdef _close(self)                   # close()'s body, under the one-runner claim
