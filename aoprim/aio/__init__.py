"""aoprim.aio -- an asyncio event loop whose stream transports batch their writes.

    import aoprim.aio
    aoprim.aio.run(main())                  # as asyncio.run(main()), on aoprim's loop
    loop = aoprim.aio.new_event_loop()      # an asyncio.AbstractEventLoop: aoprim.aio.Loop
    asyncio.run(main(), loop_factory=aoprim.aio.new_event_loop)   # 3.12+: no policy needed
    with asyncio.Runner(loop_factory=aoprim.aio.new_event_loop) as runner:   # 3.11+
        runner.run(main())
    asyncio.set_event_loop_policy(aoprim.aio.EventLoopPolicy())
    aoprim.aio.install()                    # the same, in one call (where policies exist)

The loop factory is the way asyncio recommends from Python 3.14, which deprecates event loop
policies (removal planned for 3.16); :func:`install` still works there, with a
``DeprecationWarning`` of aoprim's own.  ASGI servers: ``uvicorn app:app --loop
aoprim.aio:new_event_loop`` (uvicorn >= 0.36), ``gunicorn app:app -k
aoprim.aio.gunicorn.Worker`` (:mod:`aoprim.aio.gunicorn`); hypercorn and granian: docs/aio.md.

The loop is asyncio's own selector loop (``asyncio.SelectorEventLoop``) with two changes:

- TCP and Unix stream transports (plain and under TLS, which asyncio layers as an
  ``SSLProtocol`` over the socket transport) are :class:`aoprim.aio.transport.SocketTransport`:
  ``write()`` appends to the transport's compiled ``SendBatch`` (small writes copied and
  coalesced, large ``bytes`` by reference) and returns; reads go into one reusable buffer
  owned by the loop (``aoprim.aio._readbuf.ReadBuffer``: one ``recv()`` into reused memory; a
  read of 64 KiB or more lands in one of the buffer's pooled, resident ``bytes`` objects
  and is handed to ``data_received`` as it is, a smaller one is copied into a ``bytes`` of
  its size; at most 512 KiB per read), never a fresh 256 KiB ``recv`` per read;
  ``BufferedProtocol.get_buffer()`` is served as asyncio serves it.
- At the end of every loop iteration (after the ready callbacks ran) the loop flushes its
  ``FlushGroup``: every transport written to during that iteration is written with one
  ``sendmsg`` each, all of them under one GIL release.  The few that need attention (the
  kernel did not take everything, an error, or a transport waiting for its buffer to drain)
  are handed back to their transports.

The iteration itself (asyncio's ``_run_once``: the wait, the dispatch of fd events, due
timers, the ready queue) is compiled (``aoprim.aio._aioloop``), keeping asyncio's data
structures and order; debug mode takes asyncio's Python iteration.

The transport is aoprim's own (not asyncio's private selector transport); the private
asyncio names the package still uses are listed, with the versions they were checked on, at
the top of :mod:`aoprim.aio.transport` and :mod:`aoprim.aio.loop`.  The Python versions whose
test suites (aoprim's and CPython's own ``test_asyncio`` suites on this loop) were run are
:data:`TESTED_PYTHONS`; another (newer) version imports with a ``RuntimeWarning``.
"""
import sys
import warnings

TESTED_PYTHONS = ((3, 11), (3, 12), (3, 13))

if sys.version_info[:2] not in TESTED_PYTHONS:
    warnings.warn(
        "aoprim.aio was tested on Python "
        + ", ".join("%d.%d" % v for v in TESTED_PYTHONS)
        + f"; this is {sys.version_info[0]}.{sys.version_info[1]}, whose asyncio it was not "
          "tested with", RuntimeWarning, stacklevel=2)

from aoprim.aio.loop import EventLoopPolicy, Loop, install, new_event_loop, run  # noqa: E402
from aoprim.aio.transport import SocketTransport  # noqa: E402

__all__ = ["Loop", "new_event_loop", "EventLoopPolicy", "run", "install", "SocketTransport",
           "TESTED_PYTHONS"]
