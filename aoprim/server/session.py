"""Layer 2 -- sessions (the I/O layer): accept, receive into pooled memory, frame, batch the
sends, limit, and keep each session alive exactly as long as someone uses it.

Built on Layer 1 (:mod:`aoprim.server.loop`) and the pure framing module; it calls the Layer 3
handler through three hooks (``on_connect``, ``on_read``, ``on_close``) and knows nothing else
about it.

Receive path.  A readable socket is read with ``recv_into`` straight into a ``SlabPool`` slot.
While a session has no unfinished frame it reads into the server's *scratch* slot (one slot
shared by all sessions: with ``workers=0`` a frame view is valid only during ``on_read``, so
nothing outlives the call); the frames are cut out of it as memoryviews.  When a read ends in
the middle of a frame, the unfinished bytes move into a slot of the session's own, and the
session keeps reading into that slot until the frame completes.  (Should the pool run dry,
a session gets a heap buffer of the slot size instead, counted in the stats.)  A frame larger than a slot
gets a buffer of exactly its size -- reserved only after its header passed ``max_frame``.  With
workers, every read goes into a session-owned slot and every frame posted to a worker retains
that slot (``Slot.retain``), so the memory is reused only after the last worker is done.

Send path.  Each session has a ``SendBatch`` with ``auto_flush=False``; ``send()`` only adds.
A session with something pending is on the server's *dirty list*, which the loop flushes once
per iteration (an end-of-iteration hook), starting from a rotating position so none starves,
with a per-session byte budget.  All replies produced by one read burst therefore leave in
one ``sendmsg``.  Write interest is registered only while a socket would block.

Invariants:

- All socket, selector, batch and receive-buffer state is touched only by the loop thread.
  Other threads (workers, applications) reach a session through ``send``/``close``, which
  copy or retain the data in the calling thread and hand it over through the session's
  ``_xq`` deque plus one ``call_soon_threadsafe`` (flag ``_xsched`` cleared *before* the
  drain, so nothing queued is ever left behind).
- Lifetime: ``RefCount`` starts at 1 -- the loop's reference, dropped at teardown; every
  frame posted to a worker holds one more, dropped after its ``on_read``.  At zero the
  session returns its buffers to the pool (exactly once: ``on_zero`` runs once) and leaves
  the server's live set.
- A worker handles a session's frames in order and alone: the loop posts a session to the
  worker queue only when it is not already scheduled (``_wsched``); further frames go to the
  session's backlog, which the worker holding it drains before unscheduling (under
  ``_wlock``, a ``SpinLock`` held for a few bytecodes, never while dropping a reference).
- A limit violation (``max_frame``, ``max_pending``, ``idle_timeout``, ``frame_timeout``,
  ``max_connections``) or a handler exception closes that session only, with a logged reason.
"""
import collections
import errno
import logging
import socket
import threading
import traceback

from aoprim import AtomicInt, Closed, RefCount, SendBatch, SlabPool, Slot, SpinLock

from .framing import DEFAULT_MAX_FRAME, FrameTooLarge, Framing
from .loop import EventLoop
from .workers import WorkerPool

__all__ = ["Server", "Session"]

log = logging.getLogger("aoprim.server")

_OPEN, _CLOSING, _CLOSED = 0, 1, 2
_CLOSE_MARK = object()          # posted to a worker: run on_close
_EOF_MARK = object()            # posted to a worker: the peer's EOF, behind its last frames
_get_ident = threading.get_ident
IOV_MAX = 1024
_ACCEPT_PAUSE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# A session counts its reads and received bytes in ONE int, _nin = reads << 48 | bytes (one
# attribute update per read on the hot path); a session would need 256 TiB before the bytes
# spilled into the read count.  The idle sweep also reads it: a changed _nin means traffic.
_READ_SHIFT = 48
_READ = 1 << _READ_SHIFT
_BYTES_MASK = _READ - 1


