"""A gunicorn worker class serving an ASGI application on aoprim.aio's loop.

    gunicorn app:app -k aoprim.aio.gunicorn.Worker -w 4 -b 127.0.0.1:8000

gunicorn has no event loop option of its own: an ASGI worker class chooses the loop.  This is
uvicorn-worker's ``UvicornWorker`` (each gunicorn worker process runs one uvicorn server on
the sockets gunicorn opened, with gunicorn's TLS, keep-alive, ``--max-requests`` and signal
handling) whose uvicorn ``loop`` option is aoprim.aio's loop factory, as ``UvicornWorker``'s
own ``CONFIG_KWARGS`` pick uvloop when it is installed.  uvicorn-worker runs the server with
``asyncio.Runner(loop_factory=...)``: no event loop policy is set.

Needs ``gunicorn``, ``uvicorn-worker`` 0.4 or newer and uvicorn 0.36 or newer (the first
that run a ``module:function`` loop factory); importing this module without them raises
``ImportError`` saying what to install.
"""
from typing import Any, ClassVar

try:
    import uvicorn.config
    import uvicorn_worker  # type: ignore[import-untyped]
    from uvicorn_worker import UvicornWorker
except ImportError:                   # (the missing module's error is chained as context)
    raise ImportError(
        "aoprim.aio.gunicorn.Worker needs gunicorn, uvicorn-worker >= 0.4 and uvicorn >= 0.36: "
        "pip install gunicorn 'uvicorn-worker>=0.4' 'uvicorn>=0.36'")

if not hasattr(uvicorn.config.Config, "get_loop_factory"):
    raise ImportError(
        "aoprim.aio.gunicorn.Worker needs uvicorn >= 0.36 (the first whose loop option takes "
        f"a module:function loop factory); this is uvicorn {uvicorn.__version__}: "
        "pip install 'uvicorn>=0.36' 'uvicorn-worker>=0.4'")

# uvicorn-worker 0.3 and older build the loop with Config.setup_event_loop(), which uvicorn
# 0.36 replaced by get_loop_factory(): 0.4 is the first that runs a loop factory
_uw_version = getattr(uvicorn_worker, "__version__", "0")
if tuple(int(p) for p in _uw_version.split(".")[:2] if p.isdigit()) < (0, 4):
    raise ImportError(
        "aoprim.aio.gunicorn.Worker needs uvicorn-worker >= 0.4 (the first that runs uvicorn's "
        f"loop factory); this is uvicorn-worker {_uw_version}: pip install 'uvicorn-worker>=0.4'")

__all__ = ["Worker", "LOOP_FACTORY"]

#: the loop factory uvicorn imports in each worker process
LOOP_FACTORY = "aoprim.aio:new_event_loop"


class Worker(UvicornWorker):  # type: ignore[misc]  # uvicorn-worker ships no type hints
    """gunicorn worker class (``-k aoprim.aio.gunicorn.Worker``): uvicorn-worker's
    ``UvicornWorker`` on an :class:`aoprim.aio.Loop`.  A subclass may change the other
    uvicorn ``Config`` arguments in ``CONFIG_KWARGS`` (``"http": "h11"``, as
    ``UvicornH11Worker`` does); keep ``"loop"``."""

    CONFIG_KWARGS: ClassVar[dict[str, Any]] = {"loop": LOOP_FACTORY, "http": "auto"}
