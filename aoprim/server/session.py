"""Layer 2 -- one connection: its state machine, its lifetime and its public API.

One idea, a connection's life (over 800 lines): its states and every path from the accept
to ``on_close`` -- sends, back-pressure, limits, the close paths -- share the invariants
below; its parts are modules of their own (:mod:`.rx`, :mod:`.tx`, :mod:`.wire` and
:mod:`.tls`, :mod:`.dispatch`).

A session composes its parts: the receive side (:mod:`.rx`: the compiled ``Receiver`` is
the loop's read callback and calls ``on_read`` itself), the send side (:mod:`.tx`: a
``SendBatch`` flushed by the server's per-iteration ``FlushGroup``; sends from other threads
handed over one item per send), its wire (:mod:`.wire`: plain TCP, or TLS in :mod:`.tls`
-- what lies between those two and the socket) and its place in the dispatch
(:mod:`.dispatch`).

States: OPEN -> CLOSING -> CLOSED.

- OPEN: reading unless a pause reason is set (:class:`.rx.Rx`); sends are accepted.
- CLOSING (graceful close: by the application, a handler exception, the peer's EOF, a
  protocol violation, shutdown): no more frames are delivered (the receiver gives its buffers
  back at once); what was sent is flushed (bounded by ``close_linger``); then the write side
  is shut and unread input drained (a *lingering close*: closing a socket with unread input
  sends an RST that can destroy the reply still in flight), then CLOSED.
  (An asyncio transport's session -- ``set_transport_rules`` -- flushes with no
  ``close_linger`` bound: only ``idle_timeout``, if set, cuts a peer that takes nothing.)
- CLOSED (teardown, also the abort path: reset, send/recv error, timeouts, ``max_pending``):
  the fd leaves the loop and is closed -- with a reset (RST) when a server limit dropped
  bytes still owed, so the peer cannot take the cut stream for a whole one -- every buffer
  goes back, queued foreign sends are released, ``on_close`` runs exactly once (on the
  worker, after the last ``on_read``, when there are workers), the loop's reference is
  dropped.

``on_close`` never runs inside the code that closed the session -- a hook calling ``close()``
or ``abort()`` included: teardown queues it as a loop callback of its own (asyncio defers
``connection_lost`` the same way, with ``call_soon``), so it runs after the current hook
returns, and with workers it is posted to the session's backlog from there, behind every
``on_read``.

Lifetime: a ``RefCount`` starts at 1 (the loop's, dropped by the callback that runs or
posts ``on_close`` after teardown); each item queued for a worker holds one more.  At zero
the session leaves the server's live set.

Threads: everything but ``send``, ``close``, ``abort``, ``pause_reading``, ``resume_reading``
(and the dispatch hooks a worker calls) runs on the loop thread; those hop to it.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable, Union

from aoprim import RefCount, SendBatch, Slot
from aoprim.server._receiver import Receiver

from .dispatch import CLOSE_MARK, EOF_MARK, WorkState, fork_returned, forks_made
from .proxy import client_address
from .rx import (PAUSE_BACKLOG, PAUSE_BACKPRESSURE, PAUSE_CLOSING, PAUSE_EOF, PAUSE_SHUTDOWN,
                 PAUSE_USER, RX_EOF, RX_ERROR, RX_FORKED, RX_HANDLER, RX_PROXY, RX_PROXY_ERROR,
                 RX_TOO_LARGE, Rx)
from .tx import BYREF_MIN, ForeignSends, foreign_item, release_item

if TYPE_CHECKING:
    from asyncio.trsock import TransportSocket

    from typing_extensions import Buffer, TypeAlias

    from aoprim.server._rxbuf import RxArena
    from aoprim.server._tls import TLSFlush

    from .config import Settings
    from .dispatch import InlineDispatch, WorkerDispatch
    from .loop import EventLoop, Timer
    from .server import Server
    from .stats import Stats
    from .tx import Flusher
    from .wire import PlainWire
    from .tls import TLSWire

    #: what send() takes: any bytes-like object (bytes, bytearray, memoryview, ...) or a
    #: pool Slot (retained, not copied)
    _SendData: TypeAlias = Union[Buffer, Slot]

__all__ = ["Session", "SessionContext", "RawSession", "SinkSession", "RawSinkSession"]

log = logging.getLogger("aoprim.server")

OPEN, CLOSING, CLOSED = 0, 1, 2
_get_ident = threading.get_ident
try:
    import fcntl
except ImportError:
    fcntl = None    # type: ignore[assignment]
# Linux's SIOCOUTQNSD (linux/sockios.h): bytes in a socket's send queue not sent yet
_SIOCOUTQNSD = 0x894B if fcntl is not None and sys.platform.startswith("linux") else None
_is_frame_view = Receiver.is_frame_view
_frame_header = SendBatch.frame_header
_RESET_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.ECONNABORTED}
_LINGER_READS = 16          # reads of unread input per lingering-close callback
_DISCARD = 65536
_SOL_SOCKET = socket.SOL_SOCKET
_SO_LINGER = socket.SO_LINGER
_SHUT_RDWR = socket.SHUT_RDWR
# struct linger {int l_onoff; int l_linger;}: off, and on with 0 (a reset) never block close()
_LINGER_OFF = bytes(8)
_LINGER_RESET = (1).to_bytes(4, sys.byteorder) + bytes(4)
_NO_BLOCKING_LINGER = (_LINGER_OFF, _LINGER_RESET)
# the close causes that are a server limit cutting the session (see Session.limit_error)
_LIMIT_CAUSES = frozenset(("max_pending", "timeout", "linger"))
# an asyncio transport's writer told pause_writing() is cut once this many times
# max(max_pending, high mark) is pending before a write (see Session.over_max_pending)
_PAUSED_CAP_FACTOR = 16
# pause reasons under which the server itself keeps a session from being read: its idle and
# frame clocks stop (rx.Rx.sweep)
# (PAUSE_EOF: a half-closed peer waits for the replies its frames still queued for a worker)
_SERVER_HOLDS = PAUSE_USER | PAUSE_BACKLOG | PAUSE_SHUTDOWN | PAUSE_EOF


def _unsent(fd: int, _buf: bytes = bytes(4)) -> int:
    """Bytes in the kernel's send queue of ``fd`` not sent yet (the peer's window is full):
    ``SIOCOUTQNSD``; 0 where it cannot be asked."""
    if _SIOCOUTQNSD is None:
        return 0
    try:
        return int.from_bytes(fcntl.ioctl(fd, _SIOCOUTQNSD, _buf), sys.byteorder)
    except OSError:
        return 0


_SESSION_SOCKET: Any = None


def _session_socket_type() -> Any:
    """asyncio's ``TransportSocket`` with a session's ``shutdown()`` (made on first use:
    asyncio is imported only for who asks)."""
    global _SESSION_SOCKET
    if _SESSION_SOCKET is None:
        import operator
        from asyncio.trsock import TransportSocket

        class SessionSocket(TransportSocket):
            # (the session by weak reference: a socket object kept by the application
            # does not keep a closed session, its wire and its buffers' owners alive)
            __slots__ = ("_session", "wr_shut")

            def __init__(self, sock: socket.socket, session: Session) -> None:
                super().__init__(sock)
                self._session = weakref.ref(session)
                # shutdown(SHUT_WR or SHUT_RDWR) was called on another thread than the
                # loop's, which runs it later: a writer on that thread must send behind
                # it (the asyncio adapter's write() does)
                self.wr_shut = False

            def shutdown(self, how: int) -> None:
                session = self._session()
                if session is None:
                    self._sock.shutdown(how)    # (nothing left to send first)
                    return
                if _get_ident() != session._loop.thread_id:
                    # it runs on the loop thread later: what the kernel would refuse at
                    # once is refused here, at the call, as on the loop thread
                    how = operator.index(how)
                    if self._sock.fileno() < 0:
                        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
                    if how not in (socket.SHUT_RD, socket.SHUT_WR, socket.SHUT_RDWR):
                        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
                    if how != socket.SHUT_RD:
                        self.wr_shut = True
                session._shutdown_socket(how)

        _SESSION_SOCKET = SessionSocket
    return _SESSION_SOCKET


class SessionContext:
    """What a session needs from its server, as public attributes (filled by Server)."""

    __slots__ = ("server", "loop", "settings", "flusher", "arena", "dispatch", "stats",
                 "session_closed", "session_gone", "tls", "kick", "wire")

    server: Server
    loop: EventLoop
    settings: Settings
    flusher: Flusher
    arena: RxArena
    dispatch: InlineDispatch | WorkerDispatch
    stats: Stats
    session_closed: Callable[[Session], None]
    session_gone: Callable[[Session], None]
    tls: TLSFlush | None
    kick: Callable[[], None]
    wire: type[PlainWire] | type[TLSWire]     # each session's wire (see .wire)


class _WriteLimits:
    """A ``set_write_limits`` made on another thread, queued with its sends (ForeignSends:
    it carries no bytes and retains nothing)."""
    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args


class _WriterPaused:
    """``writer_paused()`` on another thread, queued behind the sends that crossed the high
    mark (as _WriteLimits: no bytes)."""
    __slots__ = ()


_WRITER_PAUSED = _WriterPaused()


class Session:
    """One connection.  Public: ``send``, ``close``, ``abort``, ``peer``, ``proxy_peer``,
    ``id``, ``closed``, ``close_reason``, ``server``, ``user`` (free for the application),
    ``pause_reading``/``resume_reading``, ``pending_bytes``, ``sockname``, ``socket``.

    Nothing here calls ``on_read``: the compiled ``Receiver`` does, from the loop's read
    callback, through the frame callback ``__init__`` wires into :class:`~.rx.Rx` (the
    handler's ``on_read``, or with workers the dispatcher's ``post_frame``)."""

    __slots__ = ("id", "peer", "proxy_peer", "server", "user", "work", "_ctx", "_sock", "_fd",
                 "_loop", "_state", "_reason", "_exc", "_rc", "_batch",
                 "_hs", "_hw", "_nout", "_foreign", "_rx", "_reader", "_writing", "_wm",
                 "_wm_paused", "_timer", "_lingering", "_sockname", "_close_requested", "_rst",
                 "_proxy_wait", "_sent_seen", "_owed_seen", "_oserr", "_peer_failed",
                 "_rest", "_cb_hold", "_transport", "_cap", "_limit", "_limit_cause",
                 "_progress_at", "_forks_at_accept", "_wire", "_sink", "_await_answer",
                 "_peer_eof", "__weakref__")

    id: int                 # 1, 2, ... in the order the server accepted them
    #: the client's address as ``socket.accept()`` gives it (``(host, port)`` for IPv4,
    #: ``(host, port, flowinfo, scope_id)`` for IPv6, a path for AF_UNIX) or, with the PROXY
    #: protocol, the ``(host, port)`` its header names
    peer: Any
    proxy_peer: Any         # the balancer's address under the PROXY protocol, else None
    server: Server
    user: Any               # free for the application
    work: WorkState | None  # the session's place in the worker dispatch (workers only)

    def __init__(self, ctx: SessionContext, sock: socket.socket, sid: int, peer: Any) -> None:
        self.id = sid
        self.peer = peer
        self.proxy_peer = None
        self.server = ctx.server
        self.user = None
        self._ctx = ctx
        self._sock = sock
        self._fd = sock.fileno()
        self._forks_at_accept = forks_made()    # (see _teardown: a fork may share the socket)
        loop = ctx.loop
        self._loop = loop
        self._state = OPEN
        self._reason: str | None = None
        self._exc: BaseException | None = None
        self._rc: RefCount = RefCount(1, self._on_zero)
        wire_cls = ctx.wire
        # (a TLS session's batch stays out of the FlushGroup: TLSFlush encrypts it)
        self._batch = ctx.flusher.new_batch(sock, self, wire_cls.in_flush_group)
        self._batch.owner_thread = loop.thread_id   # sends from other threads: -1 (slow path)
        self._hs = ctx.settings.header_size
        # a send above this takes _over_high: the high-water mark, or max_pending if lower
        # (both are checked there); -1 while write limits are set
        self._hw = min(ctx.settings.high_water, ctx.settings.max_pending)
        self._nout = 0                      # frames sent on the loop thread
        self._foreign = ForeignSends(loop, self._drain_foreign)
        d = ctx.dispatch
        self.work = WorkState() if d.copy_frames else None
        self._rx = Rx(ctx.arena, self._fd, ctx.settings, d.frame_callback(self),
                      self._rx_event, self, d.copy_frames, loop.time(),
                      not wire_cls.reads_proxy_header)
        wire = self._wire = wire_cls(self, ctx, sock, self._batch, self._rx)
        self._reader: Callable[[], object] | None = wire.reader
        # the wire's sink: SinkSession's send adds and marks for the wire's flush with one
        # compiled call of it (TLS: TLSConn.send_frame)
        self._sink = wire.sink
        self._writing = False               # write interest armed (the socket would block)
        # (high, low, on_high, on_low): set_write_limits
        self._wm: tuple[int, int, Callable[[], object], Callable[[], object]] | None = None
        self._wm_paused = False
        self._timer: Timer | None = None    # close linger / lingering-close timer
        self._lingering = False             # draining unread input after SHUT_WR
        # (lingering) an abortive TLS close waits for the peer's answer to close_notify
        self._await_answer = False
        self._sockname: Any = None
        # a close decided on another thread (close(), abort(), a hook's exception on a
        # worker, max_pending of a queued send) that the loop has not run yet: from then on
        # no frame is delivered and sends are dropped
        self._close_requested = False
        self._rst = False                   # close with a reset (handler_failed's reset)
        # True while the handler has not met this session (no on_connect yet, so no on_close
        # and no broadcasts): the PROXY protocol until the header is read, a wire's
        # handshake until it is done (wire_open), a failed start()
        self._proxy_wait = ctx.settings.proxy_protocol is not None or wire_cls.handshake
        self._sent_seen = 0                 # bytes the peer had taken when the sweep last
        self._owed_seen = False             #   looked, and whether output was owed then
        # the errno of the recv or send error that ended the session (a reset: ECONNRESET),
        # else None: the asyncio adapter gives connection_lost an OSError made from it
        self._oserr: int | None = None
        # the stream failed (reset, recv/send error) while the session was open: frames read
        # before it and still queued for a worker are delivered (see takes_frames)
        self._peer_failed = False
        self._peer_eof = False              # the peer's end of stream was read
        # workers=0: the rest of a frame that on_read handed back with unread() after pausing
        # reading; delivered first once reading resumes
        self._rest: bytes | None = None
        self._cb_hold = False               # hold_for_callbacks: its release is queued
        # an asyncio transport's rules (set_transport_rules): close() waits for the backlog,
        # max_pending counts what was pending before each send
        self._transport = False
        self._cap = 0                       # a transport's max_pending: max(it, high-water)
        # the reason and cause when a server limit (max_pending, a timeout, close_linger)
        # ended the session, else None (see limit_error)
        self._limit: str | None = None
        self._limit_cause: str | None = None
        self._progress_at = 0.0             # a transport's close: when the peer last took bytes

    def __repr__(self) -> str:
        st = ("open", "closing", "closed")[self._state]
        return f"<Session {self.id} {self.peer} {st}>"

    # -- public API ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once the session is closing or closed (sends are then dropped)."""
        return self._state != OPEN or self._close_requested

    @property
    def takes_frames(self) -> bool:
        """Whether a frame queued for a worker still goes to ``on_read``: while open, and
        after the stream failed under an open session (a reset: asyncio too delivers what
        was read before the error) -- not once the application, a hook's exception or a
        server limit closed it (those drop what is still queued)."""
        return not self._close_requested and (self._state == OPEN or self._peer_failed)

    @property
    def close_reason(self) -> str | None:
        return self._reason

    @property
    def pending_bytes(self) -> int:
        """Bytes accepted by send() and not yet written (approximate off the loop thread);
        over TLS, plaintext not yet encrypted plus ciphertext not yet sent."""
        return self._batch.pending_bytes + self._wire.pending

    def unsent_bytes(self) -> int:
        """``pending_bytes`` plus what other threads sent that the loop thread has not
        added yet (any thread): all a writer has handed over and the peer has not been
        sent -- an asyncio transport's ``get_write_buffer_size()``, from a worker too."""
        return self.pending_bytes + self._foreign.queued

    @property
    def socket(self) -> TransportSocket:
        """The connection's socket, for inspection and socket options: asyncio's
        ``TransportSocket`` over it, as ``get_extra_info("socket")`` on an asyncio transport,
        so it refuses ``setblocking(True)`` and ``settimeout()`` other than 0 (ValueError) --
        the loop reads, writes and drains it assuming it never blocks.  Its ``shutdown()``
        first hands what was sent to the kernel (one non-blocking attempt, as asyncio's
        ``write()`` has made before), so a ``shutdown(SHUT_WR)`` after ``send()`` does not
        overtake the data; from another thread it runs on the loop thread, after what that
        thread sent.  Close the session with close()/abort(), never the socket itself: the
        loop owns its fd."""
        return _session_socket_type()(self._sock, self)

    def _shutdown_socket(self, how: int) -> None:
        """The session socket's ``shutdown(how)`` (see ``socket``)."""
        if _get_ident() != self._loop.thread_id:
            # behind this thread's sends, which are queued for the loop thread
            self._loop.call_soon_threadsafe(self._shutdown_later, how)
            return
        if self._state != CLOSED and not self._lingering:
            self._send_once()
        self._sock.shutdown(how)

    def _shutdown_later(self, how: int) -> None:
        try:
            self._shutdown_socket(how)
        except OSError:
            pass        # (not connected any more, closed: as a send would find it)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """As asyncio's transports: ``"peername"`` (the client's address: ``peer``, the
        PROXY header's when the PROXY protocol is on), ``"sockname"``; TLS sessions also
        answer ``"ssl_object"``, ``"peercert"``, ``"cipher"``, ``"selected_alpn_protocol"``.
        Anything else: ``default``."""
        if name == "peername":
            return self.peer
        if name == "sockname":
            return self.sockname
        return self._wire.extra_info(name, default)

    @property
    def sockname(self) -> Any:
        if self._sockname is None:
            try:
                self._sockname = self._sock.getsockname()
            except OSError:
                return None
        return self._sockname

    def send(self, data: _SendData) -> None:
        """Queue ``data`` (bytes-like or ``Slot``) for sending; with u16/u32 framing a header
        is added.  Thread-safe; what one thread sends leaves in that order.  The data is
        copied (a ``Slot`` is retained instead), so the caller may reuse its buffer at once.
        A payload too long for the header raises ``ValueError``; after close, sends are
        dropped."""
        if self._state:
            self._send_slow(data)
            return
        if (type(data) is memoryview and data.nbytes >= BYREF_MIN and _is_frame_view(data)
                and _get_ident() == self._loop.thread_id):
            p = self._send_frame_view(data)
        else:
            # one C call: header + payload (copied when small, as one message; bytes by
            # reference and a Slot retained when large); ValueError when it does not fit.
            # -1: called from another thread (the batch's owner_thread is the loop's):
            # nothing was added, take the thread-safe path
            p = self._batch.add_frame(data, self._hs)
            if p < 0:
                self._send_slow(data)
                return
        self._nout += 1
        if p > self._hw:
            self._over_high()

    def _send_frame_view(self, data: memoryview) -> int:
        """send() of a large receive frame view with u16/u32 framing (loop thread): its
        header, then the view by reference -- an export the batch holds until it is sent,
        as in _send_raw.  The header is built first (ValueError: nothing
        added); if the view cannot be added after it, the stream is broken and the
        session is aborted."""
        b = self._batch
        hdr = _frame_header(data.nbytes, self._hs)
        try:
            b.add_many((hdr, data))
        except BaseException:
            self._abort("a frame could not be queued after its header", cause="send error")
            raise
        return self._write_now()

    def _write_now(self) -> int:
        """After a large by-reference send (loop thread): hand the batch to the kernel now,
        as asyncio's ``write()`` does, instead of at the iteration's end; returns the bytes
        still pending.  A large echo has nothing to coalesce with, and waiting costs cache:
        every session served in the iteration kept its own read slot (or frame buffer)
        pinned until the flush, so a burst of 10 x 512 KiB echoes copied 5 MiB in and out
        of memory that had left the CPU's cache, where writing at once frees the slot for
        the next read while its bytes are still cached.  Not while the socket is
        waiting to be writable (the writer sends, in order).  The wire writes (TLS:
        encrypts and sends, unless no application data may be encrypted yet or any more).
        A write error is handled as the iteration's flush reports one: the session is
        aborted."""
        if self._writing:
            return self.pending_bytes
        status = self._wire.write_now()
        if status < 0:
            self.flushed(status)
            return 0
        return self.pending_bytes

    def _send_raw(self, data: _SendData) -> None:
        """send() with raw framing (installed as ``send`` by :class:`RawSession`)."""
        if self._state:
            self._send_slow(data)
            return
        if (type(data) is memoryview and data.nbytes >= BYREF_MIN and _is_frame_view(data)
                and _get_ident() == self._loop.thread_id):
            # a large frame view of receive memory: read-only, and its memory
            # is pinned -- never read over -- while any export of it lives, so the batch
            # holds an export of it (add()) instead of a copy; the receiver swaps in a
            # fresh read slot, and this one goes back to its pool once the send is done.
            # That pins the whole read slot (512 KiB) for as long as the send is pending:
            # by reference only into an empty batch (one pinned slot, the ping-pong case)
            # or for a view of at least half a slot; else copied -- so a peer that does not
            # read makes its session pin one slot plus at most 2x its pending bytes, not a
            # slot per echo
            b = self._batch
            if b.pending_bytes == 0 or 2 * data.nbytes >= self._ctx.arena.raw_read_size:
                b.add(data)
                p = self._write_now()
            else:
                p = b.add_copy(data)
        else:
            # add_copy copies a view or bytearray (the memory under a frame view is reused
            # after on_read), keeps bytes by reference, retains a Slot; -1: another thread
            p = self._batch.add_copy(data)
            if p < 0:
                self._send_slow(data)
                return
        self._nout += 1
        if p > self._hw:
            self._over_high()

    def _send_via_sink(self, data: _SendData) -> None:
        """send() with u16/u32 framing for a wire whose sink adds and marks the session for
        the wire's flush in one compiled call (installed as ``send`` by :class:`SinkSession`;
        TLS: ``TLSConn.send_frame``, which also leaves large memoryviews to ``Session.send``'s
        by-reference path, without Python bytecode for the size test)."""
        if not self._state:
            p = self._sink.send_frame(data, self._hs)
            if p >= 0:                      # the loop thread, the batch's owner
                self._nout += 1
                if p > self._hw:
                    self._over_high()
                return
            if p == -1:
                self._send_slow(data)       # another thread: queued for the loop
                return
            # -2: a memoryview of at least BYREF_MIN bytes, or the sink already closed:
            # the session's own send path decides
        Session.send(self, data)
        # marked on the loop thread only: a send from another thread was queued for the
        # loop, whose _drain_foreign marks the session (the dirty list is the loop's)
        if _get_ident() == self._loop.thread_id:
            self._wire.sent()

    def _send_raw_via_sink(self, data: _SendData) -> None:
        """send() with raw framing for a wire whose sink adds and marks in one call
        (installed as ``send`` by :class:`RawSinkSession`): as _send_via_sink."""
        if not self._state:
            p = self._sink.send_copy(data)
            if p >= 0:
                self._nout += 1
                if p > self._hw:
                    self._over_high()
                return
            if p == -1:
                self._send_slow(data)
                return
        self._send_raw(data)
        if _get_ident() == self._loop.thread_id:
            self._wire.sent()

    def close(self) -> None:
        """Close gracefully: stop reading, flush what is owed, shut the write side, close.
        Thread-safe."""
        if self._state != OPEN:
            return
        if _get_ident() == self._loop.thread_id:
            self._close("closed by the application")
        else:
            # from now on this session is closed for its worker: later frames are not
            # delivered and later sends are dropped, as on the loop thread
            self._close_requested = True
            self._loop.call_soon_threadsafe(self._close, "closed by the application")

    def send_after_close(self, data: Buffer) -> bool:
        """An asyncio transport's ``write()`` after its ``close()`` while the backlog from
        before is still being sent (loop thread): added to it, as asyncio's selector
        transport still queues and sends such a write.  The backlog is what the socket did
        not take: the batch is offered to it first.  Dropped once the backlog is out
        (the write side is shut or about to be), after an abort, and from another thread
        (a worker's close is not seen here in order with its writes).  True if queued."""
        if (self._state != CLOSING or self._lingering or not self._transport
                or _get_ident() != self._loop.thread_id or not self._batch.pending_msgs):
            return False
        # asyncio's write() has offered its bytes to the socket already, so its backlog is
        # what the kernel did not take: offered here too, once, before it counts
        self._send_once()
        if not self._batch.pending_msgs:
            return False
        b = self._batch
        p = b.add_frame(data, self._hs) if self._hs else b.add_copy(data)
        if p >= 0:                      # (-1: the batch is another thread's; not here)
            self._nout += 1
            return True
        return False

    def abort(self) -> None:
        """Close at once, dropping what is unsent.  Thread-safe."""
        if self._state == CLOSED:
            return
        if _get_ident() == self._loop.thread_id:
            self._abort("aborted by the application")
        else:
            # closed for its worker from now on, as close() (no more frames, sends dropped)
            self._close_requested = True
            self._loop.call_soon_threadsafe(self._abort, "aborted by the application")

    def abort_sending(self) -> None:
        """abort() that first hands what is queued to the kernel with one non-blocking
        attempt (TLS: encrypted and sent), as an asyncio transport's ``write()`` has already
        tried the socket before ``abort()``: the peer gets what fits in the socket buffer,
        the rest is dropped.  Thread-safe (off the loop thread, the attempt comes after the
        sends this thread made before)."""
        if self._state == CLOSED:
            return
        if _get_ident() == self._loop.thread_id:
            self._send_then_abort()
        else:
            self._close_requested = True
            self._loop.call_soon_threadsafe(self._send_then_abort)

    def _send_then_abort(self) -> None:
        if self._state == CLOSED:
            return
        if not self._lingering:
            self._send_once()
        self._abort("aborted by the application")

    def _send_once(self) -> None:
        """One non-blocking attempt to write what the batch holds (loop thread): the wire's
        (TLS: the server's TLS flush, the iteration hook, run early, encrypts and sends)."""
        try:
            self._wire.flush_once()
        except (OSError, RuntimeError):
            pass            # (the abort follows: a send error changes nothing)
        except Exception as e:      # another TLS session's callback in the early flush
            log.error("session %d: flush before abort failed", self.id, exc_info=e)

    def set_transport_rules(self) -> None:
        """An asyncio transport's rules for this session (the asyncio adapter, loop thread,
        before any send): ``close()`` waits until the backlog is sent, with no
        ``close_linger`` bound (only ``idle_timeout``, if set, cuts a peer that takes
        nothing: check_timeouts), and a send is cut for size only once the writer has been
        told to pause and writes on past a generous cap (:meth:`over_max_pending`)."""
        self._transport = True
        self._set_cap()

    def _set_cap(self) -> None:
        mp = self._ctx.settings.max_pending
        self._cap = _PAUSED_CAP_FACTOR * (mp if self._wm is None else max(mp, self._wm[0]))

    def over_max_pending(self, told: bool = False) -> bool:
        """A transport's check before a send (any thread).  Writes are never cut for size
        while the writer has not been told to pause (``on_high`` of the write limits: the
        protocol's ``pause_writing()``) -- asyncio buffers them all, and an HTTP response
        written as a head, a large body and a terminator in one callback must reach the
        peer whole.  Once told, more than ``16 * max(max_pending, high)`` bytes pending
        (``high``: the write limits' high-water mark; 64 MiB with the defaults) means the
        writer ignores ``pause_writing`` and the peer does not read: the session is dropped
        (a reset; connection_lost gets a ConnectionAbortedError naming the limit) and True
        is returned.  ``told``: the writer knows it was told (it paused itself on another
        thread: writer_paused, which the loop thread may not have taken yet)."""
        if not (told or self._wm_paused):
            return False
        # (sends another thread made that the loop has not added yet count too)
        p = self.unsent_bytes()
        cap = self._cap
        if p <= cap:
            return False
        reason = (f"max_pending exceeded ({p} unsent bytes > {cap} before a write): the "
                  f"protocol writes on after pause_writing() and the peer does not read")
        if _get_ident() == self._loop.thread_id:
            self._abort(reason, None, logging.WARNING, "max_pending")
        elif not self._close_requested:
            self._close_requested = True
            self._loop.call_soon_threadsafe(self._abort, reason, None, logging.WARNING,
                                            "max_pending")
        return True

    def pause_reading(self) -> None:
        """Stop reading, and delivering frames, until resume_reading().  Thread-safe.  Inside
        on_read it takes effect after that call: no further on_read runs while paused --
        frames already read (with workers: already queued for the worker) are held, in
        order, and delivered after resume_reading()."""
        w = self.work
        if w is not None:
            with w.lock:                # seen by the worker before its next frame
                w.user_paused = True
        self._set_pause(PAUSE_USER, True)

    def resume_reading(self) -> None:
        """Undo pause_reading(): reading resumes, frames held meanwhile are delivered first.
        Thread-safe."""
        w = self.work
        if w is not None:
            with w.lock:
                w.user_paused = False
        self._set_pause(PAUSE_USER, False)

    def unread(self, data: Buffer) -> None:
        """Inside on_read, after pause_reading(): hand back the part of this frame not
        consumed (copied), to be delivered by an on_read of its own before anything read
        later, once reading resumes (used by the asyncio adapter for a BufferedProtocol
        that pauses in the middle of a chunk)."""
        rest = bytes(data)
        if self.work is not None:
            self._ctx.dispatch.push_front(self, rest)     # type: ignore[union-attr]
        elif self._rest is None:
            self._rest = rest
        else:
            self._rest = rest + self._rest

    def set_write_limits(self, high: int, low: int, on_high: Callable[[], object],
                         on_low: Callable[[], object]) -> None:
        """Call ``on_high()`` once unsent bytes exceed ``high``, then ``on_low()`` once they
        drop to ``low`` or below (used by the asyncio adapter).  Any thread: from another
        one the change is queued with that thread's sends and applied by the loop thread
        between them, in order (the writes before it checked against the old limits, those
        after against the new); after close it is dropped."""
        if _get_ident() != self._loop.thread_id:
            if self._state == OPEN and not self._close_requested:
                limits = _WriteLimits(high, low, on_high, on_low)
                self._foreign.push(limits)      # type: ignore[arg-type]  # (see _drain_foreign)
            return
        self._wm = (high, low, on_high, on_low)
        self._set_cap()
        self._hw = -1           # every send now takes _over_high, which checks the limits
        self._sync_watch()
        if not self._transport:
            self._check_wm()
        elif not self._wm_paused and self.pending_bytes > high:
            # as asyncio's set_write_buffer_limits(): pause if the backlog is above the new
            # high mark, but never resume here -- that waits for the drain to reach low
            self._wm_paused = True
            on_high()
            self._ctx.kick()

    def send_room(self) -> int:
        """What the kernel may still take at once (a hint, for a writer on another thread
        deciding whether a backlog is one the socket will not take, as asyncio's
        ``write()`` tries the socket before it counts): 0 while the socket is known to be
        full (the loop waits for it to be writable), else its send buffer's size
        (``SO_SNDBUF``; 0 once the socket is gone)."""
        if self._writing:
            return 0
        try:
            return self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            return 0

    def writer_paused(self) -> None:
        """The write limits' ``on_high`` was run by the writer itself, on another thread,
        inside the write that left more than ``high`` unsent (the asyncio adapter's
        ``write()`` on a worker, as asyncio's ``write()`` pauses the protocol before it
        returns): the loop thread takes the session as paused -- no second ``on_high``,
        and ``on_low`` once the backlog drains to ``low``.  Queued behind that thread's
        sends; dropped after close."""
        if _get_ident() != self._loop.thread_id:
            if self._state == OPEN and not self._close_requested:
                self._foreign.push(_WRITER_PAUSED)      # type: ignore[arg-type]
            return
        self._writer_paused_here()

    def _writer_paused_here(self) -> None:
        if self._wm is None or self._wm_paused:
            return
        self._wm_paused = True
        self._sync_watch()
        self._check_wm()        # (drained already: on_low now; else at a flush's report)
        self._ctx.kick()

    # -- sending (slow paths) -----------------------------------------------------------
    def _send_slow(self, data: _SendData) -> None:
        """send() when closed (dropped) or from a thread other than the loop's: validate and
        copy here (a ``Slot`` is retained instead), hand the payload over as ONE item, wake
        the loop.  The loop thread frames it with ``SendBatch.add_frame`` -- the one place
        a header is built -- so a header can never be separated from its payload."""
        if self._state or self._close_requested:
            return
        item = foreign_item(data, self._hs)
        if item is not None and self._push_foreign(item):
            self._ctx.stats.frames_out_x.fetch_add(1)   # any thread: atomic

    def _push_foreign(self, item: bytes | Slot) -> bool:
        """Queue an item for the loop thread (any thread); False if it was dropped."""
        n = self._hs + (len(item) if type(item) is bytes else item.length)
        # (a transport checks max_pending itself, before the send: over_max_pending)
        limit = None if self._transport else self._ctx.settings.max_pending
        # pending_bytes: what max_pending counts (a TLS session's: plaintext not yet
        # encrypted plus ciphertext not yet sent), as the loop thread's check does
        ok = self._foreign.push(item, n, self.pending_bytes, limit)
        if ok is None:
            # max_pending, checked here where the send is queued (on the loop thread the
            # check runs in the send itself): this send and every later one are dropped
            self._close_requested = True
            self._loop.call_soon_threadsafe(
                self._abort, f"max_pending exceeded (more than {limit} unsent bytes): the "
                "peer does not read", None, logging.WARNING, "max_pending")
        return bool(ok)

    def queue_broadcast(self, item: bytes | Slot) -> bool:
        """A broadcast made on a thread other than the loop's (``item``: the payload as
        bytes or a pool Slot, retained here for this session): queued behind this thread's
        earlier sends to this session, so what one thread sends leaves in its order."""
        if self._state or self._close_requested or self._proxy_wait:
            return False
        if isinstance(item, Slot):
            item.retain()
        return self._push_foreign(item)

    def _drain_foreign(self, items: list[bytes | Slot]) -> None:
        """Loop thread: add the payloads other threads sent, in their order (framed here,
        by the one encoder: add_frame)."""
        b = self._batch
        hs = self._hs
        for item in items:
            if self._state == CLOSED:
                release_item(item)
                continue
            if item is _WRITER_PAUSED or type(item) is _WriteLimits:
                # a write-limit change, or that thread's own pause, made between its
                # sends: the sends before it are checked against the old state first
                if b.pending_bytes > self._hw:
                    self._over_high()
                    if self._state == CLOSED:
                        continue
                if item is _WRITER_PAUSED:
                    self._writer_paused_here()
                else:
                    self.set_write_limits(*item.args)   # type: ignore[union-attr]
                continue
            try:
                if hs:
                    b.add_frame(item, hs)
                else:
                    b.add_copy(item)    # bytes by reference, a Slot retained
            except Exception as e:      # MemoryError: the stream would have a hole
                self._abort(f"send failed: {type(e).__name__}: {e}", None, logging.ERROR,
                            "send error")   # (CLOSED: the items after this are released)
            finally:
                release_item(item)      # a Slot: the batch holds its own reference now
        self._wire.sent()
        if self._state != CLOSED and b.pending_bytes > self._hw:
            self._over_high()

    def send_broadcast(self, item: bytes | Slot) -> bool:
        """Add a broadcast's payload (bytes or a pool Slot, framed here by add_frame):
        loop thread."""
        if self._state or self._proxy_wait:     # (PROXY: not before the handler met us)
            return False
        b = self._batch
        if self._hs:
            p = b.add_frame(item, self._hs)
        else:
            p = b.add_copy(item)        # bytes by reference, a Slot retained
        if not self._wire.in_flush_group:
            self._wire.sent()           # (TLS: marked for its flush; a plain batch's add was
                                        #  seen by the FlushGroup -- no call per recipient)
        if p > self._hw:
            self._over_high()
        return True

    # -- back-pressure and the flush (loop thread) --------------------------------------
    def _over_high(self) -> None:
        """A send left more than ``_hw`` bytes pending: the lower of the server's high-water
        mark and ``max_pending``, or -1 while write limits are set (so that every send
        checks them).  ``max_pending`` is checked first and on its own: a high-water mark
        set above it must not disable it."""
        p = self.pending_bytes
        st = self._ctx.settings
        if p > st.max_pending and not self._transport:
            self._abort(f"max_pending exceeded ({p} unsent bytes > {st.max_pending}): "
                        "the peer does not read", level=logging.WARNING,
                        cause="max_pending")
            return
        if p > st.high_water:
            # stop reading at once (hold: no further recv or frame in this burst), but let
            # this iteration's flush report (flushed(), watched from here) decide about the
            # fd's read interest: a flush that takes the backlog to low_water resumes with
            # no epoll_ctl at all -- a large echo crosses the mark on most read bursts, and
            # unregistering and re-registering cost two syscalls each time
            self._rx.pause(PAUSE_BACKPRESSURE)
            self._sync_watch()
        if self._wm is not None:
            self._check_wm(True)

    def _check_wm(self, try_socket: bool = False) -> None:
        """The write limits against what is pending.  ``try_socket`` (a send just added
        to the batch): an asyncio transport's batch above the high mark is first handed to
        the kernel, as asyncio's ``write()`` tries the socket before it counts what is
        left -- so ``on_high`` (``pause_writing()``) comes only for a backlog the socket
        did not take (a TLS session encrypts first: its ``_write_now``).  Not when the
        socket is known to be full (``_writing``)."""
        high, low, on_high, on_low = self._wm     # type: ignore[misc]  # (set: caller checked)
        p = self.pending_bytes
        if not self._wm_paused:
            if p > high and try_socket and self._transport:
                self._write_now()
                if self._state == CLOSED:
                    return
                p = self.pending_bytes
            if p > high:
                self._wm_paused = True
                on_high()
                # (maybe called from the iteration's flush, past the batches the callback
                # sent to: what it sent must not wait for the loop's next event)
                self._ctx.kick()
        elif p <= low:
            self._wm_paused = False
            on_low()
            self._ctx.kick()

    def _sync_watch(self) -> None:
        """The flush reports this session after every flush while anything depends on it."""
        self._batch.watch = bool(self._state or self._writing or self._wm is not None or
                                 self._rx.paused & PAUSE_BACKPRESSURE)

    def flushed(self, status: int) -> None:
        """The per-iteration flush's report (loop thread): 0 all sent (watched), 1 data
        still pending (would block or budget used up), -errno the write failed."""
        if self._state == CLOSED:
            return
        if not status and self._state == CLOSING:
            status = self._wire.end_output()    # (TLS: close_notify, once all is sent)
            if status < 0 and self._peer_eof and -status in (errno.EPIPE, errno.ECONNRESET):
                # the peer ended its stream and then its socket: everything owed was
                # handed to the kernel, and only close_notify, which nobody is left to
                # read, found the connection gone -- a clean end, as asyncio's TLS
                # transport (which sends no close_notify after the peer's EOF) has it
                status = 0
        if status < 0:
            e = -status
            if self._state != CLOSED:
                self._oserr = e
                self._peer_failed = self._state == OPEN
            self._abort(f"send failed: {os.strerror(e)}",
                        cause="reset" if e in _RESET_ERRNOS else "send error")
            return
        if status and not self._writing:
            self._writing = True
            self._update_interest()
        elif not status and self._writing:
            self._writing = False
            self._update_interest()
        if self._rx.paused & PAUSE_BACKPRESSURE:
            if self.pending_bytes <= self._ctx.settings.low_water:
                if self._rx.resume(PAUSE_BACKPRESSURE):
                    self._reading_resumed()
            else:
                # still backed up after a flush: stop the read events too (see _over_high;
                # a no-op when they are stopped already)
                self._update_interest()
        if self._wm is not None:
            self._check_wm()
        # (_owes_output: the write-limit callbacks may have written more and closed -- an
        # asyncio protocol's resume_writing writing its last bytes: the close then waits for
        # them, it requeued itself)
        if (not status and self._state == CLOSING and not self._lingering
                and not self._owes_output()):
            self._finish_close()
            return
        self._sync_watch()

    def _on_writable(self) -> None:
        if self._state != CLOSED:
            self._requeue()                     # flushed at the end of this iteration

    def _requeue(self) -> None:
        """Have this session's batch flushed at the end of this iteration."""
        self._wire.requeue()

    def _owes_output(self) -> int:
        """Something is still to be written before the write side may be shut."""
        return self._wire.owes_output()

    def _update_interest(self) -> None:
        if self._state == CLOSED:
            return
        r: Callable[[], object] | None
        if self._lingering:
            r = self._discard_input
        else:
            r = self._reader if not self._rx.paused else None
        self._loop.set_callbacks(self._fd, r, self._on_writable if self._writing else None)

    def _set_pause(self, reason: int, on: bool) -> None:
        if _get_ident() != self._loop.thread_id:
            self._loop.call_soon_threadsafe(self._set_pause, reason, on)
            return
        if self._state != OPEN:
            return
        w = self.work
        if reason == PAUSE_USER and w is not None:
            # the latest request counts, not this one: a pause a worker posted may arrive
            # after a resume_reading() the loop thread made meanwhile (an asyncio protocol's
            # task), and must not undo it -- pause_reading/resume_reading record the
            # request at once, any thread, in user_paused
            with w.lock:
                on = w.user_paused
        if on:
            if self._rx.pause(reason):
                self._update_interest()
            return
        if self._rx.resume(reason):
            self._reading_resumed()
        if reason == PAUSE_USER and w is not None:
            # frames held for the worker while paused: have it take them again
            self._ctx.dispatch.release_held(self)   # type: ignore[union-attr]

    def _reading_resumed(self) -> None:
        """The last pause reason was cleared (loop thread)."""
        self._update_interest()
        if self._rest is not None:
            # the rest on_read handed back (unread) comes before anything read later, the
            # peer's EOF included: the receiver reads nothing until _deliver_held has
            # handed it over (a readiness event may come first)
            self._rx.receiver.hold = True
            self._loop.call_soon(self._deliver_held)
        elif self._rx.receiver.pending or self._wire.holds_input():
            # frames read before the pause and held back (the receiver stops between frames
            # once held), input the wire holds (TLS: decrypted bytes in OpenSSL, records
            # in its incoming buffer): no readiness event will come for them
            self._loop.call_soon(self._deliver_held)

    def hold_for_callbacks(self) -> None:
        """Inside on_read (loop thread, no workers): deliver nothing more -- neither the rest
        of this read burst nor a later read -- until the loop callbacks queued so far have
        run (an asyncio protocol's ``call_soon``, a task it woke: on asyncio's loop each
        read is a loop callback of its own, so those run before the next delivery).  The
        bytes are kept by the receiver (and ``unread``), as for a pause; no syscall: the
        fd's read interest is not changed."""
        if self._rx.paused or self._cb_hold:
            return          # (a pause holds already; its resume delivers)
        self._cb_hold = True
        self._rx.receiver.hold = True
        self._loop.call_soon(self._release_cb_hold)

    def _release_cb_hold(self) -> None:
        self._cb_hold = False
        if self._state != OPEN or self._rx.paused:
            return          # (closing: nothing more is delivered; paused: resume does it)
        self._rx.receiver.hold = False
        if self._rx.receiver.pending or self._rest is not None:
            self._deliver_held()

    def _deliver_held(self) -> None:
        if self._state != OPEN or self._rx.paused:
            return
        rest = self._rest
        if rest is not None:
            # the rest on_read handed back (unread) comes before what the receiver holds
            self._rest = None
            if not self._cb_hold:
                self._rx.receiver.hold = False      # (set while the rest waited)
            try:
                self._ctx.dispatch.handler.on_read(self, rest)
                self._ctx.dispatch.returned("on_read")
            except BaseException as e:
                if self._ctx.dispatch.propagates(e):
                    raise
                self.handler_failed("on_read", e)
                return
            if self._state != OPEN or self._rx.paused or not self._rx.receiver.pending:
                return
        reader = self._reader
        if reader is not None:          # (None only once closed)
            reader()

    # -- hooks for the server's parts ---------------------------------------------------
    def start(self) -> None:
        """Register with the loop (loop thread, right after accept)."""
        self._wire.start()
        self._update_interest()

    def fail_start(self, reason: str) -> None:
        """start() failed (loop thread): close at once, before the handler met the session
        (no on_close), giving back everything the accept took."""
        self._proxy_wait = True         # the handler has not met us: no on_close
        self._abort(reason, level=logging.WARNING, cause="register")

    def stop_reading(self) -> None:
        """The server is shutting down: no more reads (loop thread)."""
        self._set_pause(PAUSE_SHUTDOWN, True)

    def pause_for_backlog(self, on: bool) -> None:
        """The worker backlog is full (True) / drained (False); any thread."""
        self._set_pause(PAUSE_BACKLOG, on)

    def ref(self) -> None:
        self._rc.incref()

    def unref(self) -> None:
        rc = self._rc           # _on_zero drops the attribute
        rc.decref()

    def counters(self) -> tuple[Receiver, SendBatch, int]:
        """(receiver, batch, frames sent on the loop thread) for the stats."""
        return self._rx.receiver, self._batch, self._nout

    def check_timeouts(self, now: float, idle_timeout: float | None,
                       frame_timeout: float | None, proxy_timeout: float | None = None) -> None:
        if self._state != OPEN:
            if (self._state == CLOSING and self._transport and idle_timeout is not None
                    and not self._lingering):
                self._check_close_progress(now, idle_timeout)
            return
        rx = self._rx
        held = bool(rx.paused & _SERVER_HOLDS)
        active = False
        bp = rx.paused & PAUSE_BACKPRESSURE
        if bp or (idle_timeout is not None and now - rx.last_active > 0.5 * idle_timeout):
            # A peer still taking output we owe is neither idle ("without any byte") nor, under
            # back-pressure, the one stalling: a long reply, its tail in the kernel's send
            # queue included.  Progress is what the peer took since the last look: written
            # minus still unsent (SIOCOUTQNSD), counted only if output was owed at that look
            # -- a peer that takes nothing is stalling and its clocks run, and one to which
            # nothing was owed is not kept alive by our sends.  Looked at under back-pressure
            # and once the idle clock is past half its limit (an ioctl per sweep then only).
            unsent = _unsent(self._fd)
            taken = self._bytes_written() - unsent
            if taken != self._sent_seen and self._owed_seen:
                if bp:
                    held = True         # both clocks stop (the frame clock too: we hold it)
                else:
                    active = True       # the idle clock restarts; the frame clock runs on
            self._sent_seen = taken
            self._owed_seen = unsent > 0 or self.pending_bytes > 0
        else:
            self._owed_seen = False
        w = self.work
        if w is not None and w.scheduled:
            # a worker runs (or is about to run) what the peer sent: a request that takes
            # longer than idle_timeout is the server's time, not an idle peer -- the idle
            # clock restarts (it counts again once the worker is done); the frame clock,
            # the peer's own pace, runs on
            active = True
        reason = rx.sweep(now, idle_timeout, frame_timeout, proxy_timeout, held, active)
        if reason is not None:
            self._abort(reason, level=logging.WARNING, cause="timeout")

    def _check_close_progress(self, now: float, idle_timeout: float) -> None:
        """A transport's close waiting for its backlog: cut (a reset, connection_lost gets a
        TimeoutError) once the peer took no byte for ``idle_timeout`` seconds."""
        taken = self._bytes_written() - _unsent(self._fd)
        if taken != self._sent_seen:
            self._sent_seen = taken
            self._progress_at = now
        elif now - self._progress_at > idle_timeout:
            self._abort(f"idle timeout ({idle_timeout:g} s without the peer taking a byte "
                        f"of the {self.pending_bytes} owed at close): unsent data dropped",
                        level=logging.WARNING, cause="timeout")

    def _bytes_written(self) -> int:
        """Bytes this session wrote to its socket so far (check_timeouts' progress; over
        TLS ciphertext: the batch's count is plaintext handed to OpenSSL, which stands still
        while one large segment's ciphertext drains)."""
        return self._wire.bytes_written()

    def forget_in_fork(self) -> None:
        """In a process forked from the serving one: close this process's copy of the
        socket, nothing else (no flush, no shutdown(), no option set: the connection is
        the parent's)."""
        try:
            self._sock.close()
        except OSError:
            pass

    def close_for_shutdown(self) -> None:
        self._close("server shutdown", level=logging.DEBUG, cause="shutdown")

    def abort_for_shutdown(self, reason: str) -> None:
        self._abort(reason, level=logging.WARNING, cause="shutdown")

    def lost_at_shutdown(self) -> str:
        """What aborting this session now would lose, for the shutdown timeout's message:
        the bytes still owed to the peer and the frames its worker has not run (loop
        thread)."""
        lost = []
        n = self.pending_bytes
        if n:
            lost.append(f"{n} unsent bytes dropped")
        w = self.work
        if w is not None:
            with w.lock:
                frames = sum(1 for item in w.backlog if type(item) is bytes)
                running = w.scheduled
            if frames:
                lost.append(f"{frames} frames queued for the handler dropped")
            if running:
                # (a worker has it: inside a hook for it, or about to be -- what that hook
                # sends from now on is dropped)
                lost.append("a worker still busy with it (what its hook sends is dropped)")
        return ", ".join(lost) or "nothing unsent"

    def run_on_connect(self) -> None:
        """Run the handler's on_connect (loop thread): what it raises closes this session
        only, unless the dispatch says it stops the server (see dispatch.propagates)."""
        try:
            self._ctx.dispatch.handler.on_connect(self)
            self._ctx.dispatch.returned("on_connect")
        except BaseException as e:
            if self._ctx.dispatch.propagates(e):
                raise
            self.handler_failed("on_connect", e)

    def run_on_close(self) -> None:
        """Run the handler's on_close (once; the loop thread or the session's worker)."""
        if self._proxy_wait:
            return      # on_connect never ran (PROXY header refused, start() failed)
        try:
            self._ctx.dispatch.handler.on_close(self, self._exc)
            self._ctx.dispatch.returned("on_close")
        except BaseException as e:      # (on a worker: the thread must live on)
            if self._ctx.dispatch.in_fork():
                fork_returned("on_close", e)    # (a fork's sys.exit(n): status n)
            log.error("session %d: handler on_close raised", self.id, exc_info=e)
            self._ctx.stats.handler_errors.fetch_add(1)

    def limit_error(self) -> OSError | None:
        """The error that a server limit ended the session with -- ``max_pending``
        (ConnectionAbortedError), ``idle_timeout``/``frame_timeout``/``close_linger``
        (TimeoutError), a shutdown that dropped bytes still owed (ConnectionAbortedError),
        its message the reason -- or None: what the asyncio adapter hands
        ``connection_lost`` then (``on_close`` itself gets None for these)."""
        reason = self._limit
        if reason is None:
            return None
        if self._limit_cause in ("max_pending", "shutdown"):
            return ConnectionAbortedError(reason)
        return TimeoutError(reason)

    def lost_error(self) -> OSError | None:
        """The OSError of the recv or send error that ended the stream (a reset:
        ConnectionResetError), or None: what asyncio hands ``connection_lost`` (the asyncio
        adapter; ``on_close`` itself gets None for these); after a wire error (TLS: a
        record that does not decrypt, the peer's fatal alert) the wire's (an
        ``ssl.SSLError`` naming it, as asyncio's TLS transport hands ``connection_lost``)."""
        e = self._wire.lost_error()
        if e is not None:
            return e
        err = self._oserr
        return None if err is None else OSError(err, os.strerror(err))

    def frames_done(self, reason: str, level: int, cause: str) -> None:
        """Worker thread (or the loop thread, once the completion queue is closed): every
        frame before a close the input asked for has been handled (see
        _close_after_frames)."""
        if cause == "eof" and self._peer_eof_keeps_open():
            return
        self._loop.call_soon_threadsafe(self._close, reason, None, level, cause)

    def handler_failed(self, hook: str, exc: BaseException, logged: bool = False,
                       abort: bool = False, reset: bool = False) -> None:
        """A handler hook raised: log it (unless the caller has: ``logged``, the asyncio
        adapter's exception handler), close this session only (any thread).  ``abort``
        (the asyncio adapter: asyncio's transport ends a fatal protocol error so): what is
        queued is offered to the kernel once, then the connection closes at once -- no
        lingering drain, no TLS ``close_notify``, so a TLS peer sees the session end
        uncleanly; ``reset``: bytes the peer sent were never handed to the protocol (asyncio
        would have left them in the kernel, whose close resets): close with a reset, so the
        peer can tell the failure from an end of stream."""
        if self._ctx.dispatch.in_fork():
            # handler code forked, and the fork came back with an exception: the session
            # is the parent's, the fork ends
            fork_returned(hook, exc, logged)
        if not logged:
            log.error("session %d %s: handler %s raised; closing this session", self.id,
                      self.peer, hook, exc_info=exc)
        # the traceback's frames hold the frame (and any view of it) for as long as anyone
        # keeps the exception -- a log record, say: drop their locals
        traceback.clear_frames(exc.__traceback__)
        self._ctx.stats.handler_errors.fetch_add(1)
        reason = f"handler {hook} raised {type(exc).__name__}: {exc}"
        close = self._reset_close if reset else self._fail_close if abort else self._close
        # the close's own line: WARNING, unless the caller reported the exception (the
        # asyncio adapter, to the loop's exception handler, which may be the user's)
        level = logging.DEBUG if logged else logging.WARNING
        if _get_ident() == self._loop.thread_id:
            close(reason, exc, level, "handler")
        elif self._state == OPEN:
            # closed for its worker at once: the frames still queued are not delivered (as
            # inline, where the close stops the receiver before the next frame)
            self._close_requested = True
            self._loop.call_soon_threadsafe(close, reason, exc, level, "handler")

    def _reset_close(self, reason: str, exc: BaseException | None, level: int,
                     cause: str) -> None:
        """handler_failed's reset (loop thread): as _fail_close, ending with a reset."""
        if self._state != CLOSED:
            self._rst = True            # (read by the teardown, just after)
            self._fail_close(reason, exc, level, cause)

    def _fail_close(self, reason: str, exc: BaseException | None, level: int,
                    cause: str) -> None:
        """handler_failed's abort: one attempt to send what is queued, then close now."""
        if self._state == CLOSED:
            return
        # (with a reset too: asyncio's write() had handed the reply to the kernel before
        # its fatal error reset the connection, so the peer reads it, then the reset)
        if not self._lingering:
            self._send_once()
        self._abort(reason, exc, level, cause)

    # -- receiving (loop thread) --------------------------------------------------------
    def _rx_event(self, owner: object, code: int, arg: Any) -> None:
        """The receiver's report: EOF, a recv error, a header above max_frame, or a handler
        exception.  A wire that failed (TLS: a record that does not decrypt) names the
        cause instead."""
        if self._state == OPEN:
            failed = self._wire.failed()
            if failed is not None:
                self._abort(failed, cause="tls")
                return
        if code == RX_EOF:
            self._peer_closed()
        elif code == RX_ERROR:
            reset = arg in _RESET_ERRNOS
            if self._state != CLOSED:
                self._oserr = arg
                self._peer_failed = self._state == OPEN
            self._abort(f"recv failed: {os.strerror(arg)}",
                        cause="reset" if reset else "recv error")
        elif code == RX_TOO_LARGE:
            self._close_after_frames(f"frame too large: header announces {arg} bytes, above "
                                     f"max_frame={self._ctx.settings.max_frame}",
                                     logging.WARNING, "protocol")
        elif code == RX_HANDLER:
            self.handler_failed("on_read", arg)
        elif code == RX_FORKED:
            # on_read returned (arg None) or raised in a process it forked
            fork_returned("on_read", arg)
        elif code == RX_PROXY or code == RX_PROXY_ERROR:
            self._proxy_event(code, arg)

    # -- PROXY protocol (loop thread; the policy is in proxy.py) ------------------------
    def _proxy_event(self, code: int, arg: Any) -> None:
        """The PROXY header: parsed (the client's address becomes ``peer``, then the
        handler's on_connect runs, before any frame), or refused (closed, counted)."""
        if code == RX_PROXY_ERROR:
            self.wire_proxy_refused(arg)
            return
        self.wire_proxy_header(arg)
        self._proxy_wait = False
        self.run_on_connect()

    # -- the wire's calls (loop thread; see .wire) ---------------------------------------
    def wire_open(self, reader: Callable[[], object]) -> None:
        """The wire is ready for application data (TLS: the handshake is done): ``reader``
        becomes the read callback, the handler meets the session (``on_connect``), and
        input that came with the handshake's last flight is read at once."""
        self._proxy_wait = False
        self._reader = reader
        self._update_interest()
        self.run_on_connect()
        if self._state == OPEN and not self._rx.paused and self._wire.holds_input():
            reader()

    def wire_failed(self, reason: str, level: int, cause: str) -> None:
        """The wire cannot go on (a handshake that failed or timed out, a send OpenSSL
        refused): the session is aborted."""
        self._abort(reason, level=level, cause=cause)

    def wire_holds_input(self) -> None:
        """The wire holds input no readiness event will announce (TLS: the last read
        filled its room, or met the end of the stream after its data): read it from a loop
        callback."""
        if self._state == OPEN and not self._rx.paused:
            self._loop.call_soon(self._deliver_held)

    def wire_proxy_refused(self, error: str) -> None:
        """The PROXY header was refused (``error`` says why): closed, counted."""
        self._close(f"PROXY protocol: {error}", None, logging.WARNING, "proxy")

    def wire_proxy_header(self, arg: Any) -> None:
        """The PROXY header ``arg`` was read: the client's address becomes ``peer``, the
        balancer's ``proxy_peer``."""
        peer = self.peer
        balancer = tuple(peer[:2]) if type(peer) is tuple else peer    # (AF_UNIX: a path)
        self.proxy_peer = balancer
        self.peer = client_address(arg, balancer)
        log.debug("session %d: PROXY v%d %s %s from %s", self.id, arg[0], arg[1], arg[2],
                  balancer)

    def _peer_closed(self) -> None:
        self._peer_eof = True
        self._ctx.stats.eofs += 1
        self._close_after_frames("peer closed the connection", logging.DEBUG, "eof")

    def _close_after_frames(self, reason: str, level: int, cause: str) -> None:
        """A graceful close the input asked for (the peer's EOF, a protocol violation).
        With workers, frames read before it may still be queued or running: a mark travels
        behind them and the close happens from there, so their replies still go out (a
        client that half-closes after its request gets its answer)."""
        if self.work is None or self._ctx.dispatch.closed:
            if cause == "eof" and self._peer_eof_keeps_open():
                if self._state == OPEN:
                    self._rx.close()    # half-closed: nothing more to read
                    if self._rx.pause(PAUSE_EOF):
                        self._update_interest()
                return
            self._close(reason, None, level, cause)
            return
        self._rx.close()                # nothing more is read or delivered
        if self._rx.pause(PAUSE_EOF):
            self._update_interest()
        self._ctx.dispatch.post(self, (EOF_MARK, reason, level, cause))

    def _peer_eof_keeps_open(self) -> bool:
        """The peer's EOF reached the handler's ``_on_peer_eof(session)`` hook, if it has one
        (the asyncio adapter: ``eof_received()``), after every frame before it: True keeps
        the session open for writing (not over TLS, as asyncio's TLS transport) until the
        application closes it; False: the caller closes it.  A hook that raises has the
        session closed (logged, counted) and answers True (nothing more for the caller to
        do).  Loop thread (workers=0) or the session's worker."""
        hook = getattr(self._ctx.dispatch.handler, "_on_peer_eof", None)
        if hook is None or self.closed:
            return False
        try:
            keep = hook(self)
            self._ctx.dispatch.returned("eof_received")
        except BaseException as e:      # (on a worker: the thread must live on)
            if self._ctx.dispatch.propagates(e):
                raise
            self.handler_failed("eof_received", e)
            return True                 # handler_failed closes it
        return bool(keep) and self._wire.half_close

    # -- closing (loop thread) ----------------------------------------------------------
    def _close(self, reason: str, exc: BaseException | None = None, level: int = logging.INFO,
               cause: str = "closed") -> None:
        """Graceful: stop reading, flush what is owed, then shut the write side."""
        if self._state != OPEN:
            return
        self._state = CLOSING
        self._reason = reason
        self._exc = exc
        self._ctx.stats.count_close(cause)
        log.log(level, "session %d %s closing: %s", self.id, self.peer, reason)
        self._rx.pause(PAUSE_CLOSING)
        self._rx.close()                # no frame after this one; buffers go back
        self._update_interest()
        if self._owes_output():
            self._sync_watch()          # the flush reports back; at 0 pending we finish
            self._requeue()
            if self._transport:
                # as asyncio's close(): the whole backlog is sent, however slowly the peer
                # takes it; only the idle timeout, if set, cuts a peer that takes nothing
                # (check_timeouts)
                self._progress_at = self._loop.time()
                self._sent_seen = self._bytes_written() - _unsent(self._fd)
            else:
                self._timer = self._loop.call_later(
                    self._ctx.settings.close_linger, self._abort,
                    "close linger timeout: unsent data dropped", None, logging.WARNING,
                    "linger")
        else:
            self._finish_close()

    def _finish_close(self) -> None:
        """Everything owed is written: shut the write side, then drain unread input before
        closing (a close with unread input resets the connection and can destroy the reply
        still in flight)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            linger = self._sock.getsockopt(_SOL_SOCKET, _SO_LINGER, 8)
        except OSError:
            linger = None
        if linger == _LINGER_RESET:
            # the application asked for an abortive close (SO_LINGER on with 0 s, set on
            # the session's socket): as asyncio's close, the socket is closed once what
            # was owed is sent -- the kernel resets the connection, no FIN.  Over TLS,
            # asyncio's close first waits for the peer's answer to its close_notify (the
            # peer's close_notify or EOF): the reset would otherwise discard the part of
            # the reply still in the kernel, unread.  So does this one: no FIN, the
            # peer's input drained, closed at its answer or after close_linger seconds
            if self._ctx.tls is None or self._wire.failed() is not None:
                self._teardown()
                return
            self._await_answer = True
            self._lingering = True
            self._writing = False
            self._update_interest()
            self._timer = self._loop.call_later(self._ctx.settings.close_linger,
                                                self._teardown)
            return
        unsent = _unsent(self._fd)     # (before the FIN joins the queue)
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._teardown()
            return
        got = self._drain_input()
        if got is None or (not got and not unsent):
            # EOF or an error; or nothing unread and the reply has left: close now.
            # (Nothing unread *yet* while part of the reply still waits in the kernel for
            # the peer's window is not enough: input the peer sends before it sees our FIN
            # would reach a closed socket, whose kernel answers with a reset that drops the
            # unsent rest of the reply -- so linger until the peer's EOF, or the timer.)
            self._teardown()
            return
        self._lingering = True
        self._writing = False
        self._update_interest()
        self._timer = self._loop.call_later(min(2.0, self._ctx.settings.close_linger),
                                            self._teardown)

    def _drain_input(self) -> int | None:
        """Read and drop unread input.  None: EOF or an error; else the bytes dropped (0:
        nothing was there; more may come)."""
        recv = self._sock.recv
        total = 0
        for _ in range(_LINGER_READS):
            try:
                # MSG_DONTWAIT: never blocks, even if the fd was made blocking behind the
                # loop's back (through a dup of it, say)
                data = recv(_DISCARD, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return total
            except OSError:
                return None
            if not data:
                return None
            total += len(data)
        return total

    def _discard_input(self) -> None:
        """The lingering close's read callback: the peer's EOF (or an error) ends it; so
        does, for an abortive TLS close, its answer once it has taken the whole reply."""
        got = self._drain_input()
        if got is None or (got and self._await_answer and not _unsent(self._fd)):
            self._teardown()

    def _abort(self, reason: str, exc: BaseException | None = None, level: int = logging.INFO,
               cause: str = "aborted") -> None:
        if self._state == CLOSED:
            return
        if (self._limit is None and not self._lingering and
                (cause in _LIMIT_CAUSES or (cause == "shutdown" and self.pending_bytes))):
            # (a shutdown counts when it drops bytes still owed)
            self._limit = reason
            self._limit_cause = cause
        if self._state == OPEN:
            self._reason = reason
            self._exc = exc
            self._ctx.stats.count_close(cause)
            log.log(level, "session %d %s closed: %s", self.id, self.peer, reason)
        elif reason != self._reason and not self._lingering:
            log.log(level, "session %d %s: %s", self.id, self.peer, reason)
        self._teardown()

    def _teardown(self) -> None:
        if self._state == CLOSED:
            return
        self._state = CLOSED
        ctx = self._ctx
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop.remove(self._fd)
        self._writing = self._lingering = self._await_answer = False
        self._rx.close()
        self._foreign.close()           # releases what other threads queued
        b = self._batch
        ctx.flusher.forget(b)
        ctx.stats.fold_session(self._rx.receiver, b, self._nout)
        self._nout = 0
        # a server limit drops bytes still owed (max_pending: at least the send it refused):
        # the peer must not take the cut stream for a whole one, so the close is a reset
        # (RST), not a FIN
        reset = self._rst or (self._limit is not None and (self.pending_bytes > 0 or
                                                           self._limit_cause == "max_pending"))
        b.clear()                       # releases retained slots
        sock = self._sock
        if self._sockname is None:
            # asked first in on_close / connection_lost: read it while the socket is open
            try:
                self._sockname = sock.getsockname()
            except OSError:
                pass
        try:
            # SO_LINGER with a time (set through the socket the application sees) would make
            # close() block the loop thread until the unsent rest left or the time ran out:
            # close in the background instead (the kernel still sends the rest), as without
            if reset:
                sock.setsockopt(_SOL_SOCKET, _SO_LINGER, _LINGER_RESET)
            elif sock.getsockopt(_SOL_SOCKET, _SO_LINGER, 8) not in _NO_BLOCKING_LINGER:
                sock.setsockopt(_SOL_SOCKET, _SO_LINGER, _LINGER_OFF)
        except OSError:
            pass
        if self._forks_at_accept != forks_made():
            # a fork made since the accept may hold this socket too, and then our close is
            # not the last: neither an abort's end nor a reset would leave until the fork
            # exits.  shutdown() acts on the connection itself: the peer gets the end of the
            # stream now (after what was already queued), and a reset still comes with our
            # close if it is the last
            try:
                sock.shutdown(_SHUT_RDWR)
            except OSError:
                pass
        try:
            sock.close()
        except OSError:
            pass
        ctx.session_closed(self)
        # on_close never inside the code that closed us (a hook's close()/abort(), the
        # flush's report, ...): from a loop callback of its own -- the callback phase runs
        # before the iteration's flush, so what on_close sends leaves in that iteration.
        # The loop's reference is dropped there, once on_close is run or posted.
        if self._loop.closed:
            self._post_close()          # (no callback would run any more)
        else:
            self._loop.call_soon(self._post_close)
        # the wire drops its references to us (TLS: a cycle through its compiled half and
        # its read callback), so a closed session is freed by reference counting
        self._wire.close()
        self._reader = None

    def _post_close(self) -> None:
        """on_close, after the last on_read: run here (workers=0) or posted behind the
        session's frames for its worker (loop thread, a callback of its own)."""
        try:
            self._ctx.dispatch.post(self, CLOSE_MARK)
        finally:
            rc = self._rc
            rc.decref()                 # the loop's reference (_on_zero may drop _rc)

    def _on_zero(self) -> None:
        """The last reference is gone (exactly once).  Break the session's last reference
        cycle (its RefCount holds this bound method; the hand-off queue and the receiver
        dropped theirs at teardown), so a closed session is freed by reference counting,
        not left for the cyclic GC."""
        self._rx.close()
        self._ctx.session_gone(self)
        self._rc = None     # type: ignore[assignment]  # (no ref() after zero)


class RawSession(Session):
    """A session of a raw-framing server: ``send`` needs no header."""
    __slots__ = ()
    send = Session._send_raw


class SinkSession(Session):
    """A session whose wire has a sink that adds and marks in one call (TLS)."""
    __slots__ = ()
    send = Session._send_via_sink


class RawSinkSession(Session):
    """A raw-framing session whose wire has a sink that adds and marks in one call (TLS)."""
    __slots__ = ()
    send = Session._send_raw_via_sink
