"""The loop: asyncio's selector loop, whose stream transports are aoprim's and whose every
iteration ends with one flush of all the transports written to during it.

Iteration (``_run_once``)::

    [flush]   only if something was written outside a callback (before the loop started,
              between two run_until_complete calls)
    select(), then run the ready callbacks        -- asyncio's _run_once, compiled
              (aoprim.aio._aioloop.run_once: the wait and _process_events in C, asyncio's
              data and order kept; asyncio's Python _run_once in debug mode, with a
              caller's selector or an overridden _process_events or _add_callback)
    flush     FlushGroup.flush(): every dirty batch, one sendmsg each, one GIL release;
              notify(transport, status) for the few that need attention.  A notification
              (resume_writing()) may write again: the flush is repeated while batches are
              dirty (up to FLUSH_ROUNDS times, then a ready no-op callback makes the next
              select() not sleep) -- no select() sleeps on data still sitting in a batch.
              The flush also runs when a callback raises out of the loop
              (KeyboardInterrupt, SystemExit) and in close().

A write made while the loop sleeps in select() (from a ``signal.signal`` handler or another
thread) wakes the loop: the selector marks the sleep (the loop's ``SleepFlag``, which the
compiled ``write()`` reads), checks the group just before sleeping, and write() wakes a
sleeping loop through its self-pipe.  The flag is also set while the loop is not running
(outside run_forever()): a write made then (between two run_until_complete calls, after
stop() or close()) is handed to the kernel at once, as asyncio's write() does.

Private asyncio names used here (checked on CPython 3.11.7, 3.12.1, 3.13.0): the selector
loop's ``_run_once`` (the fallback; aoprim.aio._aioloop also reads ``_ready``, ``_scheduled``,
``_timer_cancelled_count``, ``_stopping``, ``_clock_resolution``, ``_debug``,
``_remove_reader`` / ``_remove_writer``, the handles' ``_cancelled`` / ``_when`` /
``_scheduled`` / ``_run`` / ``_callback`` / ``_args`` / ``_context`` / ``_loop`` /
``_source_traceback`` (``_cancelled`` / ``_callback`` / ``_args`` / ``_context`` by the slot offsets of
Handle), and the epoll selector's ``_fd_to_key`` / ``_selector``), ``_make_socket_transport`` / ``_make_ssl_transport`` (the
hooks its create_connection / create_server / create_unix_* / connect_accepted_socket /
start_tls paths call), ``_ensure_fd_no_transport``, ``_write_to_self`` (the self-pipe
wake-up), and ``asyncio.sslproto.SSLProtocol``.
Where asyncio deprecates its event loop policies (3.14+, per its documented source; not
run here): ``asyncio._DefaultEventLoopPolicy`` and ``asyncio.events._set_event_loop_policy``
(see ``_policy_api``).

The notify callback is ``SocketTransport._aio_flushed`` itself (a plain function taking
``(transport, status)``), so the flush adds no Python frame of the loop's own.
"""
from __future__ import annotations

import asyncio
import asyncio.constants as _aconst
import os
import selectors
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar
import asyncio.sslproto as _sslproto

from aoprim import FlushGroup
from aoprim.aio._aiowrite import SleepFlag
from aoprim.aio._readbuf import ReadBuffer
from aoprim.aio import _aioloop
from aoprim.aio.transport import SocketTransport

if TYPE_CHECKING:
    import socket
    import ssl
    from collections.abc import Coroutine
    from types import ModuleType

_T = TypeVar("_T")

__all__ = ["Loop", "new_event_loop", "EventLoopPolicy", "run", "install", "READ_BUFFER_SIZE"]

#: bytes of the loop's reusable read buffer: one recv reads at most this much (twice
#: asyncio's ``max_size``: a 1 MiB message is two reads and two sends, not four;
#: a read of 64 KiB or more is still handed out as a pooled slot, see aoprim.aio._readbuf)
READ_BUFFER_SIZE = 512 * 1024


# (no super() object per iteration; a private method typeshed does not declare)
_base_run_once = asyncio.SelectorEventLoop._run_once  # type: ignore[attr-defined]

#: flushes per iteration end while notifications keep writing (then: select() does not sleep)
FLUSH_ROUNDS = 8


def _noop() -> None:
    pass


#: every aoprim.aio loop not yet garbage-collected, for the fork hook below
_LOOPS: weakref.WeakSet[Loop] = weakref.WeakSet()


