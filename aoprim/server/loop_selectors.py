"""Layer 1 backend ``selectors``: the :class:`~aoprim.server.loop.EventLoop` interface in pure
Python on ``selectors.DefaultSelector`` (epoll on Linux), an eventfd wake-up (``os.eventfd``:
Linux) and a ``heapq`` timer heap.  It is the reference implementation of the contract, kept
independent of the compiled ``EpollCore`` on purpose (why: :mod:`aoprim.server.loop`).

Invariants:

- Only the loop thread touches the selector, the timer heap and the hook list.  The one
  thread-safe entry is :meth:`SelectorsLoop.call_soon_threadsafe` (and ``stop``, built on
  it): under ``_lock`` it checks ``_closed``, appends to a ``collections.deque`` and, unless
  a wake-up is already pending, writes to an eventfd.  ``close()`` sets ``_closed`` under
  the same lock before it closes the eventfd, so no write reaches an fd number reused since.
  The lock is re-entrant: a Python signal handler runs on the main
  thread between any two bytecodes, also inside one of that thread's own sections, and the
  server's SIGINT/SIGTERM handler calls ``call_soon_threadsafe``.
- No lost wake-up: ``_wake_pending`` is cleared (under ``_lock``) by the loop *before* it
  drains the deque, and by ``run_ready()``, so a callback appended after the drain always
  finds the flag clear and writes the eventfd again; and the loop never blocks while its
  deque is non-empty (it polls with a zero timeout).  It is also cleared in an iteration
  that finds the deque empty and the flag set: that iteration's wait may have read the
  eventfd write of a producer whose callback an earlier drain already ran (it appended
  between that drain's clear and its count) -- a set flag with nothing left to read would
  make every later producer skip its write while the loop sleeps.  So whenever the loop
  waits, either the flag is clear or an eventfd write is unread.  At worst a wake-up is
  spurious.
- Timers: a heap of :class:`_Timer` ordered by (when, seq).  The timer phase runs only the
  timers with ``seq`` at most the last one issued when the phase began (a timer scheduled by
  a timer waits for the next iteration).  Cancelled timers stay in the heap until popped, or
  until they are more than half of it (and more than 256): then the heap is rebuilt without
  them, so a server that arms and cancels a timer per session never grows it without bound.
- No reference cycle through the loop while it is idle: what it registers itself (the
  eventfd's drain) does not hold it, so an unclosed loop nobody references is freed -- and
  ``__del__`` closes its fds -- at once, not by the cyclic GC.  (Callers' callbacks, the
  hooks and pending timers may hold it; ``close()`` drops them all.)
- A wait lasts at most a day (:data:`_MAX_WAIT`, as in ``EpollCore``): an ``inf`` deadline
  or an empty heap does not overflow the selector's timeout.
"""
from __future__ import annotations

import collections
import functools
import heapq
import logging
import operator
import os
import select
import selectors
import signal
import threading
import time
from typing import Any, Callable

from .loop import EventLoop, FdCallback, Timer

__all__ = ["SelectorsLoop"]

log = logging.getLogger("aoprim.server")

_epoll_type = getattr(select, "epoll", ())
_EPOLLIN = getattr(select, "EPOLLIN", 1)     # the poll() result's event bits (epoll's)
_EPOLLOUT = getattr(select, "EPOLLOUT", 4)
_NOT_EPOLLIN = ~_EPOLLIN
_NOT_EPOLLOUT = ~_EPOLLOUT
_MAX_WAIT = 86400.0     # seconds: one wait never needs to be longer (as EpollCore's)
_MAX_EVENTS = 64        # ready fds taken per wait (more wait for the next one: epoll rotates)
_COMPACT_MIN = 256      # cancelled timers tolerated before a rebuild is considered
EVENT_READ = selectors.EVENT_READ
EVENT_WRITE = selectors.EVENT_WRITE


def _no_hook() -> None:
    pass


