"""Layer 1 -- the event loop (the OS layer).

One thread runs :meth:`EventLoop.run`.  Each iteration:

1. wait for readiness (``selectors.DefaultSelector`` -- epoll on Linux) until the earliest
   timer is due, or without blocking when callbacks are queued;
2. run the readiness callbacks of the ready file descriptors;
3. run the timers that are due (a binary heap of :class:`Timer`, cancelled ones are skipped);
4. run the callbacks queued with :meth:`call_soon` / :meth:`call_soon_threadsafe`;
5. run the end-of-iteration hooks (:meth:`add_iteration_hook`) -- the session layer flushes
   its dirty list there, so every reply produced by one read burst leaves in one syscall.

Invariants:

- Only the loop thread touches the selector, the timer heap and the hook list.  The one
  thread-safe entry is :meth:`call_soon_threadsafe` (and :meth:`stop`, built on it): it
  appends to a ``collections.deque`` (atomic append) and, unless a wake-up is already
  pending, writes to an eventfd (a self-pipe where eventfd is missing).  The flag
  ``_wake_pending`` is cleared by the loop *before* it drains the deque, so a callback
  appended after the drain always finds the flag clear and writes the eventfd again; and
  the loop never blocks while its deque is non-empty (it polls with a zero timeout), so a
  callback appended between the clear and the drain runs in the next iteration at the
  latest: no wake-up is lost (at worst one is spurious).
- ``time()`` is the monotonic clock cached once per iteration (cheap timestamps for the
  session layer's idle/frame timeouts).
- The backend is swappable: ``backend="selectors"`` (default); ``"uring"`` raises
  :class:`BackendUnavailable` (no io_uring backend ships in this version); ``"auto"`` picks the
  best available backend, i.e. selectors.

This module knows nothing about sockets, sessions or frames.
"""
import collections
import heapq
import os
import select
import selectors
import threading
import time

__all__ = ["EventLoop", "Timer", "BackendUnavailable", "BACKENDS", "EVENT_READ", "EVENT_WRITE"]

BACKENDS = ("selectors", "uring", "auto")
_epoll_type = getattr(select, "epoll", ())
_EPOLLIN = getattr(select, "EPOLLIN", 1)     # the poll() result's event bits (epoll's)
_EPOLLOUT = getattr(select, "EPOLLOUT", 4)
_NOT_EPOLLIN = ~_EPOLLIN
_NOT_EPOLLOUT = ~_EPOLLOUT
_FAR = 1e6              # seconds: the sentinel timer's distance (see run())
_MAX_EVENTS = 64        # ready fds taken per wait (more wait for the next one: epoll rotates)
EVENT_READ = selectors.EVENT_READ
EVENT_WRITE = selectors.EVENT_WRITE


def _no_hook():
    pass


class BackendUnavailable(RuntimeError):
    """The requested Layer 1 backend cannot run here."""


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "uring":
        kernel = ""
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                v = f.read().strip()
            if v != "0":
                kernel = f"; besides, this kernel disables it (kernel.io_uring_disabled={v})"
        except OSError:
            pass
        raise BackendUnavailable(
            "the io_uring backend is unavailable: this version of aoprim ships no io_uring "
            "implementation (the Python standard library has no io_uring binding, and Layer 1 "
            f"is pure Python on selectors){kernel}; use backend='selectors' or 'auto'")
    return "selectors"   # "auto": io_uring is never available in this version


class Timer:
    """A scheduled callback; ``cancel()`` it any time before it runs (loop thread only)."""

    __slots__ = ("when", "seq", "callback", "args", "cancelled")

    def __init__(self, when, seq, callback, args):
        self.when = when
        self.seq = seq
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    def __lt__(self, other):
        return (self.when, self.seq) < (other.when, other.seq)


