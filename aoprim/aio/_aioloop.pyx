# cython: language_level=3, freethreading_compatible=True, binding=True
"""The compiled iteration of aoprim.aio's loop (design: docs/aio-compiled.md).

One idea, asyncio's iteration compiled (over 800 lines): the wait, the ready queue and the
timer heap follow asyncio's _run_once step for step, so they stay in one module.

``run_once(loop)`` is ``aoprim.aio.Loop._run_once``: asyncio's ``BaseEventLoop._run_once``
(as CPython 3.11-3.13 have it) with the loop's own selector wait and asyncio's
``_process_events`` done in C, wrapped in the loop's FlushGroup flushes.  What it keeps, so
that asyncio's Python code and callers see asyncio's loop:

- the data: ``loop._ready`` (deque of Handles), ``loop._scheduled`` (heapq list of
  TimerHandles, popped and heapified with ``heapq``'s functions, so the order is
  ``TimerHandle.__lt__``'s), ``loop._timer_cancelled_count``, the selector's
  ``_fd_to_key`` and its ``SelectorKey``s (whose data is asyncio's ``(reader, writer)``);
- the order: cancelled timers dropped (the same clean-up rule and thresholds), the timeout
  computed, the wait, each event's reader then writer queued (a cancelled one removes the
  reader / writer, as ``_process_events``), due timers queued (``time() +
  _clock_resolution``), then exactly the handles queued so far run, in order: asyncio's
  own ``Handle`` / ``TimerHandle`` by ``_run_handle`` (``Handle._run`` in C: its slots
  read, the callback called in its Context -- a stream transport's compiled reader by a
  cdef call -- an exception to the loop's exception handler with ``Handle._run``'s context
  dict), any other handle type by its own ``_run()``;
- the wait: as ``selectors.EpollSelector.select``: ``epoll_wait`` for at most
  ``max(len(_fd_to_key), 1)`` events, the timeout rounded up to the millisecond; EINTR runs
  the signal handlers (one that raises ends the iteration, as out of ``epoll.poll``) and
  the wait is retried with the time left.  A wait with a zero timeout keeps the GIL (no
  hand-off when something is ready); a longer one releases it.  The loop's ``SleepFlag``
  is set around the wait and the FlushGroup is checked just before it, as
  ``aoprim.aio.loop._Selector.select`` does.

When the loop is in debug mode, or its selector is not the loop's own ``_Selector`` (a
caller's selector, a mock), or ``_process_events`` is overridden (by a subclass or on the
instance), or the selector's ``select`` is replaced (on the instance: aiotools'
``VirtualClock.patch_loop()``, looptime; or on its class), or ``asyncio.events.Handle._run``
is (aiodebug's slow-callback log), the iteration is asyncio's Python ``_run_once`` instead
(inside the same flushes): slow-callback warnings, virtual clocks, mocks and overrides
behave as on asyncio.  These are checked at every iteration.

One clock: the iteration and ``call_later`` read ``time.monotonic`` directly only while the
loop's ``time()`` is BaseEventLoop's and ``time.monotonic`` is still the function this module
bound at import and ``asyncio.base_events.time`` (what BaseEventLoop.time() reads it from) is
the time module; where either is patched (``unittest.mock.patch("time.monotonic")``,
freezegun, ``mock.patch("asyncio.base_events.time", fake)``) every deadline goes through
``loop.time()``, as asyncio's own do.  The wait itself retries
after EINTR on the real clock: it is a real sleep.
"""
cimport cython
from libc.errno cimport errno, EINTR
from libc.stdlib cimport realloc, free
from libc.math cimport ceil
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetFromErrno
from cpython.dict cimport PyDict_GetItem, PyDict_GetItemWithError
cdef extern from "Python.h":
    dict PyObject_GenericGetDict(object o, void *context)
from cpython.ref cimport PyObject, Py_INCREF
from cpython.float cimport PyFloat_CheckExact, PyFloat_AS_DOUBLE
from cpython.object cimport Py_TYPE, PyTypeObject
from cpython.contextvars cimport PyContext_CopyCurrent
from libc.stdint cimport uint64_t
from cpython.tuple cimport PyTuple_CheckExact, PyTuple_Check, PyTuple_GET_SIZE
from cpython.contextvars cimport PyContext_CheckExact

from aoprim.aio._aiowrite cimport SleepFlag
from aoprim.aio._aiotransport cimport TransportReader
from aoprim.atomic_h cimport (aop_store_u32, aop_load_u64p, aop_store_u64p, AOP_SEQ_CST,
                              AOP_RELAXED)

import sys as _sys
import time as _time
import heapq as _heapq
import collections as _collections
import selectors as _selectors
from asyncio import base_events as _be
from asyncio import selector_events as _se

# the C of this module (aoprim/include/aop_aioloop.h: what it does and its invariants)
cdef extern from "aop_aioloop.h":
    PyObject *Py_True
    PyObject *PyTuple_GET_ITEM_B "PyTuple_GET_ITEM" (object t, Py_ssize_t i)
    PyObject *Py_False
    int aio_ctx_enter "PyContext_Enter"(object ctx) except -1
    int aio_ctx_exit "PyContext_Exit"(object ctx) except -1
    Py_ssize_t aio_tuple_size "PyTuple_GET_SIZE"(object t)
    Py_ssize_t aio_member_offset(object descr)
    PyObject *aio_slot(object o, Py_ssize_t off)
    object aio_call_in_context(object ctx, object cb, object args)
    Py_ssize_t aio_off_when
    PyTypeObject *aio_timer_type
    PyObject *aio_timer_lt
    PyObject *aio_str_lt
    void aio_init_slot(object o, Py_ssize_t off, object v)
    int aio_heappush(list heap, object item) except -1
    void aio_set_slot(object o, Py_ssize_t off, object v)
    object aio_alloc(PyTypeObject *t)
    ctypedef PyObject *(*aio_soon_body_t)(PyObject *, PyObject *, PyObject *, PyObject *) except NULL
    object aio_make_call_soon(object cls, aio_soon_body_t body)
    unsigned long long aio_dict_tag(object d)
    unsigned long long aio_dict_tag_p "aio_dict_tag"(PyObject *d)
    void aio_deque_init(object append, object popleft)
    int aio_deque_append(object dq, object item) except -1
    object aio_deque_popleft(object dq)
    bint aio_deque_fast()
    Py_ssize_t aio_object_member_offset(object descr)
    void *aio_tp_traverse(object t)
    Py_ssize_t aio_type_nmembers(object t)
    void aio_trav_set(object t, int which, int on)
    int aio_trav_prepare(object t, int which, list offsets)
    unsigned int aio_type_tag(object t) nogil
    object aio_heappop(list heap)

cdef extern from "<sys/epoll.h>" nogil:
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)
    enum:
        EPOLLIN
        EPOLLOUT

