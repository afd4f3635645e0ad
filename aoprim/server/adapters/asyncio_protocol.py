"""An adapter (not Layer 3 itself): run an unchanged ``asyncio.Protocol`` / ``asyncio.BufferedProtocol`` on the
aoprim server (see ``serve_protocol`` in :mod:`aoprim.server`).

One idea, asyncio's protocol API over a session (over 800 lines): the loop, the transport
and the handler below present it together and share their private state.

Each session gets one protocol instance (from the factory) and one :class:`SessionTransport`.
``Protocol.data_received`` gets ``bytes`` (asyncio's contract: the protocol may keep them).
A ``BufferedProtocol`` gets its bytes through ``get_buffer``/``buffer_updated``: they were
received into pool slots by Layer 2 and are copied once, straight from the slot, into the
buffer the protocol hands out (with ``workers=N`` from the frame's ``bytes`` copy instead).
``set_protocol()`` switches: later bytes, ``eof_received``, ``connection_lost`` and the
write-limit callbacks go to the new protocol (a Protocol <-> BufferedProtocol switch too).

The loop.  Every protocol callback runs with the server's :class:`ProtocolLoop` as the
running loop, so ``asyncio.get_running_loop()``, ``loop.call_later``/``call_at``/
``call_soon``, ``create_future``, ``create_task``, ``asyncio.sleep``, ``wait_for``,
``asyncio.timeout`` and ``run_in_executor``/``asyncio.to_thread`` work as on asyncio's
loop, and so does its debug mode (``PYTHONASYNCIODEBUG``, ``set_debug``: slow callbacks
logged); what they schedule runs on the server's loop thread (with ``workers=0`` the thread of
the protocol's own callbacks; with ``workers=N`` the protocol's callbacks run on a worker
and the loop's on the loop thread, but one connection's code never on both at once: see
:class:`_Strand`; state shared between connections needs a lock).  The loop's I/O methods raise ``NotImplementedError``.  Each connection has its own
``contextvars.Context``, copied at accept from the context of the code that made the
server (``serve_protocol()``'s caller), in which its callbacks run (what one connection
sets, another never sees; its tasks and loop callbacks copy it, as asyncio's).  The default
executor is one bounded pool per server (``min(32, cpu + 4)`` threads, as asyncio's), shut
down with it.  At shutdown, once every ``connection_lost`` has run, the tasks still pending
are cancelled and run their cancellation, then the async generators still alive are
closed (within ``shutdown_timeout``), as ``asyncio.run`` does; the loop's async generator
hooks are installed while its callbacks run (a generator dropped unfinished is closed with
``aclose()`` in a task, as asyncio's).  Exceptions go where asyncio sends them: to the
loop's exception handler (``loop.set_exception_handler``).

Writing.  The transport's write buffer is the session's ``SendBatch``:
``get_write_buffer_size()`` is its unsent bytes, and the protocol's ``pause_writing`` /
``resume_writing`` are called when it crosses the limits of ``set_write_buffer_limits``
-- as asyncio, ``pause_writing`` only for what is left once the socket was tried (over TLS:
the plaintext not yet encrypted and sent counts), and ``set_write_buffer_limits`` may pause
but never resumes.  On a worker, whose writes wait for the loop thread, the write that leaves
more unsent than the high mark plus what the socket may still take pauses the protocol
before it returns (``write``); whichever thread pauses first does, once (``_told``).  The rule for ``max_pending``: a protocol's writes are never cut for
size while it has not been told ``pause_writing()`` (asyncio buffers them all: a head, a
large body and a terminator written in one callback reach the peer whole); once told, a
write finding more than ``16 * max(max_pending, high-water mark)`` bytes pending (64 MiB by
default) cuts the connection -- the protocol ignores ``pause_writing`` and the peer does
not read.

The callbacks come in asyncio's order: ``connection_lost()`` never runs inside the callback
that caused it (``abort()``, or ``close()`` with nothing left to write, inside
``connection_made`` or ``data_received``): it follows in a later loop callback, as asyncio's
``call_soon``, and no ``data_received`` comes after ``close()``/``abort()``.  An exception
in ``connection_made`` goes to the exception handler and the connection carries on (asyncio
runs it as a loop callback) -- over TLS it is fatal, as asyncio's TLS transport makes it;
one in ``data_received``/``eof_received`` (or a
BufferedProtocol's ``get_buffer``/``buffer_updated``) goes to the exception handler, as
asyncio's "Fatal error: protocol.data_received() call failed.", and closes the connection
with ``connection_lost(exc)``.
``close()`` sends the whole backlog however slowly the peer reads (``close_linger`` does not
apply; ``idle_timeout``, if set, cuts a peer that takes nothing); a ``write()`` after it
while that backlog is still being sent joins it, as asyncio's TCP transport (plain TCP, on
the loop thread).  ``abort()`` first makes
one non-blocking attempt to send what was written (over TLS: encrypted), as asyncio's
``write()`` has already tried the socket, then closes.  The peer's EOF calls
``eof_received()``; a false return closes the transport (what it wrote first is sent), a
true one keeps it open for writing until the protocol closes it (over TLS it closes anyway,
as asyncio's TLS transport; the peer's close_notify calls it too, but not after the
protocol's own ``close()``, where asyncio's TLS transport calls it once the peer answers
the close_notify, which is not waited for here).  A reset or another socket error gives
``connection_lost`` the ``OSError`` (``ConnectionResetError``), as asyncio; a server limit
that cuts the session (``max_pending``, ``idle_timeout``, a shutdown dropping the backlog)
ends the stream with a reset and gives ``connection_lost`` an exception naming it
(``ConnectionAbortedError``, ``TimeoutError``), never None.  ``write_eof`` is not
supported.  ``get_buffer``'s size hint is -1, as asyncio's (over TLS, the bytes at hand);
``is_reading()`` is False once the transport is closing, whoever closed it.  With
``workers=0`` over TCP, the loop callbacks one delivery queued (``call_soon``, a task woken)
run before the next, as asyncio's loop, where each read is a callback of its own.  Over TLS
(``serve_protocol(..., ssl=ctx)``) ``get_extra_info`` answers asyncio's TLS names
(``sslcontext``, ``ssl_object``, ``peercert``, ``cipher``, ``compression``).
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
# (asyncio's own helpers for its debug mode: the same test of PYTHONASYNCIODEBUG/-X dev
# and the same handle format as its loop's "Executing ... took"; not in typeshed)
from asyncio.base_events import _format_handle  # type: ignore[attr-defined]
from asyncio.coroutines import _is_debug_mode  # type: ignore[attr-defined]
from asyncio.events import _get_running_loop, _set_running_loop
from asyncio.log import logger as _asyncio_log
from typing import TYPE_CHECKING, Any, Callable

from aoprim import AtomicInt

from ..handler import Handler

if TYPE_CHECKING:
    from collections.abc import Iterable

    from typing_extensions import Buffer

    from ..loop import EventLoop, Timer
    from ..server import Server
    from ..session import Session

__all__ = ["ProtocolHandler", "SessionTransport"]

log = logging.getLogger("aoprim.server")
_asyncio_log = logging.getLogger("asyncio")
# what a protocol callback raises and asyncio's loop lets through: everything else -- an
# Exception, and a CancelledError, GeneratorExit or a test framework's outcome exception
# alike -- goes to the exception handler and ends that connection only
_NOT_CAUGHT = (SystemExit, KeyboardInterrupt)
_get_ident = threading.get_ident

# what asyncio's TLS transport answers in get_extra_info (and the session's ALPN name)
# what asyncio's TLS transport says of a protocol callback that raised, where it differs
# from "Fatal error on SSL protocol"
_TLS_FATAL = {"connection_made": "Fatal error: protocol.buffer_updated() call failed.",
              "eof_received": "Error calling eof_received()"}

_TLS_NAMES = frozenset(("sslcontext", "ssl_object", "peercert", "cipher", "compression",
                        "selected_alpn_protocol"))

# the transport whose connection's context this is (set in each connection's own context,
# so also seen in the copies its tasks and callbacks run in): a callback of that connection
# reached from inside one of them runs in the caller's context, as asyncio's
_CONN: contextvars.ContextVar[SessionTransport | None] = contextvars.ContextVar(
    "aoprim_protocol_connection", default=None)


class ProtocolLoop(asyncio.AbstractEventLoop):
    """The running loop a protocol's callbacks see (``asyncio.get_running_loop()``, and so
    ``asyncio.sleep``, ``asyncio.timeout``, ``wait_for``, tasks and futures): asyncio's
    scheduling API over the server's event loop.  One per server.

    Offered: ``time``, ``call_soon``, ``call_later``, ``call_at``, ``call_soon_threadsafe``
    (asyncio ``Handle``/``TimerHandle`` objects, cancellable), ``create_future``,
    ``create_task`` (and the task factory), ``run_in_executor``, ``get_debug``/``set_debug``,
    ``is_running``/``is_closed``, the exception handler methods.  What runs through them
    runs on the server's loop thread, with this loop set as the running loop.  Everything
    else asyncio's loops do (I/O: ``create_connection``, ``sock_*``, ``add_reader``, ...;
    ``run_until_complete``, ``stop``, ``close``, signal handlers: the server runs and closes
    it) raises ``NotImplementedError`` naming the method."""

    def __init__(self, ev: EventLoop, server: Server) -> None:
        self._ev = ev
        self._server = weakref.ref(server)     # (no cycle: the server holds our handler)
        self._pid = os.getpid()     # the serving process's (see _fork_check)
        self._exception_handler: Callable[..., object] | None = None
        self._task_factory: Callable[..., Any] | None = None
        # run_in_executor(None, ...): made at the first call, shut down with the server
        self._default_executor: ThreadPoolExecutor | None = None
        self._executor_shut = False
        self._executor_lock = threading.Lock()
        # timer arms and cancels from other threads, for the loop thread (see _post)
        self._xq: list[tuple[bool, asyncio.TimerHandle]] = []
        self._xq_posted = False
        self._xlock = threading.Lock()
        # loop-thread call_soon calls so far: a delivery that queued some (a call_soon, a
        # task woken) is followed by those callbacks before the next (see on_read)
        self._nsoon = 0
        # asyncio's debug mode (PYTHONASYNCIODEBUG, -X dev, set_debug): a callback that takes
        # slow_callback_duration or longer is logged, as asyncio's "Executing ... took"
        self._debug = _is_debug_mode()
        self.slow_callback_duration = 0.1
        # async generators first iterated in its callbacks (sys.set_asyncgen_hooks, as
        # asyncio's loop): one dropped unfinished is closed with aclose() in a task, those
        # alive at the server's shutdown are closed then (see _shutdown_asyncgens)
        self._asyncgens: weakref.WeakSet[Any] = weakref.WeakSet()
        self._asyncgens_shut = False
        self._agen_lock = threading.Lock()      # (the finalizer runs on any thread: GC)
        self._agen_hooks = (self._asyncgen_firstiter_hook, self._asyncgen_finalizer_hook)

    # -- time and callbacks ----------------------------------------------------------------
    def time(self) -> float:
        return self._ev.clock()

    def call_soon(self, callback: Callable[..., object],      # type: ignore[override]
                  *args: Any,
                  context: contextvars.Context | None = None) -> asyncio.Handle:
        h = _Handle(callback, args, self, context)
        h.drop_frame()              # (debug mode: the caller's line is where it was made)
        ev = self._ev
        if _get_ident() == ev.thread_id:
            self._nsoon += 1
            ev.call_soon(self._run_handle, h)
            return h
        st = getattr(_here, "strand", None)
        if st is not None and not ev.closed:
            # inside a protocol callback on a worker: handed over once it returns, behind
            # what it did to its session (a pause_reading, its writes), as asyncio runs it
            st.keep(self._run_handle, h)
        elif not ev.call_soon_threadsafe(self._run_handle, h):
            raise RuntimeError("Event loop is closed (the server has shut down)")
        return h

    call_soon_threadsafe = call_soon      # type: ignore[assignment]

    def call_later(self, delay: float,      # type: ignore[override]
                   callback: Callable[..., object], *args: Any,
                   context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if delay is None:
            raise TypeError("delay must not be None")
        h = self.call_at(self.time() + delay, callback, *args, context=context)
        h.drop_frame()              # (debug mode: the caller's line is where it was made)
        return h

    def call_at(self, when: float,      # type: ignore[override]
                callback: Callable[..., object], *args: Any,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        if type(when) is not float:
            # refused here, on the caller's thread (a worker's arm runs later, on the loop
            # thread), by the rule of the loop's own deadlines: a number, never a str
            if isinstance(when, (str, bytes, bytearray)):
                raise TypeError(f"when must be a number, not {type(when).__name__}")
            when = float(when)
        h = _Timer(when, callback, args, self, context)
        h.drop_frame()              # (debug mode: the caller's line is where it was made)
        if _get_ident() == self._ev.thread_id:
            self._arm(h)
            return h
        st = getattr(_here, "strand", None)
        if st is not None and not self._ev.closed:
            st.keep_timer(h)                # (as call_soon: once the callback returns)
        elif not self._post(True, h):
            raise RuntimeError("Event loop is closed (the server has shut down)")
        return h

    def _post(self, arm: bool, h: asyncio.TimerHandle) -> bool:
        """Another thread's timer arm (``arm``) or cancel, handed to the loop thread, which
        owns the timer heap.  Batched: one wakeup for all those posted before the loop
        takes them -- a worker's data_received that cancels an idle timer and arms the
        next costs one, as the arm alone did.  False once the loop is closed."""
        with self._xlock:
            self._xq.append((arm, h))
            if self._xq_posted:
                return True
            self._xq_posted = True
        if self._ev.call_soon_threadsafe(self._run_posted):
            return True
        with self._xlock:
            self._xq.clear()
            self._xq_posted = False
        return False

    def _run_posted(self) -> None:
        with self._xlock:
            items, self._xq = self._xq, []
            self._xq_posted = False
        for arm, h in items:        # (in the order posted: an arm before its cancel)
            if arm:
                self._arm(h)        # type: ignore[arg-type]
            else:
                self._disarm(h)

    def _arm(self, h: _Timer) -> None:
        if not h.cancelled():
            when = h.when()
            if when != when:        # NaN: asyncio runs it in the next iteration, as if due
                when = 0.0          # (the native loop refuses NaN; 0.0 is in the past)
            h._ev_timer = self._ev.call_at(when, self._due, h)

    def _due(self, h: _Timer) -> None:
        # asyncio moves a due timer to the end of its ready queue, behind the callbacks
        # queued before -- a call_soon made just after call_later(0) runs first.  The
        # server loop runs its timers before its queued callbacks: the handle joins them
        self._ev.call_soon(self._run_handle, h)

    def _owns_this_thread(self) -> bool:
        """Whether the calling thread is one the server made (start()'s loop thread, a
        worker): it ends with the server."""
        srv = self._server()
        if srv is None:
            return False
        t = threading.current_thread()
        d = getattr(srv, "_dispatch", None)
        return t is getattr(srv, "_thread", None) or (d is not None and t in d.threads)

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        ev = self._ev
        if _get_ident() == ev.thread_id:
            t = getattr(handle, "_ev_timer", None)
            if t is not None:
                t.cancel()
        else:
            # the server loop's timers are its thread's: the cancel is handed to it, so a
            # timer cancelled from a worker (an idle timer reset per request) leaves the
            # heap at once, not at its deadline.  Queued behind this thread's arm of it, if
            # that has not run yet (then _arm finds the handle cancelled and arms nothing)
            self._post(False, handle)

    @staticmethod
    def _disarm(handle: asyncio.TimerHandle) -> None:
        t = getattr(handle, "_ev_timer", None)
        if t is not None:
            handle._ev_timer = None         # type: ignore[attr-defined]
            t.cancel()

    def _run_handle(self, h: _Handle | _Timer) -> None:
        if h.cancelled():
            return
        # with workers: a callback or task step of a connection (run in its context or a
        # copy) waits while a worker runs one of that connection's protocol callbacks
        tr = h.connection()
        if tr is not None and tr._strand is not None:
            tr._strand.run_or_defer(self._fire, h)
            return
        self._fire(h)

    def _fire(self, h: _Handle | _Timer) -> None:
        if h.cancelled():           # (again: one the strand kept may be cancelled since)
            return
        try:
            if self._debug:
                t0 = self.time()
                _call(self, h.fire)
                self._check_slow(t0, h)
                return
            _call(self, h.fire)     # (asyncio's: an exception goes to call_exception_handler)
        except _NOT_CAUGHT as e:
            # what asyncio's Handle and Task let through (a task step's too)
            self._fork_check(e)
            raise

    def _fork_check(self, e: BaseException) -> None:
        """``e`` (SystemExit, KeyboardInterrupt) leaves a loop callback, a task step or
        ``pause_writing``/``resume_writing``.  In a process the protocol's code forked from
        the server's, it must end the fork there, as the same exception out of a protocol
        callback does -- not unwind the loop thread (``start()``'s: the fork's only
        thread ends, status 0) or reach ``serve_forever()``'s caller in the fork.  The
        server's loop hands a callback's exception in a fork to the fork's end (the
        ``forked()`` contract of its event loop: "one that raises calls ``end(where,
        exc)``"), which exits with a ``SystemExit``'s status: raised as :class:`_ForkExit`,
        a ``SystemExit`` the loop catches as an ``Exception``."""
        if os.getpid() != self._pid:
            code = e.code if isinstance(e, SystemExit) else 1
            raise _ForkExit(code) from e

    def _check_slow(self, t0: float, what: object) -> None:
        """Debug mode: log a callback that ran ``slow_callback_duration`` or longer, with
        asyncio's words and logger."""
        dt = self.time() - t0
        if dt >= self.slow_callback_duration:
            _asyncio_log.warning("Executing %s took %.3f seconds",
                                 _format_handle(what) if isinstance(what, asyncio.Handle)
                                 else what, dt)

    # -- futures, tasks, executor ----------------------------------------------------------
    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(self, coro: Any, *, name: str | None = None,
                    context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        factory = self._task_factory
        if factory is None:
            if context is None:
                task = asyncio.Task(coro, loop=self, name=name)
            else:
                task = asyncio.Task(coro, loop=self, name=name, context=context)
            if task._source_traceback:      # (debug mode) as asyncio's loop: drop this
                del task._source_traceback[-1]  # frame, the caller's line is the last
            return task
        if _get_ident() != self._ev.thread_id:
            # another thread (a worker): the task must not start eagerly here.  asyncio's
            # current task is one per loop, not per thread, and the loop thread may be
            # running another task's step at this moment -- the two would swap it under
            # each other and every later step would fail ("Cannot enter into task").
            # asyncio's Task starts eagerly only while loop.is_running(): it answers
            # False to this thread for the factory's call (see is_running), so any eager
            # factory -- asyncio.eager_task_factory, create_eager_task_factory(...) --
            # schedules the first step on the loop thread instead
            prev = getattr(_here, "not_eager", False)
            _here.not_eager = True
            try:
                task = self._call_factory(factory, coro, context)
            finally:
                _here.not_eager = prev
        else:
            task = self._call_factory(factory, coro, context)
        if name is not None:
            task.set_name(name)
        return task   # type: ignore[no-any-return]

    def _call_factory(self, factory: Callable[..., Any], coro: Any,
                      context: contextvars.Context | None) -> Any:
        # as asyncio's loop: the factory is called (loop, coro[, context=]), then named
        if context is None:
            return factory(self, coro)
        return factory(self, coro, context=context)

    def set_task_factory(self, factory: Callable[..., Any] | None) -> None:
        if factory is not None and not callable(factory):
            raise TypeError("task factory must be a callable or None")
        self._task_factory = factory

    def get_task_factory(self) -> Callable[..., Any] | None:
        return self._task_factory

    def run_in_executor(self, executor: Any,      # type: ignore[override]
                        func: Callable[..., Any],
                        *args: Any) -> asyncio.Future[Any]:
        """``executor.submit(func, *args)`` as an asyncio future.  ``executor=None``
        (``asyncio.to_thread`` too): the default executor -- as asyncio's, one
        ``ThreadPoolExecutor`` of at most ``min(32, cpu + 4)`` threads, made at the first
        call, or the one given to :meth:`set_default_executor`; it is shut down with the
        server, which waits (up to ``shutdown_timeout``) for the calls still running."""
        if executor is None:
            with self._executor_lock:
                if self._ev.closed or self._executor_shut:
                    raise RuntimeError("Executor shutdown has been called (the server has "
                                       "shut down)")
                executor = self._default_executor
                if executor is None:
                    executor = self._default_executor = ThreadPoolExecutor(
                        max_workers=min(32, (os.cpu_count() or 1) + 4),
                        thread_name_prefix="aoprim-protocol-executor")
        return asyncio.wrap_future(executor.submit(func, *args), loop=self)

    def set_default_executor(self, executor: Any) -> None:
        if not isinstance(executor, ThreadPoolExecutor):
            raise TypeError("executor must be ThreadPoolExecutor")
        with self._executor_lock:
            self._default_executor = executor

    # -- async generators (asyncio's hooks) ------------------------------------------------
    def _asyncgen_firstiter_hook(self, agen: Any) -> None:
        if self._asyncgens_shut:
            warnings.warn(f"asynchronous generator {agen!r} was scheduled after "
                          f"loop.shutdown_asyncgens() call", ResourceWarning, source=self)
        with self._agen_lock:
            self._asyncgens.add(agen)

    def _asyncgen_finalizer_hook(self, agen: Any) -> None:
        # (any thread: the one whose GC dropped the generator) its aclose() as a task
        with self._agen_lock:
            self._asyncgens.discard(agen)
        if not self.is_closed():
            try:
                self.call_soon_threadsafe(self.create_task, agen.aclose())
            except RuntimeError:
                pass                # (the loop closed meanwhile: as a closed asyncio loop)

    def _shutdown_asyncgens(self, done: Callable[[], None]) -> None:
        """Close the async generators still alive (as asyncio's ``shutdown_asyncgens``, which
        ``asyncio.run`` calls once the tasks are cancelled): each one's ``aclose()`` in a
        task; ``done()`` once all finished (the server's ``shutdown_timeout`` bounds the
        wait, as for the tasks)."""
        with self._agen_lock:
            self._asyncgens_shut = True
            gens = list(self._asyncgens)
            self._asyncgens.clear()
        if not gens:
            done()
            return
        left = len(gens)

        def one_done(t: asyncio.Task[Any], agen: Any) -> None:
            nonlocal left
            if not t.cancelled() and t.exception() is not None:
                self.call_exception_handler({
                    "message": f"an error occurred during closing of asynchronous "
                               f"generator {agen!r}",
                    "exception": t.exception(), "asyncgen": agen})
            left -= 1
            if left == 0:
                done()

        for agen in gens:
            t = self.create_task(agen.aclose())
            t.add_done_callback(functools.partial(one_done, agen=agen))

    # -- shutdown (the server's, loop thread) ----------------------------------------------
    def _cancel_tasks(self, done: Callable[[], None]) -> None:
        """Cancel the tasks still pending (as ``asyncio.run`` does at its end) and call
        ``done()`` once every one has finished its cancellation -- and those it started
        meanwhile theirs.  The server's ``shutdown_timeout`` bounds the wait: the loop
        stops then, dropping what is left."""
        tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
        if not tasks:
            done()
            return
        left = len(tasks)

        def one_done(t: asyncio.Task[Any]) -> None:
            nonlocal left
            if not t.cancelled() and t.exception() is not None:
                self.call_exception_handler({
                    "message": "unhandled exception during the server's shutdown",
                    "exception": t.exception(), "task": t})
            left -= 1
            if left == 0:
                self._cancel_tasks(done)

        for t in tasks:
            t.cancel()
            t.add_done_callback(one_done)

    def _shutdown_executor(self, timeout: float) -> None:
        """The default executor shut down: queued calls dropped, the running ones waited
        for up to ``timeout`` seconds (after the loop stopped)."""
        with self._executor_lock:
            self._executor_shut = True
            ex, self._default_executor = self._default_executor, None
        if ex is None:
            return
        ex.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for th in list(getattr(ex, "_threads", ())):
            th.join(max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                log.error("the protocols' default executor did not finish within %.1f s: "
                          "a call to run_in_executor()/to_thread() is still running", timeout)
                return

    # -- state -----------------------------------------------------------------------------
    def get_debug(self) -> bool:
        return self._debug

    def set_debug(self, enabled: bool) -> None:
        self._debug = bool(enabled)

    def is_running(self) -> bool:
        # (False inside a task factory called off the loop thread: see create_task)
        return not self._ev.closed and not getattr(_here, "not_eager", False)

    def is_closed(self) -> bool:
        return self._ev.closed

    # -- errors ----------------------------------------------------------------------------
    def get_exception_handler(self) -> Callable[..., object] | None:
        return self._exception_handler

    def set_exception_handler(self, handler: Callable[..., object] | None) -> None:
        if handler is not None and not callable(handler):
            raise TypeError(f"A callable object or None is expected, got {handler!r}")
        self._exception_handler = handler

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        extra = "".join(f"\n{k}: {_context_value(k, v)}" for k, v in context.items()
                        if k not in ("message", "exception"))
        # on asyncio's logger, as asyncio's loop logs it: logging set up for asyncio's
        # messages sees these too
        _asyncio_log.error("%s%s", context.get("message", "Unhandled exception in a "
                                               "protocol's loop callback"), extra,
                  exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        """As asyncio's: the handler set (or the default one) gets ``context``; nothing it
        raises -- but SystemExit and KeyboardInterrupt -- reaches the caller (a protocol
        callback, the server's flush): the default handler logs it, and what the default
        handler itself raises (formatting a context whose ``repr()`` fails) is logged
        once more, plainly."""
        handler = self._exception_handler
        if handler is None:
            try:
                self.default_exception_handler(context)
            except _NOT_CAUGHT:
                raise
            except BaseException:
                _asyncio_log.error("Exception in default exception handler", exc_info=True)
            return
        try:
            handler(self, context)
        except _NOT_CAUGHT:
            raise
        except BaseException as e:
            # as asyncio's loop (a CancelledError too): one record, on its logger, with the
            # context it was handling
            try:
                self.default_exception_handler({
                    "message": "Unhandled error in exception handler", "exception": e,
                    "context": context})
            except _NOT_CAUGHT:
                raise
            except BaseException:
                _asyncio_log.error("Exception in default exception handler while handling "
                                   "an unexpected error in custom exception handler",
                                   exc_info=True)

    def __repr__(self) -> str:
        return f"<ProtocolLoop over {self._ev!r}>"


def _context_value(key: str, value: Any) -> str:
    """One value of an exception handler's context as asyncio's default handler writes it:
    the creation tracebacks of debug mode as tracebacks, anything else by its repr."""
    if key in ("source_traceback", "handle_traceback") and isinstance(value, list):
        what = "Object" if key == "source_traceback" else "Handle"
        tb = "".join(traceback.format_list(value)).rstrip()
        return f"{what} created at (most recent call last):\n{tb}"
    return repr(value)


def _callback_failed(loop: ProtocolLoop, fn: Callable[..., Any], args: tuple[Any, ...],
                     e: BaseException) -> None:
    """``fn(*args)`` raised where asyncio would have run it as a loop callback
    (connection_made, connection_lost): the exception handler gets what asyncio's
    ``Handle`` gives it -- "Exception in callback ...", the exception and the handle."""
    h = asyncio.Handle(fn, args, loop)
    text = repr(h)                      # "<Handle P.connection_made(<transport>)>"
    cb = text[len("<Handle "):-1] if text.startswith("<Handle ") else text
    loop.call_exception_handler({"message": f"Exception in callback {cb}",
                                 "exception": e, "handle": h})


def _not_offered(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: ProtocolLoop, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{name}() is not offered by the loop serve_protocol's callbacks run on: the "
            "server owns its loop and its I/O (docs/server.md, serve_protocol)")
    # asyncio's signature, for inspect.signature (help(), the stubs' check); raised at the
    # call, coroutine methods included
    functools.update_wrapper(method, original)
    method.__qualname__ = f"ProtocolLoop.{name}"
    return method


# every other AbstractEventLoop method: a message naming it, instead of asyncio's bare
# NotImplementedError()
for _name, _value in vars(asyncio.AbstractEventLoop).items():
    if callable(_value) and not _name.startswith("_") and _name not in vars(ProtocolLoop):
        setattr(ProtocolLoop, _name, _not_offered(_name, _value))
del _name, _value


class _ForkExit(SystemExit, Exception):
    """A ``sys.exit(n)`` (or a ``KeyboardInterrupt``: 1) out of a loop callback in a process
    forked from the server's: an ``Exception`` too, so the server's loop hands it to the
    fork's end, which exits with its status (see ``ProtocolLoop._fork_check``)."""


class _Run:
    """What the adapter's handles add to asyncio's: ``fire()`` runs one as a loop does (its
    context, an exception to the loop's exception handler); ``connection()``; and the repr
    of asyncio's own class (``<Handle ...>``, ``<TimerHandle when=...>``), as log lines and
    debug output name them there."""
    __slots__ = ()
    _shown_as = "Handle"

    def fire(self) -> None:
        self._run()         # type: ignore[attr-defined]

    def connection(self) -> SessionTransport | None:
        """The connection whose context (or a copy of it) this runs in, if any."""
        return self._context.get(_CONN)     # type: ignore[attr-defined,no-any-return]

    def drop_frame(self) -> None:
        """Debug mode: drop the innermost frame of the creation traceback (the adapter's
        call), so it ends at the protocol's own line."""
        if self._source_traceback:          # type: ignore[attr-defined]
            del self._source_traceback[-1]  # type: ignore[attr-defined]

    def _repr_info(self) -> list[str]:
        info: list[str] = super()._repr_info()     # type: ignore[misc]
        info[0] = self._shown_as
        return info


class _Handle(_Run, asyncio.Handle):
    """asyncio's Handle (see _Run)."""
    __slots__ = ()


class _Timer(_Run, asyncio.TimerHandle):
    """asyncio's TimerHandle (see _Run), with the server loop's timer that fires it."""
    __slots__ = ("_ev_timer",)
    _shown_as = "TimerHandle"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if self._source_traceback:      # (this __init__'s frame)
            del self._source_traceback[-1]
        self._ev_timer: Timer | None = None


# .loop: the ProtocolLoop set for good as this thread's running loop (a thread of the server's
# own: its loop thread when it serves in the background, a worker)
_here = threading.local()


def _call(loop: ProtocolLoop, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``loop`` as this thread's running loop (and its async generator
    hooks installed, as asyncio's loop does while it runs).  On a thread the server
    owns (``start()``'s loop thread, a worker: they end with the server) it is set once and
    stays -- asyncio's C ``_set_running_loop`` costs a microsecond a call on 3.11; on any
    other (``serve_forever()``'s caller) it is set for the call and the previous one
    restored after (calls nest), so nothing is left behind once the server returns."""
    if getattr(_here, "loop", None) is loop:
        return fn(*args)
    if loop._owns_this_thread():
        _set_running_loop(loop)
        sys.set_asyncgen_hooks(*loop._agen_hooks)
        _here.loop = loop
        return fn(*args)
    prev = _get_running_loop()
    prev_hooks = sys.get_asyncgen_hooks()
    _set_running_loop(loop)
    sys.set_asyncgen_hooks(*loop._agen_hooks)
    try:
        return fn(*args)
    finally:
        sys.set_asyncgen_hooks(*prev_hooks)
        _set_running_loop(prev)


def _in_context(tr: SessionTransport, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the connection's context -- as it is, when called from inside it
    (a context cannot be entered twice)."""
    if _CONN.get() is tr:
        return fn(*args)
    return tr._ctx.run(fn, *args)


class _Strand:
    """With ``workers=N``: one connection's code never runs on two threads at once, as on
    asyncio's one thread.  Its protocol callbacks run on a worker (``data_received``,
    ``eof_received``, ``connection_lost``), its tasks and loop callbacks on the loop thread;
    asyncio's objects that both touch (an ``Event`` that ``data_received`` sets and a task
    waits on, a ``Future``, a task's state) are not made for two threads.  So a worker
    holds the connection's strand while a protocol callback runs (``enter``/``leave``),
    and the loop thread runs the connection's callbacks and task steps -- those whose
    context is the connection's or a copy of it -- only while it can take the strand
    (``run_or_defer``); one it cannot is kept, in order, and handed back to the loop
    thread when the worker leaves.  What a protocol callback schedules therefore runs
    after it returns, as on asyncio's loop.

    What the worker's protocol callback itself schedules (``call_soon``, a task it wakes, a
    timer) is kept the same way and handed over when it leaves -- after what the callback
    did to its session meanwhile (a ``pause_reading``, its writes), which goes to the loop
    thread at once: asyncio applies those at once, and runs the scheduled code later.

    ``_lock`` is held by whoever runs the connection's code; ``_m`` makes "the loop thread
    found the strand taken and kept a callback" and "the worker gave the strand back and
    took the kept callbacks" one step each, so that no kept callback is missed.  ``_owner``
    (the holding thread's ident) lets a callback that runs inside another on the same
    thread (``pause_writing`` inside a ``write``) pass; only the holder writes it.  Each
    kept item is a call for the loop thread (a loop callback or task step to run, a timer
    to arm); they are handed over together, as one loop callback that runs them where the
    worker's callback returned (``_handed_over``), so they take effect in one step, as the
    callback's own calls do on asyncio's one thread."""
    __slots__ = ("_lock", "_m", "_owner", "_depth", "_kept", "_ev")

    def __init__(self, ev: EventLoop) -> None:
        self._lock = threading.Lock()
        self._m = threading.Lock()
        self._owner = 0
        self._depth = 0
        # (fn, args) to call; (None, (timer,)) a timer to arm
        self._kept: list[tuple[Callable[..., object] | None, tuple[Any, ...]]] = []
        self._ev = ev

    def enter(self) -> None:
        """Take the strand (waiting while the loop thread runs one of the connection's
        callbacks: a task step, short)."""
        me = _get_ident()
        if self._owner == me:
            self._depth += 1
            return
        self._lock.acquire()
        self._owner = me
        self._depth = 1
        _here.strand = self

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` holding the strand (``enter``/``leave`` around it)."""
        self.enter()
        try:
            return fn(*args)
        finally:
            self.leave()

    def keep(self, fn: Callable[..., object], *args: Any) -> None:
        """The holder: ``fn(*args)`` on the loop thread once it leaves, in order with the
        rest kept."""
        with self._m:
            self._kept.append((fn, args))

    def keep_timer(self, h: _Timer) -> None:
        """The holder: arm timer ``h`` once it leaves (``_handed_over``)."""
        with self._m:
            self._kept.append((None, (h,)))

    def leave(self) -> None:
        """Give the strand back; what was kept meanwhile goes to the loop thread, in
        order."""
        self._depth -= 1
        if self._depth:
            return
        _here.strand = None
        with self._m:
            self._owner = 0
            self._lock.release()
            kept, self._kept = self._kept, []
        if kept:
            # (a hand-over to a closed loop fails quietly: the server is gone)
            ev = self._ev
            if _get_ident() == ev.thread_id:
                ev.call_soon(_handed_over, kept)
            else:
                ev.call_soon_threadsafe(_handed_over, kept)

    def run_or_defer(self, fn: Callable[..., object], *args: Any) -> None:
        """Loop thread: ``fn(*args)`` holding the strand, or kept for the worker's
        ``leave`` if a worker holds it."""
        if self._owner == _get_ident():
            fn(*args)
            return
        with self._m:
            if not self._lock.acquire(False):
                self._kept.append((self.run_or_defer, (fn, *args)))
                return
            self._owner = _get_ident()
            self._depth = 1
            _here.strand = self
        try:
            fn(*args)
        finally:
            self.leave()


def _handed_over(kept: list[tuple[Callable[..., object] | None, tuple[Any, ...]]]) -> None:
    """Loop thread: what a strand kept while a worker ran a protocol callback (see
    _Strand.keep), where the callback returned -- as the iteration after that callback on
    asyncio's one thread: its loop callbacks and task steps run here, in order, then its
    timers that are due already (asyncio moves them to its ready queue behind those, in
    deadline order); the others are armed."""
    due: list[_Timer] = []
    for fn, args in kept:
        if fn is not None:
            fn(*args)
            continue
        h: _Timer = args[0]
        loop: ProtocolLoop = h._loop
        if not h.when() > loop._ev.clock():     # (NaN: due)
            due.append(h)
        else:
            loop._arm(h)
    due.sort(key=_deadline)         # (stable: equal deadlines in the order armed)
    for h in due:
        h._loop._run_handle(h)


def _deadline(h: _Timer) -> float:
    w = h.when()
    return w if w == w else float("-inf")       # (NaN: first, as asyncio runs it at once)


def _on_strand(st: _Strand | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, holding ``st`` if the connection has one (workers)."""
    return fn(*args) if st is None else st.run(fn, *args)


class SessionTransport(asyncio.Transport):
    """An ``asyncio.Transport`` over one session."""

    def __init__(self, session: Session, protocol: asyncio.BaseProtocol,
                 loop: ProtocolLoop, ctx: contextvars.Context) -> None:
        super().__init__({"peername": session.peer})
        self._session = session
        self._loop = loop
        self._ctx = ctx             # the connection's own context: its callbacks run in it
        self._tls = session.get_extra_info("ssl_object") is not None
        self._stage = "data_received"     # the receive callback running (its error message)
        self._undelivered = 0   # bytes of the read in hand not yet taken (see _failed)
        self._protocol: Any = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        self._closing = False
        self._lost_writes = 0       # write() calls dropped after close (see _dropped)
        self._lost = False          # connection_lost was called
        self._paused_reading = False
        self._low = self._high = 0
        # The protocol's writing state, which the loop thread's flush and a worker's
        # write() both may change: 0 writing; 1 a worker's write() is pausing it (its
        # pause_writing() runs); 2 paused, and a resume_writing() may come; 3 (workers)
        # the flush decided to pause while a callback of the connection ran: told by that
        # callback's next write() (3 -> 1) or after it (3 -> 2), or undone by the low mark
        # first (3 -> 0).  Exactly one of them pauses (0 -> 1, 0 -> 2 or through 3), and
        # the resume (2 -> 0, the loop thread at the low mark) never overtakes a worker's
        # pause_writing() still running.
        # AtomicInt is sequentially consistent: a worker's store(2) comes before its
        # writer_paused() push (the session queue's lock orders the two for the loop)
        self._told = AtomicInt(0)
        self._sock: Any = None          # get_extra_info("socket"), made at the first ask
        # with workers: the connection's code on one thread at a time (see _Strand)
        self._strand = _Strand(session._loop) if session.work is not None else None
        session.set_transport_rules()
        self.set_write_buffer_limits()

    # -- writing -------------------------------------------------------------------------
    def _dropped(self) -> None:
        # as asyncio's transports: a protocol that writes on to a closed connection is
        # told so, once a write, from the fifth on -- counting as asyncio does: its TCP
        # transport counts the close itself as one, its TLS transport only the connection's
        # loss (a close still flushing does not)
        n = self._lost_writes
        self._lost_writes = n + 1
        if not self._tls or self._lost:
            n += 1
        if n >= 5:
            _asyncio_log.warning("SSL connection is closed" if self._tls
                                 else "socket.send() raised exception.")

    def write(self, data: Buffer) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, "
                            f"not {type(data).__name__!r}")
        if not data:
            return
        s = self._session
        if self._closing:
            # while the backlog from before close() is still being sent, asyncio's TCP
            # transport queues it too (plain TCP, the loop thread); otherwise dropped
            if self._tls or s.over_max_pending() or not s.send_after_close(data):
                self._dropped()
            return
        told = self._told.load()
        if s.over_max_pending(told == 1 or told == 2):
            return          # (dropped: connection_lost gets the error naming max_pending)
        sk = self._sock
        if sk is not None and sk.wr_shut and _get_ident() != self._loop._ev.thread_id:
            # after this thread's get_extra_info("socket").shutdown(SHUT_WR), which runs
            # later on the loop thread: the bytes follow it there, where the send fails
            # as it does after a shutdown on the loop thread (EPIPE: connection_lost gets
            # the BrokenPipeError), instead of reaching the peer ahead of the FIN
            self._loop._ev.call_soon_threadsafe(s.send, bytes(data))
            return          # (False once the server has shut down: dropped, as after close)
        s.send(data)
        if _get_ident() != self._loop._ev.thread_id:
            # a worker's write: its bytes wait for the loop thread, which would pause the
            # protocol only at its flush -- while this callback writes on without limit.
            # Paused here instead, before write() returns, as asyncio's write() does, for
            # the backlog the socket will not take: asyncio counts what is left after it
            # tried the socket; here nothing was offered to it yet, so what the kernel may
            # still take (send_room) is allowed for on top of the high mark.  Or the loop
            # thread's flush decided it first (3), beside this callback: told here.  The
            # session resumes the protocol once the loop drained the backlog to the low
            # mark
            told = self._told.load()
            if told == 0:
                u = s.unsent_bytes()
                pause = (u > self._high and u > self._high + s.send_room()
                         and self._told.compare_exchange(0, 1))
            else:
                pause = told == 3 and self._told.compare_exchange(3, 1)
            if pause:
                try:
                    self._flow("pause_writing")
                finally:
                    # done: a resume may come now.  The loop thread learns of the pause
                    # behind this worker's sends (a resume it skipped while the pause
                    # ran comes then, if the backlog is already down to the low mark)
                    self._told.store(2)
                    s.writer_paused()

    def writelines(self, list_of_data: Iterable[Buffer]) -> None:
        data = b"".join(list_of_data)
        if data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError(
            "write_eof() is not supported by serve_protocol's transport (can_write_eof() is "
            "False: the server's sessions do not half-close; close() ends the stream after "
            "what was written) -- docs/server.md")

    def get_write_buffer_size(self) -> int:
        # (with workers, what this worker wrote may still be queued for the loop thread)
        return self._session.unsent_bytes()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            # asyncio's defaults: 64 KiB over TCP, 512 KiB over TLS (its SSL transport's)
            high = 4 * low if low is not None else (512 if self._tls else 64) * 1024
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._session.set_write_limits(high, low, self._pause_writing, self._resume_writing)

    def _pause_writing(self) -> None:
        # (the session's on_high, loop thread: not again if a worker's write() paused the
        # protocol; on this thread the pause is over before any resume can come)
        st = self._strand
        if st is None or _CONN.get() is self:
            if self._told.compare_exchange(0, 2):
                self._flow("pause_writing")
            return
        # with workers: decided here (3), told once no callback of the connection runs --
        # by a worker's next write() inside its callback, or after that callback
        if self._told.compare_exchange(0, 3):
            st.run_or_defer(self._tell_pause)

    def _tell_pause(self) -> None:
        if self._told.compare_exchange(3, 2):       # (not if a worker's write() told it)
            self._flow("pause_writing", False)

    def _resume_writing(self) -> None:
        # (the session's on_low, loop thread: not while a worker's pause_writing() runs --
        # then the session's writer_paused, queued behind it, checks the low mark again)
        st = self._strand
        if st is None or _CONN.get() is self:
            if self._told.compare_exchange(2, 0):
                self._flow("resume_writing")
            return
        if not self._told.compare_exchange(3, 0):   # (a pause never told: none to undo)
            st.run_or_defer(self._tell_resume)

    def _tell_resume(self) -> None:
        if self._told.compare_exchange(2, 0):
            self._flow("resume_writing", False)

    def _flow(self, name: str, inside: bool | None = None) -> None:
        """The protocol's ``pause_writing``/``resume_writing``: inside a write (this
        connection's callback or task) in the caller's context, as asyncio; from the
        flush, in a copy of the connection's context (asyncio: its writer callback's) --
        a copy, as with workers the connection's own may be in use on a worker.  An
        exception goes to the loop's exception handler, as asyncio's."""
        if inside is None:
            inside = _CONN.get() is self
        proto = self._protocol
        try:
            if inside:
                _call(self._loop, getattr(proto, name))
            else:
                _call(self._loop, self._ctx.copy().run, getattr(proto, name))
        except _NOT_CAUGHT as e:
            # inside the protocol's own write() it leaves as it came: the application's
            # code around that write (an ``except Exception``) must not catch a fork's
            # SystemExit; the callback boundary it unwinds to ends the fork.  From the
            # flush no application code is in between: ended here
            if not inside:
                self._loop._fork_check(e)
            raise
        except BaseException as e:
            self._loop.call_exception_handler({
                "message": f"protocol.{name}() failed", "exception": e,
                "transport": self, "protocol": proto})

    # -- reading -------------------------------------------------------------------------
    def is_reading(self) -> bool:
        # (False once closing, whoever closed: the protocol, the peer's EOF, a limit)
        return not self._paused_reading and not self._closing and not self._session.closed

    def pause_reading(self) -> None:
        if self._closing or self._paused_reading:
            return
        self._paused_reading = True
        self._session.pause_reading()

    def resume_reading(self) -> None:
        if self._closing or not self._paused_reading:
            return
        self._paused_reading = False
        self._session.resume_reading()

    # -- closing -------------------------------------------------------------------------
    def is_closing(self) -> bool:
        return self._closing or self._session.closed

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._session.close()

    def abort(self) -> None:
        # asyncio's write() has tried the socket already: the peer gets what fit
        self._closing = True
        self._session.abort_sending()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        s = self._session
        if name == "peername":
            return s.peer
        if name == "sockname":
            return s.sockname
        if name == "socket":
            # one object per transport, as asyncio's (it holds the session weakly: no
            # cycle keeps a closed session alive); setdefault: one wins a race of threads
            sk = self._sock
            if sk is None:
                sk = self._sock = self._extra.setdefault(  # type: ignore[attr-defined]
                    "socket", s.socket)
            return sk
        if name in _TLS_NAMES:
            # asyncio's TLS transport's names ("sslcontext": uvicorn's is_ssl() asks it to
            # choose the https scheme), from the session's SSLObject; None over plain TCP
            obj = s.get_extra_info("ssl_object")
            if obj is None:
                return default
            if name == "sslcontext":
                return obj.context
            if name == "compression":
                return obj.compression()
            return s.get_extra_info(name, default)
        return super().get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        # later data, eof_received, connection_lost and the write-limit callbacks go to it
        # (a BufferedProtocol gets its bytes through get_buffer/buffer_updated)
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)


class ProtocolHandler(Handler):
    """A Handler that drives one asyncio protocol per session (the transport's current
    one: ``set_protocol`` switches), each callback with the server's :class:`ProtocolLoop`
    as the running loop and in the connection's own ``contextvars.Context``."""

    def __init__(self, protocol_factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self._factory = protocol_factory
        self._loop: ProtocolLoop | None = None
        # the context of the code that made the server (serve_protocol()'s caller, before
        # start()): each connection's context is a copy of it, as asyncio's protocols run
        # in copies of the context that created the server (a ContextVar set before, the
        # decimal context) -- the server's own threads start with an empty one
        self._base_ctx = contextvars.copy_context()
        # connections whose connection_lost has not run yet, and the server's shutdown
        # waiting for them (see _drain_at_shutdown); on_connect/on_close may run on workers
        self._open = 0
        self._drain: Callable[[], None] | None = None
        self._open_lock = threading.Lock()

    def _loop_of(self, session: Session) -> ProtocolLoop:
        ev = session._loop
        loop = self._loop
        if loop is None or loop._ev is not ev:
            loop = self._loop = ProtocolLoop(ev, session.server)   # type: ignore[abstract]  # (I/O: none)
        return loop

    def on_connect(self, session: Session) -> None:
        loop = self._loop_of(session)
        if loop._debug:
            t0 = loop.time()
            self._connect(session, loop)
            loop._check_slow(t0, f"connection_made() of session {session.id}")
            return
        self._connect(session, loop)

    def _connect(self, session: Session, loop: ProtocolLoop) -> None:
        # the connection's own context, copied at accept from the server's maker's
        # (asyncio: its transport's callbacks'): what one connection's callbacks set,
        # another's never see
        ctx = self._base_ctx.copy()
        try:
            _call(loop, ctx.run, self._made, session, loop, ctx)
        except _NOT_CAUGHT:
            raise
        except BaseException as e:
            if isinstance(e, Exception):
                raise               # (the session's handler_failed: logged, closed)
            # the factory raised a CancelledError or the like: that connection only, as
            # asyncio's accept (and as an Exception here)
            session.handler_failed("on_connect", e)

    def _made(self, session: Session, loop: ProtocolLoop, ctx: contextvars.Context) -> None:
        proto = self._factory()
        tr = SessionTransport(session, proto, loop, ctx)
        _CONN.set(tr)
        session.user = tr
        with self._open_lock:
            self._open += 1         # (on_close counts it down; not reached if the factory
                                    # raised: the handler never met the session then)
        try:
            proto.connection_made(tr)
        except _NOT_CAUGHT:
            raise
        except BaseException as e:
            if tr._tls:
                # as asyncio's TLS transport, which calls it from the handshake's end: a
                # fatal error -- the connection is dropped, connection_lost(e)
                self._failed(tr, session, e, "connection_made")
                return
            # as asyncio over TCP (connection_made runs as a loop callback there): logged,
            # and the connection carries on
            _callback_failed(loop, proto.connection_made, (tr,), e)

    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        tr: SessionTransport = session.user
        if tr._closing:
            return
        _on_strand(tr._strand, self._read_held, tr, session, data)

    def _read_held(self, tr: SessionTransport, session: Session,
                   data: memoryview | bytes) -> None:
        # (with workers, a task or timer of the connection may have run while this worker
        # waited for the strand: after its close() or abort() nothing more is delivered;
        # after its pause_reading() the bytes wait, first in line, for resume_reading())
        if tr._closing:
            return
        if tr._paused_reading:
            session.unread(data)
            return
        self._read(tr, session, data)

    def _read(self, tr: SessionTransport, session: Session, data: memoryview | bytes) -> None:
        lp = tr._loop
        n0 = lp._nsoon
        if lp._debug:
            t0 = lp.time()
        try:
            if getattr(_here, "loop", None) is lp:
                tr._ctx.run(self._deliver, tr, session, data)
            else:
                _call(lp, tr._ctx.run, self._deliver, tr, session, data)
        except _NOT_CAUGHT:
            raise
        except BaseException as e:
            self._failed(tr, session, e, tr._stage)
            return
        finally:
            if lp._debug:
                lp._check_slow(t0, f"{tr._protocol!r}.{tr._stage}()")
        if lp._nsoon != n0 and session.work is None and not tr._tls:
            # the protocol queued loop callbacks (workers=0: this is the loop thread): as on
            # asyncio's loop, where each read is a callback of its own, they run before the
            # next delivery -- the rest of this read burst waits in the receiver
            session.hold_for_callbacks()

    def _failed(self, tr: SessionTransport, session: Session, e: BaseException,
                what: str) -> None:
        """A protocol callback raised: as asyncio's transport, the loop's exception handler
        gets it (not for an OSError, which asyncio only logs in debug mode), and the
        connection closes with ``connection_lost(e)`` (counted in ``handler_errors``)."""
        if not isinstance(e, OSError):
            if not tr._tls:
                message = f"Fatal error: protocol.{what}() call failed."
            else:
                # asyncio's TLS transport's words: connection_made runs inside its socket
                # transport's buffer_updated, eof_received in a call of its own, the data
                # callbacks inside its SSL protocol's read
                message = _TLS_FATAL.get(what, "Fatal error on SSL protocol")
            tr._loop.call_exception_handler({
                "message": message, "exception": e, "transport": tr,
                "protocol": tr._protocol})
        # as asyncio's fatal error: the connection closes at once (over TLS without
        # close_notify: the peer sees an unclean end); bytes of this read the protocol
        # never took (a BufferedProtocol's get_buffer or buffer_updated raised midway)
        # would have stayed in the kernel there, whose close then resets the connection --
        # so does ours.  (Over TLS asyncio has read and decrypted them: no reset.)
        left = tr._undelivered
        tr._undelivered = 0
        session.handler_failed(what, e, logged=True, abort=True,
                               reset=left > 0 and not tr._tls)

    def _deliver(self, tr: SessionTransport, session: Session,
                 data: memoryview | bytes) -> None:
        """The bytes to the current protocol: ``data_received``, or a BufferedProtocol's
        ``get_buffer``/``buffer_updated`` as many times as its buffers need.  ``_stage``
        names the callback running (for the exception handler's message)."""
        if not tr._buffered:
            tr._stage = "data_received"
            tr._protocol.data_received(bytes(data))
            return
        n = len(data)
        off = 0
        while off < n:
            proto: Any = tr._protocol
            # (asyncio's: -1 over TCP, "any size"; its TLS transport passes a size)
            tr._stage = "get_buffer"
            tr._undelivered = n - off       # (until it returns: see _failed)
            buf = proto.get_buffer(n - off if tr._tls else -1)
            mv = memoryview(buf).cast("B")
            if not mv.nbytes:
                raise RuntimeError("get_buffer() returned an empty buffer")
            k = min(mv.nbytes, n - off)
            mv[:k] = data[off:off + k]
            mv.release()
            tr._stage = "buffer_updated"
            tr._undelivered = n - off - k
            n0 = tr._loop._nsoon
            proto.buffer_updated(k)
            tr._undelivered = 0
            off += k
            if (off < n and tr._loop._nsoon != n0 and session.work is None
                    and not tr._tls and not tr.is_closing()):
                # it queued loop callbacks (a call_soon, a task woken to process the
                # buffer): as asyncio's loop, where each recv_into is a callback of its
                # own, they run before the buffer is asked for again -- the rest waits
                session.unread(data[off:])
                session.hold_for_callbacks()
                return
            if off < n and (not tr.is_reading() or tr.is_closing()):
                # as asyncio: nothing more for the protocol in this call.  After close()
                # or abort() the rest is dropped; after pause_reading() it is handed
                # back to the session and comes first once reading resumes
                if not tr.is_closing():
                    session.unread(data[off:])
                return
            if not tr._buffered and off < n:
                # set_protocol() to a plain Protocol inside buffer_updated
                tr._stage = "data_received"
                tr._protocol.data_received(bytes(data[off:]))
                return

    def _on_peer_eof(self, session: Session) -> bool:
        """The peer's EOF (see Session._peer_eof_keeps_open): the protocol's
        ``eof_received()``; True keeps the transport open for writing.  An exception:
        as in ``data_received`` (the exception handler, then closed)."""
        tr: SessionTransport | None = session.user
        if tr is None or tr._closing:
            return False
        return bool(_on_strand(tr._strand, self._eof, tr, session))

    def _eof(self, tr: SessionTransport, session: Session) -> bool:
        try:
            keep = bool(_call(tr._loop, _in_context, tr, tr._protocol.eof_received))
        except _NOT_CAUGHT:
            raise
        except BaseException as e:
            self._failed(tr, session, e, "eof_received")
            return True             # (closed by handler_failed)
        if keep and tr._tls:
            _asyncio_log.warning("returning true from eof_received() has no effect when "
                                 "using ssl")
        if not keep or tr._tls:
            # closing from here on, as asyncio's transport closes itself right after (with
            # workers the session's close follows from the loop thread)
            tr._closing = True
        return keep

    def on_close(self, session: Session, exc: BaseException | None) -> None:
        tr: SessionTransport | None = session.user
        if tr is None:
            return                  # (no transport was made: not counted)
        if tr._strand is not None and _get_ident() != tr._loop._ev.thread_id:
            # with workers, on a worker: connection_lost as asyncio's transport schedules
            # it, a loop callback -- behind what the connection's last callback scheduled
            # (a call_soon before its close() runs first, as on asyncio's loop)
            if tr._loop._ev.call_soon_threadsafe(tr._strand.run_or_defer, self._closed,
                                                 session, exc):
                return
        self._closed(session, exc)

    def _closed(self, session: Session, exc: BaseException | None) -> None:
        try:
            self._lost(session, exc)
        finally:
            with self._open_lock:
                self._open -= 1
                drain = self._drain if self._open == 0 else None
                self._drain = None if drain is not None else self._drain
            if drain is not None:
                drain()

    def _lost(self, session: Session, exc: BaseException | None) -> None:
        tr: SessionTransport | None = session.user
        if tr is None:
            return
        _on_strand(tr._strand, self._lost_in, tr, session, exc)

    def _lost_in(self, tr: SessionTransport, session: Session,
                 exc: BaseException | None) -> None:
        tr._closing = True
        tr._lost = True
        session.user = None
        if exc is None:
            # a reset or another socket error: asyncio hands connection_lost the OSError
            # (ConnectionResetError for ECONNRESET); a server limit that cut the session
            # (max_pending, a timeout): the error naming it
            exc = session.lost_error() or session.limit_error()
        proto = tr._protocol
        try:
            _call(tr._loop, _in_context, tr, proto.connection_lost, exc)
        except _NOT_CAUGHT:
            raise
        except BaseException as e:
            # asyncio runs connection_lost as a loop callback: its exception goes to the
            # loop's exception handler
            _callback_failed(tr._loop, proto.connection_lost, (exc,), e)

    # -- the server's shutdown -------------------------------------------------------------
    def _drain_at_shutdown(self, done: Callable[[], None]) -> None:
        """Every session has closed (loop thread): once every ``connection_lost`` has run
        (they follow in callbacks of their own, maybe on workers), cancel the protocols'
        tasks still pending and call ``done()`` once they have run their cancellation --
        as an asyncio server's connections are lost before ``asyncio.run`` cancels the
        tasks left."""
        loop = self._loop
        if loop is None:
            done()
            return

        def cancel() -> None:
            # the tasks, then the async generators left (as asyncio.run)
            _call(loop, loop._cancel_tasks,
                  lambda: _call(loop, loop._shutdown_asyncgens, done))

        def start() -> None:        # (any thread: the last on_close's)
            if _get_ident() == loop._ev.thread_id:
                cancel()
            elif not loop._ev.call_soon_threadsafe(cancel):
                done()

        with self._open_lock:
            if self._open:
                self._drain = start
                return
        start()

    def _after_stop(self, timeout: float) -> None:
        """The loop has stopped: say which tasks the shutdown dropped (a task that swallowed
        its cancellation held the shutdown until ``shutdown_timeout``), then shut the
        default executor down (waiting up to ``timeout`` s for the calls still running)."""
        loop = self._loop
        if loop is None:
            return
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if left:
            log.warning("shutdown: %d protocol task%s still running at shutdown_timeout "
                        "(a cancellation swallowed?) dropped: %s", len(left),
                        "" if len(left) == 1 else "s",
                        ", ".join(repr(t) for t in left[:3]) + (", ..." if len(left) > 3
                                                               else ""))
        loop._shutdown_executor(timeout)
