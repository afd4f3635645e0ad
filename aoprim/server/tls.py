"""Layer 2 -- TLS sessions: Python's ``ssl`` module over a ``MemoryBIO`` pair per connection,
batched (issue 21).

Why this mechanism: no new build dependency (the ``ssl`` module's OpenSSL does the record
work; asyncio and uvloop use the same ``SSLObject``), and what matters for CPU per message is
how many records and system calls a burst costs, not who calls ``SSL_write``: here every
loop iteration turns a session's whole send batch into one ``SSLObject.write`` (records of
up to 16 KiB) and one ``send``.  docs/server.md gives the measured figures.

Per connection, on the loop thread:

- **Handshake** (before ``on_connect``): the read callback is :meth:`TLSSession._hs_readable`:
  ciphertext from the socket (after the PROXY header, when the PROXY protocol is on: the
  header comes first, parsed here by a ``ProxyParser``) goes into the incoming BIO and
  ``do_handshake()`` runs; what it writes leaves with the per-iteration flush.  A handshake
  that fails (bad input, a client certificate that does not verify, EOF) closes this
  connection only, logged at INFO (an ordinary bad peer is no ERROR); one that is not done
  ``handshake_timeout`` seconds after the accept is cut.  Until it is done the handler has
  not met the session (no ``on_close``, no broadcasts).
- **Receive**: the compiled ``Receiver`` reads through its ``source`` hook:
  :meth:`TLSSession._tls_read` fills the receive slot with ``SSLObject.read(n, view)``
  (pulling ciphertext from the socket into the incoming BIO when OpenSSL wants more), and
  the Receiver cuts frames exactly as for plain TCP.  When the slot was filled, decrypted
  bytes may still wait inside OpenSSL, which no readiness event will announce: the read
  callback then schedules itself again.
- **Send**: ``send()`` adds to the session's ``SendBatch`` as on plain TCP (the batch is not
  attached to the ``FlushGroup``: its bytes must not reach the fd unencrypted) and marks the
  session dirty.  :meth:`TLSFlush.flush` (the loop's iteration hook on a TLS server) takes
  each dirty session's pending bytes segment by segment (``SendBatch.take_view``: a run of
  coalesced small frames is one segment, so one write and one TLS record per 16 KiB; a
  large payload, a broadcast ``Slot`` say, is its own segment, encrypted straight from its
  memory, never copied first), writes them into the ``SSLObject`` and sends the ciphertext
  with one ``send``.  Plaintext is encrypted only once the previous ciphertext left (at most
  ``flush_budget`` bytes per flush), so ``pending_bytes`` (and ``max_pending``) counts the
  plaintext not yet encrypted plus the ciphertext not yet sent.
- **Close**: a graceful close encrypts what is owed, then ``close_notify`` (``unwrap``),
  then the lingering close (shut the write side, drain input).  A peer's ``close_notify`` or
  a bare EOF is the peer's EOF; a TLS error after the handshake closes the session (INFO).
"""
import errno
import logging
import ssl
import threading

from aoprim import ProxyParser

from .session import OPEN, CLOSED, Session, _BYREF_MIN

__all__ = ["TLSFlush", "TLSSession", "RawTLSSession", "check_context", "server_context"]

log = logging.getLogger("aoprim.server")

_SCRATCH = 1 << 16              # ciphertext read per recv (a few records)
_EPROTO = errno.EPROTO
_get_ident = threading.get_ident


def check_context(ctx):
    """Validate ``ssl=``: a server-side ``ssl.SSLContext``.  Client-initiated renegotiation
    is refused (``OP_NO_RENEGOTIATION`` is set on it)."""
    if not isinstance(ctx, ssl.SSLContext):
        raise TypeError(f"ssl must be an ssl.SSLContext, not {type(ctx).__name__}")
    if ctx.protocol == ssl.PROTOCOL_TLS_CLIENT:
        raise ValueError("ssl must be a server-side context (ssl.PROTOCOL_TLS_SERVER or "
                         "ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)), not a "
                         "client one")
    ctx.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    return ctx


