"""aoprim.server -- a three-layer server built from aoprim's primitives.

::

    +----------------------------------------------------------------------------+
    | Layer 3  your code      handler.py (Handler.on_read)   apps.py (echo, chat) |
    |          adapters/asyncio_protocol.py: asyncio protocols as a Handler      |
    +----------------------------------------------------------------------------+
    | Layer 2  server.py      lifecycle, shutdown; composes the parts below      |
    |          session.py     one connection: state machine, API, lifetime       |
    |          rx.py          receive side: compiled Receiver, pauses, timeouts  |
    |          tx.py          send side: SendBatch per session, FlushGroup flush |
    |          dispatch.py    inline or worker threads (workers.py), backlog     |
    |          listener.py    accept policy and limits                           |
    |          config.py      settings, validated once   stats.py  counters      |
    |          framing.py     framing for clients, tools (the compiled codec)    |
    +----------------------------------------------------------------------------+
    | Layer 1  loop.py        the event-loop interface every backend implements  |
    |          loop_selectors.py  backend "selectors" (default; pure Python)     |
    |          loop_epoll.py      backend "epoll" (over _eloop.EpollCore)        |
    +----------------------------------------------------------------------------+
    | compiled, in this folder:                                                  |
    |           _eloop.pyx     EpollCore (wait, dispatch, timers, hooks: "epoll")|
    |           _receiver.pyx  Receiver / RxArena (read, cut frames, on_read)    |
    |           _proxyproto.pyx ProxyParser (the PROXY header)                   |
    |           _tls.pyx       TLSConn / TLSFlush (per-message TLS path)         |
    | compiled, the primitives (aoprim):                                         |
    |           SendBatch / FlushGroup (batch, flush all at once),               |
    |           SlabPool, RefCount, MPMCQueue, SpinLock                          |
    +----------------------------------------------------------------------------+

Each layer imports only the one below it and no module touches another module's private
attributes (tests/packaging/test_layering.py checks both).  ``supervisor.py`` runs
``--procs`` server processes; ``cli.py`` is the command line.

Example::

    from aoprim.server import Server, Handler

    class Echo(Handler):
        def on_read(self, session, data):
            session.send(data)

    srv = Server(Echo(), host="127.0.0.1", port=0, framing="u16").start()
    ...
    srv.shutdown()
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .config import Settings
from .framing import FRAMINGS, FrameDecoder, FrameTooLarge, Framing
from .handler import Handler
from .loop import BACKENDS, BackendUnavailable
from .server import Server
from .session import Session

if TYPE_CHECKING:
    # what a type checker (and mypy.stubtest) sees; at run time these two are loaded on
    # first use by __getattr__ below
    import asyncio
    import socket
    import ssl

    from typing_extensions import Unpack

    from .adapters.asyncio_protocol import ProtocolHandler, SessionTransport
    from .config import SettingsArgs

    class _ServeArgs(SettingsArgs, total=False):
        # serve_protocol's keywords: Server's (framing can only be "raw")
        framing: str
        sock: socket.socket | None
        ssl: ssl.SSLContext | None
        handshake_timeout: float

__all__ = ["Server", "Session", "Handler", "Settings", "serve_protocol", "Framing",
           "FrameDecoder", "FrameTooLarge", "FRAMINGS", "BACKENDS", "BackendUnavailable",
           "SessionTransport", "ProtocolHandler"]


def __getattr__(name: str) -> Any:
    # the asyncio adapter (and with it asyncio and ssl, most of this package's import time)
    # is loaded on first use, not by ``import aoprim.server``
    if name in ("ProtocolHandler", "SessionTransport"):
        from .adapters import asyncio_protocol
        return getattr(asyncio_protocol, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serve_protocol(protocol_factory: Callable[[], asyncio.BaseProtocol],
                   host: str | None = "127.0.0.1", port: int = 0, *, forever: bool = False,
                   **kwargs: Unpack[_ServeArgs]) -> Server:
    """Run an unchanged ``asyncio.Protocol`` / ``asyncio.BufferedProtocol`` on this server.

    ``protocol_factory()`` is called once per connection, as with ``loop.create_server``.
    Returns the started :class:`Server` (serving in a background thread; ``srv.address``,
    ``srv.shutdown()``), or with ``forever=True`` serves in the calling thread until
    ``shutdown()`` or SIGINT/SIGTERM, then returns the stopped server.  Other keyword
    arguments go to :class:`Server` (framing is ``raw``); a ``sock=`` bound but not
    listening yet is made to listen (``backlog``), as asyncio's ``create_server(sock=)``.
    """
    from .adapters.asyncio_protocol import ProtocolHandler
    _check_protocol_factory(protocol_factory)
    kwargs.setdefault("framing", "raw")
    if kwargs["framing"] != "raw":
        raise ValueError("asyncio protocols parse their own stream: framing must be 'raw'")
    if kwargs.get("sock") is not None:
        # as asyncio's create_server(sock=): a bound socket is made to listen -- once the
        # settings are known good (a refused call leaves the caller's socket as it was)
        settings = {k: v for k, v in kwargs.items() if k != "sock"}
        Settings(**settings)
        _listen_as_asyncio(kwargs["sock"], kwargs.get("backlog"))
    srv = Server(ProtocolHandler(protocol_factory), host, port, **kwargs)
    if forever:
        srv.serve_forever()
        return srv
    return srv.start()


def _listen_as_asyncio(sock: object, backlog: object) -> None:
    """``serve_protocol(..., sock=)``: as asyncio's ``create_server(sock=)``, which calls
    ``listen(backlog)`` on the socket it is given, a stream socket that is bound but not
    listening yet (what uvicorn's ``bind_socket`` hands over) is made to listen here, with
    the server's ``backlog``.  Anything else is left as it is -- a listening socket keeps
    its backlog -- for the server's own check, which refuses what it cannot accept on
    (closed, not a stream socket, connected, not bound: no port is picked for it)."""
    import socket
    if not isinstance(sock, socket.socket) or sock.fileno() < 0:
        return
    if backlog is None:
        backlog = Settings.backlog      # (the default)
    if type(backlog) is not int or not 0 <= backlog < 1 << 31:
        return              # (the server's settings refuse it, naming it)
    try:
        if (sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM
                or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
            return
        name = sock.getsockname()
        if not (name[1] if isinstance(name, tuple) else name):
            return          # not bound (port 0, no path)
        try:
            sock.getpeername()
        except OSError:
            sock.listen(backlog)
    except OSError:
        return              # (the server's check says what is wrong with it)


def _check_protocol_factory(factory: object) -> None:
    """``TypeError`` at the call for what would fail on every connection: a handler (served
    by ``Server``), a protocol instance (one object cannot serve every connection) or
    anything else that cannot be called."""
    import asyncio
    if isinstance(factory, Handler) or (isinstance(factory, type) and
                                        issubclass(factory, Handler)):
        name = (factory if isinstance(factory, type) else type(factory)).__qualname__
        raise TypeError(f"serve_protocol() takes an asyncio protocol factory; {name} is an "
                        f"aoprim Handler: serve it with Server({name}, ...)")
    is_protocol = isinstance(factory, asyncio.BaseProtocol)
    if is_protocol or not callable(factory):
        name = type(factory).__qualname__
        what = "a protocol instance" if is_protocol else "an object"
        raise TypeError(f"serve_protocol() takes a protocol factory, called once per "
                        f"connection, not {what} of type {name}: pass a class, "
                        f"serve_protocol(MyProtocol, ...), or a function returning a new "
                        f"protocol")
