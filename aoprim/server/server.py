"""Layer 2 -- the server: composes the parts and owns the lifecycle.

One idea, the server's lifecycle (over 800 lines): start, accept, shutdown and the forks of
the serving process are one state machine; the parts it composes live in their modules.

Parts (each in its own module): :class:`~.config.Settings` (validated once),
a Layer 1 loop (:func:`~.backends.create_loop`), the :class:`~.listener.Listener`, the receive
pool and its ``RxArena`` (the scratch slot every session reads into), the
:class:`~.tx.Flusher` (one ``FlushGroup``: every dirty batch flushed once per iteration), the
dispatch (inline or workers), :class:`~.stats.Stats`, and the sessions.

Lifecycle: ``start()``/``serve_forever()`` -> serving -> ``shutdown()``: stop accepting, stop
reading, close every session gracefully (flush, then close) -- with workers, each once its
worker has run what was queued for it, its ``on_close`` on a worker -- stop the workers and
the loop; sessions still open after ``shutdown_timeout`` are aborted.  After the loop stops,
every pool slot is back (``stats()["rx_slots_in_use"] == 0``), every fd is closed and every
worker thread joined -- or, for a worker stuck in a handler (``on_read`` or ``on_close``),
an error is logged after ``shutdown_timeout`` more and its session's buffers go back when
the handler returns.

In a process forked from the serving one by handler code (``os.fork()``, a multiprocessing
``fork`` worker) the server is the parent's: at the fork, ``/dev/null`` takes the place of
its listening socket and its loop's fds in the child, and the signal handlers
``serve_forever()`` installed are put back; whatever ends the fork (a ``sys.exit()`` that
unwinds through the server, ``shutdown()``, the interpreter's exit) closes only the fork's
own copies of the fds -- no ``epoll_ctl``, no ``shutdown()``, no byte sent on a connection
the parent serves.  A fork that does not end itself ends when its code comes back into the
server -- a hook returns or raises, a loop callback returns (dispatch.fork_returned) --
before the server does anything more there.  The connections' sockets stay in the fork (a
preexec_fn subprocess may be handed one); the parent shuts down a connection a fork may
share before it closes it (Session._teardown), so a fork that lives on cannot keep it open.
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import math
import os
import signal
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

from aoprim import SlabPool, Slot
from aoprim.server._rxbuf import RxArena

from .config import Settings
from .dispatch import (AT_THREAD_LIMIT, InlineDispatch, ServerThread, ThreadLimitError,
                       WorkerDispatch, fork_returned)
from .listener import Listener, describe_address, make_listening_socket, sock_address
from .backends import create_loop
from .proxy import TrustedPeers, refuse_untrusted
from .session import RawSession, RawSinkSession, Session, SessionContext, SinkSession
from .wire import PlainWire
from .stats import Stats, summary
from .tx import Flusher, check_payload

if TYPE_CHECKING:
    import ssl as _ssl
    from collections.abc import Callable, Iterable, Iterator
    from types import FrameType, TracebackType

    from typing_extensions import Buffer, Self, Unpack

    from aoprim.server._tls import TLSFlush

    from .config import SettingsArgs
    from .dispatch import WorkState
    from .handler import Handler
    from .loop import EventLoop

__all__ = ["Server", "as_handler", "hide_with_devnull", "CTRL_C_TWICE", "SAME_CTRL_C"]

log = logging.getLogger("aoprim.server")
# the message of the KeyboardInterrupt serve_forever raises at a second SIGINT while a
# handler holds the loop (the command line tells it from one a handler raised)
CTRL_C_TWICE = "Ctrl-C twice while a handler held the loop"
# a SIGINT this soon after the last one is that same Ctrl-C, relayed: the terminal signals
# its foreground process group, and a wrapper in it (``timeout``, a script that forwards
# it) sends its own copy milliseconds later -- a person's second Ctrl-C takes longer
SAME_CTRL_C = 0.2

# broadcasts up to this size (header included) are copied into each batch (SendBatch's
# default copy limit)
_COPY_MAX = 2048


def _nothing() -> None:
    pass


_HOOKS = ("on_connect", "on_read", "on_close")

# the servers started in this process and not yet stopped (for the fork hook below)
_serving: weakref.WeakSet[Server] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for srv in list(_serving):
        srv._hide_in_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


# the base class of Layer 3, by name: Layer 2 does not import it (tests/packaging/test_layering.py)
_BASE = ("aoprim.server.handler", "Handler")


def _fill_std_fds() -> None:
    """``/dev/null`` on whichever of fds 0, 1 and 2 is closed (a process started with
    ``2>&-``), so that no fd of the server -- a client's connection above all -- takes the
    number that ``print()`` and the log write to."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)   # the lowest free number: ``fd``
            except OSError:
                return
            if null != fd:                  # (not free after all: a race with a thread)
                os.close(null)


def _lift(sock: socket.socket) -> socket.socket:
    """``sock``, accepted onto fd 0, 1 or 2 -- a handler closed one of those -- moved to a
    number above them, with ``/dev/null`` put back in its place: what the process then
    prints or logs to that fd must not reach this client."""
    import fcntl
    low = sock.fileno()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        high = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError:
        os.close(null)
        raise
    sock.detach()
    lifted = socket.socket(fileno=high)
    if null != low:
        os.dup2(null, low)                  # (a std fd: inheritable, as it was)
        if null > 2:
            os.close(null)                  # (else it fills another closed std fd)
    log.warning("fd %d was closed (by handler code?): a connection got its number; "
                "/dev/null is in its place now", low)
    return lifted