def server_context(certfile, keyfile=None, ca_certs=None, client_cert="none"):
    """The CLI's context: ``ssl.create_default_context(Purpose.CLIENT_AUTH)`` (TLS 1.2+,
    OpenSSL's default ciphers) with the certificate chain; ``client_cert`` "optional" or
    "required" verifies client certificates against ``ca_certs``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    if ca_certs:
        ctx.load_verify_locations(ca_certs)
    ctx.verify_mode = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
                       "required": ssl.CERT_REQUIRED}[client_cert]
    return check_context(ctx)


class TLSFlush:
    """The per-iteration flush of a TLS server: every dirty session's batch encrypted and
    sent (see the module docstring).  One per server; loop thread only."""

    __slots__ = ("dirty", "scratch", "view")

    def __init__(self):
        self.dirty = []
        self.scratch = bytearray(_SCRATCH)      # ciphertext recv buffer, shared (one thread)
        self.view = memoryview(self.scratch)

    def mark(self, s):
        if not s._dirty:
            s._dirty = True
            self.dirty.append(s)

    def flush(self):
        d = self.dirty
        if not d:
            return
        self.dirty = []
        for s in d:
            s._dirty = False
            s._tls_flush()


class TLSSession(Session):
    """A session of a server with ``ssl=``: the Session API, over TLS."""

    __slots__ = ("_sslobj", "_inc", "_out", "_ct", "_tls", "_hs_done", "_hs_timer", "_pp",
                 "_more", "_rx_end", "_dirty", "_notified", "_tls_reason", "_drained",
                 "_raw_in", "_rec_left", "_rec_hdr", "_budget", "_stats")

    _rx_proxy = False           # the PROXY header is read here, before the handshake

    def __init__(self, ctx, sock, sid, peer):
        super().__init__(ctx, sock, sid, peer)
        st = ctx.settings
        self._tls = ctx.tls
        self._inc = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._sslobj = st.ssl.wrap_bio(self._inc, self._out, server_side=True)
        self._ct = None             # ciphertext taken from the BIO and not yet sent
        self._hs_done = False
        self._hs_timer = None
        self._pp = (ProxyParser(st.proxy_mode, st.proxy_max_header)
                    if st.proxy_protocol is not None else None)
        self._more = False          # the last read filled its room: more may wait in OpenSSL
        self._drained = False       # this readiness event's recv found the socket empty
        self._rx_end = None         # what the source returns from now on (0 EOF, -errno)
        self._dirty = False         # in TLSFlush.dirty
        self._notified = False      # close_notify written
        self._tls_reason = None     # why the TLS layer failed (for the close reason)
        self._proxy_wait = True     # the handler meets us once the handshake is done
        self._raw_in = 0            # ciphertext bytes received
        # where the ciphertext stream is in its records (_records): bytes of the current
        # record still to come, and the bytes of a record header not yet complete
        self._rec_left = 0
        self._rec_hdr = b""
        self._budget = st.flush_budget      # (looked up once: the flush runs per message)
        self._stats = ctx.stats
        self._reader = self._hs_readable
        self._rx.receiver.source = self._tls_read
        self._rx.wire = self._wire

    # -- public ---------------------------------------------------------------------------
    @property
    def pending_bytes(self):
        """Plaintext not yet encrypted plus ciphertext not yet sent."""
        ct = self._ct
        return self._batch.pending_bytes + self._out.pending + (len(ct) if ct else 0)

    def get_extra_info(self, name, default=None):
        obj = self._sslobj
        if name == "ssl_object":
            return obj
        if self._hs_done and obj is not None:
            if name == "peercert":
                return obj.getpeercert()
            if name == "cipher":
                return obj.cipher()
            if name == "selected_alpn_protocol":
                return obj.selected_alpn_protocol()
        return super().get_extra_info(name, default)

    def send(self, data):
        Session.send(self, data)
        # marked on the loop thread only: a send from another thread was queued for the
        # loop, whose _drain_foreign marks the session (the dirty list is the loop's)
        if not self._dirty and _get_ident() == self._loop.thread_id:
            self._dirty = True
            self._tls.dirty.append(self)

    def send_broadcast(self, item):
        if Session.send_broadcast(self, item):
            if not self._dirty:
                self._tls.mark(self)
            return True
        return False

    def _drain_foreign(self, items):
        Session._drain_foreign(self, items)
        if not self._dirty:
            self._tls.mark(self)

    # -- hooks of Session -----------------------------------------------------------------
    def start(self):
        self._hs_timer = self._loop.call_later(self._ctx.settings.handshake_timeout,
                                               self._hs_timeout)
        Session.start(self)

    def _requeue(self):
        self._tls.mark(self)

    def _owes_output(self):
        ct = self._ct
        return bool(self._batch.pending_msgs or self._out.pending or ct or
                    (self._hs_done and not self._notified))

    def _reading_resumed(self):
        Session._reading_resumed(self)
        if self._more:
            self._loop.call_soon(self._deliver_held)

    def _rx_event(self, owner, code, arg):
        if self._tls_reason is not None and self._state == OPEN:
            self._abort(f"TLS error: {self._tls_reason}", cause="tls")
            return
        Session._rx_event(self, owner, code, arg)

    def _teardown(self):
        if self._hs_timer is not None:
            self._hs_timer.cancel()
            self._hs_timer = None
        Session._teardown(self)

    def _wire(self):
        """(bytes received, bytes held) as the socket saw them, for the idle and frame
        clocks: ciphertext arriving is activity, and a begun record (in the incoming BIO)
        or decrypted bytes not yet delivered are a begun frame."""
        begun = self._rec_left + len(self._rec_hdr)     # (OpenSSL keeps partial records)
        return (self._raw_in, self._rx.receiver.buffered + self._inc.pending +
                self._sslobj.pending() + begun)

    def _records(self, data):
        """Follow the record boundaries of the ciphertext received (5-byte headers: type,
        version, length), so that the frame clock sees a begun record: OpenSSL takes a
        partial record out of the incoming BIO into a buffer of its own.  A few steps per
        record, none per byte."""
        n = len(data)
        i = 0
        left = self._rec_left
        hdr = self._rec_hdr
        while i < n:
            if left:
                k = n - i if n - i < left else left
                left -= k
                i += k
            elif not hdr and n - i >= 5:     # a whole header here: no slice, no concat
                left = (data[i + 3] << 8) | data[i + 4]
                i += 5
            else:
                take = data[i:i + 5 - len(hdr)]
                hdr += take
                i += len(take)
                if len(hdr) == 5:
                    left = (hdr[3] << 8) | hdr[4]
                    hdr = b""
        self._rec_left = left
        self._rec_hdr = hdr

    # -- handshake (loop thread) ----------------------------------------------------------
    def _hs_timeout(self):
        self._hs_timer = None
        if not self._hs_done:
            t = self._ctx.settings.handshake_timeout
            self._abort(f"TLS handshake timeout (not done after {t:g} s)",
                        level=logging.INFO, cause="timeout")

    def _hs_readable(self):
        tls = self._tls
        try:
            n = self._sock.recv_into(tls.scratch)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._abort(f"recv failed during the TLS handshake: {e.strerror}", cause="tls")
            return
        if not n:
            self._abort("peer closed during the TLS handshake", level=logging.INFO,
                        cause="tls")
            return
        self._raw_in += n
        data = tls.view[:n]
        pp = self._pp
        if pp is not None:
            k = pp.feed(data)
            if pp.failed:
                self._close(f"PROXY protocol: {pp.error}", None, logging.WARNING, "proxy")
                return
            if not pp.done:
                return
            self._pp = None
            self._proxy_peer_is(pp.result)
            data = data[k:]
        if data:
            self._records(data)
            self._inc.write(data)
        self._handshake()

    def _handshake(self):
        obj = self._sslobj
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            if self._out.pending:
                self._tls.mark(self)
            return
        except ssl.SSLError as e:
            self._send_now()        # the alert, best effort
            self._abort(f"TLS handshake failed: {e.reason or e}", level=logging.INFO,
                        cause="tls")
            return
        self._hs_done = True
        if self._hs_timer is not None:
            self._hs_timer.cancel()
            self._hs_timer = None
        self._proxy_wait = False
        self._reader = self._tls_readable
        self._update_interest()
        self._tls.mark(self)        # the last handshake flight / session tickets
        log.debug("session %d: TLS %s %s", self.id, obj.version(), obj.cipher()[0])
        try:
            self._ctx.dispatch.handler.on_connect(self)
        except Exception as e:
            self.handler_failed("on_connect", e)
        # application data that came with the handshake's last flight
        if self._state == OPEN and not self._rx.paused and (self._inc.pending or
                                                              obj.pending()):
            self._tls_readable()

    def _send_now(self):
        """Send what the TLS layer wrote (an alert), best effort, outside the flush."""
        try:
            if self._out.pending:
                self._sock.send(self._out.read())
        except OSError:
            pass

    # -- receive (loop thread) ------------------------------------------------------------
    def _tls_readable(self):
        self._drained = False
        self._rx.receiver.on_readable()
        if not self._dirty and self._out.pending:
            self._tls.mark(self)        # a read made the TLS layer write (KeyUpdate, alert)
        if self._more and self._state == OPEN and not self._rx.paused:
            self._loop.call_soon(self._deliver_held)    # decrypted bytes still wait

    def _tls_read(self, view):
        """The Receiver's source: decrypt into ``view`` (the receive slot's free room)."""
        end = self._rx_end
        if end is not None:
            return end
        obj = self._sslobj
        inc = self._inc
        room = len(view)
        k = 0
        while k < room:
            # ciphertext first when OpenSSL holds nothing (no SSLWantReadError to raise and
            # catch on every burst), and no recv once this event found the socket empty
            if not inc.pending and not obj.pending() and (self._drained or not self._pull()):
                break
            try:
                got = obj.read(room - k, view[k:] if k else view)
            except ssl.SSLWantReadError:        # a partial record: more ciphertext needed
                if self._drained or not self._pull():
                    break
                continue
            except ssl.SSLZeroReturnError:      # close_notify
                self._rx_end = 0
                break
            except ssl.SSLEOFError:             # EOF without close_notify: an EOF too
                self._rx_end = 0
                break
            except ssl.SSLError as e:
                self._tls_reason = e.reason or str(e)
                self._rx_end = -_EPROTO
                break
            if not got:
                self._rx_end = 0
                break
            k += got
        self._more = k == room
        return k if k else self._rx_end

    def _pull(self):
        """Ciphertext from the socket into the incoming BIO; False when there is none now
        (or the stream ended -- EOF or an error: _rx_end says so)."""
        inc = self._inc
        tls = self._tls
        try:
            n = self._sock.recv_into(tls.scratch)
        except (BlockingIOError, InterruptedError):
            self._drained = True
            return False
        except OSError as e:
            self._rx_end = -(e.errno or errno.EIO)
            return False
        if n:
            self._raw_in += n
            data = tls.view[:n]
            if (self._rec_left or self._rec_hdr or n < 5 or
                    ((data[3] << 8) | data[4]) + 5 != n):
                self._records(data)     # (else exactly one whole record: at a boundary)
            inc.write(data)
            # a short read emptied the socket: the next recv of this event would be EAGAIN
            self._drained = n < _SCRATCH
            return True
        # the peer's EOF: an EOF of the stream, told to OpenSSL never -- fed to the incoming
        # BIO it is UNEXPECTED_EOF_WHILE_READING, a fatal error: a decode_error alert instead
        # of our close_notify, and every later write fails, so replies still owed (from
        # workers, or beyond the flush budget) would be dropped.  (A record cut short by it
        # is dropped, as a plain session drops a frame cut short.)
        self._rx_end = 0
        return False

    # -- send (loop thread, from TLSFlush.flush) ------------------------------------------
    def _tls_flush(self):
        """TLSFlush.flush's work for this session (loop thread): encrypt what is pending
        (within the budget) and send it; the status (0 all sent, 1 some left, -errno) goes
        to flushed() when nonzero or watched.  One Python frame plus the send (it runs
        once per message in a ping-pong)."""
        if self._state == CLOSED:
            return
        b = self._batch
        try:
            status = self._send_ct() if self._ct is not None else 0    # what is left, first
            if not status:
                if self._hs_done and not self._notified:
                    if b.pending_bytes:
                        write = self._sslobj.write
                        out = self._out
                        budget = self._budget
                        while b.pending_bytes and out.pending < budget:
                            v = b.take_view()
                            try:
                                n = write(v)        # records of up to 16 KiB
                            finally:
                                v.release()
                            b.consume(n)
                    if self._state != OPEN and not b.pending_bytes:
                        self._close_notify()
                status = self._send_ct()
                if status == 0 and b.pending_bytes:
                    status = 1          # the budget was used up: go on when writable
        except Exception as e:          # this session's failure must not stop the others
            self._abort(f"TLS send failed: {type(e).__name__}: {e}", level=logging.WARNING,
                        cause="send error")
            return
        if status or b.watch:
            self.flushed(status)

    def _send_ct(self):
        """Send the ciphertext owed with one send: 0 all sent, 1 some left, -errno."""
        ct = self._ct
        if ct is None:
            if not self._out.pending:
                return 0
            ct = self._out.read()
        st = self._stats
        st.tls_sends += 1
        try:
            n = self._sock.send(ct)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._ct = None
            return -(e.errno or errno.EIO)
        st.tls_bytes_out += n
        if n < len(ct):
            self._ct = memoryview(ct)[n:]
            return 1
        self._ct = None
        return 0

    def _close_notify(self):
        self._notified = True
        try:
            self._sslobj.unwrap()
        except ssl.SSLWantReadError:
            pass            # the peer's close_notify is not awaited
        except ssl.SSLError:
            pass


class RawTLSSession(TLSSession):
    """A TLS session of a raw-framing server: ``send`` needs no header."""
    __slots__ = ()

    def send(self, data):
        if self._state or (type(data) is memoryview and data.nbytes >= _BYREF_MIN):
            self._send_raw(data)
        else:
            # Session._send_raw's copy path, inline (one frame less per message)
            p = self._batch.add_copy(data)
            if p < 0:
                self._send_slow(data)       # another thread: queued for the loop
            else:
                self._nout += 1
                if p > self._hw:
                    self._over_high()
        # marked on the loop thread only: a send from another thread was queued for the
        # loop, whose _drain_foreign marks the session (the dirty list is the loop's)
        if not self._dirty and _get_ident() == self._loop.thread_id:
            self._dirty = True
            self._tls.dirty.append(self)