def _drop_inherited_writes() -> None:
    """In a process forked from one running aoprim.aio loops (``os.fork()`` in a callback):
    drop, unsent, what every loop's transports had batched at the fork.  Those bytes are the
    parent's, which sends them; the child would send them a second time at its next flush
    (an iteration's end, a ``SystemExit`` out of the loop, ``close()``), where asyncio's
    ``write()`` had sent them before the fork.  What the child writes afterwards is its
    own.  Runs only in the child (``os.register_at_fork``): the write path costs nothing."""
    for loop in list(_LOOPS):
        group = loop._aio_group
        for transport in list(loop._transports.values()):  # type: ignore[attr-defined]
            if not isinstance(transport, SocketTransport):
                continue
            batch = transport._batch
            if not batch.pending_bytes:
                continue
            try:
                batch.clear()
                if group.detach(batch):             # out of the group's dirty queue,
                    group.attach(batch, transport)  # attached again (nothing pending)
            except RuntimeError:
                # busy: the fork came while another thread was inside this batch (a write
                # from outside the loop's thread); that thread does not exist in the child
                pass


os.register_at_fork(after_in_child=_drop_inherited_writes)


def _marked_select(sleep: SleepFlag, group: FlushGroup,
                   select: Callable[[float | None], list[tuple[selectors.SelectorKey, int]]],
                   timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
    """``select(timeout)`` with the loop's sleep marked: ``sleep.sleeping`` is True from just
    before the group check until select() returns, so a write made meanwhile (a signal
    handler, a thread) either is seen by the check (no wait) or sees the flag and wakes
    the loop."""
    sleep.sleeping = True
    try:
        if len(group):
            timeout = 0             # a batch became dirty after the last flush
        return select(timeout)
    finally:
        sleep.sleeping = False


class _Selector(selectors.DefaultSelector):
    """The platform's default selector, marking when it sleeps (_marked_select)."""

    def __init__(self, group: FlushGroup, sleep: SleepFlag) -> None:
        super().__init__()
        self._sleep = sleep
        self._group = group
        _aioloop.wait_state(self)       # the compiled iteration's wait reads the epoll fd

    def close(self) -> None:
        _aioloop.wait_closed(self)      # before the epoll fd is closed and its number reused
        super().close()

    def select(self, timeout: float | None = None
               ) -> list[tuple[selectors.SelectorKey, int]]:
        return _marked_select(self._sleep, self._group, super().select, timeout)


class _MarkedSelector(selectors.BaseSelector):
    """A caller's selector (``Loop(selector)``), marking its sleeps as _Selector does: the
    caller's object does the work, this one only sets ``sleep.sleeping`` around its
    select() and checks the group first, so a write made while the loop sleeps wakes it
    whoever made the selector.  Every other attribute is the caller's selector's."""

    def __init__(self, inner: selectors.BaseSelector, group: FlushGroup,
                 sleep: SleepFlag) -> None:
        self._inner = inner
        self._sleep = sleep
        self._group = group

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None
               ) -> list[tuple[selectors.SelectorKey, int]]:
        return _marked_select(self._sleep, self._group, self._inner.select, timeout)

    def close(self) -> None:
        self._inner.close()

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.get_key(fileobj)

    def get_map(self) -> Any:
        return self._inner.get_map()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _NoPatch(type):
    """Metaclass refusing what nest_asyncio does to a loop's class (it replaces _run_once,
    so no flush would ever run again, for every aoprim loop in the process)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        if name in ("_run_once", "run_forever", "run_until_complete", "_check_running"):
            raise ValueError(f"Can't patch loop of type {cls!r}: aoprim.aio.Loop flushes "
                             f"its batched writes in _run_once (nest_asyncio is not supported)")
        super().__setattr__(name, value)


_aioloop.configure(_base_run_once, _Selector)


class Loop(_aioloop.LoopCore, asyncio.SelectorEventLoop, metaclass=_NoPatch):
    """An asyncio event loop (``asyncio.SelectorEventLoop``) whose TCP and Unix stream
    transports batch their writes: everything written during one iteration leaves at the
    end of that iteration, one ``sendmsg`` per transport, under one GIL release."""

    def __init__(self, selector: selectors.BaseSelector | None = None) -> None:
        group = FlushGroup()
        group.notify = SocketTransport._aio_flushed
        self._aio_group = group
        self._aio_flush = group.flush
        # set while the loop sleeps in select() and while it is not running (run_forever
        # clears it); a caller's selector is wrapped to set it the same way
        self._aio_sleep = SleepFlag()
        self._aio_sleep.sleeping = True
        if selector is None:
            selector = _Selector(group, self._aio_sleep)
        else:
            selector = _MarkedSelector(selector, group, self._aio_sleep)
        super().__init__(selector)
        # the reusable read memory: every plain (data_received) read lands in its buffer or
        # in one of its pooled bytes slots (large reads); the loop runs one callback at a
        # time, so one ReadBuffer serves all its transports
        self._aio_rbuf = ReadBuffer(READ_BUFFER_SIZE)
        _LOOPS.add(self)

    # ---- aoprim's public extras -----------------------------------------------------------

    def flush_stats(self) -> dict[str, int]:
        """The loop's FlushGroup counters (flushes, batches_flushed, syscalls, bytes,
        gil_releases, pending, ...): ``syscalls / batches_flushed`` is the number of system
        calls per flushed transport-iteration."""
        return self._aio_group.stats

    # ---- asyncio hooks ----------------------------------------------------------------------

    # flush what was written outside a callback; one iteration (asyncio's, with the wait and
    # _process_events compiled: aoprim.aio._aioloop); flush the iteration's writes -- also when
    # a callback raised KeyboardInterrupt / SystemExit out of the loop
    _run_once = _aioloop.run_once

    # asyncio's call_soon / call_at / call_later / create_future with the handles built in
    # C (aoprim.aio._aioloop: asyncio.Handle / TimerHandle, the timer heap by heapq's algorithm);
    # asyncio's own in debug mode or where a subclass overrides the helpers they call
    # (call_later's: a subclass's call_at, which it then calls, as asyncio's does)
    call_soon = _aioloop.call_soon
    call_at = _aioloop.call_at
    call_later = _aioloop.call_later
    create_future = _aioloop.create_future
    get_debug = _aioloop.get_debug      # BaseEventLoop's (self._debug), no Python frame

    def _aio_flush_all(self) -> None:
        flush = self._aio_flush
        group = self._aio_group
        for _ in range(FLUSH_ROUNDS):
            flush()
            if not len(group):
                return
        self.call_soon(_noop)           # still dirty: the next select() must not sleep

    def run_forever(self) -> None:
        if self.is_running() or self.is_closed():
            return super().run_forever()    # asyncio's RuntimeError
        sleep = self._aio_sleep
        sleep.sleeping = False              # running: writes leave at the iteration end
        try:
            return super().run_forever()
        finally:
            sleep.sleeping = True           # not running: write() sends at once

    def close(self) -> None:
        if not self.is_running() and not self.is_closed() and len(self._aio_group):
            self._aio_flush_all()       # deliver what was written before close()
        super().close()

    def _make_socket_transport(
            self, sock: socket.socket, protocol: asyncio.BaseProtocol,
            waiter: asyncio.Future[Any] | None = None, *, extra: dict[str, Any] | None = None,
            server: asyncio.AbstractServer | None = None) -> SocketTransport:
        self._ensure_fd_no_transport(sock)  # type: ignore[attr-defined]
        return SocketTransport(self, sock, protocol, waiter, extra, server)

    def _make_ssl_transport(self, rawsock: socket.socket, protocol: asyncio.BaseProtocol,
                            sslcontext: ssl.SSLContext,
                            waiter: asyncio.Future[Any] | None = None, *,
                            server_side: bool = False, server_hostname: str | None = None,
                            extra: dict[str, Any] | None = None,
                            server: asyncio.AbstractServer | None = None,
                            ssl_handshake_timeout: float | None = _aconst.SSL_HANDSHAKE_TIMEOUT,
                            ssl_shutdown_timeout: float | None = _aconst.SSL_SHUTDOWN_TIMEOUT,
                            ) -> asyncio.Transport:
        # as asyncio's selector loop does it, over aoprim's socket transport: the TLS records
        # SSLProtocol writes during an iteration are batched like any other writes
        self._ensure_fd_no_transport(rawsock)  # type: ignore[attr-defined]
        # (typeshed's SSLProtocol takes a waiter and int timeouts only; asyncio's own loop
        # passes these same values)
        ssl_protocol = _sslproto.SSLProtocol(
            self, protocol, sslcontext, waiter,  # type: ignore[arg-type]
            server_side, server_hostname,
            ssl_handshake_timeout=ssl_handshake_timeout,  # type: ignore[arg-type]
            ssl_shutdown_timeout=ssl_shutdown_timeout)
        SocketTransport(self, rawsock, ssl_protocol, extra=extra, server=server)
        return ssl_protocol._app_transport

    def read_stats(self) -> dict[str, int]:
        """The loop's read buffer counters: reads (recv calls into it) and bytes."""
        return self._aio_rbuf.stats


