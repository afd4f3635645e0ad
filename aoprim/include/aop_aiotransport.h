/*
 * aop_aiotransport.h -- the C of aoprim.aio's compiled transport read side and write method
 * (aoprim/aio/_aiotransport.pyx, its only includer).
 *
 * What is here: the test that a class attribute is a plain __slots__ member (the transport's
 * `_writer`), that member's read through its own descriptor (type-checked, and atomic on a
 * free-threaded build, as an attribute read is), and the transport class's `write` method as
 * a C method descriptor (METH_FASTCALL | METH_KEYWORDS) over TransportWriter's c_write.
 *
 * Invariants: the static pointers below are set once while _aiotransport is imported
 * (make_write_method, on one thread, before any transport exists) and only read after.
 * Each write descriptor is made for one class, so CPython checks every call's `self` is an
 * instance of it before aop_transport_write runs.
 */
#ifndef AOP_AIOTRANSPORT_H
#define AOP_AIOTRANSPORT_H

#include <Python.h>

#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a translation unit that does not
 * call it (no -Wunused-function warning). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include <structmember.h>
/* Whether descr is a member descriptor of an object __slots__ entry (T_OBJECT_EX). */
AOP_FUNC int aop_is_object_member(PyObject *descr)
{
    return Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
           ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
}

/* The transport's `_writer`: its member descriptor's __get__ (a new reference; NULL
   with CPython's AttributeError when the slot is unset).  The descriptor checks that
   `self` is an instance of the class it belongs to, and reads the slot as an attribute
   read does (on a free-threaded build, with its atomic load). */
static PyObject *aop_writer_descr;                  /* set at import, read-only after */
AOP_FUNC PyObject *aop_writer_of(PyObject *self)
{
    return Py_TYPE(aop_writer_descr)->tp_descr_get(aop_writer_descr, self,
                                                    (PyObject *)Py_TYPE(self));
}

/* SocketTransport.write: a method descriptor made for the transport class itself (see
   make_write_method), whose C function is this.  A method descriptor checks its `self`
   argument's type on every call (the interpreter's specialised call checks the exact
   type), so `self` here is an instance of the class the descriptor was made for. */
static int (*aop_tw_impl)(PyObject *self, PyObject *data);    /* set at import */
static PyObject *aop_str_data;                                 /* "data", interned */

AOP_FUNC PyObject *aop_transport_write(PyObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *data;
    if (nargs + nkw != 1) {
        PyErr_Format(PyExc_TypeError,
                     "write() takes exactly one argument (data) (%zd given)", nargs + nkw);
        return NULL;
    }
    if (nkw) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, 0);
        int eq = PyUnicode_Compare(k, aop_str_data) == 0;
        if (!eq) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError,
                             "write() got an unexpected keyword argument '%S'", k);
            return NULL;
        }
    }
    data = args[0];
    if (aop_tw_impl(self, data) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef aop_transport_write_def = {
    "write", (PyCFunction)(void (*)(void))aop_transport_write,
    METH_FASTCALL | METH_KEYWORDS,
    "write(data): write the bytes-like data on the transport, as asyncio's write() "
    "(aoprim.aio._aiowrite's module docstring: batched, sent at the iteration's end)."};

AOP_FUNC PyObject *aop_make_write_descr(PyObject *cls)
{
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "not a type");
        return NULL;
    }
    return PyDescr_NewMethod((PyTypeObject *)cls, &aop_transport_write_def);
}

#endif /* AOP_AIOTRANSPORT_H */
