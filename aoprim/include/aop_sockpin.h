/*
 * aop_sockpin.h -- pin a socket.socket across a GIL-free write (used by aoprim/_sendbatch.pyx's _sock_pin/_sock_unpin, which FlushGroup shares).
 *
 * socket.socket.close() (Lib/socket.py) is
 *
 *     self._closed = True
 *     if self._io_refs <= 0:
 *         self._real_close()
 *
 * and `_io_refs` / `_closed` are two __slots__ of socket.socket: member descriptors of type
 * T_OBJECT_EX, i.e. two PyObject* fields at fixed offsets in every instance.  A pin adds one
 * to `_io_refs` (as makefile() does), so a close() from any thread meanwhile only sets
 * `_closed` and leaves the fd open; the unpin takes it off again and, if `_closed` was set
 * meanwhile, calls close() itself (socket._decref_socketios' logic).
 *
 * Why the pin is one critical section on the socket object, not GenericGetAttr + SetAttr:
 * on a free-threaded build each attribute access is its own critical section, so
 * "read _io_refs, store _io_refs + 1" from two threads (two batches on one socket, or a
 * makefile() / SocketIO.close()) could lose an update -- a lost increment lets close() shut
 * the fd under a write, a lost decrement keeps the fd open forever.  Every store to a
 * T_OBJECT_EX slot in CPython holds the object's own mutex (PyMember_SetOne takes
 * Py_BEGIN_CRITICAL_SECTION(obj); the 3.14 STORE_ATTR_SLOT specialisation LOCK_OBJECT()s the
 * same ob_mutex), so doing our load + store of `_io_refs` and our load of `_closed` inside
 * ONE Py_BEGIN_CRITICAL_SECTION(sock) makes them one atomic step against every other store:
 *
 *   - the read-modify-write of `_io_refs` cannot interleave with any other store to it
 *     (Python code's own `sock._io_refs += 1`, as makefile() does, is a load and then a
 *     store: on a free-threaded build our section can fall between the two and be
 *     overwritten, exactly as a second makefile() on another thread can -- CPython's
 *     socket.py; pins among themselves, and against close(), lose nothing);
 *   - close()'s `_closed = True` is a store under the same mutex, so it is ordered wholly
 *     before or wholly after our section.  Before: we read `_closed` True (the mutex's
 *     release/acquire makes its store visible) and the flush writes nothing.  After: our
 *     section happens-before close()'s store, which is sequenced before close()'s read of
 *     `_io_refs`, so that read sees our increment and close() defers.  No fence is needed
 *     beyond the mutex: both racing stores go through it (a Dekker-style store/load pair
 *     ordered by one lock, not by seq_cst atomics).
 *
 * Inside the section the slots are accessed directly (the offsets come from socket.socket's
 * own member descriptors, found once by aop_sockpin_init): calling PyObject_SetAttr there
 * would nest a second critical section on the same object, and a nested section that has to
 * wait suspends the outer one -- the very atomicity we need would be lost.  Nothing in the
 * section can block or run Python code: two pointer loads, one int allocation, one store.
 * Stores are release stores and the replaced value is DECREF'd after the section, exactly as
 * PyMember_SetOne does (lock-free readers of the slot, PyMember_GetOne, rely on that pair).
 * Loads inside the section are relaxed: every writer holds the mutex we hold.
 *
 * With the GIL (3.11, 3.12, a default 3.13 build) Py_BEGIN_CRITICAL_SECTION is a no-op and
 * the GIL is what makes the section atomic: nothing in it releases the GIL or runs Python
 * code.  Only for sockets whose type resolves `_io_refs`, `_closed` to socket.socket's own
 * descriptors with generic attribute access (aop_sockpin_type_ok): otherwise close() would
 * read something else than the slots we write.
 */
#ifndef AOP_SOCKPIN_H
#define AOP_SOCKPIN_H


#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a module that does not call it
 * (no -Wunused-function warning in a cimporting extension). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include <Python.h>
#include <structmember.h>

#if PY_VERSION_HEX < 0x030D0000
/* before 3.13 there is no free-threaded build: the GIL is the critical section */
#define Py_BEGIN_CRITICAL_SECTION(op) {
#define Py_END_CRITICAL_SECTION() }
#endif

/* Offsets of socket.socket's `_io_refs` and `_closed` slots; 0 until aop_sockpin_init.
 * Written once at module import (before any batch exists), read-only afterwards. */
AOP_FUNC Py_ssize_t aop_sp_off_refs = 0;
AOP_FUNC Py_ssize_t aop_sp_off_closed = 0;
AOP_FUNC PyObject *aop_sp_descr_refs = NULL;     /* strong references, kept for the process */
AOP_FUNC PyObject *aop_sp_descr_closed = NULL;

AOP_FUNC Py_ssize_t aop_sp_slot_offset(PyObject *descr)
{
    PyMemberDef *m;
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_SetString(PyExc_TypeError, "socket.socket's _io_refs/_closed are not slots");
        return -1;
    }
    m = ((PyMemberDescrObject *)descr)->d_member;
    if (m->type != T_OBJECT_EX || m->offset <= 0) {
        PyErr_SetString(PyExc_TypeError, "socket.socket's _io_refs/_closed slots changed kind");
        return -1;
    }
    return m->offset;
}

