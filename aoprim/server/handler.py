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
  raises, on any thread, is logged and nothing else happens (its session is closed already).
- ``session.close()`` / ``abort()`` inside ``on_connect`` or ``on_read`` (or anywhere) never
  runs ``on_close`` inside that call: the hook returns first, and ``on_close`` follows from a
  loop callback of its own (with workers, on the session's worker after its last
  ``on_read``); no ``on_read`` comes after the close.  An exception the hook raises after
  closing is still logged with its traceback and counted (``handler_errors``).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self

    from .session import Session

__all__ = ["Handler"]


class Handler:
    """Base class of the Layer 3 code.  All hooks default to doing nothing.

    A subclass defines ``on_read``: one whose ``on_read`` is still this default would drop
    every byte its sessions receive, so instantiating it raises ``TypeError`` naming the
    class and, where it defines a method of a close name (``on_reed``), that one.  (A handler
    that ignores its input on purpose says so: ``def on_read(self, session, data): pass``.)
    ``Handler()`` itself, which reads and ignores everything, may be instantiated.
    """

    if not TYPE_CHECKING:
        # hidden from type checkers, which then check a call against the subclass's own
        # __init__ (or object's: Echo(1) is an error) instead of this (*args, **kwargs)
        def __new__(cls, *args: Any, **kwargs: Any) -> Self:
            if cls.on_read is Handler.on_read and cls is not Handler:
                raise TypeError(_no_on_read(cls))
            if (args or kwargs) and cls.__init__ is object.__init__:
                # (object's own check, which a class with its own __new__ no longer gets: without
                # this, Echo(1) would pass silently)
                raise TypeError(f"{cls.__qualname__}() takes no arguments")
            return super().__new__(cls)

    def on_connect(self, session: Session) -> None:
        """A session was accepted (before any of its frames is read)."""

    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        """One frame arrived; ``data`` is valid during this call only."""

    def on_close(self, session: Session, exc: BaseException | None) -> None:
        """The session is closed; ``exc`` is the exception that closed it, or None.  Runs
        once, after the hook that closed the session returned (never inside it)."""


def _no_on_read(cls: type) -> str:
    """Why ``cls``, a Handler subclass that does not define ``on_read``, is refused."""
    names = {name for k in cls.__mro__ if k is not Handler and k is not object
             for name in vars(k) if not name.startswith("__")}
    close = difflib.get_close_matches("on_read", sorted(names), n=1)
    typo = f" ({close[0]} looks like a misspelt on_read)" if close else ""
    return (f"{cls.__qualname__} does not define on_read(self, session, data){typo}: every "
            f"byte its sessions receive would be dropped; define on_read (to ignore input "
            f"on purpose: def on_read(self, session, data): pass)")
