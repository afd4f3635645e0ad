"""Layer 2 -- the send side: each session's outgoing batch, the hand-off of sends made on
other threads, and the per-iteration flush of every dirty batch.

- Every session owns a ``SendBatch`` (``auto_flush=False``) attached to the server's one
  ``FlushGroup``.  A send on the loop thread is one C call (``add_copy``): the batch queues
  itself in the group when it becomes dirty.  At the end of every loop iteration
  :class:`Flusher` flushes the whole group with one GIL release -- all replies one read
  burst produced leave in one ``sendmsg`` per session -- and hands the few batches that need
  attention (would block, a budget used up, an error, or watched) to their sessions.
- Sends from other threads go through :class:`ForeignSends`: one item per ``send`` (a framed
  payload is one ``bytes``, or a ``(header, Slot)`` pair), so two threads can never
  interleave a header with another thread's payload.  A spin lock orders the queue against
  the session's teardown: once :meth:`ForeignSends.close` ran, a late send releases what it
  retained at once instead of leaving it in a queue nobody drains.
"""
import collections

from aoprim import FlushGroup, SendBatch, Slot, SpinLock

__all__ = ["Flusher", "ForeignSends", "IOV_MAX"]

IOV_MAX = 1024


class Flusher:
    """The server's per-iteration flush: install ``flush`` (the group's own C method) as a
    loop iteration hook; it calls ``notify(session, status)`` for each session whose batch
    needs attention."""

    def __init__(self, settings, notify):
        self.group = FlushGroup(budget=settings.flush_budget)
        self.group.notify = notify          # notify(session, status) for the few that need it
        self._batch_bytes = max(settings.flush_budget, 65536)
        self.flush = self.group.flush       # the iteration hook: C, no Python frame

    def new_batch(self, sock, owner):
        """A session's batch: its target is the socket (``fileno()`` is read at each flush,
        so a socket closed behind the session's back fails with EBADF instead of writing to
        whatever connection reuses the number)."""
        b = SendBatch(sock, max_msgs=IOV_MAX, max_bytes=self._batch_bytes, auto_flush=False)
        self.group.attach(b, owner)
        return b

    def forget(self, batch):
        self.group.detach(batch)

    def requeue(self, batch):
        self.group.requeue(batch)


class ForeignSends:
    """Sends made on threads other than the loop's, handed to the loop in order."""

    __slots__ = ("_q", "_lock", "_scheduled", "_closed", "_loop", "_drain")

    def __init__(self, loop, drain):
        self._q = collections.deque()
        self._lock = SpinLock()
        self._scheduled = False
        self._closed = False
        self._loop = loop
        self._drain = drain         # loop-thread callable: drain(items)

    def push(self, item):
        """Queue one item (any thread).  False if the session is gone (the item is
        released here)."""
        with self._lock:
            if self._closed:
                gone = True
            else:
                gone = False
                self._q.append(item)
                wake = not self._scheduled
                self._scheduled = True
        if gone:
            release_item(item)
            return False
        if wake and not self._loop.call_soon_threadsafe(self._run):
            self.close()            # the loop is closed: nobody will drain
        return True

    def _run(self):
        with self._lock:
            self._scheduled = False       # before taking: a later push schedules again
            items = list(self._q)
            self._q.clear()
            drain = self._drain
        if drain is not None:
            drain(items)
        else:                           # closed meanwhile
            for item in items:
                release_item(item)

    def close(self):
        """No more items (loop thread, teardown, or a closed loop): release what is queued."""
        with self._lock:
            self._closed = True
            self._drain = None          # the session's bound method: no cycle outlives it
            items = list(self._q)
            self._q.clear()
        for item in items:
            release_item(item)


def release_item(item):
    """Give back what a queued item retained (a Slot, or a (header, Slot) pair)."""
    if type(item) is tuple:
        item = item[1]
    if isinstance(item, Slot):
        item.release()
