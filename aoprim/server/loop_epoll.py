"""Layer 1 backend ``epoll``: the :class:`~aoprim.server.loop.EventLoop` interface on the
compiled :class:`aoprim.server._eloop.EpollCore` (Linux).

Same contract as the ``selectors`` backend (written down in :mod:`aoprim.server.loop`); the
difference is where the iteration runs.  Here the wait, the dispatch of every ready fd to its
callback, the timer heap and the per-iteration hooks are C: a session's read burst goes from
``epoll_wait`` to its compiled ``Receiver.on_readable`` with no Layer 1 bytecode between, and
the flush hook is the compiled ``FlushGroup.flush``.  The invariants (wake-up, timers, GC) are
argued at the top of ``aoprim/server/_eloop.pyx``.
"""
from __future__ import annotations

import os

from aoprim.server._eloop import EpollCore, EpollTimer

from .loop import EventLoop, Timer

__all__ = ["EpollLoop"]

Timer.register(EpollTimer)


# (type checkers do not see Timer.register above -- EpollTimer is a Timer -- nor that the
# core's read-only `iterations` counter is what EventLoop declares as a plain attribute)
class EpollLoop(EpollCore, EventLoop):  # type: ignore[misc, override]
    """The ``epoll`` backend."""

    backend = "epoll"

    #: the loop's epoll fd and eventfd (see EventLoop.own_fds)
    own_fds: tuple[int, ...]

    def __new__(cls) -> EpollLoop:
        # the compiled core keeps its fds to itself: they are the epoll and eventfd fds that
        # its construction opened (another thread opening one of those kinds at that very
        # instant would be counted too)
        before = _open_fds()
        self = super().__new__(cls)
        self.own_fds = tuple(sorted(fd for fd in _open_fds() - before
                                    if _anon_kind(fd) in ("[eventpoll]", "[eventfd]")))
        return self


def _open_fds() -> set[int]:
    # (the listing's own directory fd is in it, closed by the time it returns: left out)
    try:
        listed = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:                 # pragma: no cover - no /proc
        return set()
    return {fd for fd in listed if _is_open(fd)}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _anon_kind(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").removeprefix("anon_inode:")
    except OSError:
        return ""
