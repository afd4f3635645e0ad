# cython: language_level=3, freethreading_compatible=True
"""TransportReader: the compiled read side of aoprim.aio's stream transport
(docs/aio-compiled.md).

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

The transport's ``write`` is here too (``make_write_method``): a method descriptor made for
the transport class, whose C function runs the transport's ``aoprim.aio._aiowrite``
``TransportWriter`` without a Python frame.  The writer is read from the transport's
``_writer`` slot through that slot's own member descriptor (what ``transport._writer``
runs: CPython's check of the object's type, and its read of the slot), then called through
``_aiowrite.pxd``'s cdef interface (``c_write``), which Cython type-checks.  The transport
is not an extension type -- asyncio's ``_FlowControlMixin`` base has ``__slots__``, so a
compiled base class would be a layout conflict -- so no ``.pxd`` can declare its fields.

The GC: the reader and its transport reference each other; the reader's fields are not
cleared by the collector (``no_gc_clear``): the cycle is broken by clearing the transport's
``__dict__``, so a reader is never seen with its ReadBuffer gone.  Threads: a transport is
used from its loop's thread (asyncio's contract); the ReadBuffer claims itself atomically,
so nothing here relies on the GIL.
"""
cimport cython
from cpython.bytes cimport PyBytes_GET_SIZE
from cpython.ref cimport PyObject

from aoprim.aio._readbuf cimport ReadBuffer
from aoprim.aio._aiowrite cimport TransportWriter

from asyncio import protocols as _protocols

cdef object _BufferedProtocol = _protocols.BufferedProtocol

# the C of this module (aoprim/include/aop_aiotransport.h: what it does and its invariants)
cdef extern from "aop_aiotransport.h":
    bint aop_is_object_member(object descr)
    PyObject *aop_writer_descr
    object aop_writer_of(object self)
    int (*aop_tw_impl)(object self, object data) except -1
    PyObject *aop_str_data
    object aop_make_write_descr(object cls)


# ---- the transport's write(): a C method of its class -------------------------------------

# the transport class's `_writer` member descriptor: set once at import by
# make_write_method, read-only after (one class: a second call must give the same one);
# this reference keeps aop_writer_descr alive
cdef object _writer_descr = None
cdef object _data_str = "data"


cdef int _write(object self, object data) except -1:
    """The transport's write(data): its TransportWriter's c_write (the steps of
    aoprim.aio._aiowrite's module docstring), the writer read as ``self._writer`` by the
    slot's member descriptor; a slot that holds something else (replaced) is asked by
    ``.write(data)``; an unset one raises the attribute read's AttributeError."""
    cdef object w = aop_writer_of(self)     # a reference of its own: the slot may change
    if type(w) is TransportWriter:
        return (<TransportWriter>w).c_write(data)
    w.write(data)
    return 0


def make_write_method(cls, writer_descr):
    """The ``write`` method for stream transport class ``cls`` (aoprim.aio.transport's
    SocketTransport), which has ``writer_descr`` -- its ``_writer`` ``__slots__`` member --
    in its own dict: a method descriptor of ``cls`` whose C function runs the transport's
    TransportWriter without a Python frame.  Being a method of the class (not a bound
    method in each instance's dict), the interpreter's specialised attribute lookup and
    call reach it without a dict lookup or an argument tuple.  Called once, at import."""
    global _writer_descr
    global aop_writer_descr
    global aop_str_data
    if not isinstance(cls, type) or cls.__dict__.get("_writer") is not writer_descr:
        raise TypeError("writer_descr must be cls's own `_writer` member")
    if not aop_is_object_member(writer_descr) or (_writer_descr is not None
                                                   and writer_descr is not _writer_descr):
        raise TypeError("`_writer` is not an object __slots__ member (or not the first "
                        "class's)")
    _writer_descr = writer_descr
    aop_writer_descr = <PyObject *>writer_descr    # kept alive by _writer_descr
    aop_str_data = <PyObject *>_data_str    # kept alive by this module's _data_str
    return aop_make_write_descr(cls)


aop_tw_impl = _write


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
