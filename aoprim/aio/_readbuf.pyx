# cython: language_level=3, freethreading_compatible=True
"""ReadBuffer: receive into reused, resident memory and get exactly the bytes read.

aoprim.aio's loop owns one ReadBuffer and every plain (``data_received``) read of its stream
transports goes through it.  asyncio's own transports call ``sock.recv(262144)`` instead: a
fresh 256 KiB allocation per read, shrunk afterwards.

Where a read lands (``recv_bytes``):

- **a pool slot**: up to ``POOL_MAX`` ``bytes`` objects of ``size`` bytes, created (and
  pre-faulted) the first times a large read arrives and kept for the buffer's life, so
  their pages stay resident.  A slot is free when this buffer holds the only reference to
  it (reference count 1: nothing else can see it, so its contents may be overwritten).  The
  recv() goes straight into a free slot.  A read of at least ``HANDOUT_MIN`` bytes
  (``min(size // 4, 64 KiB)``) is handed out as the slot itself -- its length set to the
  bytes read, its cached hash reset: no copy, no allocation; the slot is free again once
  the protocol (and the write batch that sends it on) drop it.  A smaller read is copied
  out into a new ``bytes`` of its size, and the slot stays free.  A handed-out slot holds
  ``size`` bytes of memory for a read of at least ``HANDOUT_MIN``; a protocol keeping many
  of them keeps at most ``POOL_MAX``.  (The 64 KiB cap: with a large buffer, a 64 KiB read
  copied out into a fresh ``bytes`` costs a malloc'd copy and, once glibc trims the heap,
  its page faults again on every read -- what the pool is for.)
- **the buffer's own memory**, when no slot is free (none created yet: only small reads so
  far, or every slot still held): one recv() there, then one ``bytes`` of the size
  received; a large read so made also creates a new slot if fewer than ``POOL_MAX`` exist,
  and is handed out as that slot.

On a free-threaded build the pool is off (a reference count of 1 read by one thread does
not prove another thread is not about to take a reference): every read is copied out.

Threads: ``recv_bytes`` claims the buffer (and its pool) with an atomic exchange (acquire)
and frees it with a release store, so two threads can never receive into it at once (the
second one gets RuntimeError and reads nothing); the GIL is not what protects it.  The GIL is
not released during the call: the recv() uses MSG_DONTWAIT, so it never waits, whatever the
socket's mode -- on a blocking socket with nothing to read it raises BlockingIOError instead
of blocking every thread.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from libc.errno cimport errno, EINTR, EBADF
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.exc cimport PyErr_SetFromErrno, PyErr_CheckSignals
from cpython.ref cimport PyObject, Py_INCREF

from aoprim.atomic_h cimport (
    aop_exchange_u32, aop_store_u32, aop_load_i64, aop_store_i64, AOP_ACQUIRE, AOP_RELEASE,
    AOP_RELAXED,
)

from aoprim._sockfd cimport aop_sockfd_fast, aop_sockfd_fd, sockfd_setup

import socket as _socket

sockfd_setup()      # a socket's fd read from its struct, layout checked here (aop_sockfd.h)

cdef extern from "sys/socket.h" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    enum: MSG_DONTWAIT

cdef extern from *:
    """
    /* The pool needs the GIL's guarantee that a reference count of 1 stays 1 while this
       thread holds the buffer: off on a free-threaded build. */
    #ifdef Py_GIL_DISABLED
    #define AOP_RB_POOL_MAX 0
    #else
    #define AOP_RB_POOL_MAX 16
    #endif
    /* A slot handed out as the bytes of one read: length n (its memory still holds the
       slot's full size, which PyObject_Free does not need to know), NUL-terminated as every
       bytes object is, hash not yet computed (a previous owner may have hashed it). */
    static inline void aop_rb_shrink(PyObject *o, Py_ssize_t n) {
        Py_SET_SIZE(o, n);
        ((PyBytesObject *)o)->ob_sval[n] = '\\0';
    #if defined(__GNUC__)
    #pragma GCC diagnostic push
    #pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    #endif
        ((PyBytesObject *)o)->ob_shash = -1;
    #if defined(__GNUC__)
    #pragma GCC diagnostic pop
    #endif
    }
    """
    enum: AOP_RB_POOL_MAX
    void aop_rb_shrink(PyObject *o, Py_ssize_t n)
    Py_ssize_t Py_REFCNT(PyObject *o)
    Py_ssize_t Py_SIZE(PyObject *o)
    void Py_SET_SIZE(PyObject *o, Py_ssize_t n)
    char *PyBytes_AS_STRING_P "PyBytes_AS_STRING"(PyObject *o)
    void Py_XDECREF(PyObject *o)

#: the most pool slots one ReadBuffer keeps (0 on a free-threaded build)
POOL_MAX = AOP_RB_POOL_MAX

# a read of at least min(size // 4, this) bytes is handed out as its slot
cdef size_t HANDOUT_MAX = 65536

# socket.socket's own C method, called as _fileno(sock): no Python code runs for a subclass
# that overrides fileno() (as SendBatch reads it)
cdef object _fileno = _socket.socket.fileno


cdef inline ssize_t _recv_into(int fd, char *buf, size_t cap) except -1:
    """One recv() of at most cap bytes, EINTR retried after the signal handlers ran."""
    cdef ssize_t n
    while True:
        n = recv(fd, buf, cap, MSG_DONTWAIT)   # never waits, GIL held
        if n >= 0:
            return n
        if errno != EINTR:
            PyErr_SetFromErrno(OSError)
            return -1
        PyErr_CheckSignals()


cdef class ReadBuffer:
    """ReadBuffer(size=262144)

    Reused receive memory: ``recv_bytes(sock)`` reads at most ``size`` bytes from a socket
    and returns them as ``bytes`` (``b''`` at end of stream); a read of at least
    ``min(size // 4, 65536)`` bytes is returned without a copy, as one of the buffer's pooled,
    resident ``bytes`` objects (see the module's docstring)."""

    def __cinit__(self, size=262144):
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError("size must be an int")
        if size < 1 or size > (1 << 30):
            raise ValueError("size must be in 1 .. 2**30")
        self.buf = <char *>malloc(<size_t>size)
        if self.buf == NULL:
            raise MemoryError()
        self.cap = <size_t>size
        self.big = self.cap // 4 if self.cap >= 4 else 1
        if self.big > HANDOUT_MAX:
            self.big = HANDOUT_MAX
        self.npool = 0

    def __dealloc__(self):
        cdef int i
        free(self.buf)
        self.buf = NULL
        for i in range(self.npool):
            Py_XDECREF(self.pool[i])
            self.pool[i] = NULL
        self.npool = 0

    cdef PyObject *_free_slot(self) noexcept:
        """A pool slot nothing else references (reset to the full size; borrowed), or
        NULL."""
        cdef int i
        cdef PyObject *s
        for i in range(self.npool):
            s = self.pool[i]
            if Py_REFCNT(s) == 1:           # the pool's own reference only
                if <size_t>Py_SIZE(s) != self.cap:
                    Py_SET_SIZE(s, <Py_ssize_t>self.cap)
                return s
        return NULL

    def recv_bytes(self, sock):
        """One non-blocking recv() (MSG_DONTWAIT, even on a blocking socket) from socket
        ``sock``: the bytes read, b'' at end of stream.  Errors raise OSError as
        ``socket.recv`` raises them (BlockingIOError: nothing to read now); EINTR is
        retried after running signal handlers."""
        return self.c_recv(sock)

    cdef bytes c_recv(self, object sock):
        """recv_bytes() for C callers (aoprim.aio._aiotransport's reader): the same call, no
        method lookup."""
        cdef ssize_t n
        cdef PyObject *slot
        cdef object new
        cdef char *data
        cdef int fd
        if aop_sockfd_fast(sock):
            fd = aop_sockfd_fd(sock)        # the struct's field fileno() returns (aop_sockfd.h)
        else:
            fd = _fileno(sock)
        if fd < 0:
            raise OSError(EBADF, "Bad file descriptor")
        # acquire: pairs with the release store below by the previous caller
        if aop_exchange_u32(&self.busy, 1, AOP_ACQUIRE) != 0:
            raise RuntimeError("ReadBuffer is in use by another thread")
        try:
            slot = self._free_slot() if self.npool else NULL
            data = PyBytes_AS_STRING_P(slot) if slot != NULL else self.buf
            n = _recv_into(fd, data, self.cap)
            # relaxed load + store, not an RMW: only the claimer writes the counters
            aop_store_i64(&self.st_reads, aop_load_i64(&self.st_reads, AOP_RELAXED) + 1,
                          AOP_RELAXED)
            aop_store_i64(&self.st_bytes, aop_load_i64(&self.st_bytes, AOP_RELAXED) + n,
                          AOP_RELAXED)
            if <size_t>n < self.big:        # small (or EOF): a copy of its own size
                return PyBytes_FromStringAndSize(data, n)
            if slot == NULL:
                if self.npool >= AOP_RB_POOL_MAX:
                    return PyBytes_FromStringAndSize(data, n)     # every slot is held
                # a new slot: its pages faulted in once here (the copy, then the memset of
                # the rest), and kept resident for the buffer's life
                new = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>self.cap)
                slot = <PyObject *>new
                memcpy(PyBytes_AS_STRING_P(slot), data, <size_t>n)
                memset(PyBytes_AS_STRING_P(slot) + n, 0, self.cap - <size_t>n)
                Py_INCREF(new)              # the pool's reference
                self.pool[self.npool] = slot
                self.npool += 1
            aop_rb_shrink(slot, n)
            aop_store_i64(&self.st_pooled,
                          aop_load_i64(&self.st_pooled, AOP_RELAXED) + 1, AOP_RELAXED)
            return <bytes>slot              # a new reference for the caller
        finally:
            # release: publishes the buffer, its pool (and the counters) to the next claimer
            aop_store_u32(&self.busy, 0, AOP_RELEASE)

    @property
    def size(self):
        """Bytes one recv_bytes() reads at most."""
        return self.cap

    @property
    def handout_min(self):
        """A read of at least this many bytes (``min(size // 4, 65536)``) is handed out as
        a pool slot, without a copy."""
        return self.big

    @property
    def stats(self):
        """reads (recv calls that returned data or EOF) and bytes received.  Exact when no
        thread is inside recv_bytes() (relaxed atomics: never torn)."""
        return {"reads": aop_load_i64(&self.st_reads, AOP_RELAXED),
                "bytes": aop_load_i64(&self.st_bytes, AOP_RELAXED)}

    @property
    def pool_stats(self):
        """slots (pool slots created so far, at most POOL_MAX), free (slots nothing else
        references now), handed_out (reads returned as a slot, without a copy)."""
        cdef int i, nfree = 0
        for i in range(self.npool):
            if Py_REFCNT(self.pool[i]) == 1:     # the pool's own reference only
                nfree += 1
        return {"slots": self.npool, "free": nfree,
                "handed_out": aop_load_i64(&self.st_pooled, AOP_RELAXED)}
