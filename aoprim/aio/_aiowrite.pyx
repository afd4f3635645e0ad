# cython: language_level=3, freethreading_compatible=True
"""TransportWriter: the compiled ``write()`` of aoprim.aio's stream transport.

``aoprim.aio.transport.SocketTransport`` makes one per transport and serves
``transport.write`` with its ``write`` method: every write of data goes through these
steps, without a Python frame per call (a framed server writes once per message, and
that frame was a large part of aoprim.aio's cost per message).  The transport's Python code
keeps only what a write refuses (``_write_refused``) and what is not per write.

``write(data)``, while ``fast`` is set (the transport set it: not after write_eof / close /
abort / a fatal error, not during sendfile):

1. appended to the transport's ``SendBatch`` (queued in the loop's FlushGroup by the add
   that makes it dirty).  Exactly ``bytes``: as its ``add_copy`` appends them -- a message
   of at most the batch's ``copy_max`` bytes is copied with the C-level ``c_add_copy``
   (what add_copy does for it, without a Python call), anything else -- or a busy batch,
   or no memory -- is ``add(data)`` (the bound ``add_copy``, which raises what it raises).
   Any other bytes-like object (a bytearray, a memoryview, a subclass of bytes or
   bytearray): nothing when it is empty (asyncio's ``if not data: return``), else appended
   as ``writelines`` appends an item (``_add_item``, below: copied when small, by
   reference from ``SEND_NOW`` bytes on, so the kernel takes what it can from the
   caller's memory; what it leaves is copied on Python 3.11 and kept as a view on 3.12+,
   where a bytearray cannot be resized until it is sent -- as asyncio keeps it, docs/aio.md).
   Then the pending bytes are read;
2. above ``high`` (the transport's high-water mark) -- or at ``SEND_NOW`` pending bytes
   (64 KiB) or more, whatever the mark -- the batch goes to the kernel now, as
   asyncio's write() sends at once (``_flush_over_high``), without a Python frame when the
   kernel takes everything (a large message echoed whole): unless ``blocked`` (the
   transport's ``_blocked``: its writer sends, in order), the batch is flushed here -- what is left
   then goes to ``transport._block()`` and ``transport._maybe_pause_protocol()``; a flush
   error (not KeyboardInterrupt / SystemExit, which propagate) to
   ``transport._write_error(exc)``, without its traceback.  A blocked transport only
   pauses the protocol (``transport._maybe_pause_protocol()``).  ``over_high()`` is this
   step alone (the transport's ``set_write_buffer_limits`` lowering the mark);
3. ``sleep.sleeping`` (the loop's SleepFlag: the loop is inside select(), so the write
   came from a signal handler or another thread -- or the loop is not running at all):
   ``transport._aio_wake()`` (wakes the loop, or hands the batch to the kernel at once).

Why ``SEND_NOW``: batching pays per syscall saved, and from 64 KiB on a send costs about
what its copy costs whatever else rides with it; meanwhile a large message left for the
iteration's end is copied out to the kernel after the iteration's other reads have pushed
it out of the cache (ten 64 KiB echoes per wake-up: 3 us more kernel time per message than
asyncio's write, which sends at once).  Flushing early never reorders: the batch
goes out whole, in order.

Anything else (not bytes-like, or ``fast`` unset) is ``transport._write_refused(data)``:
asyncio's checks and errors, and its counting of writes after the connection was lost.

``writelines(items)`` is the same in one compiled pass over the items: while ``fast`` is set,
every item is first checked to be bytes-like (any other raises asyncio's TypeError, from
``b''.join``, with nothing written), then each is appended as ``write`` appends bytes -- a
run of bytes of at most ``copy_max`` bytes each copied under one claim of the batch
(``sb_add_bytes_run``), a bytearray or contiguous memoryview that small with
``c_add_copy``, one of ``SEND_NOW`` bytes or more by reference as ``write()`` takes it
(offered to the kernel from the caller's memory; what is left then is copied on Python 3.11
and kept as a view on 3.12+, as asyncio does), anything else ``add_copy`` -- and steps 2
and 3 run once, after the last.  Every item's buffer is acquired before any is appended:
one that refuses it (a released memoryview) raises with nothing written.
Without ``fast``: ``transport._write_refused(b''.join(items))`` (asyncio 3.11's writelines).

Threads: ``fast`` and ``high`` are plain fields written by the transport on the loop's thread,
as a transport (asyncio's too) is used from its loop's thread; ``add_copy`` claims the batch
itself, so a write from another thread never corrupts it.  No state here relies on the GIL.
"""
import sys

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_FULL_RO

