"""A user's script over aoprim's whole public surface: ``mypy --strict`` must report nothing.

tests/packaging/test_typing.py runs mypy on it against the installed package; it is never executed.
Assignments to annotated names check that a result fits the type a user expects;
``assert_type`` checks the exact type of the promised ones (an ``Any`` fits every annotation,
so only ``assert_type`` tells it from the promised type).
"""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import Any, assert_type

import aoprim
import aoprim.aio
from aoprim import (AtomicInt, BlockTable, Closed, Empty, FlushGroup, Full, MPMCQueue,
                    PoolExhausted, RefCount, RefCountError, SendBatch, SlabPool, Slot, SPSCQueue,
                    SpinLock)
from aoprim.server._eloop import EpollCore, EpollTimer
from aoprim.server._proxyproto import ProxyParser
from aoprim.server._receiver import (RX_EOF, RX_ERROR, RX_HANDLER, RX_PROXY, RX_PROXY_ERROR,
                                     RX_TOO_LARGE, Receiver)
from aoprim.server._rxbuf import RxArena
from aoprim.server._tls import TLSConn, TLSFlush
from aoprim.aio import EventLoopPolicy, Loop, SocketTransport, TESTED_PYTHONS
from aoprim.aio.gunicorn import LOOP_FACTORY, Worker
from aoprim.server import (BACKENDS, FRAMINGS, BackendUnavailable, FrameDecoder,
                           FrameTooLarge, Framing, Handler, ProtocolHandler, Server, Session,
                           SessionTransport, Settings, serve_protocol)


# -- primitives ------------------------------------------------------------------------------
def primitives() -> None:
    a = AtomicInt(1)
    before: int = a.fetch_add(2)
    swapped: bool = a.compare_exchange(3, 4)
    now: int = a.load() + a.value + int(a) + before + int(swapped)
    a.store(now)
    tallies = [a, AtomicInt(5)]
    total: int = sum(map(int, tallies)) + int(sum(tallies))
    shown: str = f"{a:,} {a:#x} {a}" + format(a, ">10")
    assert total >= 0 and shown

    rc = RefCount(1, on_zero=lambda: None)
    count: int = rc.incref() + rc.decref() + rc.count
    upgraded: bool = rc.try_incref()
    assert count >= 0 and upgraded in (True, False)

    lock = SpinLock()
    with lock:
        held: bool = lock.locked()
        assert held
    got: bool = lock.acquire(timeout=0.5)
    if got:
        lock.release()

    queues: tuple[MPMCQueue[int], SPSCQueue[int]] = (MPMCQueue[int](8), SPSCQueue(8))
    sized: tuple[MPMCQueue[str], SPSCQueue[str]] = (MPMCQueue(maxsize=8),
                                                    SPSCQueue(capacity=8))
    assert sized
    for q in queues:
        q.put(1)
        q.put_nowait(2)
        took: int = q.put_many([3, 4])
        first: int = q.get(timeout=1.0)
        assert_type(q.get_nowait(), int)
        rest: list[int] = q.get_many(8)
        size: int = q.qsize() + len(q) + q.capacity + q.maxsize
        flags: bool = q.empty() or q.full()
        for _ in range(first + len(rest) + 1):
            q.task_done()
        q.join()
        q.close()
        assert (took, size, flags) is not None

    pool = SlabPool(slot_size=4096, slots=4)
    slot: Slot = pool.acquire()
    with slot:
        view: memoryview = memoryview(slot)
        view[:2] = b"hi"
        view.release()
        slot.length = 2
        payload: memoryview = slot.data
        payload.release()
    maybe: Slot | None = pool.try_acquire()
    if maybe is not None:
        maybe.retain().release()
        maybe.release()
    free: int = pool.available + pool.in_use + pool.high_water + pool.slot_size + pool.slots

    table = BlockTable(pool)
    table.append(b"abc")
    other: BlockTable = table.fork()
    data: bytes = table.read(0, 2) + bytes(other)
    blocks: tuple[int, ...] = table.blocks
    table.consume(1)
    table.release()
    other.release()
    assert (free, data, blocks) is not None

    left, right = socket.socketpair()
    batch = SendBatch(left, max_msgs=16)
    batch.add(b"x")
    batch.add(bytearray(b"y"))
    sent: int = batch.flush()
    pending: int = batch.pending_bytes + batch.pending_msgs + len(batch)
    counters: dict[str, int] = batch.stats
    group = FlushGroup()
    group.attach(batch)
    group.flush()
    batch.clear()
    left.close()
    right.close()
    assert (sent, pending, counters) is not None

    codes: tuple[int, ...] = (RX_EOF, RX_ERROR, RX_TOO_LARGE, RX_HANDLER, RX_PROXY,
                              RX_PROXY_ERROR)
    arena: RxArena = RxArena(SlabPool(4096, 2))
    arena.close()
    is_view: bool = Receiver.is_frame_view(b"")
    parser = ProxyParser(accept=3)
    state: int = parser.feed(b"PROXY UNKNOWN\r\n")
    core = EpollCore()
    timer: EpollTimer = core.call_later(1.0, core.stop)
    timer.cancel()
    core.close()
    tls_types: tuple[type[TLSConn], type[TLSFlush]] = (TLSConn, TLSFlush)
    errors: tuple[type[Exception], ...] = (Full, Empty, PoolExhausted, RefCountError, Closed)
    include: str = aoprim.get_include()
    version: str = aoprim.__version__
    assert (codes, is_view, state, tls_types, errors, include, version) is not None