cdef object _heapify = _heapq.heapify
cdef object _monotonic = _time.monotonic
cdef int EVENT_READ = _selectors.EVENT_READ
cdef int EVENT_WRITE = _selectors.EVENT_WRITE
cdef Py_ssize_t _MIN_SCHEDULED = _be._MIN_SCHEDULED_TIMER_HANDLES
cdef double _MIN_CANCELLED_FRACTION = _be._MIN_CANCELLED_TIMER_HANDLES_FRACTION
cdef double _MAX_TIMEOUT = _be.MAXIMUM_SELECT_TIMEOUT
# asyncio before 3.13 computes the wait's timeout as min(max(0, t), MAX): nan -> 0
cdef bint _NAN_IS_ZERO = _sys.version_info < (3, 13)
cdef object _base_process_events = _se.BaseSelectorEventLoop._process_events
# what asyncio's _process_events calls for each event (the compiled one appends itself)
cdef object _base_add_callback = _be.BaseEventLoop._add_callback
# BaseEventLoop.time is 'return time.monotonic()': where a loop's class keeps it, the
# iteration calls time.monotonic itself (no Python frame), and not at all for the due
# timers when there are none
cdef object _base_time = _be.BaseEventLoop.time

# the ready-queue call (step 2): asyncio's two handle types and their slots' offsets.
# Read by offset because asyncio's handles are Python classes with __slots__ and no C
# interface (asyncio ships no .pxd to cimport); only on an object whose type is exactly
# Handle / TimerHandle, and only where every offset was found (else attribute access or
# _run()).  aoprim's own types are reached through their .pxd, never by offset.
from asyncio import events as _events
from asyncio import format_helpers as _format_helpers
cdef type _Handle = _events.Handle
cdef type _TimerHandle = _events.TimerHandle
cdef Py_ssize_t _OFF_CALLBACK = aio_member_offset(_Handle.__dict__["_callback"])
cdef Py_ssize_t _OFF_ARGS = aio_member_offset(_Handle.__dict__["_args"])
cdef Py_ssize_t _OFF_CANCELLED = aio_member_offset(_Handle.__dict__["_cancelled"])
cdef Py_ssize_t _OFF_CONTEXT = aio_member_offset(_Handle.__dict__["_context"])
# the compiled call only where all four are plain slots of both types (else: _run())
cdef bint _FAST_HANDLES = (_OFF_CALLBACK > 0 and _OFF_ARGS > 0 and _OFF_CANCELLED > 0 and
                           _OFF_CONTEXT > 0 and _TimerHandle.__dict__.get("_run") is None)
cdef Py_ssize_t _OFF_LOOP = aio_member_offset(_Handle.__dict__["_loop"])
cdef Py_ssize_t _OFF_REPR = aio_member_offset(_Handle.__dict__["_repr"])
cdef Py_ssize_t _OFF_SOURCE_TB = aio_member_offset(_Handle.__dict__["_source_traceback"])
cdef Py_ssize_t _OFF_WHEN = aio_member_offset(_TimerHandle.__dict__["_when"])
cdef Py_ssize_t _OFF_SCHEDULED = aio_member_offset(_TimerHandle.__dict__["_scheduled"])
# the scheduling calls build handles in C only where every slot Handle.__init__ /
# TimerHandle.__init__ set was found (else: asyncio's call_soon / call_at / call_later)
cdef bint _FAST_SCHEDULE = (_FAST_HANDLES and _OFF_LOOP > 0 and _OFF_REPR > 0 and
                            _OFF_SOURCE_TB > 0 and _OFF_WHEN > 0 and _OFF_SCHEDULED > 0)
aio_off_when = _OFF_WHEN if _FAST_SCHEDULE else -1


# ---- asyncio's handle classes traversed by fixed slot offsets (aio_trav_visit above) ----

class _SlotsProbe:             # a Python class with __slots__: CPython's subtype_traverse
    __slots__ = ("a",)


cdef void *_subtype_traverse = aio_tp_traverse(_SlotsProbe)


cdef list _traverse_offsets(object t):
    """The offsets of every object slot subtype_traverse visits on an instance of ``t``, or
    None where it would visit anything more or other: each class up to ``object`` must be a
    plain Python class (metaclass ``type``, one base) with subtype_traverse, no ``__dict__``,
    and exactly as many object-slot member descriptors of its own as its member table."""
    cdef list offs = []
    cdef Py_ssize_t off
    cdef tuple mro = t.__mro__
    if len(mro) < 2 or mro[len(mro) - 1] is not object:
        return None
    for k in mro[:len(mro) - 1]:
        if (type(k) is not type or len(k.__bases__) != 1 or
                aio_tp_traverse(k) != _subtype_traverse or k.__dictoffset__ != 0 or
                k.__flags__ & (1 << 4) or not k.__flags__ & (1 << 9)):  # MANAGED_DICT, HEAPTYPE
            return None
        own = []
        for v in vars(k).values():
            off = aio_object_member_offset(v)
            if off > 0 and v.__objclass__ is k:
                own.append(off)
        if len(own) != aio_type_nmembers(k):
            return None
        own.sort()                  # subtype_traverse's order: the class's members, then
        offs.extend(own)            # its base's
    if not offs:
        return None
    return offs


cdef tuple _TRAV_TYPES = (_Handle, _TimerHandle)
cdef bint _trav_ready = False
cdef bint _trav_on = False


cdef _trav_init():
    global _trav_ready
    cdef list o0 = _traverse_offsets(_Handle), o1 = _traverse_offsets(_TimerHandle)
    if (o0 is not None and o1 is not None and aio_trav_prepare(_Handle, 0, o0) and
            aio_trav_prepare(_TimerHandle, 1, o1)):
        _trav_ready = True


def handle_traverse(on=None):
    """Whether asyncio's ``Handle`` and ``TimerHandle`` are traversed by the compiled
    function (on at import where the checks of _traverse_offsets hold; False where they
    do not).  ``on`` True / False installs / restores CPython's own (tests compare the
    two).  Switching it writes the types' tp_traverse slots: a test's tool, not to be
    called while other threads run (free-threaded build); reading it is safe anywhere."""
    global _trav_on
    if on is not None and _trav_ready:
        for i, t in enumerate(_TRAV_TYPES):
            aio_trav_set(t, i, 1 if on else 0)
        _trav_on = bool(on)
    return _trav_on


_trav_init()
handle_traverse(True)
aio_timer_type = <PyTypeObject *>_TimerHandle
_timer_lt_ref = _TimerHandle.__dict__["__lt__"]       # kept alive by this module
aio_timer_lt = <PyObject *>_timer_lt_ref
_str_lt_ref = _sys.intern("__lt__")
aio_str_lt = <PyObject *>_str_lt_ref
cdef object _format_callback_source = _format_helpers._format_callback_source
# 3.13's Handle._run formats the callback with debug=self._loop.get_debug(); before, without
cdef bint _FORMAT_WITH_DEBUG = "get_debug" in _Handle._run.__code__.co_names



