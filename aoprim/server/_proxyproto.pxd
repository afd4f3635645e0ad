# cython: language_level=3
"""ProxyParser, for ``cimport``: an incremental, allocation-bounded PROXY protocol parser.

    from aoprim.server._proxyproto cimport ProxyParser, AOP_PP_MORE, AOP_PP_DONE, AOP_PP_ERROR

    cdef ProxyParser pp = ProxyParser(3, 4096)   # accept v1 and v2, headers up to 4096 bytes
    used = pp.c_feed(p, n)       # bytes of p that belong to the header (the rest is stream)
    if pp.state == AOP_PP_DONE: pp.result ...

Memory: the parser keeps at most AOP_PP_KEEP bytes (the longest v1 line, or v2's fixed part
plus the longest address block); v2 TLVs are counted and skipped, never stored.
"""

from aoprim.atomic_h cimport aop_atomic_u32

cdef enum:
    AOP_PP_MORE = 0       # the header is not complete: feed more
    AOP_PP_DONE = 1       # complete: `result` holds it, `total` is its length
    AOP_PP_ERROR = 2      # malformed, unexpected or too long: `error` holds the reason

    AOP_PP_V1_MAX = 107   # the longest v1 line, "PROXY" to CRLF (the spec's figure)
    AOP_PP_V2_FIXED = 16  # v2: signature (12), version/command, family, length (2)
    AOP_PP_KEEP = 232     # bytes kept at most: 16 + 216 (v2 AF_UNIX addresses) >= 107
    AOP_PP_LIMIT_MAX = 65551   # 16 + 65535: the longest v2 header the format can announce


cdef class ProxyParser:
    cdef int accept              # versions accepted: 1 (v1), 2 (v2) or 3 (both)
    cdef int state               # AOP_PP_MORE / DONE / ERROR
    cdef int version             # 0 until the first byte chose one, then 1 or 2
    cdef Py_ssize_t limit        # the largest header accepted, bytes (v2 length checked
                                 #   against it before anything after the fixed part is read)
    cdef Py_ssize_t total        # bytes consumed so far (the header's length once DONE)
    cdef Py_ssize_t have         # bytes kept in buf
    cdef Py_ssize_t keep         # v2: bytes to keep (16 + the address block), 0 until known
    cdef Py_ssize_t want         # v2: the whole header's length (16 + len), 0 until known
    cdef object result           # DONE: (version, command, family, src, dst)
    cdef object error            # ERROR: the reason (str)
    cdef unsigned char buf[AOP_PP_KEEP]   # the kept bytes: v1 line / v2 fixed + addresses
    cdef aop_atomic_u32 busy     # the one-owner claim of the Python methods (_owner.claim);
                                 #   the c_* methods are the caller's (a Receiver's, under
                                 #   its own claim)

    # Consume header bytes from p[0:n]; returns how many belong to the header (all of them
    # while MORE; fewer when the header ends inside p).  Nothing is consumed once DONE or
    # ERROR.  Raises only MemoryError (building the result).
    cdef Py_ssize_t c_feed(self, const unsigned char *p, Py_ssize_t n) except -1
    # The stream ended (EOF): MORE turns into ERROR when bytes were consumed; 1 if it did.
    cdef int c_eof(self) except -1
    cdef object _get(self, int what)     # a Python property, read under the claim
    cdef int _fail(self, str reason) except -1
    cdef int _v1_line(self) except -1
    cdef int _v2_fixed(self) except -1
    cdef int _v2_done(self) except -1
