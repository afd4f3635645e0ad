"""Differential drop-in suite: aoprim.aio must behave as asyncio's own loop and
uvloop do, as a peer observes it (bytes, order, callbacks).

Every scenario runs on a fresh loop of each kind ("asyncio" is the baseline and is asserted
too, so each test can fail for every loop).  The peer is a plain blocking socket read with
timeouts; the loop waits on futures with timeouts -- no sleep stands in for synchronisation.
No parametrization carries an xfail: a difference found here is a bug to fix in aoprim.aio
(``kinds(aoprim="why")`` exists only for a documented difference).
"""
import asyncio
import os
import socket
import subprocess
import threading

import pytest

pytestmark = pytest.mark.timeout(60)

try:
    import uvloop
except ImportError as exc:  # pragma: no cover - depends on the venv
    uvloop = None
    _UVLOOP_WHY = f"uvloop not importable: {exc}"

try:
    import aoprim.aio as aoprim_aio
except ImportError as exc:
    aoprim_aio = None
    _AOPRIM_WHY = f"aoprim.aio not importable: {exc}"


def new_loop(kind):
    """A fresh event loop of ``kind`` ("asyncio", "uvloop" or "aoprim"), or skip."""
    if kind == "asyncio":
        return asyncio.new_event_loop()
    if kind == "uvloop":
        if uvloop is None:
            pytest.skip(_UVLOOP_WHY)
        return uvloop.new_event_loop()
    if aoprim_aio is None:
        pytest.skip(_AOPRIM_WHY)
    return aoprim_aio.new_event_loop()


def kinds(**xfail):
    """The three loop kinds; ``aoprim="why"`` marks aoprim's run a strict xfail (why)."""
    out = []
    for kind in ("asyncio", "uvloop", "aoprim"):
        if kind in xfail:
            out.append(pytest.param(kind, marks=pytest.mark.xfail(
                strict=True, reason=f"documented difference: {xfail[kind]}")))
        else:
            out.append(kind)
    return out


@pytest.fixture
def loop_of():
    """loop_of(kind) -> a fresh loop, closed at teardown if the test did not close it."""
    made = []

    def make(kind):
        lp = new_loop(kind)
        made.append(lp)
        return lp
    yield make
    for lp in made:
        if not lp.is_closed():
            lp.close()


def read_until_eof(sock, limit=None, timeout=5.0):
    """Everything the peer receives until EOF/reset (or ``limit`` bytes, or ``timeout``)."""
    sock.settimeout(timeout)
    got = bytearray()
    while limit is None or len(got) < limit:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        except socket.timeout:
            break
        if not chunk:
            break
        got += chunk
    return bytes(got)