def ready_call_compiled():
    """True when the ready-queue call of asyncio's own handle types is compiled (their
    slots were found); False: every handle runs through its ``_run()``."""
    return _FAST_HANDLES


# set by configure(): asyncio's _run_once and the loop's selector class.  Free-threaded
# build: configure() runs once, while aoprim.aio.loop is imported (the import lock orders
# it before any loop of that module runs), and the three are only read afterwards, so no
# reader can see one replaced under it.
cdef object _base_run_once = None
cdef object _selector_type = None


def configure(base_run_once, selector_type):
    """Called once by aoprim.aio.loop: asyncio's ``_run_once`` (the fallback) and the
    loop's own selector class (the only one the compiled wait reads; only if it is an
    ``EpollSelector``: elsewhere every iteration is asyncio's)."""
    global _base_run_once, _selector_type, _own_select
    _base_run_once = base_run_once
    _selector_type = selector_type if issubclass(selector_type,
                                                 _selectors.EpollSelector) else None
    _own_select = selector_type.select


def wait_state(sel):
    """What the compiled wait keeps on a selector (``_aio_events``, ``_aio_epfd``): set by
    the loop's ``_Selector`` when it is created (after its ``_sleep`` and ``_group``)."""
    cdef _Events evs = _Events()
    evs.epfd = sel._selector.fileno() if isinstance(sel, _selectors.EpollSelector) else -1
    evs.fd_to_key = sel._fd_to_key
    evs.sleep = sel._sleep
    evs.group = sel._group
    evs.flush = sel._group.flush
    evs.sel_dict = PyObject_GenericGetDict(sel, NULL)
    sel._aio_events = evs
    sel._aio_epfd = evs.epfd


def wait_closed(sel):
    """The selector is closing: its epoll fd is forgotten (-1) before it is closed, so the
    iteration raises as selectors.EpollSelector.select on a closed selector does, never
    waits on a closed (or reused) fd number."""
    cdef _Events evs = sel._aio_events
    evs.epfd = -1
    sel._aio_epfd = -1


@cython.no_gc_clear
cdef class _Events:
    """The epoll_event array of one loop's waits, grown to the selector's size, and what
    the iteration reads of the selector and the loop (see the .pxd).  GC: its references
    (the fd map, the group) are in cycles through the loop; it is never cleared (no_gc_clear:
    the selector's and the loop's __dict__ break the cycles), so an iteration that runs
    while a cycle is collected still sees them."""

    cdef int reserve(self, int n) except -1:
        cdef epoll_event *p
        if n > self.cap:
            p = <epoll_event *>realloc(self.ev, n * sizeof(epoll_event))
            if p == NULL:
                raise MemoryError()
            self.ev = p
            self.cap = n
        return 0

    def __dealloc__(self):
        free(self.ev)


cdef int _wait(_Events evs, int epfd, int maxev, double timeout) except -1:
    """epoll_wait into evs: the number of events.  timeout < 0: no limit; seconds
    otherwise (rounded up to the millisecond, as selectors does)."""
    cdef int n, err, ms
    cdef double deadline = 0.0
    if timeout < 0:
        ms = -1
    elif timeout != timeout:                # <int>ceil(nan) is undefined (INT_MIN: no limit)
        raise ValueError("cannot convert float NaN to integer")    # as selectors' ceil
    elif timeout > _MAX_TIMEOUT:            # not reached: the caller caps the timeout
        raise ValueError(f"wait timeout {timeout!r} is over {_MAX_TIMEOUT} s")
    else:
        ms = <int>ceil(timeout * 1e3)
        deadline = _monotonic() + ms * 1e-3
    evs.reserve(maxev)
    while True:
        if ms == 0:
            n = epoll_wait(epfd, evs.ev, maxev, 0)      # nothing to wait for: keep the GIL
        else:
            with nogil:
                n = epoll_wait(epfd, evs.ev, maxev, ms)
        if n >= 0:
            return n
        err = errno
        if err != EINTR:
            PyErr_SetFromErrno(OSError)
            return -1
        PyErr_CheckSignals()                # a handler that raises ends the iteration
        if ms > 0:                          # PEP 475: retry with the time that is left
            ms = <int>ceil((deadline - _monotonic()) * 1e3)
            if ms < 0:
                ms = 0


# collections.deque's own append / popleft (method descriptors): called with the deque as
# the first argument when _ready is exactly a deque -- no bound-method lookup per call
cdef object _deque = _collections.deque
cdef object _deque_append = _collections.deque.append
cdef object _deque_popleft = _collections.deque.popleft
aio_deque_init(_deque_append, _deque_popleft)


cdef inline int _ready_append(object ready, object handle) except -1:
    if type(ready) is _deque:
        if aio_deque_fast():
            aio_deque_append(ready, handle)
        else:
            _deque_append(ready, handle)
    else:
        ready.append(handle)
    return 0


cdef int _queue(object loop, object ready, object handle, object fileobj,
                bint reader) except -1:
    """_process_events for one handle: a cancelled one removes the reader / writer, a live
    one is appended to the ready queue (_add_callback: if not cancelled).  An exact
    asyncio.Handle (what add_reader / add_writer register) has its ``_cancelled`` slot read
    directly; any other value there, or any other type, is asked by attribute."""
    if (_FAST_HANDLES and type(handle) is _Handle and
            aio_slot(handle, _OFF_CANCELLED) == Py_False):
        _ready_append(ready, handle)
        return 0
    if handle._cancelled:
        if reader:
            loop._remove_reader(fileobj)
        else:
            loop._remove_writer(fileobj)
    else:
        _ready_append(ready, handle)
    return 0


cdef inline bint _due(object handle, double end_time) except -1:
    """``not (handle._when >= end_time)``: an exact TimerHandle's float ``_when`` compared
    as a double (what float's >= computes, nan included), anything else by attribute."""
    cdef PyObject *p
    if _FAST_SCHEDULE and type(handle) is _TimerHandle:
        p = aio_slot(handle, _OFF_WHEN)
        if p != NULL and PyFloat_CheckExact(<object>p):
            return not (PyFloat_AS_DOUBLE(<object>p) >= end_time)
    return not (handle._when >= end_time)


