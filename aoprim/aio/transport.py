"""aoprim's TCP / Unix stream transport: its own implementation of ``asyncio.Transport`` (as
uvloop has its own), whose write side is a compiled ``SendBatch`` flushed by the loop's
``FlushGroup`` and whose plain read side reads into the loop's reusable buffer.

Private asyncio names this module still uses (checked on CPython 3.11.7, 3.12.1, 3.13.0):

- ``asyncio.transports._FlowControlMixin`` -- the base class, only so that asyncio's own
  ``loop.sendfile()`` fallback (``base_events._SendfileFallbackProtocol``, which refuses any
  other transport) and code testing ``isinstance(t, _FlowControlMixin)`` accept this
  transport; its ``__init__(extra, loop)``, ``set_write_buffer_limits`` and
  ``get_write_buffer_limits`` are used, the rest is overridden here.
- ``asyncio.trsock.TransportSocket`` -- what ``get_extra_info("socket")`` returns, as on
  asyncio's loop (subclassed: ``shutdown()`` first flushes what the transport batched).
- ``asyncio.constants._SendfileMode`` / ``LOG_THRESHOLD_FOR_CONNLOST_WRITES`` and the
  ``_sendfile_compatible`` / ``_start_tls_compatible`` class attributes that
  ``loop.sendfile()`` and ``loop.start_tls()`` read.
- the loop's ``_thread_id`` (get_write_buffer_size() flushes only on the loop's thread),
  ``_add_reader`` / ``_remove_reader`` / ``_add_writer`` / ``_remove_writer`` and
  ``_transports`` (asyncio's selector loop registers each transport's fd there so that
  ``loop.add_reader(fd)`` refuses a transport's socket), and ``_sock`` / ``_sock_fd`` /
  ``_make_empty_waiter`` / ``_reset_empty_waiter`` here, which the selector loop's native
  ``sendfile`` uses.
- ``Server._attach`` / ``Server._detach`` (no argument before 3.13, the transport from 3.13).
- ``selector_events._SelectorSocketTransport``: only whether it defines ``writelines``
  (3.12+), whose messages ``writelines()`` then gives.

Write side: ``write()`` and ``writelines()`` are compiled (``aoprim.aio._aiowrite``, one
path for every bytes-like object); this module keeps what a write refuses
(``_write_refused``: asyncio's checks) and what is not per write.  States of one
transport::

    attached   the batch is attached to the loop's FlushGroup.  write() appends to it (small
               writes copied and coalesced, large bytes by reference) and returns; the add
               that makes the batch dirty queues it in the group, and the loop flushes the
               whole group at the end of the iteration (one sendmsg per transport).
    blocked    the kernel did not take everything (a flush reported status 1: would block,
               a short write, or the group's per-flush budget used up; or the at-once flush
               of a write above the high-water mark left data).  The batch leaves
               the group and a writer is registered; _write_ready() flushes the batch itself
               when the socket is writable and re-attaches it once it is empty.

asyncio's semantics, and how they map here:

- ``get_write_buffer_size()`` is the batch's ``pending_bytes`` once what this iteration wrote
  was handed to the kernel (it does that first, as asyncio's write() would have, and blocks
  if data is left), so it reads as asyncio's.  A write that takes the batch above
  the high-water mark first hands the batch to the kernel at once (asyncio's write() sends
  at once too) and blocks if data is left, so flow control counts what the kernel has not
  taken; ``pause_writing()`` is called only if the batch is still above the mark.  Once
  paused, ``resume_writing()`` is called when the batch is at or below the low-water mark
  -- checked after each writer flush while blocked, and after each group flush (the batch
  is *watched*) while attached -- never once the transport is aborted or failed.
- ``close()`` and ``write_eof()`` flush what is pending at once (then, if the kernel did not
  take it all, through the writer as asyncio does).  ``abort()`` and fatal errors first
  hand what this iteration wrote to the kernel once (asyncio's write() would already have
  sent it) and drop only what the kernel does not take.
- A write error reported by the flush is a fatal write error, as in asyncio.
"""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Callable
from operator import attrgetter as _attrgetter
from threading import get_ident as _get_ident

from asyncio import constants as _constants
from asyncio import selector_events as _se
from asyncio import transports as _transports
from asyncio import trsock as _trsock
from asyncio.log import logger

