# cython: language_level=3, freethreading_compatible=True
"""ReadBuffer: receive into one reusable buffer and get exactly the bytes read.

aoprim.aio's loop owns one ReadBuffer and every plain (``data_received``) read of its stream
transports goes through it: one ``recv()`` into memory that is reused, then one ``bytes`` of
the size received.  asyncio's own transports call ``sock.recv(262144)`` instead: a fresh
256 KiB allocation per read, shrunk afterwards -- above glibc's initial mmap threshold, so a
fresh process pays mmap + munmap on every read.  (``sock.recv_into`` a bytearray followed by
``bytes(view[:n])`` does the same in Python, but costs ~0.3-0.4 us more per read: the view
slice and the buffer-protocol round trips.)

Threads: ``recv_bytes`` claims the buffer with an atomic exchange (acquire) and frees it with
a release store, so two threads can never receive into it at once (the second one gets
RuntimeError and reads nothing); the GIL is not what protects it.  The GIL is not released
during the call: the recv() uses MSG_DONTWAIT, so it never waits, whatever the socket's
mode -- on a blocking socket with nothing to read it raises BlockingIOError instead of
blocking every thread (issue 19 item 24).
"""
from libc.stdlib cimport malloc, free
from libc.errno cimport errno, EINTR, EBADF
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_SetFromErrno, PyErr_CheckSignals

from aoprim.atomic_h cimport (
    aop_exchange_u32, aop_store_u32, aop_load_i64, aop_store_i64, AOP_ACQUIRE, AOP_RELEASE,
    AOP_RELAXED,
)

import socket as _socket

cdef extern from "sys/socket.h" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    enum: MSG_DONTWAIT

# socket.socket's own C method, called as _fileno(sock): no Python code runs for a subclass
# that overrides fileno() (as SendBatch reads it)
cdef object _fileno = _socket.socket.fileno


cdef class ReadBuffer:
    """ReadBuffer(size=262144)

    One reusable receive buffer: ``recv_bytes(sock)`` reads at most ``size`` bytes from a
    socket into it and returns them as ``bytes`` (``b''`` at end of stream)."""

    def __cinit__(self, size=262144):
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError("size must be an int")
        if size < 1 or size > (1 << 30):
            raise ValueError("size must be in 1 .. 2**30")
        self.buf = <char *>malloc(<size_t>size)
        if self.buf == NULL:
            raise MemoryError()
        self.cap = <size_t>size

    def __dealloc__(self):
        free(self.buf)
        self.buf = NULL

    def recv_bytes(self, sock):
        """One non-blocking recv() (MSG_DONTWAIT, even on a blocking socket) from socket
        ``sock``: the bytes read, b'' at end of stream.  Errors raise OSError as
        ``socket.recv`` raises them (BlockingIOError: nothing to read now); EINTR is
        retried after running signal handlers."""
        cdef ssize_t n
        cdef int fd = _fileno(sock)
        if fd < 0:
            raise OSError(EBADF, "Bad file descriptor")
        # acquire: pairs with the release store below by the previous caller
        if aop_exchange_u32(&self.busy, 1, AOP_ACQUIRE) != 0:
            raise RuntimeError("ReadBuffer is in use by another thread")
        try:
            while True:
                n = recv(fd, self.buf, self.cap, MSG_DONTWAIT)   # never waits, GIL held
                if n >= 0:
                    break
                if errno != EINTR:
                    PyErr_SetFromErrno(OSError)
                PyErr_CheckSignals()
            # relaxed load + store, not an RMW: only the claimer writes the counters
            aop_store_i64(&self.st_reads, aop_load_i64(&self.st_reads, AOP_RELAXED) + 1,
                          AOP_RELAXED)
            aop_store_i64(&self.st_bytes, aop_load_i64(&self.st_bytes, AOP_RELAXED) + n,
                          AOP_RELAXED)
            return PyBytes_FromStringAndSize(self.buf, n)
        finally:
            # release: publishes the buffer (and the counters) to the next claimer
            aop_store_u32(&self.busy, 0, AOP_RELEASE)

    @property
    def size(self):
        """Bytes one recv_bytes() reads at most."""
        return self.cap

    @property
    def stats(self):
        """reads (recv calls that returned data or EOF) and bytes received.  Exact when no
        thread is inside recv_bytes() (relaxed atomics: never torn)."""
        return {"reads": aop_load_i64(&self.st_reads, AOP_RELAXED),
                "bytes": aop_load_i64(&self.st_bytes, AOP_RELAXED)}
