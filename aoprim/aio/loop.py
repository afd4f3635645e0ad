"""The loop: asyncio's selector loop, whose stream transports are aoprim's and whose every
iteration ends with one flush of all the transports written to during it.

Iteration (``_run_once``)::

    [flush]   only if something was written outside a callback (before the loop started,
              between two run_until_complete calls): so that no select() waits on data
              still sitting in a batch
    select(), then run the ready callbacks        -- asyncio's own _run_once
    flush     FlushGroup.flush(): every dirty batch, one sendmsg each, one GIL release;
              notify(transport, status) for the few that need attention

The notify callback is ``SocketTransport._aio_flushed`` itself (a plain function taking
``(transport, status)``), so the flush adds no Python frame of the loop's own.
"""
import asyncio
import asyncio.constants as _aconst
import asyncio.sslproto as _sslproto

from aoprim import FlushGroup
from aoprim._readbuf import ReadBuffer
from aoprim.aio.transport import SocketTransport

__all__ = ["Loop", "new_event_loop", "EventLoopPolicy", "run", "install", "READ_BUFFER_SIZE"]

#: bytes of the loop's reusable read buffer (asyncio's ``max_size``: one recv reads at most
#: this much, as asyncio's own transports do)
READ_BUFFER_SIZE = 256 * 1024


_base_run_once = asyncio.SelectorEventLoop._run_once     # (no super() object per iteration)


class Loop(asyncio.SelectorEventLoop):
    """An asyncio event loop (``asyncio.SelectorEventLoop``) whose TCP and Unix stream
    transports batch their writes: everything written during one iteration leaves at the
    end of that iteration, one ``sendmsg`` per transport, under one GIL release."""

    def __init__(self, selector=None):
        super().__init__(selector)
        group = FlushGroup()
        group.notify = SocketTransport._aio_flushed
        self._aio_group = group
        self._aio_flush = group.flush
        # the reusable read buffer: every plain (data_received) read goes here first; the
        # loop runs one callback at a time, so one buffer serves all its transports
        self._aio_rbuf = ReadBuffer(READ_BUFFER_SIZE)

    # ---- aoprim's public extras -----------------------------------------------------------

    def flush_stats(self):
        """The loop's FlushGroup counters (flushes, batches_flushed, syscalls, bytes,
        gil_releases, pending, ...): ``syscalls / batches_flushed`` is the number of system
        calls per flushed transport-iteration."""
        return self._aio_group.stats

    # ---- asyncio hooks ----------------------------------------------------------------------

    def _run_once(self):
        if len(self._aio_group):
            self._aio_flush()           # written outside a callback: send before select()
        _base_run_once(self)            # asyncio's: select(), then the ready callbacks
        self._aio_flush()

    def _make_socket_transport(self, sock, protocol, waiter=None, *, extra=None,
                               server=None):
        return SocketTransport(self, sock, protocol, waiter, extra, server)

    def _make_ssl_transport(self, rawsock, protocol, sslcontext, waiter=None, *,
                            server_side=False, server_hostname=None, extra=None,
                            server=None,
                            ssl_handshake_timeout=_aconst.SSL_HANDSHAKE_TIMEOUT,
                            ssl_shutdown_timeout=_aconst.SSL_SHUTDOWN_TIMEOUT):
        # as asyncio's selector loop does it, over aoprim's socket transport: the TLS records
        # SSLProtocol writes during an iteration are batched like any other writes
        ssl_protocol = _sslproto.SSLProtocol(
            self, protocol, sslcontext, waiter, server_side, server_hostname,
            ssl_handshake_timeout=ssl_handshake_timeout,
            ssl_shutdown_timeout=ssl_shutdown_timeout)
        SocketTransport(self, rawsock, ssl_protocol, extra=extra, server=server)
        return ssl_protocol._app_transport

    def read_stats(self):
        """The loop's read buffer counters: reads (recv calls into it) and bytes."""
        return self._aio_rbuf.stats


def new_event_loop():
    """A new :class:`Loop`."""
    return Loop()


class EventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """asyncio's default policy (child watchers included), making :class:`Loop` s."""

    def new_event_loop(self):
        return Loop()


def run(main, *, debug=None):
    """``asyncio.run(main, debug=debug)`` on a new :class:`Loop`."""
    with asyncio.Runner(debug=debug, loop_factory=new_event_loop) as runner:
        return runner.run(main)


def install():
    """Make :class:`Loop` asyncio's default: ``asyncio.set_event_loop_policy(
    EventLoopPolicy())``."""
    asyncio.set_event_loop_policy(EventLoopPolicy())
