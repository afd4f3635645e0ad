# cython: language_level=3
"""TLSConn and TLSFlush (aoprim.server._tls), for ``cimport``: the server's per-message TLS path.
Loop thread only, but for ``TLSConn.ct_left`` and ``TLSFlush``'s counters (atomics read by
any thread)."""
cimport cython
from libc.stdint cimport int64_t
from aoprim.server._receiver cimport Receiver, _RxSource
from aoprim._sendbatch cimport SendBatch
from aoprim.atomic_h cimport aop_atomic_i64


@cython.final
cdef class _Window:
    cdef char *ptr                   # the memory of the current call
    cdef Py_ssize_t len
    cdef bint writable
    cdef Py_ssize_t exports          # live buffer exports (loop thread)


cdef class TLSFlush:
    cdef list dirty                  # sessions to flush at the end of this iteration
    cdef list spare                  # the other list (swapped at each flush), or None
                                     #   while a flush runs
    cdef _Window win                 # the one window (loop thread; never nested)
    cdef readonly bytearray scratch
    cdef char *sptr
    cdef aop_atomic_i64 nsends       # sends of ciphertext (loop thread writes, any reads)
    cdef aop_atomic_i64 nbytes       # their bytes
    cdef int _flush(self, list d) except -1


@cython.final
cdef class TLSConn(_RxSource):
    cdef TLSFlush tls
    cdef object sess                 # the session's TLSWire: policy callbacks
    cdef Receiver rx
    cdef SendBatch batch
    cdef object fileno               # sock.fileno (bound): -1 once the socket is closed
    cdef object inc                  # incoming MemoryBIO
    cdef object _read                # the _ssl object's read / write / pending (bound C
    cdef object _write               #   methods: what SSLObject.read/write/pending call)
    cdef object _pending
    cdef object _inc_write           # inc.write, out.read (bound C methods)
    cdef object _out_read
    cdef object _add_frame           # batch.add_frame, batch.add_copy (bound)
    cdef object _add_copy
    cdef public Py_ssize_t byref_min # send_frame/send_copy leave memoryviews this long to
                                     #   the session (-1: none)
    cdef object out
    cdef object ct                   # ciphertext read from `out`, not all sent (or None)
    cdef Py_ssize_t ct_off           # bytes of ct already sent
    cdef aop_atomic_i64 ct_left      # len(ct) - ct_off (any thread reads: `pending`)
    cdef public int64_t raw_in       # ciphertext bytes received
    cdef readonly int64_t raw_out    # ciphertext bytes sent (loop thread)
    cdef Py_ssize_t rec_left         # bytes of the current record still to come
    cdef int rec_hn                  # bytes of a record header received so far (< 5)
    cdef unsigned char rec_hdr[5]
    cdef Py_ssize_t budget           # plaintext encrypted per flush, at most
    cdef public bint app             # application data may be encrypted
    cdef readonly bint dirty         # in tls.dirty
    cdef readonly bint more          # the next read has something no readiness event
                                     #   announces: the last read filled its room (more
                                     #   may wait), or met the end after its data
    cdef bint idle                   # the BIO and OpenSSL are known to hold no input
    cdef bint drained                # this readiness event's recv found the socket empty
    cdef bint has_end                # c_read returns `end` from now on
    cdef int end                     # 0 (EOF) or -errno
    cdef bint closed
    cdef public object tls_reason    # why the TLS layer failed (for the close reason)

    cdef bint _gone(self) noexcept
    cdef int _mark(self) except -1
    cdef void _records(self, const unsigned char *d, Py_ssize_t n) noexcept
    cdef int _pull(self) except -1
    cdef Py_ssize_t c_flush(self) except? -1
    cdef Py_ssize_t _send_ct(self) except? -1