cdef int _iteration(LoopCore loop, _Events evs, bint own_time) except -1:
    cdef list scheduled = loop.c_scheduled
    cdef Py_ssize_t sched_count = len(scheduled)
    cdef object ready = loop.c_ready
    cdef object handle, key, data
    cdef dict fd_to_key
    cdef double timeout, end_time
    cdef int n, i, ev, events, epfd
    cdef PyObject *k
    cdef Py_ssize_t ntodo, j
    cdef SleepFlag sleep
    if (sched_count > _MIN_SCHEDULED and
            <double>loop.c_timer_cancelled_count / sched_count > _MIN_CANCELLED_FRACTION):
        new_scheduled = []
        for handle in scheduled:
            if handle._cancelled:
                handle._scheduled = False
            else:
                new_scheduled.append(handle)
        _heapify(new_scheduled)
        loop.c_scheduled = scheduled = new_scheduled
        loop.c_timer_cancelled_count = 0
    else:
        while len(scheduled) and scheduled[0]._cancelled:
            loop.c_timer_cancelled_count -= 1
            handle = aio_heappop(scheduled)
            handle._scheduled = False
    handle = None

    timeout = -1.0
    if len(ready) or loop.c_stopping:
        timeout = 0.0
    elif len(scheduled):
        # as asyncio: inf -> the maximum, negative -> 0; nan (a call_at(nan) timer at the
        # top of the heap) -> 0 before 3.13 (min(max(0, nan), MAX) is 0, and the timer is
        # due at once: 'nan >= end_time' is False), passed on from 3.13 (the wait raises
        # selectors' ValueError)
        timeout = scheduled[0]._when - (_monotonic() if own_time else loop.time())
        if timeout > _MAX_TIMEOUT:
            timeout = _MAX_TIMEOUT
        elif timeout < 0 or (_NAN_IS_ZERO and timeout != timeout):
            timeout = 0.0

    # the wait (aoprim.aio.loop._Selector.select + selectors.EpollSelector.select)
    fd_to_key = evs.fd_to_key
    epfd = evs.epfd
    if epfd < 0:        # the selector was closed (wait_closed): as epoll.poll() on it
        raise ValueError("I/O operation on closed epoll object")
    sleep = evs.sleep
    # seq_cst store, then the group check (a load): the Dekker pair with a write from a
    # signal handler or another thread, which queues its batch and then loads the flag --
    # either the check sees the batch or the write sees the flag and wakes the loop
    aop_store_u32(&sleep.flag, 1, AOP_SEQ_CST)
    try:
        if len(evs.group):
            timeout = 0.0                   # a batch became dirty after the last flush
        n = _wait(evs, epfd, max(len(fd_to_key), 1), timeout)
    finally:
        aop_store_u32(&sleep.flag, 0, AOP_SEQ_CST)     # seq_cst: the same pair, cleared

    # asyncio's _process_events, per event
    for i in range(n):
        ev = evs.ev[i].events
        events = 0
        if ev & ~EPOLLIN:
            events |= EVENT_WRITE
        if ev & ~EPOLLOUT:
            events |= EVENT_READ
        k = PyDict_GetItem(fd_to_key, evs.ev[i].data.fd)
        if k == NULL:
            continue
        key = <object>k
        if PyTuple_Check(key) and PyTuple_GET_SIZE(key) == 4:
            # a SelectorKey (a namedtuple): its fields by the tuple's items -- key[i] on a
            # namedtuple goes through a Python-level __getitem__ (slot_sq_item)
            events &= <int><object>PyTuple_GET_ITEM_B(key, 2)     # SelectorKey.events
            data = <object>PyTuple_GET_ITEM_B(key, 3)             # .data: (reader, writer)
            fileobj = <object>PyTuple_GET_ITEM_B(key, 0)          # .fileobj
        else:
            events &= <int>key[2]
            data = key[3]
            fileobj = key[0]
        reader, writer = data
        if events & EVENT_READ and reader is not None:
            _queue(loop, ready, reader, fileobj, True)
        if events & EVENT_WRITE and writer is not None:
            _queue(loop, ready, writer, fileobj, False)
    key = data = reader = writer = fileobj = None

    # 'later' callbacks that are due
    if own_time and not len(scheduled):
        end_time = 0.0              # nothing can be due: asyncio's time() would be unused
    else:
        end_time = (_monotonic() if own_time else loop.time()) + loop.c_clock_resolution
    while len(scheduled):
        if not _due(scheduled[0], end_time):
            break
        handle = aio_heappop(scheduled)
        if _FAST_SCHEDULE and type(handle) is _TimerHandle:
            aio_set_slot(handle, _OFF_SCHEDULED, False)
        else:
            handle._scheduled = False
        _ready_append(ready, handle)

    # the handles queued so far, in order (not those they queue)
    ntodo = len(ready)
    if type(ready) is _deque:
        for j in range(ntodo):
            handle = aio_deque_popleft(ready) if aio_deque_fast() else _deque_popleft(ready)
            _run_handle(handle)
    else:
        popleft = ready.popleft
        for j in range(ntodo):
            handle = popleft()
            _run_handle(handle)
    return 0


cdef int _report(object handle, object exc) except -1:
    """The except branch of ``Handle._run``: the same context dict to the handle's loop's
    ``call_exception_handler`` (the callback formatted after the call, as there)."""
    loop = handle._loop
    if _FORMAT_WITH_DEBUG:
        cb = _format_callback_source(handle._callback, handle._args,
                                     debug=loop.get_debug())
    else:
        cb = _format_callback_source(handle._callback, handle._args)
    context = {
        'message': f'Exception in callback {cb}',
        'exception': exc,
        'handle': handle,
    }
    if handle._source_traceback:
        context['source_traceback'] = handle._source_traceback
    loop.call_exception_handler(context)
    return 0


cdef int _read_in_context(object ctx, TransportReader reader) except -1:
    """``ctx.run(reader)`` for a stream transport's compiled reader (step 3): the same
    Context enter / exit as ``aio_call_in_context``, and a cdef call of its read instead of
    the vectorcall (no argument tuple parsed, no ``__call__`` wrapper)."""
    aio_ctx_enter(ctx)
    try:
        reader.read_ready()
    finally:
        aio_ctx_exit(ctx)
    return 0


