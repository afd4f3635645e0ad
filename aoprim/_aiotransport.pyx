# cython: language_level=3, freethreading_compatible=True
"""TransportReader: the compiled read side of aoprim.aio's stream transport (issue 23 step 3,
docs/aio-compiled.md).

``aoprim.aio.transport.SocketTransport`` makes one per transport and registers it as its
fd's reader (``transport._read_ready`` is the reader itself): the loop's ready queue calls
it, and one read runs no Python frame of aoprim's -- the recv is a C call on the loop's
``ReadBuffer`` and ``protocol.data_received(data)`` a vectorcall.  It does what asyncio's
selector transport's ``_read_ready`` does, in the same order, with the same messages:

- ``conn_lost`` set (the transport is being closed, aborted or lost): nothing;
- a plain protocol: ``ReadBuffer.recv_bytes(sock)`` (at most the buffer's size,
  ``aoprim.aio.loop.READ_BUFFER_SIZE``); BlockingIOError / InterruptedError: nothing; any other error (not
  KeyboardInterrupt / SystemExit, which propagate) is
  ``transport._fatal_error(exc, 'Fatal read error on socket transport')``; ``b''`` (end of
  stream) is ``transport._read_ready__on_eof()`` (eof_received, then close unless it
  returned true -- Python, once per connection); data is ``protocol.data_received(data)``,
  whose error is ``_fatal_error(exc, 'Fatal error: protocol.data_received() call
  failed.')``;
- a ``BufferedProtocol``: ``protocol.get_buffer(-1)`` (an empty one raises asyncio's
  RuntimeError; either is ``'Fatal error: protocol.get_buffer() call failed.'``), then
  ``sock.recv_into(buf)`` (errors as above; 0 is end of stream), then
  ``protocol.buffer_updated(nbytes)`` (``'Fatal error: protocol.buffer_updated() call
  failed.'``).

The state a read needs lives here, and the transport's names for it read and write these
fields: ``_protocol`` is ``protocol``, ``_buffered`` is ``buffered`` (set together by
``set_protocol``), ``_conn_lost`` is ``conn_lost``; ``sock`` is the transport's socket until
its connection is lost (then None).  What is not per message (pause/resume_reading,
close, abort, EOF, fatal errors) stays in the transport's Python code.

The GC: the reader and its transport reference each other; the reader's fields are not
cleared by the collector (``no_gc_clear``): the cycle is broken by clearing the transport's
``__dict__``, so a reader is never seen with its ReadBuffer gone.  Threads: a transport is
used from its loop's thread (asyncio's contract); the ReadBuffer claims itself atomically,
so nothing here relies on the GIL.
"""
cimport cython
from cpython.bytes cimport PyBytes_GET_SIZE

from aoprim._readbuf cimport ReadBuffer

from asyncio import protocols as _protocols

cdef object _BufferedProtocol = _protocols.BufferedProtocol


@cython.no_gc_clear
@cython.final
cdef class TransportReader:
    """TransportReader(transport, sock, rbuf): see the module docstring.  Calling it is one
    read-ready callback."""

    def __cinit__(self, transport, sock, ReadBuffer rbuf not None):
        self.transport = transport
        self.sock = sock
        self.rbuf = rbuf
        self.protocol = None
        self.buffered = False
        self.conn_lost = 0

    @property
    def __qualname__(self):
        # how asyncio's handle repr (debug mode, slow-callback warnings) names the callback:
        # as it named the Python method this replaces
        return "SocketTransport._read_ready"

    def set_protocol(self, protocol):
        """The transport's protocol, and whether reads go through get_buffer()."""
        self.buffered = isinstance(protocol, _BufferedProtocol)
        self.protocol = protocol

    def __call__(self):
        self.read_ready()

    cdef int read_ready(self) except -1:
        """One read-ready callback (see the module docstring)."""
        cdef bytes data
        if self.buffered:
            return self._read_buffered()
        if self.conn_lost:
            return 0
        try:
            data = self.rbuf.c_recv(self.sock)
        except (BlockingIOError, InterruptedError):
            return 0
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.transport._fatal_error(exc, 'Fatal read error on socket transport')
            return 0
        if PyBytes_GET_SIZE(data) == 0:
            self.transport._read_ready__on_eof()
            return 0
        try:
            self.protocol.data_received(data)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.transport._fatal_error(
                exc, 'Fatal error: protocol.data_received() call failed.')
        return 0

    cdef int _read_buffered(self) except -1:
        if self.conn_lost:
            return 0
        try:
            buf = self.protocol.get_buffer(-1)
            if not len(buf):
                raise RuntimeError('get_buffer() returned an empty buffer')
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.transport._fatal_error(
                exc, 'Fatal error: protocol.get_buffer() call failed.')
            return 0
        try:
            nbytes = self.sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return 0
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.transport._fatal_error(exc, 'Fatal read error on socket transport')
            return 0
        if not nbytes:
            self.transport._read_ready__on_eof()
            return 0
        try:
            self.protocol.buffer_updated(nbytes)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.transport._fatal_error(
                exc, 'Fatal error: protocol.buffer_updated() call failed.')
        return 0
