# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""MPMCQueue: a bounded lock-free multi-producer multi-consumer queue of Python objects
(API.md, "Queues").

The queue itself is aop_mpmc_t in aoprim/include/aop_queue.h, where the algorithm (Vyukov's
bounded queue: a sequence number per cell, CAS-claimed tail/head counters padded 128 bytes
apart), its invariants, the memory order of every atomic and the no-lost-wake-up argument
are written down.  This module is the Python surface over it:
- each cell's 64-bit word carries a PyObject* with its strong reference: put takes a new
  reference (before publishing), get hands it to the caller, dealloc releases what is left;
- a reference is only ever dropped with nothing held and nothing spun on: a failed push
  drops the reference it took (the caller still holds its own, so no __del__ can run), and
  a waiting put/get releases the GIL and waits in C without touching any object;
- the fast path (put(x) / get() / *_nowait) is one mode check, one CAS and one store, with
  no clock read, no lock and no GIL release;
- the queue is in OBJ mode (see the .pxd): C code using the *_u64 API on the same
  instance gets AOP_Q_BADMODE, and Python callers get TypeError on a RAW-mode queue.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.list cimport PyList_New

cdef extern from "Python.h":
    void _list_set_item "PyList_SET_ITEM" (object lst, Py_ssize_t i, PyObject *o)

from aoprim.atomic_h cimport aop_load_u32, AOP_RELAXED
from aoprim._qwait cimport (
    AOP_Q_OK, AOP_Q_RETRY, AOP_Q_BUSY, AOP_Q_CLOSED, AOP_Q_MODE_OBJ, aop_q_mode_ok,
    q_obj_mode, q_steal, q_word, q_capacity, q_timeout_ns, q_max_items, q_raise,
    q_wait_interruptible,
)

cdef enum:
    CHUNK = 64      # words moved per C call by put_many / get_many


