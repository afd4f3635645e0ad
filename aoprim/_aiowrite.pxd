cdef class TransportWriter:
    cdef readonly object transport  # the SocketTransport it writes for
    cdef object add                 # the transport's SendBatch.add_copy (bound)
    cdef object selector            # the loop's selector (its ``sleeping`` flag)
    cdef public bint fast           # write() may take the short path (the transport sets it)
    cdef public Py_ssize_t high     # the transport's high-water mark
