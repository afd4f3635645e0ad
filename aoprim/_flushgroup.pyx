# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""FlushGroup: flush every dirty SendBatch once per loop iteration, one GIL release for all.

A module of its own beside _sendbatch.pyx; it drives the batches' internals through
aoprim/_sendbatch.pxd.  The design notes follow.
"""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memmove
from libc.errno cimport EINTR, ENOTSOCK, EBADF
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF

from aoprim.atomic_h cimport (
    aop_store_i64, aop_exchange_u32, aop_store_u32, AOP_RELAXED, AOP_ACQUIRE,
    AOP_RELEASE, aop_spin_init, aop_spin_lock, aop_spin_unlock,
)
from aoprim._sendbatch cimport (
    SendBatch, _GroupBase, aop_sb_owner, aop_sb_would_block, SB_COPY, SB_BYTES,
    _get, _add, _claim, _unclaim, _raise_busy, _release_owner, _positive, _sock_pin,
    _sock_unpin, _sock_closing,
)
cdef extern from "<sys/socket.h>" nogil:
    enum: MSG_DONTWAIT
cdef extern from *:
    """
    #ifdef Py_GIL_DISABLED
    #define AOP_FG_GIL_BUILD 0
    #else
    #define AOP_FG_GIL_BUILD 1
    #endif
    """
    # 1 when this build has a GIL (3.11, 3.12, a default 3.13): see the lone write below
    const bint AOP_FG_GIL_BUILD
from aoprim._sockfd cimport (
    aop_sockfd_fast, aop_sockfd_fd, aop_sockfd_nonblocking, sockfd_setup,
)
cimport cython

import socket as _socket

sockfd_setup()      # the fd / timeout read from the socket's struct, layout checked here
# =========================================================================================
# FlushGroup: flush every dirty batch once per loop iteration, one GIL release for all
# =========================================================================================
#
# A batch attached to a group (attach(b, owner)) queues itself there when an add leaves it
# with pending data and it is not queued yet: O(1), in C, no Python call.  flush() then:
#
#   A  (GIL held, no Python code runs)  take the whole queue (swap q and w under qlock),
#      claim each batch (`busy`), mark it unqueued, take its owner, pin its socket (a
#      close() from any thread is deferred until C, so its number cannot be reused under
#      B's write), then read its fd;
#   B  (GIL released ONCE -- or not at all when exactly one batch is to be written and its
#      socket is non-blocking now: that write uses MSG_DONTWAIT)  write every batch: one
#      system call each (more only beyond
#      IOV_MAX segments), up to `budget` bytes; the owners of fully written segments
#      (bytes, exports, slots) are moved out of the batch into `rel`, so the batch is
#      committed and may go on writing without the GIL;
#   C  (GIL held)  compute each status, unclaim each batch, unpin the sockets (a deferred
#      close() runs there), and only then release `rel` (with the unpins, the place
#      arbitrary Python code runs: a slot's release(), a __del__) and build
#      the report.  No system call follows: the rule -- never write to an fd number
#      read before a GIL re-acquisition -- holds because the fds are read in A, with no
#      Python code between the first read and the writes (fileno() is socket.socket's own C
#      method, and an int object is not a GC allocation, so no collection can run either).
#
# Invariants (whoever holds a batch's `busy` may rely on them for that batch):
#   G1  b.group is g and b.queued  =>  g holds exactly one entry for b: in q, or in the w of
#       a running flush.  (Entries for batches that are no longer queued in g -- detached,
#       cleared by the GC -- may linger: a flush drops them.)
#   G2  q[0:qlen] and the arrays' growth are touched only under qlock, which is never held
#       across a Python call or a DECREF (habit 6); w, rel, serial, rot only by the thread
#       inside flush() (`flushing`).
#   G3  an entry's reference is owned by the array holding it; moving an entry moves it.
#
# Threads: a group is meant for one thread (the event loop).  flush() refuses a second
# entry (another thread, or a release callback calling it again) with RuntimeError.  Adding
# to attached batches from other threads is memory-safe -- queueing is under qlock -- but a
# batch being flushed is busy like any SendBatch (RuntimeError / -EBUSY for the adder), and
# a batch another thread holds when the flush claims it is put back in the queue, untouched.
#
# GC: group <-> batch <-> owner (a session) form cycles.  The group is @no_gc_clear: the GC
# never clears it, so its queue stays valid until __dealloc__, and its tp_traverse (patched
# in below) visits the queued batches so such cycles are found.  The GC breaks them by
# clearing the batches instead (Cython's tp_clear: sock, group, owner -> None); a cleared
# batch reads as a closed socket (flush: EBADF; group: status -EBADF), never queues itself
# again, and releases what it still holds (slots...) in __dealloc__.  The group's __dealloc__
# drops its queue entries, marking those batches unqueued.

cdef enum:
    FG_DROP = 0      # entry dropped at the end (stale or duplicate): its reference released
    FG_MOVED = 1     # entry put back in the live queue (its reference went with it)
    FG_HELD = 2      # batch claimed, nothing to write (or no fd): reported per its status
    FG_WRITE = 3     # batch claimed, fd read: written in the GIL-free pass

cdef Py_ssize_t FG_INIT = 64           # initial queue / work array length
cdef Py_ssize_t FG_KEEP = 4096         # an emptied array longer than this shrinks back
cdef Py_ssize_t REL_INIT = 64
cdef Py_ssize_t REL_KEEP = 4096


cdef int _fd_of(SendBatch b) noexcept:
    """The fd a group flush writes to, or -1 (closed socket, cleared or uninitialised
    batch).  Runs no Python code (see _sock_fd): a socket's fd is read from its struct
    (aop_sockfd.h: what socket.socket's C fileno() returns, without the call and its int)."""
    if not b.has_sock:
        return b.fd
    if b.sock is not None and b.sock_fileno is not None and aop_sockfd_fast(b.sock):
        return aop_sockfd_fd(b.sock)
    try:
        return b._sock_fd()
    except BaseException:
        return -1


cdef void _fg_write(FlushGroup g, SendBatch b, aop_fg_item *it) noexcept nogil:
    """Pass B for one claimed batch (no GIL): write until drained, a short write, would
    block, an error, or `budget` bytes.  Owners of sent segments go to g.rel."""
    cdef Py_ssize_t written = 0
    cdef Py_ssize_t old
    cdef Py_ssize_t h
    cdef ssize_t r
    cdef size_t offered = 0
    cdef int fd = it.fd
    _add(&g.st_batches, 1)
    while b.head < b.nseg:
        if written >= g.budget:
            _add(&g.st_budget, 1)
            break
        r = b._write_once(fd, &offered)
        _add(&b.st_syscalls, 1)
        _add(&g.st_syscalls, 1)
        if r < 0:
            if r == -EINTR:
                continue
            if aop_sb_would_block(<int>-r):
                _add(&b.st_wouldblock, 1)
                break
            if r == -ENOTSOCK and b.is_sock and not b.has_sock:
                b.is_sock = False             # an int fd that is a pipe/file: writev now
                continue
            it.status = <int>r                # pending data intact
            break
        old = b.head
        h = b._advance(<size_t>r)
        written += r
        _add(&g.st_bytes, <int64_t>r)
        if b._range_owned(old, h) and g._take_owners(b, old, h) < 0:
            # out of memory for rel: [old, h) stays uncommitted until pass C (GIL held)
            it.rel_a = old
            it.rel_b = h
            break
        b._commit_head(h)
        if <size_t>r < offered:
            _add(&b.st_partial, 1)
            break


# _fg_write called through a pointer taking void *: the batch comes from a PyObject * in
# the work array, and Cython cannot cast that to SendBatch without the GIL (it would count
# a reference).  Same ABI: a cdef function's extension-type argument is a struct pointer.
ctypedef void (*_fg_write_t)(void *g, void *b, aop_fg_item *it) noexcept nogil
cdef _fg_write_t _fg_write_p = <_fg_write_t>_fg_write


cdef object _sock_gettimeout = _socket.socket.gettimeout   # the C method: no override runs


cdef inline bint _nonblocking_now(SendBatch b) noexcept:
    """b's socket is non-blocking NOW (re-read, not trusted from attach: it may have been
    switched to blocking since, and a blocking write with the GIL held would stall every
    thread).  Runs no Python code: the timeout field of the socket's struct (aop_sockfd.h),
    or socket.socket's own C gettimeout (its float result is not a GC allocation) where that
    layout check failed."""
    if not b.nonblocking or not b.has_sock or b.sock is None:
        return False
    if aop_sockfd_fast(b.sock):
        return aop_sockfd_nonblocking(b.sock)    # its struct's timeout (aop_sockfd.h): 0
    try:
        return _sock_gettimeout(b.sock) == 0.0
    except BaseException:
        return False


cdef inline bint _lone_nonblocking(aop_fg_item *w, Py_ssize_t n) noexcept:
    """The one entry to write (pass A found exactly one) targets a socket that is
    non-blocking NOW (re-read here, not trusted from attach: it may have been switched to
    blocking since).  Runs no Python code (socket.socket's own C
    gettimeout).  The write then also uses MSG_DONTWAIT, so it cannot block even if the
    mode changes after this check (another thread, free-threaded build)."""
    cdef Py_ssize_t i
    cdef SendBatch b
    for i in range(n):
        if w[i].kind == FG_WRITE:
            b = <SendBatch>w[i].batch
            return _nonblocking_now(b)
    return False


@cython.no_gc_clear
cdef class FlushGroup(_GroupBase):
    """FlushGroup(budget=262144)

    Flushes every dirty SendBatch once per loop iteration with at most one GIL release.
    ``attach(b, owner)`` makes ``b`` queue itself here whenever an add leaves it with pending
    data; ``flush()`` writes every queued batch (one system call each) and returns None, or
    a list of ``(owner, status)`` for the batches that need attention: 1 = data still pending
    (would block, short write, or ``budget`` bytes written this flush; NOT queued again: arm
    write interest or call ``requeue``), -errno = the write failed (data intact, not queued),
    0 = all sent but the batch is watched (``b.watch = True``).

    A group belongs to one thread (the event loop): flush() refuses a concurrent or
    reentrant call with RuntimeError.  Adding to attached batches from other threads is
    safe (queueing is locked), but a batch being flushed is busy like any SendBatch.

    Closing from another thread: flush() pins every socket it writes before reading its
    fd and unpins it after the GIL-free pass, so a ``socket.close()`` meanwhile is deferred
    until then (that batch reports -EBADF if the close came before the pin); no batch's
    bytes can reach a socket that reuses a closed number.  Not covered: ``os.close`` /
    ``detach()`` of a socket's number during a flush, and int-fd targets.  A batch written
    alone (no GIL release) must be non-blocking at that moment and is written with
    MSG_DONTWAIT; otherwise the GIL is released for its write.
    """

    def __cinit__(self):
        self.budget = 256 << 10
        aop_spin_init(&self.qlock)
        self.q = <aop_fg_item *>malloc(FG_INIT * sizeof(aop_fg_item))
        self.w = <aop_fg_item *>malloc(FG_INIT * sizeof(aop_fg_item))
        self.rel = <aop_sb_owner *>malloc(REL_INIT * sizeof(aop_sb_owner))
        if self.q == NULL or self.w == NULL or self.rel == NULL:
            raise MemoryError()
        self.qcap = FG_INIT
        self.wcap = FG_INIT
        self.relcap = REL_INIT

    def __init__(self, budget=256 << 10):
        self.budget = _positive(budget, "budget")

    def __dealloc__(self):
        cdef aop_fg_item *q = self.q
        cdef Py_ssize_t n = self.qlen
        cdef Py_ssize_t i
        cdef SendBatch b
        self.q = NULL
        self.qlen = self.qcap = 0
        if q != NULL:
            for i in range(n):
                b = <SendBatch>q[i].batch
                if _claim(b):
                    # a batch still attached here would keep the group alive; so it was
                    # cleared by the GC (group None) or detached without its entry
                    if b.group is None or b.group is self:
                        b.queued = False
                    _unclaim(b)
                b = None
                Py_DECREF(<object>q[i].batch)
            free(q)
        free(self.w)
        self.w = NULL
        if self.rel != NULL:
            for i in range(self.nrel):       # empty outside a flush
                _release_owner(&self.rel[i])
            free(self.rel)
            self.rel = NULL

    # ---- the live queue (qlock) --------------------------------------------------------

    cdef int _push(self, PyObject *b) noexcept:
        """Append an entry, taking over the reference b.  0, or -1 (no memory: nothing
        taken)."""
        cdef aop_fg_item *nq
        cdef Py_ssize_t cap
        aop_spin_lock(&self.qlock)
        if self.qlen == self.qcap:
            cap = self.qcap * 2
            nq = <aop_fg_item *>realloc(self.q, cap * sizeof(aop_fg_item))
            if nq == NULL:
                aop_spin_unlock(&self.qlock)
                return -1
            self.q = nq
            self.qcap = cap
        self.q[self.qlen].batch = b
        self.qlen += 1
        if self.qlen > _get(&self.st_high):
            aop_store_i64(&self.st_high, self.qlen, AOP_RELAXED)   # relaxed: a statistic
        aop_spin_unlock(&self.qlock)
        return 0

    cdef int _queue(self, SendBatch b) noexcept:
        """Queue b (GIL held, b's busy held by the caller, b not queued).  0 or -1."""
        Py_INCREF(b)        # before publishing: a flush on another thread may take it at once
        if self._push(<PyObject *>b) < 0:
            Py_DECREF(b)    # never the last reference: the caller holds b
            return -1
        b.queued = True
        return 0

    cdef PyObject *_unqueue(self, SendBatch b) noexcept:
        """Remove b's entry from the live queue (order kept); returns its reference for the
        caller to drop after unlocking, or NULL when it is not there."""
        cdef Py_ssize_t i
        cdef PyObject *p = NULL
        aop_spin_lock(&self.qlock)
        for i in range(self.qlen):
            if self.q[i].batch == <PyObject *>b:
                p = self.q[i].batch
                memmove(self.q + i, self.q + i + 1,
                        (self.qlen - i - 1) * sizeof(aop_fg_item))
                self.qlen -= 1
                break
        aop_spin_unlock(&self.qlock)
        return p

    # ---- the flush -----------------------------------------------------------------------

    cdef int _take_owners(self, SendBatch b, Py_ssize_t a, Py_ssize_t e) noexcept nogil:
        """Move the owners of b's fully written segments [a, e) to rel (no GIL needed: a
        Py_buffer taken with PyBUF_SIMPLE moves by value).  0, or -1 on ENOMEM (nothing
        moved)."""
        cdef Py_ssize_t k
        cdef Py_ssize_t need = 0
        cdef Py_ssize_t cap
        cdef aop_sb_owner *nr
        for k in range(a, e):
            if b.own[k].kind >= SB_BYTES:
                need += 1
        if self.nrel + need > self.relcap:
            cap = self.relcap * 2
            while cap < self.nrel + need:
                cap *= 2
            nr = <aop_sb_owner *>realloc(self.rel, cap * sizeof(aop_sb_owner))
            if nr == NULL:
                return -1
            self.rel = nr
            self.relcap = cap
        for k in range(a, e):
            if b.own[k].kind >= SB_BYTES:
                memcpy(&self.rel[self.nrel], &b.own[k], sizeof(aop_sb_owner))
                self.nrel += 1
                b.own[k].kind = SB_COPY
                b.own[k].obj = NULL
        return 0

    cdef void _release_taken(self) noexcept:
        """Pass C: release the owners moved out of the batches (GIL held, every batch
        already unclaimed and consistent, so a release callback may use them)."""
        cdef Py_ssize_t k = 0
        cdef aop_sb_owner *nr
        while k < self.nrel:          # rel cannot grow meanwhile: only a flush appends
            _release_owner(&self.rel[k])
            k += 1
        self.nrel = 0
        if self.relcap > REL_KEEP:
            nr = <aop_sb_owner *>realloc(self.rel, REL_INIT * sizeof(aop_sb_owner))
            if nr != NULL:
                self.rel = nr
                self.relcap = REL_INIT

    cdef object c_flush_all(self):
        if aop_exchange_u32(&self.flushing, 1, AOP_ACQUIRE) != 0:
            # acquire: pairs with the release store below by the previous flusher
            raise RuntimeError("FlushGroup.flush() is already running (another thread, or "
                               "a callback inside it): a group belongs to one thread")
        try:
            return self._flush_all()
        finally:
            aop_store_u32(&self.flushing, 0, AOP_RELEASE)

    cdef object _flush_all(self):
        cdef Py_ssize_t n
        cdef Py_ssize_t i
        cdef Py_ssize_t k
        cdef Py_ssize_t start
        cdef Py_ssize_t nwrite = 0
        cdef Py_ssize_t tcap
        cdef aop_fg_item *it
        cdef aop_fg_item *tmp
        cdef SendBatch b
        cdef uint64_t serial
        cdef int fd
        cdef int pr
        cdef bint lone = False
        cdef list out = None
        cdef PyObject *p
        _add(&self.st_flushes, 1)

        # ---- A: take the queue (the array that becomes live can hold every put-back) --
        aop_spin_lock(&self.qlock)
        n = self.qlen
        if n == 0:
            aop_spin_unlock(&self.qlock)
            return None
        if self.wcap < n:
            tmp = <aop_fg_item *>realloc(self.w, self.qcap * sizeof(aop_fg_item))
            if tmp == NULL:
                aop_spin_unlock(&self.qlock)
                raise MemoryError()
            self.w = tmp
            self.wcap = self.qcap
        tmp = self.w
        self.w = self.q
        self.q = tmp
        tcap = self.wcap
        self.wcap = self.qcap
        self.qcap = tcap
        self.qlen = 0
        aop_spin_unlock(&self.qlock)

        self.serial += 1
        serial = self.serial
        start = <Py_ssize_t>(self.rot % <size_t>n)     # fairness: rotate the first batch
        self.rot += 1
        for i in range(n):
            k = i + start
            if k >= n:
                k -= n
            it = &self.w[k]
            it.owner = NULL
            it.fd = -1
            it.status = 0
            it.watch = False
            it.sock = NULL
            it.rel_a = it.rel_b = 0
            b = <SendBatch>it.batch
            if not _claim(b):
                if b.flush_mark == serial:
                    it.kind = FG_DROP        # a second entry for a batch this flush holds
                elif self._push(it.batch) == 0:
                    it.kind = FG_MOVED       # another thread is inside it: keep it queued
                    _add(&self.st_busy, 1)
                else:
                    # only reachable on a free-threaded build, out of memory, with adders on
                    # other threads growing the queue meanwhile: the entry is lost and the
                    # batch stays marked queued until detach() (documented, not silent)
                    it.kind = FG_DROP
                    _add(&self.st_busy, 1)
                continue
            b.flush_mark = serial            # written by flushers only (under `flushing`)
            if b.group is not self or not b.queued:
                _unclaim(b)                  # a stale entry (G1): drop it
                it.kind = FG_DROP
                continue
            b.queued = False
            it.owner = <PyObject *>b.owner
            Py_INCREF(b.owner)
            it.watch = b.watched
            it.kind = FG_HELD
            if b.head == b.nseg:
                continue                     # flushed or cleared since it was queued
            if (AOP_FG_GIL_BUILD and n == 1 and b.has_sock and b.sock is not None
                    and _nonblocking_now(b)):
                # the lone write (pass B below: GIL held, MSG_DONTWAIT) needs no pin: from
                # this fd read to its write the GIL is never released and no Python code
                # runs, so no close() can land in between, and close() clears the socket's
                # fd (fileno() -1) before it releases the GIL for the close(2) -- the number
                # read here is this socket's, open, at the write.  `_closed` set (close()
                # called while another holder -- a makefile() file, a pin -- keeps the fd
                # open) reads as closed, as a pin would report it.  Not on a free-threaded
                # build: there other threads run meanwhile, so the pin is taken.
                lone = True
                fd = -1 if _sock_closing(b.sock) else _fd_of(b)
            elif b.has_sock and b.sock is not None:
                # pin before the fd is read: a close() from any thread is deferred until
                # pass C, so the number cannot be reused under pass B's write
                try:
                    pr = _sock_pin(b.sock)
                except BaseException:
                    pr = -1                  # not pinnable (_io_refs unset or not an int):
                                             # nothing taken, treated as closed
                if pr >= 0:
                    it.sock = <PyObject *>b.sock     # pinned (also when closing): pass C
                    Py_INCREF(b.sock)                # unpins it, and only then
                fd = _fd_of(b) if pr > 0 else -1
            else:
                fd = _fd_of(b)
            if fd < 0:
                it.status = -EBADF           # the socket is closed: data intact
                continue
            it.fd = fd
            it.kind = FG_WRITE
            nwrite += 1
        b = None

        # ---- B: every system call, the GIL released once ----------------------------------
        if nwrite == 1 and (lone or _lone_nonblocking(self.w, n)):
            # one write to a non-blocking socket: it cannot block, and releasing and
            # re-taking the GIL would cost about as much as the syscall's user-space work
            for i in range(n):
                if self.w[i].kind == FG_WRITE:
                    b = <SendBatch>self.w[i].batch
                    b.wflags = MSG_DONTWAIT      # never block with the GIL held
                    _fg_write_p(<void *>self, <void *>self.w[i].batch, &self.w[i])
                    b.wflags = 0
                    b = None
        elif nwrite:
            _add(&self.st_gil, 1)
            with nogil:
                for i in range(n):
                    k = i + start
                    if k >= n:
                        k -= n
                    if self.w[k].kind == FG_WRITE:
                        _fg_write_p(<void *>self, <void *>self.w[k].batch, &self.w[k])

        # ---- C: statuses, unclaim, then release the sent objects, report ----------------
        for i in range(n):
            it = &self.w[i]
            if it.kind < FG_HELD:
                continue
            b = <SendBatch>it.batch
            if it.rel_b > it.rel_a:
                if self._take_owners(b, it.rel_a, it.rel_b) < 0:
                    b._release_range(it.rel_a, it.rel_b)    # no memory at all: release here
                b._commit_head(it.rel_b)
            if it.status >= 0:
                it.status = 1 if b.head < b.nseg else 0
            if it.status > 0:
                _add(&self.st_pending, 1)
            elif it.status < 0:
                _add(&self.st_errors, 1)
            _unclaim(b)
        b = None
        try:
            for i in range(n):
                it = &self.w[i]
                p = it.sock
                if p != NULL:
                    it.sock = NULL
                    _sock_unpin(<object>p)      # a deferred close() happens here
                    Py_DECREF(<object>p)
            self._release_taken()
            for i in range(n):
                k = i + start
                if k >= n:
                    k -= n
                it = &self.w[k]
                if it.kind >= FG_HELD and (it.status != 0 or it.watch):
                    if out is None:
                        out = []
                    out.append((<object>it.owner, it.status))
        finally:
            # drop the work array's references (each DECREF may run code: the entry is
            # cleared first; a callback cannot reach w, flush() being refused meanwhile)
            for i in range(n):
                it = &self.w[i]
                p = it.owner
                it.owner = NULL
                if p != NULL:
                    Py_DECREF(<object>p)
                p = it.batch
                it.batch = NULL
                if it.kind != FG_MOVED:
                    Py_DECREF(<object>p)
            # large and empty: both arrays shrink back (w now; q too if nothing was queued
            # meanwhile -- it was grown to hold the put-backs)
            if self.wcap > FG_KEEP:
                tmp = <aop_fg_item *>realloc(self.w, FG_INIT * sizeof(aop_fg_item))
                if tmp != NULL:
                    self.w = tmp
                    self.wcap = FG_INIT
            aop_spin_lock(&self.qlock)
            if self.qlen == 0 and self.qcap > FG_KEEP:
                tmp = <aop_fg_item *>realloc(self.q, FG_INIT * sizeof(aop_fg_item))
                if tmp != NULL:
                    self.q = tmp
                    self.qcap = FG_INIT
            aop_spin_unlock(&self.qlock)
        return out

    # ---- Python API ---------------------------------------------------------------------

    def attach(self, SendBatch b not None, owner=None):
        """Attach ``b``: from now on an add that leaves it with pending data queues it here
        (data already pending queues it now).  ``owner`` (kept by strong reference) is what
        flush() reports for it.  Re-attaching to the same group replaces the owner; a batch
        attached to another group raises ValueError."""
        cdef object old = None
        if not _claim(b):
            _raise_busy()
        try:
            if b.group is not None and b.group is not self:
                raise ValueError("this SendBatch is attached to another FlushGroup "
                                 "(detach it first)")
            if b.group is None:
                b.queued = False             # a batch cleared by the GC left its flag
            old = b.owner                    # dropped after the claim: may run __del__
            b.owner = owner
            b.group = self
            # a first filter for pass B's GIL-held single write: a socket blocking now
            # never takes it; a non-blocking one is re-checked at write time
            # (_lone_nonblocking), as its mode may change after attach
            b.nonblocking = b.has_sock and b.sock.gettimeout() == 0.0
            if not b.queued and b.head < b.nseg:
                if self._queue(b) < 0:
                    raise MemoryError()
        finally:
            _unclaim(b)

    def detach(self, SendBatch b not None):
        """Detach ``b`` (it leaves the queue, its owner is dropped).  Idempotent: returns
        False when ``b`` was not attached to this group."""
        cdef object old_owner = None
        cdef object old_group = None
        cdef PyObject *entry = NULL
        if not _claim(b):
            _raise_busy()
        try:
            if b.group is not self:
                return False
            if b.queued:
                entry = self._unqueue(b)     # NULL: in a running flush's hands (G1 stale)
                b.queued = False
            old_owner = b.owner
            old_group = b.group
            b.owner = None
            b.group = None
        finally:
            _unclaim(b)
        if entry != NULL:
            Py_DECREF(<object>entry)
        return True

    cdef int c_requeue(self, SendBatch b) except -1:
        cdef int r = 0
        if not _claim(b):
            _raise_busy()
        try:
            if b.group is not self:
                raise ValueError("this SendBatch is not attached to this FlushGroup")
            if not b.queued:
                if self._queue(b) < 0:
                    raise MemoryError()
                r = 1
        finally:
            _unclaim(b)
        return r

    def requeue(self, SendBatch b not None):
        """Queue ``b`` for the next flush (after a status 1, say).  Returns False when it
        was queued already."""
        return self.c_requeue(b) == 1

    def flush(self):
        """Flush every queued batch: all system calls with the GIL released at most once
        (not at all when one batch is written, to a non-blocking socket).  Returns
        None when nothing needs attention, else a list of (owner, status) in flush order:
        1 = data still pending, -errno = the write failed, 0 = all sent (watched batch).

        With ``notify`` set, flush() calls ``notify(owner, status)`` for each of them instead
        and returns None -- so a bound ``group.flush`` can be an event loop's per-iteration
        hook with no Python frame of its own.  Every entry is notified even if one call
        raises; the first exception is re-raised afterwards."""
        cdef object res = self.c_flush_all()
        cdef object cb = self.notify
        cdef object first = None
        if res is None or cb is None:
            return res
        for owner, status in <list>res:
            try:
                cb(owner, status)
            except BaseException as e:
                if first is None:
                    first = e
        if first is not None:
            raise first
        return None

    def __len__(self):
        cdef Py_ssize_t n
        aop_spin_lock(&self.qlock)
        n = self.qlen
        aop_spin_unlock(&self.qlock)
        return n

    @property
    def stats(self):
        """Counters since creation: flushes, batches_flushed (batches written to), syscalls,
        bytes, gil_releases, pending (reports of status 1), budget_stops, errors, busy
        (entries put back: another thread held the batch), queue_high_water."""
        return {
            "flushes": _get(&self.st_flushes),
            "batches_flushed": _get(&self.st_batches),
            "syscalls": _get(&self.st_syscalls),
            "bytes": _get(&self.st_bytes),
            "gil_releases": _get(&self.st_gil),
            "pending": _get(&self.st_pending),
            "budget_stops": _get(&self.st_budget),
            "errors": _get(&self.st_errors),
            "busy": _get(&self.st_busy),
            "queue_high_water": _get(&self.st_high),
        }

    @property
    def _capacity(self):
        """Test hook: (queue entries, work entries, rel entries) allocated."""
        return (self.qcap, self.wcap, self.relcap)

    def __repr__(self):
        return f"<aoprim.FlushGroup queued={len(self)} budget={self.budget}>"


# ---- FlushGroup's tp_traverse also visits its queue ---------------------------------------
# Cython generates traverse only for object fields; the queue is a C array of strong
# references, so the module extends the generated function.  Read without qlock: the GC
# runs with the GIL held (queue changes need it on a GIL build) or with the world stopped.

ctypedef int (*_visitproc)(PyObject *, void *) noexcept
ctypedef int (*_traverseproc)(PyObject *, _visitproc, void *) noexcept

cdef extern from "Python.h":
    ctypedef struct _TypeSlots "PyTypeObject":
        _traverseproc tp_traverse
        unsigned long tp_flags
    unsigned long Py_TPFLAGS_HAVE_GC

cdef _traverseproc _fg_base_traverse = NULL


cdef int _fg_traverse(FlushGroup g, _visitproc visit, void *arg) noexcept:
    cdef Py_ssize_t i
    cdef int r
    if _fg_base_traverse != NULL:
        r = _fg_base_traverse(<PyObject *>g, visit, arg)
        if r:
            return r
    for i in range(g.qlen):
        r = visit(g.q[i].batch, arg)
        if r:
            return r
    return 0


cdef _TypeSlots *_fg_type = <_TypeSlots *>FlushGroup
if not (_fg_type.tp_flags & Py_TPFLAGS_HAVE_GC):
    raise ImportError("aoprim._flushgroup: FlushGroup was built without GC support")
_fg_base_traverse = _fg_type.tp_traverse
_fg_type.tp_traverse = <_traverseproc>_fg_traverse


def _sock_view(sock):
    """Test hook: (read from the struct, fd, non-blocking) as a flush reads them for
    ``sock`` -- the struct's fields when the layout check passed and ``sock`` is a
    ``_socket.socket``, else None for both."""
    if not aop_sockfd_fast(sock):
        return (False, None, None)
    return (True, aop_sockfd_fd(sock), aop_sockfd_nonblocking(sock))
