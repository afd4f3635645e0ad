"""Layer 1 -- a loop of the named backend: :func:`create_loop`.

The interface (:mod:`aoprim.server.loop`) knows no backend; each backend module
(:mod:`~aoprim.server.loop_selectors`, :mod:`~aoprim.server.loop_epoll`) implements it; this
module, above both, picks one by name.  Layer 2 makes its loop here.
"""
from __future__ import annotations

from .loop import BACKENDS, BackendUnavailable, EventLoop

__all__ = ["create_loop"]


def create_loop(backend: str = "selectors") -> EventLoop:
    """A new loop of the named backend.  Unknown names raise ``ValueError``; a known backend
    that cannot run here raises :class:`BackendUnavailable` with the reason."""
    if backend == "uring":
        raise BackendUnavailable(
            "backend 'uring' is not available: no io_uring backend ships in this version of "
            f"aoprim; accepted backends: {', '.join(BACKENDS)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "epoll":
        try:
            from .loop_epoll import EpollLoop
        except ImportError as e:     # pragma: no cover - a build without epoll (not Linux)
            raise BackendUnavailable(f"backend 'epoll' is not available here: {e}") from e
        return EpollLoop()
    from .loop_selectors import SelectorsLoop
    return SelectorsLoop()