/* Called once with socket.socket.__dict__['_io_refs'] and ['_closed']. */
AOP_FUNC int aop_sockpin_init(PyObject *d_refs, PyObject *d_closed)
{
    Py_ssize_t a = aop_sp_slot_offset(d_refs), b;
    if (a < 0)
        return -1;
    b = aop_sp_slot_offset(d_closed);
    if (b < 0)
        return -1;
    Py_INCREF(d_refs);
    Py_INCREF(d_closed);
    aop_sp_descr_refs = d_refs;
    aop_sp_descr_closed = d_closed;
    aop_sp_off_refs = a;
    aop_sp_off_closed = b;
    return 0;
}

#define AOP_SP_SLOT(o, off) ((PyObject **)((char *)(o) + (off)))

/* One step on `_io_refs` (delta +1: pin; -1: unpin, never below 0) and a read of `_closed`,
 * in ONE critical section.  Returns 1 when `_closed` is True, 0 when not, -1 with an
 * exception (`_io_refs` unset, not an int, or at PY_SSIZE_T_MAX: nothing changed). */
AOP_FUNC int aop_sock_refs_step(PyObject *sock, int delta)
{
    PyObject **refs = AOP_SP_SLOT(sock, aop_sp_off_refs);
    PyObject **closed = AOP_SP_SLOT(sock, aop_sp_off_closed);
    PyObject *old, *nv = NULL;
    Py_ssize_t n = 0;
    int r = -1;
    /* Between the load and the store nothing runs that could release the GIL, block, or run
     * Python code: an exact int's value, one int allocation (ints are not GC-tracked, so no
     * collection can start).  The error branches may allocate an exception (and, on 3.11,
     * start a collection), but they store nothing: a failed step changes nothing. */
    Py_BEGIN_CRITICAL_SECTION(sock);
    old = __atomic_load_n(refs, __ATOMIC_RELAXED);     /* relaxed: writers hold our mutex */
    if (old == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_io_refs");
    } else if (!PyLong_CheckExact(old)) {
        PyErr_SetString(PyExc_TypeError, "socket _io_refs is not an int");
    } else if ((n = PyLong_AsSsize_t(old)) == -1 && PyErr_Occurred()) {
        /* out of range: nothing changed */
    } else if (delta > 0 && n == PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_OverflowError, "_io_refs");
    } else if ((delta > 0 || n > 0) && (nv = PyLong_FromSsize_t(n + delta)) == NULL) {
        /* no memory: nothing changed */
    } else {
        if (nv != NULL)      /* release: pairs with PyMember_GetOne's lock-free slot load */
            __atomic_store_n(refs, nv, __ATOMIC_RELEASE);
        r = __atomic_load_n(closed, __ATOMIC_RELAXED) == Py_True;
    }
    Py_END_CRITICAL_SECTION();
    if (nv != NULL)
        Py_DECREF(old);              /* the slot's reference to the replaced value */
    return r;
}

/* Pin: returns 1 (pinned, open), 0 (pinned, but close() was already called: unpin it all
 * the same), -1 with an exception (nothing taken). */
AOP_FUNC inline int aop_sock_pin(PyObject *sock)
{
    int r = aop_sock_refs_step(sock, 1);
    return r < 0 ? -1 : !r;
}

/* Unpin: returns 1 when close() was called meanwhile (the caller calls sock.close() now,
 * outside the section: it runs Python code), 0 otherwise, -1 with an exception. */
AOP_FUNC inline int aop_sock_unpin(PyObject *sock)
{
    return aop_sock_refs_step(sock, -1);
}

/* `_closed` is True: close() was called (while pinned, the fd is still open).  One pointer
 * load, compared, never dereferenced.  Relaxed: advisory -- while the pin is held the number
 * cannot be reused whatever this reads; it only makes a flush stop sooner after a close(). */
AOP_FUNC inline int aop_sock_closing(PyObject *sock)
{
    return __atomic_load_n(AOP_SP_SLOT(sock, aop_sp_off_closed), __ATOMIC_RELAXED) == Py_True;
}

/* 1 when instances of `t` (a socket.socket subclass) read and write `_io_refs` / `_closed`
 * through the slots above: generic attribute access, and `io_refs` / `closed` -- what the
 * type's MRO resolves the two names to, found by the caller -- are socket.socket's own
 * descriptors.  Checked once per batch, at SendBatch.__init__. */
AOP_FUNC int aop_sockpin_type_ok(PyTypeObject *t, PyObject *io_refs, PyObject *closed)
{
    return aop_sp_descr_refs != NULL && io_refs == aop_sp_descr_refs &&
           closed == aop_sp_descr_closed &&
           t->tp_setattro == PyObject_GenericSetAttr &&
           t->tp_getattro == PyObject_GenericGetAttr;
}

#endif
