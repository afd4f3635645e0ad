# cython: language_level=3, freethreading_compatible=True
"""TransportWriter: the compiled ``write()`` of aoprim.aio's stream transport.

``aoprim.aio.transport.SocketTransport`` makes one per transport and serves
``transport.write`` with its ``write`` method: the same steps as the transport's Python
fast path, without a Python frame per call (a framed server writes once per message, and
that frame was a large part of aoprim.aio's cost per message).

``write(data)``, while ``fast`` is set (the transport set it: not after write_eof / close /
abort / a fatal error, not during sendfile) and ``data`` is exactly ``bytes``:

1. ``add(data)`` -- the transport's ``SendBatch.add_copy``: appended to the batch (queued in
   the loop's FlushGroup by the add that makes it dirty); it returns the pending bytes;
2. above ``high`` (the transport's high-water mark): ``transport._over_high()`` (hands the
   batch to the kernel at once, blocks if data is left, pauses the protocol if still above);
3. ``selector.sleeping`` (the loop is inside select(): the write came from a signal handler
   or another thread): ``transport._loop._aio_wake()``.

Anything else (another type, ``fast`` unset) is ``transport._write_slow(data)``: asyncio's
checks, errors and counting of writes after the connection was lost.

Threads: ``fast`` and ``high`` are plain fields written by the transport on the loop's thread,
as a transport (asyncio's too) is used from its loop's thread; ``add_copy`` claims the batch
itself, so a write from another thread never corrupts it.  No state here relies on the GIL.
"""


cdef class TransportWriter:
    """TransportWriter(transport, add, selector): see the module docstring."""

    def __cinit__(self, transport, add, selector):
        self.transport = transport
        self.add = add
        self.selector = selector
        self.fast = True
        self.high = 0

    def write(self, data):
        """Write ``data`` on the transport (see the module docstring)."""
        cdef Py_ssize_t pending
        if self.fast and type(data) is bytes:
            pending = self.add(data)
            if pending > self.high:
                self.transport._over_high()
            if self.selector.sleeping:
                self.transport._loop._aio_wake()
            return
        self.transport._write_slow(data)
