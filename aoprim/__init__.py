"""aoprim: compiled concurrency primitives for Python servers, and a server built from them.

Public names are listed in docs/api.md; everything here is importable as ``from aoprim import X``
(the server lives in ``aoprim.server``).
"""
import os as _os
import sys as _sys
from importlib.machinery import EXTENSION_SUFFIXES as _EXT

# The Pythons pyproject.toml's requires-python admits and the suite runs on.  An install
# forced past requires-python (pip --ignore-requires-python) would import and then fail
# deep inside (aoprim.aio needs asyncio's 3.11 names): refuse here, saying what is supported.
_SUPPORTED = "CPython 3.11, 3.12 and 3.13"
if _sys.version_info < (3, 11):
    raise ImportError(
        f"aoprim supports {_SUPPORTED} (pyproject.toml: requires-python >= 3.11); this is "
        f"Python {_sys.version.split()[0]} ({_sys.executable}): install aoprim with a "
        "supported Python")


def _defer_to_installed_build():
    """A source checkout has no compiled extensions.  When it is imported anyway -- e.g.
    ``python -m aoprim serve`` run from the repository root, which puts the checkout first on
    sys.path -- serve the package's modules from the installed build instead, so the README's
    command works from any directory.  An installed (or in-place built) package is untouched.
    With no build anywhere on sys.path, ImportError says what to do (instead of ``No module
    named 'aoprim._atomic'``)."""
    here = _os.path.dirname(_os.path.abspath(__file__))

    def built(folder):
        return any(_os.path.exists(_os.path.join(folder, "_atomic" + s)) for s in _EXT)

    if built(here):
        return
    for entry in _sys.path:
        cand = _os.path.join(_os.path.abspath(entry or _os.curdir), "aoprim")
        if cand != here and built(cand):
            __path__[:] = [cand]     # submodules (and __main__) now load from the build
            return
    raise ImportError(
        f"aoprim's compiled modules are missing: {here} is aoprim's source, not a built "
        f"package (no _atomic{_EXT[0]} for this Python, "
        f"{_sys.version.split()[0]}).  Run `pip install .` in the checkout (it needs a C "
        "compiler and Python's headers), then run Python from outside the checkout: from "
        "inside it, its aoprim/ folder is imported instead of the installed package.",
        name="aoprim", path=here)


_defer_to_installed_build()

from aoprim.errors import Closed, Empty, Full, PoolExhausted, RefCountError
from aoprim._atomic import AtomicInt, RefCount
from aoprim._spinlock import SpinLock

# queues
from aoprim._mpmc import MPMCQueue
from aoprim._spsc import SPSCQueue

# buffers
from aoprim._slab import SlabPool, Slot
from aoprim._blocktable import BlockTable

# send batching; FlushGroup: every dirty batch flushed at once
from aoprim._sendbatch import SendBatch
from aoprim._flushgroup import FlushGroup

# receive path
from aoprim._receiver import (Receiver, RxArena, RX_EOF, RX_ERROR, RX_TOO_LARGE,
                              RX_HANDLER, RX_PROXY, RX_PROXY_ERROR)
# PROXY protocol header parser: what Receiver(proxy=...) runs
from aoprim._proxyproto import ProxyParser
# the compiled Layer 1 event loop core (the server's "epoll" backend)
from aoprim._eloop import EpollCore, EpollTimer

from typing import TYPE_CHECKING
if TYPE_CHECKING:   # bound for type checkers; at run time by __getattr__ below (it loads ssl)
    from aoprim._tls import TLSConn, TLSFlush

# (one version, in aoprim/_version.py; "as": re-exported for type checkers)
from aoprim._version import __version__ as __version__  # noqa: E402

__all__ = [
    "AtomicInt", "RefCount", "SpinLock",
    "MPMCQueue", "SPSCQueue",
    "SlabPool", "Slot", "BlockTable",
    "Full", "Empty", "PoolExhausted", "RefCountError", "Closed",
    "SendBatch", "FlushGroup",
    "Receiver", "RxArena", "RX_EOF", "RX_ERROR", "RX_TOO_LARGE", "RX_HANDLER",
    "RX_PROXY", "RX_PROXY_ERROR", "ProxyParser", "EpollCore", "EpollTimer",
    "TLSConn", "TLSFlush",
    "get_include",
]


def __getattr__(name: str):
    # The server's compiled TLS path (aoprim._tls) imports ssl: loaded on first use of its
    # names, so that `import aoprim` / `import aoprim.server` do not load ssl (PEP 562).
    if name in ("TLSConn", "TLSFlush"):
        from aoprim import _tls
        return getattr(_tls, name)
    raise AttributeError(f"module 'aoprim' has no attribute {name!r}")


def get_include() -> str:
    """The folder holding aoprim's C headers (aop_atomic.h).

    Add it to ``include_dirs`` of an Extension that cimports aoprim; the ``.pxd`` files are
    found on the normal package path (``from aoprim._atomic cimport AtomicInt``).
    """
    return _os.path.join(__path__[0], "include")