from aoprim import SendBatch
from aoprim.aio._aiowrite import TransportWriter
from aoprim.aio._aiotransport import TransportReader, make_write_method

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Iterable

    from typing_extensions import Buffer

    from aoprim.aio.loop import Loop

IOV_MAX = 1024                   # segments one sendmsg takes (the kernel's UIO_MAXIOV)

__all__ = ["SocketTransport"]

_BYTES_LIKE = (bytes, bytearray, memoryview)

# asyncio 3.12+'s selector transport has a writelines() of its own, which checks write_eof()
# and a sendfile in progress before it reads the items, with its own messages; 3.11's is
# WriteTransport.writelines (join, then write(): write()'s messages) -- by what the module
# holds, not a version number
_OWN_WRITELINES = "writelines" in vars(_se._SelectorSocketTransport)


def _writelines_refused(eof: bool) -> None:
    if eof:
        raise RuntimeError('Cannot call writelines() after write_eof()')
    raise RuntimeError('unable to writelines; sendfile is in progress')


def _server_takes_transport() -> bool:
    import asyncio.base_events as be
    return be.Server._attach.__code__.co_argcount == 2     # 3.13+: _attach(self, transport)


_SERVER_ARG = _server_takes_transport()


def _set_result_unless_cancelled(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.cancelled():
        fut.set_result(result)


def _set_nodelay(sock: socket.socket) -> None:
    # as asyncio does for its TCP transports: writes leave without waiting for an ACK
    if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
            and sock.proto == socket.IPPROTO_TCP):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _TransportSocket(_trsock.TransportSocket):
    """asyncio's ``TransportSocket`` wrapper, whose ``shutdown()`` first hands the
    transport's batched writes to the kernel (asyncio's write() had already sent them), so
    that ``get_extra_info("socket").shutdown(SHUT_WR)`` after ``write()`` does not overtake
    the data."""

    __slots__ = ("_aio_batch",)

    def __init__(self, sock: socket.socket, batch: SendBatch) -> None:
        super().__init__(sock)
        self._aio_batch = batch

    def shutdown(self, how: int) -> None:
        batch = self._aio_batch
        if batch.pending_bytes:
            try:
                batch.flush()
            except OSError:
                pass                    # the transport's own flush reports it
        return self._sock.shutdown(how)