class Peer:
    """A thread reading a blocking socket to EOF/reset; ``result()`` joins it."""

    def __init__(self, sock, limit=None, timeout=10.0):
        self.sock = sock
        self.data = None
        self.thread = threading.Thread(
            target=self._run, args=(limit, timeout), daemon=True)
        self.thread.start()

    def _run(self, limit, timeout):
        self.data = read_until_eof(self.sock, limit, timeout)

    def result(self, timeout=15.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "peer reader did not finish"
        return self.data


class Rec(asyncio.Protocol):
    """Records every callback in ``events``; ``lost`` resolves at connection_lost."""

    def __init__(self, loop):
        self.loop = loop
        self.events = []
        self.data = bytearray()
        self.transport = None
        self.lost = loop.create_future()
        self.got_data = loop.create_future()

    def connection_made(self, transport):
        self.transport = transport
        self.events.append("made")

    def data_received(self, data):
        self.events.append("data")
        self.data += data
        if not self.got_data.done():
            self.got_data.set_result(None)

    def eof_received(self):
        self.events.append("eof")

    def pause_writing(self):
        self.events.append("pause")

    def resume_writing(self):
        self.events.append("resume")

    def connection_lost(self, exc):
        self.events.append("lost")
        if not self.lost.done():
            self.lost.set_result(exc)


async def connect(loop, factory):
    """A loop transport on one end of a socketpair; returns (transport, protocol, peer)."""
    a, b = socket.socketpair()
    tr, pr = await loop.create_connection(factory, sock=a)
    return tr, pr, b


# -- 1. producer writing from resume_writing ------------------------------------------------

CHUNK = b"p" * 70_000
NCHUNKS = 40


class Producer(asyncio.Protocol):
    """Writes CHUNK until paused, goes on in resume_writing; closes after the last chunk."""

    def __init__(self, loop):
        self.sent = 0
        self.paused = False
        self.lost = loop.create_future()

    def connection_made(self, transport):
        self.transport = transport
        self._produce()

    def _produce(self):
        while not self.paused and self.sent < NCHUNKS:
            self.sent += 1
            self.transport.write(CHUNK)
        if self.sent == NCHUNKS and not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        self._produce()

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", kinds())
def test_producer_in_resume_writing_plain(loop_of, kind):
    loop = loop_of(kind)
    a, b = socket.socketpair()
    peer = Peer(b)

    async def main():
        tr, pr = await loop.create_connection(lambda: Producer(loop), sock=a)
        await asyncio.wait_for(asyncio.shield(pr.lost), 10)
        return pr
    pr = loop.run_until_complete(main())
    data = peer.result()
    b.close()
    assert pr.sent == NCHUNKS
    assert len(data) == NCHUNKS * len(CHUNK) == 2_800_000


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate and key for 127.0.0.1 (openssl CLI), or skip."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    try:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot make a self-signed certificate with openssl: {exc}")
    return str(cert), str(key)


def tls_contexts(tls_files):
    """(server context, client context) trusting the self-signed certificate."""
    import ssl
    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    cctx.load_verify_locations(cert)
    return sctx, cctx


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", kinds())
def test_producer_in_resume_writing_tls(loop_of, kind, tls_files):
    import ssl
    sctx, cctx = tls_contexts(tls_files)
    loop = loop_of(kind)
    result = {}

    def client(port):
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        with cctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            got = bytearray()
            s.settimeout(10)
            while len(got) < NCHUNKS * len(CHUNK):
                try:
                    chunk = s.recv(1 << 16)
                except (OSError, ssl.SSLError):
                    break
                if not chunk:
                    break
                got += chunk
            result["n"] = len(got)

    async def main():
        protos = []

        def factory():
            protos.append(Producer(loop))
            return protos[-1]
        server = await loop.create_server(factory, "127.0.0.1", 0, ssl=sctx)
        port = server.sockets[0].getsockname()[1]
        t = threading.Thread(target=client, args=(port,), daemon=True)
        t.start()
        done = loop.run_in_executor(None, t.join, 20)
        await asyncio.wait_for(done, 25)
        server.close()
        return protos
    protos = loop.run_until_complete(main())
    assert protos and protos[0].sent == NCHUNKS
    assert result.get("n") == NCHUNKS * len(CHUNK)


# -- 2. write then abort / write then raise -------------------------------------------------

class WriteThen(asyncio.Protocol):
    """On the first data: writes a reply, then aborts (or raises)."""

    def __init__(self, loop, how):
        self.how = how
        self.lost = loop.create_future()

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(b"ERR bad command\r\n")
        if self.how == "abort":
            self.transport.abort()
        else:
            raise RuntimeError("bad command")

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["abort", "raise"])
@pytest.mark.parametrize("kind", kinds())
def test_write_then_abort_or_raise_delivers(loop_of, kind, how):
    loop = loop_of(kind)
    loop.set_exception_handler(lambda lp, ctx: None)   # the raise is logged; keep quiet
    a, b = socket.socketpair()

    async def main():
        tr, pr = await loop.create_connection(lambda: WriteThen(loop, how), sock=a)
        b.sendall(b"bogus\r\n")
        await asyncio.wait_for(asyncio.shield(pr.lost), 5)
    loop.run_until_complete(main())
    data = read_until_eof(b)
    b.close()
    assert data == b"ERR bad command\r\n"


