"""aoprim.aio -- an asyncio event loop whose stream transports batch their writes.

    import aoprim.aio
    aoprim.aio.run(main())                  # as asyncio.run(main()), on aoprim's loop
    loop = aoprim.aio.new_event_loop()      # an asyncio.AbstractEventLoop: aoprim.aio.Loop
    asyncio.set_event_loop_policy(aoprim.aio.EventLoopPolicy())
    aoprim.aio.install()                    # the same, in one call

The loop is asyncio's own selector loop (``asyncio.SelectorEventLoop``) with two changes:

- TCP and Unix stream transports (plain and under TLS, which asyncio layers as an
  ``SSLProtocol`` over the socket transport) are :class:`aoprim.aio.transport.SocketTransport`:
  ``write()`` appends to the transport's compiled ``SendBatch`` (small writes copied and
  coalesced, large ``bytes`` by reference) and returns; reads go into one reusable buffer
  owned by the loop (``aoprim._readbuf.ReadBuffer``: one ``recv()`` into reused memory,
  then one ``bytes`` of the size read), never a fresh 256 KiB ``recv`` per read;
  ``BufferedProtocol.get_buffer()`` is served as asyncio serves it.
- At the end of every loop iteration (after the ready callbacks ran) the loop flushes its
  ``FlushGroup``: every transport written to during that iteration is written with one
  ``sendmsg`` each, all of them under one GIL release.  The few that need attention (the
  kernel did not take everything, an error, or a transport waiting for its buffer to drain)
  are handed back to their transports.

Private asyncio surface used (``_run_once``, ``_make_socket_transport``,
``_make_ssl_transport``, ``_SelectorSocketTransport``): the versions it was tested with are
pinned in :data:`TESTED_PYTHONS`; importing this package on any other version raises
ImportError naming the versions, rather than misbehaving (set ``AOPRIM_AIO_UNTESTED=1`` to
import it anyway, at your own risk).
"""
import os
import sys

TESTED_PYTHONS = ((3, 11),)

if sys.version_info[:2] not in TESTED_PYTHONS and not os.environ.get("AOPRIM_AIO_UNTESTED"):
    raise ImportError(
        "aoprim.aio subclasses private parts of asyncio (_run_once, _make_socket_transport, "
        "_SelectorSocketTransport) and was tested only on Python "
        + ", ".join("%d.%d" % v for v in TESTED_PYTHONS)
        + f"; this is {sys.version_info[0]}.{sys.version_info[1]}. Use asyncio's default "
          "loop here (or set AOPRIM_AIO_UNTESTED=1 to try it anyway).")

from aoprim.aio.loop import EventLoopPolicy, Loop, install, new_event_loop, run  # noqa: E402
from aoprim.aio.transport import SocketTransport  # noqa: E402

__all__ = ["Loop", "new_event_loop", "EventLoopPolicy", "run", "install", "SocketTransport",
           "TESTED_PYTHONS"]