class SocketTransport(_transports._FlowControlMixin, _transports.Transport):
    """A stream transport (TCP or Unix socket) whose writes are batched per loop
    iteration."""

    # _writer: the compiled write() path (aoprim.aio._aiowrite.TransportWriter), in a slot that
    # the class's compiled write() reads through the slot's member descriptor
    # (aoprim.aio._aiotransport.make_write_method)
    __slots__ = ("_writer", "__dict__", "__weakref__")

    _start_tls_compatible = True
    _sendfile_compatible = _constants._SendfileMode.TRY_NATIVE
    max_size = 256 * 1024
    _sock: socket.socket | None = None      # for __del__ if __init__ failed early

    if TYPE_CHECKING:
        # state asyncio's base classes keep (private; typeshed leaves it out): the loop
        # (None once connection_lost ran, so Any rather than an Optional checked at every
        # use), the extra-info dict, the write buffer limits and the pause flag
        _loop: Any
        _extra: dict[str, Any]
        _high_water: int
        _low_water: int
        _protocol_paused: bool
        _server: Any
        _empty_waiter: asyncio.Future[None] | None

    def __init__(self, loop: Loop, sock: socket.socket, protocol: asyncio.BaseProtocol,
                 waiter: asyncio.Future[Any] | None = None,
                 extra: dict[str, Any] | None = None,
                 server: Any = None) -> None:
        batch = SendBatch(sock, max_msgs=IOV_MAX, auto_flush=False)
        self._batch = batch
        # write() (the class's, compiled) runs this writer's steps (aoprim.aio._aiowrite),
        # its `fast` flag set (writes taken, see _can_fast); it reads the loop's SleepFlag
        # (set while the loop is inside select()); made before the base __init__, which
        # sets the write buffer limits it keeps a copy of
        self._writer = TransportWriter(self, batch, loop._aio_sleep)
        super().__init__(extra, loop)
        self._group = loop._aio_group
        # the read side (aoprim.aio._aiotransport): the fd's reader callback itself, compiled;
        # it holds _protocol, _buffered and _conn_lost (the properties below)
        self._reader = TransportReader(self, sock, loop._aio_rbuf)
        self._read_ready = self._reader
        self._blocked = False            # writer registered, batch out of the group
        self._extra['socket'] = _TransportSocket(sock, batch)
        try:
            self._extra['sockname'] = sock.getsockname()
        except OSError:
            self._extra['sockname'] = None
        if 'peername' not in self._extra:
            try:
                self._extra['peername'] = sock.getpeername()
            except OSError:
                self._extra['peername'] = None
        self._sock = sock
        self._sock_fd = sock.fileno()
        self._protocol_connected = False
        self.set_protocol(protocol)
        self._server = server
        # _conn_lost (the reader's conn_lost, 0): set when connection_lost is scheduled
        self._closing = False            # set when close() is called
        self._paused = False             # set when pause_reading() is called
        self._eof = False
        self._empty_waiter = None
        if server is not None:
            if _SERVER_ARG:
                server._attach(self)
            else:
                server._attach()
        loop._transports[self._sock_fd] = self
        _set_nodelay(sock)
        self._group.attach(batch, self)
        loop.call_soon(self._protocol.connection_made, self)
        # start reading only once connection_made() has been called
        loop.call_soon(self._add_reader, self._sock_fd, self._read_ready)
        if waiter is not None:
            loop.call_soon(_set_result_unless_cancelled, waiter, None)

    def __repr__(self) -> str:
        info = [self.__class__.__name__]
        if self._sock is None:
            info.append('closed')
        elif self._closing:
            info.append('closing')
        info.append(f'fd={self._sock_fd}')
        if self._sock is not None:
            info.append('read=' + ('polling' if self.is_reading() else 'idle'))
            info.append(f'write=<{"polling" if self._blocked else "idle"}, '
                        f'bufsize={self.get_write_buffer_size()}>')
        return '<{}>'.format(' '.join(info))

    def __del__(self, _warn: Callable[..., None] = __import__('warnings').warn) -> None:
        if self._sock is not None:
            _warn(f"unclosed transport {self!r}", ResourceWarning, source=self)
            self._sock.close()
            self._sock = None
            server = self._server
            if server is not None:
                self._server = None
                if _SERVER_ARG:
                    server._detach(self)
                else:
                    server._detach()

    # ---- aoprim's extras ---------------------------------------------------------------------

    @property
    def send_stats(self) -> dict[str, int]:
        """The transport's SendBatch counters: syscalls, messages, bytes, partial_writes,
        would_block."""
        return self._batch.stats

    # ---- protocol, state ---------------------------------------------------------------------

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        if (self._protocol_connected and self._protocol_paused and not self._blocked
                and self._batch.pending_bytes):
            # A protocol switch (start_tls) while the old protocol is paused by writes not
            # flushed yet.  asyncio would have sent them at write() time and, if the kernel
            # took them, never paused it: do the same now, so the old protocol gets its
            # resume_writing() and the new one never gets a resume it was not paused for.
            self._flush_now()
            self._maybe_resume_protocol()
        self._reader.set_protocol(protocol)     # _protocol, and _buffered
        self._protocol_connected = True

    # The read side's state, kept by the compiled reader (read without a Python frame)
    _protocol = property(_attrgetter("_reader.protocol"),
                         lambda self, protocol: self._reader.set_protocol(protocol))
    @property
    def _buffered(self) -> bool:
        # a def, not property(attrgetter): mypy (and so .ci/package's stubtest) reads only
        # the decorator form as read-only; nothing per message reads it
        """The protocol is a BufferedProtocol: reads use get_buffer()."""
        return self._reader.buffered

    _conn_lost = property(_attrgetter("_reader.conn_lost"),
                          lambda self, n: setattr(self._reader, "conn_lost", n),
                          doc="Set when the call to connection_lost is scheduled; then "
                              "counts writes made after it.")

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return not self._closing and not self._paused

    def pause_reading(self) -> None:
        if not self.is_reading():
            return
        self._paused = True
        self._loop._remove_reader(self._sock_fd)
        if self._loop.get_debug():
            logger.debug("%r pauses reading", self)

    def resume_reading(self) -> None:
        if self._closing or not self._paused:
            return
        self._paused = False
        self._add_reader(self._sock_fd, self._read_ready)
        if self._loop.get_debug():
            logger.debug("%r resumes reading", self)

    def _add_reader(self, fd: int, callback: Callable[[], object]) -> None:
        if not self.is_reading():
            return
        self._loop._add_reader(fd, callback)

    def can_write_eof(self) -> bool:
        return True

    # ---- write side --------------------------------------------------------------------------

    def _can_fast(self) -> bool:
        return not self._eof and self._empty_waiter is None and not self._conn_lost

    @property
    def _blocked(self) -> bool:
        """Writer registered, batch out of the group: the compiled writer's flag (its
        write() flushes above the high-water mark only when unset)."""
        return self._writer.blocked

    @_blocked.setter
    def _blocked(self, value: bool) -> None:
        self._writer.blocked = value

    @property
    def _fast(self) -> bool:
        """write() may take the short path: the compiled writer's flag."""
        return self._writer.fast

    @_fast.setter
    def _fast(self, value: bool) -> None:
        self._writer.fast = value

    # write(data): a C method of this class (set below the class: make_write_method), no
    # Python frame: every write of data is the compiled writer's (aoprim.aio._aiowrite: to
    # the batch, above the high-water mark to the kernel at once, a sleeping loop woken);
    # what it does not take comes here

    def _write_refused(self, data: object) -> None:
        """write() of what the compiled writer does not take: not a bytes-like object, or
        the transport not writable (its `fast` flag unset: after write_eof(), during a
        sendfile, once the connection is lost) -- asyncio's exceptions, in asyncio's order,
        and its count of the writes made after the connection was lost."""
        if not isinstance(data, _BYTES_LIKE):
            raise TypeError(f'data argument must be a bytes-like object, '
                            f'not {type(data).__name__!r}')
        if self._eof:
            raise RuntimeError('Cannot call write() after write_eof()')
        if self._empty_waiter is not None:
            raise RuntimeError('unable to write; sendfile is in progress')
        if not data:
            return
        if self._conn_lost:
            if self._conn_lost >= _constants.LOG_THRESHOLD_FOR_CONNLOST_WRITES:
                logger.warning('socket.send() raised exception.')
            self._conn_lost += 1
            return
        # none of those: `fast` is unset only in those states (_can_fast), so the flag is
        # stale; set again, the compiled writer takes the write
        self._fast = True
        self._writer.write(data)

    def writelines(self, list_of_data: Iterable[Buffer]) -> None:
        # one compiled pass (aoprim.aio._aiowrite: TransportWriter.writelines): every item
        # checked first (asyncio's TypeError, nothing written), then appended as write()
        # appends; not fast: _write_refused(b''.join(items)), asyncio's checks and order
        if _OWN_WRITELINES and (self._eof or self._empty_waiter is not None):
            _writelines_refused(self._eof)
        self._writer.writelines(list_of_data)

    def _aio_wake(self) -> None:
        """write() saw the loop's SleepFlag set.  The loop is running (sleeping in select():
        the write came from a signal handler or another thread): wake it through its
        self-pipe.  The loop is not running (before it started, between two runs, after
        stop() or close()): hand the batch to the kernel now, as asyncio's write() does --
        no iteration end would send it."""
        loop = self._loop
        if loop.is_running():
            loop._write_to_self()
        elif not self._blocked:
            self._flush_now()

    def get_write_buffer_size(self) -> int:
        # What the kernel has not taken, as on asyncio -- also right after a write: asyncio's
        # write() hands data to the kernel at once, so what this iteration wrote is handed
        # to it now (blocks if data is left, as a write above the mark).  Read by a caller
        # that watches its own buffering; the batch's internal count is
        # _batch.pending_bytes.
        # Only on the loop's thread (or with no loop running): from another thread -- a
        # transport is not thread-safe, but a monitoring read must not break it -- the count
        # is read as it is, never flushed there (a flush racing the loop's own would find
        # the batch busy, and registering a writer is the loop thread's business).
        batch = self._batch
        if batch.pending_bytes and not self._blocked and not self._conn_lost:
            tid = self._loop._thread_id
            if tid is None or tid == _get_ident():
                self._flush_now()
        return batch.pending_bytes

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._set_write_buffer_limits(high=high, low=low)
        if self._batch.pending_bytes > self._high_water:
            self._writer.over_high()        # the write path's step (aoprim.aio._aiowrite)

    def _set_write_buffer_limits(self, high: int | None = None,
                                 low: int | None = None) -> None:
        super()._set_write_buffer_limits(high=high, low=low)
        self._writer.high = self._high_water     # the compiled write()'s copy

    def _maybe_pause_protocol(self) -> None:
        if self._batch.pending_bytes <= self._high_water:
            return
        if not self._protocol_paused:
            self._protocol_paused = True
            self._batch.watch = True        # report after every flush until resumed
            try:
                self._protocol.pause_writing()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._loop.call_exception_handler({
                    'message': 'protocol.pause_writing() failed',
                    'exception': exc, 'transport': self, 'protocol': self._protocol})

    def _maybe_resume_protocol(self) -> None:
        if (self._protocol_paused and not self._conn_lost
                and self._batch.pending_bytes <= self._low_water):
            self._protocol_paused = False
            self._batch.watch = False
            try:
                self._protocol.resume_writing()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._loop.call_exception_handler({
                    'message': 'protocol.resume_writing() failed',
                    'exception': exc, 'transport': self, 'protocol': self._protocol})

    def _aio_flushed(self, status: int) -> None:
        """The loop's FlushGroup notify callback, called as ``notify(transport, status)`` for
        this transport after a flush: 1 = data left (block: writer), < 0 = -errno of a write
        error, 0 = all sent and the batch is watched (the protocol is paused).  Nothing for
        a transport aborted meanwhile (by an earlier notification of the same flush)."""
        if self._conn_lost:
            return
        try:
            if status > 0:
                self._block()
            elif status < 0:
                self._write_error(OSError(-status, os.strerror(-status)))
            else:
                self._maybe_resume_protocol()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            loop = self._loop
            if loop is not None:
                loop.call_exception_handler({
                    'message': 'Exception in the write-flush callback of a transport',
                    'exception': exc, 'transport': self, 'protocol': self._protocol})

    def _block(self) -> None:
        if self._blocked or self._conn_lost or self._sock is None:
            return
        self._blocked = True
        self._group.detach(self._batch)
        self._loop._add_writer(self._sock_fd, self._write_ready)

    def _unblock(self) -> None:
        self._blocked = False
        self._loop._remove_writer(self._sock_fd)
        self._group.attach(self._batch, self)

    def _write_error(self, exc: BaseException) -> None:
        self._batch.clear()
        self._fatal_error(exc, 'Fatal write error on socket transport')
        w = self._empty_waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    def _flush_now(self) -> bool:
        """Flush at once (close, write_eof, sendfile); block if data is left.  False if the
        write failed (the transport is then being closed)."""
        if not self._flush_or_fail():
            return False
        if self._batch.pending_bytes:
            self._block()
        return True

    def _flush_or_fail(self) -> bool:
        """One flush of the batch; False if the write failed (the transport is then being
        closed).  KeyboardInterrupt and SystemExit pass through."""
        try:
            self._batch.flush()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._write_error(exc)
            return False
        return True

    def _write_ready(self) -> None:
        if self._conn_lost:
            return
        if not self._flush_or_fail():
            return
        if self._batch.pending_bytes:
            self._maybe_resume_protocol()   # may write more, after what is still pending
        else:
            # The kernel took everything: what resume_writing() writes now (staying below
            # the high-water mark) is sent before this callback returns, as asyncio's
            # write() sends at once into an empty buffer -- also when resume_writing() then
            # stops the loop or raises KeyboardInterrupt / SystemExit (the writer would only
            # run at the next select).  A protocol paused again goes on through the writer.
            try:
                self._maybe_resume_protocol()
            except BaseException:           # KeyboardInterrupt, SystemExit
                self._send_resumed_writes()
                raise
            if not self._send_resumed_writes():
                return
        if not self._batch.pending_bytes and not self._conn_lost:
            self._unblock()
            if self._empty_waiter is not None and not self._empty_waiter.done():
                self._empty_waiter.set_result(None)
            if self._closing:
                self._call_connection_lost(None)
            elif self._eof:
                self._sock.shutdown(socket.SHUT_WR)

    def _send_resumed_writes(self) -> bool:
        """_write_ready(): flush what resume_writing() wrote into the drained batch, unless it
        paused the protocol again (then the writer sends it, and a resume follows from
        there).  False if the write failed (the transport is then being closed)."""
        if self._batch.pending_bytes and not self._conn_lost and not self._protocol_paused:
            return self._flush_or_fail()
        return True

    def write_eof(self) -> None:
        if self._closing or self._eof:
            return
        self._eof = True
        self._fast = False
        if self._batch.pending_bytes and not self._blocked:
            if not self._flush_now():
                return
        if not self._batch.pending_bytes:
            self._sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop._remove_reader(self._sock_fd)
        if self._batch.pending_bytes and not self._blocked:
            if not self._flush_now():
                return
        if not self._batch.pending_bytes:
            self._conn_lost += 1
            self._fast = False
            self._loop._remove_writer(self._sock_fd)
            self._loop.call_soon(self._call_connection_lost, None)

    def abort(self) -> None:
        self._force_close(None)

    def _fatal_error(self, exc: BaseException,
                     message: str = 'Fatal error on transport') -> None:
        if isinstance(exc, OSError):
            if self._loop.get_debug():
                logger.debug("%r: %s", self, message, exc_info=True)
        else:
            self._loop.call_exception_handler({
                'message': message, 'exception': exc,
                'transport': self, 'protocol': self._protocol})
        self._force_close(exc)

    def _force_close(self, exc: BaseException | None) -> None:
        if self._conn_lost:
            return
        batch = self._batch
        if batch.pending_bytes and not self._blocked:
            # written during this iteration: asyncio's write() would already have handed it
            # to the kernel, so do that now; drop only what the kernel does not take
            try:
                batch.flush()
            except OSError:
                pass
        batch.clear()
        batch.watch = False
        if self._blocked:
            self._loop._remove_writer(self._sock_fd)
        if not self._closing:
            self._closing = True
            self._loop._remove_reader(self._sock_fd)
        self._conn_lost += 1
        self._fast = False
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        self._blocked = True                # never re-attached
        self._fast = False
        if not self._conn_lost:
            self._conn_lost = 1             # a write after this is counted and dropped
        self._group.detach(self._batch)     # drops the batch's reference to us
        self._batch.clear()
        w = self._empty_waiter
        if w is not None and w.done():
            self._empty_waiter = None       # already resolved: nothing to fail
        try:
            if self._protocol_connected:
                self._protocol.connection_lost(exc)
        finally:
            self._sock.close()
            self._sock = None
            self._reader.sock = None
            self._protocol = None
            self._loop = None
            server = self._server
            if server is not None:
                self._server = None
                if _SERVER_ARG:
                    server._detach(self)
                else:
                    server._detach()
        # as asyncio's selector transport: a loop.sendfile() waiting for the buffer to drain
        # (abort(), Server.abort_clients(), a fatal error) fails instead of waiting forever
        w = self._empty_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionError("Connection is closed by peer"))

    # ---- sendfile (the loop's native path waits for the buffer to drain) ----------------------

    def _make_empty_waiter(self) -> asyncio.Future[None]:
        if self._empty_waiter is not None:
            raise RuntimeError("Empty waiter is already set")
        self._empty_waiter = self._loop.create_future()
        self._fast = False
        if self._batch.pending_bytes and not self._blocked:
            self._flush_now()
        if not self._batch.pending_bytes and not self._empty_waiter.done():
            self._empty_waiter.set_result(None)
        return self._empty_waiter

    def _reset_empty_waiter(self) -> None:
        self._empty_waiter = None
        self._fast = self._can_fast()

    # ---- read side ---------------------------------------------------------------------------

    # _read_ready: the compiled reader (aoprim.aio._aiotransport.TransportReader), set in
    # __init__; a plain protocol's data and a BufferedProtocol's get_buffer() /
    # buffer_updated() are handled there, end of stream here

    def _read_ready__on_eof(self) -> None:
        if self._loop.get_debug():
            logger.debug("%r received EOF", self)
        try:
            keep_open = self._protocol.eof_received()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, 'Fatal error: protocol.eof_received() call failed.')
            return
        if keep_open:
            # the protocol may still write, but nothing more can be read
            self._loop._remove_reader(self._sock_fd)
        else:
            self.close()


SocketTransport.write = make_write_method(     # type: ignore[method-assign]
    SocketTransport, SocketTransport.__dict__["_writer"])
