# cython: language_level=3
"""A socket's fd and blocking state read from its C struct: aoprim/include/aop_sockfd.h
(see there).  A module that uses it calls ``sockfd_setup()`` once at import; until then,
and whenever the layout check failed, ``aop_sockfd_fast`` is false and the caller reads
``fileno()`` / ``gettimeout()`` as before."""
from libc.stdint cimport int64_t


cdef extern from "aop_sockfd.h":
    int aop_sockfd_ok
    int aop_sockfd_init(object socket_type) except -1
    int aop_sockfd_probe_fd(object sock) noexcept
    int64_t aop_sockfd_probe_timeout(object sock) noexcept
    bint aop_sockfd_fast(object o) noexcept
    int aop_sockfd_fd(object sock) noexcept
    bint aop_sockfd_nonblocking(object sock) noexcept


cdef inline int sockfd_setup() except -1:
    """Check the layout against a live socket (fd, three timeouts, closed) and turn the
    direct reads on only when every probe matches what the methods say."""
    global aop_sockfd_ok
    import _socket
    if aop_sockfd_init(_socket.socket) == 0:
        return 0                        # instances too small for the struct: methods
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        ok = aop_sockfd_probe_fd(s) == s.fileno() and s.fileno() >= 0
        s.settimeout(0.0)
        ok = ok and aop_sockfd_probe_timeout(s) == 0
        s.settimeout(None)
        ok = ok and aop_sockfd_probe_timeout(s) < 0         # -1 s (in ns): blocking
        s.settimeout(1.5)
        ok = ok and aop_sockfd_probe_timeout(s) == 1500000000
    finally:
        s.close()
    ok = ok and aop_sockfd_probe_fd(s) == -1 == s.fileno()
    aop_sockfd_ok = 1 if ok else 0
    return 0
