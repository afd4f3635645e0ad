"""aoprim's exceptions, in one place (docs/api.md)."""
import queue as _queue

__all__ = ["Full", "Empty", "PoolExhausted", "RefCountError", "Closed"]


class Full(_queue.Full):
    """The queue is full (non-blocking put, or a put that timed out)."""


class Empty(_queue.Empty):
    """The queue is empty (non-blocking get, or a get that timed out)."""


class PoolExhausted(RuntimeError):
    """A pool has no free slot."""


class RefCountError(ValueError):
    """An illegal reference-count transition (decref at 0, incref at 0)."""


class Closed(RuntimeError):
    """The queue was closed."""
