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
    ``on_read``: the frames still queued for it are dropped;
  * the loop thread never blocks on a full completion queue: a session that does not fit
    waits in an overflow list that the loop retries at the end of every iteration;
  * every queued item holds one reference of the session's ``RefCount``, dropped after it ran.
"""
import collections
import logging

from aoprim import Closed, Full, SpinLock

from .workers import WorkerPool

__all__ = ["InlineDispatch", "WorkerDispatch", "WorkState", "EOF_MARK", "CLOSE_MARK"]

log = logging.getLogger("aoprim.server")

EOF_MARK = object()     # (EOF_MARK, reason, ...): close once the frames before it ran
CLOSE_MARK = object()   # run on_close, after every on_read


class InlineDispatch:
    copy_frames = False
    threads = ()
    closed = False

    def __init__(self, handler):
        self.handler = handler

    def frame_callback(self, session):
        return self.handler.on_read

    def start(self, loop):
        pass

    def post(self, session, item):       # marks only (EOF never travels inline)
        if item is CLOSE_MARK:
            session.run_on_close()

    def stop(self):
        return True

    def join(self, timeout):
        return True


class WorkState:
    """A session's place in the worker dispatch (created by WorkerDispatch)."""

    __slots__ = ("backlog", "lock", "scheduled", "paused")

    def __init__(self):
        self.backlog = collections.deque()
        self.lock = SpinLock()
        self.scheduled = False
        self.paused = False


class WorkerDispatch:
    copy_frames = True

    def __init__(self, handler, settings, on_exit=None):
        self.handler = handler
        self._limit = settings.worker_backlog
        self._resume_at = settings.worker_backlog // 4
        self._pool = WorkerPool(settings.workers, self._run_session,
                                capacity=settings.worker_queue, on_exit=on_exit)
        self._overflow = collections.deque()     # sessions waiting for room (loop thread)
        self._loop = None
        self.closed = False

    @property
    def threads(self):
        return self._pool.threads

    def frame_callback(self, session):
        return self.post_frame

    def start(self, loop):
        self._loop = loop
        loop.add_iteration_hook(self._retry_overflow)
        self._pool.start()

    # -- loop thread ------------------------------------------------------------------
    def post_frame(self, session, data):
        """The receiver's frame callback: queue one frame (bytes) for a worker."""
        self.post(session, data)

    def post(self, session, item):
        """Queue a frame or a mark behind the session's earlier items (loop thread)."""
        w = session.work
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

    def _schedule(self, session):
        if self._overflow:
            self._overflow.append(session)      # keep the order of sessions waiting
            return
        try:
            self._pool.queue.put_nowait(session)
        except Full:
            self._overflow.append(session)
        except Closed:                          # shutting down: run it here, in order
            self._run_session(session)

    def _retry_overflow(self):
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
    def _run_session(self, session):
        """Run the session's items in order until its backlog is empty."""
        w = session.work
        handler = self.handler
        while True:
            with w.lock:
                if not w.backlog:
                    w.scheduled = False
                    return
                item = w.backlog.popleft()
                resume = w.paused and len(w.backlog) <= self._resume_at
                if resume:
                    w.paused = False
            if resume:
                session.pause_for_backlog(False)
            if item is CLOSE_MARK:
                session.run_on_close()
            elif type(item) is tuple:           # (EOF_MARK, reason, level, cause)
                session.frames_done(*item[1:])
            elif not session.closed:
                try:
                    handler.on_read(session, item)
                except BaseException as e:
                    # anything a hook raises here -- SystemExit, CancelledError and
                    # KeyboardInterrupt included -- closes this session only; the worker
                    # thread lives on (if it ended, the sessions it owed would never be
                    # served).  KeyboardInterrupt from SIGINT reaches only the main thread.
                    session.handler_failed("on_read", e)
            item = None
            session.unref()

    def stop(self):
        """Close the completion queue: workers drain what is queued, then exit; the
        sessions still waiting in the overflow list run here, on the calling (loop)
        thread."""
        self.closed = True
        self._pool.close()
        ov = self._overflow
        while ov:
            self._run_session(ov.popleft())

    def join(self, timeout):
        return self._pool.join(timeout)
