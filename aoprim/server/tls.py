"""Layer 2 -- TLS sessions: Python's ``ssl`` module over a ``MemoryBIO`` pair per connection,
batched.

Why this mechanism: no new build dependency (the ``ssl`` module's OpenSSL does the record
work; asyncio and uvloop use the same ``SSLObject``), and what matters for CPU per message is
how many records and system calls a burst costs: here every loop iteration turns a session's
whole send batch into one ``SSLObject.write`` (records of up to 16 KiB) and one ``send``.
What runs once per message is compiled -- ``aoprim.server._tls.TLSConn`` (the decrypt into the
receive slot, the encrypt-and-send of a flush) and ``TLSFlush`` (the iteration hook), as
uvloop's sslproto is Cython over the same objects -- and this module keeps the policy: the
handshake, ``close_notify``, timeouts, errors and what they close.  docs/server.md gives the
measured figures.

Per connection, on the loop thread:

- **Handshake** (before ``on_connect``): the read callback is :meth:`TLSWire._hs_readable`:
  ciphertext from the socket (after the PROXY header, when the PROXY protocol is on: the
  header comes first, parsed here by a ``ProxyParser``) goes into the incoming BIO and
  ``do_handshake()`` runs; what it writes leaves with the per-iteration flush.  A handshake
  that fails (bad input, a client certificate that does not verify, EOF) closes this
  connection only, logged at INFO (an ordinary bad peer is no ERROR); one that is not done
  ``handshake_timeout`` seconds after the accept is cut.  Until it is done the handler has
  not met the session (no ``on_close``, no broadcasts).
- **Receive**: the read callback is ``TLSConn.on_readable``; the compiled ``Receiver``
  reads through the ``TLSConn`` (its compiled ``source``), which fills the receive slot
  with the ``SSLObject``'s ``read(n, buffer)`` (pulling ciphertext from the socket into the
  incoming BIO when OpenSSL holds none), and the Receiver cuts frames exactly as for plain
  TCP.  When the slot was filled, decrypted bytes may still wait inside OpenSSL, which no
  readiness event will announce: :meth:`TLSWire._tls_more` schedules another read.
- **Send**: ``send()`` adds to the session's ``SendBatch`` as on plain TCP (the batch is not
  attached to the ``FlushGroup``: its bytes must not reach the fd unencrypted) and marks the
  session dirty (``TLSConn.mark``).  ``TLSFlush.flush`` (the loop's iteration hook on a TLS
  server) first sends the ciphertext still owed, then takes each dirty session's pending
  bytes segment by segment (``SendBatch.c_peek``/``c_consume``: a run of
  coalesced small frames is one segment, so one write and one TLS record per 16 KiB; a
  large payload, a broadcast ``Slot`` say, is its own segment, encrypted straight from its
  memory, never copied first), writes them into the ``SSLObject`` and sends the ciphertext
  with one ``send``.  Plaintext is encrypted only once the previous ciphertext left (at most
  ``flush_budget`` plaintext bytes per flush), so ``pending_bytes`` (and ``max_pending``,
  on the loop thread and where another thread's send is queued) counts the plaintext not
  yet encrypted plus the ciphertext not yet sent.  The wire's Python
  (:meth:`TLSWire._tls_flushed`, which reports to ``Session.flushed``) runs only when a
  flush leaves something or the batch is watched (closing, back-pressure, write limits).
- **Close**: a graceful close encrypts what is owed, then ``close_notify`` (``unwrap``),
  then the lingering close (shut the write side, drain input).  A peer's ``close_notify`` or
  a bare EOF is the peer's EOF; a TLS error after the handshake closes the session (INFO).
"""
from __future__ import annotations

import errno
import logging
import os
import re
import reprlib
import ssl
import stat
from typing import TYPE_CHECKING, Any

from aoprim.server._proxyproto import ProxyParser
from aoprim.server._tls import TLSConn, TLSFlush

from .tx import BYREF_MIN

if TYPE_CHECKING:
    import socket
    from typing import Callable

    from aoprim import SendBatch

    from .loop import Timer
    from .rx import Rx
    from .session import Session, SessionContext

__all__ = ["TLSFlush", "TLSWire", "check_context", "server_context"]

