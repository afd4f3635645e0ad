# cython: language_level=3, freethreading_compatible=True
"""The server's per-message TLS path, compiled: ``TLSConn`` and ``TLSFlush``.

``aoprim.server.tls`` owns the TLS policy -- the handshake, ``close_notify``, timeouts,
errors and what they close -- in Python; what runs once per message is here, without a
Python frame (as uvloop's sslproto is Cython over the same ``ssl`` objects):

- **Receive.** A ``TLSConn`` is its Receiver's compiled ``source`` (``_RxSource``: the
  Receiver calls ``c_read`` with the receive slot's free room, no memoryview made for it
  and no Python call).  ``c_read`` decrypts into that room with the ``SSLObject``'s C-level
  ``read(n, buffer)`` (``ssl.SSLObject._sslobj``, the ``_ssl`` object every
  ``SSLObject`` method forwards to); when OpenSSL holds nothing it first pulls ciphertext
  with one ``recv`` (MSG_DONTWAIT) into the server's shared scratch and hands it to the
  incoming ``MemoryBIO``.  No second ``recv`` in a readiness event after a short one (the
  socket is empty then).  The ciphertext's record boundaries are followed (``rec_begun``:
  a begun record is a begun frame for the frame clock).  ``on_readable`` is the session's
  read callback once the handshake is done.  A read that meets the end of the stream after
  data (the peer's ``close_notify`` or a fatal alert in the same ciphertext as its last
  records) returns the data; the end, which no readiness event will announce (the socket
  is empty), is read again by ``on_readable`` in the same call.
- **Send.** ``TLSFlush.flush`` is the loop's iteration hook: for each session marked dirty
  (``mark``), ``c_flush`` sends the ciphertext still owed, and only once it all left encrypts
  the batch's pending plaintext segment by segment (``SendBatch.c_peek``/``c_consume``: a
  run of coalesced small frames is one segment, so one ``write`` and one record per 16 KiB;
  a large payload is encrypted from its own memory) up to ``budget`` plaintext bytes, reads
  the outgoing BIO once and sends it with one ``send`` (MSG_DONTWAIT | MSG_NOSIGNAL).  The
  session's Python (its wire's ``_tls_flushed``) runs only when the status is not 0 (would block, the
  budget used up, an error) or the batch is watched (closing, back-pressure, write limits);
  an exception goes to the wire's ``_tls_failed``.
- **Counting.** ``pending`` is the ciphertext taken from the BIO and not yet sent (an atomic,
  read from any thread: ``max_pending`` counts it with the plaintext not yet encrypted);
  ``TLSFlush.sends`` / ``bytes_out`` the sends of ciphertext and their bytes.

Threads: everything but ``pending``, ``send_frame`` and ``send_copy`` runs on the loop
thread (the session's Python marks a session dirty there only).  ``pending`` is an atomic.
``send_frame``/``send_copy`` may be called from any thread (Session.send): there the batch,
limited to the loop thread, refuses the add (-1) and nothing is marked; what they read of
the connection itself is the batch's bound add method, which close() on the loop thread
drops -- so both read it, and close() drops every field, inside a critical section on the
connection (a per-object lock on a free-threaded build, nothing with the GIL): a plain load
then INCREF racing with close()'s DECREF could free it under the caller.  The receive side
runs inside its Receiver's burst, under the Receiver's one-owner claim (aoprim.server._receiver),
which also refuses a second thread calling on_readable().

GC: a ``TLSConn`` and its session reference each other until ``close()`` (the session's
teardown) drops every reference it holds.  A GC clear that reaches a ``TLSConn`` first sets
its object fields to None: every entry point checks for that (``_gone``) and then acts as
closed (``c_read`` reports EOF, ``c_flush`` and ``on_readable`` do nothing).
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.buffer cimport PyBuffer_FillInfo
from cpython.memoryview cimport PyMemoryView_GET_BUFFER
from libc.stdint cimport int64_t
from libc.errno cimport errno, EAGAIN, EINTR, EPROTO, EBADF

from aoprim.server._receiver cimport Receiver, _RxSource
from aoprim._sendbatch cimport SendBatch, _get
from aoprim.atomic_h cimport aop_atomic_i64, aop_load_i64, aop_store_i64, AOP_RELAXED

import ssl

cdef extern from "<errno.h>":
    int EWOULDBLOCK

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL

cdef object _WantRead = ssl.SSLWantReadError
cdef object _ZeroReturn = ssl.SSLZeroReturnError
cdef object _EOFError = ssl.SSLEOFError
cdef object _SSLError = ssl.SSLError

cdef Py_ssize_t SCRATCH = 1 << 16      # ciphertext read per recv (a few records)


cdef inline void _set(aop_atomic_i64 *a, int64_t v) noexcept nogil:
    # relaxed store: written by the loop thread only; other threads read it (relaxed) as an
    # approximate figure (max_pending's check), and no other memory is published through it
    aop_store_i64(a, v, AOP_RELAXED)


@cython.final
cdef class _Window:
    """A buffer over memory of ours (the receive slot, the send batch, the scratch), pointed
    anew before each call into ``_ssl`` / ``MemoryBIO`` instead of a new memoryview per
    call.  Valid only during that call (those calls release their buffer before they
    return); never re-pointed while an export of it lives (``_point`` checks)."""

    def __getbuffer__(self, Py_buffer *b, int flags):
        PyBuffer_FillInfo(b, self, self.ptr, self.len, not self.writable, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *b):
        self.exports -= 1


cdef inline _Window _point(_Window w, char *p, Py_ssize_t n, bint writable):
    if w.exports:
        raise BufferError("TLS window still exported")
    w.ptr = p
    w.len = n
    w.writable = writable
    return w


cdef class TLSFlush:
    """The per-iteration flush of a TLS server (one per server, loop thread): every dirty
    session's batch encrypted and sent.  ``scratch``: the ciphertext ``recv`` buffer all its
    sessions share (one thread); never resized."""

    def __cinit__(self):
        self.dirty = []
        self.spare = []
        self.win = _Window()
        self.scratch = bytearray(SCRATCH)
        self.sptr = PyByteArray_AS_STRING(self.scratch)

    def __len__(self):
        """Sessions marked dirty and not flushed yet (loop thread)."""
        return len(self.dirty)

    @property
    def sends(self):
        # relaxed: a counter read for stats()
        return aop_load_i64(&self.nsends, AOP_RELAXED)

    @property
    def bytes_out(self):
        # relaxed: a counter read for stats()
        return aop_load_i64(&self.nbytes, AOP_RELAXED)

    def flush(self):
        """The iteration hook: c_flush each dirty session; its Python only for a status,
        a watched batch or an exception."""
        cdef list d = self.dirty
        cdef TLSConn c
        cdef Py_ssize_t status
        if not d:
            return
        # marks made during this flush go to the other list (no list made per flush)
        self.dirty = self.spare if self.spare is not None else []   # ([]: a nested flush)
        self.spare = None
        try:
            self._flush(d)
        finally:
            del d[:]
            self.spare = d

    cdef int _flush(self, list d) except -1:
        # every entry is flushed even if a session's Python raises (its write-limit callback,
        # say); the first exception is re-raised afterwards (as FlushGroup.flush does): left
        # to escape, it dropped the entries after it while they stayed marked dirty, and
        # those sessions were never flushed again
        cdef TLSConn c
        cdef Py_ssize_t status
        cdef object first = None
        for o in d:
            c = <TLSConn>o
            c.dirty = False
            if c._gone():
                continue
            try:
                try:
                    status = c.c_flush()
                except Exception as e:  # this session's failure must not stop the others
                    if not c._gone():
                        c.sess._tls_failed(e)
                    continue
                if (status or c.batch.watched) and not c._gone():
                    c.sess._tls_flushed(status)
            except BaseException as e:
                if first is None:
                    first = e
        if first is not None:
            raise first
        return 0


cdef inline bint _byref(TLSConn c, data) noexcept:
    # a memoryview of at least byref_min bytes: the session's own (by-reference) send path
    return (c.byref_min >= 0 and type(data) is memoryview and
            PyMemoryView_GET_BUFFER(data).len >= c.byref_min)


cdef inline object _added(TLSConn c, object p):
    # the batch's add returned p: mark the session dirty when it added (p >= 0)
    if p >= 0:
        c._mark()
    return p


cdef class TLSConn(_RxSource):
    """One TLS session's per-message work (see the module docstring):
    ``TLSConn(tls, wire, sock, sslobj, incoming, outgoing, batch, budget)``, then
    ``attach(receiver)``; ``wire`` (the session's ``TLSWire``) gets the policy callbacks.
    ``app``: application data may be encrypted (the wire sets it once the handshake is done,
    clears it when it writes ``close_notify``)."""

    def __cinit__(self, TLSFlush tls, sess, sock, sslobj, inc, out, SendBatch batch,
                  Py_ssize_t budget):
        cdef object so = sslobj._sslobj  # the _ssl object (C) every SSLObject method calls
        self.tls = tls
        self.sess = sess
        self.batch = batch
        self.fileno = sock.fileno
        self.inc = inc
        self.out = out
        self._read = so.read
        self._write = so.write
        self._pending = so.pending
        self._inc_write = inc.write
        self._out_read = out.read
        self._add_frame = batch.add_frame
        self._add_copy = batch.add_copy
        self.budget = budget if budget > 0 else 1
        self.byref_min = -1         # send_frame/send_copy take every memoryview until set

    def attach(self, Receiver rx):
        """Become ``rx``'s source."""
        self.rx = rx
        rx.source = self        # (the C field: typed access bypasses the property)
        rx.csource = self       # c_read called directly, no view, no Python call

    cdef bint _gone(self) noexcept:
        # closed, or a GC clear set the object fields to None
        return self.closed or self._read is None

    # -- state read by the session's Python ------------------------------------------------
    @property
    def pending(self):
        """Ciphertext taken from the outgoing BIO and not yet sent (any thread)."""
        # relaxed: an approximate figure off the loop thread (see _set)
        return aop_load_i64(&self.ct_left, AOP_RELAXED)

    @property
    def rec_begun(self):
        """Bytes of a begun, unfinished record: still to come plus a partial header."""
        return self.rec_left + self.rec_hn

    def mark(self):
        """Have this session flushed at the end of this iteration (loop thread)."""
        self._mark()

    cdef int _mark(self) except -1:
        # the one place a session joins the iteration's dirty list (mark, send_frame/copy)
        if not self.dirty and not self._gone():
            self.dirty = True
            self.tls.dirty.append(self)
        return 0

    def close(self):
        """The session's teardown: drop every reference (breaks the cycle with it)."""
        # critical section: send_frame/send_copy on another thread read _add_frame,
        # _add_copy and the fields _gone() tests under the same lock (see the module doc).
        # The old values are dropped after the section: a DECREF may run a finaliser.
        with cython.critical_section(self):
            old = (self.sess, self.rx, self.batch, self.fileno, self.inc, self.out,
                   self._read, self._write, self._pending, self._inc_write,
                   self._out_read, self._add_frame, self._add_copy, self.ct)
            self.closed = True
            self.sess = self.rx = self.batch = None
            self.fileno = self.inc = self.out = None
            self._read = self._write = self._pending = self._inc_write = None
            self._out_read = None
            self._add_frame = self._add_copy = None
            self.ct = None
        _set(&self.ct_left, 0)
        old = None

    # -- send, the session's per-message half ---------------------------------------------
    # a TLS session's send in one call (Session._send_via_sink; u16 echo: one Python call
    # less per frame, and the by-reference size test without Python bytecode): the batch's
    # add, then mark()

    def send_frame(self, data, header_size):
        """``batch.add_frame(data, header_size)`` and, when it added, ``mark()``: returns
        add_frame's result (pending bytes; -1 from another thread, nothing added), or -2
        with nothing done for a memoryview of at least ``byref_min`` bytes, or once closed
        (the session's own send path takes those)."""
        with cython.critical_section(self):     # any thread: see close()
            add = None if self._gone() or _byref(self, data) else self._add_frame
        if add is None:
            return -2
        return _added(self, add(data, header_size))

    def send_copy(self, data):
        """``batch.add_copy(data)`` and, when it added, ``mark()``: as send_frame."""
        with cython.critical_section(self):     # any thread: see close()
            add = None if self._gone() or _byref(self, data) else self._add_copy
        if add is None:
            return -2
        return _added(self, add(data))

    # -- receive ---------------------------------------------------------------------------
    def feed(self, data):
        """Ciphertext read by the session itself (the handshake) into the incoming BIO."""
        cdef const unsigned char[::1] v = data
        if self._gone():
            return
        if v.shape[0]:
            self._records(&v[0], v.shape[0])
        self.idle = False
        self._inc_write(data)

    cdef void _records(self, const unsigned char *d, Py_ssize_t n) noexcept:
        # follow the record boundaries (5-byte headers: type, version, length): OpenSSL
        # takes a partial record out of the incoming BIO into a buffer of its own, and the
        # frame clock must still see it as begun.  A few steps per record, none per byte.
        cdef Py_ssize_t i = 0, k
        cdef Py_ssize_t left = self.rec_left
        cdef int hn = self.rec_hn
        while i < n:
            if left:
                k = n - i if n - i < left else left
                left -= k
                i += k
            else:
                self.rec_hdr[hn] = d[i]
                hn += 1
                i += 1
                if hn == 5:
                    left = (<Py_ssize_t>self.rec_hdr[3] << 8) | self.rec_hdr[4]
                    hn = 0
        self.rec_left = left
        self.rec_hn = hn

    cdef int _pull(self) except -1:
        # ciphertext from the socket into the incoming BIO: 1 when some came, 0 when there
        # is none now or the stream ended (EOF or an error: has_end says so)
        cdef int fd
        cdef ssize_t n
        cdef int e
        fd = self.fileno()
        if fd < 0:
            self.has_end = True
            self.end = -EBADF
            return 0
        while True:
            n = recv(fd, self.tls.sptr, <size_t>SCRATCH, MSG_DONTWAIT)
            if n >= 0:
                break
            e = errno
            if e == EINTR:
                continue
            if e == EAGAIN or e == EWOULDBLOCK:
                self.drained = True
            else:
                self.has_end = True
                self.end = -e
            return 0
        if n:
            self.raw_in += n
            self._records(<const unsigned char *>self.tls.sptr, n)
            self._inc_write(_point(self.tls.win, self.tls.sptr, n, False))
            # a short read emptied the socket: the next recv of this event would be EAGAIN
            self.drained = n < SCRATCH
            return 1
        # the peer's EOF: an EOF of the stream, told to OpenSSL never -- fed to the incoming
        # BIO it is UNEXPECTED_EOF_WHILE_READING, a fatal error: a decode_error alert instead
        # of our close_notify, and every later write fails, so replies still owed (from
        # workers, or beyond the flush budget) would be dropped.  (A record cut short by it
        # is dropped, as a plain session drops a frame cut short.)
        self.has_end = True
        self.end = 0
        return 0

    cdef ssize_t c_read(self, char *p, Py_ssize_t room, int *err) except -2:
        # decrypt into p[0:room) (the Receiver's source; see _RxSource)
        cdef Py_ssize_t k = 0, got
        cdef bint short = False      # the last read returned less than asked: its record
                                     # is used up, so OpenSSL holds no decrypted byte
        cdef object r
        if not self.has_end and self._gone():
            self.has_end = True
            self.end = 0
        if self.has_end:
            self.more = False
            if self.end == 0:
                return 0
            err[0] = -self.end
            return -1
        while k < room:
            # ciphertext first when OpenSSL holds nothing (no SSLWantReadError to raise and
            # catch on every burst), and no recv once this event found the socket empty.
            # idle: known to hold nothing (the last c_read ended so), no need to ask
            if self.idle or (not self.inc.pending and (short or not self._pending())):
                self.idle = True
                if self.drained or not self._pull():
                    break
            self.idle = False
            try:
                r = self._read(room - k, _point(self.tls.win, p + k, room - k, True))
            except _WantRead:           # a partial record: more ciphertext needed
                if self.drained or not self._pull():
                    break
                continue
            except (_ZeroReturn, _EOFError):    # close_notify, or EOF without it: an EOF
                self.has_end = True
                self.end = 0
                break
            except _SSLError as e:
                self.tls_reason = e.reason or str(e)
                self.has_end = True
                self.end = -EPROTO
                break
            got = r
            if not got:
                self.has_end = True
                self.end = 0
                break
            short = got < room - k
            k += got
        # more: a next read has something to return that no readiness event will announce --
        # decrypted bytes held in OpenSSL (the room was filled), or the end this read met
        # after its data (a close_notify or a fatal alert read with the last records leaves
        # the socket empty: the end is returned by the next read)
        self.more = k == room or (k != 0 and self.has_end)
        if k:
            return k
        if self.has_end:
            if self.end == 0:
                return 0
            err[0] = -self.end
            return -1
        err[0] = EAGAIN
        return -1

    def on_readable(self):
        """The session's read callback once the handshake is done."""
        cdef Receiver rx = self.rx      # a reference of our own for the burst: a handler
        if self._gone():                # that closes the session inside it drops ours
            return                      # (close()), and may free the session with its Rx
        self.drained = False
        rx.c_on_readable()
        if self._gone():
            return
        if self.more and self.has_end:
            # the end came with the data just delivered: the next read returns it, made in
            # this call, so the session acts on it (the peer's EOF, a TLS error) before
            # this iteration's flush tries to answer a peer that ended the TLS session.
            # (A Receiver held by its owner reads nothing: then `more` stays set and the
            # session's _reading_resumed reads it.)
            rx.c_on_readable()
            if self._gone():
                return
        if not self.dirty and self.out.pending:
            self.mark()                 # a read made the TLS layer write (KeyUpdate, alert)
        if self.more:
            self.sess._tls_more()       # decrypted bytes or the end still wait (no readiness
                                        # event will come for them)

    # -- send ------------------------------------------------------------------------------
    cdef Py_ssize_t c_flush(self) except? -1:
        # send what is owed; then encrypt pending plaintext (within the budget) and send it.
        # 0 all sent, 1 some left (would block, or the budget used up), -errno
        cdef Py_ssize_t status, w, n, done = 0
        cdef char *p
        cdef SendBatch b = self.batch
        if self.ct is not None:
            status = self._send_ct()
            if status:
                return status
        if self.app:
            while done < self.budget and b.c_peek(&p, &n):
                w = self._write(_point(self.tls.win, p, n, False))  # records of up to 16 KiB
                b.c_consume(w)
                done += w
        status = self._send_ct()
        if status == 0 and self.app and _get(&b.pend_bytes):
            status = 1          # the budget was used up: go on when writable
        return status

    def write_now(self):
        """Encrypt the pending plaintext and send it now, until the socket would block
        (loop thread, the batch's owner): a transport's ``write()`` above its high mark,
        as asyncio's TLS transport encrypts a write and hands it to the socket inside
        ``write()``, so that ``pause_writing()`` comes only for a backlog the socket did
        not take.  No flush budget: the caller asked for this write to go out.  0 all
        sent, 1 some left, -errno."""
        cdef Py_ssize_t status
        if self._gone():
            return 0
        while True:
            status = self.c_flush()
            # 1 with no ciphertext left over: the budget was used up, the socket still
            # takes more (c_flush consumed a budget of plaintext, so this ends)
            if status != 1 or self.ct is not None:
                return status

    def send_ct(self):
        """What the outgoing BIO holds (and what is left), sent with one send: 0 all sent,
        1 some left, -errno.  (The session's close_notify and alerts.)"""
        if self._gone():
            return 0
        return self._send_ct()

    cdef Py_ssize_t _send_ct(self) except? -1:
        cdef object ct = self.ct
        cdef Py_ssize_t off, size
        cdef ssize_t n
        cdef int fd, e
        if ct is None:
            ct = self._out_read()
            if not PyBytes_GET_SIZE(ct):
                return 0
            self.ct = ct
            self.ct_off = 0
        off = self.ct_off
        size = PyBytes_GET_SIZE(ct)
        fd = self.fileno()
        _set(&self.tls.nsends, aop_load_i64(&self.tls.nsends, AOP_RELAXED) + 1)
        if fd < 0:
            n = -1
            e = EBADF
        else:
            while True:
                n = send(fd, PyBytes_AS_STRING(ct) + off, <size_t>(size - off),
                         MSG_DONTWAIT | MSG_NOSIGNAL)
                if n >= 0:
                    break
                e = errno
                if e != EINTR:
                    break
        if n < 0:
            if e == EAGAIN or e == EWOULDBLOCK:
                n = 0
            else:
                self.ct = None
                _set(&self.ct_left, 0)
                return -e
        _set(&self.tls.nbytes, aop_load_i64(&self.tls.nbytes, AOP_RELAXED) + n)
        self.raw_out += n
        off += n
        if off < size:
            self.ct_off = off
            _set(&self.ct_left, size - off)
            return 1
        self.ct = None
        _set(&self.ct_left, 0)
        return 0
