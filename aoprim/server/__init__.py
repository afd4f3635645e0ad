"""aoprim.server -- a three-layer server built from aoprim's primitives.

::

    +------------------------------------------------------------------+
    | Layer 3  your code          handler.py  (Handler.on_read)        |
    |          apps.py (echo, chat)   protocol.py (asyncio adapter)    |
    +------------------------------------------------------------------+
    | Layer 2  sessions           session.py  (Server, Session)        |
    |          SlabPool slots, framing.py (raw/u16/u32, pure),         |
    |          SendBatch + dirty list, RefCount lifetimes, limits,     |
    |          workers.py (MPMCQueue completions, IOCP shape)          |
    +------------------------------------------------------------------+
    | Layer 1  event loop         loop.py  (selectors, eventfd wake-up,|
    |                                       timer heap)                |
    +------------------------------------------------------------------+
    | OS       epoll, sockets                                          |
    +------------------------------------------------------------------+

Each layer imports only the one below it (tests/test_layering.py checks): handler.py imports
nothing of the server and no socket/selectors; session.py imports loop.py and framing.py;
loop.py imports nothing of the server.  This package module composes them.

Example::

    from aoprim.server import Server, Handler

    class Echo(Handler):
        def on_read(self, session, data):
            session.send(data)

    srv = Server(Echo(), host="127.0.0.1", port=0, framing="u16").start()
    ...
    srv.shutdown()
"""
from .framing import FRAMINGS, FrameDecoder, FrameTooLarge, Framing
from .handler import Handler
from .loop import BACKENDS, BackendUnavailable
from .protocol import ProtocolHandler, SessionTransport
from .session import Server, Session

__all__ = ["Server", "Session", "Handler", "serve_protocol", "Framing", "FrameDecoder",
           "FrameTooLarge", "FRAMINGS", "BACKENDS", "BackendUnavailable", "SessionTransport"]


def serve_protocol(protocol_factory, host="127.0.0.1", port=0, *, forever=False, **kwargs):
    """Run an unchanged ``asyncio.Protocol`` / ``asyncio.BufferedProtocol`` on this server.

    ``protocol_factory()`` is called once per connection, as with ``loop.create_server``.
    Returns the started :class:`Server` (serving in a background thread; ``srv.address``,
    ``srv.shutdown()``), or with ``forever=True`` serves in the calling thread until
    SIGINT/SIGTERM.  Other keyword arguments go to :class:`Server` (framing is ``raw``).
    """
    kwargs.setdefault("framing", "raw")
    if kwargs["framing"] != "raw":
        raise ValueError("asyncio protocols parse their own stream: framing must be 'raw'")
    srv = Server(ProtocolHandler(protocol_factory), host, port, **kwargs)
    if forever:
        srv.serve_forever()
        return srv
    return srv.start()
