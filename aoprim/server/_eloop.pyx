# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""EpollCore: the hot path of a Layer 1 event loop, compiled (epoll, eventfd, a timer heap).

One idea, the loop's iteration, kept whole (over 800 lines): the wait, the dispatch, the
timers and the wake-up share one set of invariants, argued below.

    core = EpollCore()
    core.set_callbacks(fd, on_read, on_write)   # None = not interested; both None forgets fd
    core.call_soon(cb, *args); core.call_soon_threadsafe(cb, *args)   # the latter: any thread
    t = core.call_at(when, cb, *args); t.cancel()
    core.add_iteration_hook(hook)
    core.run()                                  # until stop()

It is the engine of the ``epoll`` backend (:mod:`aoprim.server.loop_epoll`), which adds the
:class:`~aoprim.server.loop.EventLoop` interface on top; the contract (iteration order,
isolation, timers, thread-safe wake-up) is written down once, in ``aoprim/server/loop.py``,
and this class keeps all of it.  What is compiled is the per-iteration work: the wait
(``epoll_wait`` straight into a C array, no tuple per event), the dispatch of each ready fd to
its callbacks (looked up by index in a list, called with vectorcall), the timer heap (C
comparisons of C doubles) and the hooks.  A read burst of a session thus costs no Python
bytecode of Layer 1 at all: the loop calls the session's compiled ``Receiver.on_readable``
directly, and the per-iteration hook is the compiled ``FlushGroup.flush``.

Invariants
- One loop thread.  Only the thread running :meth:`run` touches the fd table, the timer heap
  and the hook list.  :meth:`run` and :meth:`close` take a one-runner claim (an atomic
  exchange of ``_running``, acquire; a release store gives it back), so a second thread
  calling either meanwhile gets RuntimeError -- on a free-threaded build two runners would
  share the epoll array and the timer heap.  A claim, not a critical section: a second
  runner is a bug to report, and a critical section would be suspended while epoll_wait
  blocks.  The other loop-thread methods (call_soon, call_at, call_later, set_callbacks,
  remove, add_iteration_hook, EpollTimer.cancel) are the loop thread's alone while it runs:
  the loop reads the fd table, the heap and the hook list through borrowed pointers, so on a
  free-threaded build another thread's store there would free an object under it.  They
  check it: ``run()`` publishes its thread's ident in ``_loop_tid`` and clears it on the way
  out, and each of them raises RuntimeError (changing nothing) when called from another
  thread while the loop runs.  Before ``run()`` (set-up) and after it returns, whoever owns
  the loop may call them.  From any other thread use :meth:`call_soon_threadsafe`.  The thread-safe entries are :meth:`call_soon_threadsafe` and
  :meth:`stop` (built on it): an append to a ``collections.deque`` (atomic with the GIL, and
  internally locked in a free-threaded build) plus, unless a wake-up is already pending, one
  ``write`` to the eventfd.
- No lost wake-up: the loop clears ``wake_pending`` *before* it drains the ready queue, and
  never blocks while the queue is non-empty (it waits with a zero timeout).  A producer
  appends and then swaps the flag to 1; if it read 0 it writes the eventfd.  Both the clear
  and the swap are sequentially consistent (a Dekker pair: each side writes one location and
  then reads the other), so either the loop's drain sees the item, or the producer sees the
  flag clear and writes the eventfd -- never neither.  The loop also clears the flag right
  after each read of the eventfd: the write it consumed may be that of a producer whose
  item an earlier drain already ran (appended before the drain's count, swapped after its
  clear), and a flag left set with nothing left to read would make every later producer
  skip its write while the loop sleeps.  The queue is looked at again before the next wait,
  so whenever the loop waits, either the flag is clear or an eventfd write is unread.  At
  worst a wake-up is spurious.
- ``close()`` never pulls the eventfd from under a producer: a producer counts itself in
  ``_inflight`` before it reads ``_closed`` and out after its eventfd write; ``close()`` sets
  ``_closed`` and then waits (GIL released) until ``_inflight`` is 0 before it closes the fds.
  Both sides write one location and then read the other, sequentially consistent (a Dekker
  pair): either the producer sees the loop closed and queues nothing (returns False), or
  ``close()`` sees it in flight and waits for it.  So no write ever reaches an fd number the
  process has since reused.  (In a GIL build the producer's section runs no Python code --
  its item tuple is built before it counts itself in -- so ``close()`` never actually waits.)
