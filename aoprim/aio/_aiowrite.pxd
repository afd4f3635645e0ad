from aoprim._sendbatch cimport SendBatch
from aoprim.atomic_h cimport aop_atomic_u32


cdef class SleepFlag:
    cdef aop_atomic_u32 flag        # 1: the loop is (about to be) inside select()


cdef class TransportWriter:
    cdef readonly object transport  # the SocketTransport it writes for
    cdef SendBatch batch            # the transport's batch
    cdef object add                 # its add_copy (bound): every other message
    cdef SleepFlag sleep            # the loop's: set while it sleeps in select()
    cdef public bint fast           # write() may take the short path (the transport sets it)
    cdef public Py_ssize_t high     # the transport's high-water mark
    cdef public bint blocked        # the transport's _blocked: writer registered, batch detached

    cdef int c_write(self, object data) except -1
    cdef int _flush_over_high(self, SendBatch b) except -1
