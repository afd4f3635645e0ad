"""Results used as what they are not: each line marked ``# E: <code>`` must be reported with
that code, nothing else."""
from __future__ import annotations

import asyncio

import aoprim.aio
from aoprim import AtomicInt, MPMCQueue, SlabPool
from aoprim.server import Handler, Server


async def answer() -> int:
    return 42


srv = Server(Handler())
port: str = srv.address[1]  # E: assignment
host: int = srv.address[0]  # E: assignment
started: int = srv.start()  # E: assignment
open_count: int = srv.sessions  # E: assignment
text: str = aoprim.aio.run(answer())  # E: assignment
loop: asyncio.Future[int] = aoprim.aio.new_event_loop()  # E: assignment
policy: aoprim.aio.Loop = aoprim.aio.EventLoopPolicy()  # E: assignment
if aoprim.aio.install():  # E: func-returns-value
    pass
count: str = AtomicInt(1).fetch_add(1)  # E: assignment
MPMCQueue[int](8).put_many(5)  # E: arg-type
MPMCQueue[int](8).put("five")  # E: arg-type
name: str = MPMCQueue[int](8).get()  # E: assignment
SlabPool().acquire().length = "full"  # E: assignment
AtomicInt("one")  # E: arg-type
srv.shutdown()
