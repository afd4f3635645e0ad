"""Layer 1 -- the event loop interface (the OS layer), written down in one place.

Layer 2 (sessions, listener, dispatch, flush) uses a loop only through the methods of
:class:`EventLoop` below.  A backend is a subclass that implements them; two ship:

- ``selectors`` (:mod:`aoprim.server.loop_selectors`, the default): pure Python over
  ``selectors.DefaultSelector`` and an eventfd -- readable, the reference;
- ``epoll`` (:mod:`aoprim.server.loop_epoll`, Linux): the same contract with the iteration
  compiled (:class:`aoprim.server._eloop.EpollCore`) -- the wait, the per-fd dispatch, the
  timer heap and the hooks run in C, so Layer 1 adds no bytecode to a read burst.

**Two implementations, on purpose.**  Both write the whole contract --
timer heap, cancellation and compaction, the wake-up protocol, ``run_ready``, ``close``, the
signal wake-up fd -- once each; only the wait and the dispatch differ in kind.  The selectors
backend does *not* become a thin "portable fallback" over the compiled core's heap, queue and
wake-up, because: (1) there is nothing to fall back to -- aoprim is Linux-only, and on Linux
``DefaultSelector`` *is* epoll (both backends also need ``eventfd``), so a shared core would
leave one implementation with two names; (2) its independence is what makes it useful: it
is the readable statement of the contract, and :file:`tests/server/test_loop_differential.py` runs
random schedules on both and demands identical traces -- an oracle only while the two do not
share the code under test (the defects it exists to catch are in one backend only -- say, a
stale writer called after its read callback dropped it, or a deadlock of a non-reentrant
lock under a signal handler; a shared core would put any such bug in both, where no
differential test sees it); (3) the public contract names it the default, pure-Python
backend.  What keeps two implementations from
drifting is this docstring (the one contract), :file:`tests/server/test_loop.py` (every contract
test on every backend) and the differential test (hypothesis; a short run in CI).  The cost
is the selectors backend's CPU per message (docs/server.md gives the measured ratios).

A further backend (say, io_uring) implements the same methods and joins :data:`BACKENDS`
(and :func:`aoprim.server.backends.create_loop`, which makes a loop of a named backend);
Layers 2 and 3 do not change.

The contract every backend keeps:

- **One loop thread.**  :meth:`EventLoop.run` runs on one thread (``thread_id`` while it
  runs).  Every method is for that thread only, except :meth:`call_soon_threadsafe` and
  :meth:`stop`, which any thread may call.
- **An iteration** is: wait for readiness (no longer than the earliest timer, not at all
  while callbacks are queued) -> run the readiness callbacks -> run the timers that were due
  when the phase began and were scheduled *before* it (a timer that schedules another for
  "now" runs it in the next iteration, never in the same pass: no livelock) -> run the
  callbacks queued so far (ones queued while they run wait for the next iteration) -> run the
  per-iteration hooks (Layer 2 flushes every dirty send batch there: one syscall per session
  per read burst).
- **Readiness is level-triggered**: a read callback that leaves data unread is called again
  next iteration.  A callback may change any registration, its own included.
- **Isolation**: an exception escaping one callback, timer or hook is logged (logger
  ``aoprim.server``) and the loop goes on with the next one, as asyncio does; it never ends
  :meth:`run`.  ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) does end it.
- **Thread-safe wake-up**: a callback queued with :meth:`call_soon_threadsafe` runs in the
  next iteration at the latest, also when the loop is waiting without a timeout.  Once the
  loop is closed, :meth:`call_soon_threadsafe` returns ``False`` and queues nothing (the
  caller still owns whatever it meant to hand over); otherwise it returns ``True``.
- **Time**: :meth:`time` is the monotonic clock, cached once per iteration.
- **Deadlines**: a timer's deadline (``call_at``) or delay (``call_later``) is a float.  NaN
  raises ``ValueError`` on both (asyncio accepts it, but NaN compares false with every
  deadline: one backend ran it at once, the other parked it on top of the heap, where no
  later timer ever fired again).  A deadline in the past or a negative delay (``-inf``
  included) runs in the next timer phase, like 0; ``inf`` never fires (the timer stays in
  :attr:`pending_timers` until cancelled).  Timers with equal deadlines run in the order
  they were scheduled.
- **Signals**: while :meth:`run` runs on the main thread, it sets Python's signal wake-up fd
  to a pipe it watches (the previous one is back when it returns): a signal that arrives
  just before the wait, or is delivered to another thread, wakes the loop at once and its
  Python handler runs on the loop's thread (if the previous fd was closed meanwhile, none is
  set back, and that is logged).  A handler that raises ``KeyboardInterrupt`` or
  ``SystemExit`` ends :meth:`run`; where an ``Exception`` from a handler surfaces (inside a
  callback, reported like its own; or from the wait, ending :meth:`run`) depends on which
  bytecode the interpreter was at -- do not rely on it.

This module knows nothing about sockets, sessions or frames.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional

#: a readiness callback (None: not interested)
FdCallback = Optional[Callable[[], object]]

__all__ = ["EventLoop", "Timer", "BACKENDS", "BackendUnavailable"]

#: the backends this build accepts (``backend=`` / ``--backend``)
BACKENDS = ("selectors", "epoll")


class BackendUnavailable(RuntimeError):
    """The requested Layer 1 backend cannot run here."""


class Timer(abc.ABC):
    """What :meth:`EventLoop.call_at` returns."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Do not run the callback (loop thread; harmless after it ran, and twice).  Not for
        other threads -- it may rebuild the loop's heap under a running timer phase: from
        there, ``loop.call_soon_threadsafe(timer.cancel)``."""

    when: float


class EventLoop(abc.ABC):
    """The Layer 1 interface.  See the module docstring for the contract."""

    #: the backend's name, one of BACKENDS
    backend: str | None = None
    #: the thread running run(), or None
    thread_id: int | None = None
    #: iterations completed (a statistic)
    iterations: int = 0
    #: the fds the loop itself opened (its epoll instance, its wake-up eventfd): what a
    #: process forked from the serving one must not act on (the server hides them there)
    own_fds: tuple[int, ...] = ()

    # -- file descriptors (loop thread) -----------------------------------------------
    @abc.abstractmethod
    def set_callbacks(self, fd: int, on_read: FdCallback, on_write: FdCallback) -> None:
        """Register ``fd``'s readiness callbacks at once (``None`` = not interested; both
        ``None`` unregisters).  Replacing a callback with another costs no syscall.  On a
        closed loop: ``RuntimeError`` (``remove`` is then a no-op)."""

    def add_reader(self, fd: int, callback: Callable[[], object]) -> None:
        self.set_callbacks(fd, callback, self.writer_of(fd))

    def remove_reader(self, fd: int) -> None:
        self.set_callbacks(fd, None, self.writer_of(fd))

    def add_writer(self, fd: int, callback: Callable[[], object]) -> None:
        self.set_callbacks(fd, self.reader_of(fd), callback)

    def remove_writer(self, fd: int) -> None:
        self.set_callbacks(fd, self.reader_of(fd), None)

    @abc.abstractmethod
    def reader_of(self, fd: int) -> FdCallback:
        """The read callback registered for ``fd``, or None."""

    @abc.abstractmethod
    def writer_of(self, fd: int) -> FdCallback:
        """The write callback registered for ``fd``, or None."""

    @abc.abstractmethod
    def remove(self, fd: int) -> None:
        """Forget ``fd`` entirely (call before closing it)."""

    # -- callbacks and timers ---------------------------------------------------------
    @abc.abstractmethod
    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        """Run ``callback(*args)`` in this or the next callback phase (loop thread)."""

    @abc.abstractmethod
    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any) -> bool:
        """``call_soon`` from any thread; wakes the loop.  False once the loop is closed."""

    @abc.abstractmethod
    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer:
        """Run ``callback(*args)`` once :meth:`time` reaches ``when``; returns a Timer.
        ``when`` is a float; NaN raises ``ValueError``."""

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        """``call_at(clock() + delay)``; a negative delay counts as 0, NaN raises
        ``ValueError``, ``inf`` never fires."""
        if isinstance(delay, (str, bytes, bytearray)):     # float() would parse them
            raise TypeError(f"must be real number, not {type(delay).__name__}")
        delay = float(delay)
        if delay != delay:
            raise ValueError("a timer's delay must not be NaN")
        return self.call_at(self.clock() + (delay if delay > 0.0 else 0.0), callback, *args)

    @abc.abstractmethod
    def time(self) -> float:
        """The monotonic time cached at the start of this iteration."""

    @abc.abstractmethod
    def clock(self) -> float:
        """The monotonic time now (not cached)."""

    @abc.abstractmethod
    def add_iteration_hook(self, hook: Callable[[], object]) -> None:
        """``hook()`` runs at the end of every iteration; several run in the order added."""

    @property
    @abc.abstractmethod
    def pending_timers(self) -> int:
        """Timers scheduled and not yet run, cancelled ones included until compacted."""

    # -- running ----------------------------------------------------------------------
    @abc.abstractmethod
    def run(self) -> None:
        """Run iterations until :meth:`stop` (loop thread)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Make :meth:`run` return after the current iteration (any thread)."""

    @abc.abstractmethod
    def run_ready(self) -> None:
        """Run the queued callbacks now, after :meth:`run` returned (clean-up)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's resources (after :meth:`run` returned); idempotent."""

    @abc.abstractmethod
    def forked(self, end: Callable[[str, BaseException | None], object]) -> None:
        """In a process forked by code a callback ran (the server calls it in the child,
        at the fork): from then on a callback of any kind (readiness, timer, ``call_soon``,
        iteration hook) that returns calls ``end(where, None)``, one that raises
        ``end(where, exc)`` -- and ``end`` ends the process: nothing more of the parent's
        loop runs there."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` ran."""

    def in_loop_thread(self) -> bool:
        import threading
        return threading.get_ident() == self.thread_id