- fd table: ``_rd[fd]`` / ``_wr[fd]`` hold the callbacks (None = not interested); a fd is
  registered with epoll exactly when one of them is not None.  The two lists always have
  one length: growing builds both longer lists first, then installs them (replacing, not
  extending), so a MemoryError leaves the old pair.  They only grow (``close()`` empties
  them).
- Timers: a binary heap of :class:`EpollTimer` ordered by (when, seq).  The timer phase runs
  only timers due when it began *and* issued before it began (seq <= the last seq issued):
  a timer that schedules another for "now" runs it in the next iteration, never the same
  pass.  Cancelled timers stay in the heap until popped, or until they are more than half of
  it (and more than 256): then the heap is rebuilt without them.
- Callbacks are called with a strong reference held (a callback may unregister itself).  An
  ``Exception`` escaping a callback, timer or hook is logged (logger ``aoprim.server``) and
  counted in ``errors``; the loop goes on.  A ``BaseException`` ends :meth:`run`.

Waiting.  While the loop is busy -- callbacks are queued, or the last zero-timeout poll found
fds ready, or the last blocking wait came back with a full array -- an iteration first asks
epoll for ready fds with a zero timeout, holding the GIL: something is ready and the GIL
hand-off (a mutex and a condition variable each way) is saved.  Once such a poll finds
nothing, the loop stops polling first: it releases the GIL and blocks in one epoll_wait
(which returns at once when fds are ready), as asyncio does -- an empty poll before every
sleep would be a system call per iteration for nothing (two epoll_wait per iteration
under a ping-pong load).  ``polls`` counts the zero-timeout polls, ``sleeps`` the waits
that released the GIL.  EINTR runs the signal handlers (PyErr_CheckSignals): a handler that raises -- SIGINT's
KeyboardInterrupt -- ends run(); otherwise the wait is retried with a recomputed timeout.
On the main thread, run() also sets Python's signal wake-up fd to a pipe it watches (and puts
the previous one back when it returns -- or none, logged, if that fd was closed meanwhile), so a signal that arrives just before the wait -- or
is delivered to another thread -- still wakes the loop and runs its handler at once.

GC.  Tracked, and ``no_gc_clear``: the loop is in cycles all the time (fd table -> a bound
method of a session -> the session -> the loop), but every such cycle passes through one of
its containers (the fd lists, the timer heap, the ready deque, the hook list), whose own
tp_clear breaks it.  So the GC never clears the loop's fields: a loop reached by a callback
that runs while the GC tears a cycle down still has its lists and its fds.  An EpollTimer is
tracked and clearable (callback, args and loop may close a cycle); a cleared timer has
``_loop`` None and ``cancel()`` checks for it.
"""
cimport cython
from libc.errno cimport errno, EINTR
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.math cimport ceil
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport PyObject
from cpython.number cimport PyNumber_Index
from aoprim.atomic_h cimport (aop_atomic_u32, aop_load_u32, aop_store_u32, aop_exchange_u32,
                              aop_fetch_add_u32, aop_fetch_sub_u32, aop_yield,
                              aop_load_i64, aop_store_i64,
                              AOP_ACQUIRE, AOP_RELAXED, AOP_RELEASE, AOP_SEQ_CST)
from cpython.pythread cimport PyThread_get_thread_ident

import collections
import logging
import os
import signal
import threading

__all__ = ["EpollCore", "EpollTimer"]

log = logging.getLogger("aoprim.server")


cdef extern from "<sys/epoll.h>" nogil:
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event *event)
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)
    enum:
        EPOLLIN
        EPOLLOUT
        EPOLL_CLOEXEC
        EPOLL_CTL_ADD
        EPOLL_CTL_MOD
        EPOLL_CTL_DEL

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    enum:
        EFD_NONBLOCK
        EFD_CLOEXEC

cdef extern from "<unistd.h>" nogil:
    ssize_t c_read "read"(int fd, void *buf, size_t n)
    ssize_t c_write "write"(int fd, const void *buf, size_t n)
    int c_close "close"(int fd)

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec *ts)
    enum:
        CLOCK_MONOTONIC

cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1


cdef enum:
    MAX_EVENTS = 64         # ready fds per wait (== _events[] in the .pxd; the rest: next wait)
    COMPACT_MIN = 256       # cancelled timers tolerated before a rebuild is considered
    MAX_WAIT_MS = 86400000  # one day: a wait never needs to be longer (a timer re-checks)


cdef inline double monotonic() noexcept nogil:
    """CLOCK_MONOTONIC in seconds: the clock of time.monotonic() on Linux."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


