"""aoprim: compiled concurrency primitives for Python servers, and a server built from them.

Public names are listed in API.md; everything here is importable as ``from aoprim import X``
(the server lives in ``aoprim.server``).
"""
import os as _os

from aoprim.errors import Closed, Empty, Full, PoolExhausted, RefCountError
from aoprim._atomic import AtomicInt, RefCount
from aoprim._spinlock import SpinLock

# queues (issue 3)
from aoprim._mpmc import MPMCQueue
from aoprim._spsc import SPSCQueue

# buffers (issue 4)
from aoprim._slab import SlabPool, Slot
from aoprim._blocktable import BlockTable

# send batching (issue 5)
from aoprim._sendbatch import SendBatch

__version__ = "0.1.0"

__all__ = [
    "AtomicInt", "RefCount", "SpinLock",
    "MPMCQueue", "SPSCQueue",
    "SlabPool", "Slot", "BlockTable",
    "Full", "Empty", "PoolExhausted", "RefCountError", "Closed",
    "SendBatch",
    "get_include",
]


def get_include() -> str:
    """The folder holding aoprim's C headers (aop_atomic.h).

    Add it to ``include_dirs`` of an Extension that cimports aoprim; the ``.pxd`` files are
    found on the normal package path (``from aoprim._atomic cimport AtomicInt``).
    """
    return _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "include")
