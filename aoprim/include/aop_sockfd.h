/*
 * aop_sockfd.h -- a socket object's fd and timeout read from its C struct.
 *
 * `sock.fileno()` and `sock.gettimeout() == 0.0`, as FlushGroup and ReadBuffer ask them once
 * per flush / per read, cost a vectorcall, an int or float object and its conversion each
 * (~200-400 instructions): more than the rest of a small write's bookkeeping.  Both methods
 * only read two fields of `_socket.socket`'s instance struct (Modules/socketmodule.h,
 * PySocketSockObject, the same on 3.11, 3.12 and 3.13):
 *
 *     PyObject_HEAD; SOCKET_T sock_fd; int sock_family, sock_type, sock_proto;
 *     PyObject *(*errorhandler)(void); _PyTime_t sock_timeout; ...
 *
 * so these functions read the same fields, as fileno() / gettimeout() themselves do: no
 * Python code runs, the GIL is never released, nothing is allocated.  `sock_fd` is -1 once
 * close() (or detach()) cleared it, which socketmodule.c does before it releases the GIL for
 * close(2) -- exactly what fileno() would have returned.  `sock_timeout` is in nanoseconds:
 * negative blocking (-1 s), 0 non-blocking, > 0 a timeout.
 *
 * The struct is private to CPython, so its layout is CHECKED at import (aop_sockfd_init,
 * called with `_socket.socket` and a live socket whose fileno() / timeout the caller then
 * compares through aop_sockfd_probe): if anything differs, aop_sockfd_ok stays 0 and every
 * caller uses the Python methods as before.  Only objects whose type is `_socket.socket` or
 * a subclass (socket.socket is one) are read this way (aop_sockfd_fast).
 *
 * Threads: on a free-threaded build socketmodule.c reads and writes these fields with
 * relaxed atomics (3.13: _Py_atomic_load_int_relaxed / store) -- so do we (relaxed: a
 * value read once, whose ordering against other memory the callers do not rely on; with
 * the GIL a plain load would do as well).
 */
#ifndef AOP_SOCKFD_H
#define AOP_SOCKFD_H


#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a module that does not call it
 * (no -Wunused-function warning in a cimporting extension). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    int sock_fd;                     /* SOCKET_T on POSIX */
    int sock_family;
    int sock_type;
    int sock_proto;
    PyObject *(*errorhandler)(void);
    int64_t sock_timeout;            /* _PyTime_t / PyTime_t: ns, < 0 blocking */
} aop_sockfd_obj;

/* `_socket.socket`, and whether the layout check passed: written once at module import,
 * read-only afterwards (each extension module that includes this header has its own). */
AOP_FUNC PyTypeObject *aop_sockfd_type = NULL;
AOP_FUNC int aop_sockfd_ok = 0;

/* Remember `_socket.socket` (a strong reference, kept for the process).  1: its instances
 * are large enough to hold the struct above (the caller then probes the fields), 0: they
 * are not (stay on the methods), -1 with an exception. */
AOP_FUNC int aop_sockfd_init(PyObject *socket_type)
{
    if (!PyType_Check(socket_type)) {
        PyErr_SetString(PyExc_TypeError, "_socket.socket is not a type");
        return -1;
    }
    aop_sockfd_ok = 0;
    if (((PyTypeObject *)socket_type)->tp_basicsize < (Py_ssize_t)sizeof(aop_sockfd_obj))
        return 0;                    /* not the struct we know */
    Py_INCREF(socket_type);
    aop_sockfd_type = (PyTypeObject *)socket_type;
    return 1;
}

/* The import-time check's reads: (fd, timeout in ns) of `sock`, any layout. */
AOP_FUNC inline int aop_sockfd_probe_fd(PyObject *sock)
{
    return __atomic_load_n(&((aop_sockfd_obj *)sock)->sock_fd, __ATOMIC_RELAXED);
}
AOP_FUNC inline int64_t aop_sockfd_probe_timeout(PyObject *sock)
{
    return __atomic_load_n(&((aop_sockfd_obj *)sock)->sock_timeout, __ATOMIC_RELAXED);
}

/* The check passed and `o` is a `_socket.socket` (or subclass) instance: its fields may be
 * read directly. */
AOP_FUNC inline int aop_sockfd_fast(PyObject *o)
{
    return aop_sockfd_ok && (Py_TYPE(o) == aop_sockfd_type ||
                             PyType_IsSubtype(Py_TYPE(o), aop_sockfd_type));
}

/* fileno(): the fd, -1 when closed.  Only when aop_sockfd_fast(sock). */
AOP_FUNC inline int aop_sockfd_fd(PyObject *sock)
{
    /* relaxed: see the header comment */
    return __atomic_load_n(&((aop_sockfd_obj *)sock)->sock_fd, __ATOMIC_RELAXED);
}

/* gettimeout() == 0.0: the socket is non-blocking now.  Only when aop_sockfd_fast(sock). */
AOP_FUNC inline int aop_sockfd_nonblocking(PyObject *sock)
{
    /* relaxed: see the header comment */
    return __atomic_load_n(&((aop_sockfd_obj *)sock)->sock_timeout, __ATOMIC_RELAXED) == 0;
}

#endif