@cython.final
cdef class EpollTimer:
    """What :meth:`EpollCore.call_at` returns (a :class:`~aoprim.server.loop.Timer`)."""

    # when, seq, cancelled (readonly), callback, args, _loop (None once popped from the
    # heap, or cleared by the GC): declared in _eloop.pxd

    def cancel(self):
        """Do not run the callback (loop thread; harmless after it ran).  From another
        thread while the loop runs: RuntimeError (cancel through call_soon_threadsafe)."""
        if self._loop is not None:
            self._loop._loop_thread_only("EpollTimer.cancel")
        if self.cancelled:
            return
        self.cancelled = True
        self.callback = self.args = None
        cdef EpollCore loop = self._loop
        if loop is not None:
            loop._timer_cancelled()

    def __repr__(self):
        st = " cancelled" if self.cancelled else ""
        return f"<EpollTimer when={self.when:.6f} seq={self.seq}{st}>"


cdef inline void _bump(aop_atomic_i64 *counter) noexcept nogil:
    """Add one to a counter only the loop thread writes.  A relaxed load and a relaxed
    store, not a read-modify-write: with one writer no increment can be lost, and a reader
    on another thread sees a whole value (never a torn one), perhaps a moment old."""
    aop_store_i64(counter, aop_load_i64(counter, AOP_RELAXED) + 1, AOP_RELAXED)


cdef inline bint _before(EpollTimer a, EpollTimer b) noexcept:
    return a.when < b.when or (a.when == b.when and a.seq < b.seq)


