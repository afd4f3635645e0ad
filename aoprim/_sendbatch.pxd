# cython: language_level=3
"""SendBatch, for ``cimport``: a nogil add-pointer / flush API.

    from aoprim._sendbatch cimport SendBatch

    cdef SendBatch b = SendBatch(fd, auto_flush=False)
    cdef Py_ssize_t n
    with nogil:
        b.c_add_copy(header, 4)          # copied now: the caller may reuse `header` at once
        b.c_add_ptr(payload, size)       # by reference: NOT copied
        n = b.c_flush()                  # >= 0 bytes written, or -errno

Lifetime rule for c_add_ptr: the batch keeps only the pointer.  The caller must keep the
memory alive and unchanged until it has been fully sent: until a flush has returned with
``pending_bytes`` no longer covering it (simplest: until ``pending_bytes == 0``), or until
``clear()`` / the batch's deallocation.  c_add_copy has no such rule.

Return codes: c_add_* return 0 when the batch is below both thresholds, 1 when ``max_msgs``
or ``max_bytes`` is reached (the C API never flushes by itself: flush when you see 1),
-ENOMEM when memory ran out (nothing was added), -EBUSY when another thread is inside the
same batch (nothing was added).  c_flush returns the bytes written by this call (0 when the
kernel would block or nothing is pending), -EBUSY, or -errno of a failed write (pending data
intact).  c_flush retries EINTR without checking Python signal handlers.  When a flush
completes messages added from Python that own objects (bytes, buffer exports, slots), it
takes the GIL briefly to release them; a release may close the socket (and the number be
reused), so before any further system call it re-reads the socket's fd and stops with
-EBADF if it changed (an int-fd target is the caller's to keep open).  Unlike
flush() and FlushGroup.flush(), c_flush does not pin the socket (that needs the GIL): a
socket.close() from another thread during a c_flush is the caller's to prevent.

One thread at a time: every entry point (Python or C) claims the batch with one atomic
exchange; a concurrent entry gets RuntimeError (Python) or -EBUSY (C), never corruption.

FlushGroup lives in aoprim._flushgroup (``from aoprim._flushgroup cimport FlushGroup``).
A batch attached to a group queues itself there (one C field says whether it is queued)
when an add leaves it with pending data -- the C adds included: c_add_* take the GIL
briefly for that, only on the add that queues the batch.  The batch sees its group as a
``_GroupBase`` (declared below), whose one virtual method ``_queue`` FlushGroup overrides:
this keeps the dependency one-way (_flushgroup cimports _sendbatch, never the reverse).
"""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from posix.uio cimport iovec
from cpython.ref cimport PyObject
from aoprim.atomic_h cimport (
    aop_atomic_i64, aop_atomic_u32, aop_spinlock_t, aop_load_i64, aop_store_i64,
    aop_exchange_u32, aop_store_u32, AOP_RELAXED, AOP_ACQUIRE, AOP_RELEASE,
)

cdef extern from "aop_sendbatch.h" nogil:
    enum: AOP_SB_IOV_MAX
    ssize_t aop_sb_write(int fd, iovec *iov, int cnt, int is_sock)
    ssize_t aop_sb_write_flags(int fd, iovec *iov, int cnt, int is_sock, int flags)
    int aop_sb_would_block(int e)

# What keeps one segment's memory alive (parallel to SendBatch.iov).
ctypedef struct aop_sb_owner:
    int kind                 # SB_COPY, SB_RAW, SB_BYTES, SB_VIEW or SB_SLOT (below)
    PyObject *obj            # SB_BYTES: the bytes (strong ref); SB_SLOT: the slot (strong ref)
    Py_buffer view           # SB_VIEW / SB_SLOT: the held export (PyBUF_SIMPLE, no self-pointers)

cdef enum:
    SB_COPY = 0              # bytes live in the coalescing buffer `cbuf`
    SB_RAW = 1               # c_add_ptr: caller-owned memory, nothing to release
    SB_BYTES = 2             # a bytes object, referenced
    SB_VIEW = 3              # a bytearray/memoryview export, held until sent
    SB_SLOT = 4              # a slot-like object: export + retain(), release() when sent

cdef class _GroupBase          # defined below: a batch points to its group (a FlushGroup)


