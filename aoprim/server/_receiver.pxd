# cython: language_level=3
"""Receiver, for ``cimport``: the compiled per-read, per-frame receive path (its buffers,
RxArena and the rest, are declared in aoprim/server/_rxbuf.pxd).

    from aoprim.server._rxbuf cimport RxArena
    from aoprim.server._receiver cimport Receiver

    cdef Receiver rx = Receiver(arena, fd, 2, 65536, on_frame, on_event, session)
    rx.c_on_readable()           # == rx.on_readable(), without the Python method call

Buffers (who owns what; the invariants are argued at the top of _receiver.pyx)
- An RxArena owns one *scratch* buffer (a pool Slot, or a heap buffer of slot size when the
  pool was exhausted); every Receiver of the arena reads into it while it holds no
  unfinished frame.  Exported frame views pin it; the arena swaps in a fresh scratch after
  a burst that left views behind, and the old one goes back when its last view dies.
- A Receiver owns at most one buffer, ``own``, while a frame is unfinished or received
  frames wait undelivered (``pending``): a pool Slot, a
  heap buffer of slot size (pool exhausted) or a heap buffer of exactly one frame (a frame
  larger than a slot).  It holds one reference; close()/dealloc give it back (deferred
  while views of it live).

One thread: a Receiver, and the RxArena it reads into, are used by one event-loop thread,
enforced: each claims itself (``tid``, aoprim/_owner.pxd's tclaim) for every call, so a
second thread gets RuntimeError while the owning thread's nested calls (a handler reading
another receiver, closing its own) go through.  Counters are relaxed atomics, readable from
any thread without a claim.  Frame views may travel to other threads: their pins are atomic
counts.
"""
from libc.stdint cimport int64_t, uint64_t
from cpython.ref cimport PyObject
from aoprim.atomic_h cimport aop_atomic_i64
from aoprim._slab cimport SlabPool, Slot
from aoprim.server._rxbuf cimport RxArena, _RxExporter
from aoprim.server._proxyproto cimport ProxyParser

# on_event codes (the Python constants RX_EOF ... have the same values)
cdef enum:
    AOP_RX_EOF = 1          # the peer closed its side (recv returned 0); arg 0
    AOP_RX_ERROR = 2        # recv failed; arg errno
    AOP_RX_TOO_LARGE = 3    # a header announced more than max_frame; arg the announced length
    AOP_RX_HANDLER = 4      # on_frame raised an Exception; arg the exception
    AOP_RX_PROXY = 5        # the PROXY header is complete; arg (version, command, family,
                            #   src, dst) (see aoprim.server._proxyproto); frames follow
    AOP_RX_PROXY_ERROR = 6  # the PROXY header was refused (or the stream ended inside it);
                            #   arg the reason (str); nothing more is read
    AOP_RX_FORKED = 7       # on_frame forked and its fork came back here (returned: arg
                            #   None; raised: arg the exception); the owner ends the fork


cdef class _RxSource:
    # A compiled ``source`` (the server's TLS sessions, aoprim.server._tls): the Receiver calls
    # c_read instead of source(view) -- no memoryview, no Python call.  Same contract as a
    # Python source, in C: fill p[0:room) from the front; return the bytes written (> 0),
    # 0 at the end of the stream, or -1 with *err set (EAGAIN: nothing there now; else the
    # errno given to on_event as RX_ERROR).  An exception goes to sys.unraisablehook and
    # reads as EIO, as a Python source's.
    cdef ssize_t c_read(self, char *p, Py_ssize_t room, int *err) except -2


