"""Worker threads in the IOCP shape: a completion queue (``MPMCQueue``) and N threads that take
completions (one thread: in batches, ``get_many``; several: one at a time, so that none
sits idle while another holds a batch) and run them.

This module is generic: an item is whatever the producer posts, and ``dispatch(item)`` is the
producer's function.  Per-session ordering is the dispatch layer's business (it posts a session
at most once at a time, see dispatch.py).  ``close()`` closes the queue: the threads drain
what is left, then exit; each exiting thread calls ``on_exit()``.

In a process forked from the pool's (by code that ``dispatch`` runs), the pool is the
parent's: the forking thread, the fork's only one, runs on as a worker until ``dispatch``
raises, then ends as a plain thread does (a ``SystemExit`` quietly), logging nothing and
calling no ``on_exit()`` (that would act on the parent's objects).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from aoprim import Closed, MPMCQueue

__all__ = ["AT_THREAD_LIMIT", "ServerThread", "ThreadLimitError", "WorkerPool"]

log = logging.getLogger("aoprim.server")


# what a thread that cannot start says of the reason
AT_THREAD_LIMIT = (": the process is at its thread limit (RLIMIT_NPROC, a pids cgroup's "
                   "pids.max, kernel.threads-max)")


class ThreadLimitError(RuntimeError):
    """A thread the server needs could not start: the process is at its thread limit
    (RLIMIT_NPROC, which Linux counts threads in; a pids cgroup's ``pids.max``, as
    systemd's ``TasksMax=`` and ``docker --pids-limit`` set; ``kernel.threads-max``)."""


class ServerThread(threading.Thread):
    """A thread of the server's own (its loop thread, a worker): a daemon, so that it never
    holds the interpreter's exit (the server stops it) -- but not to the threads handler
    code starts on it.  ``Thread()`` makes a new thread a daemon when the thread creating it
    is one, so a thread an ``on_read`` on a worker started (a background job, as in a plain
    program or under asyncio) was silently a daemon, killed unfinished at exit.  Asked by
    code running on it, once it runs, this thread answers ``daemon`` False: what it starts
    is a daemon only if asked (``daemon=True``), as what the main thread starts.  To every
    other thread, and to the interpreter (which reads it before the thread runs), it is a
    daemon."""

    @property
    def daemon(self) -> bool:
        return bool(super().daemon) and not (threading.get_ident() == self.ident
                                             and self.is_alive())

    @daemon.setter
    def daemon(self, value: bool) -> None:
        threading.Thread.daemon.fset(self, value)      # type: ignore[attr-defined]


class WorkerPool:
    def __init__(self, n: int, dispatch: Callable[[Any], object], capacity: int = 4096,
                 batch: int = 32, on_exit: Callable[[], object] | None = None,
                 name: str = "aoprim-worker") -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError("workers must be an int")
        if n < 1:
            raise ValueError("a WorkerPool needs at least one thread")
        self.queue: MPMCQueue[Any] = MPMCQueue(capacity)
        self._dispatch = dispatch
        # ``batch`` counts for one thread only: with two or more, one item at a time -- a
        # batch taken is run in turn by its taker while another thread may sit idle (with
        # slow items, a CPU-bound handler draining a session, one worker did 87% of the
        # work of two)
        self._batch = batch if n == 1 else 1
        self._on_exit = on_exit
        self._pid = os.getpid()
        self.threads = [ServerThread(target=self._run, name=f"{name}-{i}", daemon=True)
                        for i in range(n)]

    def start(self) -> None:
        """Start the threads; :class:`ThreadLimitError` if one cannot start (those started
        are the caller's to stop: ``close()`` and ``join()``)."""
        for i, t in enumerate(self.threads):
            try:
                t.start()
            except RuntimeError as e:       # "can't start new thread"
                raise ThreadLimitError(f"cannot start worker thread {i + 1} of "
                                       f"{len(self.threads)} ({e}){AT_THREAD_LIMIT}") from None

    def close(self) -> None:
        self.queue.close()

    def join(self, timeout: float | None = None) -> bool:
        for t in self.threads:
            if t.ident is not None:
                t.join(timeout)
        return not any(t.is_alive() for t in self.threads)

    def _run(self) -> None:
        q = self.queue
        dispatch = self._dispatch
        batch = self._batch
        try:
            while True:
                try:
                    item = q.get()          # blocks (spins briefly, then parks)
                except Closed:
                    return
                dispatch(item)
                while True:                 # then take what is there in batches
                    try:
                        items = q.get_many(batch)
                    except Closed:
                        return
                    if not items:
                        break
                    for item in items:
                        dispatch(item)
                    del items
                del item
        except BaseException:
            # (dispatch guards its own errors; what it lets through in a fork ends the fork)
            if os.getpid() != self._pid:
                raise
            log.exception("worker thread crashed")      # pragma: no cover
            raise
        finally:
            if self._on_exit is not None and os.getpid() == self._pid:
                self._on_exit()