# -- 3. a flush notification aborting another transport -------------------------------------

class Aborter(Rec):
    """pause_writing aborts ``other`` (set after both connections are made)."""
    other = None

    def pause_writing(self):
        super().pause_writing()
        if self.other is not None and not self.other.transport.is_closing():
            self.other.transport.abort()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", kinds())
def test_abort_from_flush_notification_then_fd_reuse(loop_of, kind):
    loop = loop_of(kind)
    big = b"z" * (4 << 20)

    async def main():
        ta, pa, peer_a = await connect(loop, lambda: Aborter(loop))
        tb, pb, peer_b = await connect(loop, lambda: Aborter(loop))
        pa.other, pb.other = pb, pa
        # both fill the kernel buffer in one iteration: the first paused aborts the other
        ta.write(big)
        tb.write(big)
        await asyncio.wait_for(asyncio.wait([pa.lost, pb.lost],
                                            return_when=asyncio.FIRST_COMPLETED), 5)
        await asyncio.sleep(0)
        aborted = pb if pb.lost.done() else pa
        survivor = pa if aborted is pb else pb
        assert aborted.events.count("pause") <= 1
        # a new connection (its fd likely the aborted one's number) reads normally
        tc, pc, peer_c = await connect(loop, lambda: Rec(loop))
        peer_c.sendall(b"hello")
        await asyncio.wait_for(asyncio.shield(pc.got_data), 5)
        survivor.transport.abort()
        tc.close()
        await asyncio.wait_for(asyncio.gather(pc.lost, survivor.lost), 5)
        for s in (peer_a, peer_b, peer_c):
            s.close()
        return bytes(pc.data)
    assert loop.run_until_complete(main()) == b"hello"


# -- 4. loop.close() with a pending write; KeyboardInterrupt after a write -------------------

@pytest.mark.timeout(30)
# loop.close() with the transport still open is the scenario: the transport is collected unclosed
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", kinds())
def test_loop_close_with_pending_write_delivers(loop_of, kind):
    loop = loop_of(kind)
    a, b = socket.socketpair()

    async def main():
        tr, pr = await loop.create_connection(lambda: Rec(loop), sock=a)
        return tr
    tr = loop.run_until_complete(main())
    tr.write(b"late write")          # outside any loop iteration
    loop.close()
    data = read_until_eof(b, limit=len(b"late write"), timeout=2)
    a.close()
    b.close()
    assert data == b"late write"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("kind", kinds())
def test_base_exception_after_write_delivers(loop_of, kind, exc_type):
    loop = loop_of(kind)
    a, b = socket.socketpair()
    tr, pr = loop.run_until_complete(loop.create_connection(lambda: Rec(loop), sock=a))

    def cb():
        tr.write(b"bye")
        raise exc_type()
    loop.call_soon(cb)
    with pytest.raises(exc_type):
        loop.run_forever()
    data = read_until_eof(b, limit=3, timeout=2)
    tr.abort()
    loop.run_until_complete(asyncio.wait_for(asyncio.shield(pr.lost), 5))
    b.close()
    assert data == b"bye"


# -- every callback source, and the ways a transport ends ----------------------------------
# (scenarios where a loop's write path could differ: each runs on the three loops, which
# must agree)

def run_on(loop, coro, timeout=20):
    loop.set_exception_handler(lambda lp, ctx: None)
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.mark.parametrize("source", ["call_later", "future_callback", "call_soon_threadsafe",
                                    "add_signal_handler"])