cdef class SendBatch:
    cdef object sock                 # the target socket (kept alive), or None for an int fd
    cdef object sock_fileno          # socket.socket.fileno (C), called as sock_fileno(sock)
    cdef bint has_sock               # target is a socket object (sock is not None)
    cdef int fd                      # int-fd target (sockets re-read fileno() at each flush)
    cdef bint is_sock                # send/sendmsg; False after ENOTSOCK -> write/writev
    cdef readonly Py_ssize_t max_msgs         # auto-flush threshold in messages (>= 1)
    cdef readonly Py_ssize_t max_bytes        # auto-flush threshold in bytes (>= 1)
    cdef readonly bint auto_flush             # add() flushes when a threshold is reached
    cdef readonly size_t copy_max             # messages of at most this many bytes are copied
    cdef size_t write_limit          # test hook: cap on bytes offered per syscall (0 = none)
    cdef unsigned long owner_tid     # != 0: add_copy/add_frame from another thread add nothing

    # unsent segments are iov[head:nseg]; own[k] keeps iov[k]'s memory alive
    cdef iovec *iov                  # iovec array handed to the kernel (cursor = head)
    cdef aop_sb_owner *own           # owners, parallel to iov
    cdef Py_ssize_t head             # first unsent segment (its front may be trimmed)
    cdef Py_ssize_t nseg             # one past the last segment
    cdef Py_ssize_t segcap           # allocated length of iov and own

    # coalescing buffer: live copied bytes are cbuf[first live SB_COPY segment : cused]
    cdef char *cbuf                  # preallocated, reused; grows by doubling, compacts
    cdef size_t cused                # bytes of cbuf in use (sent prefix included)
    cdef size_t ccap                 # allocated size of cbuf

    # message boundaries: ends[mhead:mtail] = the length of each pending message, 4 bytes
    # each; a message longer than MSG_LEN (2**31 - 1) takes several entries, all but its
    # last flagged MSG_CONT (_sendbatch.pyx: I3)
    cdef uint32_t *ends              # message lengths (| MSG_CONT: continued in the next)
    cdef Py_ssize_t mhead            # first pending entry
    cdef Py_ssize_t mtail            # one past the last pending entry
    cdef Py_ssize_t mcap             # allocated length of ends
    cdef uint64_t mfront             # stream offset just past entry mhead (when mhead < mtail)
    cdef uint64_t added              # stream offset: bytes ever added (cleared ones included)
    cdef uint64_t sent               # stream offset: bytes written or dropped by clear()

    # read by any thread (relaxed loads), written by the owner (relaxed stores)
    cdef aop_atomic_i64 pend_bytes   # added - sent
    cdef aop_atomic_i64 pend_msgs    # entries in [mhead, mtail) without MSG_CONT
    cdef aop_atomic_i64 st_syscalls  # write syscalls issued (failed ones included)
    cdef aop_atomic_i64 st_messages  # messages fully written
    cdef aop_atomic_i64 st_bytes     # bytes written
    cdef aop_atomic_i64 st_partial   # syscalls that wrote less than offered
    cdef aop_atomic_i64 st_wouldblock  # syscalls that got EAGAIN/EWOULDBLOCK
    cdef aop_atomic_u32 busy         # 1 while a thread is inside (add/flush/clear/C API)

    # FlushGroup membership: every field below is read and written only by the thread that
    # holds `busy` (group ones included: attach/detach/requeue/flush claim the batch first)
    cdef readonly _GroupBase group   # the FlushGroup this batch is attached to, or None
    cdef object owner                # what the group reports with this batch (strong ref)
    cdef readonly bint queued        # the group holds exactly one queue entry for it
    cdef bint watched                # `watch`: reported after every group flush
    cdef bint nonblocking            # the target was a non-blocking socket at attach (a
                                     # hint: a group re-checks the socket at write time)
    cdef int wflags                  # extra send() flags for _write_once (a group's
                                     # GIL-held write sets MSG_DONTWAIT), else 0
    cdef uint64_t flush_mark         # serial of the last group flush that claimed it
    cdef object __weakref__          # a session may hold its batch weakly

    # C-level API (see the module docstring for return codes and lifetime rules)
    cdef int c_add_ptr(self, const void *p, size_t n) noexcept nogil
    cdef int c_add_copy(self, const void *p, size_t n) noexcept nogil
    cdef Py_ssize_t c_flush(self) noexcept nogil
    # take_view() / consume() without Python objects (the server's TLS flush, aoprim.server._tls):
    # c_peek: the first unsent segment (valid until the next call on the batch), 0 when
    # nothing is pending, else 1; c_consume(k): the first k bytes were written elsewhere
    cdef int c_peek(self, char **p, Py_ssize_t *n) except -1
    cdef int c_consume(self, Py_ssize_t k) except -1

    # internals (busy held by the caller)
    cdef int _room_segs(self) noexcept nogil
    cdef int _room_msgs(self) noexcept nogil
    cdef int _room_copy(self, size_t n) noexcept nogil
    cdef int _add_raw(self, const char *p, size_t n, int kind, PyObject *obj,
                      Py_buffer *view) noexcept nogil
    cdef int _add_copy2(self, const char *a, size_t na, const char *b,
                        size_t nb) noexcept nogil
    cdef bint _over(self) noexcept nogil
    cdef ssize_t _write_once(self, int fd, size_t *offered) noexcept nogil
    cdef Py_ssize_t _advance(self, size_t n) noexcept nogil
    cdef bint _range_owned(self, Py_ssize_t a, Py_ssize_t b) noexcept nogil
    cdef void _release_range(self, Py_ssize_t a, Py_ssize_t b) noexcept
    cdef void _commit_head(self, Py_ssize_t h) noexcept nogil
    cdef int _sock_fd(self) except -2
    cdef int _target_fd(self) except -2
    cdef Py_ssize_t _flush_locked(self) except -1
    cdef Py_ssize_t _flush_fd(self) except -1
    cdef int _add_obj(self, object data) except -1
    cdef int _add_buffer(self, object data, bint copy_all=*) except -1
    cdef int _add_slot(self, object s) except -1
    cdef Py_ssize_t _slot_prep(self, object s, Py_buffer *view) except -1
    cdef void _unadd_copy(self, size_t n) noexcept nogil
    cdef int _maybe_queue(self) except -1
    cdef void _queue_quietly(self) noexcept
    cdef int _auto_flush(self) except -1


