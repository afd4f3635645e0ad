"""aoprim: compiled concurrency primitives for Python servers, and a server built from them.

The top level holds the primitives, importable as ``from aoprim import X`` (and cimportable
from their modules, ``from aoprim._atomic cimport AtomicInt``); the server lives in
``aoprim.server``, the asyncio loop in ``aoprim.aio``, each with its compiled parts beside it.
Every public name, its semantics and its errors: docs/api.md.
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

# (one version, in aoprim/_version.py; "as": re-exported for type checkers)
from aoprim._version import __version__ as __version__  # noqa: E402

__all__ = [
    "AtomicInt", "RefCount", "SpinLock",
    "MPMCQueue", "SPSCQueue",
    "SlabPool", "Slot", "BlockTable",
    "Full", "Empty", "PoolExhausted", "RefCountError", "Closed",
    "SendBatch", "FlushGroup",
    "get_include",
]

# Deprecated top-level names: the server's compiled parts (receive path, PROXY header parser,
# event-loop core, TLS path), which live in aoprim.server beside the code that uses them.
# Each still resolves, with a DeprecationWarning naming its import from there, for one
# release.  They are loaded on first use only: `import aoprim` loads neither the server's
# receive path nor ssl.
_MOVED = {
    **dict.fromkeys(("Receiver", "RX_EOF", "RX_ERROR", "RX_TOO_LARGE", "RX_HANDLER",
                     "RX_PROXY", "RX_PROXY_ERROR"), "aoprim.server._receiver"),
    "RxArena": "aoprim.server._rxbuf",
    "ProxyParser": "aoprim.server._proxyproto",
    "EpollCore": "aoprim.server._eloop",
    "EpollTimer": "aoprim.server._eloop",
    "TLSConn": "aoprim.server._tls",
    "TLSFlush": "aoprim.server._tls",
}


def __getattr__(name: str) -> object:
    # PEP 562: called only for a name the module itself does not bind (dir(aoprim) lists the
    # bound ones, so the deprecated names stay out of it)
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'aoprim' has no attribute {name!r}")
    import importlib
    import warnings
    warnings.warn(f"aoprim.{name} is deprecated: import it as `from {home} import {name}` "
                  "(the top-level name is removed in the next release)",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)


def get_include() -> str:
    """The folder holding aoprim's C headers (aop_atomic.h).

    Add it to ``include_dirs`` of an Extension that cimports aoprim; the ``.pxd`` files are
    found on the normal package path (``from aoprim._atomic cimport AtomicInt``).
    """
    return _os.path.join(__path__[0], "include")
