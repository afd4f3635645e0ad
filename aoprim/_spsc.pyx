# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""SPSCQueue: a bounded lock-free single-producer single-consumer queue of Python objects
(docs/queues.md).  Correct only with ONE producer thread and ONE consumer thread.

The queue itself is aop_spsc_t in aoprim/include/aop_queue.h, where the algorithm (a
power-of-two ring; producer-owned tail and consumer-owned head on separate 128-byte blocks,
published with release and read with acquire, each side caching the other's index), its
invariants, the memory order of every atomic and the no-lost-wake-up argument
are written down.  This module is the Python surface over it; the method bodies are shared with the other
queue in aoprim/_qcore.pxd (compiled per queue type, no indirection), where the
reference rules are stated.
"""
cimport cython
from cpython.ref cimport PyObject
from types import GenericAlias
from aoprim._qcore cimport (
    QTypeSlots, traverseproc, q_ctor_capacity, inquiry, visitproc, q_traverse, q_clear,
    aop_spsc_new, q_drain_dealloc, q_put, q_put_nowait, q_get, q_get_nowait, q_put_many,
    q_get_many, q_size, q_close, q_repr, q_task_done, q_join,
    q_get_settled, q_put_settled, q_async_register, q_async_unregister, q_async_any, q_async_wake,
    q_running_loop, q_fast_install,
)
from aoprim._qasync import async_methods as _async_methods
from aoprim.errors import Empty, Full
from aoprim._mpmc import _wake_future


# GC: tracked, and cleared by our own tp_clear (q_clear, below), which only drops the queued
# items: the ring itself is freed in __dealloc__, so a queue the GC cleared first is a valid,
# empty queue to anything that still touches it (a finalizer, C code).
# Deallocation goes through CPython's trashcan (as list's does): dropping a queue releases
# its items, which may be queues holding queues...; past a small nesting depth the trashcan
# defers the inner deallocations, so a long chain cannot overflow the C stack.
@cython.trashcan(True)
cdef class SPSCQueue:
    """SPSCQueue(capacity) or SPSCQueue(maxsize=capacity): bounded lock-free queue for exactly one producer thread and one
    consumer thread.  capacity (int >= 1) is rounded up to a power of two; see .capacity.

    Free-threaded builds: one producer and one consumer thread at a time; a second thread
    on a side at the same moment gets RuntimeError and changes nothing.  qsize, close,
    task_done and join from any thread."""

    def __cinit__(self, *args, **kwargs):
        # SPSCQueue(capacity), SPSCQueue(capacity=n) or queue.Queue's SPSCQueue(maxsize=n), parsed by
        # q_ctor_capacity (aoprim/_qcore.pxd) so that every message names the class
        self.q = aop_spsc_new(q_ctor_capacity("SPSCQueue", args, kwargs))
        if self.q is NULL:
            raise MemoryError()
        self._agetters = []
        self._aputters = []

    def __dealloc__(self):
        if self.q is not NULL:
            q_drain_dealloc(self.q)
            self.q = NULL

    @property
    def capacity(self):
        """The real capacity (the requested one rounded up to a power of two)."""
        return self.q.cap

    @property
    def maxsize(self):
        """queue.Queue's name for the capacity (the real one, as .capacity)."""
        return self.q.cap

    @classmethod
    def __class_getitem__(cls, item):
        """SPSCQueue[int]: a generic alias for annotations, as queue.Queue[int]."""
        return GenericAlias(cls, item)

    # put / put_nowait / get / get_nowait: the bodies are the cdef functions below the class,
    # which the fast entries call too (aoprim/_qcore.pxd, "fast entries")
    def put(self, item, block=True, timeout=None):
        """Put item; if full, wait (block=True) at most timeout seconds (None: forever).
        Full if no room in time, Closed if the queue is (or gets) closed."""
        return _put(self, item, block, timeout)

    def put_nowait(self, item):
        """Put item without waiting: Full if there is no room, Closed if closed."""
        return _put_nowait(self, item)

    def get(self, block=True, timeout=None):
        """Remove and return an item; if empty, wait (block=True) at most timeout seconds.
        Empty if none in time; Closed once the queue is closed and drained."""
        return _get(self, block, timeout)

    def get_nowait(self):
        """Remove and return an item without waiting: Empty, or Closed once drained."""
        return _get_nowait(self)

    def put_many(self, iterable):
        """Enqueue items from iterable, in order, until the queue is full; return how many
        were taken.  Closed if the queue is closed.  A list or tuple is moved in batches
        (one claim per batch); from any other iterable an item is taken only when there is
        room for it."""
        n = q_put_many(self.q, iterable)
        if n and q_async_any(&self._nagetters):
            q_async_wake(self._agetters, &self._nagetters, _wake_future, n)
        return n

    def get_many(self, max_items):
        """Dequeue up to max_items items without waiting (possibly []).  Closed once the
        queue is closed and drained."""
        items = q_get_many(self.q, max_items)
        if items and q_async_any(&self._naputters):
            q_async_wake(self._aputters, &self._naputters, _wake_future, len(items))
        return items

    def qsize(self):
        """Approximate number of items (exact when no other thread is using the queue)."""
        return q_size(self.q)

    def __len__(self):
        return q_size(self.q)

    def empty(self):
        """True if the queue looks empty (approximate while other threads run)."""
        return q_size(self.q) == 0

    def full(self):
        """True if the queue looks full (approximate while other threads run)."""
        return q_size(self.q) >= self.q.cap

    # get_async / put_async are Python coroutine functions (aoprim/_qasync.py: what inspect,
    # asyncio and unittest.mock take for coroutine functions); their waits are these two.
    get_async, put_async = _async_methods("SPSCQueue", "aoprim._spsc")

    async def _get_async_wait(self):
        """get_async's wait, after it found the queue empty: register, re-check, await a
        wake-up, try again (aoprim/_qcore.pxd, "asyncio waiters")."""
        while True:
            fut = q_running_loop().create_future()
            q_async_register(self._agetters, &self._nagetters, fut)
            try:
                item = q_get_settled(self.q)            # the re-check after registering
            except Empty:
                pass
            except BaseException:
                if not q_async_unregister(self._agetters, &self._nagetters, fut):
                    q_async_wake(self._agetters, &self._nagetters, _wake_future, 1)
                raise
            else:
                q_async_unregister(self._agetters, &self._nagetters, fut)
                if q_async_any(&self._naputters):
                    q_async_wake(self._aputters, &self._naputters, _wake_future, 1)
                return item
            try:
                await fut                               # a put or close() wakes us
            except BaseException:
                # cancelled: if a waker took our future, its wake-up goes to the next waiter
                if not q_async_unregister(self._agetters, &self._nagetters, fut):
                    q_async_wake(self._agetters, &self._nagetters, _wake_future, 1)
                raise
            try:
                return self.get_nowait()
            except Empty:
                pass                                    # another consumer was first

    async def _put_async_wait(self, item):
        """put_async's wait, after it found the queue full (as _get_async_wait)."""
        while True:
            fut = q_running_loop().create_future()
            q_async_register(self._aputters, &self._naputters, fut)
            try:
                q_put_settled(self.q, item)             # the re-check after registering
            except Full:
                pass
            except BaseException:
                if not q_async_unregister(self._aputters, &self._naputters, fut):
                    q_async_wake(self._aputters, &self._naputters, _wake_future, 1)
                raise
            else:
                q_async_unregister(self._aputters, &self._naputters, fut)
                if q_async_any(&self._nagetters):
                    q_async_wake(self._agetters, &self._nagetters, _wake_future, 1)
                return
            try:
                await fut                               # a get or close() wakes us
            except BaseException:
                if not q_async_unregister(self._aputters, &self._naputters, fut):
                    q_async_wake(self._aputters, &self._naputters, _wake_future, 1)
                raise
            try:
                self.put_nowait(item)
                return
            except Full:
                pass                                    # another producer was first

    def task_done(self):
        """queue.Queue's task_done(): the task of an item got earlier is finished.  Each
        successful put (put_many: each item it took) adds one unfinished task; ValueError
        if there is none."""
        q_task_done(self.q)

    def join(self):
        """queue.Queue's join(): wait until every item put has had its task_done() (the
        GIL released; parked, not spinning).  Returns at once if none is unfinished."""
        q_join(self.q)

    def close(self):
        """Close: put* raise Closed from now on; get* drain what is left, then raise Closed.
        Every blocked put/get wakes up.  Idempotent."""
        q_close(self.q)
        if q_async_any(&self._nagetters):
            q_async_wake(self._agetters, &self._nagetters, _wake_future, -1)
        if q_async_any(&self._naputters):
            q_async_wake(self._aputters, &self._naputters, _wake_future, -1)

    def __repr__(self):
        return q_repr(self.q, "SPSCQueue", id(self))


# ---- the hot methods' bodies (borrowed arguments: no reference is taken on self or item) ---

cdef object _put(SPSCQueue self, object item, object block, object timeout):
    q_put(self.q, item, block, timeout)
    if q_async_any(&self._nagetters):
        q_async_wake(self._agetters, &self._nagetters, _wake_future, 1)
    return None


cdef object _put_nowait(SPSCQueue self, object item):
    q_put_nowait(self.q, item)
    if q_async_any(&self._nagetters):
        q_async_wake(self._agetters, &self._nagetters, _wake_future, 1)
    return None


cdef object _get(SPSCQueue self, object block, object timeout):
    item = q_get(self.q, block, timeout)
    if q_async_any(&self._naputters):
        q_async_wake(self._aputters, &self._naputters, _wake_future, 1)
    return item


cdef object _get_nowait(SPSCQueue self):
    item = q_get_nowait(self.q)
    if q_async_any(&self._naputters):
        q_async_wake(self._aputters, &self._naputters, _wake_future, 1)
    return item


# the fast entries' functions: put(x), put_nowait(x), get(), get_nowait()
cdef object _put1(object self, object item):
    return _put(<SPSCQueue>self, item, True, None)


cdef object _put_nowait1(object self, object item):
    return _put_nowait(<SPSCQueue>self, item)


cdef object _get0(object self):
    return _get(<SPSCQueue>self, True, None)


cdef object _get_nowait0(object self):
    return _get_nowait(<SPSCQueue>self)


q_fast_install(SPSCQueue, _put1, _put_nowait1, _get0, _get_nowait0)


# ---- the cyclic GC ------------------------------------------------------------------------
# Cython generates tp_traverse / tp_clear for the class's object fields; these wrap them to
# cover the objects in the ring too (aoprim/_qcore.pxd, "the cyclic GC"), so a cycle through
# a queued item is collected like one through a list.

cdef traverseproc _base_traverse = (<QTypeSlots *>SPSCQueue).tp_traverse
cdef inquiry _base_clear = (<QTypeSlots *>SPSCQueue).tp_clear


cdef int _traverse(PyObject *o, visitproc visit, void *arg) noexcept:
    cdef int r = _base_traverse(o, visit, arg)
    if r:
        return r
    return q_traverse((<SPSCQueue>o).q, visit, arg)


cdef int _clear(PyObject *o) noexcept:
    q_clear((<SPSCQueue>o).q)
    return _base_clear(o)


(<QTypeSlots *>SPSCQueue).tp_traverse = _traverse
(<QTypeSlots *>SPSCQueue).tp_clear = _clear