@pytest.mark.parametrize("kind", kinds())
def test_write_from_each_callback_source_is_delivered(loop_of, kind, source):
    import signal
    loop = loop_of(kind)

    async def main():
        tr, pr, b = await connect(loop, lambda: Rec(loop))
        peer = Peer(b, limit=3)
        if source == "call_later":
            loop.call_later(0.001, tr.write, b"src")
        elif source == "future_callback":
            f = loop.create_future()
            f.add_done_callback(lambda f: tr.write(b"src"))
            loop.call_soon(f.set_result, None)
        elif source == "call_soon_threadsafe":
            threading.Thread(target=loop.call_soon_threadsafe, args=(tr.write, b"src")).start()
        else:
            loop.add_signal_handler(signal.SIGUSR1, tr.write, b"src")
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGUSR1)).start()
        data = await loop.run_in_executor(None, peer.result)
        if source == "add_signal_handler":
            loop.remove_signal_handler(signal.SIGUSR1)
        tr.close()
        await asyncio.wait_for(asyncio.shield(pr.lost), 5)
        b.close()
        return data
    assert run_on(loop, main()) == b"src"


@pytest.mark.parametrize("kind", kinds())
def test_write_after_write_eof_or_close(loop_of, kind):
    """write() after write_eof(): RuntimeError; after close(): ignored (asyncio logs it after
    LOG_THRESHOLD_FOR_CONNLOST_WRITES); the peer gets what came before, then EOF."""
    loop = loop_of(kind)

    async def main():
        out = []
        for end in ("write_eof", "close"):
            tr, pr, b = await connect(loop, lambda: Rec(loop))
            peer = Peer(b)
            tr.write(b"before")
            getattr(tr, end)()
            try:
                tr.write(b"after")
                out.append(None)
            except RuntimeError:
                out.append("RuntimeError")
            out.append(await loop.run_in_executor(None, peer.result))
            tr.close()
            await asyncio.wait_for(asyncio.shield(pr.lost), 5)
            b.close()
        return out
    assert run_on(loop, main()) == ["RuntimeError", b"before", None, b"before"]


@pytest.mark.parametrize("kind", kinds())
def test_writelines_of_many_small_parts_then_eof(loop_of, kind):
    # (a bytearray changed after write() is not compared: asyncio 3.11 copies it, 3.12+
    # and uvloop may send it as changed; aoprim.aio copies)
    loop = loop_of(kind)
    parts = [bytes([65 + i % 26]) * (i % 50 + 1) for i in range(5000)]

    async def main():
        tr, pr, b = await connect(loop, lambda: Rec(loop))
        peer = Peer(b)
        tr.writelines(parts)
        tr.writelines(iter([bytearray(b"array"), memoryview(b"view")]))
        tr.write_eof()
        data = await loop.run_in_executor(None, peer.result)
        tr.close()
        await asyncio.wait_for(asyncio.shield(pr.lost), 5)
        b.close()
        return data
    assert run_on(loop, main()) == b"".join(parts) + b"arrayview"


@pytest.mark.parametrize("family", ["tcp", "unix"])
@pytest.mark.parametrize("kind", kinds())
def test_peer_reset_with_megabytes_pending(loop_of, kind, family):
    """8 MiB pending, the peer closes unread data (TCP: RST; Unix socketpair: close with
    data queued): connection_lost(ConnectionResetError), once."""
    import struct
    loop = loop_of(kind)

    async def main():
        if family == "tcp":
            ls = socket.create_server(("127.0.0.1", 0))
            a = socket.create_connection(ls.getsockname())
            b, _ = ls.accept()
            ls.close()
            b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            a, b = socket.socketpair()
        tr, pr = await loop.create_connection(lambda: Rec(loop), sock=a)
        tr.write(b"x" * (8 << 20))
        b.recv(1)                            # the transport is writing
        b.close()                            # unread data: the writer's peer is reset
        exc = await asyncio.wait_for(asyncio.shield(pr.lost), 5)
        return type(exc), pr.events.count("lost"), tr.is_closing()
    exc_type, lost, closing = run_on(loop, main())
    assert (exc_type, lost, closing) == (ConnectionResetError, 1, True)