def _restore_wakeup_fd(old: int) -> None:
    """Put back the signal wake-up fd that was set before run(); if that fd was closed
    meanwhile (set_wakeup_fd refuses it: EBADF), set none and log it -- run()'s own pipe
    is closed either way, and is never left installed.  (EpollCore does the same.)"""
    try:
        signal.set_wakeup_fd(old)
    except (OSError, ValueError) as e:
        signal.set_wakeup_fd(-1)
        log.warning("event loop: could not put back the signal wake-up fd %d (%s); "
                    "none is set", old, e)


def _drain_eventfd(fd: int) -> None:
    """The wake-up eventfd's read callback: reset its counter."""
    try:
        os.eventfd_read(fd)
    except OSError:
        pass


def _as_double(x: Any) -> float:
    """``x`` as a float, by the rule of a C ``double`` argument (EpollCore's): a number
    (``__float__`` or ``__index__``), never a str or bytes as ``float()`` would take."""
    if isinstance(x, (str, bytes, bytearray)):
        raise TypeError(f"must be real number, not {type(x).__name__}")
    return float(x)


class _Timer(Timer):
    __slots__ = ("when", "seq", "callback", "args", "cancelled", "_loop")

    def __init__(self, when: float, seq: int, callback: Callable[..., object] | None,
                 args: tuple[Any, ...] | None, loop: SelectorsLoop | None) -> None:
        self.when = when
        self.seq = seq
        self.callback = callback
        self.args = args
        self.cancelled = False
        self._loop = loop           # None once popped from the heap

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        self.callback = self.args = None
        if self._loop is not None:
            self._loop._timer_cancelled()

    def __lt__(self, other: _Timer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)