def _check_int(name, v, lo, allow_none=False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, not {v}")
    return v


def _check_seconds(name, v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None")
    if not v > 0:
        raise ValueError(f"{name} must be > 0 (or None for no limit), not {v}")
    return float(v)


class Session:
    """One connection.  Public: ``send``, ``close``, ``abort``, ``peer``, ``id``, ``closed``,
    ``server``, ``user`` (free for the application), ``pause_reading``/``resume_reading``,
    ``pending_bytes``, ``sockname``, ``socket``."""

    __slots__ = ("id", "peer", "server", "user", "_sock", "_fd", "_loop", "_batch", "_rc",
                 "_state", "_reason", "_exc", "_rx", "_rxmv", "_pos", "_end", "_big", "_bigmv",
                 "_bigfill", "_reading", "_writing", "_bp_paused", "_user_paused", "_dirty",
                 "_xq", "_xsched", "_last", "_frame_t0", "_wlock", "_wsched", "_backlog",
                 "_wm", "_wm_paused", "_slow", "_eof", "_linger", "_sockname", "_tid", "_scr", "_onr",
                 "_hdr", "_hw", "_dl", "_nin", "_seen", "_nout", "__weakref__")

    def __init__(self, server, sock, sid, peer):
        self.id = sid
        self.peer = peer
        self.server = server
        self.user = None
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = server._loop
        self._tid = server._loop.thread_id   # sessions are created on the running loop
        self._batch = server._make_batch(sock)
        # hot-path copies of server constants (loop thread): one attribute load each
        self._scr = server._scratch_mv
        self._onr = server._on_read
        self._hdr = server._hdr
        self._hw = server._high_water   # -1 while write limits are set: see _over_high
        self._dl = server._dirty        # the server's dirty list (one list, never replaced)
        self._nin = 0                   # reads << 48 | bytes read (see _READ)
        self._seen = 0                  # _nin when the idle sweep last looked
        self._nout = 0                  # frames sent from the loop thread
        self._rc = RefCount(1, self._on_zero)
        self._state = _OPEN
        self._reason = None
        self._exc = None
        self._rx = None          # session-owned receive slot (None: use the scratch slot)
        self._rxmv = None
        self._pos = 0            # first unconsumed byte in _rx
        self._end = 0            # end of valid bytes in _rx
        self._big = None         # a frame larger than a slot: bytearray of exactly its size
        self._bigmv = None
        self._bigfill = 0
        self._reading = False
        self._writing = False
        self._bp_paused = False  # back-pressure: unsent bytes above high water
        self._user_paused = False
        self._dirty = False      # on the server's dirty list
        self._xq = collections.deque()   # ready-to-add items sent from other threads
        self._xsched = False
        self._last = server._loop.now
        self._frame_t0 = None    # when the unfinished frame began (slowloris defence)
        self._wlock = SpinLock()
        self._wsched = False
        self._backlog = collections.deque()
        self._wm = None          # (high, low, on_high, on_low) set by set_write_limits
        self._slow = False       # see _update_interest: the flush takes the general path
        self._eof = False        # the peer's EOF was read; the close waits for the workers
        self._wm_paused = False
        self._linger = None
        self._sockname = None

    def __repr__(self):
        st = ("open", "closing", "closed")[self._state]
        return f"<Session {self.id} {self.peer} {st}>"

    # -- public API (any thread) ---------------------------------------------------------
    @property
    def closed(self):
        """True once the session is closing or closed (sends are then dropped)."""
        return self._state != _OPEN

    @property
    def close_reason(self):
        return self._reason

    @property
    def pending_bytes(self):
        """Bytes accepted by send() and not yet written to the socket (approximate off-loop)."""
        return self._batch.pending_bytes

    @property
    def socket(self):
        """The connection's socket, for inspection and socket options.  Close the session
        with close()/abort(), never the socket itself: the loop still owns its fd."""
        return self._sock

    @property
    def sockname(self):
        if self._sockname is None:
            try:
                self._sockname = self._sock.getsockname()
            except OSError:
                return None
        return self._sockname

    def send(self, data):
        """Queue ``data`` (bytes-like or ``Slot``) for sending; with u16/u32 framing a header is
        added.  Thread-safe; what one thread sends leaves in that order.  The data is copied
        (a ``Slot`` is retained instead), so the caller may reuse its buffer at once.  A
        payload too long for the header raises ``ValueError``; after close, sends are
        dropped."""
        if self._state or _get_ident() != self._tid:
            self._send_slow(data)
            return
        # the loop thread, the hot path: straight into the batch
        t = type(data)
        if t is memoryview:
            n = data.nbytes
        elif t is bytes:
            n = len(data)
        else:
            self._send_other(data)
            return
        b = self._batch
        b.add(self._hdr(n))             # ValueError when n does not fit the header
        p = b.add_copy(data)            # a view is copied: its memory is reused after on_read
        self._nout += 1
        if not self._dirty:
            self._dirty = True
            self._dl.append(self)
        if p > self._hw:
            self._over_high()

    def _send_raw(self, data):
        """send() with raw framing (installed as ``send`` by :class:`_RawSession`)."""
        if self._state or _get_ident() != self._tid:
            self._send_slow(data)
            return
        # add_copy copies a view or bytearray (the scratch slot under a frame view is reused
        # by the next read), keeps bytes by reference, retains a Slot
        p = self._batch.add_copy(data)
        self._nout += 1
        if not self._dirty:
            self._dirty = True
            self._dl.append(self)
        if p > self._hw:
            self._over_high()

    def _send_slow(self, data):
        """send() when closed (dropped) or from a thread other than the loop's."""
        if self._state:
            return
        self._send_foreign(data)

    def _send_other(self, data):
        """send() of a Slot, bytearray or other bytes-like object (loop thread)."""
        srv = self.server
        fr = srv._framing
        b = self._batch
        if isinstance(data, Slot):
            if fr.header_size:
                b.add(fr.header(data.length))
            b.add(data)
        else:
            data = memoryview(data).cast("B")
            if fr.header_size:
                b.add(fr.encode(data))
            elif data.nbytes:
                b.add(bytes(data))
            else:
                return
        srv._st_frames_out += 1
        self._queued()

    def _send_foreign(self, data):
        """send() from a thread other than the loop's: frame/copy here, hand over, wake."""
        srv = self.server
        fr = srv._framing
        xq = self._xq
        if isinstance(data, Slot):
            if fr.header_size:
                xq.append(fr.header(data.length))
            xq.append(data.retain())
        elif fr.header_size:
            xq.append(fr.encode(data))
        else:
            if not len(data):
                return
            xq.append(data if type(data) is bytes else bytes(data))
        srv._st_frames_out_x.fetch_add(1)   # any thread: atomic
        if not self._xsched:
            self._xsched = True
            self._loop.call_soon_threadsafe(self._drain_xq)

    def close(self):
        """Close gracefully: stop reading, flush what is owed, shut the write side, close.
        Thread-safe."""
        if self._state != _OPEN:
            return
        if _get_ident() == self._loop.thread_id:
            self._close("closed by the application")
        else:
            self._loop.call_soon_threadsafe(self._close, "closed by the application")

    def abort(self):
        """Close at once, dropping what is unsent.  Thread-safe."""
        if self._state == _CLOSED:
            return
        if _get_ident() == self._loop.thread_id:
            self._abort("aborted by the application")
        else:
            self._loop.call_soon_threadsafe(self._abort, "aborted by the application")

    def pause_reading(self):
        if _get_ident() != self._loop.thread_id:
            self._loop.call_soon_threadsafe(self.pause_reading)
            return
        if not self._user_paused:
            self._user_paused = True
            self._update_interest()

    def resume_reading(self):
        if _get_ident() != self._loop.thread_id:
            self._loop.call_soon_threadsafe(self.resume_reading)
            return
        if self._user_paused:
            self._user_paused = False
            self._update_interest()

    def set_write_limits(self, high, low, on_high, on_low):
        """Call ``on_high()`` once unsent bytes exceed ``high``, then ``on_low()`` once they
        drop to ``low`` or below (loop thread; used by the asyncio transport adapter)."""
        self._wm = (high, low, on_high, on_low)
        self._hw = -1           # every send now takes _over_high, which checks the limits
        self._update_interest()  # recomputes _slow
        self._check_wm()

    # -- sending (loop thread) -----------------------------------------------------------
    def _add_ready(self, item):
        """Add an already framed item (bytes or Slot) -- broadcast and the _xq drain."""
        self._batch.add(item)
        self._queued()

    def _queued(self):
        """After adding to the batch: join the dirty list (flushed at the end of this loop
        iteration) and apply back-pressure.  send()'s hot path inlines the same steps."""
        if not self._dirty:
            self._dirty = True
            self.server._dirty.append(self)
        if self._batch.pending_bytes > self._hw:
            self._over_high()

    def _drain_xq(self):
        self._xsched = False        # before draining: a later send() schedules again
        xq = self._xq
        while xq:
            item = xq.popleft()
            if self._state == _CLOSED:
                if isinstance(item, Slot):
                    item.release()
                continue
            self._add_ready(item)
            if isinstance(item, Slot):
                item.release()      # the batch holds its own reference now
            del item

    def _over_high(self):
        """A send left more than ``_hw`` bytes pending: the server's high-water mark, or -1
        while write limits are set (so that every send checks them)."""
        p = self._batch.pending_bytes
        srv = self.server
        if p > srv._high_water:
            if p > srv._max_pending:
                self._abort(f"max_pending exceeded ({p} unsent bytes > {srv._max_pending}): "
                            "the peer does not read", level=logging.WARNING)
                return
            if not self._bp_paused:
                self._bp_paused = True
                self._update_interest()
        if self._wm is not None:
            self._check_wm()

    def _check_wm(self):
        high, low, on_high, on_low = self._wm
        p = self._batch.pending_bytes
        if not self._wm_paused:
            if p > high:
                self._wm_paused = True
                on_high()
        elif p <= low:
            self._wm_paused = False
            on_low()

    def _flush(self):
        """Write what is pending, within the per-session budget.  Returns True when the
        session should stay on the dirty list (budget used up, more to send)."""
        b = self._batch
        srv = self.server
        budget = srv._flush_budget
        sent = 0
        while b.pending_msgs:
            try:
                n = b.flush()
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._abort(f"send failed: {e}", e)
                return False
            if n == 0:                      # would block: wait for writability
                if not self._writing:
                    self._writing = True
                    self._update_interest()
                return False
            sent += n
            if sent >= budget and b.pending_msgs:
                return True
        return self._flushed()

    def _flushed(self):
        """Everything pending is written: drop write interest, resume reading, finish a
        close."""
        b = self._batch
        srv = self.server
        if self._writing:
            self._writing = False
            self._update_interest()
        if self._bp_paused and b.pending_bytes <= srv._low_water:
            self._bp_paused = False
            self._update_interest()
        if self._wm is not None:
            self._check_wm()
        if self._state == _CLOSING:
            self._finish_close()
        return False

    def _on_writable(self):
        if self._state == _CLOSED:
            return
        if self._dirty:
            return      # the end-of-iteration flush will do it
        if self._flush():
            self._dirty = True
            self.server._dirty.append(self)

    def _update_interest(self):
        if self._state == _CLOSED:
            return
        srv = self.server
        r = (srv._reader(self) if self._state == _OPEN and not self._bp_paused
             and not self._user_paused and not srv._reads_stopped and not self._eof
             else None)
        w = self._on_writable if self._writing else None
        self._reading = r is not None
        # anything but "open, not waiting for writability, no back-pressure, no write limits"
        # sends the end-of-iteration flush down the general path
        self._slow = bool(self._state or self._writing or self._bp_paused or
                          self._wm is not None)
        self._loop.set_callbacks(self._fd, r, w)

    # -- receiving (loop thread) ---------------------------------------------------------
    def _read_raw(self):
        """The raw framing fast path without workers: read into the scratch slot, hand the
        chunk to on_read as a view of it.  Registered only while the session is open and
        reading (_update_interest), so it needs no state check."""
        mv = self._scr
        try:
            n = self._sock.recv_into(mv)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._abort(f"recv failed: {e}", e)
            return
        if not n:
            self._peer_closed()
            return
        self._nin += n + _READ          # one read of n bytes (also the idle sweep's clock)
        try:
            self._onr(self, mv[:n])
        except Exception as e:
            self._handler_failed("on_read", e)

    def _on_readable(self):
        if self._state != _OPEN:
            return
        if self._big is not None:
            self._read_big()
            return
        srv = self.server
        own = self._rx
        if own is None:
            if srv._scratch is not None:
                mv = srv._scratch_mv
            else:
                own = self._take_rx_slot()
                if own is None:
                    return
                mv = self._rxmv
            pos = end = 0
        else:
            mv = self._rxmv
            pos = self._pos
            end = self._end
        n = self._recv(mv[end:] if end else mv)
        if not n:
            return
        end += n
        fr = srv._framing
        if not fr.header_size:                  # raw: the chunk is the frame
            self._deliver(mv, own, ((0, end),))
            if own is not None:
                self._drop_rx()
            return
        need = 0
        try:
            spans, pos, need = fr.scan(mv, pos, end)
        except FrameTooLarge as e:
            if e.spans:
                self._deliver(mv, own, e.spans)
            self._abort(f"frame too large: {e}", level=logging.WARNING)
            return
        if spans:
            self._frame_t0 = None
            self._deliver(mv, own, spans)
            if self._state != _OPEN:
                return
        if pos == end:                          # nothing unfinished
            self._frame_t0 = None
            if own is not None:
                self._drop_rx()
            return
        # an unfinished frame of `need` bytes (header included) starts at pos
        if self._frame_t0 is None:
            self._frame_t0 = self._loop.now
        size = srv._rx_slot_size
        if need > size:                         # bigger than a slot: a buffer of its size
            big = bytearray(need)               # header already checked against max_frame
            k = end - pos
            big[:k] = mv[pos:end]
            self._big = big
            self._bigmv = memoryview(big)
            self._bigfill = k
            if own is not None:
                self._drop_rx()
            return
        if own is None or need > size - pos:     # move the unfinished frame to a fresh slot
            k = end - pos
            new = srv._acquire_rx()
            newmv = memoryview(new)
            newmv[:k] = mv[pos:end]
            if own is not None:
                self._drop_rx()
            self._rx = new
            self._rxmv = newmv
            self._pos = 0
            self._end = k
        else:
            self._pos = pos
            self._end = end

    def _recv(self, buf):
        """One recv_into for the general read paths (_read_raw inlines it): the bytes read,
        counted; or 0 when there is nothing to do -- would block, or an error or the peer's
        EOF, both handled here."""
        try:
            n = self._sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            self._abort(f"recv failed: {e}", e)
            return 0
        if not n:
            self._peer_closed()
            return 0
        self._nin += n + _READ
        return n

    def _peer_closed(self):
        """The peer's EOF.  With workers, frames the peer sent before it
        may still be waiting or running: the close waits for them -- an EOF mark travels the
        session's worker order and closes the session from there -- so their replies still
        go out (a client that half-closes after its request gets its answer)."""
        srv = self.server
        srv._st_recv += 1
        if srv._workers is None or srv._workers_done:
            self._close("peer closed the connection", level=logging.DEBUG)
            return
        self._eof = True
        self._update_interest()         # nothing more to read
        self._rc.incref()               # the mark holds the session like a frame
        self._post((_EOF_MARK, None))

    def _take_rx_slot(self):
        slot = self.server._acquire_rx()
        self._rx = slot
        self._rxmv = memoryview(slot)
        self._pos = self._end = 0
        return slot

    def _drop_rx(self):
        slot, mv = self._rx, self._rxmv
        if slot is None:
            return
        self._rx = self._rxmv = None
        self._pos = self._end = 0
        mv.release()
        if type(slot) is not bytearray:
            self.server._release_slot(slot)

    def _read_big(self):
        srv = self.server
        big = self._big
        need = len(big)
        n = self._recv(self._bigmv[self._bigfill:])
        if not n:
            return
        self._bigfill += n
        if self._bigfill < need:
            return
        bmv = self._bigmv
        self._big = self._bigmv = None
        self._frame_t0 = None
        self._deliver(bmv, None, ((srv._framing.header_size, need),))
        bmv.release()

    def _deliver(self, mv, slot, spans):
        srv = self.server
        srv._st_frames_in += len(spans)
        if srv._workers is None:
            on_read = srv._on_read
            for a, b in spans:
                try:
                    on_read(self, mv[a:b])
                except Exception as e:
                    self._handler_failed("on_read", e)
                    return
                if self._state != _OPEN:
                    return
            return
        # workers: each frame holds a session reference and (when pooled) a slot reference
        if type(slot) is bytearray:
            slot = None                 # an unpooled fallback buffer: copy the frames
        for a, b in spans:
            if slot is not None:
                slot.retain()
                view = memoryview(slot)[a:b]
            else:
                view = bytes(mv[a:b])
            self._rc.incref()
            self._post((view, slot))

    def _post(self, item):
        with self._wlock:
            if self._wsched:
                self._backlog.append(item)
                return
            self._wsched = True
        try:
            self.server._workers.post((self, item))
        except Closed:      # shutting down, workers draining: run it here, still in order
            self.server._dispatch((self, item))

    def _handler_failed(self, hook, exc):
        log.error("session %d %s: handler %s raised; closing this session", self.id, self.peer,
                  hook, exc_info=exc)
        # the traceback's frames hold the frame view (and so the pool slot under it) for as
        # long as anyone keeps the exception -- a log record, say: drop their locals
        traceback.clear_frames(exc.__traceback__)
        self.server._st_handler_errors.fetch_add(1)    # loop or worker thread: atomic
        if _get_ident() == self._loop.thread_id:
            self._close(f"handler {hook} raised {type(exc).__name__}: {exc}", exc,
                        level=logging.WARNING)
        elif self._state == _OPEN:
            self._loop.call_soon_threadsafe(
                self._close, f"handler {hook} raised {type(exc).__name__}: {exc}", exc,
                logging.WARNING)

    # -- closing (loop thread) -----------------------------------------------------------
    def _close(self, reason, exc=None, level=logging.INFO):
        """Graceful: stop reading, flush what is owed, then shut down the write side."""
        if self._state != _OPEN:
            return
        self._state = _CLOSING
        self._reason = reason
        self._exc = exc
        log.log(level, "session %d %s closing: %s", self.id, self.peer, reason)
        if self._xq:
            self._drain_xq_closing()
        self._update_interest()
        if self._batch.pending_msgs:
            if not self._dirty:
                self._dirty = True
                self.server._dirty.append(self)
            self._linger = self._loop.call_later(self.server._close_linger, self._abort,
                                                 "close linger timeout: unsent data dropped")
        else:
            self._finish_close()

    def _drain_xq_closing(self):
        xq = self._xq
        while xq:
            item = xq.popleft()
            self._batch.add(item)
            if isinstance(item, Slot):
                item.release()
            del item

    def _finish_close(self):
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._teardown()

    def _abort(self, reason, exc=None, level=logging.INFO):
        if self._state == _CLOSED:
            return
        if self._state == _OPEN:
            self._reason = reason
            self._exc = exc
            log.log(level, "session %d %s closed: %s", self.id, self.peer, reason)
        elif reason and self._reason and reason != self._reason:
            log.log(level, "session %d %s: %s", self.id, self.peer, reason)
        self._teardown()

    def _teardown(self):
        if self._state == _CLOSED:
            return
        self._state = _CLOSED
        self._slow = True
        srv = self.server
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._loop.remove(self._fd)
        self._reading = self._writing = False
        try:
            self._sock.close()
        except OSError:
            pass
        srv._retire_batch(self._batch)
        srv._st_reads += self._nin >> _READ_SHIFT
        srv._st_bytes_in += self._nin & _BYTES_MASK
        srv._st_frames_out += self._nout
        self._nin = self._nout = 0
        while self._xq:
            item = self._xq.popleft()
            if isinstance(item, Slot):
                item.release()
        srv._sessions.pop(self.id, None)
        if srv._workers is not None and not srv._workers_done:
            self._rc.incref()
            self._post((_CLOSE_MARK, None))
        else:
            srv._call_on_close(self)
        # the loop's reference, dropped once the current callback has unwound (a frame view
        # may still be on the stack of the handler that closed us)
        self._loop.call_soon(self._rc.decref)
        srv._check_done()

    def _on_zero(self):
        """The last reference is gone: return the buffers to the pool (exactly once)."""
        if self._rx is not None:
            self._drop_rx()
        self._big = None
        if self._bigmv is not None:
            self._bigmv.release()
            self._bigmv = None
        self.server._live.discard(self)


class _RawSession(Session):
    """A session of a raw-framing server: ``send`` needs no header."""
    __slots__ = ()
    send = Session._send_raw


class Server:
    """The server: see :mod:`aoprim.server`."""

    def __init__(self, handler, host="127.0.0.1", port=0, framing="raw", *,
                 max_frame=DEFAULT_MAX_FRAME, max_connections=10000, max_pending=4 << 20,
                 idle_timeout=None, frame_timeout=30.0, workers=0, backend="selectors",
                 high_water=None, low_water=None, flush_budget=256 << 10, backlog=1024,
                 reuse_port=False, rx_slot_size=16384, rx_slots=1024, tx_slot_size=16384,
                 tx_slots=256, close_linger=5.0, shutdown_timeout=5.0, sock=None):
        for hook in ("on_connect", "on_read", "on_close"):
            if not callable(getattr(handler, hook, None)):
                raise TypeError(f"handler must have a callable {hook}() (subclass Handler)")
        self.handler = handler
        self._framing = Framing(framing, max_frame)
        self.framing = framing
        self.max_frame = max_frame
        self._max_connections = _check_int("max_connections", max_connections, 1)
        self._max_pending = _check_int("max_pending", max_pending, 1)
        self._idle_timeout = _check_seconds("idle_timeout", idle_timeout)
        self._frame_timeout = _check_seconds("frame_timeout", frame_timeout)
        self._nworkers = _check_int("workers", workers, 0)
        hw = _check_int("high_water", high_water, 1, True)
        if hw is None:
            hw = min(256 << 10, max(1, self._max_pending // 2))
        lw = _check_int("low_water", low_water, 0, True)
        if lw is None:
            lw = hw // 4
        if lw > hw:
            raise ValueError("low_water must be <= high_water")
        self._high_water = hw
        self._low_water = lw
        self._flush_budget = _check_int("flush_budget", flush_budget, 1)
        self._batch_bytes = max(self._flush_budget, 65536)
        self._close_linger = float(close_linger)
        self._shutdown_timeout = float(shutdown_timeout)
        self._rx_slot_size = _check_int("rx_slot_size", rx_slot_size, 64)
        self._loop = EventLoop(backend)
        self.backend = self._loop.backend
        self._rx_pool = SlabPool(self._rx_slot_size, _check_int("rx_slots", rx_slots, 2))
        self._tx_pool = SlabPool(_check_int("tx_slot_size", tx_slot_size, 64),
                                 _check_int("tx_slots", tx_slots, 1))
        self._scratch = None
        self._scratch_mv = None
        self._sessions = {}             # id -> Session (open or closing)
        self._live = set()              # sessions whose RefCount is above zero
        self._next_id = 0
        self._dirty = []
        self._rot = 0
        self._reads_stopped = False
        self._stopping = False
        self._accept_paused = False
        self._workers = None
        self._workers_done = True
        self._workers_left = 0
        self._on_read = handler.on_read
        self._stuck = []                # slots whose release was refused (a view outlived a call)
        self._thread = None
        self._done = threading.Event()
        self._started = False
        self._closed_batches = {"syscalls": 0, "messages": 0, "bytes": 0}
        self._st_conn_total = 0
        self._st_refused = 0
        self._st_frames_in = 0
        self._st_reads = 0                      # reads that returned data (closed sessions)
        self._st_frames_out = 0                 # loop thread only
        self._st_frames_out_x = AtomicInt(0)    # sends from other threads
        self._st_bytes_in = 0
        self._st_recv = 0                       # reads that returned EOF
        self._st_handler_errors = AtomicInt(0)
        self._st_rx_fallbacks = 0
        self._hdr = None if framing == "raw" else self._framing.header
        self._raw_fast = False      # raw framing without workers: Session._read_raw
        self._session_cls = _RawSession if framing == "raw" else Session
        try:
            self._lsock = self._make_listener(host, port, backlog, reuse_port, sock)
        except BaseException:
            self._loop.close()
            raise
        self.address = self._lsock.getsockname()[:2]

    # -- set-up --------------------------------------------------------------------------
    @staticmethod
    def _make_listener(host, port, backlog, reuse_port, sock):
        if sock is not None:
            sock.setblocking(False)
            return sock
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, stype, proto, _, addr = infos[0]
        s = socket.socket(family, stype, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr)
            s.listen(backlog)
            s.setblocking(False)
        except BaseException:
            s.close()
            raise
        return s

    def _reader(self, s):
        return s._read_raw if self._raw_fast else s._on_readable

    def _make_batch(self, sock):
        """A SendBatch with auto_flush off.  Its target is the socket, not the int fd: the
        batch reads ``fileno()`` at every flush, so a socket closed behind the session's back
        (``Session.socket`` is public) fails with EBADF instead of writing to whatever
        connection reuses the number."""
        return SendBatch(sock, max_msgs=IOV_MAX, max_bytes=self._batch_bytes,
                         auto_flush=False)

    def _prepare(self):
        if self._started:
            raise RuntimeError("a Server can be started once")
        self._started = True
        loop = self._loop
        loop.thread_id = None
        if self._nworkers:
            self._scratch = None
            self._workers_done = False
            self._workers_left = self._nworkers
            self._workers = WorkerPool(self._nworkers, self._dispatch,
                                       on_exit=self._worker_exited)
            self._workers.start()
        else:
            self._scratch = self._rx_pool.acquire()
            self._scratch_mv = memoryview(self._scratch)
            self._raw_fast = self._hdr is None
        loop.add_reader(self._lsock.fileno(), self._on_accept)
        loop.add_iteration_hook(self._flush_dirty)
        ticks = [t for t in (self._idle_timeout, self._frame_timeout) if t]
        if ticks:
            self._sweep_every = min(1.0, max(0.01, min(ticks) / 10))
            loop.call_later(self._sweep_every, self._sweep)
        log.info("aoprim server listening on %s:%s (framing=%s, workers=%d, backend=%s)",
                 self.address[0], self.address[1], self.framing, self._nworkers, self.backend)

    def start(self):
        """Serve in a background thread; returns once the server accepts connections."""
        self._prepare()
        self._thread = threading.Thread(target=self._run, name="aoprim-loop", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self):
        """Serve in the calling thread until shutdown() or SIGINT/SIGTERM (main thread)."""
        import signal
        self._prepare()
        old = {}
        if threading.current_thread() is threading.main_thread():
            def on_signal(signum, frame):
                log.info("received %s: shutting down", signal.Signals(signum).name)
                self._loop.call_soon_threadsafe(self._begin_shutdown)
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, on_signal)
        try:
            self._run()
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    def _run(self):
        try:
            self._loop.run()
        except BaseException:
            log.exception("event loop crashed")
            raise
        finally:
            self._cleanup()
            self._done.set()

    def shutdown(self, timeout=None):
        """Stop accepting, let workers finish, flush what is pending, close every session,
        stop the loop and join it.  Thread-safe; idempotent."""
        if not self._started:
            self._started = True
            self._lsock.close()
            self._loop.close()
            self._done.set()
            return
        if self._done.is_set():
            return
        self._loop.call_soon_threadsafe(self._begin_shutdown)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self._shutdown_timeout + 5 if timeout is None else timeout)
            if self._thread.is_alive():
                raise TimeoutError("the server loop did not stop in time")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    # -- shutdown (loop thread) ------------------------------------------------------------
    def _begin_shutdown(self):
        if self._stopping:
            return
        self._stopping = True
        log.info("aoprim server shutting down (%d sessions)", len(self._sessions))
        self._loop.remove(self._lsock.fileno())
        self._lsock.close()
        self._reads_stopped = True
        for s in list(self._sessions.values()):
            s._update_interest()
        self._loop.call_later(self._shutdown_timeout, self._force_stop)
        if self._workers is not None and not self._workers_done:
            self._workers.close()       # workers drain what is queued, then exit
        else:
            self._close_all()

    def _worker_exited(self):
        self._loop.call_soon_threadsafe(self._one_worker_gone)

    def _one_worker_gone(self):
        self._workers_left -= 1
        if self._workers_left == 0:
            self._workers_done = True
            if self._stopping:
                self._close_all()

    def _close_all(self):
        for s in list(self._sessions.values()):
            s._close("server shutdown", level=logging.DEBUG)
        self._check_done()

    def _force_stop(self):
        for s in list(self._sessions.values()):
            s._abort("shutdown timeout: unsent data dropped", level=logging.WARNING)
        self._loop.stop()

    def _check_done(self):
        if self._stopping and self._workers_done and not self._sessions:
            self._loop.stop()

    def _cleanup(self):
        for s in list(self._sessions.values()):
            s._abort("server stopped")
        if self._workers is not None:
            self._workers.close()
            if not self._workers.join(5):
                log.error("worker threads did not exit")
        self._loop.run_ready()      # deferred decrefs (and late worker notices)
        try:
            self._lsock.close()
        except OSError:
            pass
        if self._scratch is not None:
            self._scratch_mv.release()
            self._scratch_mv = None
            self._release_slot(self._scratch)
            self._scratch = None
        for slot in self._stuck[:]:
            try:
                slot.release()
                self._stuck.remove(slot)
            except BufferError:
                pass
        self._loop.close()
        log.info("aoprim server stopped: %s", self.stats())

    # -- accepting (loop thread) -----------------------------------------------------------
    def _on_accept(self):
        lsock = self._lsock
        loop = self._loop
        while True:
            try:
                sock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _ACCEPT_PAUSE_ERRNOS:
                    log.warning("accept failed (%s): pausing accepts for 0.1 s", e)
                    self._accept_paused = True
                    loop.remove_reader(lsock.fileno())
                    loop.call_later(0.1, self._resume_accept)
                    return
                if e.errno == errno.ECONNABORTED:
                    continue
                log.warning("accept failed: %s", e)
                return
            if len(self._sessions) >= self._max_connections:
                self._st_refused += 1
                log.warning("max_connections (%d) reached: refusing %s", self._max_connections,
                            addr)
                sock.close()
                continue
            try:
                sock.setblocking(False)
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            self._next_id += 1
            self._st_conn_total += 1
            s = self._session_cls(self, sock, self._next_id, addr)
            self._sessions[s.id] = s
            self._live.add(s)
            log.debug("session %d %s connected", s.id, addr)
            s._update_interest()
            try:
                self.handler.on_connect(s)
            except Exception as e:
                s._handler_failed("on_connect", e)

    def _resume_accept(self):
        self._accept_paused = False
        if not self._stopping:
            self._loop.add_reader(self._lsock.fileno(), self._on_accept)

    # -- buffers -------------------------------------------------------------------------
    def _acquire_rx(self):
        """A receive slot from the pool -- or, when the pool is exhausted, a private
        bytearray of the same size (counted in stats as ``rx_pool_fallbacks``): a burst of
        sessions with unfinished frames degrades to heap buffers instead of failing."""
        slot = self._rx_pool.try_acquire()
        if slot is None:
            self._st_rx_fallbacks += 1
            if self._st_rx_fallbacks == 1 or self._st_rx_fallbacks % 1000 == 0:
                log.warning("receive pool exhausted (%d slots in use): using heap buffers "
                            "(%d so far)", self._rx_pool.in_use, self._st_rx_fallbacks)
            return bytearray(self._rx_slot_size)
        return slot

    def _release_slot(self, slot):
        try:
            slot.release()
        except BufferError:
            # a handler kept a view of a frame beyond its call: the slot cannot go back yet
            log.error("a frame view outlived its on_read call; its slot is held back")
            self._stuck.append(slot)

    def _retire_batch(self, batch):
        st = batch.stats
        cb = self._closed_batches
        for k in cb:
            cb[k] += st.get(k, 0)
        batch.clear()

    # -- flushing (loop thread, end of every iteration) ------------------------------------
    def _flush_dirty(self):
        """End of every loop iteration: one flush per dirty session (usually ONE sendmsg for
        everything its read burst produced), starting from a rotating position.

        The dirty list is walked in place: a session dirtied while the walk runs (a close
        callback sending, say) is appended and visited in this same walk, so once it ends
        every entry has been visited and the list is cleared.  A session whose budget ran
        out stays dirty: it is collected in ``again`` (flag set at once, so it is never
        appended twice) and becomes the next iteration's list."""
        dl = self._dirty
        if not dl:
            return
        n = len(dl)
        if n > 1:
            k = self._rot % n
            self._rot += 1
            if k:
                dl[:] = dl[k:] + dl[:k]
        again = None
        for s in dl:
            s._dirty = False
            if s._slow:
                # closing/closed, waiting for writability, back-pressured or with write
                # limits: the general path (a writable socket is flushed by its write
                # callback)
                if s._state != _CLOSED and not s._writing and s._flush():
                    s._dirty = True
                    if again is None:
                        again = []
                    again.append(s)
                continue
            b = s._batch
            try:
                b.flush()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                s._abort(f"send failed: {e}", e)
                continue
            if b:                       # messages still pending: a short write
                if s._flush():          # the general path: budget, interest, watermarks
                    s._dirty = True
                    if again is None:
                        again = []
                    again.append(s)
        dl.clear()
        if again is not None:
            dl.extend(again)

    # -- timeouts (loop thread) ------------------------------------------------------------
    def _sweep(self):
        now = self._loop.now
        idle = self._idle_timeout
        ft = self._frame_timeout
        for s in list(self._sessions.values()):
            if s._state != _OPEN:
                continue
            # a session's last traffic is known to within one sweep period: the read paths
            # only bump _nin; the sweep notices a change and stamps the time
            nin = s._nin
            if nin != s._seen:
                s._seen = nin
                s._last = now
            if idle is not None and now - s._last > idle:
                s._abort(f"idle timeout ({idle:g} s without a byte)", level=logging.WARNING)
            elif ft is not None and s._frame_t0 is not None and now - s._frame_t0 > ft:
                s._abort(f"frame timeout (a frame begun {now - s._frame_t0:.2f} s ago is "
                         f"incomplete, limit {ft:g} s)", level=logging.WARNING)
        if not self._stopping:
            self._loop.call_later(self._sweep_every, self._sweep)

    # -- workers ---------------------------------------------------------------------------
    def _dispatch(self, posted):
        """Worker thread: run the session's frames in order until its backlog is empty."""
        s, item = posted
        handler = self.handler
        while True:
            view, slot = item
            item = None
            if view is _CLOSE_MARK:
                self._call_on_close(s)
            elif view is _EOF_MARK:         # every earlier frame has been handled
                self._loop.call_soon_threadsafe(s._close, "peer closed the connection", None,
                                                logging.DEBUG)
            else:
                try:
                    if s._state != _CLOSED:
                        handler.on_read(s, view)
                except Exception as e:
                    s._handler_failed("on_read", e)
                if slot is not None:
                    try:
                        view.release()
                    except BufferError:
                        pass
                    self._release_slot(slot)
            del view, slot
            s._rc.decref()
            with s._wlock:
                if not s._backlog:
                    s._wsched = False
                    return
                item = s._backlog.popleft()

    def _call_on_close(self, s):
        try:
            self.handler.on_close(s, s._exc)
        except Exception as e:
            log.error("session %d: handler on_close raised", s.id, exc_info=e)

    # -- public ----------------------------------------------------------------------------
    def broadcast(self, data, sessions=None, exclude=None):
        """Send one buffer to many sessions (all open ones by default) without copying it per
        session: the framed payload is written once into a pool ``Slot`` that every session's
        batch retains.  ``exclude``: one session to leave out.  Thread-safe."""
        fr = self._framing
        if isinstance(data, Slot):
            payload = data.data
        else:
            payload = memoryview(data).cast("B")
        n = payload.nbytes
        hdr = fr.header(n)
        total = len(hdr) + n
        slot = self._tx_pool.try_acquire() if total <= self._tx_pool.slot_size else None
        if slot is not None:
            mv = memoryview(slot)
            mv[:len(hdr)] = hdr
            mv[len(hdr):total] = payload
            mv.release()
            slot.length = total
            item = slot
        else:
            item = hdr + payload if hdr else bytes(payload)
        del payload
        if _get_ident() == self._loop.thread_id:
            self._broadcast_now(item, sessions, exclude)
        else:
            self._loop.call_soon_threadsafe(self._broadcast_now, item, sessions, exclude)

    def _broadcast_now(self, item, sessions, exclude):
        try:
            targets = list(self._sessions.values()) if sessions is None else list(sessions)
            k = 0
            for s in targets:
                if s is exclude or s._state != _OPEN or s.server is not self:
                    continue
                s._add_ready(item)
                k += 1
            self._st_frames_out += k
        finally:
            if isinstance(item, Slot):
                item.release()

    @property
    def sessions(self):
        """The open sessions (a snapshot list)."""
        return list(self._sessions.values())

    @property
    def live_sessions(self):
        """How many sessions still hold references (0 after shutdown when nothing leaked)."""
        return len(self._live)

    @property
    def rx_pool(self):
        return self._rx_pool

    @property
    def tx_pool(self):
        return self._tx_pool

    def stats(self):
        """Counters: connections current/total, frames and bytes in/out, syscalls."""
        agg = dict(self._closed_batches)
        reads = self._st_reads
        bin_ = self._st_bytes_in
        fout = self._st_frames_out
        for s in list(self._sessions.values()):
            st = s._batch.stats
            for k in agg:
                agg[k] += st.get(k, 0)
            nin = s._nin
            reads += nin >> _READ_SHIFT
            bin_ += nin & _BYTES_MASK
            fout += s._nout
        sends = agg["syscalls"]
        frames_out = fout + self._st_frames_out_x.load()
        return {
            "connections": len(self._sessions),
            "connections_total": self._st_conn_total,
            "connections_refused": self._st_refused,
            # the raw fast path delivers each read as one frame without counting frames
            "frames_in": self._st_frames_in + (reads if self._raw_fast else 0),
            "frames_out": frames_out,
            "bytes_in": bin_,
            "bytes_out": agg["bytes"],
            "recv_syscalls": self._st_recv + reads,
            "send_syscalls": sends,
            "messages_per_send": (frames_out / sends) if sends else 0.0,
            "handler_errors": self._st_handler_errors.load(),
            "rx_pool_fallbacks": self._st_rx_fallbacks,
            "loop_iterations": self._loop.iterations,
        }