@pytest.mark.parametrize("kind", kinds())
def test_get_write_buffer_size_right_after_write(loop_of, kind):
    """What the kernel has not taken, also inside the callback that wrote: 0 for a write
    the socket buffer takes whole, the remainder (> 0) for one it cannot."""
    loop = loop_of(kind)

    async def main():
        tr, pr, b = await connect(loop, lambda: Rec(loop))
        b.setblocking(False)
        tr.write(b"s" * 1000)
        small = tr.get_write_buffer_size()
        tr.set_write_buffer_limits(high=64 << 20)     # no pause: only the size is compared
        tr.write(b"L" * (32 << 20))                    # more than any socket buffer
        large = tr.get_write_buffer_size()
        tr.abort()
        await asyncio.wait_for(asyncio.shield(pr.lost), 5)
        b.close()
        return small, 0 < large < (32 << 20)
    assert run_on(loop, main()) == (0, True)


@pytest.mark.parametrize("kind", kinds())
def test_buffered_protocol_with_a_small_buffer(loop_of, kind):
    loop = loop_of(kind)

    class BP(asyncio.BufferedProtocol):
        def __init__(self):
            self.buf = bytearray(7)
            self.got = bytearray()
            self.sizes = set()
            self.done = loop.create_future()

        def get_buffer(self, hint):
            return self.buf

        def buffer_updated(self, n):
            self.sizes.add(n <= 7)
            self.got += self.buf[:n]
            if len(self.got) >= 100_000 and not self.done.done():
                self.done.set_result(bytes(self.got))

    async def main():
        a, b = socket.socketpair()
        tr, pr = await loop.create_connection(BP, sock=a)
        payload = bytes(range(256)) * 400
        threading.Thread(target=b.sendall, args=(payload[:100_000],)).start()
        got = await asyncio.wait_for(pr.done, 10)
        tr.close()
        b.close()
        return got == payload[:100_000], pr.sizes
    assert run_on(loop, main()) == (True, {True})


@pytest.mark.parametrize("kind", kinds())
def test_tls_echo_of_8_mib_both_directions_under_back_pressure(loop_of, kind, tls_files):
    sctx, cctx = tls_contexts(tls_files)
    loop = loop_of(kind)
    blob = os.urandom(1 << 20) * 8

    async def handle(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()
        await w.wait_closed()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=sctx)
        port = srv.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=cctx,
                                             server_hostname="127.0.0.1")

        async def send():
            for i in range(0, len(blob), 100_000):
                w.write(blob[i:i + 100_000])
                await w.drain()
        sender = asyncio.ensure_future(send())
        got = bytearray()
        while len(got) < len(blob):
            chunk = await r.read(1 << 20)
            if not chunk:
                break
            got += chunk
        await sender
        w.close()
        await w.wait_closed()
        srv.close()
        await srv.wait_closed()
        return bytes(got) == blob
    assert run_on(loop, main(), timeout=50) is True