class SelectorsLoop(EventLoop):
    """The ``selectors`` backend."""

    backend = "selectors"

    @property
    def own_fds(self) -> tuple[int, ...]:  # type: ignore[override]
        """The selector's fd (epoll on Linux; -1 for select/poll) and the wake-up eventfd."""
        if self._closed:
            return ()
        try:
            sel = self._sel.fileno()
        except (AttributeError, ValueError):    # (a selector without an fd)
            sel = -1
        return tuple(fd for fd in (sel, self.__dict__.get("_rfd", -1)) if fd >= 0)

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._timers: list[_Timer] = []    # heap of _Timer
        self._ncancelled = 0               # cancelled timers still in the heap
        self._seq = 0
        # (callback, args); appended from any thread
        self._ready: collections.deque[tuple[Callable[..., object], tuple[Any, ...]]] = \
            collections.deque()
        self._hooks: list[Callable[[], object]] = []
        self._hook: Callable[[], object] = _no_hook     # the hooks as one callable
        self._wake_pending = False
        # call_soon_threadsafe's section vs close() and the loop's clear of _wake_pending.
        # Re-entrant: a Python signal handler runs on the main thread between any two
        # bytecodes, also inside a `with self._lock:` of that thread, and the server's
        # handler calls call_soon_threadsafe -- with a plain Lock that acquire deadlocked.
        # Every section is consistent when another one nests in it on the same thread.
        self._lock = threading.RLock()
        self._sigfd = -1                   # the signal wake-up pipe while run() runs
        self._running = False
        self._stopping = False
        self._closed = False
        self.thread_id = None
        self.iterations = 0
        self.errors = 0                    # callbacks that raised (logged)
        # forked(end): what ends a process forked by a callback's code once it comes back
        self._fork_end: Callable[[str, BaseException | None], object] | None = None
        self._now = time.monotonic()
        self._cbs: dict[int, tuple[FdCallback, FdCallback]] = {}   # fd -> (read, write)
        try:
            # a failure (EMFILE, ENOSPC at max_user_watches) closes what was opened, as
            # EpollCore's dealloc does -- else it waited for the GC (the loop is in a cycle)
            self._wfd = self._rfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                # the drain is a partial over the fd number, not a bound method: the
                # loop's own table must not hold the loop (a cycle), or an unclosed loop
                # -- a Server never started -- kept both fds until the cyclic GC ran
                self.set_callbacks(self._rfd, functools.partial(_drain_eventfd, self._rfd),
                                   None)
            except BaseException:
                os.close(self._rfd)
                del self._rfd, self._wfd
                raise
        except BaseException:
            self._sel.close()
            self._closed = True
            raise

    # -- time and timers --------------------------------------------------------------
    def time(self) -> float:
        return self._now

    def clock(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> _Timer:
        if type(when) is not float:
            when = _as_double(when)
        if when != when:
            raise ValueError("a timer's deadline must not be NaN")
        self._seq += 1
        t = _Timer(when, self._seq, callback, args, self)
        heapq.heappush(self._timers, t)
        return t

    @property
    def pending_timers(self) -> int:
        return len(self._timers)

    def _timer_cancelled(self) -> None:
        self._ncancelled += 1
        n = self._ncancelled
        if n > _COMPACT_MIN and 2 * n > len(self._timers):
            live = [t for t in self._timers if not t.cancelled]
            for t in self._timers:
                if t.cancelled:
                    t._loop = None
            heapq.heapify(live)
            self._timers[:] = live
            self._ncancelled = 0

    # -- callbacks --------------------------------------------------------------------
    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        self._ready.append((callback, args))

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any) -> bool:
        item = (callback, args)
        # The closed test, the append and the eventfd write form one section under _lock,
        # and close() sets _closed under the same lock before it closes the eventfd: so a
        # producer either sees the loop closed and queues nothing, or finishes its write
        # before the fd is closed -- never writes into an fd number the process has since
        # reused (the epoll backend's _inflight count does the same).
        with self._lock:
            if self._closed:
                return False
            self._ready.append(item)
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    os.eventfd_write(self._wfd, 1)
                except BlockingIOError:
                    pass    # the counter is full: a wake-up is pending anyway
        return True

    def add_iteration_hook(self, hook: Callable[[], object]) -> None:
        self._hooks.append(hook)
        hooks = tuple(self._hooks)
        if len(hooks) == 1:
            self._hook = hook
        else:
            def run_hooks() -> None:
                for h in hooks:
                    try:
                        h()
                    except Exception as e:
                        self._report(h, e)
                    if self._fork_end is not None:
                        self._fork_end(f"loop callback {h!r}", None)
            self._hook = run_hooks

    # -- file descriptors -------------------------------------------------------------
    def set_callbacks(self, fd: int, on_read: FdCallback, on_write: FdCallback) -> None:
        if self._closed:
            raise RuntimeError("the event loop is closed")
        if type(fd) is not int:
            # an fd number, as EpollCore's C int: a socket object would be registered
            # with the selector under its fileno() but keyed here by the object -- never
            # dispatched, and reported ready by every wait
            fd = operator.index(fd)
        events = (EVENT_READ if on_read is not None else 0) | \
                 (EVENT_WRITE if on_write is not None else 0)
        cbs = self._cbs
        old = cbs.get(fd)
        if old is None:
            if events:
                self._sel.register(fd, events)
                cbs[fd] = (on_read, on_write)
            return
        if not events:
            del cbs[fd]
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError):
                # the selector dropped it already (a modify that failed on an fd closed
                # without remove() and reused): forgotten anyway, as EpollCore's DEL
                pass
            return
        if (old[0] is None) != (on_read is None) or (old[1] is None) != (on_write is None):
            self._sel.modify(fd, events)    # raises: the table keeps the old pair (EpollCore)
        cbs[fd] = (on_read, on_write)

    def reader_of(self, fd: int) -> FdCallback:
        return self._cbs.get(fd, (None, None))[0]

    def writer_of(self, fd: int) -> FdCallback:
        return self._cbs.get(fd, (None, None))[1]

    def remove(self, fd: int) -> None:
        if self._cbs.pop(fd, None) is not None:
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError):
                pass

    # -- running ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def stop(self) -> None:
        self.call_soon_threadsafe(self._set_stopping)

    def _set_stopping(self) -> None:
        self._stopping = True

    def forked(self, end: Callable[[str, BaseException | None], object]) -> None:
        self._fork_end = end

    def _report(self, cb: object, exc: BaseException) -> None:
        if self._fork_end is not None:
            self._fork_end(f"loop callback {cb!r}", exc)
        self.errors += 1
        log.error("event loop: callback %r raised; the loop goes on", cb, exc_info=exc)

    def run(self) -> None:
        if self._closed:
            raise RuntimeError("the event loop is closed")
        if self._running:
            raise RuntimeError("the event loop is already running")
        self._running = True
        self._stopping = False
        self.thread_id = threading.get_ident()
        self._now = time.monotonic()
        sig_r = sig_w = -1
        old = None
        if threading.current_thread() is threading.main_thread():
            # Signals: Python's C handler only sets a flag, so a signal that lands after the
            # last check and before the wait -- or on another thread -- would wait for the
            # next event (with no timer: a day).  Its wake-up fd closes that
            # window: the handler also writes a byte to a pipe the loop watches, the wait
            # returns and the interpreter runs the Python handler on this thread.
            sig_r, sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                old = signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
                self.set_callbacks(sig_r, self._drain_sigfd, None)
            except BaseException:
                if old is not None:
                    signal.set_wakeup_fd(old)
                os.close(sig_r)
                os.close(sig_w)
                self._running = False
                raise
            self._sigfd = sig_r
        try:
            self._run()
        finally:
            self._running = False
            if sig_r >= 0:
                self._sigfd = -1
                _restore_wakeup_fd(old)
                self.remove(sig_r)
                os.close(sig_r)
                os.close(sig_w)

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # an unclosed loop freed (by refcount when idle, else by the GC): the eventfd is a
        # bare int nobody else
        # closes, and the selector's epoll fd was seen to outlive a collected loop -- close
        # both, as EpollCore's dealloc does.  No producer can be inside
        # call_soon_threadsafe: it would hold a reference to the loop.
        fd = self.__dict__.get("_rfd", -1)
        if fd >= 0 and not self._closed:
            self._closed = True
            try:
                self._sel.close()
            except Exception:
                pass
            try:
                _close(fd)
            except OSError:
                pass

    def _drain_sigfd(self) -> None:
        try:
            while len(os.read(self._sigfd, 64)) == 64:
                pass
        except OSError:
            pass        # empty (EAGAIN)

    def _run(self) -> None:
        cbs = self._cbs
        poll = self._poller()
        ready = self._ready
        lock = self._lock
        timers = self._timers
        monotonic = time.monotonic
        heappop = heapq.heappop
        NOT_OUT = _NOT_EPOLLOUT
        NOT_IN = _NOT_EPOLLIN
        it = self.iterations
        now = self._now
        while not self._stopping:
            # The wait ends at the earliest timer, measured from `now` (taken after the
            # previous wait): a timer may fire late by one iteration's callback time.
            if ready:
                timeout: float = 0
            elif timers:
                timeout = timers[0].when - now
                if timeout < 0:
                    timeout = 0
                elif timeout > _MAX_WAIT:
                    timeout = _MAX_WAIT
            else:
                timeout = _MAX_WAIT
            events = poll(timeout, _MAX_EVENTS)
            self._now = now = monotonic()
            it += 1
            self.iterations = it
            for fd, ev in events:
                if self._fork_end is not None:  # the previous callback forked, returned
                    self._fork_end("a readiness callback", None)
                try:
                    rcb, wcb = cbs[fd]
                except KeyError:    # removed by an earlier callback of this batch
                    continue
                try:        # zero-cost unless something raises (3.11)
                    if wcb is None:
                        # registered for reading only: epoll reports IN, HUP or ERR -- all
                        # of which the read callback handles (it sees EOF or the error)
                        rcb()
                        continue
                    if ev & NOT_OUT and rcb is not None:
                        rcb()
                        # re-read: the read callback may have dropped or replaced the
                        # writer, or forgotten the fd (a session closing) -- the old
                        # writer must not run on it
                        wcb = cbs.get(fd, (None, None))[1]
                        if wcb is None:
                            continue
                    if ev & NOT_IN:
                        wcb()
                except Exception as e:
                    self._report(cbs.get(fd), e)
            if self._fork_end is not None:
                self._fork_end("a readiness callback", None)
            # drop the last callbacks' references: a closed session must not be kept
            # alive by a loop-local variable until the next event
            rcb = wcb = None
            if timers and timers[0].when <= now:
                limit = self._seq       # timers scheduled from here on wait a round
                while timers:
                    t = timers[0]
                    if t.when > now or t.seq > limit:
                        break
                    heappop(timers)
                    t._loop = None
                    if t.cancelled:
                        self._ncancelled -= 1
                        continue
                    try:
                        t.callback(*t.args)
                    except Exception as e:
                        self._report(t.callback, e)
                    if self._fork_end is not None:
                        self._fork_end(f"loop callback {t.callback!r}", None)
                t = None
            if ready or self._wake_pending:
                # cleared before draining: a later call_soon_threadsafe writes again.  Under
                # the producers' lock, so the clear and their append-then-test are ordered
                # without relying on the GIL (a free-threaded build).  Cleared with the deque
                # empty too: this iteration's wait may have read the write of a producer
                # whose callback was drained already (the invariants above).  The unlocked
                # test sees a flag set before an eventfd write this thread has read (the
                # write and the read are syscalls: ordered by the kernel)
                with lock:
                    self._wake_pending = False
                for _ in range(len(ready)):
                    cb, args = ready.popleft()
                    try:
                        cb(*args)
                    except Exception as e:
                        self._report(cb, e)
                    if self._fork_end is not None:
                        self._fork_end(f"loop callback {cb!r}", None)
                cb = args = None
            try:
                self._hook()
            except Exception as e:
                self._report(self._hook, e)
            if self._fork_end is not None:      # (a flush's resume_writing that forked)
                self._fork_end(f"loop callback {self._hook!r}", None)

    def _poller(self) -> Callable[[float, int], list[tuple[int, int]]]:
        """``poll(timeout_seconds, maxevents) -> [(fd, epoll_event_mask)]``: the selector's
        own epoll object (DefaultSelector.select() builds a (key, events) tuple per ready fd
        in Python, ~0.35 us per event).  Registrations stay the selector's; only the wait
        goes straight to its epoll object.  Elsewhere an adapter over select()."""
        sel = self._sel
        ep = getattr(sel, "_selector", None)
        if isinstance(ep, _epoll_type):
            return ep.poll      # type: ignore[no-any-return]  # (select.epoll's)
        sel_select = sel.select

        # (other platforms)
        def poll(timeout: float, maxevents: int) -> list[tuple[int, int]]:  # pragma: no cover
            return [(key.fd, (_EPOLLIN if mask & EVENT_READ else 0) |
                     (_EPOLLOUT if mask & EVENT_WRITE else 0))
                    for key, mask in sel_select(timeout)]
        return poll

    def run_ready(self) -> None:
        if self._running:
            raise RuntimeError("run_ready() is for a stopped loop")
        ready = self._ready
        # cleared before draining, as in the loop's callback phase: left set, every later
        # call_soon_threadsafe -- stop() included -- would skip the eventfd write and the
        # next run() sleep
        with self._lock:
            self._wake_pending = False
        while ready:
            cb, args = ready.popleft()
            try:
                cb(*args)
            except Exception as e:
                self._report(cb, e)

    def close(self) -> None:
        if self._running:
            raise RuntimeError("cannot close a running event loop")
        if self._closed:
            return
        with self._lock:        # waits for a producer inside call_soon_threadsafe
            self._closed = True
        self._sel.close()
        os.close(self._rfd)
        self._cbs.clear()       # remove() is a no-op now, reader_of()/writer_of() None
        leftover = list(self._ready)
        self._ready.clear()
        self._timers.clear()
        self._hooks.clear()
        self._hook = _no_hook
        if leftover:
            log.debug("event loop closed with %d callbacks queued", len(leftover))