class EventLoop:
    """A minimal readiness loop: fd callbacks, timers, thread-safe wake-up."""

    def __init__(self, backend="selectors"):
        self.backend = _check_backend(backend)
        self._sel = selectors.DefaultSelector()
        self._timers = []                 # heap of Timer
        self._seq = 0
        self._ready = collections.deque()  # (callback, args); appended from any thread
        self._hooks = []                  # end-of-iteration callbacks (loop thread)
        self._hook = _no_hook             # ... as one callable (the hook, or a runner)
        self._wake_pending = False
        self._running = False
        self._stopping = False
        self._closed = False
        self.thread_id = None
        self.iterations = 0
        self.now = time.monotonic()
        # the wake-up channel: eventfd (one fd, 8-byte counter) or a self-pipe
        if hasattr(os, "eventfd"):
            self._wfd = self._rfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:   # pragma: no cover - Linux has eventfd
            self._rfd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._cbs = {}                    # fd -> (read callback, write callback)
        self.set_callbacks(self._rfd, self._drain_wakeup, None)

    # -- time and timers (loop thread) --------------------------------------------------
    def time(self):
        """The monotonic time cached at the start of this iteration."""
        return self.now

    def call_later(self, delay, callback, *args):
        return self.call_at(time.monotonic() + max(0.0, delay), callback, *args)

    def call_at(self, when, callback, *args):
        self._seq += 1
        t = Timer(when, self._seq, callback, args)
        heapq.heappush(self._timers, t)
        return t

    # -- callbacks ----------------------------------------------------------------------
    def call_soon(self, callback, *args):
        """Run ``callback(*args)`` in this iteration's callback phase (loop thread)."""
        self._ready.append((callback, args))

    def call_soon_threadsafe(self, callback, *args):
        """Like call_soon, from any thread; wakes the loop if it is waiting."""
        self._ready.append((callback, args))
        if not self._wake_pending and not self._closed:
            self._wake_pending = True
            self._write_wakeup()

    def in_loop_thread(self):
        return threading.get_ident() == self.thread_id

    def _write_wakeup(self):
        try:
            if self._wfd == self._rfd:
                os.eventfd_write(self._wfd, 1)
            else:   # pragma: no cover
                os.write(self._wfd, b"\0")
        except (BlockingIOError, OSError):
            pass   # counter/pipe full or loop closed: a wake-up is pending anyway

    def _drain_wakeup(self):
        try:
            if self._wfd == self._rfd:
                os.eventfd_read(self._rfd)
            else:   # pragma: no cover
                while os.read(self._rfd, 4096):
                    pass
        except (BlockingIOError, OSError):
            pass

    def add_iteration_hook(self, hook):
        """``hook()`` runs at the end of every iteration (loop thread); several hooks run in
        the order they were added."""
        self._hooks.append(hook)
        hooks = tuple(self._hooks)
        if len(hooks) == 1:
            self._hook = hook
        else:
            def run_hooks():
                for h in hooks:
                    h()
            self._hook = run_hooks

    # -- file descriptors (loop thread) -------------------------------------------------
    def add_reader(self, fd, callback):
        self._update(fd, 0, callback)

    def add_writer(self, fd, callback):
        self._update(fd, 1, callback)

    def remove_reader(self, fd):
        self._update(fd, 0, None)

    def remove_writer(self, fd):
        self._update(fd, 1, None)

    def set_callbacks(self, fd, on_read, on_write):
        """Set both readiness callbacks of ``fd`` at once (None = not interested)."""
        events = (EVENT_READ if on_read is not None else 0) | \
                 (EVENT_WRITE if on_write is not None else 0)
        cbs = self._cbs
        if fd not in cbs:
            if events:
                self._sel.register(fd, events)
                cbs[fd] = (on_read, on_write)
            return
        if not events:
            self._sel.unregister(fd)
            del cbs[fd]
            return
        old = cbs[fd]
        cbs[fd] = (on_read, on_write)
        if (old[0] is None) != (on_read is None) or (old[1] is None) != (on_write is None):
            self._sel.modify(fd, events)

    def _update(self, fd, which, callback):
        cbs = list(self._cbs.get(fd, (None, None)))
        cbs[which] = callback
        self.set_callbacks(fd, cbs[0], cbs[1])

    def remove(self, fd):
        """Forget ``fd`` entirely (before closing it)."""
        if self._cbs.pop(fd, None) is not None:
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError):
                pass

    # -- running ------------------------------------------------------------------------
    def stop(self):
        """Make :meth:`run` return after the current iteration (any thread)."""
        self.call_soon_threadsafe(self._set_stopping)

    def _set_stopping(self):
        self._stopping = True

    def run(self):
        if self._closed:
            raise RuntimeError("the event loop is closed")
        if self._running:
            raise RuntimeError("the event loop is already running")
        self._running = True
        self._stopping = False
        self.thread_id = threading.get_ident()
        self.now = time.monotonic()
        # A far-away timer that re-arms itself keeps the heap non-empty, so the wait below
        # needs no "any timers?" test; 10**6 s keeps epoll's millisecond timeout in an int.
        sentinel = self.call_at(self.now + _FAR, self._rearm_sentinel)
        try:
            self._run()
        finally:
            sentinel.cancel()
            self._running = False

    def _rearm_sentinel(self):
        self.call_at(self.now + _FAR, self._rearm_sentinel)

    def _run(self):
        cbs = self._cbs
        poll = self._poller()
        ready = self._ready
        timers = self._timers
        monotonic = time.monotonic
        heappop = heapq.heappop
        NOT_OUT = _NOT_EPOLLOUT
        NOT_IN = _NOT_EPOLLIN
        it = self.iterations
        now = self.now
        while not self._stopping:
            # The wait ends at the earliest timer.  It is measured from `now` (taken after
            # the previous wait), so a timer may fire late by one iteration's callback time.
            # A timer added during this iteration is seen by the next one.
            due = timers[0].when
            if ready:
                timeout = 0
            else:
                timeout = due - now
                if timeout < 0:
                    timeout = 0
            events = poll(timeout, _MAX_EVENTS)
            self.now = now = monotonic()
            it += 1
            self.iterations = it
            for fd, ev in events:
                try:
                    rcb, wcb = cbs[fd]
                except KeyError:    # removed by an earlier callback of this batch
                    continue
                if wcb is None:
                    # registered for reading only: epoll reports IN, HUP or ERR -- all of
                    # which the read callback handles (it sees EOF or the error).  (An OUT
                    # left over from a writer that an earlier callback of this batch removed
                    # costs one read that finds nothing.)
                    rcb()
                    continue
                if ev & NOT_OUT and rcb is not None:
                    rcb()
                if ev & NOT_IN:
                    wcb()
            if due <= now:
                while timers[0].when <= now:
                    t = heappop(timers)
                    if not t.cancelled:
                        t.callback(*t.args)
            if ready:
                # cleared before draining: a later call_soon_threadsafe writes again
                self._wake_pending = False
                for _ in range(len(ready)):
                    cb, args = ready.popleft()
                    cb(*args)
            self._hook()

    def _poller(self):
        """``poll(timeout_seconds, maxevents) -> [(fd, epoll_event_mask)]``.  On Linux the
        selector's own epoll object: DefaultSelector.select() builds a (key, events) tuple
        per ready fd in Python -- about 0.35 us per event, measured.  The registrations stay
        the selector's (public register/modify/unregister); only the wait goes straight to
        its epoll object.  Elsewhere an adapter over select() with the same result shape."""
        sel = self._sel
        ep = getattr(sel, "_selector", None)
        if isinstance(ep, _epoll_type):
            return ep.poll
        sel_select = sel.select

        def poll(timeout, maxevents):   # pragma: no cover - other platforms
            return [(key.fd, (_EPOLLIN if mask & EVENT_READ else 0) |
                     (_EPOLLOUT if mask & EVENT_WRITE else 0))
                    for key, mask in sel_select(timeout)]
        return poll

    def run_ready(self):
        """Run the queued callbacks now (after run() returned; used for clean-up)."""
        if self._running:
            raise RuntimeError("run_ready() is for a stopped loop")
        ready = self._ready
        while ready:
            cb, args = ready.popleft()
            cb(*args)

    def close(self):
        """Release the selector and the wake-up fd (after run() returned)."""
        if self._running:
            raise RuntimeError("cannot close a running event loop")
        if self._closed:
            return
        self._closed = True
        self._sel.close()
        os.close(self._rfd)
        if self._wfd != self._rfd:   # pragma: no cover
            os.close(self._wfd)
        self._ready.clear()
        self._timers.clear()
        self._hooks.clear()
        self._hook = _no_hook
