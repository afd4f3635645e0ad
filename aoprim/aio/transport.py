"""aoprim's TCP / Unix stream transport: asyncio's ``_SelectorSocketTransport`` with its
write side replaced by a compiled ``SendBatch`` and its plain read side reading into the
loop's reusable buffer.

Write side -- states of one transport::

    attached   the batch is attached to the loop's FlushGroup.  write() appends to it (small
               writes copied and coalesced, large bytes by reference) and returns; the add
               that makes the batch dirty queues it in the group, and the loop flushes the
               whole group at the end of the iteration (one sendmsg per transport).
    blocked    the kernel did not take everything (a flush reported status 1: would block,
               a short write, or the group's per-flush budget used up).  The batch leaves
               the group and a writer is registered; _write_ready() flushes the batch itself
               when the socket is writable and re-attaches it once it is empty.

asyncio's semantics, and how they map here:

- ``get_write_buffer_size()`` is the batch's ``pending_bytes`` (bytes written and not yet
  accepted by the kernel).  ``pause_writing()`` is called when it goes above the high-water
  mark (on the write that crosses it, as asyncio does); the batch is then *watched*, so the
  group reports it after every flush and ``resume_writing()`` is called once it is at or
  below the low-water mark.
- ``close()`` and ``write_eof()`` flush what is pending at once (then, if the kernel did not
  take it all, through the writer as asyncio does); ``abort()`` drops it (the batch is
  cleared: every referenced object is released at once).
- A write error reported by the flush is a fatal write error, as in asyncio.

Private asyncio surface: subclassing ``selector_events._SelectorSocketTransport`` (pinned by
``aoprim.aio.TESTED_PYTHONS``).
"""
import os
import socket

from asyncio import constants as _constants
from asyncio.protocols import BufferedProtocol as _BufferedProtocol
from asyncio import selector_events as _selector_events
from asyncio.log import logger

from aoprim import SendBatch

IOV_MAX = 1024                   # segments one sendmsg takes (the kernel's UIO_MAXIOV)

__all__ = ["SocketTransport"]

_Base = _selector_events._SelectorSocketTransport
_BYTES_LIKE = (bytes, bytearray, memoryview)