cdef class MPMCQueue:
    """MPMCQueue(capacity): bounded lock-free queue for any number of producer and consumer
    threads.  capacity (int >= 1) is rounded up to a power of two; see .capacity."""

    def __cinit__(self, capacity):
        cdef uint64_t cap = q_capacity(capacity)
        self.q = aop_mpmc_new(cap)
        if self.q is NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef uint64_t buf[CHUNK]
        cdef uint64_t n, i
        if self.q is NULL:
            return
        # relaxed: nobody else can reach a queue being deallocated
        if aop_load_u32(&self.q.mode, AOP_RELAXED) == AOP_Q_MODE_OBJ:
            while True:
                aop_mpmc_pop_many_(self.q, buf, CHUNK, &n)
                if n == 0:
                    break
                for i in range(n):
                    q_steal(buf[i])      # the queue's reference, dropped: no lock is held
        aop_mpmc_free(self.q)
        self.q = NULL

    @property
    def capacity(self):
        """The real capacity (the requested one rounded up to a power of two)."""
        return self.q.cap

    def put(self, item, block=True, timeout=None):
        """Put item; if full, wait (block=True) at most timeout seconds (None: forever).
        Full if no room in time, Closed if the queue is (or gets) closed."""
        cdef int64_t ns = -1
        cdef uint64_t v = q_word(item)
        cdef int r
        if not (block is True and timeout is None):
            ns = q_timeout_ns(block, timeout)
        q_obj_mode(&self.q.mode)
        Py_INCREF(item)                  # the queue's reference, taken before publication
        r = aop_mpmc_push_(self.q, v)
        if r == AOP_Q_OK:
            return
        if (r == AOP_Q_RETRY or r == AOP_Q_BUSY) and ns != 0:
            try:
                r = q_wait_interruptible(aop_mpmc_push_wait_p, self.q, &v, ns)
            except BaseException:
                Py_DECREF(item)          # interrupted: not queued
                raise
            if r == AOP_Q_OK:
                return
        Py_DECREF(item)                  # not queued: the caller still holds item
        q_raise(r, True)

    def put_nowait(self, item):
        """Put item without waiting: Full if there is no room, Closed if closed."""
        cdef int r
        q_obj_mode(&self.q.mode)
        Py_INCREF(item)
        r = aop_mpmc_push_(self.q, q_word(item))
        if r != AOP_Q_OK:
            Py_DECREF(item)
            q_raise(r, True)

    def get(self, block=True, timeout=None):
        """Remove and return an item; if empty, wait (block=True) at most timeout seconds.
        Empty if none in time; Closed once the queue is closed and drained."""
        cdef int64_t ns = -1
        cdef uint64_t v
        cdef int r
        if not (block is True and timeout is None):
            ns = q_timeout_ns(block, timeout)
        q_obj_mode(&self.q.mode)
        r = aop_mpmc_pop_(self.q, &v)
        if r == AOP_Q_OK:
            return q_steal(v)
        if (r == AOP_Q_RETRY or r == AOP_Q_BUSY) and ns != 0:
            r = q_wait_interruptible(aop_mpmc_pop_wait_p, self.q, &v, ns)
            if r == AOP_Q_OK:
                return q_steal(v)
        q_raise(r, False)

    def get_nowait(self):
        """Remove and return an item without waiting: Empty, or Closed once drained."""
        cdef uint64_t v
        cdef int r
        q_obj_mode(&self.q.mode)
        r = aop_mpmc_pop_(self.q, &v)
        if r == AOP_Q_OK:
            return q_steal(v)
        q_raise(r, False)

    def put_many(self, iterable):
        """Enqueue items from iterable, in order, until the queue is full; return how many
        were taken.  Closed if the queue is closed.  A list or tuple is moved in batches
        (one claim per batch); from any other iterable an item is taken only when there is
        room for it (should a racing producer take that room first, we wait for room rather
        than lose the item)."""
        cdef uint64_t buf[CHUNK]
        cdef uint64_t n, i, pushed, v, total = 0
        cdef Py_ssize_t pos = 0, size
        cdef int r
        cdef object seq, it, x
        q_obj_mode(&self.q.mode)
        if aop_mpmc_closed(self.q):
            q_raise(AOP_Q_CLOSED, True)
        if type(iterable) is list or type(iterable) is tuple:
            seq = iterable
            while True:
                size = len(seq)
                n = 0
                while n < CHUNK and pos + <Py_ssize_t>n < size:
                    x = seq[pos + n]
                    Py_INCREF(x)              # the queue's reference
                    buf[n] = q_word(x)
                    n += 1
                if n == 0:
                    break
                r = aop_mpmc_push_many_(self.q, buf, n, &pushed)
                for i in range(pushed, n):
                    q_steal(buf[i])           # not queued: give back (seq still holds them)
                total += pushed
                pos += <Py_ssize_t>pushed
                if r == AOP_Q_CLOSED and total == 0:
                    q_raise(r, True)
                if pushed < n:
                    break
            return total
        it = iter(iterable)
        while aop_mpmc_size(self.q) < self.q.cap:
            try:
                x = next(it)
            except StopIteration:
                break
            Py_INCREF(x)
            v = q_word(x)
            r = aop_mpmc_push_(self.q, v)
            if r == AOP_Q_RETRY or r == AOP_Q_BUSY:
                try:
                    r = q_wait_interruptible(aop_mpmc_push_wait_p, self.q, &v, -1)
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

    def get_many(self, max_items):
        """Dequeue up to max_items items without waiting (possibly []).  Closed once the
        queue is closed and drained."""
        cdef uint64_t want = q_max_items(max_items)
        cdef uint64_t buf[CHUNK]
        cdef uint64_t n, i, got = 0
        cdef int r
        cdef list out
        q_obj_mode(&self.q.mode)
        if want == 0:
            r = aop_mpmc_pop_many_(self.q, buf, 0, &n)
            if r != AOP_Q_OK:
                q_raise(r, False)
            return []
        r = aop_mpmc_pop_many_(self.q, buf, want if want < CHUNK else CHUNK, &n)
        if r != AOP_Q_OK:
            if r == AOP_Q_RETRY or r == AOP_Q_BUSY:
                return []
            q_raise(r, False)
        if n == want or n < CHUNK:
            # the common case: one claim, build the list directly (references are stolen)
            out = PyList_New(<Py_ssize_t>n)
            for i in range(n):
                # the queue's reference moves into the list (SET_ITEM steals it)
                _list_set_item(out, <Py_ssize_t>i, <PyObject *><uintptr_t>buf[i])
            return out
        out = []
        while True:
            for i in range(n):
                out.append(q_steal(buf[i]))
            got += n
            if got == want or n < CHUNK:
                return out
            r = aop_mpmc_pop_many_(self.q, buf, min(want - got, <uint64_t>CHUNK), &n)
            if r != AOP_Q_OK:
                return out

    def qsize(self):
        """Approximate number of items (exact when no other thread is using the queue)."""
        return aop_mpmc_size(self.q)

    def __len__(self):
        return aop_mpmc_size(self.q)

    def empty(self):
        """True if the queue looks empty (approximate while other threads run)."""
        return aop_mpmc_size(self.q) == 0

    def full(self):
        """True if the queue looks full (approximate while other threads run)."""
        return aop_mpmc_size(self.q) >= self.q.cap

    def close(self):
        """Close: put* raise Closed from now on; get* drain what is left, then raise Closed.
        Every blocked put/get wakes up.  Idempotent."""
        aop_mpmc_close(self.q)

    def __repr__(self):
        return (f"<aoprim.MPMCQueue capacity={self.q.cap} size={aop_mpmc_size(self.q)}"
                f"{' closed' if aop_mpmc_closed(self.q) else ''} at {id(self):#x}>")
