# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""ProxyParser: the PROXY protocol header (HAProxy's proxy-protocol.txt, v1 and v2), parsed
incrementally from a byte stream, sans I/O.

    pp = ProxyParser(accept=3, limit=4096)   # 1: v1 only, 2: v2 only, 3: either
    used = pp.feed(chunk)        # bytes of chunk that belong to the header
    pp.state                     # PP_MORE, PP_DONE (pp.result) or PP_ERROR (pp.error)

The compiled Receiver (aoprim.server._receiver) runs one of these over the first bytes of a
connection when the server's ``proxy_protocol`` is on; its ``c_feed`` is the same code.

Rules (stated once; tests/server/test_proxy_protocol.py checks each)
- The first byte chooses the version: ``P`` is v1, ``\\r`` (0x0D) is v2; anything else, or
  a version not accepted, is an error at once (a client that skips the balancer is refused
  at its first byte).  Every later byte is checked as it arrives, so a header fed one byte
  at a time fails at the same byte as one fed whole.
- v1: ``PROXY TCP4|TCP6 <src> <dst> <sport> <dport>\\r\\n`` or ``PROXY UNKNOWN[...]\\r\\n``,
  at most 107 bytes including the CRLF.  Single spaces; addresses as inet_pton reads them
  (a TCP4 line must carry IPv4 addresses, TCP6 IPv6 ones); ports decimal 0..65535 without
  leading zeros.  A LF without CR, or 107 bytes without CRLF, is an error.
- v2: the 12-byte signature, version 2 (high nibble of byte 12), command LOCAL (0) or
  PROXY (1), then family/transport (byte 13) and a big-endian length (bytes 14-15) of what
  follows.  16 + length must not exceed ``limit`` (checked before a byte past the fixed
  part is read).  PROXY needs a known family -- UNSPEC 0x00, TCP4 0x11, UDP4 0x12, TCP6
  0x21, UDP6 0x22, UNIX 0x31/0x32 -- and a length covering its address block (12, 36 or 216
  bytes); what follows the addresses (TLVs) is skipped, counted against the length, never
  stored.  LOCAL ignores the family and skips the whole block, as the spec says.