from aoprim._sendbatch cimport SendBatch, _get, sb_add_bytes_run
from aoprim.atomic_h cimport aop_load_u32, aop_store_u32, AOP_SEQ_CST

# pending bytes at which write() hands the batch to the kernel at once, below the
# high-water mark too (the module docstring: why)
cdef enum:
    _SEND_NOW = 65536
SEND_NOW = _SEND_NOW

# asyncio 3.11 copies the part of a write the kernel does not take at once; 3.12+ keeps a
# memoryview of the caller's buffer (docs/aio.md lists it among the differences)
cdef bint _COPY_UNSENT = sys.version_info < (3, 12)


cdef class SleepFlag:
    """SleepFlag(): one per aoprim.aio loop -- ``sleeping`` is True while the loop is (about
    to be) inside select().  The loop's selector sets it before its last check of the
    FlushGroup and clears it when select() returns; a write reads it after queueing its
    batch.  Both sides are seq_cst (a store then a load on each side, Dekker-style): either
    the loop's check sees the queued batch, or the write sees the flag and wakes the loop --
    never neither, also on a free-threaded build."""

    @property
    def sleeping(self):
        return aop_load_u32(&self.flag, AOP_SEQ_CST) != 0    # seq_cst: see the class doc

    @sleeping.setter
    def sleeping(self, value):
        aop_store_u32(&self.flag, 1 if value else 0, AOP_SEQ_CST)   # seq_cst: class doc


cdef class TransportWriter:
    """TransportWriter(transport, batch, sleep): see the module docstring."""

    def __cinit__(self, transport, SendBatch batch not None, SleepFlag sleep not None):
        self.transport = transport
        self.batch = batch
        self.add = batch.add_copy
        self.sleep = sleep
        self.fast = True
        self.high = 0
        self.blocked = False

    def write(self, data):
        """Write ``data`` on the transport (see the module docstring)."""
        self.c_write(data)

    cdef int c_write(self, object data) except -1:
        """write() for C callers (the transport's ``write`` method, which
        ``aoprim.aio._aiotransport.make_write_method`` made): the same steps, no method
        call."""
        cdef Py_ssize_t pending
        cdef Py_ssize_t n
        cdef SendBatch b = self.batch
        cdef bint viewed
        if self.fast:
            if type(data) is bytes:
                n = PyBytes_GET_SIZE(data)
                # owner_tid: a batch limited to one thread is left to add_copy's own check
                if (0 < n and <size_t>n <= b.copy_max and b.owner_tid == 0
                        and b.c_add_copy(PyBytes_AS_STRING(data), <size_t>n) >= 0):
                    pending = _get(&b.pend_bytes)    # relaxed load (see _get): a threshold
                else:
                    pending = self.add(data)
                return _after_add(self, b, pending)
            if isinstance(data, (bytes, bytearray, memoryview)):
                if not data:                # asyncio's `if not data: return`
                    return 0
                viewed = _add_item(self, b, data)
                try:
                    _after_add(self, b, _get(&b.pend_bytes))    # relaxed load: a threshold
                finally:
                    if viewed and _COPY_UNSENT and _get(&b.pend_bytes):
                        b._copy_views()     # 3.11: what the kernel left is copied
                return 0
        self.transport._write_refused(data)
        return 0

    def over_high(self):
        """Step 2 of the module docstring alone, for a batch above the high-water mark
        that no write just took there (the transport lowered the mark): to the kernel now
        unless blocked or the connection is lost, then pause the protocol if still above
        the mark."""
        if self.blocked or self.transport._conn_lost:
            self.transport._maybe_pause_protocol()
        else:
            self._flush_over_high(self.batch)

    def writelines(self, items):
        """Write every bytes-like item of ``items`` in order (see the module docstring)."""
        cdef list lst = items if type(items) is list else list(items)
        cdef SendBatch b = self.batch
        cdef object item
        cdef type t
        cdef Py_buffer view
        cdef bint viewed = False
        cdef Py_ssize_t i, j, end
        if not self.fast:
            self.transport._write_refused(b''.join(lst))
            return
        for item in lst:
            t = type(item)
            if t is bytes:
                continue
            if (t is not bytearray and t is not memoryview
                    and not isinstance(item, (bytes, bytearray, memoryview))):
                b''.join(lst)               # asyncio 3.11's TypeError, nothing written
            # every buffer acquired once before anything is appended: an item that refuses
            # it (a released memoryview) raises here, nothing written -- asyncio 3.12+
            # takes memoryview(item) of every item before it buffers any, 3.11 joins them
            PyObject_GetBuffer(item, &view, PyBUF_FULL_RO)
            PyBuffer_Release(&view)
        # runs of small bytes items are copied under one claim of the batch
        # (sb_add_bytes_run); any other item as write() takes it
        i = 0
        end = len(lst)
        while i < end:
            j = sb_add_bytes_run(b, lst, i)
            if j > i:
                i = j
                continue
            item = lst[i]
            i += 1
            if _add_item(self, b, item):
                viewed = True
        try:
            _after_add(self, b, _get(&b.pend_bytes))    # relaxed load (see _get): a threshold
        finally:
            if viewed and _COPY_UNSENT and _get(&b.pend_bytes):
                b._copy_views()             # 3.11: what the kernel left is copied (asyncio's)


    cdef int _flush_over_high(self, SendBatch b) except -1:
        """Above the high-water mark, not blocked, the connection not lost (step 2): the
        batch to the kernel now; data left: block (writer) and pause the protocol if still
        above the mark; a failed flush: the transport's write error, no pause."""
        try:
            b.flush()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            # no traceback: its frames (write()'s) would keep the written data alive
            self.transport._write_error(exc.with_traceback(None))
            return 0
        if _get(&b.pend_bytes):             # relaxed load (see _get): flushed on this thread
            self.transport._block()
            self.transport._maybe_pause_protocol()
        return 0