class SocketTransport(_Base):
    """A stream transport (TCP or Unix socket) whose writes are batched per loop
    iteration."""

    def __init__(self, loop, sock, protocol, waiter=None, extra=None, server=None):
        # before the base __init__: it may schedule callbacks that write
        batch = SendBatch(sock, max_msgs=IOV_MAX, auto_flush=False)
        self._batch = batch
        self._add = batch.add_copy       # asyncio copies what it buffers: so does add_copy
        self._group = loop._aio_group
        self._recv = loop._aio_rbuf.recv_bytes    # recv_bytes(sock): into the loop's buffer
        self._blocked = False            # writer registered, batch out of the group
        self._fast = True                # write() may take the short path (see _can_fast)
        super().__init__(loop, sock, protocol, waiter, extra, server)
        self._group.attach(batch, self)

    # ---- aoprim's extras ---------------------------------------------------------------------

    @property
    def send_stats(self):
        """The transport's SendBatch counters: syscalls, messages, bytes, partial_writes,
        would_block."""
        return self._batch.stats

    def set_protocol(self, protocol):
        self._buffered = isinstance(protocol, _BufferedProtocol)
        if self._protocol_paused and not self._blocked and self._batch.pending_bytes:
            # A protocol switch (start_tls) while the old protocol is paused by writes not
            # flushed yet.  asyncio would have sent them at write() time and, if the kernel
            # took them, never paused it: do the same now, so the old protocol gets its
            # resume_writing() and the new one never gets a resume it was not paused for.
            self._flush_now()
            self._maybe_resume_protocol()
        super().set_protocol(protocol)

    # ---- write side --------------------------------------------------------------------------

    def _can_fast(self):
        return not self._eof and self._empty_waiter is None and not self._conn_lost

    def write(self, data):
        if self._fast and type(data) is bytes:
            if self._add(data) > self._high_water:
                self._maybe_pause_protocol()
            return
        self._write_slow(data)

    def _write_slow(self, data):
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
        if self._add(data) > self._high_water:
            self._maybe_pause_protocol()

    def writelines(self, list_of_data):
        items = list_of_data if type(list_of_data) is list else list(list_of_data)
        if not self._fast:
            # the same checks, errors and order as asyncio's (which joins, then writes)
            self._write_slow(b''.join(items))
            return
        for data in items:
            if not isinstance(data, _BYTES_LIKE):
                b''.join(items)             # raises asyncio's TypeError, nothing written
        add = self._add
        p = 0
        for data in items:
            p = add(data)
        if p > self._high_water:
            self._maybe_pause_protocol()

    def get_write_buffer_size(self):
        return self._batch.pending_bytes

    def _maybe_pause_protocol(self):
        super()._maybe_pause_protocol()
        if self._protocol_paused and not self._batch.watch:
            self._batch.watch = True        # report after every flush until resumed

    def _maybe_resume_protocol(self):
        super()._maybe_resume_protocol()
        if not self._protocol_paused and self._batch.watch:
            self._batch.watch = False

    def _aio_flushed(self, status):
        """The loop's FlushGroup notify callback, called as ``notify(transport, status)`` for
        this transport after a flush: 1 = data left (block: writer), < 0 = -errno of a write
        error, 0 = all sent and the batch is watched (the protocol is paused)."""
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

    def _block(self):
        if self._blocked or self._sock is None:
            return
        self._blocked = True
        self._group.detach(self._batch)
        self._loop._add_writer(self._sock_fd, self._write_ready)

    def _unblock(self):
        self._blocked = False
        self._loop._remove_writer(self._sock_fd)
        self._group.attach(self._batch, self)

    def _write_error(self, exc):
        self._batch.clear()
        self._fatal_error(exc, 'Fatal write error on socket transport')
        w = self._empty_waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    def _flush_now(self):
        """Flush at once (close, write_eof, sendfile); block if data is left.  False if the
        write failed (the transport is then being closed)."""
        try:
            self._batch.flush()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._write_error(exc)
            return False
        if self._batch.pending_bytes:
            self._block()
        return True

    def _write_ready(self):
        if self._conn_lost:
            return
        try:
            self._batch.flush()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._loop._remove_writer(self._sock_fd)
            self._write_error(exc)
            return
        self._maybe_resume_protocol()       # may write more
        if not self._batch.pending_bytes:
            self._unblock()
            if self._empty_waiter is not None and not self._empty_waiter.done():
                self._empty_waiter.set_result(None)
            if self._closing:
                self._call_connection_lost(None)
            elif self._eof:
                self._sock.shutdown(socket.SHUT_WR)

    def write_eof(self):
        if self._closing or self._eof:
            return
        self._eof = True
        self._fast = False
        if self._batch.pending_bytes and not self._blocked:
            if not self._flush_now():
                return
        if not self._batch.pending_bytes:
            self._sock.shutdown(socket.SHUT_WR)

    def close(self):
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

    def _force_close(self, exc):
        if self._conn_lost:
            return
        self._batch.clear()                 # abort drops what is pending
        if self._blocked:
            self._loop._remove_writer(self._sock_fd)
        if not self._closing:
            self._closing = True
            self._loop._remove_reader(self._sock_fd)
        self._conn_lost += 1
        self._fast = False
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc):
        self._blocked = True                # never re-attached
        self._fast = False
        if not self._conn_lost:
            self._conn_lost = 1             # a write after this is counted and dropped
        self._group.detach(self._batch)     # drops the batch's reference to us
        self._batch.clear()
        w = self._empty_waiter
        if w is not None and w.done():
            self._empty_waiter = None       # already resolved: nothing to fail
        super()._call_connection_lost(exc)

    # ---- sendfile (the loop's native path waits for the buffer to drain) ----------------------

    def _make_empty_waiter(self):
        if self._empty_waiter is not None:
            raise RuntimeError("Empty waiter is already set")
        self._empty_waiter = self._loop.create_future()
        self._fast = False
        if self._batch.pending_bytes and not self._blocked:
            self._flush_now()
        if not self._batch.pending_bytes and not self._empty_waiter.done():
            self._empty_waiter.set_result(None)
        return self._empty_waiter

    def _reset_empty_waiter(self):
        self._empty_waiter = None
        self._fast = self._can_fast()

    # ---- read side ---------------------------------------------------------------------------

    def _read_ready(self):
        # asyncio's _read_ready -> _read_ready_cb indirection, folded: one Python call per read
        if self._buffered:
            self._read_ready__get_buffer()
            return
        if self._conn_lost:
            return
        try:
            data = self._recv(self._sock)
        except (BlockingIOError, InterruptedError):
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, 'Fatal read error on socket transport')
            return
        if not data:
            self._read_ready__on_eof()
            return
        try:
            self._protocol.data_received(data)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(
                exc, 'Fatal error: protocol.data_received() call failed.')

    def _read_ready__data_received(self):
        if not self._buffered:
            self._read_ready()
