# cython: language_level=3
"""The one implementation of MPMCQueue's and SPSCQueue's Python surface.

One idea, the queues' Python surface (over 800 lines), written once for both queue types.

Both classes are thin: each method calls the generic function of the same name here with
its own C queue pointer.  The functions are ``cdef inline`` over the fused type ``qptr``, so
Cython emits one specialisation per queue type and every ``aop_mpmc_*`` / ``aop_spsc_*``
call stays a direct (inlinable) C call: sharing the code costs the fast path nothing.

This file also holds the C declarations of both queues (aoprim/include/aop_queue.h); the
public ones are re-exported by aoprim/_mpmc.pxd and aoprim/_spsc.pxd for cimporters.

Reference rules (the invariants of the Python surface):
- each cell's 64-bit word carries a PyObject* with its strong reference: put takes a new
  reference (before publishing), get hands it to the caller, dealloc releases what is left;
- a reference is only ever dropped with nothing held and nothing spun on: a failed push
  drops the reference it took (the caller still holds its own, so no __del__ can run), and
  a waiting put/get releases the GIL and waits in C without touching any object;
- the ring of a queue used from Python changes only while the GIL is held (GIL builds): a
  blocked put/get waits without the GIL for a *probe* to say the operation could proceed,
  then performs it with the GIL.  So the cyclic GC, which runs with the GIL, always sees a
  consistent ring and can traverse the queued objects (q_traverse / q_clear below);
- get_many moves every item it claims into a list slot allocated before the claim, so no
  allocation failure can lose one (see _q_get_many); put_many reads each batch from a
  sequence that cannot change under the reads (see _q_put_many);
- the fast path (put(x) / get() / *_nowait) has no clock read, no lock, no GIL release;
- a queue used from Python is in OBJ mode: C code using the *_u64 API on the same
  instance gets AOP_Q_BADMODE, and Python callers get TypeError on a RAW-mode queue.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.list cimport PyList_New, PyList_GetSlice, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from aoprim.atomic_h cimport (
    aop_atomic_u32, aop_load_u32, aop_now_ns, aop_deadline_ns, AOP_RELAXED, AOP_SEQ_CST,
    aop_fetch_add_u32, aop_fetch_sub_u32, aop_thread_fence, aop_yield,
)
from aoprim._qwait cimport (
    AOP_Q_OK, AOP_Q_RETRY, AOP_Q_BUSY, AOP_Q_CLOSED, AOP_Q_MODE_OBJ,
    q_obj_mode, q_steal, q_word, q_timeout_ns, q_max_items, q_raise, q_wait_interruptible,
    q_capacity,
)
from cpython.number cimport PyNumber_Index

cdef extern from "Python.h":
    void _list_set_item "PyList_SET_ITEM" (object lst, Py_ssize_t i, PyObject *o)
    PyObject *_list_get_item "PyList_GET_ITEM" (object lst, Py_ssize_t i)
    # no `except`: get_many handles the failure itself (see _q_get_many)
    int _list_set_slice "PyList_SetSlice" (object lst, Py_ssize_t lo, Py_ssize_t hi, object v)
    void _set_size "Py_SET_SIZE" (object o, Py_ssize_t n)
    void _decref "Py_DECREF" (PyObject *o)
    void _err_clear "PyErr_Clear" ()

cdef extern from "aop_queue.h" nogil:
    ctypedef struct aop_mpmc_t:
        uint64_t cap             # real capacity (a power of two); read-only
        aop_atomic_u32 mode      # AOP_Q_MODE_NONE until the first operation fixes it
        # (the rest -- cells, padded tail/head, wait sets -- is private to aop_queue.h)

    # public C API: raw 64-bit words, RAW mode
    int aop_mpmc_try_push_u64(aop_mpmc_t *q, uint64_t v) noexcept
    int aop_mpmc_try_pop_u64(aop_mpmc_t *q, uint64_t *out) noexcept
    int aop_mpmc_push_u64(aop_mpmc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_mpmc_pop_u64(aop_mpmc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_mpmc_push_many_u64(aop_mpmc_t *q, const uint64_t *v, uint64_t n,
                               uint64_t *pushed) noexcept
    int aop_mpmc_pop_many_u64(aop_mpmc_t *q, uint64_t *out, uint64_t n,
                              uint64_t *popped) noexcept
    uint64_t aop_mpmc_size(aop_mpmc_t *q) noexcept          # approximate item count
    bint aop_mpmc_closed(aop_mpmc_t *q) noexcept
    void aop_mpmc_close(aop_mpmc_t *q) noexcept             # wakes every waiter

    # mode-less internals used by the Python methods (OBJ mode); not for C callers
    aop_mpmc_t *aop_mpmc_new(uint64_t capacity) noexcept
    void aop_mpmc_free(aop_mpmc_t *q) noexcept
    int aop_mpmc_push_(aop_mpmc_t *q, uint64_t v) noexcept
    int aop_mpmc_pop_(aop_mpmc_t *q, uint64_t *out) noexcept
    int aop_mpmc_push_wait_(aop_mpmc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_mpmc_pop_wait_(aop_mpmc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_mpmc_push_many_(aop_mpmc_t *q, const uint64_t *v, uint64_t n,
                            uint64_t *pushed) noexcept
    int aop_mpmc_pop_many_(aop_mpmc_t *q, uint64_t *out, uint64_t n,
                           uint64_t *popped) noexcept
    int aop_mpmc_room_wait_p(void *q, uint64_t *unused, int64_t timeout_ns) noexcept
    int aop_mpmc_item_wait_p(void *q, uint64_t *unused, int64_t timeout_ns) noexcept

    # task accounting (any mode, any thread): see "Task accounting" in aop_queue.h
    int aop_mpmc_task_done(aop_mpmc_t *q) noexcept        # AOP_Q_OK, or RETRY: none unfinished
    bint aop_mpmc_all_done(aop_mpmc_t *q) noexcept        # nothing unfinished
    int aop_mpmc_join_wait_p(void *q, uint64_t *unused, int64_t timeout_ns) noexcept

cdef extern from "aop_queue.h":
    # with the GIL: called by the cyclic GC's traverse (fn visits one object)
    int aop_mpmc_each_(aop_mpmc_t *q, int (*fn)(uint64_t, void *) noexcept, void *arg) noexcept

cdef extern from "aop_queue.h" nogil:
    ctypedef struct aop_spsc_t:
        uint64_t cap             # real capacity (a power of two); read-only
        aop_atomic_u32 mode      # AOP_Q_MODE_NONE until the first operation fixes it
        aop_atomic_u32 pclaim    # misuse detection: see "Misuse detection" in aop_queue.h
        aop_atomic_u32 cclaim
        # (the rest -- ring, padded tail/head with cached copies, wait sets -- is private)

    # public C API: raw 64-bit words, RAW mode
    int aop_spsc_try_push_u64(aop_spsc_t *q, uint64_t v) noexcept
    int aop_spsc_try_pop_u64(aop_spsc_t *q, uint64_t *out) noexcept
    int aop_spsc_push_u64(aop_spsc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_spsc_pop_u64(aop_spsc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_spsc_push_many_u64(aop_spsc_t *q, const uint64_t *v, uint64_t n,
                               uint64_t *pushed) noexcept
    int aop_spsc_pop_many_u64(aop_spsc_t *q, uint64_t *out, uint64_t n,
                              uint64_t *popped) noexcept
    uint64_t aop_spsc_size(aop_spsc_t *q) noexcept          # approximate item count
    bint aop_spsc_closed(aop_spsc_t *q) noexcept
    void aop_spsc_close(aop_spsc_t *q) noexcept             # wakes every waiter

    # mode-less internals used by the Python methods (OBJ mode); not for C callers
    aop_spsc_t *aop_spsc_new(uint64_t capacity) noexcept
    void aop_spsc_free(aop_spsc_t *q) noexcept
    int aop_spsc_push_(aop_spsc_t *q, uint64_t v) noexcept
    int aop_spsc_pop_(aop_spsc_t *q, uint64_t *out) noexcept
    int aop_spsc_push_wait_(aop_spsc_t *q, uint64_t v, int64_t timeout_ns) noexcept
    int aop_spsc_pop_wait_(aop_spsc_t *q, uint64_t *out, int64_t timeout_ns) noexcept
    int aop_spsc_push_many_(aop_spsc_t *q, const uint64_t *v, uint64_t n,
                            uint64_t *pushed) noexcept
    int aop_spsc_pop_many_(aop_spsc_t *q, uint64_t *out, uint64_t n,
                           uint64_t *popped) noexcept
    int aop_spsc_room_wait_p(void *q, uint64_t *unused, int64_t timeout_ns) noexcept
    int aop_spsc_item_wait_p(void *q, uint64_t *unused, int64_t timeout_ns) noexcept
    int aop_spsc_task_done(aop_spsc_t *q) noexcept        # as the MPMC ones
    bint aop_spsc_all_done(aop_spsc_t *q) noexcept
    int aop_spsc_join_wait_p(void *q, uint64_t *unused, int64_t timeout_ns) noexcept
    bint aop_spsc_side_claim(aop_atomic_u32 *c) noexcept
    void aop_spsc_side_release(aop_atomic_u32 *c) noexcept
    bint aop_spsc_side_busy(const aop_atomic_u32 *c) noexcept

cdef extern from "aop_queue.h":
    int aop_spsc_each_(aop_spsc_t *q, int (*fn)(uint64_t, void *) noexcept, void *arg) noexcept

cdef extern from *:
    """
    #ifdef Py_GIL_DISABLED
    #define AOP_Q_FREE_THREADED 1
    #else
    #define AOP_Q_FREE_THREADED 0
    #endif
    """
    bint AOP_Q_FREE_THREADED     # a compile-time constant: the C compiler drops dead branches


# ---- fast entries for the hot methods ---------------------------------------------------
# put(x), get(), put_nowait(x) and get_nowait() are most of a queue's calls.  Cython's own
# wrapper of a def method parses every call shape (keywords, defaults) and takes a reference
# to each argument and default for the call's duration; on a free-threaded build each of
# those reference-count operations costs several instructions more, and one on an argument
# owned by another thread is an atomic operation.  That parsing was half of put()'s
# instructions on 3.13t.  So each of these methods gets a small C entry (q_fast_install,
# at import) that handles the common shapes -- no keywords, and exactly the positional
# arguments the fast function takes -- by calling a cdef function with borrowed arguments,
# and hands every other shape to Cython's wrapper unchanged (its checks and messages stay
# the only ones).  The entry replaces ml_meth in the method's own PyMethodDef, which every
# descriptor and bound method of it reads on each call, before any call can happen (the
# module is still initialising); a method whose flags are not the expected FASTCALL |
# KEYWORDS keeps Cython's wrapper.
cdef extern from *:
    """
    typedef PyObject *(*aop_q_fastcall_t)(PyObject *, PyObject *const *, Py_ssize_t, PyObject *);
    typedef struct {
        aop_q_fastcall_t full;                     /* Cython's wrapper: every call shape */
        PyObject *(*f0)(PyObject *);               /* no arguments, no keywords */
        PyObject *(*f1)(PyObject *, PyObject *);   /* one positional argument, no keywords */
    } aop_q_fast_t;

    #define AOP_Q_FAST_ENTRY(NAME) \
        static __attribute__((unused)) aop_q_fast_t NAME##_fast; \
        static __attribute__((unused)) PyObject *NAME##_entry(PyObject *self, PyObject *const *args, \
                                      Py_ssize_t nargsf, PyObject *kwnames) \
        { \
            Py_ssize_t nargs = PyVectorcall_NARGS(nargsf); \
            if (kwnames == NULL) { \
                if (nargs == 0 && NAME##_fast.f0) return NAME##_fast.f0(self); \
                if (nargs == 1 && NAME##_fast.f1) return NAME##_fast.f1(self, args[0]); \
            } \
            return NAME##_fast.full(self, args, nargsf, kwnames); \
        }
    AOP_Q_FAST_ENTRY(aop_q_put)
    AOP_Q_FAST_ENTRY(aop_q_put_nowait)
    AOP_Q_FAST_ENTRY(aop_q_get)
    AOP_Q_FAST_ENTRY(aop_q_get_nowait)

    /* Point the method `name` of tp at entry, keeping Cython's wrapper in fast->full.
     * 0 when installed, 1 when the method is not a FASTCALL | KEYWORDS method descriptor
     * (left as it is), -1 with an exception set. */
    static __attribute__((unused)) int aop_q_fast_install(PyTypeObject *tp, const char *name,
                                                          aop_q_fast_t *fast, aop_q_fastcall_t entry)
    {
        PyMethodDef *def;
        PyObject *d = PyDict_GetItemString(tp->tp_dict, name);   /* borrowed */
        if (d == NULL) {
            PyErr_Format(PyExc_AttributeError, "%s has no method %s", tp->tp_name, name);
            return -1;
        }
        if (!PyObject_TypeCheck(d, &PyMethodDescr_Type)) return 1;
        def = ((PyMethodDescrObject *)d)->d_method;
        if (def->ml_flags != (METH_FASTCALL | METH_KEYWORDS)) return 1;
        fast->full = (aop_q_fastcall_t)(void (*)(void))def->ml_meth;
        def->ml_meth = (PyCFunction)(void (*)(void))entry;
        return 0;
    }
    """
    ctypedef struct aop_q_fast_t:
        object (*f0)(object)
        object (*f1)(object, object)
    ctypedef void *aop_q_fastcall_t
    aop_q_fast_t aop_q_put_fast, aop_q_put_nowait_fast, aop_q_get_fast, aop_q_get_nowait_fast
    void *aop_q_put_entry
    void *aop_q_put_nowait_entry
    void *aop_q_get_entry
    void *aop_q_get_nowait_entry
    int aop_q_fast_install(type tp, const char *name, aop_q_fast_t *fast,
                           aop_q_fastcall_t entry) except -1


cdef inline int q_fast_install(type tp, object (*put1)(object, object),
                               object (*put_nowait1)(object, object),
                               object (*get0)(object), object (*get_nowait0)(object)) except -1:
    """Give tp's put/put_nowait/get/get_nowait their fast entries (see above); at import."""
    aop_q_put_fast.f1 = put1
    aop_q_put_nowait_fast.f1 = put_nowait1
    aop_q_get_fast.f0 = get0
    aop_q_get_nowait_fast.f0 = get_nowait0
    aop_q_fast_install(tp, b"put", &aop_q_put_fast, <aop_q_fastcall_t>aop_q_put_entry)
    aop_q_fast_install(tp, b"put_nowait", &aop_q_put_nowait_fast,
                       <aop_q_fastcall_t>aop_q_put_nowait_entry)
    aop_q_fast_install(tp, b"get", &aop_q_get_fast, <aop_q_fastcall_t>aop_q_get_entry)
    aop_q_fast_install(tp, b"get_nowait", &aop_q_get_nowait_fast,
                       <aop_q_fastcall_t>aop_q_get_nowait_entry)
    return 0


ctypedef aop_mpmc_t *mpmc_ptr
ctypedef aop_spsc_t *spsc_ptr
ctypedef fused qptr:
    mpmc_ptr
    spsc_ptr

cdef enum:
    CHUNK = 64      # words moved per C call by put_many / get_many


# ---- compile-time dispatch: one direct C call per queue type ------------------------------

cdef inline void q_free(qptr q) noexcept nogil:
    if qptr is mpmc_ptr:
        aop_mpmc_free(q)
    else:
        aop_spsc_free(q)

cdef inline int q_push(qptr q, uint64_t v) noexcept nogil:
    if qptr is mpmc_ptr:
        return aop_mpmc_push_(q, v)
    else:
        return aop_spsc_push_(q, v)

cdef inline int q_pop(qptr q, uint64_t *v) noexcept nogil:
    if qptr is mpmc_ptr:
        return aop_mpmc_pop_(q, v)
    else:
        return aop_spsc_pop_(q, v)

cdef inline int q_push_many(qptr q, const uint64_t *v, uint64_t n, uint64_t *done) noexcept nogil:
    if qptr is mpmc_ptr:
        return aop_mpmc_push_many_(q, v, n, done)
    else:
        return aop_spsc_push_many_(q, v, n, done)

cdef inline int q_pop_many(qptr q, uint64_t *v, uint64_t n, uint64_t *done) noexcept nogil:
    if qptr is mpmc_ptr:
        return aop_mpmc_pop_many_(q, v, n, done)
    else:
        return aop_spsc_pop_many_(q, v, n, done)

cdef inline int q_wait_room(qptr q, int64_t ns) except -1:
    """Wait (without the GIL) until a push could proceed: OK, CLOSED, or RETRY on timeout."""
    if qptr is mpmc_ptr:
        return q_wait_interruptible(aop_mpmc_room_wait_p, q, NULL, ns)
    else:
        return q_wait_interruptible(aop_spsc_room_wait_p, q, NULL, ns)

cdef inline int q_wait_item(qptr q, int64_t ns) except -1:
    """Wait (without the GIL) until a pop could proceed: OK, CLOSED, or RETRY on timeout."""
    if qptr is mpmc_ptr:
        return q_wait_interruptible(aop_mpmc_item_wait_p, q, NULL, ns)
    else:
        return q_wait_interruptible(aop_spsc_item_wait_p, q, NULL, ns)

cdef inline int q_wait_op(qptr q, bint push, uint64_t *v, int64_t ns) except -1:
    """A blocked put (push) or get: wait for the probe, then operate with the GIL held, until
    it succeeds, is closed, or ns (< 0: never) runs out (RETRY).  The operation may lose a
    race after a positive probe (MPMC): then it waits again for what is left of ns."""
    cdef int64_t deadline = 0, left = ns
    cdef int r
    if ns > 0:
        deadline = aop_deadline_ns(ns)             # saturates: INT64_MAX never wraps
    while True:
        r = q_wait_room(q, left) if push else q_wait_item(q, left)
        if r != AOP_Q_OK:
            return r
        r = q_push(q, v[0]) if push else q_pop(q, v)
        if not (r == AOP_Q_RETRY or r == AOP_Q_BUSY):
            return r
        if ns > 0:
            left = deadline - aop_now_ns()
            if left <= 0:
                return AOP_Q_RETRY

cdef inline int q_wait_push(qptr q, uint64_t *v, int64_t ns) except -1:
    if qptr is spsc_ptr:
        if not AOP_Q_FREE_THREADED:
            # GIL build: the wait probes the ring without the GIL, so it claims the side
            if not aop_spsc_side_claim(&q.pclaim):
                spsc_misuse(True)
            try:
                return q_wait_op(q, True, v, ns)
            finally:
                aop_spsc_side_release(&q.pclaim)
    return q_wait_op(q, True, v, ns)     # MPMC; SPSC free-threaded: the caller holds the claim

cdef inline int q_wait_pop(qptr q, uint64_t *v, int64_t ns) except -1:
    if qptr is spsc_ptr:
        if not AOP_Q_FREE_THREADED:
            if not aop_spsc_side_claim(&q.cclaim):
                spsc_misuse(False)
            try:
                return q_wait_op(q, False, v, ns)
            finally:
                aop_spsc_side_release(&q.cclaim)
    return q_wait_op(q, False, v, ns)


# ---- the cyclic GC ------------------------------------------------------------------------

ctypedef int (*visitproc)(PyObject *, void *) noexcept
ctypedef int (*traverseproc)(PyObject *, visitproc, void *) noexcept
ctypedef int (*inquiry)(PyObject *) noexcept

cdef extern from "Python.h":
    # the two slots a queue class wraps (see q_traverse / q_clear and each class's module)
    ctypedef struct QTypeSlots "PyTypeObject":
        traverseproc tp_traverse
        inquiry tp_clear

cdef struct _visit_ctx:
    visitproc visit
    void *arg

cdef inline int _visit_word(uint64_t v, void *ctx) noexcept:
    cdef _visit_ctx *c = <_visit_ctx *>ctx
    return c.visit(<PyObject *><uintptr_t>v, c.arg)

cdef inline int q_traverse(qptr q, visitproc visit, void *arg) noexcept:
    """tp_traverse's part for the queued objects.  GIL build: the GC holds the GIL and every
    operation on an OBJ-mode queue changes the ring under it, so the ring is consistent here.
    Free-threaded build: the GC stops the world, and threads waiting without it only probe.
    A RAW-mode queue carries no objects."""
    cdef _visit_ctx c
    # relaxed: the mode was fixed under the GIL we hold, or never
    if q is NULL or aop_load_u32(&q.mode, AOP_RELAXED) != AOP_Q_MODE_OBJ:
        return 0
    c.visit = visit
    c.arg = arg
    if qptr is mpmc_ptr:
        return aop_mpmc_each_(q, _visit_word, &c)
    else:
        return aop_spsc_each_(q, _visit_word, &c)

cdef inline int q_clear(qptr q) noexcept:
    """tp_clear's part: drop every queued object (the queue is cyclic garbage: nobody else
    can reach it).  The queue stays usable, empty."""
    cdef uint64_t buf[CHUNK]
    cdef uint64_t n, i
    # relaxed: nobody else can reach the queue
    if q is NULL or aop_load_u32(&q.mode, AOP_RELAXED) != AOP_Q_MODE_OBJ:
        return 0
    while True:
        q_pop_many(q, buf, CHUNK, &n)
        if n == 0:
            return 0
        for i in range(n):
            q_steal(buf[i])      # the queue's reference, dropped: no lock is held


# ---- SPSC misuse detection (see "Misuse detection" in aop_queue.h) ------------------------

cdef inline int spsc_misuse(bint producer) except -1:
    side = "put" if producer else "get"
    raise RuntimeError(
        f"SPSCQueue: two threads {side} at the same time; an SPSCQueue has one producer "
        f"thread and one consumer thread (use MPMCQueue for more)")

cdef inline int spsc_enter(aop_atomic_u32 *c, bint producer) except -1:
    """Start an operation of one side.  Free-threaded: claim the side for the operation.
    GIL build: only check that no blocking wait of another thread holds it."""
    if AOP_Q_FREE_THREADED:
        if not aop_spsc_side_claim(c):
            spsc_misuse(producer)
    elif aop_spsc_side_busy(c):
        spsc_misuse(producer)
    return 0

cdef inline void spsc_leave(aop_atomic_u32 *c) noexcept:
    if AOP_Q_FREE_THREADED:
        aop_spsc_side_release(c)

cdef inline uint64_t q_size(qptr q) noexcept nogil:
    if qptr is mpmc_ptr:
        return aop_mpmc_size(q)
    else:
        return aop_spsc_size(q)

cdef inline bint q_closed(qptr q) noexcept nogil:
    if qptr is mpmc_ptr:
        return aop_mpmc_closed(q)
    else:
        return aop_spsc_closed(q)

cdef inline void q_close(qptr q) noexcept nogil:
    if qptr is mpmc_ptr:
        aop_mpmc_close(q)
    else:
        aop_spsc_close(q)


# ---- the Python surface, written once ----------------------------------------------------

cdef inline int q_drain_dealloc(qptr q) noexcept:
    """Release every object still queued, then the queue (dealloc: nobody else can reach
    it)."""
    q_clear(q)
    q_free(q)
    return 0


cdef inline int _q_put(qptr q, object item, object block, object timeout) except -1:
    cdef int64_t ns = -1
    cdef uint64_t v = q_word(item)
    cdef int r
    if not (block is True and timeout is None):
        ns = q_timeout_ns(block, timeout)
    q_obj_mode(&q.mode)
    Py_INCREF(item)                  # the queue's reference, taken before publication
    r = q_push(q, v)
    if r == AOP_Q_OK:
        return 0
    if (r == AOP_Q_RETRY or r == AOP_Q_BUSY) and ns != 0:
        try:
            r = q_wait_push(q, &v, ns)
        except BaseException:
            Py_DECREF(item)          # interrupted: not queued
            raise
        if r == AOP_Q_OK:
            return 0
    Py_DECREF(item)                  # not queued: the caller still holds item
    return q_raise(r, True)


cdef inline int _q_put_nowait(qptr q, object item) except -1:
    cdef int r
    q_obj_mode(&q.mode)
    Py_INCREF(item)                  # the queue's reference, taken before publication
    r = q_push(q, q_word(item))
    if r != AOP_Q_OK:
        Py_DECREF(item)              # not queued: the caller still holds item
        q_raise(r, True)
    return 0


cdef inline object _q_get(qptr q, object block, object timeout):
    cdef int64_t ns = -1
    cdef uint64_t v
    cdef int r
    if not (block is True and timeout is None):
        ns = q_timeout_ns(block, timeout)
    q_obj_mode(&q.mode)
    r = q_pop(q, &v)
    if r == AOP_Q_OK:
        return q_steal(v)
    if (r == AOP_Q_RETRY or r == AOP_Q_BUSY) and ns != 0:
        r = q_wait_pop(q, &v, ns)
        if r == AOP_Q_OK:
            return q_steal(v)
    q_raise(r, False)


cdef inline object _q_get_nowait(qptr q):
    cdef uint64_t v
    cdef int r
    q_obj_mode(&q.mode)
    r = q_pop(q, &v)
    if r == AOP_Q_OK:
        return q_steal(v)
    q_raise(r, False)


cdef inline object _q_put_many(qptr q, object iterable):
    cdef uint64_t buf[CHUNK]
    cdef uint64_t n, i, pushed, v, total = 0
    cdef Py_ssize_t pos = 0, size, base
    cdef int r
    cdef object seq, src, it, x
    q_obj_mode(&q.mode)
    if q_closed(q):
        q_raise(AOP_Q_CLOSED, True)
    if type(iterable) is list or type(iterable) is tuple:
        seq = iterable
        while True:
            if AOP_Q_FREE_THREADED and type(seq) is list:
                # Free-threaded: another thread may shrink the list between our reads
                # (reading past its end would fail with references already taken).  Read
                # the batch from a slice: a snapshot the list makes under its own lock,
                # holding its items while we do.  (GIL build: the GIL makes the reads below
                # atomic with respect to other threads -- no Python code runs between them
                # -- and the C compiler drops this branch.)
                src = PyList_GetSlice(seq, pos, pos + CHUNK)
                base = 0
            else:
                src = seq
                base = pos
            # src cannot change under the reads below (see above), and every index is
            # checked against its size: no read can fail with references already taken
            n = 0
            if type(src) is list:
                size = PyList_GET_SIZE(src)
                while n < CHUNK and base + <Py_ssize_t>n < size:
                    x = <object>PyList_GET_ITEM(src, base + <Py_ssize_t>n)
                    Py_INCREF(x)          # the queue's reference
                    buf[n] = q_word(x)
                    n += 1
            else:
                size = PyTuple_GET_SIZE(src)
                while n < CHUNK and base + <Py_ssize_t>n < size:
                    x = <object>PyTuple_GET_ITEM(src, base + <Py_ssize_t>n)
                    Py_INCREF(x)          # the queue's reference
                    buf[n] = q_word(x)
                    n += 1
            if n == 0:
                break
            r = q_push_many(q, buf, n, &pushed)
            for i in range(pushed, n):
                q_steal(buf[i])           # not queued: give back (src still holds them)
            total += pushed
            pos += <Py_ssize_t>pushed
            if r == AOP_Q_CLOSED and total == 0:
                q_raise(r, True)
            if pushed < n:
                break
        return total
    it = iter(iterable)
    while q_size(q) < q.cap:
        try:
            x = next(it)
        except StopIteration:
            break
        Py_INCREF(x)
        v = q_word(x)
        r = q_push(q, v)
        if r == AOP_Q_RETRY or r == AOP_Q_BUSY:
            # (MPMC) a racing producer took the room we saw: wait for room rather than
            # lose an item already pulled from the iterator
            try:
                r = q_wait_push(q, &v, -1)
            except BaseException:
                Py_DECREF(x)
                raise
        if r != AOP_Q_OK:
            Py_DECREF(x)
            if total == 0:
                q_raise(r, True)
            break
        total += 1
    return total


cdef inline list _q_get_many(qptr q, object max_items):
    """Every item taken off the ring goes straight into a list slot that was allocated
    before it was taken, so no allocation failure can lose one: a MemoryError is raised
    only while nothing has been taken (the first list), and later the list is grown before
    each further claim -- if that fails, get_many returns what it already has ("up to")."""
    cdef uint64_t want = q_max_items(max_items)
    cdef uint64_t buf[CHUNK]
    cdef uint64_t n, i, m, got, hint
    cdef int r
    cdef list out
    cdef PyObject *old
    q_obj_mode(&q.mode)
    if want == 0:
        r = q_pop_many(q, buf, 0, &n)
        if r != AOP_Q_OK:
            q_raise(r, False)
        return []
    m = want if want < CHUNK else CHUNK
    hint = q_size(q)                        # a snapshot: sizes the first claim
    if hint == 0:
        # looks empty: no slots to allocate.  (An item whose put happened-before this call
        # is counted by the snapshot; a racing one may as well have come just after.)
        r = q_pop_many(q, buf, 0, &n)       # takes nothing: reports closed-and-drained
        if r != AOP_Q_OK:
            q_raise(r, False)
        return []
    if hint < m:
        m = hint
    out = PyList_New(<Py_ssize_t>m)         # m empty (NULL) slots; MemoryError: nothing taken
    r = q_pop_many(q, buf, m, &n)
    if r != AOP_Q_OK:
        _set_size(out, 0)
        if r == AOP_Q_RETRY or r == AOP_Q_BUSY:
            return out                      # []
        q_raise(r, False)
    for i in range(n):
        # the queue's reference moves into the list (SET_ITEM steals it)
        _list_set_item(out, <Py_ssize_t>i, <PyObject *><uintptr_t>buf[i])
    if n < m:
        _set_size(out, <Py_ssize_t>n)       # the unused tail slots are NULL: just shorter
    got = n
    while got < want and n == CHUNK:        # a full batch was claimed: there may be more
        m = want - got if want - got < CHUNK else CHUNK
        # room first: CHUNK placeholders (None) at the end, each replaced by an item below
        # ((None,) * 64: a constant tuple that Cython builds once; 64 == CHUNK)
        if _list_set_slice(out, <Py_ssize_t>got, <Py_ssize_t>got, (None,) * 64) < 0:
            _err_clear()                    # MemoryError: keep what we have, take no more
            break
        r = q_pop_many(q, buf, m, &n)
        if r != AOP_Q_OK:
            n = 0                           # empty now (or closed): return what we have
        for i in range(n):
            old = _list_get_item(out, <Py_ssize_t>(got + i))
            _list_set_item(out, <Py_ssize_t>(got + i), <PyObject *><uintptr_t>buf[i])
            _decref(old)                    # a placeholder (None): runs no code
        for i in range(n, <uint64_t>CHUNK):
            _decref(_list_get_item(out, <Py_ssize_t>(got + i)))   # unused placeholders
        got += n
        _set_size(out, <Py_ssize_t>got)     # drops the unused placeholders' slots
    return out


# The entry points: MPMC goes straight to the bodies above; SPSC brackets them with its side's
# misuse check (a relaxed load in GIL builds; a claim in free-threaded ones).

cdef inline int q_put(qptr q, object item, object block, object timeout) except -1:
    if qptr is spsc_ptr:
        spsc_enter(&q.pclaim, True)
        try:
            return _q_put(q, item, block, timeout)
        finally:
            spsc_leave(&q.pclaim)
    else:
        return _q_put(q, item, block, timeout)

cdef inline int q_put_nowait(qptr q, object item) except -1:
    if qptr is spsc_ptr:
        spsc_enter(&q.pclaim, True)
        try:
            return _q_put_nowait(q, item)
        finally:
            spsc_leave(&q.pclaim)
    else:
        return _q_put_nowait(q, item)

cdef inline object q_put_many(qptr q, object iterable):
    if qptr is spsc_ptr:
        spsc_enter(&q.pclaim, True)
        try:
            return _q_put_many(q, iterable)
        finally:
            spsc_leave(&q.pclaim)
    else:
        return _q_put_many(q, iterable)

cdef inline object q_get(qptr q, object block, object timeout):
    if qptr is spsc_ptr:
        spsc_enter(&q.cclaim, False)
        try:
            return _q_get(q, block, timeout)
        finally:
            spsc_leave(&q.cclaim)
    else:
        return _q_get(q, block, timeout)

cdef inline object q_get_nowait(qptr q):
    if qptr is spsc_ptr:
        spsc_enter(&q.cclaim, False)
        try:
            return _q_get_nowait(q)
        finally:
            spsc_leave(&q.cclaim)
    else:
        return _q_get_nowait(q)

cdef inline list q_get_many(qptr q, object max_items):
    if qptr is spsc_ptr:
        spsc_enter(&q.cclaim, False)
        try:
            return _q_get_many(q, max_items)
        finally:
            spsc_leave(&q.cclaim)
    else:
        return _q_get_many(q, max_items)


# ---- construction ------------------------------------------------------------------------

cdef inline uint64_t q_ctor_capacity(str name, tuple args, dict kwargs) except 0:
    """The capacity of Name(capacity) / Name(capacity=...) / Name(maxsize=...) (queue.Queue's
    keyword, an alias).  Every message names the class, never the constructor's internals.
    maxsize <= 0 (unbounded, in queue.Queue) is refused: a ring has a fixed size."""
    cdef bint by_capacity = "capacity" in kwargs, by_maxsize = "maxsize" in kwargs
    if len(args) > 1:
        raise TypeError(f"{name}() takes 1 positional argument ({len(args)} given)")
    for key in kwargs:
        if key != "capacity" and key != "maxsize":
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
    if args and by_capacity:
        raise TypeError(f"{name}() got multiple values for argument 'capacity'")
    if (args or by_capacity) and by_maxsize:
        raise TypeError(f"{name}() takes capacity or maxsize, not both")
    if by_maxsize:
        maxsize = kwargs["maxsize"]
        if (not isinstance(maxsize, float) and hasattr(type(maxsize), "__index__")
                and PyNumber_Index(maxsize) <= 0):
            raise ValueError(f"{name}(maxsize={PyNumber_Index(maxsize)}): queue.Queue's "
                             f"unbounded maxsize <= 0 has no equivalent, as {name} is a "
                             f"bounded ring; give its capacity (an int >= 1)")
        return q_capacity(maxsize)
    if args:
        return q_capacity(args[0])
    if by_capacity:
        return q_capacity(kwargs["capacity"])
    raise TypeError(f"{name}() needs a capacity (e.g. {name}(1024))")


cdef inline object q_running_loop():
    """asyncio.get_running_loop(), with asyncio imported here, on the first wait of a
    get_async/put_async, not when the queue's module is imported: `import aoprim` (and the
    server, and threads-only users) never loads asyncio, and ssl with it."""
    from asyncio import get_running_loop
    return get_running_loop()


# ---- asyncio waiters (get_async / put_async) ----------------------------------------------
# A coroutine that finds the queue empty (full) registers a future in the queue's list of
# async getters (putters), then tries again, then awaits the future.  A successful put (get)
# wakes ONE registered future of the other side per item (slot) it made -- the oldest, through
# its loop's call_soon_threadsafe -- and close() wakes every one; the woken coroutine tries
# again.  Why no wake-up is lost (Dekker, as W1..W4 / N1, N2 in aop_queue.h):
#   register:  A1 append the future;  A2 count += 1 (seq_cst RMW);  A3 seq_cst fence;
#              A4 the operation again (q_pop_settled / q_push_settled)
#   put (get): B1 the ring operation (its seq_cst CAS / store is N1);  B2 count (seq_cst load);
#              if B2 != 0: pop a registered future and wake it
#   If B2 reads 0, B2 precedes A2 in the total order, so B1 precedes A3 and A4 sees B1 (a
#   claim whose cell is not yet published is BUSY, and the settled retry yields until it
#   lands).  Otherwise B2 reads A2's increment, which A1 precedes: the waker finds a future.
# Waking one per item keeps a put's cost independent of the number of waiters; it is safe
# because a wake-up is never swallowed:
#   - a woken coroutine that finds nothing (another consumer was first) registers again;
#   - one that leaves without an item after a waker took its future (it was cancelled, even
#     after its future got its result) wakes the next waiter in its place (its unregister
#     finds the future gone: q_async_unregister returns 0);
#   - a future whose loop is closed cannot be woken: the waker pops the next one instead.
# A coroutine that takes an item on its re-check (A4) while a waker took its future used one
# wake-up for one item, as if woken.  A cancelled or finished coroutine takes its future out
# of the list (if a waker has not), so none is left behind.  The lists are only appended to,
# popped and removed from -- each one atomic list operation, also in free-threaded builds.

cdef inline int q_pop_settled(qptr q, uint64_t *v) noexcept nogil:
    """One pop that never reports BUSY: a producer that claimed the cell and has not yet
    published it finishes in a few instructions (yield to it until it has)."""
    cdef int r = q_pop(q, v)
    while r == AOP_Q_BUSY:
        aop_yield()
        r = q_pop(q, v)
    return r

cdef inline int q_push_settled(qptr q, uint64_t v) noexcept nogil:
    cdef int r = q_push(q, v)
    while r == AOP_Q_BUSY:
        aop_yield()
        r = q_push(q, v)
    return r

cdef inline object _q_get_settled(qptr q):
    cdef uint64_t v
    cdef int r
    q_obj_mode(&q.mode)
    r = q_pop_settled(q, &v)
    if r == AOP_Q_OK:
        return q_steal(v)
    q_raise(r, False)

cdef inline object _q_put_settled(qptr q, object item):
    cdef int r
    q_obj_mode(&q.mode)
    Py_INCREF(item)                  # the queue's reference, taken before publication
    r = q_push_settled(q, q_word(item))
    if r != AOP_Q_OK:
        Py_DECREF(item)              # not queued: the caller still holds item
        q_raise(r, True)
    return None

cdef inline object q_get_settled(qptr q):
    """get_nowait, except that an item a producer is publishing right now is waited for."""
    if qptr is spsc_ptr:
        spsc_enter(&q.cclaim, False)
        try:
            return _q_get_settled(q)
        finally:
            spsc_leave(&q.cclaim)
    else:
        return _q_get_settled(q)

cdef inline object q_put_settled(qptr q, object item):
    """put_nowait, except that a cell a consumer is emptying right now is waited for."""
    if qptr is spsc_ptr:
        spsc_enter(&q.pclaim, True)
        try:
            return _q_put_settled(q, item)
        finally:
            spsc_leave(&q.pclaim)
    else:
        return _q_put_settled(q, item)

cdef inline int q_async_register(list waiters, aop_atomic_u32 *count, object fut) except -1:
    waiters.append(fut)                              # A1
    aop_fetch_add_u32(count, 1, AOP_SEQ_CST)         # A2: seq_cst RMW (see above)
    aop_thread_fence(AOP_SEQ_CST)                    # A3: orders A2 before the re-check A4
    return 0

cdef inline bint q_async_unregister(list waiters, aop_atomic_u32 *count,
                                    object fut) except -1:
    """Take fut out of the list: 1 if it was there, 0 if a waker took it (and counted it)."""
    try:
        waiters.remove(fut)
    except ValueError:
        return 0
    # relaxed: the count only decides whether a waker looks at the list; the list decides
    aop_fetch_sub_u32(count, 1, AOP_RELAXED)
    return 1

cdef inline bint q_async_any(aop_atomic_u32 *count) noexcept nogil:
    """B2: may a coroutine be registered?  Call right after the operation (B1); when True,
    call q_async_wake.  A seq_cst load (see above): on x86 one plain load."""
    return aop_load_u32(count, AOP_SEQ_CST) != 0

cdef inline int q_async_wake(list waiters, aop_atomic_u32 *count, object wake,
                             Py_ssize_t n) except -1:
    """Wake the n oldest registered futures (n < 0: every one), after q_async_any said there
    may be one.  A future whose loop is closed does not count: the next one is woken."""
    if waiters is None:
        return 0                 # cleared by the cyclic GC: nobody can be waiting
    while n != 0:
        try:
            fut = waiters.pop(0)
        except IndexError:
            return 0
        aop_fetch_sub_u32(count, 1, AOP_RELAXED)     # relaxed: as in q_async_unregister
        try:
            fut.get_loop().call_soon_threadsafe(wake, fut)
        except RuntimeError:
            continue             # its loop is closed: nobody there can take the item
        n -= 1
    return 0


# ---- queue.Queue's task accounting (no OBJ-mode claim: it moves no object) --------------

cdef inline object q_task_done(qptr q):
    cdef int r
    if qptr is mpmc_ptr:
        r = aop_mpmc_task_done(q)
    else:
        r = aop_spsc_task_done(q)
    if r != AOP_Q_OK:
        raise ValueError("task_done() called too many times")
    return None

cdef inline object q_join(qptr q):
    """Wait (GIL released, parked after a brief spin) until nothing is unfinished; signal
    handlers run between slices, as in a blocked get."""
    if qptr is mpmc_ptr:
        if not aop_mpmc_all_done(q):
            q_wait_interruptible(aop_mpmc_join_wait_p, q, NULL, -1)
    else:
        if not aop_spsc_all_done(q):
            q_wait_interruptible(aop_spsc_join_wait_p, q, NULL, -1)
    return None


cdef inline str q_repr(qptr q, str name, object ident):
    return (f"<aoprim.{name} capacity={q.cap} size={q_size(q)}"
            f"{' closed' if q_closed(q) else ''} at {ident:#x}>")
