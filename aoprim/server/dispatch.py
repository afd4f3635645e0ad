"""Layer 2 -- dispatch: who runs ``on_read``.

- :class:`InlineDispatch` (``workers=0``): the loop thread, called straight from the
  compiled receiver; a frame is a view of pooled memory, valid during the call.
- :class:`WorkerDispatch` (``workers=N``): N threads in the IOCP shape
  (:class:`~aoprim.server.workers.WorkerPool` over an ``MPMCQueue``).  A frame is a ``bytes``
  copy (nothing pooled outlives the read that produced it).  Rules:

  * per-session order: a session's items (frames, then its EOF and close marks) go to its own
    backlog; the session is in the completion queue at most once at a time, and the worker
    that takes it drains its backlog alone before letting go (``SpinLock``-guarded flag,
    held for a few bytecodes, never while dropping a reference);
  * a backlog of ``worker_backlog`` frames pauses the session's reading; it resumes once the
    worker has brought it down to a quarter.  The pause takes effect between two frames: the
    compiled receiver delivers no further frame of the bytes it already read (they stay in
    its buffer until reading resumes), so the backlog stays at the limit (plus at most the
    session's EOF and close marks), however many frames one read brought;
  * a session closed from its worker (a hook raised, ``close()``, ``abort()``) gets no more
    ``on_read``: the frames still queued for it are dropped (likewise after any close the
    application or the server decided); a stream that failed under it (a reset) does not
    drop them: they were read before the error, and asyncio delivers those too;
  * the loop thread never blocks on a full completion queue: a session that does not fit
    waits in an overflow list that the loop retries at the end of every iteration;
  * every queued item holds one reference of the session's ``RefCount``, dropped after it ran;
  * at the server's shutdown each session closes once its worker has run what was queued for
    it (a mark travels behind its frames), so its ``on_close`` runs on a worker too; the
    completion queue closes after the last ``on_close``.

Which exceptions from a hook leave the thread that ran it, instead of closing that session
only (:meth:`WorkerDispatch.propagates`): with workers, only a ``KeyboardInterrupt`` raised on
the main thread; inline (``workers=0``), every ``BaseException`` that is not an
``Exception``; in a process forked from the server's (a handler's ``os.fork()``), every one of
those, on any thread: ``sys.exit()`` in the fork ends the fork, as in a plain thread, and the
fork never serves on.

A fork that does not end itself never serves on either: when handler code running in a
process it forked comes back into the server -- a hook returns or raises, a loop callback
returns -- :func:`fork_returned` ends that process there (:func:`end_fork`: ``os._exit``
after a bounded flush of stdout and stderr), before the server does anything more in it (no
further frame, no flush, no close: the connections are the parent's).  The check costs no
system call: a dispatch compares the count of forks an ``os.register_at_fork`` hook keeps
with the count it saw when the server started (``_ForkAware``; the compiled receiver keeps
its own count, for its per-frame check).
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from aoprim import Closed, Full, SpinLock

from .workers import AT_THREAD_LIMIT, ServerThread, ThreadLimitError, WorkerPool

if TYPE_CHECKING:
    from .config import Settings
    from .handler import Handler
    from .loop import EventLoop
    from .session import Session

#: a receiver's frame callback: (session, frame)
FrameCallback = Callable[[Any, Any], object]

__all__ = ["InlineDispatch", "WorkerDispatch", "WorkState", "ServerThread", "ThreadLimitError",
           "AT_THREAD_LIMIT", "EOF_MARK", "CLOSE_MARK", "SHUTDOWN_MARK"]

log = logging.getLogger("aoprim.server")

# forks of this process so far, counted in each child (os.register_at_fork)
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)

# forks this process made (os.fork, a fork multiprocessing worker; counted in the parent):
# a session that sees it moved since its accept may share its socket with a fork
_forks_made = 0


def _count_fork_made() -> None:
    global _forks_made
    _forks_made += 1


os.register_at_fork(after_in_parent=_count_fork_made)


def forks_made() -> int:
    """How many times this process has forked (the parent's count: see _count_fork_made)."""
    return _forks_made


def fork_returned(where: str, exc: BaseException | None = None,
                  logged: bool = False) -> NoReturn:
    """Handler code forked this process and came back into the server (``where``: the hook
    that returned or raised, or the loop callback that returned): end the process here --
    status 0 after a return (logged as a WARNING: a fork should end itself), 1 after an
    exception (logged with its traceback, unless ``logged``: the asyncio adapter's
    exception handler did), the status a ``SystemExit`` asks for after ``sys.exit()`` (as
    the interpreter's exit gives it: None 0, an int itself, anything else printed to
    stderr and 1) -- on any thread, the loop's and a worker's too.  Nothing of the server
    runs on in it: nothing is sent, nothing of the parent's is shut down."""
    if exc is None:
        log.warning("process %d, forked by handler code, returned into the server from %s: "
                    "it ends here (a fork should end itself: os._exit())", os.getpid(), where)
        end_fork(0)
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            end_fork(0)
        if isinstance(code, int):
            end_fork(_exit_status(code))
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        end_fork(1)
    log.error("process %d, forked by handler code: %s raised%s; the fork ends", os.getpid(),
              where, " (logged above)" if logged else "", exc_info=None if logged else exc)
    # an uncaught KeyboardInterrupt ends plain Python by SIGINT's default action (status
    # -SIGINT to a waitpid(), 130 to a shell), so a caller can tell it from a failure
    if isinstance(exc, KeyboardInterrupt):
        end_fork(128 + signal.SIGINT, signal.SIGINT)    # (128 + SIGINT: CPython's fallback)
    end_fork(1)


def _exit_status(code: int) -> int:
    """``sys.exit(code)``'s status as the interpreter gives it: the code read as a C long
    (anything beyond it is -1) and cast to a C int; the kernel keeps its low 8 bits."""
    if not -2**63 <= code < 2**63:
        return -1
    return ((code & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def end_fork(status: int, signum: int | None = None) -> NoReturn:
    """End this process, a fork of the serving one, with ``status``: stdout and stderr are
    flushed first (log records are written as they are made), then ``os._exit()`` -- as
    multiprocessing ends the processes it forks.  Not the interpreter's exit: that would
    run the atexit handlers the fork inherited from its parent, and multiprocessing's
    terminates every Pool worker the parent started (the fork takes them for its own),
    losing the parent's tasks; nor ``logging.shutdown()``, which would write a buffering
    handler's copy of the parent's records again.  The flush runs on a thread of its own,
    waited for one second at most: a stream's lock may be held by a thread of the parent
    (blocked on a full pipe), which does not exist in the fork and never lets it go.
    ``signum``: end by that signal's default action instead (``status`` if it returns)."""
    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
    try:
        t = threading.Thread(target=flush, name="aoprim-fork-exit", daemon=True)
        t.start()
        t.join(1.0)
    except Exception:           # (no thread can start: the streams stay unflushed)
        pass
    if signum is not None:
        try:
            signal.signal(signum, signal.SIG_DFL)      # (raises off the main thread)
        except ValueError:
            pass
        try:
            # this thread, with the signal let through: its default action ends the process
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            signal.pthread_kill(threading.get_ident(), signum)
        except OSError:
            pass
    os._exit(status)

EOF_MARK = object()     # (EOF_MARK, reason, ...): close once the frames before it ran
CLOSE_MARK = object()   # run on_close, after every on_read
SHUTDOWN_MARK = object()    # the server's shutdown: close once the frames before it ran


class _ForkAware:
    """What both dispatches know of forks: whether this is a process handler code forked
    from the serving one (the fork count moved since the dispatch was made, in the serving
    process's start), and the end of such a fork once a hook returned into the server."""

    def __init__(self) -> None:
        self._forks = _forks

    def in_fork(self) -> bool:
        """True in a process forked from the server's (by handler code)."""
        return _forks != self._forks

    def returned(self, where: str) -> None:
        """A hook returned: in a process handler code forked, that ends the process."""
        if _forks != self._forks:
            fork_returned(where)


class InlineDispatch(_ForkAware):
    copy_frames = False
    threads: tuple[threading.Thread, ...] = ()
    closed = False

    def __init__(self, handler: Handler) -> None:
        super().__init__()
        self.handler = handler

    def propagates(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a hook, leaves the loop (stopping the server) instead
        of closing that session only: every ``BaseException`` that is not an
        ``Exception`` -- but in a process handler code forked, where the hook's failure
        ends the fork (``fork_returned``: a ``sys.exit(n)`` with status n, on whichever
        thread the loop runs)."""
        return not isinstance(exc, Exception) and not self.in_fork()

    def frame_callback(self, session: Session) -> FrameCallback:
        return self.handler.on_read

    def start(self, loop: EventLoop) -> None:
        pass

    # marks only (EOF never travels inline)
    def post(self, session: Session, item: object) -> None:
        if item is CLOSE_MARK:
            session.run_on_close()

    def stop(self) -> bool:
        return True

    def join(self, timeout: float | None) -> bool:
        return True


class WorkState:
    """A session's place in the worker dispatch (created by WorkerDispatch)."""

    __slots__ = ("backlog", "lock", "scheduled", "paused", "user_paused", "ending")

    def __init__(self) -> None:
        self.backlog: collections.deque[Any] = collections.deque()
        self.lock = SpinLock()
        self.scheduled = False
        self.paused = False             # the backlog's limit paused reading
        self.user_paused = False        # pause_reading(): the worker holds the backlog
        self.ending = False             # SHUTDOWN_MARK queued: the session must not be held


class WorkerDispatch(_ForkAware):
    copy_frames = True

    def __init__(self, handler: Handler, settings: Settings,
                 on_exit: Callable[[], object] | None = None) -> None:
        super().__init__()
        self.handler = handler
        self._limit = settings.worker_backlog
        self._resume_at = settings.worker_backlog // 4
        self._pool = WorkerPool(settings.workers, self._run_session,
                                capacity=settings.worker_queue, on_exit=on_exit)
        # sessions waiting for room (loop thread)
        self._overflow: collections.deque[Session] = collections.deque()
        self._loop: EventLoop | None = None
        self.closed = False

    def propagates(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a hook, leaves the thread that ran it instead of
        closing that session only: a ``KeyboardInterrupt`` on the main thread (the user's
        interrupt of a ``serve_forever()`` there).  Anything else -- ``SystemExit``,
        ``asyncio.CancelledError``, a ``KeyboardInterrupt`` raised on a worker or a loop
        thread of ``start()`` -- closes that session only, on every thread: the server
        and its workers serve on.  (In a process handler code forked, the session's
        ``handler_failed`` ends the fork instead: ``fork_returned``, a ``sys.exit(n)``
        with status n -- though the forking worker is the fork's main thread.)"""
        if isinstance(exc, Exception):
            return False
        return (isinstance(exc, KeyboardInterrupt) and not self.in_fork() and
                threading.current_thread() is threading.main_thread())

    @property
    def threads(self) -> list[threading.Thread]:
        return self._pool.threads

    def frame_callback(self, session: Session) -> FrameCallback:
        return self.post_frame

    def start(self, loop: EventLoop) -> None:
        self._loop = loop
        loop.add_iteration_hook(self._retry_overflow)
        self._pool.start()

    # -- loop thread ------------------------------------------------------------------
    def post_frame(self, session: Session, data: bytes) -> None:
        """The receiver's frame callback: queue one frame (bytes) for a worker."""
        self.post(session, data)

    def post(self, session: Session, item: object) -> None:
        """Queue a frame or a mark behind the session's earlier items (loop thread)."""
        # (every session of a worker server has a WorkState)
        w: WorkState = session.work     # type: ignore[assignment]
        session.ref()                       # the item's reference, dropped after it ran
        with w.lock:
            w.backlog.append(item)
            n = len(w.backlog)
            schedule = not w.scheduled
            w.scheduled = True
            if n >= self._limit and not w.paused:
                w.paused = True
                pause = True
            else:
                pause = False
        if pause:
            session.pause_for_backlog(True)
        if schedule:
            self._schedule(session)

    def push_front(self, session: Session, data: bytes) -> None:
        """Session.unread() from its worker, inside on_read: the frame's rest goes back to
        the front of the backlog (the worker running the session takes it next, or holds
        it while paused)."""
        w: WorkState = session.work     # type: ignore[assignment]
        session.ref()
        with w.lock:
            w.backlog.appendleft(data)

    def close_when_done(self, session: Session) -> None:
        """The server's shutdown (loop thread, reading stopped): close ``session`` once its
        worker has run what is queued for it, so that its ``on_close`` runs on a worker
        too, after its last ``on_read``.  A session its application paused holds its
        queue: it is closed at once (its held frames are dropped, as for any close while
        paused)."""
        w: WorkState = session.work     # type: ignore[assignment]
        session.ref()                       # the mark's reference
        with w.lock:
            held = w.user_paused and not w.scheduled
            if not held:
                w.backlog.append(SHUTDOWN_MARK)
                w.ending = True
                schedule = not w.scheduled
                w.scheduled = True
        if held:
            session.unref()
            session.close_for_shutdown()
        elif schedule:
            self._schedule(session)

    def release_held(self, session: Session) -> None:
        """resume_reading() (loop thread): schedule the session again if its worker let it
        go holding frames."""
        w: WorkState = session.work     # type: ignore[assignment]
        with w.lock:
            schedule = bool(w.backlog) and not w.scheduled and not w.user_paused
            if schedule:
                w.scheduled = True
        if schedule:
            self._schedule(session)

    def _schedule(self, session: Session) -> None:
        if self._overflow:
            self._overflow.append(session)      # keep the order of sessions waiting
            return
        try:
            self._pool.queue.put_nowait(session)
        except Full:
            self._overflow.append(session)
        except Closed:                          # shutting down: run it here, in order
            self._run_session(session)

    def _retry_overflow(self) -> None:
        ov = self._overflow
        q = self._pool.queue
        while ov:
            try:
                q.put_nowait(ov[0])
            except Full:
                return
            except Closed:
                while ov:
                    self._run_session(ov.popleft())
                return
            ov.popleft()

    # -- worker threads (and the loop thread once the queue is closed) -----------------
    def _run_session(self, session: Session) -> None:
        """Run the session's items in order until its backlog is empty."""
        # (every session of a worker server has a WorkState)
        w: WorkState = session.work     # type: ignore[assignment]
        handler = self.handler
        while True:
            with w.lock:
                # paused by the application (pause_reading, even from the on_read just run):
                # hold what is queued, in order, until resume_reading (release_held); a
                # closed session is not held (its frames are dropped or, after a reset,
                # delivered, then on_close runs)
                if not w.backlog or (w.user_paused and not session.closed):
                    w.scheduled = False
                    # the shutdown's mark waits behind a pause: close it now instead (its
                    # on_close is posted here again, and runs: a closed session is not held)
                    end = w.ending and bool(w.backlog)
                    break
                item = w.backlog.popleft()
                resume = w.paused and len(w.backlog) <= self._resume_at
                if resume:
                    w.paused = False
            if resume:
                session.pause_for_backlog(False)
            if item is CLOSE_MARK:
                session.run_on_close()
            elif item is SHUTDOWN_MARK:
                self._loop.call_soon_threadsafe(session.close_for_shutdown)
            elif type(item) is tuple:           # (EOF_MARK, reason, level, cause)
                session.frames_done(*item[1:])
            elif session.takes_frames:
                try:
                    handler.on_read(session, item)
                    if _forks != self._forks:
                        fork_returned("on_read")
                except BaseException as e:
                    # anything a hook raises here -- SystemExit, CancelledError and
                    # KeyboardInterrupt included -- closes this session only; the worker
                    # thread lives on (if it ended, the sessions it owed would never be
                    # served).  KeyboardInterrupt from SIGINT reaches only the main thread.
                    # In a forked process it ends this thread, the fork's only one.
                    if self.propagates(e):
                        raise
                    session.handler_failed("on_read", e)
            item = None
            session.unref()
        if end:
            self._loop.call_soon_threadsafe(session.close_for_shutdown)

    def stop(self) -> None:
        """Close the completion queue: workers drain what is queued, then exit; the
        sessions still waiting in the overflow list run here, on the calling (loop)
        thread.  (The server's shutdown calls it once every session's on_close has run,
        when nothing waits; after its timeout, once it posted the last on_close.)"""
        self.closed = True
        self._pool.close()
        ov = self._overflow
        while ov:
            self._run_session(ov.popleft())

    def join(self, timeout: float | None) -> bool:
        return self._pool.join(timeout)