def new_event_loop() -> Loop:
    """A new :class:`Loop`."""
    return Loop()


def _policy_api(aio: ModuleType) -> tuple[bool, Any, Any]:
    """``(deprecated, base, setter)`` for the asyncio module ``aio``: whether its event loop
    policies are deprecated, the default policy class to derive from, and the function that
    sets the policy (``None``, ``None`` where asyncio has no policies any more).

    On 3.11-3.13 the policy names are public and silent.  3.14 deprecates them (removal
    planned for 3.16): ``asyncio.DefaultEventLoopPolicy`` is served by the module's
    ``__getattr__`` with a ``DeprecationWarning`` and ``asyncio.set_event_loop_policy()``
    warns, each wrapping a private name (``asyncio._DefaultEventLoopPolicy``,
    ``asyncio.events._set_event_loop_policy``) that is used here instead, so that importing
    this module and :func:`install` raise none of CPython's warnings.  The branch follows
    what the module holds, not a version number."""
    if "DefaultEventLoopPolicy" in vars(aio):
        return False, aio.DefaultEventLoopPolicy, aio.set_event_loop_policy
    return (True, vars(aio).get("_DefaultEventLoopPolicy"),
            getattr(getattr(aio, "events", None), "_set_event_loop_policy", None))


POLICIES_DEPRECATED, _policy_base, _set_policy = _policy_api(asyncio)
if TYPE_CHECKING:
    _PolicyBase = asyncio.DefaultEventLoopPolicy
