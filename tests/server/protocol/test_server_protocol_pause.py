"""Pausing and the socket the application sees, on serve_protocol and on native Handlers:

- ``get_extra_info("socket")`` / ``Session.socket`` is asyncio's ``TransportSocket``: a
  protocol cannot make the loop's socket blocking (shutdown() would then hang in a recv);
- with workers, no ``data_received``/``on_read`` runs while reading is paused: frames already
  queued for the worker are held, in order, and delivered after ``resume_reading()``.

Both Layer 1 backends, with and without workers.  (A BufferedProtocol pausing inside
``buffer_updated``: test_server_protocol_differential.py.)"""
import asyncio
import asyncio.trsock
import socket
import struct
import threading
import time

import pytest

from aoprim.server import Handler, Server, serve_protocol
from aoprim.server.loop import BACKENDS

from server_support import HOST, wait_for
from tlscerts import tls_certs  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(60)

WORKERS = [0, 2]


def _shutdown_returns(srv):
    """shutdown() in a thread of its own: it returns, without "the server loop did not stop
    in time" (the loop thread stuck in a blocking call)."""
    box = {}

    def run():
        try:
            srv.shutdown(timeout=5)
            box["ok"] = True
        except BaseException as e:      # reported below
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(20)
    assert not th.is_alive(), "shutdown() hung"
    assert box.get("ok"), box


# -- the socket ---------------------------------------------------------------------------
class SocketProbe(asyncio.Protocol):
    def __init__(self, box, ready):
        self.box = box
        self.ready = ready

    def connection_made(self, transport):
        s = transport.get_extra_info("socket")
        self.box["type"] = type(s)
        for name, call in (("setblocking", lambda: s.setblocking(True)),
                           ("settimeout", lambda: s.settimeout(None))):
            try:
                call()
                self.box[name] = "accepted"
            except ValueError:
                self.box[name] = "refused"
        s.setblocking(False)                    # allowed: what the loop needs anyway
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)    # options still work
        self.box["fileno"] = s.fileno()
        self.ready.set()


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_protocol_cannot_make_the_socket_blocking(backend, workers):
    box, ready = {}, threading.Event()
    srv = serve_protocol(lambda: SocketProbe(box, ready), HOST, 0, backend=backend,
                         workers=workers)
    idle = socket.create_connection(srv.address[:2], timeout=10)
    try:
        assert ready.wait(10)
        assert issubclass(box["type"], asyncio.trsock.TransportSocket)
        assert box["setblocking"] == "refused" and box["settimeout"] == "refused", box
        assert box["fileno"] >= 0
        # an idle client and the attempt above: shutdown() still returns
        _shutdown_returns(srv)
    finally:
        idle.close()
        srv.shutdown()


class DupBlocking(asyncio.Protocol):
    """Makes the fd blocking behind the loop's back: a dup shares the file's O_NONBLOCK."""

    def __init__(self, ready):
        self.ready = ready

    def connection_made(self, transport):
        d = transport.get_extra_info("socket").dup()
        d.setblocking(True)
        d.close()

    def data_received(self, data):
        self.ready.set()


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shutdown_returns_when_the_fd_was_made_blocking_through_a_dup(backend, workers):
    ready = threading.Event()
    srv = serve_protocol(lambda: DupBlocking(ready), HOST, 0, backend=backend,
                         workers=workers)
    idle = socket.create_connection(srv.address[:2], timeout=10)
    try:
        idle.sendall(b"x" * 10)
        assert ready.wait(10)
        _shutdown_returns(srv)
    finally:
        idle.close()
        srv.shutdown()


class LingerWriter(asyncio.Protocol):
    """Sets SO_LINGER with a long time, then writes more than a peer that does not read
    lets leave: a close() of that socket would block until the time ran out."""

    def __init__(self, ready):
        self.ready = ready

    def connection_made(self, transport):
        transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 60))
        transport.write(b"x" * (2 << 20))
        self.ready.set()


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shutdown_returns_when_the_protocol_set_so_linger(backend, workers):
    ready = threading.Event()
    srv = serve_protocol(lambda: LingerWriter(ready), HOST, 0, backend=backend,
                         workers=workers, shutdown_timeout=0.5)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.settimeout(10)
    try:
        stalled.connect(srv.address[:2])
        assert ready.wait(10)
        wait_for(lambda: srv.stats()["bytes_out"] > 0, 10, "the first bytes sent")
        _shutdown_returns(srv)      # the loop thread not stuck in close() for 60 s
    finally:
        stalled.close()
        srv.shutdown()