cdef class Receiver:
    cdef RxArena arena           # the scratch to read into (None once closed)
    cdef object on_frame         # on_frame(owner, data); None once closed
    cdef object on_event         # on_event(owner, code, arg); None once closed
    cdef object owner            # first argument of both callbacks; None once closed
    cdef _RxExporter fx          # turns (buffer, offset, length) into one pinned view
    cdef PyObject *fview         # during a burst: a spare frame view nobody else holds,
                                 #   re-pointed at the next frame (owned ref), or NULL
    cdef PyObject *own           # Slot or _HeapBuf holding an unfinished frame (one ref,
                                 # a C pointer so that a GC clear never drops it), or NULL
    cdef char *optr              # first byte of own
    cdef Py_ssize_t ocap         # bytes at optr
    cdef Py_ssize_t pos          # own[pos:end) are the bytes kept (unfinished frame, or
    cdef Py_ssize_t end          #   undelivered frames when `pending`)
    cdef Py_ssize_t want         # > 0: own is one frame's exact buffer, read only up to
                                 #   want; 0: read up to ocap
    cdef Py_ssize_t need         # set by _cut: bytes (header included) of the unfinished
                                 #   frame at the stop position (hs while its header is short)
    cdef uint64_t announced      # set by _cut: the too-large length
    cdef uint64_t max_frame      # largest payload accepted
    cdef int fd                  # the socket (the caller owns it)
    cdef int hs                  # header size: 0 (raw), 2 or 4
    cdef bint copy_frames        # deliver bytes copies instead of pinned views
    cdef bint closed             # close() ran
    cdef bint busy               # inside on_readable (a nested call does nothing)
    cdef bint failed             # RX_TOO_LARGE, RX_PROXY_ERROR or RX_ERROR ENOMEM seen:
                                 #   nothing more is read
    cdef bint pending            # own[pos:end) may hold complete, undelivered frames
    cdef bint filled             # the last recv filled all the room it was offered
    cdef bint hold               # the owner paused reading: no further frame or recv this
                                 #   call, and on_readable() does nothing while set
    cdef int max_reads           # recv calls per on_readable while each fills its room
    cdef int64_t reads           # recv calls that returned data (relaxed atomics, as below:
                                 #   written by the owner, read by any thread)
    cdef int64_t bytes_in        # bytes received
    cdef int64_t frames_in       # frames delivered (handed to on_frame)
    cdef unsigned long forks     # the process's fork count at construction (see _forks)
    cdef aop_atomic_i64 tid      # the owning thread's ident while claimed, else 0
    cdef object source           # None: recv from fd; else source(view) fills a writable
                                 #   view of the room and returns the bytes written, 0 at
                                 #   EOF, None when nothing is there, -errno on an error
    cdef _RxSource csource       # source, when it is a compiled one (else None)
    cdef ProxyParser pp          # PROXY protocol: the header still expected, or None (off,
                                 #   or the header is done); its bytes never reach `own`

    # on_readable() for Cython callers: 0, or -1 with a BaseException set.
    cdef int c_on_readable(self) except -1
    cdef int _on_readable(self, RxArena arena) except -1    # claims held
    cdef object _locked(self, int what)     # a property read under the claim
    cdef int _burst(self, bint do_read) except -1
    cdef int _cut(self, object buf, char *p, Py_ssize_t *ppos, Py_ssize_t end) except -1
    cdef int _cut_frames(self, object buf, char *p, Py_ssize_t *ppos, Py_ssize_t end,
                         PyObject **pbase) except -1
    cdef object _view(self, object buf, char *p, Py_ssize_t n)
    cdef int _deliver(self, object buf, object base, char *p, Py_ssize_t n,
                      Py_ssize_t *ppos, Py_ssize_t newpos) except -1
    cdef int _event(self, int code, object arg) except -1
    cdef int _settle(self, object buf, char *p, Py_ssize_t pos, Py_ssize_t end,
                     int why) except -1
    cdef int _adopt(self, object b, char *p, Py_ssize_t cap) except -1
    cdef int _drop_own(self) except -1
    cdef ssize_t _pull(self, char *p, Py_ssize_t room, int *err) except -2
    cdef int _proxy(self, char *p, Py_ssize_t *ppos, Py_ssize_t end) except -1
