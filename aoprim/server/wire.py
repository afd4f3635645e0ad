"""Layer 2 -- a session's wire: what lies between its send batch / receiver and the socket.

A :class:`~.session.Session` owns one wire, made by its server's ``SessionContext.wire``
class: :class:`PlainWire` (the bytes go to the socket as they are) or
:class:`~.tls.TLSWire` (TLS over a ``MemoryBIO`` pair).  The session keeps the connection's
policy -- its states, close paths, limits and the handler's hooks -- and asks its wire only
the questions below; the wire acts on the session only through the session's ``wire_*``
methods and ``flushed()``.

What a wire offers its session (loop thread unless said otherwise):

- class attributes: ``in_flush_group`` (the session's batch joins the server's
  ``FlushGroup``; a TLS batch holds plaintext, flushed by the TLS flush instead),
  ``reads_proxy_header`` (the wire reads the PROXY header itself, so the receiver does not),
  ``handshake`` (the handler meets the session only once the wire calls ``wire_open``),
  ``half_close`` (a peer's EOF may leave the session open for writing);
- ``reader``: the first read callback; ``sink``: what the session's send adds to -- the
  batch itself (plain), or an object whose ``send_frame(data, header_size)`` /
  ``send_copy(data)`` add to the batch and mark it for the wire's flush in one compiled call
  (any thread; -1: another thread, -2: a large memoryview or closed, nothing added), which
  ``SinkSession`` / ``RawSinkSession`` call (TLS);
- ``pending`` (any thread): bytes owed beyond the batch's (TLS: ciphertext not yet sent);
- ``sent()``: the batch gained data outside ``add_*``; ``requeue()``: flush it this
  iteration anyway; ``flush_once()``: one non-blocking attempt now (before an abort);
  ``write_now()``: hand what is pending to the socket now, 0 all sent, 1 some left, -errno;
- ``end_output()``: everything owed is sent and the session is closing: write the wire's own
  end (TLS: ``close_notify``) and send it, as ``write_now``; ``owes_output()``: something is
  still to be written before the write side may be shut;
- ``holds_input()``: input waits that no readiness event will announce;
- ``failed()``: why the wire failed (a reason for the close), or None; ``lost_error()``:
  the error for ``connection_lost`` then, or None;
- ``extra_info(name, default)``, ``bytes_written()`` (bytes on the socket, for the clocks),
  ``start()`` (right after the accept), ``close()`` (the end of the session's teardown:
  drop every reference back to the session).
"""
from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import socket

    from aoprim import SendBatch

    from .rx import Rx
    from .session import Session, SessionContext

__all__ = ["PlainWire"]


class PlainWire:
    """Plain TCP: the batch is in the server's ``FlushGroup`` (an add marks it for the
    iteration's flush), the receiver reads the socket itself.  Holds no reference to its
    session."""

    __slots__ = ("reader", "sink", "_batch", "_flusher")

    in_flush_group = True
    reads_proxy_header = False
    handshake = False
    half_close = True
    pending = 0

    def __init__(self, session: Session, ctx: SessionContext, sock: socket.socket,
                 batch: SendBatch, rx: Rx) -> None:
        self.reader: Callable[[], object] = rx.receiver.on_readable
        self.sink: object = batch
        self._batch = batch
        self._flusher = ctx.flusher

    def sent(self) -> None:
        pass        # (the FlushGroup saw the add)

    def requeue(self) -> None:
        self._flusher.requeue(self._batch)

    def flush_once(self) -> None:
        b = self._batch
        if b.group is not None and b.pending_bytes:
            b.flush()

    def write_now(self) -> int:
        b = self._batch
        if b.group is None:             # (detached at the teardown)
            return 1
        try:
            b.flush()
        except OSError as e:
            return -(e.errno or errno.EIO)
        except RuntimeError:            # another thread holds the batch: the flush will
            return 1
        return 1 if b.pending_bytes else 0

    def end_output(self) -> int:
        return 0

    def owes_output(self) -> int:
        return self._batch.pending_msgs

    def holds_input(self) -> bool:
        return False

    def failed(self) -> str | None:
        return None

    def lost_error(self) -> OSError | None:
        return None

    def extra_info(self, name: str, default: Any) -> Any:
        return default

    def bytes_written(self) -> int:
        return self._batch.stats["bytes"]

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass
