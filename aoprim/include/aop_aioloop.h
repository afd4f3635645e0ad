/*
 * aop_aioloop.h -- the C of aoprim.aio's compiled loop (aoprim/aio/_aioloop.pyx, its only
 * includer; design: docs/aio-compiled.md).
 *
 * What is here: reads and writes of asyncio's Handle / TimerHandle slots by their offsets
 * (aio_member_offset, aio_slot, aio_init_slot, aio_set_slot), Context.run without its
 * argument parsing (aio_call_in_context), heapq's sift / push / pop over the timer heap with
 * TimerHandle's `_when` compared directly (aio_lt), the handles' tp_traverse by fixed
 * offsets (aio_trav*), deque append / popleft through their C functions, a dict's and a
 * type's version tag, call_soon's METH_FASTCALL | METH_KEYWORDS argument parsing, and
 * tp_alloc.
 *
 * Invariants:
 *
 *   - One includer.  The static state below (aio_off_when, aio_timer_type, aio_timer_lt,
 *     aio_str_lt, aio_trav[], the deque functions, aio_soon_body, aio_s_context) is
 *     _aioloop's: set once while that module is imported (before any loop runs, on one
 *     thread) and only read after -- except aio_s_context_seen, published once by a CAS
 *     (see aio_call_soon_fast), and tp_traverse, switched by aio_trav_set (a release store).
 *   - Slots by offset only on asyncio's own types.  asyncio.Handle and TimerHandle are
 *     Python classes with __slots__ and no C API, and asyncio ships no .pxd: their slots'
 *     offsets are read from their member descriptors at import (aio_member_offset, -1 when
 *     a name is not a plain member), and the .pyx uses an offset only on an object whose
 *     type is exactly that class (Py_TYPE(o) == the class) and only where every offset it
 *     needs was found; anything else goes through attribute access or the handle's _run().
 *     aoprim's own types are never read this way: between aoprim's modules a .pxd
 *     declares the fields and cdef methods.
 *   - The slot helpers do what a member descriptor's get / set do for a T_OBJECT_EX slot
 *     (NULL: unset; a set takes a new reference and releases the old value), without its
 *     type check, which the caller made.
 *   - The heap functions are Modules/_heapqmodule.c's, step for step (the same list layout,
 *     the same size checks after each comparison, which may run Python code): equal
 *     deadlines come out in heapq's order.
 *   - Each function is called with the GIL held (attached to the interpreter, on a
 *     free-threaded build) and on the loop's thread, which alone touches the loop's heap
 *     and its handles (asyncio's contract); what other threads may reach (the traverse
 *     functions, run by any thread's collection; aio_s_context_seen) is named with its
 *     atomic operation and memory order where it is used.
 */
#ifndef AOP_AIOLOOP_H
#define AOP_AIOLOOP_H

#include <Python.h>

#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a translation unit that does not
 * call it (no -Wunused-function warning). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include "structmember.h"    /* PyMemberDef (3.11; in descrobject.h from 3.12) */
/* the slot a member descriptor reads (Handle's __slots__): its offset in the object */
AOP_FUNC Py_ssize_t aio_member_offset(PyObject *descr) {
    if (Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
    return ((PyMemberDescrObject *)descr)->d_member->offset;
}
/* a slot's value (borrowed, NULL when unset) */
static inline PyObject *aio_slot(PyObject *o, Py_ssize_t off) {
    return *(PyObject **)((char *)o + off);
}
/* contextvars.Context.run(cb, *args) as CPython's context_run does it: enter, one
   vectorcall of the tuple's items, exit (also after an error) */
AOP_FUNC PyObject *aio_call_in_context(PyObject *ctx, PyObject *cb, PyObject *args) {
    PyObject *r;
    if (PyContext_Enter(ctx)) return NULL;
    r = PyObject_Vectorcall(cb, ((PyTupleObject *)args)->ob_item,
                            (size_t)PyTuple_GET_SIZE(args), NULL);
    if (PyContext_Exit(ctx)) { Py_XDECREF(r); return NULL; }
    return r;
}

/* ---- scheduling (call_soon / call_at / call_later): asyncio's handles built in C ---- */
/* the slots of asyncio.Handle / TimerHandle (set once at import, read-only after) */
static Py_ssize_t aio_off_when = -1;
static PyTypeObject *aio_timer_type = NULL;
static PyObject *aio_timer_lt = NULL;       /* TimerHandle.__lt__ as asyncio defines it */
static PyObject *aio_str_lt = NULL;         /* "__lt__", interned */

/* a fresh object's slot (NULL after tp_alloc): takes a new reference */
static inline void aio_init_slot(PyObject *o, Py_ssize_t off, PyObject *v) {
    Py_INCREF(v);
    *(PyObject **)((char *)o + off) = v;
}

/* 1 if TimerHandle's class dict still holds asyncio's __lt__ (a patched one is called) */
AOP_FUNC int aio_timer_lt_ok(void) {
    PyObject *d = aio_timer_type->tp_dict;
    PyObject *lt = d ? PyDict_GetItem(d, aio_str_lt) : NULL;    /* borrowed */
    return lt != NULL && lt == aio_timer_lt;
}

/* 'a < b' as heapq asks it: for two exact TimerHandles (asyncio's __lt__ unpatched:
   fast != 0) their _when compared -- as doubles when both are floats, which is what
   'self._when < other._when' computes; any other pair by PyObject_RichCompareBool */
AOP_FUNC int aio_lt(PyObject *a, PyObject *b, int fast) {
    if (fast && Py_TYPE(a) == aio_timer_type && Py_TYPE(b) == aio_timer_type) {
        PyObject *wa = *(PyObject **)((char *)a + aio_off_when);
        PyObject *wb = *(PyObject **)((char *)b + aio_off_when);
        if (wa != NULL && wb != NULL) {
            if (PyFloat_CheckExact(wa) && PyFloat_CheckExact(wb))
                return PyFloat_AS_DOUBLE(wa) < PyFloat_AS_DOUBLE(wb);
            return PyObject_RichCompareBool(wa, wb, Py_LT);
        }
    }
    return PyObject_RichCompareBool(a, b, Py_LT);
}

/* heapq's _siftdown / _siftup / heappush / heappop (Modules/_heapqmodule.c), step for
   step -- the same list layout, so equal deadlines come out in heapq's order -- with
   aio_lt as the comparison; the size checks as heapq's (a comparison may run Python) */
AOP_FUNC int aio_siftdown(PyObject *heap, Py_ssize_t startpos, Py_ssize_t pos, int fast) {
    PyObject *newitem, *parent, **arr;
    Py_ssize_t parentpos, size = PyList_GET_SIZE(heap);
    int cmp;
    if (pos >= size) { PyErr_SetString(PyExc_IndexError, "index out of range"); return -1; }
    arr = ((PyListObject *)heap)->ob_item;
    newitem = arr[pos];
    while (pos > startpos) {
        parentpos = (pos - 1) >> 1;
        parent = arr[parentpos];
        Py_INCREF(newitem);
        Py_INCREF(parent);
        cmp = aio_lt(newitem, parent, fast);
        Py_DECREF(parent);
        Py_DECREF(newitem);
        if (cmp < 0) return -1;
        if (size != PyList_GET_SIZE(heap)) {
            PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
            return -1;
        }
        if (cmp == 0) break;
        arr = ((PyListObject *)heap)->ob_item;
        parent = arr[parentpos];
        newitem = arr[pos];
        arr[parentpos] = newitem;
        arr[pos] = parent;
        pos = parentpos;
    }
    return 0;
}

AOP_FUNC int aio_siftup(PyObject *heap, Py_ssize_t pos, int fast) {
    Py_ssize_t startpos = pos, endpos = PyList_GET_SIZE(heap), childpos, limit;
    PyObject *tmp1, *tmp2, **arr;
    int cmp;
    if (pos >= endpos) { PyErr_SetString(PyExc_IndexError, "index out of range"); return -1; }
    arr = ((PyListObject *)heap)->ob_item;
    limit = endpos >> 1;
    while (pos < limit) {
        childpos = 2 * pos + 1;
        if (childpos + 1 < endpos) {
            PyObject *a = arr[childpos], *b = arr[childpos + 1];
            Py_INCREF(a);
            Py_INCREF(b);
            cmp = aio_lt(a, b, fast);
            Py_DECREF(a);
            Py_DECREF(b);
            if (cmp < 0) return -1;
            childpos += ((unsigned)cmp ^ 1);
            arr = ((PyListObject *)heap)->ob_item;
            if (endpos != PyList_GET_SIZE(heap)) {
                PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
                return -1;
            }
        }
        tmp1 = arr[childpos];
        tmp2 = arr[pos];
        arr[childpos] = tmp2;
        arr[pos] = tmp1;
        pos = childpos;
    }
    return aio_siftdown(heap, startpos, pos, fast);
}

AOP_FUNC int aio_heappush(PyObject *heap, PyObject *item) {
    if (PyList_Append(heap, item)) return -1;
    return aio_siftdown(heap, 0, PyList_GET_SIZE(heap) - 1, aio_timer_lt_ok());
}

/* a slot's value replaced (the old one released) */
static inline void aio_set_slot(PyObject *o, Py_ssize_t off, PyObject *v) {
    PyObject **p = (PyObject **)((char *)o + off), *old = *p;
    Py_INCREF(v);
    *p = v;
    Py_XDECREF(old);
}

/* asyncio's Handle and TimerHandle traversed by their slots' fixed offsets.  Both are
   Python classes with __slots__, so CPython gives them subtype_traverse, which finds
   the slots by walking the class chain and each class's member table on every visit
   -- the largest part of the cycle collector's cost per queued handle (callgrind,
   docs/aio-compiled.md).  aio_trav_visit visits exactly what subtype_traverse visits
   for an instance of these classes: every __slots__ object of the class and its bases
   (not __weakref__, which is not a member), and the heap type itself (a subclass's
   subtype_traverse leaves that visit to a base whose traverse is not its own).  It is
   installed only where every check of _traverse_offsets holds (see there); the types'
   tp_clear / tp_dealloc stay CPython's.  It applies process-wide: every loop's asyncio
   handles (the same references, so only faster). */
#define AIO_TRAV_MAX 16
typedef struct { traverseproc orig; int n; Py_ssize_t off[AIO_TRAV_MAX]; } aio_trav_t;
static aio_trav_t aio_trav[2];
#define AIO_TRAV_V(i) { PyObject *v_ = *(PyObject **)(base + off[i]); \
    if (v_ != NULL) { int r_ = visit(v_, arg); if (r_) return r_; } }