cdef int _add_item(TransportWriter w, SendBatch b, object item) except -1:
    """Step 1 for one bytes-like item (of writelines, or a write() of anything but exact
    bytes): exact bytes of at most ``copy_max`` bytes copied by ``c_add_copy``; another
    contiguous buffer (a bytearray, a memoryview, a subclass of bytes or bytearray) copied
    the same way when that small, appended by reference from ``SEND_NOW`` bytes on (as
    asyncio's write() sends a large buffer: the kernel takes what it can from the caller's
    memory; the caller copies what is left on 3.11); anything else -- a size between the
    two, a non-contiguous view, a busy batch, a batch limited to one thread -- by
    ``add_copy``.  Returns 1 when the item was appended by reference."""
    cdef Py_ssize_t n
    cdef Py_buffer view
    cdef bint small, large
    if type(item) is bytes:
        n = PyBytes_GET_SIZE(item)
        if n == 0:
            return 0
        if (<size_t>n <= b.copy_max and b.owner_tid == 0
                and b.c_add_copy(PyBytes_AS_STRING(item), <size_t>n) >= 0):
            return 0
    elif b.owner_tid == 0:
        try:
            PyObject_GetBuffer(item, &view, PyBUF_SIMPLE)
        except BufferError:
            pass                            # not contiguous: add_copy gathers it
        else:
            small = (view.len == 0 or (<size_t>view.len <= b.copy_max
                     and b.c_add_copy(view.buf, <size_t>view.len) >= 0))
            large = view.len >= _SEND_NOW
            PyBuffer_Release(&view)
            if small:
                return 0
            if large:
                b.add(item)                 # by reference: the export is held until sent
                return 1
    w.add(item)
    return 0


cdef int _after_add(TransportWriter w, SendBatch b, Py_ssize_t pending) except -1:
    """Steps 2 and 3 of the module docstring, once data was added: the at-once flush above
    the high-water mark (or at SEND_NOW), and the wake-up of a sleeping loop."""
    if pending > w.high or pending >= _SEND_NOW:
        if w.blocked:
            w.transport._maybe_pause_protocol()     # the writer sends, in order
        else:
            w._flush_over_high(b)
    if aop_load_u32(&w.sleep.flag, AOP_SEQ_CST):    # seq_cst: see SleepFlag
        w.transport._aio_wake()
    return 0