log = logging.getLogger("aoprim.server")



def check_context(ctx: object) -> ssl.SSLContext:
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


_CERT_PEM = b"-----BEGIN CERTIFICATE-----"
_KEY_PEM = b"PRIVATE KEY-----"          # PRIVATE / RSA PRIVATE / EC PRIVATE / ENCRYPTED PRIVATE
_OPENSSH_KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----"     # ssh-keygen's format (~/.ssh/id_*)
_PEM_KEY = re.compile(rb"-----BEGIN (?!OPENSSH )(?:[A-Z0-9]+ )*PRIVATE KEY-----")

# The most a file is read: a certificate chain or a key is a few KiB, a CA bundle a few
# hundred (Debian's whole ca-certificates.crt is ~220 KiB).  Anything larger is the wrong file
# (a disk image, /dev/zero through a symlink), refused instead of read into memory.
_PEM_LIMIT = 1 << 20
_CA_LIMIT = 16 << 20

# Where a file already open is opened again by its descriptor (Linux): OpenSSL loads the
# file that was checked, even if its path is replaced in between (by a FIFO, say).
_FD_DIR = "/proc/self/fd"

# A path is checked with stat() before it is opened: opening a device can have effects of
# its own (a tape rewinds), and opening a FIFO for reading waits for a writer.
_KINDS = ((stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _as_path(name: str, value: object) -> str:
    """``value`` of parameter ``name`` as a ``str`` path: a ``str``, ``bytes`` (decoded with
    ``os.fsdecode``, as ``open()`` takes them) or ``os.PathLike``.  Anything else is a
    ``TypeError``: an int in particular, which ``open()`` would take for a file descriptor --
    and close."""
    if isinstance(value, (str, bytes, os.PathLike)):
        try:
            return os.fsdecode(value)
        except TypeError:           # an __fspath__ that returns neither str nor bytes
            pass
    raise TypeError(f"{name} must be a file path (str, bytes or os.PathLike), not "
                    f"{type(value).__name__} {reprlib.repr(value)}")


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n and not n % (1 << 20) else f"{n} bytes"


def _file_error(flag: str, path: str, st: os.stat_result, limit: int) -> Exception | None:
    """What is wrong with a file of this ``stat`` for option ``flag``, if anything: a
    directory, not a regular file, more than ``limit`` bytes."""
    if stat.S_ISDIR(st.st_mode):
        return IsADirectoryError(errno.EISDIR, f"{flag} {path!r}: is a directory, not a "
                                 f"regular file: give the PEM file in it")
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a file")
        return ValueError(f"{flag} {path!r} is {kind}, not a regular file: give the PEM "
                          f"file itself (the server reads no pipe or device: it could be "
                          f"endless)")
    if st.st_size > limit:
        n = st.st_size
        size = f"{n / (1 << 20):.1f} MiB ({n} bytes)" if n >= 1 << 20 else f"{n} bytes"
        return ValueError(f"{flag} {path!r} is {size}: more than any PEM file it should be "
                          f"(at most {_size_text(limit)}): is it the right file?")
    return None


def _os_error(flag: str, path: str, e: OSError) -> OSError:
    """``e`` as an ``OSError`` of the same type naming the option and the file."""
    what = {errno.ENOENT: "no such file", errno.EACCES: "permission denied (this user "
            "cannot read it)", errno.ENOTDIR: "a part of the path is not a directory"}
    reason = what.get(e.errno or 0) or (e.strerror or str(e)).lower()
    return OSError(e.errno, f"{flag} {path!r}: {reason}")


class _PEMFile:
    """The file that option ``flag`` names, open (``fd``) and read (``data``): checked to be
    a regular file of at most ``limit`` bytes before it is opened, again once open, and while
    it is read.  ``path`` is what to give OpenSSL: the open file itself (``/proc/self/fd/N``)
    where there is such a path, else the name.  Errors name the option and the file: an
    ``OSError`` of the same type (``FileNotFoundError``, ``PermissionError``,
    ``IsADirectoryError``, ...) or ``ValueError`` (not a regular file, too large)."""

    def __init__(self, flag: str, name: str, limit: int) -> None:
        self.fd = -1
        try:
            st = os.stat(name)
        except OSError as e:
            raise _os_error(flag, name, e) from None
        except ValueError:          # os.stat's "embedded null byte"
            raise ValueError(f"{flag} {name!r}: a path cannot hold a NUL character") from None
        err = _file_error(flag, name, st, limit)
        if err is not None:
            raise err
        try:
            # O_NONBLOCK: should the path have become a FIFO since, open() does not wait
            self.fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            err = _file_error(flag, name, os.fstat(self.fd), limit)
            if err is None:
                self.data = self._read(flag, name, limit)
        except OSError as e:
            self.close()
            raise _os_error(flag, name, e) from None
        except ValueError:
            self.close()
            raise
        if err is not None:
            self.close()
            raise err
        self.path = f"{_FD_DIR}/{self.fd}" if os.path.isdir(_FD_DIR) else name

    def _read(self, flag: str, name: str, limit: int) -> bytes:
        """The file's bytes; ``ValueError`` if it holds more than ``limit`` -- more than its
        ``stat()`` said: a file that grows, or one of /proc's (``st_size`` 0)."""
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(self.fd, min(left, 1 << 16))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            left -= len(chunk)
        raise ValueError(f"{flag} {name!r} is more than {_size_text(limit)}: more than any "
                         f"PEM file it should be: is it the right file?")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# server_context's client_cert -> the context's verify_mode
_CLIENT_CERT_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
                      "required": ssl.CERT_REQUIRED}


def server_context(certfile: str | bytes | os.PathLike[str] | os.PathLike[bytes],
                   keyfile: str | bytes | os.PathLike[str] | os.PathLike[bytes] | None = None,
                   ca_certs: str | bytes | os.PathLike[str] | os.PathLike[bytes] | None = None,
                   client_cert: str = "none") -> ssl.SSLContext:
    """The CLI's context: ``ssl.create_default_context(Purpose.CLIENT_AUTH)`` (TLS 1.2+,
    OpenSSL's default ciphers) with the certificate chain; ``client_cert`` "optional" or
    "required" verifies client certificates against ``ca_certs``.

    A path is a ``str``, ``bytes`` (decoded with ``os.fsdecode``) or ``os.PathLike``;
    anything else (an int is never taken for a file descriptor) is a ``TypeError`` naming
    the parameter.  Only a regular file is read, and at most 1 MiB of a certificate or key
    file, 16 MiB of a CA bundle; OpenSSL then loads the very file that was checked.

    Every failure names the option (``--certfile``, ``--keyfile``, ``--ca-certs``), the file
    and what is wrong with it: ``OSError`` (``FileNotFoundError``, ``PermissionError``,
    ``IsADirectoryError``) for a file that cannot be read, ``ValueError`` for a pipe or a
    device, a file over the bound, or one whose content is not what the option needs -- no
    PEM certificate, no private key (and no ``--keyfile``), an OpenSSH key, an encrypted key
    (the server cannot ask for a passphrase), a key that does not match the certificate
    (whatever the two algorithms), CA certificates that do not load."""
    if client_cert not in _CLIENT_CERT_MODES:
        raise ValueError(f"--client-cert {client_cert!r}: give one of "
                         f"{', '.join(_CLIENT_CERT_MODES)}")
    certfile = _as_path("certfile", certfile)
    keyfile = _as_path("keyfile", keyfile) if keyfile is not None else None
    ca_certs = _as_path("ca_certs", ca_certs) if ca_certs is not None else None
    files: list[_PEMFile] = []
    try:
        return _server_context(files, certfile, keyfile, ca_certs, client_cert)
    finally:
        for f in files:
            f.close()


def _server_context(files: list[_PEMFile], certfile: str, keyfile: str | None,
                    ca_certs: str | None, client_cert: str) -> ssl.SSLContext:
    """server_context's work; every file it opens is added to ``files`` (closed by the
    caller once OpenSSL has loaded them)."""
    cert = _PEMFile("--certfile", certfile, _PEM_LIMIT)
    files.append(cert)
    key = _PEMFile("--keyfile", keyfile, _PEM_LIMIT) if keyfile else cert
    if key is not cert:
        files.append(key)
    cert_pem, key_pem = cert.data, key.data
    key_flag = f"--keyfile {keyfile!r}" if keyfile else f"--certfile {certfile!r}"
    if _CERT_PEM not in cert_pem:
        raise ValueError(
            f"--certfile {certfile!r} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
            + (": it holds a private key -- give that file with --keyfile and the "
               "certificate with --certfile" if _KEY_PEM in cert_pem else ""))
    if _OPENSSH_KEY in key_pem and not _PEM_KEY.search(key_pem):
        # (its header ends as a PEM key's does: OpenSSL then says only "PEM lib")
        raise ValueError(
            f"{key_flag} holds an OpenSSH private key, not a PEM one: is it an SSH key "
            f"(~/.ssh/id_*)? Give the key the certificate was issued for (an RSA or ECDSA "
            f"key in OpenSSH format converts with ssh-keygen -p -m PEM -f KEY, which "
            f"rewrites KEY in place; ssh-keygen cannot convert an Ed25519 one)")
    if _KEY_PEM not in key_pem:
        if not keyfile:
            raise ValueError(f"--certfile {certfile!r} holds a certificate but no private "
                             f"key: give the key's file with --keyfile")
        raise ValueError(
            f"--keyfile {keyfile!r} holds no PEM private key (-----BEGIN ... PRIVATE "
            f"KEY-----)" + (": it holds a certificate -- is it the certificate file?"
                            if _CERT_PEM in key_pem else ""))

    def no_passphrase() -> str:
        # OpenSSL asks for one only for an encrypted key: refuse, instead of a prompt on
        # the terminal (or a hang without one)
        raise ValueError(f"{key_flag} is an encrypted private key: the server cannot ask "
                         f"for its passphrase; give an unencrypted copy (openssl pkey -in "
                         f"KEY -out PLAIN_KEY)")

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert.path, key.path if keyfile else None,
                            password=no_passphrase)
    except ssl.SSLError as e:
        # KEY_VALUES_MISMATCH: a key of the certificate's algorithm, not its key.
        # NO_CERTIFICATE_ASSIGNED: a key of another algorithm (an EC key for an RSA
        # certificate, ...): OpenSSL keeps one certificate per algorithm and found none for
        # this key's -- the certificate loaded, so that is the same mistake.
        if e.reason in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
            raise ValueError(f"the private key in {key_flag} does not match the certificate "
                             f"in --certfile {certfile!r}: give the key the certificate was "
                             f"issued for") from None
        raise ValueError(f"cannot load the certificate in --certfile {certfile!r} with the "
                         f"private key in {key_flag}: {e.reason or e} (are they PEM files "
                         f"of one certificate chain and its key?)") from None
    if ca_certs:
        ca = _PEMFile("--ca-certs", ca_certs, _CA_LIMIT)
        files.append(ca)
        if _CERT_PEM not in ca.data:
            raise ValueError(f"--ca-certs {ca_certs!r} holds no PEM certificate "
                             f"(-----BEGIN CERTIFICATE-----): give the PEM file of the CAs "
                             f"that issue the client certificates")
        try:
            ctx.load_verify_locations(ca.path)
        except ssl.SSLError as e:
            raise ValueError(f"--ca-certs {ca_certs!r}: cannot load its CA certificates: "
                             f"{e.reason or e}") from None
    ctx.verify_mode = _CLIENT_CERT_MODES[client_cert]
    return check_context(ctx)


