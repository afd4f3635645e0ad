from aoprim.aio._readbuf cimport ReadBuffer


cdef class TransportReader:
    cdef readonly object transport  # the SocketTransport it reads for
    cdef public object sock         # its socket (None once the connection is lost)
    cdef ReadBuffer rbuf            # the loop's read buffer (plain protocols read into it)
    cdef readonly object protocol   # the transport's _protocol (set_protocol sets it)
    cdef readonly bint buffered     # the protocol is a BufferedProtocol (set with protocol)
    cdef public Py_ssize_t conn_lost  # the transport's _conn_lost: nonzero, reads nothing

    cdef int read_ready(self) except -1
    cdef int _read_buffered(self) except -1