class SlowReaderProducer(asyncio.Protocol):
    """Writes ``blob`` in 64 KiB chunks until paused, goes on in resume_writing, closes after
    the last chunk; ``paused`` (a threading.Event) is set at the first pause_writing."""

    def __init__(self, loop, blob):
        self.blob = blob
        self.pos = 0
        self.pauses = 0
        self.is_paused = False
        self.paused = threading.Event()
        self.lost = loop.create_future()

    def connection_made(self, transport):
        self.transport = transport
        self._produce()

    def _produce(self):
        while not self.is_paused and self.pos < len(self.blob):
            self.transport.write(self.blob[self.pos:self.pos + 65536])
            self.pos += 65536
        if self.pos >= len(self.blob) and not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self):
        self.is_paused = True
        self.pauses += 1
        self.paused.set()

    def resume_writing(self):
        self.is_paused = False
        self._produce()

    def connection_lost(self, exc):
        self.paused.set()                    # never leave the client waiting
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", kinds())
def test_tls_16_mib_to_a_slow_reader_with_a_small_receive_buffer(loop_of, kind, tls_files):
    """The server writes 16 MiB over TLS to a client whose SO_RCVBUF is small and which
    reads only once the server has been paused: every byte arrives, in order, then EOF."""
    import ssl
    sctx, cctx = tls_contexts(tls_files)
    loop = loop_of(kind)
    blob = os.urandom(16 << 20)
    protos = []
    result = {}

    def client(port):
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect
        raw.settimeout(20)
        raw.connect(("127.0.0.1", port))
        with cctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            # late: only once the server's writes have backed up to a pause
            if not protos_ready.wait(20) or not protos[0].paused.wait(20):
                result["err"] = "the server never paused"
                return
            got = bytearray()
            while True:
                try:
                    chunk = s.recv(1 << 16)
                except (OSError, ssl.SSLError) as exc:
                    result["err"] = repr(exc)
                    break
                if not chunk:
                    break
                got += chunk
            result["got"] = bytes(got)

    protos_ready = threading.Event()

    async def main():
        def factory():
            protos.append(SlowReaderProducer(loop, blob))
            protos_ready.set()
            return protos[-1]
        server = await loop.create_server(factory, "127.0.0.1", 0, ssl=sctx)
        port = server.sockets[0].getsockname()[1]
        t = threading.Thread(target=client, args=(port,), daemon=True)
        t.start()
        await loop.run_in_executor(None, t.join, 90)
        assert not t.is_alive(), "client did not finish"
        exc = await asyncio.wait_for(asyncio.shield(protos[0].lost), 10)
        server.close()
        await server.wait_closed()
        return exc
    exc = run_on(loop, main(), timeout=100)
    assert result.get("err") is None
    got = result["got"]
    assert len(got) == len(blob)
    assert got == blob
    assert len(protos) == 1 and protos[0].pauses >= 1 and protos[0].pos >= len(blob)
    assert exc is None


@pytest.mark.parametrize("kind", kinds())
def test_start_tls_on_both_ends(loop_of, kind, tls_files):
    sctx, cctx = tls_contexts(tls_files)
    loop = loop_of(kind)

    async def handle(r, w):
        await w.start_tls(sctx)
        data = await r.readexactly(5)
        w.write(data * 1000)
        await w.drain()
        w.close()
        await w.wait_closed()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        await w.start_tls(cctx, server_hostname="127.0.0.1")
        w.write(b"hello")
        got = await r.read(-1)
        w.close()
        await w.wait_closed()
        srv.close()
        await srv.wait_closed()
        return got
    assert run_on(loop, main()) == b"hello" * 1000


@pytest.mark.parametrize("kind", kinds())
def test_sendfile_between_writes_keeps_order(loop_of, kind, tmp_path):
    if kind == "uvloop":
        pytest.skip("uvloop's loop.sendfile() raises NotImplementedError")
    loop = loop_of(kind)
    path = tmp_path / "f.bin"
    path.write_bytes(b"s" * 300_000)

    async def main():
        tr, pr, b = await connect(loop, lambda: Rec(loop))
        peer = Peer(b)
        tr.write(b"head")
        with open(path, "rb") as f:
            n = await loop.sendfile(tr, f)
        tr.write(b"tail")
        tr.write_eof()
        data = await loop.run_in_executor(None, peer.result)
        tr.close()
        await asyncio.wait_for(asyncio.shield(pr.lost), 5)
        b.close()
        return n, data
    n, data = run_on(loop, main())
    assert n == 300_000
    assert data == b"head" + b"s" * 300_000 + b"tail"


@pytest.mark.parametrize("kind", kinds())
def test_write_then_stop_delivers_before_run_forever_returns(loop_of, kind):
    loop = loop_of(kind)
    tr, pr, b = loop.run_until_complete(connect(loop, lambda: Rec(loop)))

    def cb():
        tr.write(b"bye")
        loop.stop()
    loop.call_soon(cb)
    loop.run_forever()
    b.setblocking(False)
    try:
        got = b.recv(10)                     # no waiting: the kernel must have it already
    except BlockingIOError:
        got = b""
    tr.close()
    loop.run_until_complete(asyncio.wait_for(asyncio.shield(pr.lost), 5))
    b.close()
    assert got == b"bye"
