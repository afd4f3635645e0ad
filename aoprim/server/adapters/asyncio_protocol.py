"""An adapter (not Layer 3 itself): run an unchanged ``asyncio.Protocol`` / ``asyncio.BufferedProtocol`` on the
aoprim server (see ``serve_protocol`` in :mod:`aoprim.server`).

Each session gets one protocol instance (from the factory) and one :class:`SessionTransport`.
``Protocol.data_received`` gets ``bytes`` (asyncio's contract: the protocol may keep them).
A ``BufferedProtocol`` gets its bytes through ``get_buffer``/``buffer_updated``: they were
received into pool slots by Layer 2 and are copied once, straight from the slot, into the
buffer the protocol hands out (with ``workers=N`` from the frame's ``bytes`` copy instead).
The transport's write buffer is the session's ``SendBatch``: ``get_write_buffer_size()`` is
its unsent bytes, and the protocol's ``pause_writing`` /
``resume_writing`` are called when it crosses the limits of ``set_write_buffer_limits``.

The callbacks come in asyncio's order: ``connection_lost()`` never runs inside the callback
that caused it (``abort()``, or ``close()`` with nothing left to write, inside
``connection_made`` or ``data_received``): it follows in a later loop callback, as asyncio's
``call_soon``, and no ``data_received`` comes after ``close()``/``abort()``.  The peer's EOF
calls ``eof_received()``; a false return closes the transport (what it wrote first is
sent), a true one keeps it open for writing until the protocol closes it (over TLS it closes
anyway, as asyncio's TLS transport).  A reset or another socket error gives
``connection_lost`` the ``OSError`` (``ConnectionResetError``), as asyncio.
``write_eof`` is not supported.  Over TLS
(``serve_protocol(..., ssl=ctx)``) ``get_extra_info`` answers asyncio's TLS names
(``sslcontext``, ``ssl_object``, ``peercert``, ``cipher``, ``compression``).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable

from ..handler import Handler

if TYPE_CHECKING:
    from collections.abc import Iterable

    from typing_extensions import Buffer

    from ..session import Session

__all__ = ["ProtocolHandler", "SessionTransport"]

log = logging.getLogger("aoprim.server")

# what asyncio's TLS transport answers in get_extra_info (and the session's ALPN name)
_TLS_NAMES = frozenset(("sslcontext", "ssl_object", "peercert", "cipher", "compression",
                        "selected_alpn_protocol"))


class SessionTransport(asyncio.Transport):
    """An ``asyncio.Transport`` over one session."""

    def __init__(self, session: Session, protocol: asyncio.BaseProtocol) -> None:
        super().__init__({"peername": session.peer})
        self._session = session
        self._protocol = protocol
        self._closing = False
        self._paused_reading = False
        self._low = self._high = 0
        self.set_write_buffer_limits()

    # -- writing -------------------------------------------------------------------------
    def write(self, data: Buffer) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, "
                            f"not {type(data).__name__!r}")
        if self._closing or not data:
            return
        self._session.send(data)

    def writelines(self, list_of_data: Iterable[Buffer]) -> None:
        data = b"".join(list_of_data)
        if data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self._session.pending_bytes

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 4 * low if low is not None else 64 * 1024
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._session.set_write_limits(high, low, self._pause_writing, self._resume_writing)

    def _pause_writing(self) -> None:
        try:
            self._protocol.pause_writing()
        except Exception:
            log.exception("protocol pause_writing() failed")

    def _resume_writing(self) -> None:
        try:
            self._protocol.resume_writing()
        except Exception:
            log.exception("protocol resume_writing() failed")

    # -- reading -------------------------------------------------------------------------
    def is_reading(self) -> bool:
        return not self._paused_reading and not self._closing

    def pause_reading(self) -> None:
        if self._closing or self._paused_reading:
            return
        self._paused_reading = True
        self._session.pause_reading()

    def resume_reading(self) -> None:
        if self._closing or not self._paused_reading:
            return
        self._paused_reading = False
        self._session.resume_reading()

    # -- closing -------------------------------------------------------------------------
    def is_closing(self) -> bool:
        return self._closing or self._session.closed

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._session.close()

    def abort(self) -> None:
        self._closing = True
        self._session.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        s = self._session
        if name == "peername":
            return s.peer
        if name == "sockname":
            return s.sockname
        if name == "socket":
            return s.socket
        if name in _TLS_NAMES:
            # asyncio's TLS transport's names ("sslcontext": uvicorn's is_ssl() asks it to
            # choose the https scheme), from the session's SSLObject; None over plain TCP
            obj = s.get_extra_info("ssl_object")
            if obj is None:
                return default
            if name == "sslcontext":
                return obj.context
            if name == "compression":
                return obj.compression()
            return s.get_extra_info(name, default)
        return super().get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol


class ProtocolHandler(Handler):
    """A Handler that drives one asyncio protocol per session."""

    def __init__(self, protocol_factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self._factory = protocol_factory

    def on_connect(self, session: Session) -> None:
        proto = self._factory()
        tr = SessionTransport(session, proto)
        session.user = (proto, tr, isinstance(proto, asyncio.BufferedProtocol))
        proto.connection_made(tr)

    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        proto, tr, buffered = session.user
        if tr._closing:
            return
        if not buffered:
            proto.data_received(bytes(data))
            return
        n = len(data)
        off = 0
        while off < n:
            buf = proto.get_buffer(n - off)
            mv = memoryview(buf).cast("B")
            k = min(mv.nbytes, n - off)
            if k <= 0:
                raise RuntimeError("get_buffer() returned an empty buffer")
            mv[:k] = data[off:off + k]
            mv.release()
            proto.buffer_updated(k)
            off += k
            if off < n and (not tr.is_reading() or tr.is_closing()):
                # as asyncio: nothing more for the protocol in this call.  After close() or
                # abort() the rest is dropped; after pause_reading() it is handed back to
                # the session and comes first once reading resumes
                if not tr.is_closing():
                    session.unread(data[off:])
                return

    def _on_peer_eof(self, session: Session) -> bool:
        """The peer's EOF (see Session._peer_eof_keeps_open): the protocol's
        ``eof_received()``; True keeps the transport open for writing."""
        if session.user is None:
            return False
        proto, tr, _ = session.user
        if tr._closing:
            return False
        return bool(proto.eof_received())

    def on_close(self, session: Session, exc: BaseException | None) -> None:
        if session.user is None:
            return
        proto, tr, _ = session.user
        tr._closing = True
        session.user = None
        if exc is None:
            # a reset or another socket error: asyncio hands connection_lost the OSError
            # (ConnectionResetError for ECONNRESET)
            exc = session.lost_error()
        proto.connection_lost(exc)