def _check_listening(sock: object) -> None:
    """Refuse a ``sock=`` the server cannot accept on -- not a socket (``TypeError``), or
    closed, not a stream socket, or not listening (``ValueError``) -- before the server
    opens or starts anything: a server on it would log that it listens and never accept a
    connection (a socket bound but not listening makes accept() fail with EINVAL, again and
    again).  The socket is left as it is, the caller's."""
    if not isinstance(sock, socket.socket):
        raise TypeError(f"sock must be a socket.socket (bound and listening), not "
                        f"{type(sock).__name__}")
    fd = sock.fileno()
    if fd < 0:
        raise ValueError(f"sock= is closed ({sock!r}): pass a bound and listening socket")
    try:
        stype = sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError as e:        # EBADF: its fd was closed behind it; ENOTSOCK
        raise ValueError(f"sock= cannot be used: fd {fd} is not an open socket "
                         f"({e.strerror or e}): pass a bound and listening socket") from None
    if stype != socket.SOCK_STREAM:
        kinds: dict[int, str] = {
            socket.SOCK_DGRAM: "a SOCK_DGRAM socket (UDP, or AF_UNIX datagrams)",
            socket.SOCK_SEQPACKET: "a SOCK_SEQPACKET socket",
            socket.SOCK_RAW: "a SOCK_RAW socket"}
        kind = kinds.get(stype, f"a socket of type {stype}")
        raise ValueError(f"sock= is {kind}, fd {fd}: the server accepts connections on a "
                         f"bound and listening SOCK_STREAM socket (TCP, or AF_UNIX stream)")
    if not listening:
        try:
            peer = sock.getpeername()
        except OSError:
            peer = None
        what = (f"is connected to {describe_address(peer)}, not listening" if peer
                else "is not listening")
        raise ValueError(f"sock= {what} (fd {fd}): call bind() and listen() on it before "
                         f"passing it, or pass host and port instead of sock=")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """On the main thread, a SIGINT or SIGTERM that arrives inside the block -- the server
    starting its threads -- is held and handled as the caller's handler says (the default
    SIGINT's ``KeyboardInterrupt``, the command line's stop) once the block is done: raised
    inside ``Thread.start()``, such an exception could leave a thread half started, which
    no join sees (or a phantom entry in ``threading``'s tables).  Signals whose handler is
    not a Python callable (``SIG_DFL``, ``SIG_IGN``) are left as they are.  A handler of
    another signal that calls the one in place for SIGTERM with its own number (the
    command line's SIGHUP and SIGQUIT) is held as that SIGTERM, and given to the caller's
    SIGTERM handler with that number."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, int, FrameType | None]] = []   # (whose handler, signum, frame)
    prev: dict[int, Any] = {}

    def holder(sig: int) -> Callable[[int, FrameType | None], None]:
        def hold(signum: int, frame: FrameType | None) -> None:
            held.append((sig, signum, frame))
        return hold
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            h = signal.getsignal(sig)
            if callable(h):
                prev[sig] = signal.signal(sig, holder(sig))
        yield
    finally:
        for num, h in prev.items():
            signal.signal(num, h)
        for sig, num, frame in held:
            prev[sig](num, frame)       # (raises, as the caller's handler does)


def as_plain_python(signum: int) -> None:
    """Act on SIGINT/SIGTERM as a plain Python program does (in a process forked from the
    serving one, whose inherited handlers are not its own): SIGINT raises
    ``KeyboardInterrupt`` (its handler put back to Python's); SIGTERM's handler goes back to
    the default action and the signal is raised again, ending the process."""
    if signum == signal.SIGINT:
        signal.signal(signum, signal.default_int_handler)
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _join_starting(threads: Iterable[threading.Thread], timeout: float) -> bool:
    """Join the threads of ``threads`` still starting: a ``KeyboardInterrupt`` in
    ``Thread.start()``'s wait for the new thread leaves one that runs but has no ident yet
    (a join skips it).  Each is waited for, a millisecond at a time, until it has begun --
    one listed by ``threading.enumerate()`` is started or starting -- then joined; all
    within ``timeout`` seconds.  False if one is still alive then."""
    deadline = time.monotonic() + timeout
    for t in threads:
        while (t.ident is None and t in threading.enumerate()
               and time.monotonic() < deadline):
            time.sleep(0.001)
        if t.ident is not None:
            t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def _is_base(k: type) -> bool:
    return (k.__module__, k.__qualname__) == _BASE


def _lacks(obj: object) -> list[str]:
    """The handler hooks ``obj`` has no callable of."""
    return [h for h in _HOOKS if not callable(getattr(obj, h, None))]


def _typos(obj: object, hooks: list[str], names: list[str]) -> list[str]:
    # a method of a close name is the likely typo (on_reed for on_read)
    names = [n for n in names if not n.startswith("__") and n not in _HOOKS]
    return [f"{close[0]} looks like a misspelt {h}" for h in hooks
            for close in [difflib.get_close_matches(h, names, n=1)] if close]


def _refuse(what: str, obj: object, missing: list[str]) -> TypeError:
    typos = _typos(obj, missing, dir(obj))
    return TypeError(f"handler {what} has no callable {', '.join(missing)}"
                     + (f" ({'; '.join(typos)})" if typos else "")
                     + ": pass an instance of a subclass of aoprim.server.Handler that "
                       "defines on_read, or the subclass itself")


def _default_on_read(obj: object) -> str | None:
    """Why ``obj``'s ``on_read``, the base ``Handler``'s do-nothing default, is refused (it
    would drop every byte its sessions receive); None if ``obj`` has an ``on_read`` of its
    own -- in its class, a base before ``Handler`` or its instance ``__dict__``."""
    if "on_read" in getattr(obj, "__dict__", {}):
        return None
    cls = type(obj)
    mro = cls.__mro__
    owner = next((i for i, k in enumerate(mro) if "on_read" in vars(k)), None)
    if owner is None or not _is_base(mro[owner]):
        return None
    name = cls.__qualname__
    if _is_base(cls):
        return ("the base class Handler itself drops every byte its sessions receive (each "
                "of its hooks does nothing): serve a subclass of it that defines "
                "on_read(self, session, data)")
    later = [k for k in mro[owner + 1:] if "on_read" in vars(k)]
    if later:
        mixin = later[0].__qualname__
        return (f"{name}: Handler's default on_read shadows {mixin}.on_read (a base listed "
                f"after Handler comes after it in the method resolution order): list "
                f"{mixin} before Handler in the bases of {name}")
    names = [n for k in mro[:owner] for n in vars(k)] + list(getattr(obj, "__dict__", {}))
    typo = _typos(obj, ["on_read"], names)
    return (f"{name} does not define on_read(self, session, data)"
            + (f" ({typo[0]})" if typo else "")
            + ": every byte its sessions receive would be dropped; define on_read (to "
              "ignore input on purpose: def on_read(self, session, data): pass)")


def _not_sync(obj: object) -> str | None:
    """Why a hook of ``obj`` cannot work, called synchronously as every hook is: an
    ``async def``, an async generator or a generator only makes an object that nothing
    awaits or iterates, so its body never runs.  None if every hook is a plain callable."""
    for h in _HOOKS:
        f = getattr(obj, h)
        kind = ("a coroutine function (async def)" if inspect.iscoroutinefunction(f) else
                "an async generator function" if inspect.isasyncgenfunction(f) else
                "a generator function" if inspect.isgeneratorfunction(f) else None)
        if kind is not None:
            return (f"{type(obj).__qualname__}.{h} is {kind}: the server calls its hooks "
                    f"synchronously and never awaits or iterates what they return, so its "
                    f"body would never run; make it a plain def, or run asyncio code with "
                    f"aoprim.server.serve_protocol() (an asyncio.Protocol) or on aoprim.aio's "
                    f"event loop")
    return None


# the arguments the server calls each hook with: (session,), (session, data),
# (session, reason)
_HOOK_ARGS = {"on_connect": ("session",), "on_read": ("session", "data"),
              "on_close": ("session", "reason")}


def _bad_arity(obj: object) -> str | None:
    """Why a hook of ``obj`` cannot be called with the server's arguments (a missing or an
    extra parameter), found at construction rather than as a TypeError at every call.
    None if each takes them, or if its signature cannot be read (a C callable)."""
    for h in _HOOKS:
        f = getattr(obj, h)
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):
            continue
        args = _HOOK_ARGS[h]
        try:
            sig.bind(*args)
        except TypeError as e:
            return (f"{type(obj).__qualname__}.{h}{sig} cannot take the server's arguments "
                    f"({', '.join(args)}): {e}")
    return None


def _instantiate(cls: type) -> object:
    """``cls()``; a class whose constructor needs arguments is refused naming them (its real
    signature: ``__init__``'s, wherever in the bases it is)."""
    name = cls.__qualname__
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None                  # (no signature to check: the call itself will say)
    if sig is not None:
        try:
            sig.bind()
        except TypeError:
            raise TypeError(f"Server() instantiates a handler class with no arguments; "
                            f"{name} needs arguments {sig}: pass an instance, "
                            f"Server({name}(...))") from None
    return cls()


def as_handler(handler: object) -> Handler:
    """The handler ``Server(handler)`` serves with (the command line's rule too, and
    ``serve_protocol``'s): an object with callable ``on_connect``, ``on_read`` and
    ``on_close`` (a ``Handler`` instance, or any object with the three hooks) as it is; a
    class with them (a ``Handler`` subclass) instantiated with no arguments.  The instance is
    then checked: its ``on_read`` must not be ``Handler``'s do-nothing default (one set per
    instance in ``__init__`` counts; a mixin's listed after ``Handler`` does not, as Python
    resolves it), and no hook may be an ``async def`` or a generator.  Anything else -- the
    base ``Handler`` itself, an object or class without the hooks, a class whose constructor
    needs arguments, a function -- is refused with a ``TypeError`` naming it, what it lacks
    and the likely cause (a typo, the order of the bases)."""
    if isinstance(handler, type):
        missing = _lacks(handler)
        if missing:
            raise _refuse(f"class {handler.__qualname__}", handler, missing)
        handler = _instantiate(handler)
    missing = _lacks(handler)
    if missing and inspect.isroutine(handler):
        name = handler.__qualname__
        raise TypeError(f"handler {name} is a function, not a handler (it has no "
                        f"{', '.join(missing)}): if it returns one, call it: "
                        f"Server({name}(), ...)")
    if missing:
        raise _refuse(f"object of type {type(handler).__qualname__}", handler, missing)
    why = _default_on_read(handler) or _not_sync(handler) or _bad_arity(handler)
    if why is not None:
        raise TypeError(why)
    return cast("Handler", handler)


def _met(s: Session, tls: bool, proxy: bool) -> bool:
    """Whether the handler has met ``s`` (its ``on_connect`` ran), by the rule the sessions
    follow: under the PROXY protocol once the header is read (``proxy_peer`` is set then,
    also for a LOCAL/UNKNOWN header), with TLS once the handshake is done (the cipher is
    known then, not before); without either, from the accept.  (Read from any thread: the
    cipher is read only once the handshake is done, after the session tickets were written,
    so the SSL object's session is no longer replaced under the reader.)"""
    if proxy and s.proxy_peer is None:
        return False
    return not tls or s.get_extra_info("cipher") is not None


def _prefault(pool: SlabPool) -> None:
    """Write every slot of a fresh ``pool`` once, so its pages are resident before the first
    recv (the pool keeps its memory until it is freed: no page is faulted in twice)."""
    slots = [pool.acquire() for _ in range(pool.slots)]
    zero = bytes(pool.slot_size)
    try:
        for s in slots:
            with memoryview(s) as mv:
                mv[:] = zero
    finally:
        for s in slots:
            s.release()


def hide_with_devnull(fds: Iterable[int]) -> None:
    """Put ``/dev/null`` in place of each fd of ``fds`` (-1 skipped): a fork hiding what is
    its parent's, the numbers still owned by the copied objects, whose close() then closes
    nothing the fork opened since (fds 0-2 stay inheritable).  At the fd limit (EMFILE: a
    busy server) the lowest of them is closed first to make room -- ``/dev/null`` then
    takes the lowest free number, that one or a lower one, and goes over the rest."""
    want = sorted(set(fds) - {-1})
    if not want:
        return
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        try:
            os.close(want[0])
        except OSError:
            pass
        try:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return              # (the first is closed at least)
    for fd in want:
        if fd != null:
            try:
                os.dup2(null, fd, inheritable=fd <= 2)
            except OSError:
                pass
    if null not in want:
        os.close(null)
    elif null <= 2:
        os.set_inheritable(null, True)


class Server:
    """A three-layer server: ``Server(handler, host, port, framing, **settings)``.

    ``handler`` has ``on_connect``, ``on_read``, ``on_close`` (subclass
    :class:`~aoprim.server.Handler`); a ``Handler`` subclass given instead of an instance is
    instantiated with no arguments, and anything without the three hooks is refused with a
    ``TypeError`` (see :func:`as_handler`).  ``framing`` is ``"raw"``, ``"u16"`` or ``"u32"``.
    Keyword settings (see :class:`~aoprim.server.config.Settings` for all and their
    defaults): ``max_frame``, ``max_connections``, ``max_pending``, ``idle_timeout``,
    ``frame_timeout``, ``workers``, ``backend``, ``high_water``, ``low_water``,
    ``flush_budget``, ``backlog``, ``reuse_port``, ``rx_slot_size``, ``rx_slots``, ``rx_reads``,
    ``rx_read_size``, ``rx_read_slots``, ``rx_frame_cache``, ``tx_slot_size``, ``tx_slots``, ``close_linger``, ``shutdown_timeout``,
    ``worker_backlog``, ``worker_queue``, ``accept_batch``, ``proxy_protocol``,
    ``trusted_proxies``, ``proxy_max_header``, ``proxy_header_timeout`` (behind a load
    balancer: see :mod:`~.proxy`), ``ssl`` (a server-side ``ssl.SSLContext``: TLS, see
    :mod:`~.tls`), ``handshake_timeout``.  ``sock``: serve on an already bound and listening socket
    instead of ``host``/``port``.
    """

    def __init__(self, handler: Handler | type[Handler],
                 host: str | None = "127.0.0.1", port: int = 0,
                 framing: str = "raw", *, sock: socket.socket | None = None,
                 ssl: _ssl.SSLContext | None = None, handshake_timeout: float = 10.0,
                 **settings: Unpack[SettingsArgs]) -> None:
        handler = as_handler(handler)
        _fill_std_fds()
        st = Settings(framing=framing, ssl=ssl, handshake_timeout=handshake_timeout,
                      **settings)
        if st.ssl is not None:
            from .tls import check_context      # (imports ssl only when TLS is used)
            check_context(st.ssl)
        if sock is not None:
            _check_listening(sock)
        self.settings = st
        self.handler = handler
        self.framing = st.framing
        self.max_frame = st.max_frame
        self._arena: RxArena | None = None
        self._stats = Stats()
        self._sessions: dict[int, Session] = {}     # id -> Session (open or closing)
        self._live: set[Session] = set()    # sessions whose RefCount is above zero
        self._next_id = 0
        self._stopping = False
        self._draining = self._drained = False     # the handler's own shutdown work
        self._workers_left = 0
        self._dispatch: InlineDispatch | WorkerDispatch | None = None
        self._listener: Listener | None = None
        self._flusher: Flusher | None = None
        self._flush: Callable[[], object] | None = None    # the loop's flush hook, once made
        self._ctx: SessionContext | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._started = False
        self._pid = os.getpid()             # the serving process (see _in_fork)
        self._old_signals: dict[int, Any] = {}  # what serve_forever's handlers replaced
        # serve_forever's signals: whether one asked for the shutdown, whether the loop has
        # yet to take the last request, and whether a second SIGINT raised KeyboardInterrupt
        self._asked = self._request_pending = False
        self._interrupted = False
        self._sigint_at = -math.inf         # when the last SIGINT counted came
        # taken by whoever runs the loop first: start()'s thread, or start() itself when it
        # gives up before that thread began (then the thread must not run the loop)
        self._run_claim = threading.Lock()
        # PROXY protocol: who may connect (checked at accept, before reading); None: off
        self._trusted = (TrustedPeers(st.trusted_proxies) if st.proxy_protocol is not None
                         else None)
        # Everything below that fails gives back what was opened before it, at once, not
        # when the loop is freed.  (A sock= passed in stays the caller's.)
        self._loop: EventLoop = create_loop(st.backend)
        try:
            self._open_parts(st, host, port, sock)
        except BaseException:
            self._loop.close()
            raise
        # (host, port) -- for IPv6 too -- or the path of an AF_UNIX socket passed as sock=
        # (typed as the TCP case, which is what nearly every caller has)
        self.address: tuple[str, int] = self._address

    def _open_parts(self, st: Settings, host: str | None, port: int,
                    sock: socket.socket | None) -> None:
        """The constructor's resources after the loop: the pools, the listening socket
        (made here unless ``sock`` is given) and its address; a failure closes the socket
        made here (the caller closes the loop)."""
        self.backend = self._loop.backend
        self._rx_pool = SlabPool(st.rx_slot_size, st.rx_slots)
        self._tx_pool = SlabPool(st.tx_slot_size, st.tx_slots)
        # raw framing: raw sessions read up to rx_read_size bytes per recv into
        # slots of this pool (a 64 KiB message is one recv, not four slot-sized ones and an
        # empty one), and a large echo is sent by reference from that slot.  Its memory is
        # the project's, touched once here: no page of it is ever faulted in again.
        self._raw_pool: SlabPool | None = None
        if st.framing == "raw" and st.rx_read_size > st.rx_slot_size:
            self._raw_pool = SlabPool(st.rx_read_size, st.rx_read_slots)
            _prefault(self._raw_pool)
        if sock is not None:
            sock.setblocking(False)
            self._lsock = sock
            self._address = sock_address(sock)
            return
        self._lsock = make_listening_socket(host, port, st.backlog, st.reuse_port)
        try:
            self._address = sock_address(self._lsock)
        except BaseException:
            self._lsock.close()
            raise

    # -- set-up --------------------------------------------------------------------------
    def _claim_start(self) -> None:
        """Mark the server started (once, in the process that made it); from here on, a
        start that does not reach its loop gives back what it took (:meth:`_undo_start`)."""
        if self._started:
            raise RuntimeError("a Server can be started once")
        if os.getpid() != self._pid:
            # its loop's epoll instance (or selector) is shared with the process that made
            # it: registrations there would meet the parent's (EEXIST) and steal its events
            raise RuntimeError(
                f"this Server was made in process {self._pid} and is started in {os.getpid()}, "
                f"a fork of it: a Server serves in the process that made it -- make it after "
                f"the fork, or serve one port from several processes with reuse_port=True or "
                f"`python -m aoprim serve --procs N`")
        self._started = True

    def _undo_start(self) -> None:
        """A start that failed or was interrupted before its loop ran -- a
        ``KeyboardInterrupt`` in ``serve_forever()``'s first moments, a thread that could
        not start -- gives back everything it took: the worker threads it started are
        stopped and joined, the listening socket, the receive arena and the loop closed.
        ``shutdown()`` and ``close()`` then find a stopped server.  Each step may have been
        done already (by a cleanup that was itself interrupted): each is idempotent."""
        if self._in_fork():
            self._forget_in_fork()
            return
        try:
            d = self._dispatch
            if d is not None:
                d.stop()        # (the queue closed: the workers find nothing and exit)
                if not (d.join(self.settings.shutdown_timeout) and
                        _join_starting(d.threads, self.settings.shutdown_timeout)):
                    log.error("worker threads did not exit within %.1f s of a failed "
                              "start", self.settings.shutdown_timeout)
        finally:
            self._close_parts()
            self._done.set()

    def _prepare_parts(self) -> None:
        st = self.settings
        loop = self._loop
        if st.workers:
            self._workers_left = st.workers
            self._dispatch = WorkerDispatch(self.handler, st, on_exit=self._worker_exited)
        else:
            self._dispatch = InlineDispatch(self.handler)
        # u16/u32: a frame larger than a slot gets a buffer of its own; up to rx_frame_cache
        # bytes of them are kept resident for the next large frame
        self._arena = RxArena(self._rx_pool, self._raw_pool,
                              st.rx_frame_cache if st.framing != "raw" else 0)
        self._flusher = Flusher(st, Session.flushed)
        ctx = SessionContext()
        ctx.server = self
        ctx.loop = loop
        ctx.settings = st
        ctx.flusher = self._flusher
        ctx.arena = self._arena
        ctx.dispatch = self._dispatch
        ctx.stats = self._stats
        ctx.session_closed = self._session_closed
        ctx.session_gone = self._session_gone
        ctx.tls = None
        ctx.kick = self._kick
        ctx.wire = PlainWire
        self._ctx = ctx
        self._session_cls = RawSession if st.framing == "raw" else Session
        flush = self._flusher.flush
        if st.ssl is not None:
            from .tls import TLSFlush, TLSWire
            ctx.tls = self._stats.tls = TLSFlush()
            flush = ctx.tls.flush       # every batch is a TLS session's: none in the group
            ctx.wire = TLSWire
            # (the TLS wire's sink adds and marks in one compiled call: TLSConn.send_frame)
            self._session_cls = RawSinkSession if st.framing == "raw" else SinkSession
        self._listener = Listener(loop, self._lsock, st, self._accept, self._has_room)
        self._pid = os.getpid()
        _serving.add(self)
        self._dispatch.start(loop)
        loop.add_iteration_hook(flush)
        self._flush = flush
        self._fallbacks_seen = 0
        loop.call_later(st.sweep_every or 1.0, self._sweep)
        log.info("aoprim server listening on %s (framing=%s, workers=%d, backend=%s%s)",
                 describe_address(self.address), st.framing, st.workers, self.backend,
                 ", TLS" if st.ssl is not None else "")

    def start(self) -> Self:
        """Serve in a background thread; returns once the server accepts connections.  If
        it raises (the thread cannot start; a ``KeyboardInterrupt`` while it waits), nothing
        of the server is left running."""
        self._claim_start()
        try:
            with _signals_held():
                self._prepare_parts()
                ready = threading.Event()
                self._thread = ServerThread(target=self._run, args=(ready,),
                                            name="aoprim-loop", daemon=True)
                try:
                    self._thread.start()
                except RuntimeError as e:   # "can't start new thread"
                    raise ThreadLimitError(f"cannot start the server's loop thread "
                                           f"({e}){AT_THREAD_LIMIT}") from None
            ready.wait()
        except BaseException:
            if self._run_claim.acquire(blocking=False):
                # the loop thread did not start or has not begun: it never will (_run
                # returns at once), so nothing runs and the start is undone here
                self._thread = None
                self._undo_start()
            else:
                self.shutdown()         # it serves: stopped as any server is
            raise
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until shutdown() or SIGINT/SIGTERM (main thread).

        On the main thread its signal handlers go in once the server is prepared, just
        before its loop runs (until then a signal acts as the caller's handler says: a
        ``KeyboardInterrupt``, the command line's stop): a SIGINT or SIGTERM asks for the
        graceful shutdown; a second SIGINT that comes before the loop has taken the first
        -- a handler holds it: a blocking call, a deadlock -- raises
        ``KeyboardInterrupt`` where the main thread is, out of that code, as
        ``asyncio.run()`` does.  Whatever ends it before its loop runs gives back what was
        started (:meth:`_undo_start`)."""
        self._claim_start()
        old = self._old_signals
        try:
            with _signals_held():
                self._prepare_parts()
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    old[sig] = signal.signal(sig, self._on_signal)
            self._run(None)
        except BaseException:
            if not self._done.is_set():     # (_run's own cleanup did not run or finish)
                self._undo_start()
            raise
        finally:
            if not self._in_fork():     # (a fork's were put back at the fork)
                for num, h in old.items():
                    signal.signal(num, h)
            old.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """serve_forever()'s SIGINT/SIGTERM handler (main thread): the first asks the loop
        for the graceful shutdown; a SIGINT that comes while the loop has not yet taken the
        last request -- a callback or a handler holds it, so the shutdown cannot start --
        raises ``KeyboardInterrupt`` out of the code that holds it.  A request once the
        loop took the last one (the shutdown under way, bounded by ``shutdown_timeout``) is
        only logged.  (A SIGTERM never raises: a service manager may send it twice.)  The
        handler and the loop both run on the main thread: the flags need no lock.

        In a process forked from the serving one, a signal that lands before the fork's
        hook has put the old handlers back (``_hide_in_fork``) acts as in a plain Python
        program -- SIGTERM's default action, SIGINT a ``KeyboardInterrupt`` -- instead of
        asking a loop that is the parent's."""
        if self._in_fork():
            as_plain_python(signum)
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            now = time.monotonic()
            if now - self._sigint_at < SAME_CTRL_C:
                return          # the same Ctrl-C, relayed by a wrapper (see SAME_CTRL_C)
            self._sigint_at = now
            if self._request_pending:
                log.warning("received %s again while the loop is held (by a handler that "
                            "does not return?): raising KeyboardInterrupt", name)
                self._interrupted = True
                raise KeyboardInterrupt(CTRL_C_TWICE)
        # (set before anything that may run a nested handler: a SIGINT right behind this
        # one, in the log call, sees it)
        first, self._asked = not self._asked, True
        self._request_pending = True
        log.info("received %s: %s", name, "shutting down" if first else
                 "the shutdown is under way")
        self._loop.call_soon_threadsafe(self._take_request)

    def _take_request(self) -> None:
        """The loop takes a shutdown request of serve_forever's signal handler (loop thread:
        the main thread)."""
        self._request_pending = False
        self._begin_shutdown()

    def _run(self, ready: threading.Event | None) -> None:
        if not self._run_claim.acquire(blocking=False):
            return      # start() gave up before this thread began: it undid the start
        try:
            self._loop.call_soon(self._listener.start)
            if ready is not None:
                self._loop.call_soon(ready.set)
            self._loop.run()
        except BaseException as e:
            # (a fork's sys.exit() unwinding, or the KeyboardInterrupt of a second SIGINT,
            # logged by the signal handler: not a crash)
            if self._in_fork():
                raise
            if isinstance(e, (SystemExit, KeyboardInterrupt)):
                # a callback ended the program (sys.exit() after a last write, a Ctrl-C's
                # KeyboardInterrupt): not a crash.  What this iteration queued is handed to
                # the kernel first, as asyncio's write() had already done, so the closes
                # below are the peer's clean end of stream, not a reset over a lost reply
                self._flush_once()
                if not (self._interrupted and isinstance(e, KeyboardInterrupt)):
                    # serve_forever's caller gets the exception; start()'s thread has no
                    # caller: it is said here, and the thread ends quietly
                    log.log(logging.INFO if ready is None else logging.WARNING,
                            "%r raised on the loop thread: the server stops", e)
                if ready is not None:
                    return
            else:
                log.exception("event loop crashed")
            raise
        finally:
            if ready is not None:
                ready.set()
            if self._in_fork():
                self._forget_in_fork()
            else:
                self._cleanup()
            self._done.set()

    def _flush_once(self) -> None:
        """Hand what the sessions queued to the kernel, once, without waiting (a loop that
        a SystemExit or KeyboardInterrupt ended: see _run)."""
        flush = self._flush
        if flush is None:
            return
        try:
            flush()
        except Exception:
            log.exception("the last flush failed")

    # -- forks of the serving process ------------------------------------------------------
    def _in_fork(self) -> bool:
        """True in a process forked from the serving one (by handler code)."""
        return os.getpid() != self._pid

    def _close_parts(self) -> None:
        """The end of a stop, or of a start that failed: the listening socket (through its
        listener, once made), the receive arena, the loop; no longer serving."""
        if self._listener is not None:
            self._listener.close()
        else:
            self._lsock.close()
        if self._arena is not None:
            self._arena.close()
        self._loop.close()
        _serving.discard(self)

    def _hide_in_fork(self) -> None:
        """At a fork, in the child (see the module docstring): ``/dev/null`` in place of the
        listening socket and the loop's fds, whose numbers the copied objects still own
        (so their close() closes no fd the fork opened since); the signal handlers and
        the signal wake-up fd ``serve_forever()`` set go back to what they were.  The loop
        is told: a callback that comes back into it ends the fork (dispatch.fork_returned),
        as a hook that returns or raises there does."""
        if self._loop.closed:
            return                      # (stopped: nothing of it is left to hide)
        self._loop.forked(fork_returned)
        # the listening socket wherever it is (fd 0 under inetd's `wait` or systemd's
        # StandardInput=socket) and the loop's fds: a fork that lives on (a multiprocessing
        # Pool worker) must hold no share of the port.  The connections' sockets stay: a
        # subprocess started with a preexec_fn (which runs this hook) may be handed one as
        # its stdout; the parent's abort of a connection a fork may share shuts it down
        # first (Session._teardown), so the peer is not left waiting for the fork's exit
        hide_with_devnull({self._lsock.fileno()} | (set(self._loop.own_fds) - {0, 1, 2}))
        old = self._old_signals
        if old:
            try:
                for sig, h in old.items():
                    signal.signal(sig, h)
                signal.set_wakeup_fd(-1)    # (the loop's pipe, which the parent reads)
            except (ValueError, OSError):   # not the main thread of the fork: left as is
                pass

    def _forget_in_fork(self) -> None:
        """The server stops in a fork of the serving process: close the fork's copies of
        the sessions' sockets (a plain close(): the parent's connections are untouched)
        and leave the rest -- the loop and the listening socket, ``/dev/null`` since the
        fork -- to the fork's exit."""
        _serving.discard(self)
        for s in list(self._sessions.values()):
            s.forget_in_fork()
        self._done.set()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, let workers finish, flush what is pending, close every session,
        stop the loop, and wait until it has stopped and cleaned up (every slot back, every
        fd closed) -- whether it runs in start()'s thread or in serve_forever() in a thread
        of the caller's.  Called from a handler (on the loop thread or a worker), it only
        starts the shutdown: the shutdown waits for those threads.  ``timeout`` (default
        ``2 * shutdown_timeout + 5`` s): TimeoutError if the loop has not stopped by then.
        Thread-safe; idempotent.  In a process forked from the serving one it only closes
        the fork's copies of the sessions' sockets (see the module docstring).  A
        ``timeout`` that is NaN or below 0 raises ValueError before anything is done."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        if self._started and self._in_fork():
            self._forget_in_fork()
            return
        if not self._started:
            self._started = True
            self._lsock.close()
            self._loop.close()
            self._done.set()
            return
        if self._done.is_set():
            # (a shutdown already under way, or done: the loop thread may not have ended
            # yet -- it ends right after _done -- so wait for it, as the first call does)
            th = self._thread
            if th is not None and th is not threading.current_thread():
                th.join()
            return
        self._loop.call_soon_threadsafe(self._begin_shutdown)
        if self._loop.in_loop_thread() or (self._dispatch is not None and
                                           threading.current_thread() in
                                           self._dispatch.threads):
            return      # the loop or a worker (which the shutdown waits for) cannot wait
        st = self.settings
        wait = 2 * st.shutdown_timeout + 5 if timeout is None else timeout
        # (a huge timeout -- shutdown_timeout=1e300, timeout=inf -- waits as long as a lock
        # can, instead of raising OverflowError)
        if not self._done.wait(min(wait, threading.TIMEOUT_MAX)):
            raise TimeoutError("the server loop did not stop in time")
        if self._thread is not None:
            self._thread.join()         # (start()'s thread: it ends right after _done)

    def close(self) -> None:
        """Give back what the constructor opened -- the loop (its epoll fd and eventfd) and
        the listening socket (a ``sock=`` passed in too: it was handed over) -- for a server
        that is never started; it cannot be started afterwards.  Idempotent.  On a started
        server it is :meth:`shutdown` (which closes everything once the loop stops)."""
        self.shutdown()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.shutdown()

    # -- accepting (loop thread) -----------------------------------------------------------
    def _has_room(self) -> bool:
        return len(self._sessions) < self.settings.max_connections

    def _accept(self, sock: socket.socket, addr: Any) -> None:
        try:
            if sock.fileno() <= 2:
                # first of all: a refusal below logs, and the log must not reach this client
                sock = _lift(sock)
        except OSError:
            sock.close()
            return
        if self._trusted is not None and not self._trusted(addr):    # PROXY protocol
            self._stats.connections_total += 1
            refuse_untrusted(sock, addr, self._stats)
            return
        try:
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            return
        self._next_id += 1
        self._stats.connections_total += 1
        try:
            s = self._session_cls(self._ctx, sock, self._next_id, addr)
        except BaseException:
            sock.close()                # (a MemoryError building its parts)
            raise
        self._sessions[s.id] = s
        self._live.add(s)
        log.debug("session %d %s connected", s.id, addr)
        try:
            s.start()
        except OSError as e:    # epoll_ctl: ENOSPC (max_user_watches), ENOMEM
            s.fail_start(f"cannot register with the event loop: {e}")
            return
        if self._trusted is not None or self._ctx.tls is not None:
            return      # PROXY protocol / TLS: on_connect once the header / handshake is done
        s.run_on_connect()

    def _kick(self) -> None:
        """Application code ran where this iteration's flush may be past the batches it
        sent to (on_close or a write-limit callback, run from the flush's report): if any
        batch is left dirty, the loop comes round again at once instead of waiting for its
        next event (loop thread)."""
        tls = self._ctx.tls
        if len(tls if tls is not None else self._flusher.group):
            self._loop.call_soon(_nothing)

    def _session_gone(self, s: Session) -> None:
        # the session's last reference dropped (any thread: a worker that ran its on_close)
        self._live.discard(s)
        if self._stopping and not self._live:
            self._loop.call_soon_threadsafe(self._check_done)

    def _session_closed(self, s: Session) -> None:
        self._sessions.pop(s.id, None)
        if self._listener is not None:
            self._listener.room_freed()
        self._check_done()

    # -- timeouts (loop thread) ------------------------------------------------------------
    def _sweep(self) -> None:
        """Timeouts (every sweep_every seconds, or 1 s without timeouts) and the receive
        pool's health."""
        st = self.settings
        now = self._loop.time()
        if not self._stopping:
            # first: whatever fails below (logged by the loop), the sweeps go on
            self._loop.call_later(st.sweep_every or 1.0, self._sweep)
        if st.sweep_every is not None:
            pt = st.proxy_header_timeout if st.proxy_protocol is not None else None
            for s in list(self._sessions.values()):
                s.check_timeouts(now, st.idle_timeout, st.frame_timeout, pt)
        fb = self._arena.fallbacks
        if fb != self._fallbacks_seen:
            # a raw server's receivers read into the raw read pool, framed ones into the
            # receive pool: name the one whose reads fell back to the heap
            if self._raw_pool is not None:
                name, pool = "raw read pool", self._raw_pool
            else:
                name, pool = "receive pool", self._rx_pool
            log.warning("%s exhausted (%d of %d slots in use): %d reads went to heap "
                        "buffers since the last check", name, pool.in_use, pool.slots,
                        fb - self._fallbacks_seen)
            self._fallbacks_seen = fb

    # -- shutdown (loop thread) ------------------------------------------------------------
    def _begin_shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        log.info("aoprim server shutting down (%d sessions)", len(self._sessions))
        self._listener.close()
        for s in list(self._sessions.values()):
            s.stop_reading()
        self._loop.call_later(self.settings.shutdown_timeout, self._force_stop)
        if self._workers_left:
            # each session closes once its worker ran what is queued for it, and its
            # on_close runs on a worker; the workers stop after the last one (_check_done)
            for s in list(self._sessions.values()):
                self._dispatch.close_when_done(s)
            self._check_done()
        else:
            self._close_all()

    def _worker_exited(self) -> None:
        if not self._loop.call_soon_threadsafe(self._one_worker_gone):
            self._workers_left -= 1     # the loop is gone: nothing waits for this any more

    def _one_worker_gone(self) -> None:
        self._workers_left -= 1
        if self._workers_left == 0 and self._stopping:
            self._close_all()

    def _close_all(self) -> None:
        for s in list(self._sessions.values()):
            s.close_for_shutdown()
        self._check_done()

    def _force_stop(self) -> None:
        for s in list(self._sessions.values()):
            s.abort_for_shutdown(f"shutdown timeout: {s.lost_at_shutdown()}")
        self._loop.stop()

    def _check_done(self) -> None:
        if self._stopping and self._workers_left and not self._sessions:
            # every session closed: once the last on_close has run (the last reference is
            # gone), the workers are let go; they find nothing queued and exit
            if not self._live and not self._dispatch.closed:
                self._dispatch.stop()
            return
        if self._stopping and not self._workers_left and not self._sessions:
            # a handler with work of its own on the loop (the asyncio adapter's tasks: they
            # are cancelled and run their cancellation) finishes it first; _force_stop, at
            # shutdown_timeout, bounds it
            drain = getattr(self.handler, "_drain_at_shutdown", None)
            if drain is not None and not self._drained:
                if not self._draining:
                    self._draining = True
                    drain(self._drain_done)
                return
            self._loop.stop()

    def _drain_done(self) -> None:
        self._drained = True
        self._check_done()

    def _cleanup(self) -> None:
        for s in list(self._sessions.values()):
            s.abort_for_shutdown("server stopped")
        if self._dispatch is not None:
            # the closes' on_close posted to the workers while they still take work (not run
            # here once the queue is closed: a blocking one would hold this thread past
            # the join's bound)
            self._loop.run_ready()
            self._dispatch.stop()
            if not self._dispatch.join(self.settings.shutdown_timeout):
                log.error("worker threads did not exit within %.1f s: their sessions' "
                          "buffers go back when their handlers return",
                          self.settings.shutdown_timeout)
        self._loop.run_ready()      # worker notices, late closes
        after = getattr(self.handler, "_after_stop", None)
        if after is not None:
            # (the asyncio adapter's default executor: its running calls waited for)
            try:
                after(self.settings.shutdown_timeout)
            except Exception:
                log.exception("the handler's shutdown failed")
            self._loop.run_ready()
        self._close_parts()
        log.info("aoprim server stopped: %s", summary(self.stats()))

    # -- public ----------------------------------------------------------------------------
    def broadcast(self, data: Buffer | Slot, sessions: Iterable[Session] | None = None,
                  exclude: Session | None = None) -> None:
        """Send one buffer to many sessions (all open ones by default) without copying it per
        session: the payload is written once into a pool ``Slot`` that every session's batch
        retains (a payload small enough to be copied into each batch -- as cheap as a
        retain -- is one shared ``bytes`` instead, so a session that does not read holds no
        pool slot for it); each batch adds the header itself (``SendBatch.add_frame``, the
        one encoder).  ``exclude``: one session to leave out.  Thread-safe: called on
        another thread, the payload is queued to each session behind that thread's earlier
        sends, so what one thread sends (sends and broadcasts) leaves in its order.  A
        payload too long for the header raises ``ValueError`` in the calling thread."""
        hs = self.settings.header_size
        if isinstance(data, Slot):
            payload = data.data
        else:
            try:
                payload = memoryview(data)
            except TypeError:
                raise TypeError(f"broadcast() takes bytes, bytearray, memoryview or a Slot, "
                                f"not {type(data).__name__}") from None
        n = payload.nbytes
        try:
            check_payload(n, hs)
            slot = None
            if hs + n > _COPY_MAX and n <= self._tx_pool.slot_size:
                slot = self._tx_pool.try_acquire()
            if slot is not None:
                mv = memoryview(slot)
                try:
                    mv[:n] = payload.cast("B") if payload.c_contiguous else payload.tobytes()
                finally:
                    mv.release()
                slot.length = n
                item = slot
            else:
                item = data if type(data) is bytes else payload.tobytes()
        finally:
            payload.release()
        if not hs and not n:
            return
        try:
            if self._loop.in_loop_thread():
                self._broadcast_now(item, sessions, exclude)
            else:
                self._broadcast_foreign(item, sessions, exclude)
        finally:
            if slot is not None:
                slot.release()          # each session retained its own reference

    def _targets(self, sessions: Iterable[Session] | None,
                 exclude: Session | None) -> list[Session]:
        # (a copy of the dict first: atomic on any build, also from another thread)
        targets = self._sessions.copy().values() if sessions is None else sessions
        return [s for s in targets if s is not exclude and s.server is self]

    def _broadcast_now(self, item: bytes | Slot, sessions: Iterable[Session] | None,
                       exclude: Session | None) -> None:
        k = 0
        for s in self._targets(sessions, exclude):
            if s.send_broadcast(item):
                k += 1
        self._stats.frames_out += k

    def _broadcast_foreign(self, item: bytes | Slot, sessions: Iterable[Session] | None,
                           exclude: Session | None) -> None:
        k = 0
        for s in self._targets(sessions, exclude):
            if s.queue_broadcast(item):
                k += 1
        self._stats.frames_out_x.fetch_add(k)   # any thread: atomic

    @property
    def sessions(self) -> list[Session]:
        """The open and closing sessions the handler has met -- whose ``on_connect`` has run
        and ``on_close`` not yet -- as a snapshot list (a closing one drops sends).  A
        connection still in its TLS handshake or before its PROXY header is not listed, as
        ``broadcast()`` does not send to it: no application code sees it before
        ``on_connect``."""
        tls = self.settings.ssl is not None
        proxy = self.settings.proxy_protocol is not None
        if not (tls or proxy):
            return list(self._sessions.values())
        return [s for s in self._sessions.copy().values() if _met(s, tls, proxy)]

    @property
    def live_sessions(self) -> int:
        """How many sessions still hold references (0 after shutdown when nothing leaked)."""
        return len(self._live)

    @property
    def rx_pool(self) -> SlabPool:
        return self._rx_pool

    @property
    def tx_pool(self) -> SlabPool:
        return self._tx_pool

    @property
    def loop(self) -> EventLoop:
        """The Layer 1 loop (for timers and call_soon_threadsafe from handlers)."""
        return self._loop

    def stats(self) -> dict[str, Any]:
        """Counters (JSON-serialisable): connections, frames and bytes in/out, syscalls,
        pool slots in use, close causes."""
        lst = self._listener
        arena = self._arena
        fc = arena.frame_cache if arena is not None else None
        extra = {
            "rx_slots_in_use": self._rx_pool.in_use,
            "rx_raw_slots_in_use": self._raw_pool.in_use if self._raw_pool is not None else 0,
            "rx_frame_buffers_in_use": fc["in_use"] if fc else 0,
            "rx_frame_cache_bytes": fc["kept_bytes"] if fc else 0,
            "tx_slots_in_use": self._tx_pool.in_use,
            "rx_pool_fallbacks": arena.fallbacks if arena is not None else 0,
            "rx_scratch_swaps": arena.scratch_swaps if arena is not None else 0,
            "live_sessions": len(self._live),
            "accept_paused_full": lst.pauses_full if lst is not None else 0,
            "accept_errors": lst.accept_errors if lst is not None else 0,
            "loop_iterations": self._loop.iterations,
            "loop_errors": getattr(self._loop, "errors", 0),
        }
        return self._stats.snapshot(list(self._sessions.values()), extra)
