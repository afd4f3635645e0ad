"""Layer 3 -- your code (the logic layer).

Subclass :class:`Handler` and implement ``on_read``; everything below (event loop, buffers,
framing, batching, lifetimes, limits) is the server's.  This module imports no socket and no
selectors: a handler sees sessions only through their small API (``send``, ``close``,
``peer``, ``id``, ``closed``, ``server.broadcast``).

Rules for handlers:

- ``data`` in ``on_read`` is one frame as a bytes-like view, valid only during the call
  (copy it with ``bytes(data)`` to keep it).
- ``session.send()`` copies (or retains a ``Slot``), so the view can be sent back directly.
- With ``workers=0`` the hooks run on the loop thread: do not block in them.  With
  ``workers=N`` ``on_read`` runs on a worker thread; a session's frames still arrive in order
  and never on two workers at once.
- An exception raised by a hook closes that session (logged with its traceback) and nothing
  else; no later frame of that session reaches ``on_read`` (with workers too: the frames
  already queued for it are dropped).  On a worker thread this holds for every
  ``BaseException`` (``SystemExit``, ``asyncio.CancelledError``, ``KeyboardInterrupt``): the
  worker lives on.  On the loop thread (``workers=0``) a ``BaseException`` that is not an
  ``Exception`` stops the server (every session aborted, every buffer back) and propagates
  out of ``serve_forever()``; SIGINT itself never raises ``KeyboardInterrupt`` in a serving
  ``serve_forever()`` (it shuts down cleanly).  ``on_close`` is the exception: whatever it
  raises, on any thread, is logged with its traceback and counted in ``handler_errors``;
  nothing else happens (its session is closed already).
- ``session.close()`` / ``abort()`` inside ``on_connect`` or ``on_read`` (or anywhere) never
  runs ``on_close`` inside that call: the hook returns first, and ``on_close`` follows from a
  loop callback of its own (with workers, on the session's worker after its last
  ``on_read``); no ``on_read`` comes after the close.  An exception the hook raises after
  closing is still logged with its traceback and counted (``handler_errors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import Session

__all__ = ["Handler"]


class Handler:
    """Base class of the Layer 3 code.  All hooks default to doing nothing.

    A subclass defines ``on_read`` (in its class, a mixin listed before ``Handler``, or per
    instance in ``__init__``): ``Server`` refuses a handler whose ``on_read`` is still this
    default, which would drop every byte its sessions receive -- the bare ``Handler`` too --
    with a ``TypeError`` naming the class and the likely cause (a misspelt ``on_reed``, a
    mixin listed after ``Handler``).  A handler that ignores its input on purpose says so:
    ``def on_read(self, session, data): pass``.  The hooks are plain functions, called
    synchronously: ``Server`` refuses an ``async def`` or generator hook (asyncio code runs
    under ``serve_protocol`` or ``aoprim.aio``).
    """

    def on_connect(self, session: Session) -> None:
        """A session was accepted (before any of its frames is read)."""

    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        """One frame arrived; ``data`` is valid during this call only."""

    def on_close(self, session: Session, exc: BaseException | None) -> None:
        """The session is closed; ``exc`` is the exception that closed it, or None.  Runs
        once, after the hook that closed the session returned (never inside it)."""