cdef int _call(object handle, object cb, object args, object ctx) except -1:
    """``Handle._run`` after its slots are read: ``ctx.run(cb, *args)``; an exception other
    than SystemExit / KeyboardInterrupt (which propagate) goes to the exception handler.  A
    transport's compiled reader (exactly a ``TransportReader``, no arguments: what the
    transport registers) is read by a cdef call."""
    try:
        if type(cb) is TransportReader and aio_tuple_size(args) == 0:
            _read_in_context(ctx, <TransportReader>cb)
        else:
            aio_call_in_context(ctx, cb, args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        _report(handle, exc)
    return 0


cdef int _run_handle(object handle) except -1:
    """The ready-queue call: one handle popped from ``_ready``, run unless cancelled.

    A handle whose type is exactly ``asyncio.Handle`` / ``TimerHandle`` is run here: its
    slots read directly (references held for the call: the callback may cancel its own
    handle, which clears ``_callback`` / ``_args``), the callback called in its Context
    (``_call``).  Any other handle type (a subclass, a mock) runs through its own
    ``_run()``, as do handles whose slots are not what ``Handle.__init__`` stores (a
    context that is not a ``contextvars.Context``, args that are not a tuple).

    Step 3 (docs/aio-compiled.md): a callback of a compiled type (the stream transport's
    reader, ``aoprim.aio._aiotransport.TransportReader``) is recognised by its exact type in
    ``_call`` and read by a cdef call inside the same Context enter / exit instead of the
    vectorcall.

    Single-threaded by the loop's contract: a handle is cancelled by the loop's thread
    (asyncio's Handle.cancel is not thread-safe either), so the borrowed slot reads are not
    raced."""
    cdef type t = type(handle)
    cdef PyObject *p
    cdef object cb, args, ctx
    if _FAST_HANDLES and (t is _Handle or t is _TimerHandle):
        p = aio_slot(handle, _OFF_CANCELLED)
        if p == Py_True:
            return 0
        if p == Py_False:
            cb = _slot(handle, _OFF_CALLBACK)
            args = _slot(handle, _OFF_ARGS)
            ctx = _slot(handle, _OFF_CONTEXT)
            if cb is not None and PyTuple_CheckExact(args) and PyContext_CheckExact(ctx):
                return _call(handle, cb, args, ctx)
            handle._run()
            return 0
    if handle._cancelled:
        return 0
    handle._run()
    return 0


cdef inline object _slot(object o, Py_ssize_t off):
    """A slot's value (a new reference), None when unset."""
    cdef PyObject *p = aio_slot(o, off)
    return <object>p if p != NULL else None


# ---- what a loop's class keeps of asyncio's, cached by the class's version tag ----------

cdef _be_cls = _be.BaseEventLoop
cdef object _py_call_soon = _be_cls.call_soon
cdef object _py_call_at = _be_cls.call_at
cdef object _py_call_later = _be_cls.call_later
cdef object _base_check_closed = _be_cls._check_closed
cdef object _base__call_soon = _be_cls._call_soon
cdef object _base_get_debug = _be_cls.get_debug
cdef object _handle_init = _Handle.__init__
cdef object _timer_init = _TimerHandle.__init__
from asyncio import futures as _futures
cdef object _Future = _futures.Future

cdef enum:
    _C_KNOWN = 1            # the entry holds a class's checks
    _C_EVENTS = 2           # the class's _process_events is asyncio's (selector loop's)
    _C_TIME = 4             # its time() is BaseEventLoop's: time.monotonic() is it
    _C_SCHED = 8            # call_soon / call_at / call_later's helpers are asyncio's
    _C_FIELDS = 16          # a LoopCore whose class reaches LoopCore's own descriptor for
                            # every field name: self._ready etc. are the C fields
    _C_CALL_AT = 32         # its call_at is this module's: call_later need not call it

# (version tag << 8) | the _C_ bits of the last loop class checked: one word, so a reader
# on another thread (free-threaded build, two loops) sees a tag and its own class's bits;
# relaxed: a stale or torn-free old entry only misses (the class is then checked again)
cdef uint64_t _class_cache = 0
# this module's call_at (defined below): a class whose call_at is it gets the compiled
# call_later, which makes the timer itself
cdef object _own_call_at = None


cdef int _class_bits(object loop) except -1:
    """The _C_ bits of the loop's class: from the cache when the class's version tag is
    the cached one (the class and its bases unchanged since they were checked), else
    checked now by the class's attributes (which also gives the class a tag)."""
    cdef object t = type(loop)
    cdef unsigned int tag = aio_type_tag(t)
    cdef uint64_t c = aop_load_u64p(&_class_cache, AOP_RELAXED)   # relaxed: see above
    cdef int bits
    if tag != 0 and <unsigned int>(c >> 8) == tag:
        return <int>(c & 0xff)
    bits = _C_KNOWN
    if isinstance(loop, LoopCore) and _fields_are_loopcores(t):
        bits |= _C_FIELDS
    # a subclass's _process_events or _add_callback is called by asyncio's iteration,
    # never by the compiled one
    if t._process_events is _base_process_events and t._add_callback is _base_add_callback:
        bits |= _C_EVENTS
    # a subclass's call_at sees every timer asyncio's call_later makes (asyncio.sleep,
    # wait_for on 3.11): call_later goes through it, as BaseEventLoop.call_later does
    if t.call_at is _own_call_at:
        bits |= _C_CALL_AT
    if t.time is _base_time:
        bits |= _C_TIME
    if (_FAST_SCHEDULE and t._check_closed is _base_check_closed and
            t._call_soon is _base__call_soon and
            (t.get_debug is _base_get_debug or t.get_debug is _get_debug) and
            _Handle.__init__ is _handle_init and _TimerHandle.__init__ is _timer_init):
        bits |= _C_SCHED
    tag = aio_type_tag(t)               # assigned by the lookups above, if it was not
    if tag != 0:
        aop_store_u64p(&_class_cache, ((<uint64_t>tag) << 8) | <uint64_t>bits,
                       AOP_RELAXED)     # relaxed: one word, read as one (see above)
    return bits


cdef tuple _FIELD_NAMES = ("_ready", "_scheduled", "_selector", "_stopping", "_debug",
                           "_closed", "_clock_resolution", "_timer_cancelled_count")


cdef bint _fields_are_loopcores(object t) except -1:
    """True when an attribute lookup of each field name on an instance of ``t`` finds
    LoopCore's own descriptor: no class before LoopCore in the MRO has its own attribute
    of that name (a subclass's __slots__ slot, property or plain class attribute would be
    what asyncio's code reads and writes, not the C field)."""
    core = LoopCore.__dict__
    for name in _FIELD_NAMES:
        for klass in t.__mro__:
            d = klass.__dict__
            if name in d:
                if d[name] is not core[name]:
                    return False
                break
    return True


cdef enum:
    _DICT_EVENTS = 1        # the instance __dict__ has "_process_events"
    _DICT_TIME = 2          # ... "time"


cdef inline int _dict_bits(LoopCore loop) except -1:
    """The _DICT_ bits of the loop's instance __dict__ (PyObject_GenericGetDict: what
    ``loop.__dict__`` returns, without the attribute lookup): looked up again only when
    the dict's version tag is not the one they were found under."""
    cdef dict d = PyObject_GenericGetDict(loop, NULL)
    cdef unsigned long long tag = aio_dict_tag(d)
    if tag == 0 or tag != loop._dict_tag:
        loop._dict_bits = ((_DICT_EVENTS if "_process_events" in d else 0) |
                           (_DICT_TIME if "time" in d else 0))
        loop._dict_tag = tag
    return loop._dict_bits


cdef inline int _compiled_ok(LoopCore loop, object sel) except -1:
    """0: asyncio's Python iteration; 1: the compiled one; 2: the compiled one, and the
    loop's time() is BaseEventLoop's (in neither its class nor its __dict__; run_once then
    also checks that ``time.monotonic`` is not patched: _clock_patched).  The
    compiled one reads the
    loop state from LoopCore's C fields: only where they are what asyncio's code reads
    (_C_FIELDS), and with an exact list as the timer heap (heapq takes a list subclass:
    asyncio's iteration then).  It does not call ``Handle._run`` nor the selector's
    ``select``: where either is patched (aiodebug's slow-callback log, checked here;
    aiotools' and looptime's virtual clocks, which replace ``select`` on the selector
    instance, checked in run_once: _select_patched) the iteration is asyncio's, which
    calls them."""
    cdef int bits = _class_bits(loop)
    if not bits & _C_FIELDS or not bits & _C_EVENTS or loop.c_unset:
        return 0
    if type(sel) is not _selector_type or loop.c_debug or type(loop.c_scheduled) is not list:
        return 0
    cdef int d = _dict_bits(loop)
    if d & _DICT_EVENTS:
        return 0
    if not _handle_run_ok():
        return 0
    if bits & _C_TIME and not d & _DICT_TIME:
        return 2
    return 1


# ---- what the compiled iteration does not call, checked per iteration ------------------

# time.monotonic as this module found it: the iteration and call_later call it directly
# (no Python frame) while it is still what the time module holds; a patched one
# (unittest.mock.patch("time.monotonic"), freezegun) is what asyncio's BaseEventLoop.time()
# returns, so every deadline then goes through loop.time(): one clock, as on asyncio
cdef dict _time_dict = _time.__dict__
cdef object _S_MONOTONIC = _sys.intern("monotonic")
cdef object _S_SELECT = _sys.intern("select")


# BaseEventLoop.time() reads ``time`` from asyncio.base_events' globals at each call:
# replacing that name (unittest.mock.patch("asyncio.base_events.time", fake)) is a patched
# clock as much as replacing time.monotonic
cdef dict _be_dict = _be.__dict__
cdef object _S_TIME = _sys.intern("time")
# both dicts as borrowed pointers (the modules, held by sys.modules and by this module's
# globals, keep them alive): the per-iteration tag reads take no reference
cdef PyObject *_time_dict_p = <PyObject *>_time_dict
cdef PyObject *_be_dict_p = <PyObject *>_be_dict


# the version tags of the time module's dict and of asyncio.base_events' under which each
# was last found unpatched (0: none): one word each, relaxed -- a stale value only makes
# the next check look it up again
cdef uint64_t _time_clean_tag = 0
cdef uint64_t _be_clean_tag = 0


cdef bint _clock_patched_slow(uint64_t time_tag, uint64_t be_tag) except -1:
    if PyDict_GetItemWithError(_time_dict, _S_MONOTONIC) != <PyObject *>_monotonic:
        return True
    aop_store_u64p(&_time_clean_tag, time_tag, AOP_RELAXED)
    if PyDict_GetItemWithError(_be_dict, _S_TIME) != <PyObject *>_time:
        return True
    aop_store_u64p(&_be_clean_tag, be_tag, AOP_RELAXED)
    return False


cdef inline bint _clock_patched() except -1:
    """True when the clock BaseEventLoop.time() reads is no longer ``time.monotonic`` as
    this module bound it: ``time.monotonic`` replaced in the time module, or the name
    ``time`` in asyncio.base_events' globals no longer the time module.  Each dict is looked
    up (by an interned key) only when it changed since it was last found unpatched (its
    version tag): two tag compares otherwise."""
    cdef uint64_t tag = aio_dict_tag_p(_time_dict_p)
    cdef uint64_t be_tag = aio_dict_tag_p(_be_dict_p)
    if (tag != 0 and tag == aop_load_u64p(&_time_clean_tag, AOP_RELAXED) and
            be_tag == aop_load_u64p(&_be_clean_tag, AOP_RELAXED)):
        return False
    return _clock_patched_slow(tag, be_tag)


# (version tag << 1) | ok: whether asyncio's Handle._run is still the one the compiled
# ready-queue call stands for (on Handle and TimerHandle), as of TimerHandle's version tag
# -- which CPython renews on any change to TimerHandle or to Handle, its base; one word,
# relaxed (as _class_cache: a stale entry only misses)
cdef object _orig_handle_run = _Handle.__dict__["_run"]
cdef uint64_t _run_cache = 0


cdef bint _handle_run_ok() except -1:
    cdef unsigned int tag = aio_type_tag(_TimerHandle)
    cdef uint64_t c = aop_load_u64p(&_run_cache, AOP_RELAXED)
    cdef bint ok
    if tag != 0 and <unsigned int>(c >> 1) == tag:
        return <bint>(c & 1)
    ok = _Handle._run is _orig_handle_run and _TimerHandle._run is _orig_handle_run
    tag = aio_type_tag(_TimerHandle)    # assigned by the lookups above, if it was not
    if tag != 0:
        aop_store_u64p(&_run_cache, ((<uint64_t>tag) << 1) | <uint64_t>ok, AOP_RELAXED)
    return ok


# the same for the selector class's select() (the loop's _Selector.select and the
# EpollSelector.select it calls), as of _Selector's version tag (renewed by a change to it
# or to any base)
cdef object _own_select = None          # _Selector.select (configure)
cdef object _epoll_select = _selectors.EpollSelector.select
cdef uint64_t _select_cache = 0


cdef bint _select_class_ok() except -1:
    cdef unsigned int tag = aio_type_tag(_selector_type)
    cdef uint64_t c = aop_load_u64p(&_select_cache, AOP_RELAXED)
    cdef bint ok
    if tag != 0 and <unsigned int>(c >> 1) == tag:
        return <bint>(c & 1)
    ok = (_selector_type.select is _own_select and
          _selectors.EpollSelector.select is _epoll_select)
    tag = aio_type_tag(_selector_type)
    if tag != 0:
        aop_store_u64p(&_select_cache, ((<uint64_t>tag) << 1) | <uint64_t>ok, AOP_RELAXED)
    return ok


cdef inline bint _select_patched(_Events evs) except -1:
    """True when the selector's ``select`` is not _Selector's own: replaced on the instance
    (one lookup in its __dict__, kept in evs, by an interned key: not cached by the dict's
    version tag, which 3.13 does not renew when an attribute is stored into an object's
    inline values) or on the class or a base."""
    return (PyDict_GetItemWithError(evs.sel_dict, _S_SELECT) != NULL or
            not _select_class_ok())


# ---- the scheduling calls: asyncio's handles built in C ---------------------------------

cdef object _new_handle(type t, object callback, tuple args, object loop, object context):
    """``t(callback, args, loop, context)`` for t asyncio's Handle or TimerHandle, outside
    debug mode: the slots ``Handle.__init__`` sets (no source traceback), set directly on
    a fresh object (``TimerHandle``'s ``_when`` / ``_scheduled`` by the caller)."""
    if context is None:
        context = PyContext_CopyCurrent()
    h = aio_alloc(<PyTypeObject *>t)
    aio_init_slot(h, _OFF_CONTEXT, context)
    aio_init_slot(h, _OFF_LOOP, loop)
    aio_init_slot(h, _OFF_CALLBACK, callback)
    aio_init_slot(h, _OFF_ARGS, args)
    aio_init_slot(h, _OFF_CANCELLED, False)
    aio_init_slot(h, _OFF_REPR, None)
    aio_init_slot(h, _OFF_SOURCE_TB, None)
    return h


# the loop state the scheduling calls read: LoopCore's C fields on aoprim.aio's loops (as
# the iteration reads them) where the class reaches them (_C_FIELDS of its _class_bits),
# the attribute on any other loop these functions are bound to
cdef inline object _debug_of(object loop, int bits):
    return (<LoopCore>loop).c_debug if bits & _C_FIELDS else loop._debug


cdef inline object _closed_of(object loop, int bits):
    return (<LoopCore>loop).c_closed if bits & _C_FIELDS else loop._closed


cdef inline object _ready_of(object loop, int bits):
    return (<LoopCore>loop).c_ready if bits & _C_FIELDS else loop._ready


cdef inline object _scheduled_of(object loop, int bits):
    return (<LoopCore>loop).c_scheduled if bits & _C_FIELDS else loop._scheduled


cdef object _schedule_at(object loop, object when, object callback, tuple args,
                         object context, int bits):
    """call_at's body after its checks: a TimerHandle pushed on ``loop._scheduled`` by
    heapq's algorithm (aio_heappush), then marked scheduled."""
    h = _new_handle(_TimerHandle, callback, args, loop, context)
    aio_init_slot(h, _OFF_WHEN, when)
    aio_init_slot(h, _OFF_SCHEDULED, False)
    scheduled = _scheduled_of(loop, bits)
    if type(scheduled) is list:
        aio_heappush(<list>scheduled, h)
    else:
        _heapq.heappush(scheduled, h)       # heapq's own errors for a non-list
    aio_set_slot(h, _OFF_SCHEDULED, True)
    return h


cdef _unexpected_keyword(str name, dict kw):
    # asyncio's methods are Python functions: CPython names the class in this message
    # (3.11-3.13 alike); a Cython signature without **kw would say only "call_soon()".
    raise TypeError(f"BaseEventLoop.{name}() got an unexpected keyword argument "
                    f"'{next(iter(kw))}'")


cdef PyObject *_call_soon_body(PyObject *self_, PyObject *callback_, PyObject *args_,
                               PyObject *context_) except NULL:
    """call_soon after its arguments were parsed (aio_call_soon_fast): a new reference, or
    NULL with the error set."""
    r = _call_soon(<object>self_, <object>callback_, <tuple>args_, <object>context_)
    Py_INCREF(r)
    return <PyObject *>r


cdef object _call_soon(object self, object callback, tuple args, object context):
    cdef int bits = _class_bits(self)
    if not bits & _C_SCHED or _debug_of(self, bits):
        return _py_call_soon(self, callback, *args, context=context)
    if _closed_of(self, bits):
        raise RuntimeError('Event loop is closed')
    h = _new_handle(_Handle, callback, args, self, context)
    _ready_append(_ready_of(self, bits), h)
    return h


def call_at(self, when, callback, *args, context=None, **kw):
    """``BaseEventLoop.call_at`` in C (asyncio's where call_soon's is, above)."""
    if kw:
        _unexpected_keyword('call_at', kw)
    if when is None:
        raise TypeError("when cannot be None")
    cdef int bits = _class_bits(self)
    if not bits & _C_SCHED or _debug_of(self, bits):
        return _py_call_at(self, when, callback, *args, context=context)
    if _closed_of(self, bits):
        raise RuntimeError('Event loop is closed')
    return _schedule_at(self, when, callback, args, context, bits)


_own_call_at = call_at


def call_later(self, delay, callback, *args, context=None, **kw):
    """``BaseEventLoop.call_later`` in C: ``time() + delay`` (``time.monotonic()`` where the
    loop keeps BaseEventLoop's time() and time.monotonic is not patched, as the iteration),
    then call_at's body.  Where the loop's class has a call_at of its own, asyncio's
    call_later, which calls it."""
    if kw:
        _unexpected_keyword('call_later', kw)
    if delay is None:
        raise TypeError('delay must not be None')
    cdef int bits = _class_bits(self)
    if not bits & _C_SCHED or not bits & _C_CALL_AT or _debug_of(self, bits):
        # asyncio's: self.call_at(self.time() + delay, ...), a subclass's call_at included
        return _py_call_later(self, delay, callback, *args, context=context)
    # a time() in the instance dict: as _compiled_ok finds it (_dict_bits)
    if bits & _C_TIME and not _clock_patched() and not (
            _dict_bits(<LoopCore>self) & _DICT_TIME if isinstance(self, LoopCore)
            else "time" in PyObject_GenericGetDict(self, NULL)):
        when = _monotonic() + delay
    else:
        when = self.time() + delay
    if when is None:
        raise TypeError("when cannot be None")
    if _closed_of(self, bits):
        raise RuntimeError('Event loop is closed')
    return _schedule_at(self, when, callback, args, context, bits)


def get_debug(self):
    """``BaseEventLoop.get_debug`` without its Python frame: ``self._debug``.  asyncio's
    ``Future.__init__`` (the C ``_asyncio.Future``'s too) asks the loop once per future,
    and ``Handle.__init__`` once per handle where asyncio builds one."""
    return _debug_of(self, _class_bits(self))


cdef object _get_debug = get_debug


def create_future(self):
    """``BaseEventLoop.create_future`` without its Python frame: ``asyncio.Future(loop=self)``
    (the C ``_asyncio.Future`` where it is asyncio's)."""
    return _Future(loop=self)


# call_soon: a method (descriptor) of LoopCore whose C function parses the arguments as
# CPython parses asyncio's Python signature (aio_call_soon_fast), then _call_soon
call_soon = aio_make_call_soon(LoopCore, _call_soon_body)


# a LoopCore field after ``del loop._x``: the attribute reads as missing (AttributeError)
# until assigned again, as an instance attribute deleted from asyncio's loop -- so
# unittest.mock.patch.object(loop, "_clock_resolution", ...), which restores an attribute
# not in vars(loop) by deleting its patch and, when the name is then missing, assigning
# the original, leaves the loop as it was
cdef object _UNSET = object()


cdef int _missing(object loop, str name) except -1:
    raise AttributeError(f"{type(loop).__name__!r} object has no attribute {name!r}",
                         name=name, obj=loop)


@cython.auto_pickle(False)     # a loop is not picklable (asyncio's neither)
cdef class LoopCore:
    """The first base of ``aoprim.aio.Loop`` (see the .pxd): ``_ready``, ``_scheduled``,
    ``_selector``, ``_stopping``, ``_debug``, ``_closed``, ``_clock_resolution`` and
    ``_timer_cancelled_count`` in C fields behind data descriptors of the same names, so
    asyncio's Python code keeps ``self._ready`` etc. unchanged while the compiled iteration
    reads the fields (uvloop keeps its loop state in C fields likewise).  The differences a
    caller can see: these names are not in ``vars(loop)``, and a loop cannot be pickled or
    copied.  ``del loop._ready`` (etc.) makes the attribute read as missing until it is
    assigned again, as on asyncio's loop (the iteration is asyncio's meanwhile).

    GC: the fields are traversed and cleared as any object's; after a clear (a loop
    collected in a cycle) they are None, and a method called then fails as on asyncio's
    loop after its __dict__ was cleared.  The finalizer (BaseEventLoop.__del__) runs
    before any clear, so it sees them intact.

    Threads (a free-threaded build has no GIL to order a field's read against its
    replacement): the only fields another thread reads are the ones asyncio's thread-safe
    entry points read -- ``_ready`` (assigned once, in __init__) and ``_closed`` /
    ``_debug`` / ``_stopping`` (bools, immortal from 3.12, so a read racing a write never
    sees a freed object); ``_scheduled``, ``_timer_cancelled_count`` and the cached
    ``_evs`` are the loop thread's, as in asyncio."""

    property _ready:
        def __get__(self):
            if self.c_ready is _UNSET:
                _missing(self, "_ready")
            return self.c_ready

        def __set__(self, value):
            if self.c_ready is _UNSET:
                self.c_unset -= 1
            self.c_ready = value

        def __del__(self):
            if self.c_ready is _UNSET:
                _missing(self, "_ready")
            self.c_ready = _UNSET
            self.c_unset += 1

    property _scheduled:
        def __get__(self):
            if self.c_scheduled is _UNSET:
                _missing(self, "_scheduled")
            return self.c_scheduled

        def __set__(self, value):
            if self.c_scheduled is _UNSET:
                self.c_unset -= 1
            self.c_scheduled = value

        def __del__(self):
            if self.c_scheduled is _UNSET:
                _missing(self, "_scheduled")
            self.c_scheduled = _UNSET
            self.c_unset += 1

    property _selector:
        def __get__(self):
            if self.c_selector is _UNSET:
                _missing(self, "_selector")
            return self.c_selector

        def __set__(self, value):
            if self.c_selector is _UNSET:
                self.c_unset -= 1
            self.c_selector = value

        def __del__(self):
            if self.c_selector is _UNSET:
                _missing(self, "_selector")
            self.c_selector = _UNSET
            self.c_unset += 1

    property _stopping:
        def __get__(self):
            if self.c_stopping is _UNSET:
                _missing(self, "_stopping")
            return self.c_stopping

        def __set__(self, value):
            if self.c_stopping is _UNSET:
                self.c_unset -= 1
            self.c_stopping = value

        def __del__(self):
            if self.c_stopping is _UNSET:
                _missing(self, "_stopping")
            self.c_stopping = _UNSET
            self.c_unset += 1

    property _debug:
        def __get__(self):
            if self.c_debug is _UNSET:
                _missing(self, "_debug")
            return self.c_debug

        def __set__(self, value):
            if self.c_debug is _UNSET:
                self.c_unset -= 1
            self.c_debug = value

        def __del__(self):
            if self.c_debug is _UNSET:
                _missing(self, "_debug")
            self.c_debug = _UNSET
            self.c_unset += 1

    property _closed:
        def __get__(self):
            if self.c_closed is _UNSET:
                _missing(self, "_closed")
            return self.c_closed

        def __set__(self, value):
            if self.c_closed is _UNSET:
                self.c_unset -= 1
            self.c_closed = value

        def __del__(self):
            if self.c_closed is _UNSET:
                _missing(self, "_closed")
            self.c_closed = _UNSET
            self.c_unset += 1

    property _clock_resolution:
        def __get__(self):
            if self.c_clock_resolution is _UNSET:
                _missing(self, "_clock_resolution")
            return self.c_clock_resolution

        def __set__(self, value):
            if self.c_clock_resolution is _UNSET:
                self.c_unset -= 1
            self.c_clock_resolution = value

        def __del__(self):
            if self.c_clock_resolution is _UNSET:
                _missing(self, "_clock_resolution")
            self.c_clock_resolution = _UNSET
            self.c_unset += 1

    property _timer_cancelled_count:
        def __get__(self):
            if self.c_timer_cancelled_count is _UNSET:
                _missing(self, "_timer_cancelled_count")
            return self.c_timer_cancelled_count

        def __set__(self, value):
            if self.c_timer_cancelled_count is _UNSET:
                self.c_unset -= 1
            self.c_timer_cancelled_count = value

        def __del__(self):
            if self.c_timer_cancelled_count is _UNSET:
                _missing(self, "_timer_cancelled_count")
            self.c_timer_cancelled_count = _UNSET
            self.c_unset += 1


# iterations that ran asyncio's Python _run_once (process-wide; a plain counter: exact on
# one loop thread, approximate when loops on several threads of a free-threaded build
# fall back at once) -- tests read it to tell which path ran
cdef unsigned long long _python_iterations = 0


def python_iterations():
    """How many iterations of any aoprim.aio loop ran asyncio's Python ``_run_once`` (debug
    mode, a caller's selector, a patched ``select`` / ``Handle._run`` / ``_process_events``)
    since import."""
    return _python_iterations


def run_once(LoopCore loop):
    """``Loop._run_once``: flush what was written outside a callback, one iteration
    (compiled, or asyncio's -- see the module docstring), then flush the iteration's
    writes -- also when a callback raised out of the loop (KeyboardInterrupt,
    SystemExit)."""
    global _python_iterations
    cdef _Events evs
    cdef int ok
    sel = loop.c_selector
    ok = _compiled_ok(loop, sel)
    if ok:
        # the loop's own _Selector: its _Events holds the group and the flush (looked up
        # once per selector: wait_state sets a selector's _aio_events when it is made)
        if sel is loop._evs_sel and loop._evs is not None:
            evs = loop._evs
        else:
            evs = <_Events>sel._aio_events
            loop._evs = evs
            loop._evs_sel = sel
        group = evs.group
        flush = evs.flush
        if _select_patched(evs):
            ok = 0                          # asyncio's iteration calls the patched select
        elif ok == 2 and _clock_patched():
            ok = 1                          # time.monotonic patched: deadlines by loop.time()
    else:
        group = loop._aio_group
        flush = loop._aio_flush
    if len(group):
        loop._aio_flush_all()               # written outside a callback: send before the wait
    try:
        if ok:
            _iteration(loop, evs, ok == 2)
        else:
            _python_iterations += 1
            _base_run_once(loop)
    finally:
        flush()
        if len(group):
            loop._aio_flush_all()           # a notification wrote again
