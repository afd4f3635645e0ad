"""Layer 1 backend ``epoll``: the :class:`~aoprim.server.loop.EventLoop` interface on the
compiled :class:`aoprim.server._eloop.EpollCore` (Linux).

Same contract as the ``selectors`` backend (written down in :mod:`aoprim.server.loop`); the
difference is where the iteration runs.  Here the wait, the dispatch of every ready fd to its
callback, the timer heap and the per-iteration hooks are C: a session's read burst goes from
``epoll_wait`` to its compiled ``Receiver.on_readable`` with no Layer 1 bytecode between, and
the flush hook is the compiled ``FlushGroup.flush``.  The invariants (wake-up, timers, GC) are
argued at the top of ``aoprim/server/_eloop.pyx``.
"""
from aoprim.server._eloop import EpollCore, EpollTimer

from .loop import EventLoop, Timer

__all__ = ["EpollLoop"]

Timer.register(EpollTimer)


# (type checkers do not see Timer.register above -- EpollTimer is a Timer -- nor that the
# core's read-only `iterations` counter is what EventLoop declares as a plain attribute)
class EpollLoop(EpollCore, EventLoop):  # type: ignore[misc, override]
    """The ``epoll`` backend."""

    backend = "epoll"