class TLSWire:
    """A TLS session's wire (see :mod:`.wire`): the Session API over TLS.  The per-message
    work is its ``TLSConn`` (``_t``, compiled: aoprim.server._tls); the policy is here.  It
    acts on its session only through the session's ``wire_*`` methods and ``flushed()``."""

    __slots__ = ("reader", "sink", "_s", "_sock", "_loop", "_tls", "_batch", "_rx",
                 "_sslobj", "_inc", "_out", "_t", "_hs_done", "_hs_timer", "_hs_timeout_s",
                 "_pp", "_notified")

    in_flush_group = False      # the batch holds plaintext: TLSFlush encrypts and sends it
    reads_proxy_header = True   # the PROXY header is read here, before the handshake
    handshake = True            # the handler meets the session once the handshake is done
    half_close = False          # as asyncio's TLS transport: a peer's EOF ends the session

    def __init__(self, session: Session, ctx: SessionContext, sock: socket.socket,
                 batch: SendBatch, rx: Rx) -> None:
        st = ctx.settings
        self._s: Session | None = session
        self._sock = sock
        self._loop = ctx.loop
        self._tls = ctx.tls
        self._batch = batch
        self._rx: Rx | None = rx
        self._inc = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._sslobj = st.ssl.wrap_bio(self._inc, self._out, server_side=True)
        self._t = t = TLSConn(ctx.tls, self, sock, self._sslobj, self._inc, self._out,
                              batch, st.flush_budget)
        t.attach(rx.receiver)
        t.byref_min = BYREF_MIN     # send_frame/send_copy leave those to Session.send
        self.sink: object = t       # (SinkSession's send: t.send_frame)
        self._hs_done = False
        self._hs_timer: Timer | None = None
        self._hs_timeout_s = st.handshake_timeout
        self._pp: ProxyParser | None = (ProxyParser(st.proxy_mode, st.proxy_max_header)
                    if st.proxy_protocol is not None else None)
        self._notified = False      # close_notify written
        self.reader: Callable[[], object] | None = self._hs_readable
        rx.wire = self._counts
        if self._pp is not None:
            rx.header_wait = self._header_wait    # proxy_header_timeout's clock

    # -- what the session asks (see .wire) ---------------------------------------------------
    @property
    def pending(self) -> int:
        """Ciphertext not yet sent (any thread)."""
        return self._t.pending

    def extra_info(self, name: str, default: Any) -> Any:
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
        return default

    def sent(self) -> None:
        self._t.mark()

    def requeue(self) -> None:
        self._t.mark()

    def flush_once(self) -> None:
        """The server's TLS flush (the iteration hook, run early) encrypts and sends."""
        if self._batch.pending_bytes or self._t.pending:
            self._tls.flush()

    def start(self) -> None:
        self._hs_timer = self._loop.call_later(self._hs_timeout_s, self._hs_timeout)

    def owes_output(self) -> int:
        # plaintext is owed only while it can still be encrypted: once the handshake is done
        # and until close_notify -- and then close_notify itself is owed.  (Plaintext queued
        # before the handshake completed, or after close_notify, is never sent.)
        return bool(self._out.pending or self._t.pending or
                    (self._hs_done and not self._notified))

    def holds_input(self) -> bool:
        # decrypted bytes held in OpenSSL, the end read with the last data (``more``), or
        # whole records waiting in the incoming BIO (the request that came with the
        # handshake's last flight while on_connect paused)
        return bool(self._t.more or (self._hs_done and (self._inc.pending or
                                                        self._sslobj.pending())))

    def failed(self) -> str | None:
        reason = self._t.tls_reason
        return None if reason is None else f"TLS error: {reason}"

    def lost_error(self) -> OSError | None:
        """After a TLS error (a record that does not decrypt, the peer's fatal alert) an
        ``ssl.SSLError`` naming it (``reason`` set), as asyncio's TLS transport hands
        ``connection_lost``."""
        reason = self._t.tls_reason
        if reason is None:
            return None
        e = ssl.SSLError(errno.EPROTO, f"TLS error: {reason}")
        e.reason = reason
        return e

    def close(self) -> None:
        """The end of the session's teardown: drop every reference back to it."""
        if self._hs_timer is not None:
            self._hs_timer.cancel()
            self._hs_timer = None
        self._t.close()         # after the teardown's last flush report: drops the cycle
        rx = self._rx
        if rx is not None:
            # the Rx's clocks are bound methods of ours
            rx.wire = rx.header_wait = None
        self._rx = self._s = None
        self.reader = None

    def _counts(self) -> tuple[int, int]:
        """(bytes received, bytes held) as the socket saw them, for the idle and frame
        clocks: ciphertext arriving is activity, and a begun record (OpenSSL keeps partial
        records) or decrypted bytes not yet delivered are a begun frame."""
        t = self._t
        rx = self._rx
        held = rx.receiver.buffered if rx is not None else 0
        return (t.raw_in, held + t.rec_begun + self._inc.pending + self._sslobj.pending())

    def write_now(self) -> int:
        """Encrypt the pending plaintext and hand it to the socket now (a transport's write
        above its high mark, loop thread), unless no application data may be encrypted yet
        (handshake) or any more (close_notify written): 0 all sent, 1 some left, -errno."""
        if not self._hs_done or self._notified:
            return 1
        try:
            return self._t.write_now()
        except Exception as e:      # OpenSSL refused (as the iteration's flush reports it)
            self._tls_failed(e)
            return 1

    def end_output(self) -> int:
        """The session is closing and its flush left nothing: once the plaintext owed is
        encrypted and sent, ``close_notify``, sent as write_now."""
        if self._hs_done and not self._notified and not self._batch.pending_bytes:
            self._close_notify()
            return self._t.send_ct()
        return 0

    def bytes_written(self) -> int:
        return self._t.raw_out

    def _header_wait(self) -> bool:
        """The PROXY header is still due (read here, before the handshake)."""
        return self._pp is not None

    # -- handshake (loop thread) ----------------------------------------------------------
    def _hs_timeout(self) -> None:
        self._hs_timer = None
        s = self._s
        if not self._hs_done and s is not None:
            t = self._hs_timeout_s
            s.wire_failed(f"TLS handshake timeout (not done after {t:g} s)", logging.INFO,
                          "timeout")

    def _hs_readable(self) -> None:
        s = self._s
        if s is None:
            return
        scratch = self._tls.scratch
        try:
            n = self._sock.recv_into(scratch)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            s.wire_failed(f"recv failed during the TLS handshake: {e.strerror}", logging.INFO,
                          "tls")
            return
        if not n:
            s.wire_failed("peer closed during the TLS handshake", logging.INFO, "tls")
            return
        self._t.raw_in += n
        data = memoryview(scratch)[:n]
        pp = self._pp
        if pp is not None:
            k = pp.feed(data)
            if pp.failed:
                s.wire_proxy_refused(pp.error or "refused")
                return
            if not pp.done:
                return
            self._pp = None
            s.wire_proxy_header(pp.result)
            data = data[k:]
        if data:
            self._t.feed(data)
        self._handshake(s)

    def _handshake(self, s: Session) -> None:
        obj = self._sslobj
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            if self._out.pending:
                self._t.mark()
            return
        except ssl.SSLError as e:
            self._send_now()        # the alert, best effort
            s.wire_failed(f"TLS handshake failed: {e.reason or e}", logging.INFO, "tls")
            return
        self._hs_done = True
        if self._hs_timer is not None:
            self._hs_timer.cancel()
            self._hs_timer = None
        self._t.app = True
        self._t.mark()              # the last handshake flight / session tickets
        log.debug("session %d: TLS %s %s", s.id, obj.version(), obj.cipher()[0])
        s.wire_open(self._t.on_readable)

    def _send_now(self) -> None:
        """Send what the TLS layer wrote (an alert), best effort, outside the flush."""
        try:
            if self._out.pending:
                self._sock.send(self._out.read())
        except OSError:
            pass

    # -- called by TLSConn / TLSFlush (compiled) -----------------------------------------
    def _tls_more(self) -> None:
        """The last read filled its room, or met the end of the stream after its data:
        decrypted bytes may wait inside OpenSSL, or the end is still to be read, which no
        readiness event will announce."""
        s = self._s
        if s is not None:
            s.wire_holds_input()

    def _tls_flushed(self, status: int) -> None:
        """TLSFlush.flush's report for this session: status not 0 (0 all sent, 1 some left,
        -errno) or the batch is watched; the session's end_output writes close_notify."""
        s = self._s
        if s is not None:
            s.flushed(status)

    def _tls_failed(self, e: BaseException) -> None:
        s = self._s
        if s is not None:
            s.wire_failed(f"TLS send failed: {type(e).__name__}: {e}", logging.WARNING,
                          "send error")

    def _close_notify(self) -> None:
        self._notified = True
        self._t.app = False
        try:
            self._sslobj.unwrap()
        except ssl.SSLWantReadError:
            pass            # the peer's close_notify is not awaited
        except ssl.SSLError:
            pass