@cython.no_gc_clear
cdef class EpollCore:
    """The compiled loop.  Use it through :class:`aoprim.server.loop_epoll.EpollLoop`."""

    # fields (declared in _eloop.pxd): _epfd, _evfd; atomics: _wake_pending (1 while an
    # eventfd write is unconsumed), _closed, _inflight (producers inside
    # call_soon_threadsafe); _rd/_wr: fd -> read / write callback or None; _timers: heap of
    # EpollTimer; _ncancelled: cancelled timers still in it; _seq: last timer seq issued; _ready: deque of (callback, args); _hooks;
    # _now: the cached time; _events: epoll_wait's array; thread_id; _iterations, _errors
    # (callbacks that raised, logged), _sleeps (waits that released the GIL and blocked),
    # _polls (zero-timeout waits holding the GIL), read through the properties of the same
    # names; _hot: poll first (see Waiting)

    def __cinit__(self):
        self._epfd = -1
        self._evfd = -1
        self._sigfd = -1
        self._rd = []
        self._wr = []
        self._timers = []
        self._ready = collections.deque()
        self._hooks = []
        self.thread_id = None
        # release: plain initial values; the object is published to other threads only
        # through Python (a reference handed over), which orders these stores anyway
        aop_store_u32(&self._wake_pending, 0, AOP_RELEASE)
        aop_store_u32(&self._closed, 0, AOP_RELEASE)
        aop_store_u32(&self._inflight, 0, AOP_RELEASE)
        aop_store_i64(&self._loop_tid, 0, AOP_RELAXED)     # relaxed: as the one above
        self._epfd = epoll_create1(EPOLL_CLOEXEC)
        if self._epfd < 0:
            raise OSError(errno, os.strerror(errno))
        self._evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if self._evfd < 0:
            raise OSError(errno, os.strerror(errno))
        cdef epoll_event ev
        ev.events = EPOLLIN
        ev.data.u64 = 0
        ev.data.fd = self._evfd
        if epoll_ctl(self._epfd, EPOLL_CTL_ADD, self._evfd, &ev) < 0:
            raise OSError(errno, os.strerror(errno))
        self._now = monotonic()

    def __dealloc__(self):
        self._close_fds()

    cdef void _close_fds(self) noexcept nogil:
        if self._epfd >= 0:
            c_close(self._epfd)
            self._epfd = -1
        if self._evfd >= 0:
            c_close(self._evfd)
            self._evfd = -1

    cdef int _loop_thread_only(self, str what) except -1:
        """RuntimeError when another thread than the one inside run() calls ``what``."""
        # relaxed: the ident is the only datum read, and a thread sees its own store; a
        # thread that is not the loop's reads either 0 (not running: set-up is allowed) or
        # another thread's ident, never its own
        cdef int64_t tid = aop_load_i64(&self._loop_tid, AOP_RELAXED)
        if tid != 0 and tid != <int64_t>PyThread_get_thread_ident():
            raise RuntimeError(
                f"{what}() called from a thread other than the event loop's while it runs "
                "(the loop's fd table, timers and hooks are its thread's alone): use "
                "call_soon_threadsafe()")
        return 0

    # -- time and timers ------------------------------------------------------------------
    def time(self):
        """The monotonic time cached at the start of this iteration."""
        return self._now

    def clock(self):
        """The monotonic time now (not cached)."""
        return monotonic()

    def call_at(self, double when, callback, *args):
        """Run ``callback(*args)`` once :meth:`time` reaches ``when``; returns the timer.
        NaN raises ValueError (it compares false with every deadline and would corrupt the
        heap); ``inf`` never fires; a deadline in the past runs in the next timer phase."""
        if when != when:
            raise ValueError("a timer's deadline must not be NaN")
        self._loop_thread_only("call_at")
        cdef EpollTimer t = EpollTimer.__new__(EpollTimer)
        self._seq += 1
        t.when = when
        t.seq = self._seq
        t.callback = callback
        t.args = args
        t._loop = self
        self._heap_push(t)
        return t

    def call_later(self, double delay, callback, *args):
        """Run ``callback(*args)`` ``delay`` seconds from now (see :meth:`call_at`)."""
        if delay != delay:
            raise ValueError("a timer's delay must not be NaN")
        if delay < 0:
            delay = 0
        return self.call_at(monotonic() + delay, callback, *args)

    @property
    def own_fds(self):
        """The fds the loop itself opened: its epoll instance and its wake-up eventfd
        (empty once closed) -- what a process forked from the serving one must not act on."""
        return tuple([fd for fd in (self._epfd, self._evfd) if fd >= 0])

    @property
    def pending_timers(self):
        """Timers scheduled and not yet run, cancelled ones included until compacted."""
        return len(self._timers)

    cdef int _heap_push(self, EpollTimer t) except -1:
        cdef list h = self._timers
        h.append(t)
        cdef Py_ssize_t i = PyList_GET_SIZE(h) - 1, parent
        cdef EpollTimer p
        while i > 0:
            parent = (i - 1) >> 1
            p = <EpollTimer>PyList_GET_ITEM(h, parent)
            if not _before(t, p):
                break
            h[i] = p
            i = parent
        h[i] = t
        return 0

    cdef EpollTimer _heap_pop(self):
        """Remove and return the earliest timer (the heap is not empty)."""
        cdef list h = self._timers
        cdef EpollTimer top = <EpollTimer>PyList_GET_ITEM(h, 0)
        cdef EpollTimer last = h.pop()
        cdef Py_ssize_t n = PyList_GET_SIZE(h)
        if n:
            self._sift_down(last, 0, n)
        return top

    cdef int _sift_down(self, EpollTimer t, Py_ssize_t i, Py_ssize_t n) except -1:
        """Place ``t`` at index ``i`` and move it down to its place in h[:n]."""
        cdef list h = self._timers
        cdef Py_ssize_t c
        cdef EpollTimer a, b
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            a = <EpollTimer>PyList_GET_ITEM(h, c)
            if c + 1 < n:
                b = <EpollTimer>PyList_GET_ITEM(h, c + 1)
                if _before(b, a):
                    c += 1
                    a = b
            if not _before(a, t):
                break
            h[i] = a
            i = c
        h[i] = t
        return 0

    cdef int _timer_cancelled(self) except -1:
        cdef EpollTimer t
        cdef Py_ssize_t i, n
        self._ncancelled += 1
        if self._ncancelled > COMPACT_MIN and 2 * self._ncancelled > len(self._timers):
            live = []
            for t in self._timers:
                if t.cancelled:
                    t._loop = None
                else:
                    live.append(t)
            self._timers = live
            n = len(live)
            i = n // 2 - 1
            while i >= 0:           # heapify
                self._sift_down(<EpollTimer>live[i], i, n)
                i -= 1
            self._ncancelled = 0
        return 0

    # -- callbacks --------------------------------------------------------------------------
    def call_soon(self, callback, *args):
        """Run ``callback(*args)`` in this or the next callback phase (loop thread)."""
        self._loop_thread_only("call_soon")
        self._ready.append((callback, args))

    def call_soon_threadsafe(self, callback, *args):
        """``call_soon`` from any thread; wakes the loop.  False once the loop is closed."""
        item = (callback, args)     # built first: nothing below runs Python code
        # seq_cst, both: the Dekker pair with close() (count in, then read _closed)
        aop_fetch_add_u32(&self._inflight, 1, AOP_SEQ_CST)
        if aop_load_u32(&self._closed, AOP_SEQ_CST):
            # release: as below (we touched nothing, but close() waits on this count)
            aop_fetch_sub_u32(&self._inflight, 1, AOP_RELEASE)
            return False
        self._ready.append(item)
        # seq_cst: the Dekker pair with the loop's clear of the flag (see the invariants)
        if aop_exchange_u32(&self._wake_pending, 1, AOP_SEQ_CST) == 0:
            self._wake()
        # release: close() (acquire) sees our append and write done before it closes the fd
        aop_fetch_sub_u32(&self._inflight, 1, AOP_RELEASE)
        return True

    cdef void _wake(self) noexcept nogil:
        cdef uint64_t one = 1
        # EAGAIN: the counter is full, so a wake-up is pending anyway.  EBADF cannot happen:
        # close() closes the eventfd only once no producer is inside (_inflight is 0)
        c_write(self._evfd, &one, 8)

    cdef void _drain_wakeup(self) noexcept nogil:
        cdef uint64_t v
        c_read(self._evfd, &v, 8)

    cdef void _drain_sigfd(self) noexcept nogil:
        cdef char buf[64]
        while c_read(self._sigfd, buf, 64) == 64:
            pass

    def add_iteration_hook(self, hook):
        """``hook()`` runs at the end of every iteration; several run in the order added."""
        self._loop_thread_only("add_iteration_hook")
        self._hooks.append(hook)

    # -- file descriptors -------------------------------------------------------------------
    def set_callbacks(self, fd_number, on_read, on_write):
        """Register ``fd``'s readiness callbacks at once (None = not interested; both None
        unregisters).  Replacing a callback with another costs no syscall.  On a closed
        loop: RuntimeError; a negative fd or the loop's own eventfd: ValueError; an fd that
        is not an integer (a float, a socket object): TypeError, as on the selectors
        backend (a C ``int`` parameter would truncate 3.0 to 3)."""
        cdef int fd
        if self._epfd < 0:
            raise RuntimeError("the event loop is closed")
        self._loop_thread_only("set_callbacks")
        fd = PyNumber_Index(fd_number)
        if fd < 0:
            raise ValueError(f"invalid file descriptor {fd}")
        if fd == self._evfd:
            raise ValueError("that fd is the loop's own eventfd")
        cdef list rd = self._rd, wr = self._wr
        cdef Py_ssize_t n = PyList_GET_SIZE(rd)
        if fd >= n:
            if on_read is None and on_write is None:
                return
            # Both grown tables are built before either is installed: a MemoryError leaves
            # the old pair, never an _rd longer than _wr (lookups skip bounds checks).  The
            # tables are replaced, not extended: _run re-reads them before every dispatch.
            grow = [None] * (fd + 1 - n + n // 2 + 16)
            new_rd = rd + grow
            new_wr = wr + grow
            self._rd = rd = new_rd      # commit: two stores that cannot fail
            self._wr = wr = new_wr
        old_r = <object>PyList_GET_ITEM(rd, fd)
        old_w = <object>PyList_GET_ITEM(wr, fd)
        cdef uint32_t old_ev = (EPOLLIN if old_r is not None else 0) | \
                               (EPOLLOUT if old_w is not None else 0)
        cdef uint32_t new_ev = (EPOLLIN if on_read is not None else 0) | \
                               (EPOLLOUT if on_write is not None else 0)
        cdef epoll_event ev
        cdef int op
        if new_ev != old_ev:
            ev.events = new_ev
            ev.data.u64 = 0
            ev.data.fd = fd
            op = EPOLL_CTL_ADD if old_ev == 0 else (EPOLL_CTL_DEL if new_ev == 0
                                                    else EPOLL_CTL_MOD)
            if epoll_ctl(self._epfd, op, fd, &ev) < 0:
                err = errno
                if op != EPOLL_CTL_DEL:
                    raise OSError(err, os.strerror(err))
                # DEL of an fd already closed (EBADF) or never known: forgotten anyway
        rd[fd] = on_read
        wr[fd] = on_write

    def reader_of(self, int fd):
        """The read callback registered for ``fd``, or None."""
        if 0 <= fd < len(self._rd):
            return self._rd[fd]
        return None

    def writer_of(self, int fd):
        """The write callback registered for ``fd``, or None."""
        if 0 <= fd < len(self._wr):
            return self._wr[fd]
        return None

    def remove(self, int fd):
        """Forget ``fd`` entirely (call before closing it)."""
        if 0 <= fd < len(self._rd) and (self._rd[fd] is not None or self._wr[fd] is not None):
            self.set_callbacks(fd, None, None)

    # -- counters (any thread may read them) ------------------------------------------------
    # relaxed loads: each is a statistic on its own, ordered with nothing else; the loop
    # thread's _bump is the only writer
    @property
    def iterations(self):
        """Loop iterations run."""
        return aop_load_i64(&self._iterations, AOP_RELAXED)

    @property
    def errors(self):
        """Callbacks that raised (each logged; the loop went on)."""
        return aop_load_i64(&self._errors, AOP_RELAXED)

    @property
    def sleeps(self):
        """Waits that released the GIL and blocked in ``epoll_wait``."""
        return aop_load_i64(&self._sleeps, AOP_RELAXED)

    @property
    def polls(self):
        """Zero-timeout ``epoll_wait`` calls made without releasing the GIL."""
        return aop_load_i64(&self._polls, AOP_RELAXED)

    # -- running ----------------------------------------------------------------------------
    @property
    def closed(self):
        # acquire: pairs with close()'s store; any thread may ask
        return bool(aop_load_u32(&self._closed, AOP_ACQUIRE))

    @property
    def running(self):
        # acquire: pairs with the release store that ends run(); any thread may ask
        return aop_load_u32(&self._running, AOP_ACQUIRE) == 1

    def stop(self):
        """Make :meth:`run` return after the current iteration (any thread)."""
        self.call_soon_threadsafe(self._set_stopping)

    def _set_stopping(self):
        self._stopping = True

    def _report(self, cb, exc):
        if self._fork_end is not None:
            self._fork_end(f"loop callback {cb!r}", exc)
        _bump(&self._errors)
        log.error("event loop: callback %r raised; the loop goes on", cb, exc_info=exc)

    def forked(self, end):
        """In a process forked by code a callback ran (the server calls it at the fork):
        from now on, a callback of any kind (readiness, timer, ready, iteration hook) that
        returns calls ``end(where, None)``, and one that raises ``end(where, exc)`` -- which
        ends the process: the loop is the parent's."""
        self._fork_end = end

    cdef int _fork_returned(self, object cb) except -1:
        self._fork_end(cb if type(cb) is str else f"loop callback {cb!r}", None)
        return 0

    def run(self):
        """Run iterations until :meth:`stop` (loop thread)."""
        # The one-runner claim: a test-and-set, not a read then a write, so two threads
        # calling run() at once (free-threaded build) cannot both get in and share the
        # epoll array, the timer heap and the fd table.  acquire: pairs with the release
        # store at the end of the previous run() (or close()), whose state we take over.
        if aop_exchange_u32(&self._running, 1, AOP_ACQUIRE) != 0:
            raise RuntimeError("the event loop is already running")
        if aop_load_u32(&self._closed, AOP_ACQUIRE):    # acquire: pairs with close()
            aop_store_u32(&self._running, 0, AOP_RELEASE)   # release: nothing changed
            raise RuntimeError("the event loop is closed")
        self._stopping = False
        self.thread_id = threading.get_ident()
        self._now = monotonic()
        cdef int r = -1, w = -1
        cdef epoll_event ev
        old = None
        if threading.current_thread() is threading.main_thread():
            # Signals: Python's C handler only sets a flag, so a signal that lands after the
            # last check and before epoll_wait would wait for the next event (forever, with
            # no timer).  Its wake-up fd closes that window: the handler also writes a byte
            # there, epoll sees it, and the dispatch runs the Python handlers.
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
                ev.events = EPOLLIN
                ev.data.u64 = 0
                ev.data.fd = r
                if epoll_ctl(self._epfd, EPOLL_CTL_ADD, r, &ev) < 0:
                    raise OSError(errno, os.strerror(errno))
            except BaseException:
                if old is not None:
                    signal.set_wakeup_fd(old)
                os.close(r)
                os.close(w)
                aop_store_u32(&self._running, 0, AOP_RELEASE)   # release: see below
                raise
            self._sigfd = r
        # relaxed, both: the ident is read only to compare it (_loop_thread_only)
        aop_store_i64(&self._loop_tid, <int64_t>PyThread_get_thread_ident(), AOP_RELAXED)
        try:
            self._run()
        finally:
            aop_store_i64(&self._loop_tid, 0, AOP_RELAXED)
            # release: the next run()/close() (acquire) sees the state this run left
            aop_store_u32(&self._running, 0, AOP_RELEASE)
            if r >= 0:
                self._sigfd = -1
                try:
                    signal.set_wakeup_fd(old)
                except (OSError, ValueError) as e:
                    # the fd set before run() was closed meanwhile (EBADF): set none and
                    # say so -- our pipe is closed below either way, never left installed
                    signal.set_wakeup_fd(-1)
                    log.warning("event loop: could not put back the signal wake-up fd %d "
                                "(%s); none is set", old, e)
                epoll_ctl(self._epfd, EPOLL_CTL_DEL, r, &ev)
                os.close(r)
                os.close(w)

    cdef int _wait(self, int timeout_ms) except -1:
        """epoll_wait into _events; returns the number of ready fds."""
        cdef int n, err
        cdef double deadline
        if timeout_ms == 0 or self._hot:
            # busy (the last zero-timeout poll found fds ready, or callbacks are queued):
            # take what is ready without the GIL hand-off
            _bump(&self._polls)
            n = epoll_wait(self._epfd, self._events, MAX_EVENTS, 0)
            if n != 0 or timeout_ms == 0:
                if n < 0:
                    err = errno
                    if err != EINTR:
                        raise OSError(err, os.strerror(err))
                    PyErr_CheckSignals()        # a handler that raises ends run()
                    return 0
                self._hot = n > 0
                return n
            # nothing ready: an empty poll is a system call spent for nothing -- stop
            # polling first until a wait comes back full again (under a ping-pong load a
            # poll then a wait would cost one system call per message more than asyncio)
            self._hot = False
        deadline = self._now + timeout_ms * 1e-3
        while True:
            _bump(&self._sleeps)
            with nogil:
                n = epoll_wait(self._epfd, self._events, MAX_EVENTS, timeout_ms)
                err = errno
            if n >= 0:
                # a full batch: more is probably ready at once -- poll first next time
                self._hot = n == MAX_EVENTS
                return n
            if err != EINTR:
                raise OSError(err, os.strerror(err))
            PyErr_CheckSignals()            # a handler that raises ends run()
            # PEP 475: retry with the time that is left
            timeout_ms = <int>ceil((deadline - monotonic()) * 1e3)
            if timeout_ms <= 0:
                return 0

    cdef int _run(self) except -1:
        cdef list rd = self._rd
        cdef list wr = self._wr
        cdef object ready = self._ready
        cdef list hooks = self._hooks
        cdef EpollTimer t
        cdef long long limit
        cdef double due, wait
        cdef int n, i, fd, timeout_ms
        cdef uint32_t ev
        cdef Py_ssize_t k, nready
        cdef object rcb, wcb, cb, args, popleft = ready.popleft
        while not self._stopping:
            # the lists may have been replaced (fd table grown, heap compacted)
            if len(ready):
                timeout_ms = 0
            elif len(self._timers):
                due = (<EpollTimer>PyList_GET_ITEM(self._timers, 0)).when
                wait = (due - self._now) * 1e3
                if wait <= 0:
                    timeout_ms = 0
                elif wait >= MAX_WAIT_MS:
                    timeout_ms = MAX_WAIT_MS
                else:
                    timeout_ms = <int>ceil(wait)     # never wake before the timer is due
            else:
                timeout_ms = MAX_WAIT_MS
            n = self._wait(timeout_ms)
            self._now = monotonic()
            _bump(&self._iterations)
            for i in range(n):
                if self._fork_end is not None:     # the previous callback forked, returned
                    self._fork_returned("a readiness callback")
                ev = self._events[i].events
                fd = self._events[i].data.fd
                if fd == self._evfd:
                    self._drain_wakeup()
                    # seq_cst: the write just read may be that of a producer whose item was
                    # drained already; cleared after the read, and the queue is looked at
                    # again before the next wait (the Dekker pair of the invariants above)
                    aop_store_u32(&self._wake_pending, 0, AOP_SEQ_CST)
                    continue
                if fd == self._sigfd:           # a signal arrived: run its handlers
                    self._drain_sigfd()
                    PyErr_CheckSignals()        # a handler that raises ends run()
                    continue
                # re-read before every dispatch: an earlier callback may have grown the fd
                # table (set_callbacks installs new, longer lists) -- a stale list would hold
                # callbacks that were unregistered since
                rd = self._rd
                wr = self._wr
                if fd >= PyList_GET_SIZE(rd):
                    continue
                rcb = <object>PyList_GET_ITEM(rd, fd)
                wcb = <object>PyList_GET_ITEM(wr, fd)
                try:
                    if wcb is None:
                        # registered for reading only: epoll reports IN, HUP or ERR -- all of
                        # which the read callback handles (it sees EOF or the error)
                        if rcb is not None:
                            rcb()
                        continue
                    if rcb is not None and ev & ~(<uint32_t>EPOLLOUT):
                        rcb()
                        wr = self._wr           # the read callback may have grown the table
                        wcb = <object>PyList_GET_ITEM(wr, fd)   # ... or dropped the writer
                        if wcb is None:
                            continue
                    if ev & ~(<uint32_t>EPOLLIN):
                        wcb()
                except Exception as e:
                    self._report(rcb if rcb is not None else wcb, e)
            if self._fork_end is not None:
                self._fork_returned("a readiness callback")
            # drop the last callbacks' references: a closed session must not be kept alive
            # by a local variable until the next event
            rcb = wcb = None
            if PyList_GET_SIZE(self._timers):
                t = <EpollTimer>PyList_GET_ITEM(self._timers, 0)
                if t.when <= self._now:
                    limit = self._seq       # timers scheduled from here on wait a round
                    while PyList_GET_SIZE(self._timers):
                        t = <EpollTimer>PyList_GET_ITEM(self._timers, 0)
                        if t.when > self._now or t.seq > limit:
                            break
                        self._heap_pop()
                        t._loop = None
                        if t.cancelled:
                            self._ncancelled -= 1
                            continue
                        cb = t.callback
                        args = t.args
                        try:
                            cb(*args)
                        except Exception as e:
                            self._report(cb, e)
                        if self._fork_end is not None:
                            self._fork_returned(cb)
                    t = None
                    cb = args = None
            nready = len(ready)
            if nready:
                # seq_cst: cleared before draining, so a call_soon_threadsafe whose item the
                # drain misses sees the flag clear and writes the eventfd again (Dekker pair)
                aop_store_u32(&self._wake_pending, 0, AOP_SEQ_CST)
                for k in range(nready):
                    cb, args = popleft()
                    try:
                        cb(*args)
                    except Exception as e:
                        self._report(cb, e)
                    if self._fork_end is not None:
                        self._fork_returned(cb)
                cb = args = None
            for k in range(PyList_GET_SIZE(hooks)):
                cb = <object>PyList_GET_ITEM(hooks, k)
                try:
                    cb()
                except Exception as e:
                    self._report(cb, e)
                if self._fork_end is not None:     # (a flush's resume_writing that forked)
                    self._fork_returned(cb)
            cb = None
        return 0

    def run_ready(self):
        """Run the queued callbacks now, after :meth:`run` returned (clean-up)."""
        if aop_load_u32(&self._running, AOP_ACQUIRE):   # acquire: pairs with run()'s end
            raise RuntimeError("run_ready() is for a stopped loop")
        ready = self._ready
        # seq_cst: the same clear-before-drain as the loop's callback phase (Dekker pair with
        # call_soon_threadsafe).  Left set, every later call_soon_threadsafe -- stop()
        # included -- would skip the eventfd write and the next run() sleep
        aop_store_u32(&self._wake_pending, 0, AOP_SEQ_CST)
        while ready:
            cb, args = ready.popleft()
            try:
                cb(*args)
            except Exception as e:
                self._report(cb, e)

    def close(self):
        """Release the backend's resources (after :meth:`run` returned); idempotent."""
        # close() takes the one-runner claim too (acquire, as run()), so it can neither run
        # under a run() another thread started nor twice at once (closing the fds twice)
        if aop_exchange_u32(&self._running, 1, AOP_ACQUIRE) != 0:
            raise RuntimeError("cannot close a running event loop (or one another thread "
                               "is closing)")
        try:
            self._close()
        finally:
            aop_store_u32(&self._running, 0, AOP_RELEASE)   # release: as at run()'s end

    cdef _close(self):
        if aop_load_u32(&self._closed, AOP_ACQUIRE):    # acquire: an earlier close()
            return
        # seq_cst, both: the Dekker pair with call_soon_threadsafe (set _closed, then read
        # _inflight); acquire on the reads: the producers' appends and writes are done
        aop_store_u32(&self._closed, 1, AOP_SEQ_CST)
        if aop_load_u32(&self._inflight, AOP_SEQ_CST):
            with nogil:
                # acquire: pairs with each producer's release decrement, so its append
                # and eventfd write are complete before the fds below are closed
                while aop_load_u32(&self._inflight, AOP_ACQUIRE):
                    aop_yield()
        self._close_fds()
        leftover = len(self._ready)
        self._ready.clear()
        for t in self._timers:
            (<EpollTimer>t)._loop = None
        self._timers = []
        self._ncancelled = 0
        self._hooks.clear()
        n = len(self._rd)
        self._rd = [None] * n
        self._wr = [None] * n
        if leftover:
            log.debug("event loop closed with %d callbacks queued", leftover)