def test_asyncio_refuses_the_same_calls():
    """What the probe expects is asyncio's own behaviour (its loop, its transport)."""
    box, ready = {}, threading.Event()

    async def main():
        srv = await asyncio.get_running_loop().create_server(
            lambda: SocketProbe(box, ready), HOST, 0)
        c = socket.create_connection(srv.sockets[0].getsockname(), timeout=10)
        try:
            await asyncio.wait_for(asyncio.to_thread(ready.wait, 10), 15)
        finally:
            c.close()
            srv.close()

    asyncio.run(main())
    assert box["type"] is asyncio.trsock.TransportSocket
    assert box["setblocking"] == "refused" and box["settimeout"] == "refused"


class SocketHandler(Handler):
    def __init__(self, box, ready):
        self.box = box
        self.ready = ready

    def on_connect(self, session):
        s = session.socket
        try:
            s.setblocking(True)
            self.box["setblocking"] = "accepted"
        except ValueError:
            self.box["setblocking"] = "refused"
        self.ready.set()

    def on_read(self, session, data):
        pass


@pytest.mark.parametrize("backend", BACKENDS)
def test_session_socket_refuses_blocking(backend):
    box, ready = {}, threading.Event()
    srv = Server(SocketHandler(box, ready), HOST, 0, backend=backend).start()
    c = socket.create_connection(srv.address[:2], timeout=10)
    try:
        assert ready.wait(10)
        assert box["setblocking"] == "refused"
        _shutdown_returns(srv)
    finally:
        c.close()
        srv.shutdown()


# -- workers: nothing delivered while paused -----------------------------------------------
N_MORE = 5


class _Gate:
    """The first delivery blocks until the test has had N_MORE more frames read (queued for
    the worker), then pauses reading and returns; every delivery is logged with whether
    reading was on."""

    def __init__(self):
        self.log = []
        self.total = 0
        self.release = threading.Event()
        self.first_done = threading.Event()
        self.more = threading.Event()
        self.all_in = threading.Event()

    def deliver(self, data, reading, pause):
        self.log.append((len(data), reading))
        self.total += len(data)
        if len(self.log) == 1:
            assert self.release.wait(20)
            pause()
            self.first_done.set()
        else:
            self.more.set()
        if self.total == 100 * (1 + N_MORE):
            self.all_in.set()


class GateProtocol(asyncio.Protocol):
    def __init__(self, gate):
        self.gate = gate

    def connection_made(self, transport):
        self.t = transport
        self.gate.transport = transport

    def data_received(self, data):
        self.gate.deliver(data, self.t.is_reading(), self.t.pause_reading)


class GateHandler(Handler):
    def __init__(self, gate):
        self.gate = gate

    def on_connect(self, session):
        self.gate.transport = session

    def on_read(self, session, data):
        self.gate.deliver(bytes(data), not self.gate.paused, self._pause(session))

    def _pause(self, session):
        def pause():
            self.gate.paused = True
            session.pause_reading()
        return pause


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["protocol", "handler"])
def test_nothing_delivered_while_paused(kind, backend, workers):
    gate = _Gate()
    gate.paused = False
    if kind == "protocol":
        srv = serve_protocol(lambda: GateProtocol(gate), HOST, 0, backend=backend,
                             workers=workers)
    else:
        srv = Server(GateHandler(gate), HOST, 0, backend=backend, workers=workers).start()
    c = socket.create_connection(srv.address[:2], timeout=10)
    try:
        c.sendall(b"a" * 100)
        wait_for(lambda: srv.stats()["frames_in"] == 1, 10, "the first frame")
        if workers:
            # while the worker is inside the first delivery, the loop reads (and queues)
            # N_MORE frames of their own
            for i in range(N_MORE):
                c.sendall(bytes([ord("b") + i]) * 100)
                wait_for(lambda: srv.stats()["frames_in"] == 2 + i, 10, "a frame read")
        gate.release.set()
        assert gate.first_done.wait(10)
        if not workers:
            for i in range(N_MORE):
                c.sendall(bytes([ord("b") + i]) * 100)
        # paused: whatever was read or queued stays put (a bounded look, then resume)
        assert not gate.more.wait(0.3), f"delivered while paused: {gate.log}"
        gate.paused = False
        gate.transport.resume_reading()
        assert gate.all_in.wait(10), gate.log
        assert all(reading for _, reading in gate.log), gate.log
        assert gate.total == 100 * (1 + N_MORE)
    finally:
        c.close()
        srv.shutdown(timeout=10)