- Results: ``(version, command, family, src, dst)``: version 1 or 2; command "PROXY" or
  "LOCAL" (v1 is always "PROXY"); family "TCP4", "TCP6", "UDP4", "UDP6", "UNIX_STREAM"
  (0x31), "UNIX_DGRAM" (0x32) -- the spec's names --, "UNSPEC" (v2 LOCAL and v2 UNSPEC) or
  "UNKNOWN" (v1); src/dst ``(host, port)`` for the IP families (host in inet_ntop's
  canonical text, as socket.getpeername gives it), the socket address (str, UTF-8 with
  surrogateescape) for the UNIX families, None otherwise.  A UNIX address is the path up
  to its first NUL; an abstract-namespace address (first byte NUL) is "\\x00" + its name
  up to its last non-NUL byte (like Linux's abstract names in text form); an all-NUL
  field (unnamed socket) is "".

Memory: one parser keeps at most AOP_PP_KEEP (232) bytes, inline; the only allocations are
the result (or the error string) when the header ends.
"""
from aoprim._owner cimport claim, unclaim, owner_busy
cimport cython
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from libc.string cimport memcpy, memchr

cdef extern from "<sys/socket.h>" nogil:
    int AF_INET
    int AF_INET6

cdef extern from "<arpa/inet.h>" nogil:
    int inet_pton(int af, const char *src, void *dst)
    const char *inet_ntop(int af, const void *src, char *dst, unsigned int size)

PP_MORE = AOP_PP_MORE
PP_DONE = AOP_PP_DONE
PP_ERROR = AOP_PP_ERROR
V1_MAX = AOP_PP_V1_MAX
V2_FIXED = AOP_PP_V2_FIXED
KEEP_MAX = AOP_PP_KEEP
LIMIT_MAX = AOP_PP_LIMIT_MAX
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"

cdef const unsigned char *SIG = b"\r\n\r\n\x00\r\nQUIT\n"
cdef const unsigned char *V1_PREFIX = b"PROXY "


cdef inline int _port(const unsigned char *s, Py_ssize_t n) noexcept:
    """A v1 port: 1..5 decimal digits, no leading zero (but "0"), <= 65535; else -1."""
    cdef int v = 0
    cdef Py_ssize_t i
    if n < 1 or n > 5 or (n > 1 and s[0] == c'0'):
        return -1
    for i in range(n):
        if s[i] < c'0' or s[i] > c'9':
            return -1
        v = v * 10 + (s[i] - c'0')
    return v if v <= 65535 else -1


cdef inline object _ntop(int af, const unsigned char *a):
    cdef char out[48]
    if inet_ntop(af, a, out, sizeof(out)) == NULL:
        raise ValueError("inet_ntop failed")     # never: the size is enough for either
    return (<bytes>out).decode("ascii")


cdef inline unsigned int _be16(const unsigned char *q) noexcept:
    return (<unsigned int>q[0] << 8) | q[1]


cdef inline object _path(const unsigned char *a, Py_ssize_t n):
    """A v2 UNIX address (n = 108 bytes, NUL-padded) as str (UTF-8, surrogateescape): a
    filesystem path ends at its first NUL; an abstract-namespace name (leading NUL) is
    "\\x00" + the name, up to its last non-NUL byte (the padding cannot be told from
    trailing NULs of the name: they are dropped); an all-NUL field (unnamed) is ""."""
    cdef const unsigned char *z
    if n > 0 and a[0] == 0:
        while n > 1 and a[n - 1] == 0:
            n -= 1
        if n == 1:
            return ""
        return "\x00" + (<bytes>a[1:n]).decode("utf-8", "surrogateescape")
    z = <const unsigned char *>memchr(a, 0, n)
    if z != NULL:
        n = z - a
    return (<bytes>a[:n]).decode("utf-8", "surrogateescape")


cdef inline int _enter(ProxyParser pp) except -1:
    if not claim(&pp.busy):
        owner_busy("ProxyParser")
    return 0


@cython.final
@cython.no_gc
cdef class ProxyParser:
    """ProxyParser(accept=3, limit=4096): one connection's PROXY header, fed in any pieces.

    ``accept``: 1 (v1 only), 2 (v2 only) or 3 (either).  ``limit``: the longest header
    accepted, 232..65551 bytes (v1 lines are at most 107 whatever the limit).  Not
    GC-tracked: it holds only the result (a tuple of ints, strings, None and (host, port)
    tuples) or an error string -- nothing that can refer back to it.

    One thread at a time, enforced: feed(), eof() and the properties claim the parser
    (an atomic exchange, acquire; a release store gives it back), so a second thread
    entering meanwhile gets RuntimeError and changes nothing.  A claim, not a critical
    section: sharing one connection's header parser is a bug to report.  ``accept`` and
    ``limit`` are fixed at construction and readable anywhere."""

    def __cinit__(self, accept=3, limit=4096):
        if isinstance(accept, bool) or not isinstance(accept, int):
            raise TypeError("accept must be an int (1, 2 or 3)")
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError("limit must be an int")
        if accept not in (1, 2, 3):
            raise ValueError(f"accept must be 1 (v1), 2 (v2) or 3 (either), not {accept}")
        if not AOP_PP_KEEP <= limit <= AOP_PP_LIMIT_MAX:
            raise ValueError(f"limit must be between {AOP_PP_KEEP} and {AOP_PP_LIMIT_MAX}, "
                             f"not {limit}")
        self.accept = accept
        self.limit = limit
        self.state = AOP_PP_MORE
        self.version = 0
        self.total = self.have = self.keep = self.want = 0
        self.result = None
        self.error = None

    cdef int _fail(self, str reason) except -1:
        self.state = AOP_PP_ERROR
        self.error = reason
        return 0

    cdef Py_ssize_t c_feed(self, const unsigned char *p, Py_ssize_t n) except -1:
        cdef Py_ssize_t i = 0, k, j
        cdef unsigned char c
        if self.state != AOP_PP_MORE or n <= 0:
            return 0
        if self.version == 0:
            c = p[0]
            if c == V1_PREFIX[0] and self.accept & 1:
                self.version = 1
            elif c == SIG[0] and self.accept & 2:
                self.version = 2
            else:
                self._fail(_first_byte_reason(c, self.accept))
                return 0
        if self.version == 1:
            while i < n:
                c = p[i]
                if self.have < 6 and c != V1_PREFIX[self.have]:
                    self._fail(f"not a PROXY v1 header: byte {self.have} is {c:#04x}")
                    return i
                self.buf[self.have] = c
                self.have += 1
                self.total += 1
                i += 1
                if c == c'\n':
                    if self.buf[self.have - 2] != c'\r':
                        self._fail("PROXY v1 header: LF without CR")
                    else:
                        self._v1_line()
                    return i
                if self.have >= AOP_PP_V1_MAX:
                    self._fail(f"PROXY v1 header: no CRLF within {AOP_PP_V1_MAX} bytes")
                    return i
            return i
        # version 2
        while i < n:
            if self.have < AOP_PP_V2_FIXED:
                k = min(AOP_PP_V2_FIXED - self.have, n - i)
                for j in range(k):
                    if self.have + j < 12 and p[i + j] != SIG[self.have + j]:
                        self._fail(f"not a PROXY v2 signature: byte {self.have + j} is "
                                   f"{p[i + j]:#04x}")
                        memcpy(self.buf + self.have, p + i, j)   # the bytes that matched
                        self.have += j
                        self.total += j
                        return i + j
                memcpy(self.buf + self.have, p + i, k)
                self.have += k
                self.total += k
                i += k
                if self.have == AOP_PP_V2_FIXED:
                    self._v2_fixed()
                    if self.state != AOP_PP_MORE:
                        return i
            elif self.have < self.keep:
                k = min(self.keep - self.have, n - i)
                memcpy(self.buf + self.have, p + i, k)
                self.have += k
                self.total += k
                i += k
            else:
                k = min(self.want - self.total, n - i)     # TLVs: counted, not kept
                self.total += k
                i += k
            if self.total == self.want:
                self._v2_done()
                return i
        return i

    cdef int c_eof(self) except -1:
        if self.state == AOP_PP_MORE and self.total > 0:
            self._fail(f"the connection ended inside the PROXY header "
                       f"(after {self.total} bytes)")
            return 1
        return 0

    cdef int _v1_line(self) except -1:
        # buf[0:have] is "PROXY " ... "\r\n"
        cdef const unsigned char *s = self.buf + 6
        cdef Py_ssize_t n = self.have - 8          # the line between "PROXY " and CRLF
        cdef Py_ssize_t tok[4]
        cdef Py_ssize_t tlen[4]
        cdef Py_ssize_t i, t, start
        cdef int af, sp, dp
        cdef unsigned char a[2][16]
        cdef char text[48]
        if n >= 7 and memcmp_(s, b"UNKNOWN", 7) and (n == 7 or s[7] == c' '):
            self.result = (1, "PROXY", "UNKNOWN", None, None)
            self.state = AOP_PP_DONE
            return 0
        if n > 5 and memcmp_(s, b"TCP4 ", 5):
            af = AF_INET
        elif n > 5 and memcmp_(s, b"TCP6 ", 5):
            af = AF_INET6
        else:
            return self._fail("PROXY v1 header: protocol is not TCP4, TCP6 or UNKNOWN")
        # exactly four tokens separated by single spaces after "TCPx "
        t = 0
        start = 5
        for i in range(5, n + 1):
            if i == n or s[i] == c' ':
                if t == 4 or i == start:
                    return self._fail("PROXY v1 header: expected 4 fields separated by "
                                      "single spaces after the protocol")
                tok[t] = start
                tlen[t] = i - start
                t += 1
                start = i + 1
        if t != 4:
            return self._fail("PROXY v1 header: expected 4 fields separated by single "
                              "spaces after the protocol")
        for i in range(2):
            if tlen[i] > 45:
                return self._fail("PROXY v1 header: address too long")
            if memchr(s + tok[i], 0, tlen[i]) != NULL:
                # inet_pton would stop at the NUL and accept "1.2.3.4\0zz" as 1.2.3.4
                return self._fail("PROXY v1 header: NUL byte in an address")
            memcpy(text, s + tok[i], tlen[i])
            text[tlen[i]] = 0
            if inet_pton(af, text, a[i]) != 1:
                return self._fail(f"PROXY v1 header: {'source' if i == 0 else 'destination'}"
                                  f" is not an {'IPv4' if af == AF_INET else 'IPv6'} address")
        sp = _port(s + tok[2], tlen[2])
        dp = _port(s + tok[3], tlen[3])
        if sp < 0 or dp < 0:
            return self._fail("PROXY v1 header: a port is not a decimal 0..65535 without "
                              "leading zeros")
        self.result = (1, "PROXY", "TCP4" if af == AF_INET else "TCP6",
                       (_ntop(af, a[0]), sp), (_ntop(af, a[1]), dp))
        self.state = AOP_PP_DONE
        return 0

    cdef int _v2_fixed(self) except -1:
        cdef unsigned char vc = self.buf[12]
        cdef unsigned char fam = self.buf[13]
        cdef Py_ssize_t ln = _be16(self.buf + 14)
        cdef Py_ssize_t alen
        if vc >> 4 != 2:
            return self._fail(f"PROXY v2 header: unsupported version {vc >> 4}")
        if vc & 0xF > 1:
            return self._fail(f"PROXY v2 header: unknown command {vc & 0xF}")
        if AOP_PP_V2_FIXED + ln > self.limit:
            return self._fail(f"PROXY v2 header of {AOP_PP_V2_FIXED + ln} bytes is above the "
                              f"limit ({self.limit})")
        self.want = AOP_PP_V2_FIXED + ln
        if vc & 0xF == 0:           # LOCAL: the block (family included) is ignored
            self.keep = AOP_PP_V2_FIXED
            return 0
        if fam == 0x00:
            alen = 0
        elif fam == 0x11 or fam == 0x12:
            alen = 12
        elif fam == 0x21 or fam == 0x22:
            alen = 36
        elif fam == 0x31 or fam == 0x32:
            alen = 216
        else:
            return self._fail(f"PROXY v2 header: unknown address family/transport "
                              f"{fam:#04x}")
        if ln < alen:
            return self._fail(f"PROXY v2 header: length {ln} is shorter than the "
                              f"{alen}-byte address block of family {fam:#04x}")
        self.keep = AOP_PP_V2_FIXED + alen
        return 0

    cdef int _v2_done(self) except -1:
        cdef const unsigned char *b = self.buf
        cdef unsigned char fam = b[13]
        cdef str kind
        if b[12] & 0xF == 0:
            self.result = (2, "LOCAL", "UNSPEC", None, None)
        elif fam == 0x00:
            self.result = (2, "PROXY", "UNSPEC", None, None)
        elif fam >> 4 == 1:
            kind = "TCP4" if fam & 0xF == 1 else "UDP4"
            self.result = (2, "PROXY", kind, (_ntop(AF_INET, b + 16), _be16(b + 24)),
                           (_ntop(AF_INET, b + 20), _be16(b + 26)))
        elif fam >> 4 == 2:
            kind = "TCP6" if fam & 0xF == 1 else "UDP6"
            self.result = (2, "PROXY", kind, (_ntop(AF_INET6, b + 16), _be16(b + 48)),
                           (_ntop(AF_INET6, b + 32), _be16(b + 50)))
        else:
            self.result = (2, "PROXY", "UNIX_STREAM" if fam == 0x31 else "UNIX_DGRAM",
                           _path(b + 16, 108), _path(b + 124, 108))
        self.state = AOP_PP_DONE
        return 0

    # ---- Python API (tests, tools) -----------------------------------------------------------

    def feed(self, data):
        """Consume header bytes from ``data`` (bytes-like); returns how many belong to the
        header.  After PP_DONE the rest of ``data`` is the stream's; nothing is consumed once
        the parser is done or failed."""
        cdef Py_buffer view
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)   # before the claim (may run Python)
        try:
            _enter(self)
            try:
                return self.c_feed(<const unsigned char *>view.buf, view.len)
            finally:
                unclaim(&self.busy)
        finally:
            PyBuffer_Release(&view)

    def eof(self):
        """The stream ended: a header begun and not finished becomes an error.  True if it
        did."""
        _enter(self)
        try:
            return bool(self.c_eof())
        finally:
            unclaim(&self.busy)

    cdef object _get(self, int what):
        # a property read under the claim (object fields are read, then INCREF'd: another
        # thread replacing one meanwhile would free it under us)
        _enter(self)
        try:
            if what == 0:
                return self.state
            if what == 1:
                return self.version
            if what == 2:
                return self.total
            if what == 3:
                return self.result
            if what == 4:
                return self.error
            st = ("more", "done", "error")[self.state]
            return f"<ProxyParser {st} version={self.version} total={self.total}>"
        finally:
            unclaim(&self.busy)

    @property
    def state(self):
        """PP_MORE, PP_DONE or PP_ERROR."""
        return self._get(0)

    @property
    def done(self):
        return self._get(0) == AOP_PP_DONE

    @property
    def failed(self):
        return self._get(0) == AOP_PP_ERROR

    @property
    def version(self):
        """0 until the first byte, then 1 or 2."""
        return self._get(1)

    @property
    def total(self):
        """Bytes consumed (the header's length once done)."""
        return self._get(2)

    @property
    def result(self):
        """``(version, command, family, src, dst)`` once done, else None."""
        return self._get(3)

    @property
    def error(self):
        """Why the header was refused, or None."""
        return self._get(4)

    @property
    def accept(self):
        return self.accept

    @property
    def limit(self):
        return self.limit

    def __repr__(self):
        return self._get(5)

    def __reduce__(self):
        raise TypeError("ProxyParser objects cannot be pickled")


cdef inline bint memcmp_(const unsigned char *a, const char *b, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        if a[i] != <unsigned char>b[i]:
            return False
    return True


cdef str _first_byte_reason(unsigned char c, int accept):
    want = {1: "a PROXY v1 header", 2: "a PROXY v2 header", 3: "a PROXY header"}[accept]
    hint = ""
    if c == c'P' and accept == 2:
        hint = " (a v1 header? only v2 is accepted)"
    elif c == 0x0D and accept == 1:
        hint = " (a v2 header? only v1 is accepted)"
    return f"expected {want}, the stream starts with byte {c:#04x}{hint}"
