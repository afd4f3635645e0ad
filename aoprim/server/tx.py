"""Layer 2 -- the send side: each session's outgoing batch, the hand-off of sends made on
other threads, and the per-iteration flush of every dirty batch.

- Every session owns a ``SendBatch`` (``auto_flush=False``) attached to the server's one
  ``FlushGroup``.  A send on the loop thread is one C call (``add_frame`` with u16/u32
  framing -- the one place a frame header is built -- ``add_copy`` with raw): the batch
  queues itself in the group when it becomes dirty.  At the end of every loop iteration
  :class:`Flusher` flushes the whole group with one GIL release -- all replies one read
  burst produced leave in one ``sendmsg`` per session (more only beyond ``IOV_MAX``
  messages; a session's writes stop for this iteration once ``flush_budget`` bytes are
  out) -- and hands the few batches that need attention (would block, a budget used up, an
  error, or watched) to their sessions.
- Sends from other threads go through :class:`ForeignSends`: one item per ``send`` (the
  payload as one ``bytes`` copy, or a retained ``Slot``; see :func:`foreign_item`), framed
  on the loop thread by ``add_frame`` as it drains them, so another thread's send can never
  come between a header and its payload.  A broadcast made on another thread is queued the
  same way, behind that thread's earlier sends to each session.  A spin lock orders the queue against
  the session's teardown: once :meth:`ForeignSends.close` ran, a late send releases what it
  retained at once instead of leaving it in a queue nobody drains.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable

from aoprim import FlushGroup, SendBatch, Slot, SpinLock

if TYPE_CHECKING:
    import socket

    from typing_extensions import Buffer

    from .config import Settings
    from .loop import EventLoop

__all__ = ["BYREF_MIN", "Flusher", "ForeignSends", "IOV_MAX", "check_payload",
           "foreign_item", "release_item"]

IOV_MAX = 1024
# sends of a receive frame view at least this long go by reference: see
# session.Session._send_raw and Session._send_frame_view
BYREF_MIN = 32768


class Flusher:
    """The server's per-iteration flush: install ``flush`` (the group's own C method) as a
    loop iteration hook; it calls ``notify(session, status)`` for each session whose batch
    needs attention."""

    def __init__(self, settings: Settings, notify: Callable[[Any, int], object]) -> None:
        self.group = FlushGroup(budget=settings.flush_budget)
        self.group.notify = notify          # notify(session, status) for the few that need it
        self._batch_bytes = max(settings.flush_budget, 65536)
        self.flush = self.group.flush       # the iteration hook: C, no Python frame

    def new_batch(self, sock: socket.socket, owner: object, attach: bool = True) -> SendBatch:
        """A session's batch: its target is the socket (``fileno()`` is read at each flush,
        so a socket closed behind the session's back fails with EBADF instead of writing to
        whatever connection reuses the number)."""
        b = SendBatch(sock, max_msgs=IOV_MAX, max_bytes=self._batch_bytes, auto_flush=False)
        if attach:
            self.group.attach(b, owner)
        return b

    def forget(self, batch: SendBatch) -> None:
        self.group.detach(batch)

    def requeue(self, batch: SendBatch) -> None:
        self.group.requeue(batch)


class ForeignSends:
    """Sends made on threads other than the loop's, handed to the loop in order."""

    __slots__ = ("_q", "_lock", "_scheduled", "_closed", "_loop", "_drain", "_bytes")

    def __init__(self, loop: EventLoop, drain: Callable[[list[bytes | Slot]], object]) -> None:
        self._bytes = 0             # bytes queued here, not yet handed to the batch
        self._q: collections.deque[bytes | Slot] = collections.deque()
        self._lock = SpinLock()
        self._scheduled = False
        self._closed = False
        self._loop = loop
        # loop-thread callable: drain(items)
        self._drain: Callable[[list[bytes | Slot]], object] | None = drain

    def push(self, item: bytes | Slot, nbytes: int = 0, pending: int = 0,
             limit: int | None = None) -> bool | None:
        """Queue one item of ``nbytes`` bytes (any thread).  False if the session is gone
        (the item is released here).  ``limit``: refuse the item (released here; returns
        None) when ``pending`` (the batch's unsent bytes) plus what is queued here plus
        ``nbytes`` would exceed it -- max_pending, checked where the item is queued."""
        over = False
        with self._lock:
            if self._closed:
                gone = True
            elif limit is not None and pending + self._bytes + nbytes > limit:
                gone = over = True
            else:
                gone = False
                self._q.append(item)
                self._bytes += nbytes
                wake = not self._scheduled
                self._scheduled = True
        if gone:
            release_item(item)
            return None if over else False
        if wake and not self._loop.call_soon_threadsafe(self._run):
            self.close()            # the loop is closed: nobody will drain
        return True

    @property
    def queued(self) -> int:
        """Bytes queued here, not yet handed to the batch (any thread; a racy read)."""
        return self._bytes

    def _run(self) -> None:
        with self._lock:
            self._scheduled = False       # before taking: a later push schedules again
            items = list(self._q)
            self._q.clear()
            self._bytes = 0             # (they reach the batch's pending bytes next)
            drain = self._drain
        if drain is not None:
            drain(items)
        else:                           # closed meanwhile
            for item in items:
                release_item(item)

    def close(self) -> None:
        """No more items (loop thread, teardown, or a closed loop): release what is queued."""
        with self._lock:
            self._closed = True
            self._drain = None          # the session's bound method: no cycle outlives it
            items = list(self._q)
            self._q.clear()
        for item in items:
            release_item(item)


def release_item(item: bytes | Slot) -> None:
    """Give back what a queued item retained (a Slot; bytes hold nothing)."""
    if isinstance(item, Slot):
        item.release()


def check_payload(n: int, header_size: int) -> None:
    """ValueError for a payload of ``n`` bytes too long for the header -- the encoder's own
    check and message (``SendBatch.frame_header``, add_frame's header code), raised in the
    sending thread, before anything is queued."""
    if header_size:
        SendBatch.frame_header(n, header_size)


def foreign_item(data: Buffer | Slot, header_size: int) -> bytes | Slot | None:
    """What a send made on another thread hands the loop: the payload's bytes (a copy: the
    caller may reuse its buffer at once; any buffer's bytes in C order, as add_frame takes
    them), or a ``Slot``, retained.  Validated here, in the sending thread (TypeError for
    what is not bytes-like, ValueError for a payload too long for the header).  None: an
    empty raw send (nothing to send).  The header is NOT built here: the loop thread's
    ``SendBatch.add_frame`` is the one encoder."""
    if isinstance(data, Slot):
        check_payload(data.length, header_size)
        data.retain()
        return data
    if type(data) is not bytes:
        try:
            data = memoryview(data).tobytes()
        except TypeError:
            raise TypeError(f"send() takes bytes, bytearray, memoryview or a Slot, not "
                            f"{type(data).__name__}") from None
    check_payload(len(data), header_size)
    if not header_size and not data:
        return None
    return data