class _WritesUntilPaused(asyncio.Protocol):
    """asyncio's producer pattern: write 16 KiB chunks until pause_writing() (or 32 MiB);
    records where and when the pause came.  The peer reads nothing until it is told."""
    CHUNK = 16 * 1024
    CAP = 32 * 2**20

    def __init__(self, seen):
        self.seen = seen

    def connection_made(self, transport):
        self.t = transport
        self.paused = False

    def data_received(self, data):
        self.seen["writer"] = threading.current_thread()
        n = 0
        while not self.paused and n < self.CAP:
            self.t.write(b"z" * self.CHUNK)
            n += self.CHUNK
            self.seen["most buffered"] = max(self.seen.get("most buffered", 0),
                                             self.t.get_write_buffer_size())
        self.seen["written"] = n

    def pause_writing(self):
        self.paused = True
        self.seen.setdefault("pauses", []).append(threading.current_thread())

    def resume_writing(self):
        self.seen["resumed"] = True


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_over_the_high_mark_pauses_the_writer_inside_it_on_every_thread(
        backend, workers, tls, tls_certs):
    """As asyncio's write(): the write that leaves more than the high-water mark unsent
    (beyond what the socket takes) calls pause_writing() before it returns, on the thread
    that wrote (a worker too), so a protocol writing until paused buffers at most about a
    socket buffer and one high mark, as on asyncio -- with workers it wrote on for
    megabytes until the loop thread's flush paused it; once the peer reads,
    resume_writing() comes and every byte arrives."""
    seen = {}
    srv = serve_protocol(lambda: _WritesUntilPaused(seen), HOST, 0, backend=backend,
                         workers=workers, ssl=tls_certs.server_ctx() if tls else None)
    try:
        raw = socket.create_connection(srv.address, timeout=30)
        c = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost") if tls else raw
        with c:
            c.sendall(b"go")
            wait_for(lambda: "written" in seen, 30, "the writer to stop")
            high = (512 if tls else 64) * 1024
            assert seen["written"] < _WritesUntilPaused.CAP, seen
            # once: inside the write, on the writer's thread, or from the loop thread's
            # flush if that found the socket full first (beside the worker on a
            # free-threaded build; between two of its writes when the GIL switches)
            assert len(seen["pauses"]) == 1, seen
            # at most what a socket may take (the kernel's largest autotuned send buffer),
            # one high mark and a chunk or two (TLS: records in flight)
            with open("/proc/sys/net/ipv4/tcp_wmem") as f:
                sndbuf_max = int(f.read().split()[2])
            assert seen["most buffered"] <= high + sndbuf_max + 2 * _WritesUntilPaused.CHUNK, \
                seen
            got = 0
            while got < seen["written"]:
                b = c.recv(1 << 20)
                assert b, (got, seen)
                got += len(b)
            assert got == seen["written"]
            wait_for(lambda: seen.get("resumed"), 30, "resume_writing")
    finally:
        srv.shutdown(timeout=15)


class _PumpsUntilPaused(asyncio.Protocol):
    """Each request byte asks for ``TOTAL`` bytes, written in 64 KiB chunks until
    pause_writing() and on from resume_writing() -- on a worker, data_received and the
    writes it makes run beside the loop thread's flush and its resume_writing().
    pause_writing() takes a while (a log line, a lock): the window in which a resume must
    not overtake it.  Records every flow callback that comes out of turn."""
    TOTAL = 4 * 2**20
    CHUNK = b"z" * 65536

    def __init__(self, wrong):
        self.wrong = wrong
        self.paused = self.pausing = False
        self.left = 0

    def connection_made(self, transport):
        self.t = transport

    def pump(self):
        while not self.paused and self.left > 0:
            n = min(self.left, len(self.CHUNK))
            self.left -= n
            self.t.write(self.CHUNK[:n])

    def data_received(self, data):
        self.left += self.TOTAL * len(data)
        self.pump()

    def pause_writing(self):
        if self.paused or self.pausing:
            self.wrong.append("pause_writing while paused")
        self.pausing = True
        time.sleep(0.005)
        self.paused, self.pausing = True, False

    def resume_writing(self):
        if self.pausing:
            self.wrong.append("resume_writing while pause_writing ran")
        elif not self.paused:
            self.wrong.append("resume_writing while not paused")
        self.paused = False
        self.pump()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resume_never_overtakes_a_workers_pause_and_no_round_stalls(backend, workers):
    """A fast reader drains what a worker's write() paused for while that pause_writing()
    still runs: the loop thread's resume_writing() came first (a resume while pausing),
    the pause then held for good, and the connection stalled (nothing more was written).
    Now the resume waits for the pause, and every round's bytes arrive."""
    wrong = []
    srv = serve_protocol(lambda: _PumpsUntilPaused(wrong), HOST, 0, backend=backend,
                         workers=workers)
    try:
        with socket.create_connection(srv.address, timeout=10) as c:
            for r in range(12):
                c.sendall(b"g")
                got = 0
                while got < _PumpsUntilPaused.TOTAL:
                    try:
                        b = c.recv(1 << 20)
                    except socket.timeout:
                        raise AssertionError(f"round {r} stalled at {got} bytes; {wrong}")
                    assert b, (r, got, wrong)
                    got += len(b)
                assert got == _PumpsUntilPaused.TOTAL, (r, got)
        assert wrong == []
    finally:
        srv.shutdown(timeout=15)