else:                                        # no policies: EventLoopPolicy is a plain class
    _PolicyBase = _policy_base if _policy_base is not None else object


class EventLoopPolicy(_PolicyBase):
    """asyncio's default policy (child watchers included), making :class:`Loop` s.  Where
    asyncio has event loop policies only; a loop factory needs none: pass
    ``loop_factory=new_event_loop`` to ``asyncio.run()`` (3.12+) or ``asyncio.Runner``."""

    def new_event_loop(self) -> Loop:
        return Loop()


def run(main: Coroutine[Any, Any, _T], *, debug: bool | None = None) -> _T:
    """``asyncio.run(main, debug=debug)`` on a new :class:`Loop`: like asyncio.run, the loop
    is the policy's current loop while it runs (``asyncio.set_event_loop``), and none
    after.  Called from a running event loop it raises RuntimeError, as asyncio.run does,
    before it makes a loop."""
    if asyncio._get_running_loop() is not None:
        raise RuntimeError("aoprim.aio.run() cannot be called from a running event loop")

    def factory() -> Loop:
        loop = Loop()
        asyncio.set_event_loop(loop)
        return loop
    try:
        with asyncio.Runner(debug=debug, loop_factory=factory) as runner:
            return runner.run(main)
    finally:
        asyncio.set_event_loop(None)


def install() -> None:
    """Make :class:`Loop` asyncio's default: ``asyncio.set_event_loop_policy(
    EventLoopPolicy())``.

    Where asyncio deprecates its policies (3.14+) this still sets the policy, without
    CPython's warning, and emits one ``DeprecationWarning`` of its own that names the loop
    factory to use instead; where asyncio has no policies it raises ``RuntimeError``."""
    if _set_policy is None:
        raise RuntimeError(
            "aoprim.aio.install() needs asyncio's event loop policies, which this Python does "
            "not have: run the code with asyncio.run(main(), "
            "loop_factory=aoprim.aio.new_event_loop), asyncio.Runner(loop_factory="
            "aoprim.aio.new_event_loop) or aoprim.aio.run(main())")
    if POLICIES_DEPRECATED:
        warnings.warn(
            "aoprim.aio.install() sets an asyncio event loop policy; asyncio deprecates "
            "policies from Python 3.14 (removal planned for 3.16): use asyncio.run(main(), "
            "loop_factory=aoprim.aio.new_event_loop), asyncio.Runner(loop_factory="
            "aoprim.aio.new_event_loop) or aoprim.aio.run(main()) instead",
            DeprecationWarning, stacklevel=2)
    _set_policy(EventLoopPolicy())