static inline int aio_trav_visit(aio_trav_t *t, PyObject *self, visitproc visit,
                                 void *arg) {
    const Py_ssize_t *off = t->off;
    char *base = (char *)self;
    int i, n = t->n;
    /* straight-line for the two layouts CPython 3.11-3.13 give Handle (8 slots) and
       TimerHandle (10): no loop counter kept across the visit calls */
    if (n == 8) {
        AIO_TRAV_V(0) AIO_TRAV_V(1) AIO_TRAV_V(2) AIO_TRAV_V(3)
        AIO_TRAV_V(4) AIO_TRAV_V(5) AIO_TRAV_V(6) AIO_TRAV_V(7)
    } else if (n == 10) {
        AIO_TRAV_V(0) AIO_TRAV_V(1) AIO_TRAV_V(2) AIO_TRAV_V(3) AIO_TRAV_V(4)
        AIO_TRAV_V(5) AIO_TRAV_V(6) AIO_TRAV_V(7) AIO_TRAV_V(8) AIO_TRAV_V(9)
    } else {
        for (i = 0; i < n; i++) AIO_TRAV_V(i)
    }
    Py_VISIT((PyObject *)Py_TYPE(self));
    return 0;
}
AOP_FUNC int aio_trav0(PyObject *self, visitproc visit, void *arg) {
    return aio_trav_visit(&aio_trav[0], self, visit, arg);
}
AOP_FUNC int aio_trav1(PyObject *self, visitproc visit, void *arg) {
    return aio_trav_visit(&aio_trav[1], self, visit, arg);
}
AOP_FUNC traverseproc aio_trav_fn(int which) { return which ? aio_trav1 : aio_trav0; }
/* a member descriptor of an object slot (what traverse_slots visits); -1 otherwise */
AOP_FUNC Py_ssize_t aio_object_member_offset(PyObject *descr) {
    if (Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
    if (((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) return -1;
    return ((PyMemberDescrObject *)descr)->d_member->offset;
}
static inline void *aio_tp_traverse(PyObject *t) {
    return (void *)((PyTypeObject *)t)->tp_traverse;
}
static inline Py_ssize_t aio_type_nmembers(PyObject *t) { return Py_SIZE(t); }
/* which: 0 or 1; t's traverse set to aio_trav<which> with these offsets (or back to
   t's original one with on == 0) */
AOP_FUNC void aio_trav_set(PyObject *t, int which, int on) {
    aio_trav_t *tr = &aio_trav[which];
    /* release: the offsets aio_trav_prepare wrote are visible before the function
       that reads them is; a collector reads tp_traverse (in the free-threaded build
       with the world stopped, which orders it anyway); one pointer-sized store, never
       torn */
    __atomic_store_n(&((PyTypeObject *)t)->tp_traverse,
                     on ? aio_trav_fn(which) : tr->orig, __ATOMIC_RELEASE);
}
AOP_FUNC int aio_trav_prepare(PyObject *t, int which, PyObject *offsets) {
    aio_trav_t *tr = &aio_trav[which];
    Py_ssize_t i, n = PyList_GET_SIZE(offsets);
    if (n > AIO_TRAV_MAX) return 0;
    for (i = 0; i < n; i++) {
        tr->off[i] = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, i));
        if (tr->off[i] < 0) { PyErr_Clear(); return 0; }
    }
    tr->n = (int)n;
    if (tr->orig == NULL) tr->orig = ((PyTypeObject *)t)->tp_traverse;
    return 1;
}

/* collections.deque's own append (METH_O) and popleft (METH_NOARGS), called through
   their C functions (the method descriptors' ml_meth) on an exact deque: what
   calling the descriptor does, without the vectorcall and argument checks around it.
   NULL (not set) where the descriptors are not of that kind: then the descriptors are
   called. */
static PyCFunction aio_dq_append_fn = NULL, aio_dq_popleft_fn = NULL;
AOP_FUNC void aio_deque_init(PyObject *append, PyObject *popleft) {
    PyMethodDef *a, *p;
    if (Py_TYPE(append) != &PyMethodDescr_Type || Py_TYPE(popleft) != &PyMethodDescr_Type)
        return;
    a = ((PyMethodDescrObject *)append)->d_method;
    p = ((PyMethodDescrObject *)popleft)->d_method;
    if ((a->ml_flags & ~METH_COEXIST) == METH_O && (p->ml_flags & ~METH_COEXIST) == METH_NOARGS) {
        aio_dq_append_fn = a->ml_meth;
        aio_dq_popleft_fn = p->ml_meth;
    }
}
static inline int aio_deque_append(PyObject *dq, PyObject *item) {
    PyObject *r = aio_dq_append_fn(dq, item);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}
static inline PyObject *aio_deque_popleft(PyObject *dq) {
    return aio_dq_popleft_fn(dq, NULL);
}
static inline int aio_deque_fast(void) { return aio_dq_append_fn != NULL; }

/* a dict's version tag (ma_version_tag, deprecated from 3.12 but kept through 3.13,
   where every change of a dict still stores a new, process-unique value in it) */
static inline unsigned long long aio_dict_tag(PyObject *d) {
#if PY_VERSION_HEX < 0x030E0000
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return (unsigned long long)((PyDictObject *)d)->ma_version_tag;
#pragma GCC diagnostic pop
#else
    return 0;       /* not kept: every check reads the dict */
#endif
}

/* call_soon's argument parsing, as CPython parses asyncio's
   ``def call_soon(self, callback, *args, context=None)`` (its TypeErrors word for
   word), as a METH_FASTCALL | METH_KEYWORDS method of LoopCore: no keyword dict, no
   argument tuple beyond the handle's own.  The body is _call_soon_body (Cython). */
typedef PyObject *(*aio_soon_body_t)(PyObject *, PyObject *, PyObject *, PyObject *);
static aio_soon_body_t aio_soon_body = NULL;
static PyObject *aio_s_context = NULL;      /* "context", interned (call sites' kwnames
                                               are interned: compared by pointer first) */
static PyObject *aio_s_context_seen = NULL; /* another "context" object a caller passed
                                               (_asyncio's Future builds its own, not
                                               interned, once): a reference kept, so
                                               its address is never reused */
AOP_FUNC PyObject *aio_call_soon_fast(PyObject *self, PyObject *const *args,
                                    Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *callback = nargs >= 1 ? args[0] : NULL, *context = Py_None, *rest, *r;
    Py_ssize_t i, nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        /* relaxed load: a stale NULL only falls to the string compare below */
        if (k == aio_s_context || k == __atomic_load_n(&aio_s_context_seen, __ATOMIC_RELAXED)) {
            context = args[nargs + i];
        } else if (PyUnicode_CompareWithASCIIString(k, "context") == 0) {
            PyObject *none = NULL;
            context = args[nargs + i];
            /* the first one kept, once: a reference taken, then published by a CAS
               (relaxed: the pointer is only compared, never dereferenced, by readers);
               a thread that loses the race gives its reference back */
            Py_INCREF(k);
            if (!__atomic_compare_exchange_n(&aio_s_context_seen, &none, k, 0,
                                             __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                Py_DECREF(k);
        } else if (PyUnicode_CompareWithASCIIString(k, "callback") == 0) {
            if (callback != NULL) {
                PyErr_SetString(PyExc_TypeError, "BaseEventLoop.call_soon() got "
                                "multiple values for argument 'callback'");
                return NULL;
            }
            callback = args[nargs + i];
        } else {
            PyErr_Format(PyExc_TypeError, "BaseEventLoop.call_soon() got an "
                         "unexpected keyword argument '%S'", k);
            return NULL;
        }
    }
    if (callback == NULL) {
        PyErr_SetString(PyExc_TypeError, "BaseEventLoop.call_soon() missing 1 required "
                        "positional argument: 'callback'");
        return NULL;
    }
    rest = nargs > 1 ? PyTuple_New(nargs - 1) : PyTuple_New(0);
    if (rest == NULL) return NULL;
    for (i = 1; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(rest, i - 1, args[i]);
    }
    r = aio_soon_body(self, callback, rest, context);
    Py_DECREF(rest);
    return r;
}
static PyMethodDef aio_call_soon_def = {
    "call_soon", (PyCFunction)(void (*)(void))aio_call_soon_fast,
    METH_FASTCALL | METH_KEYWORDS,
    "call_soon($self, callback, *args, context=None)\n--\n\n"
    "``BaseEventLoop.call_soon`` in C: the same checks, an ``asyncio.Handle`` appended "
    "to ``_ready``.  In debug mode, or where the loop's class overrides a helper "
    "call_soon calls (``_check_closed``, ``_call_soon``, ``get_debug``) or asyncio's "
    "handle classes were patched, it is asyncio's own (thread check, callback check, "
    "source traceback)."};
AOP_FUNC PyObject *aio_make_call_soon(PyObject *cls, aio_soon_body_t body) {
    aio_soon_body = body;
    if (aio_s_context == NULL && (aio_s_context = PyUnicode_InternFromString("context")) == NULL)
        return NULL;
    return PyDescr_NewMethod((PyTypeObject *)cls, &aio_call_soon_def);
}

/* object.__new__(t) for a type without __new__ / __init__ of its own to run: what
   object_new does (tp_alloc: the slots NULL, the object tracked by the GC) */
static inline PyObject *aio_alloc(PyTypeObject *t) {
    return t->tp_alloc(t, 0);
}

/* a class's version tag (0: none assigned).  CPython gives every version of a type's
   attributes (its own and its bases') a tag unique in the process -- a change to the
   class or a base clears it and the next lookup assigns a new one -- so a cached
   tag != 0 equal to the class's current tag means "the same class, unchanged".
   Relaxed: CPython's own readers of the tag (the type cache) load it relaxed; a stale
   value only misses the cache. */
static inline unsigned int aio_type_tag(PyObject *t) {
    return __atomic_load_n(&((PyTypeObject *)t)->tp_version_tag, __ATOMIC_RELAXED);
}

AOP_FUNC PyObject *aio_heappop(PyObject *heap) {
    PyObject *lastelt, *returnitem;
    Py_ssize_t n = PyList_GET_SIZE(heap);
    if (n == 0) { PyErr_SetString(PyExc_IndexError, "index out of range"); return NULL; }
    lastelt = PyList_GET_ITEM(heap, n - 1);
    Py_INCREF(lastelt);
    if (PyList_SetSlice(heap, n - 1, n, NULL)) { Py_DECREF(lastelt); return NULL; }
    n--;
    if (!n) return lastelt;
    returnitem = PyList_GET_ITEM(heap, 0);
    PyList_SET_ITEM(heap, 0, lastelt);
    if (aio_siftup(heap, 0, aio_timer_lt_ok())) { Py_DECREF(returnitem); return NULL; }
    return returnitem;
}

#endif /* AOP_AIOLOOP_H */