# -- aoprim.server ---------------------------------------------------------------------------
class Echo(Handler):
    def on_connect(self, session: Session) -> None:
        peer: Any = session.peer
        ident: int = session.id
        assert peer is not None and ident > 0

    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        session.send(data)
        if bytes(data) == b"quit":
            session.close()

    def on_close(self, session: Session, exc: BaseException | None) -> None:
        closed: bool = session.closed
        assert closed


class Upper(Handler):
    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        session.send(bytes(data).upper())
        name: Any = session.get_extra_info("peername")
        session.send(bytearray(b"!"))
        assert name is not None


def server() -> None:
    srv = Server(Echo(), host="127.0.0.1", port=0, framing="u16", max_frame=1 << 16,
                 workers=2, idle_timeout=30.0, backend="epoll", ssl=None)
    started: Server = srv.start()
    assert_type(srv.start, Callable[[], Server])
    address: tuple[str, int] = srv.address
    assert_type(srv.address, tuple[str, int])
    assert_type(srv.stats(), dict[str, Any])
    assert_type(srv.settings, Settings)
    assert_type(srv.sessions, list[Session])
    host, port = srv.address
    client = socket.create_connection(srv.address)
    client.close()
    srv.broadcast(b"to everyone")
    counters: dict[str, Any] = srv.stats()
    frames: int = srv.stats()["frames_in"]
    open_sessions: list[Session] = srv.sessions
    settings: Settings = srv.settings
    max_frame: int = settings.max_frame
    idle: float | None = settings.idle_timeout
    context: ssl.SSLContext | None = settings.ssl
    srv.shutdown(timeout=10.0)
    assert (started, address, host, port, counters, frames, open_sessions, max_frame, idle,
            context) is not None

    with Server(Upper(), port=0, framing="raw") as srv2:
        assert srv2.address[1] > 0

    names: tuple[str, ...] = BACKENDS + FRAMINGS
    framing = Framing("u16", max_frame=1024)
    wire: bytes = framing.encode(b"payload")
    decoder = FrameDecoder("u16")
    frames_out: list[bytes] = decoder.feed(wire)
    too_large: type[ValueError] = FrameTooLarge
    missing: type[RuntimeError] = BackendUnavailable
    assert (names, frames_out, too_large, missing) is not None

    proto_srv: Server = serve_protocol(asyncio.Protocol, "127.0.0.1", 0)
    proto_srv.shutdown()
    adapter = ProtocolHandler(asyncio.Protocol)
    transport_type: type[asyncio.Transport] = SessionTransport
    assert adapter is not None and transport_type is not None


# -- aoprim.aio ------------------------------------------------------------------------------
async def main() -> int:
    loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
    return 1 if isinstance(loop, Loop) else 0


def aio() -> None:
    result: int = aoprim.aio.run(main())
    assert_type(aoprim.aio.run(main()), int)
    loop: Loop = aoprim.aio.new_event_loop()
    assert_type(aoprim.aio.new_event_loop(), Loop)
    assert_type(EventLoopPolicy().new_event_loop(), Loop)
    assert_type(aoprim.aio.install(), None)
    base: asyncio.AbstractEventLoop = aoprim.aio.new_event_loop()
    try:
        value: int = loop.run_until_complete(main())
        stats: dict[str, int] = loop.flush_stats()
    finally:
        loop.close()
        base.close()
    policy: asyncio.AbstractEventLoopPolicy = EventLoopPolicy()
    aoprim.aio.install()
    with asyncio.Runner(loop_factory=aoprim.aio.new_event_loop) as runner:
        ran: int = runner.run(main())
    transport_type: type[asyncio.Transport] = SocketTransport
    tested: tuple[tuple[int, int], ...] = TESTED_PYTHONS
    assert (result, value, stats, policy, ran, transport_type, tested) is not None


class H11Worker(Worker):
    """The gunicorn worker with uvicorn's h11 parser (as docs/aio.md's subclass example)."""

    CONFIG_KWARGS = {**Worker.CONFIG_KWARGS, "http": "h11"}


factory: str = LOOP_FACTORY


if __name__ == "__main__":
    primitives()
    server()
    aio()