# What a SendBatch needs from its group: aoprim._flushgroup.FlushGroup subclasses this.
cdef class _GroupBase:
    # Queue b (GIL held, b's busy held by the caller, b not queued).  0, or -1 (no memory).
    cdef int _queue(self, SendBatch b) noexcept


# ---- helpers shared with aoprim._flushgroup ---------------------------------------------

cdef inline int64_t _get(aop_atomic_i64 *a) noexcept nogil:
    # relaxed: a counter read for reporting; no other memory depends on it
    return aop_load_i64(a, AOP_RELAXED)


cdef inline void _add(aop_atomic_i64 *a, int64_t d) noexcept nogil:
    # relaxed load + store, not an RMW: only the thread holding `busy` (for a group: the
    # thread inside flush()) writes the counters, other threads only read them (relaxed),
    # so no update can be lost.
    aop_store_i64(a, aop_load_i64(a, AOP_RELAXED) + d, AOP_RELAXED)


cdef inline bint _claim(SendBatch b) noexcept nogil:
    # acquire: pairs with the release store in _unclaim() by the previous owner, so every
    # field it wrote (arrays, cursors, buffers) is visible to us.
    return aop_exchange_u32(&b.busy, 1, AOP_ACQUIRE) == 0


cdef inline void _unclaim(SendBatch b) noexcept nogil:
    # release: publishes all our writes to the next thread that claims the batch.
    aop_store_u32(&b.busy, 0, AOP_RELEASE)


cdef int _raise_busy() except -1
cdef int _sock_pin(object sock) except -1
cdef void _sock_unpin(object sock) noexcept
cdef bint _sock_closing(object sock) noexcept
cdef void _release_owner(aop_sb_owner *o) noexcept
cdef Py_ssize_t _positive(object v, str name) except -1
# add_copy() of a run of small bytes items of a list under one claim (aoprim.aio._aiowrite's
# writelines): the index of the first item not taken (see _sendbatch.pyx)
cdef Py_ssize_t sb_add_bytes_run(SendBatch b, list items, Py_ssize_t i) except -1
