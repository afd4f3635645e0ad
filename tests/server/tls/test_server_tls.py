"""TLS on aoprim.server: echo over TLS 1.2 and 1.3 (framed and raw), the handshake
before on_connect, get_extra_info, client certificates, handshake_timeout, close_notify on
close(), back-pressure, PROXY header before the ClientHello, workers, broadcast -- on both
backends, every slot and fd back after every test (make_server's teardown checks).
Hostile peers, openssl s_client, HAProxy and the bench live in the tlstest suites."""
import logging
import socket
import ssl
import struct
import threading

import pytest

from aoprim.server import Handler, Server
from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS

from proc_support import end
from tlscerts import CLIENT_CN, tls_certs  # noqa: F401  (fixture)
from server_support import (HOST, assert_no_leaks, frame, make_server,  # noqa: F401
                                 open_fds, recv_exact, wait_for)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def tls_connect(srv, ctx, hostname="localhost", timeout=10.0, strict_eof=False):
    """A TLS client socket; ``strict_eof``: a TCP EOF without close_notify raises
    SSLEOFError (by default recv answers b"" for both, as ssl's suppress_ragged_eofs)."""
    raw = socket.create_connection(srv.address, timeout=timeout)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        return ctx.wrap_socket(raw, server_hostname=hostname,
                               suppress_ragged_eofs=not strict_eof)
    except BaseException:
        raw.close()
        raise


def read_u16(s):
    n = struct.unpack(">H", recv_exact(s, 2))[0]
    return recv_exact(s, n)


class Recorder(Echo):
    def __init__(self):
        self.connected = []
        self.closed = []
        self.info = {}

    def on_connect(self, session):
        self.connected.append(session)
        self.info[session.id] = {k: session.get_extra_info(k) for k in (
            "peername", "sockname", "ssl_object", "peercert", "cipher",
            "selected_alpn_protocol")}

    def on_close(self, session, exc):
        self.closed.append(session.id)


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_u16_echo_pipelined(make_server, tls_certs, version):
    srv = make_server(Echo(), framing="u16", ssl=tls_certs.server_ctx())
    with tls_connect(srv, tls_certs.client_ctx(version=version)) as s:
        assert s.version() == {"1.2": "TLSv1.2", "1.3": "TLSv1.3"}[version]
        payloads = [bytes([i]) * (i * 37 % 3000) for i in range(200)]
        s.sendall(b"".join(frame(p) for p in payloads))
        for p in payloads:
            assert read_u16(s) == p
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")


def echo_one_thread(srv, ctx, data, nbytes):
    """Write ``data`` and read ``nbytes`` back over TLS in ONE thread (asyncio): an
    SSLSocket must not be read and written from two threads at once (OpenSSL's SSL object
    is not thread-safe; a reader thread beside sendall() garbled the stream now and then)."""
    import asyncio

    async def run():
        r, w = await asyncio.open_connection(*srv.address, ssl=ctx,
                                             server_hostname="localhost")
        w.write(data)
        try:
            return await asyncio.wait_for(r.readexactly(nbytes), 30)
        finally:
            w.close()
            try:
                await asyncio.wait_for(w.wait_closed(), 10)     # close_notify both ways
            except (asyncio.TimeoutError, OSError):
                w.transport.abort()
    return asyncio.run(run())


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_raw_echo_large(make_server, tls_certs, version):
    srv = make_server(Echo(), ssl=tls_certs.server_ctx())
    blob = bytes(range(256)) * 4096         # 1 MiB: many records, many slots
    got = echo_one_thread(srv, tls_certs.client_ctx(version=version), blob, len(blob))
    assert got == blob


def test_extra_info_and_on_connect_after_handshake(make_server, tls_certs):
    h = Recorder()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(alpn=["x-aoprim", "h2"]))
    ctx = tls_certs.client_ctx(alpn=["x-aoprim"])
    with tls_connect(srv, ctx) as s:
        s.sendall(frame(b"hi"))
        assert read_u16(s) == b"hi"
        info = h.info[h.connected[0].id]
        assert info["peername"] == s.getsockname()
        assert info["sockname"] == s.getpeername()
        assert isinstance(info["ssl_object"], ssl.SSLObject)
        assert info["cipher"][0] == s.cipher()[0]
        assert info["selected_alpn_protocol"] == "x-aoprim"
        assert not info["peercert"]             # no client certificate asked for
        assert h.connected[0].get_extra_info("nope", 7) == 7


@pytest.mark.parametrize("mode", ["required", "optional"])
def test_client_cert(make_server, tls_certs, mode):
    h = Recorder()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(client_cert=mode))
    with tls_connect(srv, tls_certs.client_ctx(with_cert=True)) as s:
        s.sendall(frame(b"x"))
        assert read_u16(s) == b"x"
    cert = h.info[h.connected[0].id]["peercert"]
    assert dict(x[0] for x in cert["subject"])["commonName"] == CLIENT_CN
    if mode == "optional":
        with tls_connect(srv, tls_certs.client_ctx()) as s:
            s.sendall(frame(b"y"))
            assert read_u16(s) == b"y"
        assert not h.info[h.connected[1].id]["peercert"]


def test_client_cert_required_missing_or_foreign_closes_that_one(make_server, tls_certs,
                                                                  caplog):
    h = Recorder()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(client_cert="required"))
    for ctx in (tls_certs.client_ctx(version="1.2"),
                tls_certs.client_ctx(other_cert=True, version="1.2")):
        with pytest.raises((ssl.SSLError, OSError)):
            with tls_connect(srv, ctx) as s:
                s.sendall(frame(b"x"))
                read_u16(s)
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")
    assert h.connected == [] and h.closed == []      # the handler never met them
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with tls_connect(srv, tls_certs.client_ctx(with_cert=True)) as s:   # others still served
        s.sendall(frame(b"ok"))
        assert read_u16(s) == b"ok"


def test_handshake_timeout(make_server, tls_certs, caplog):
    h = Recorder()
    srv = make_server(h, ssl=tls_certs.server_ctx(), handshake_timeout=0.3)
    with socket.create_connection(srv.address) as raw:
        raw.settimeout(10)
        raw.sendall(b"\x16\x03\x01")        # a ClientHello that never completes
        assert raw.recv(100) == b""         # cut by the server
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")
    assert h.connected == [] and h.closed == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_plaintext_instead_of_client_hello(make_server, tls_certs, caplog):
    srv = make_server(Echo(), ssl=tls_certs.server_ctx())
    with socket.create_connection(srv.address) as raw:
        raw.settimeout(10)
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
        try:
            while raw.recv(100):
                pass                        # (an alert, then EOF)
        except ConnectionResetError:
            pass
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class CloseAfterReply(Handler):
    def on_read(self, session, data):
        session.send(data)
        session.close()


def test_close_sends_close_notify_after_the_reply(make_server, tls_certs):
    srv = make_server(CloseAfterReply(), framing="u16", ssl=tls_certs.server_ctx())
    with tls_connect(srv, tls_certs.client_ctx(), strict_eof=True) as s:
        s.sendall(frame(b"bye"))
        assert read_u16(s) == b"bye"
        # close_notify: a clean TLS EOF (recv returns b""), not SSLEOFError / a reset
        assert s.recv(10) == b""
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")


def test_shutdown_sends_close_notify(backend, tls_certs):
    srv = Server(Echo(), HOST, 0, framing="u16", backend=backend,
                 ssl=tls_certs.server_ctx()).start()
    try:
        with tls_connect(srv, tls_certs.client_ctx(), strict_eof=True) as s:
            s.sendall(frame(b"a"))
            assert read_u16(s) == b"a"
            threading.Thread(target=srv.shutdown).start()
            assert s.recv(10) == b""
    finally:
        srv.shutdown()
    assert_no_leaks(srv)


class TwoBursts(Handler):
    """200 KiB at once, then 200 KiB more once the first was encrypted (a loop timer): only
    the ciphertext still unsent makes the second burst exceed max_pending (300 KiB)."""
    def on_connect(self, session):
        session.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def on_read(self, session, data):
        session.send(b"z" * (200 << 10))
        session.server.loop.call_later(0.3, session.send, b"y" * (200 << 10))


def test_max_pending_counts_unsent_ciphertext(make_server, tls_certs, caplog):
    srv = make_server(TwoBursts(), ssl=tls_certs.server_ctx(), max_pending=300 << 10)
    s = tls_connect(srv, tls_certs.client_ctx())
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"go")
        wait_for(lambda: srv.stats()["connections"] == 0, 20, "cut for max_pending")
    finally:
        s.close()
    assert any("max_pending" in r.getMessage() for r in caplog.records)


class WorkerBursts(Handler):
    """With workers: 250 KiB in reply to "a" (all of it encrypted by the next flush, little
    of it sent: small socket buffers), then 100 KiB in reply to "b" -- a worker's send,
    checked against max_pending (256 KiB) where it is queued.  The plaintext pending then is
    0; the ciphertext not yet sent is most of the 250 KiB."""
    def __init__(self):
        self.closed_after = []

    def on_connect(self, session):
        session.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def on_read(self, session, data):
        for c in bytes(data):
            if c == ord("a"):
                session.send(b"z" * (250 << 10))
            elif c == ord("b"):
                session.send(b"y" * (100 << 10))
                self.closed_after.append(session.closed)


def test_max_pending_counts_unsent_ciphertext_for_a_workers_send(make_server, tls_certs,
                                                                 caplog):
    """A send from a worker thread is checked against max_pending where it is queued: that
    check must count the ciphertext not yet sent, as the loop thread's does (it counted the
    plaintext only: the 100 KiB was accepted with ~250 KiB of ciphertext unsent, and below
    the high-water mark nothing checked again -- the session stayed open above max_pending).
    high_water is max_pending, so neither send alone takes the loop's _over_high path."""
    h = WorkerBursts()
    srv = make_server(h, ssl=tls_certs.server_ctx(), workers=1, max_pending=256 << 10,
                      high_water=256 << 10)
    s = tls_connect(srv, tls_certs.client_ctx())
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"a")
        assert s.recv(1) == b"z"        # the 250 KiB was encrypted and began to leave
        s.sendall(b"b")
        wait_for(lambda: srv.stats()["connections"] == 0, 10, "cut for max_pending")
    finally:
        s.close()
    assert h.closed_after == [True]     # refused in the worker's own send
    assert srv.stats()["closes"].get("max_pending") == 1
    assert any("max_pending" in r.getMessage() for r in caplog.records)


class Chatty(Echo):
    def on_read(self, session, data):
        if bytes(data) == b"all":
            session.server.broadcast(b"B" * 5000)   # larger than copy_max: by reference
        else:
            session.send(data)


def test_broadcast_to_tls_sessions(make_server, tls_certs):
    srv = make_server(Chatty(), framing="u16", ssl=tls_certs.server_ctx())
    socks = [tls_connect(srv, tls_certs.client_ctx()) for _ in range(3)]
    try:
        for s in socks:
            s.sendall(frame(b"ping"))
            assert read_u16(s) == b"ping"
        socks[0].sendall(frame(b"all"))
        for s in socks:
            assert read_u16(s) == b"B" * 5000
    finally:
        for s in socks:
            s.close()


def test_workers(make_server, tls_certs):
    srv = make_server(Echo(), framing="u16", ssl=tls_certs.server_ctx(), workers=2)
    with tls_connect(srv, tls_certs.client_ctx()) as s:
        payloads = [bytes([i]) * 100 for i in range(100)]
        s.sendall(b"".join(frame(p) for p in payloads))
        for p in payloads:
            assert read_u16(s) == p


def test_proxy_header_then_handshake(make_server, tls_certs):
    h = Recorder()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), proxy_protocol="v1")
    raw = socket.create_connection(srv.address, timeout=10)
    raw.sendall(b"PROXY TCP4 203.0.113.7 192.0.2.1 4242 443\r\n")
    with tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(frame(b"via proxy"))
        assert read_u16(s) == b"via proxy"
        sess = h.connected[0]
        assert sess.peer == ("203.0.113.7", 4242)
        assert sess.get_extra_info("peername") == ("203.0.113.7", 4242)


def test_many_handshakes_slots_back(make_server, tls_certs):
    srv = make_server(Echo(), framing="u16", ssl=tls_certs.server_ctx())
    ctx = tls_certs.client_ctx()
    for i in range(30):
        with tls_connect(srv, ctx) as s:
            s.sendall(frame(b"%d" % i))
            assert read_u16(s) == b"%d" % i
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")
    st = srv.stats()
    assert st["connections_total"] == 30
    wait_for(lambda: srv.stats()["rx_slots_in_use"] <= 1, what="slots back")


def test_ssl_setting_validated():
    with pytest.raises(TypeError):
        Server(Echo(), HOST, 0, ssl=object())
    with pytest.raises(ValueError):
        Server(Echo(), HOST, 0, ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    with pytest.raises(ValueError):
        Server(Echo(), HOST, 0, ssl=None, handshake_timeout=0)


# -- the two compiled hooks TLS uses --------------------------------------------------------

def test_sendbatch_take_view_and_consume():
    from aoprim import SendBatch
    a, b = socket.socketpair()
    try:
        sb = SendBatch(a, auto_flush=False)
        assert sb.take_view() is None
        sb.add_frame(b"abc", 2)
        sb.add_frame(b"de", 2)
        big = b"x" * 5000                   # larger than copy_max: its own segment
        sb.add(big)
        v = sb.take_view()
        assert bytes(v) == b"\x00\x03abc\x00\x02de"     # coalesced: one segment
        v.release()
        sb.consume(4)
        assert sb.pending_bytes == 5005 and sb.pending_msgs == 3
        sb.consume(5)
        assert sb.pending_msgs == 1
        v = sb.take_view()
        assert bytes(v) == big
        v.release()
        with pytest.raises(ValueError):
            sb.consume(5001)
        sb.consume(5000)
        assert sb.pending_bytes == 0 and sb.take_view() is None
        assert sb.stats["bytes"] == 9 + 5000 and sb.stats["messages"] == 3
    finally:
        a.close()
        b.close()


def test_receiver_source_fills_the_slot_and_frames_are_cut():
    from aoprim import SlabPool
    from aoprim.server._receiver import Receiver, RX_EOF
    from aoprim.server._rxbuf import RxArena
    chunks = [frame(b"hello") + frame(b"wor"), frame(b"!")[:1],
              frame(b"!")[1:], None, 0]
    got, events = [], []

    def source(view):
        c = chunks.pop(0)
        if c is None or c == 0:
            return c
        view[:len(c)] = c
        return len(c)
    pool = SlabPool(4096, 4)
    arena = RxArena(pool)
    rx = Receiver(arena, 0, 2, 1000, lambda o, d: got.append(bytes(d)),
                  lambda o, c, a: events.append(c), None)
    rx.source = source
    for _ in range(5):
        rx.on_readable()
    assert got == [b"hello", b"wor", b"!"]
    assert events == [RX_EOF]
    rx.close()
    arena.close()
    assert pool.in_use == 0
    with pytest.raises(TypeError):
        rx.source = 3


# -- the CLI ---------------------------------------------------------------------------------

def _cli_echo(port, ctx):
    raw = socket.create_connection((HOST, port), timeout=10)
    with ctx.wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(frame(b"over tls"))
        assert read_u16(s) == b"over tls"
        return s.version()


@pytest.mark.parametrize("procs", ["1", "2"])
def test_cli_serves_tls_with_client_certs(tls_certs, procs):
    import signal
    import test_cli as cli_t
    c = tls_certs
    p, port = cli_t.start_server("--app", "echo", "--framing", "u16", "--procs", procs,
                                 "--certfile", c.server_cert, "--keyfile", c.server_key,
                                 "--ca-certs", c.ca_cert, "--client-cert", "required",
                                 "--handshake-timeout", "5")
    try:
        assert _cli_echo(port, c.client_ctx(with_cert=True)) == "TLSv1.3"
        assert _cli_echo(port, c.client_ctx(with_cert=True, version="1.2")) == "TLSv1.2"
        with pytest.raises((ssl.SSLError, OSError)):
            _cli_echo(port, c.client_ctx(version="1.2"))       # no client certificate
        rc, out, err = cli_t.stop(p, signal.SIGINT)
        assert rc == 0, err
        assert "Traceback" not in err and " ERROR " not in err
    finally:
        end(p)


@pytest.mark.parametrize("args, message", [
    (["--keyfile", "k.pem"], "need --certfile"),
    (["--certfile", "/nonexistent/cert.pem"], "TLS: "),
    (["--certfile", "CERT", "--client-cert", "required"], "needs --ca-certs"),
])
def test_cli_tls_usage_errors(tls_certs, args, message):
    import subprocess
    import sys
    args = [tls_certs.server_cert if a == "CERT" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port", "0",
                        *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr


def test_signature_names_ssl_and_handshake_timeout():
    import inspect
    params = inspect.signature(Server).parameters
    assert params["ssl"].default is None and params["handshake_timeout"].default == 10.0


def test_stats_count_tls_sends_and_ciphertext(make_server, tls_certs):
    srv = make_server(Echo(), framing="u16", ssl=tls_certs.server_ctx())
    with tls_connect(srv, tls_certs.client_ctx()) as s:
        s.sendall(b"".join(frame(b"x" * 100) for _ in range(16)))
        for _ in range(16):
            assert read_u16(s) == b"x" * 100
        # (the loop counts a send just after it returned: the client may be faster)
        wait_for(lambda: srv.stats()["tls_bytes_out"] > 16 * 102 + 1000, what="counters")
        st = srv.stats()
        assert st["bytes_out"] == 16 * 102                  # plaintext, as on plain TCP
        assert st["send_syscalls"] >= 2                     # handshake flight + the replies
        # ciphertext: the handshake's flights, tickets, record headers and tags on top
        assert st["tls_bytes_out"] > st["bytes_out"] + 1000
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")
    assert srv.stats()["tls_bytes_out"] >= st["tls_bytes_out"]   # folded at teardown too


class _SpyConn:
    """A session's TLSConn (compiled, final) behind a wrapper that records the thread of
    every mark() the session's Python makes; everything else goes to the real one."""
    threads = set()

    def __init__(self, *args):
        object.__setattr__(self, "real", _SpyConn.cls(*args))

    def mark(self):
        _SpyConn.threads.add(threading.get_ident())
        self.real.mark()

    # the send path's add-and-mark (compiled: its mark is not a Python call): a result >= 0
    # means it marked the session
    def send_frame(self, data, hs):
        p = self.real.send_frame(data, hs)
        if p >= 0:
            _SpyConn.threads.add(threading.get_ident())
        return p

    def send_copy(self, data):
        p = self.real.send_copy(data)
        if p >= 0:
            _SpyConn.threads.add(threading.get_ident())
        return p

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __setattr__(self, name, value):
        setattr(self.real, name, value)


def test_raw_sends_from_workers_mark_dirty_on_the_loop_thread_only(make_server, tls_certs,
                                                                    monkeypatch):
    """A send from a worker thread is handed to the loop (foreign queue); only the loop
    thread may touch TLSFlush's dirty list (a worker appending to it raced the flush that
    swaps it: a session left marked and never flushed)."""
    import aoprim.server.tls as tls_mod
    _SpyConn.cls = tls_mod.TLSConn
    _SpyConn.threads = set()
    monkeypatch.setattr(tls_mod, "TLSConn", _SpyConn)
    srv = make_server(Echo(), ssl=tls_certs.server_ctx(), workers=2)
    with tls_connect(srv, tls_certs.client_ctx()) as s:
        for i in range(50):
            s.sendall(b"m%03d" % i)
            assert recv_exact(s, 4) == b"m%03d" % i
    assert _SpyConn.threads == {srv.loop.thread_id}


def test_tlsconn_send_frame_and_send_copy_add_then_mark():
    """A TLS session's send, its compiled half: send_frame / send_copy add to the batch and mark the
    session dirty once (a result >= 0: the pending bytes); a memoryview of at least
    byref_min bytes, or a closed TLSConn, is left to the session's own send (-2, nothing
    added, not marked); another thread than the batch's owner gets -1, nothing added and no
    mark (the dirty list is the loop thread's)."""
    from aoprim import SendBatch
    from aoprim.server._tls import TLSConn, TLSFlush
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls = TLSFlush()
    a, b = socket.socketpair()
    try:
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        batch = SendBatch(a, auto_flush=False)
        batch.owner_thread = threading.get_ident()
        t = TLSConn(tls, object(), a, ctx.wrap_bio(inc, out, server_side=True), inc, out,
                    batch, 65536)
        t.byref_min = 32768
        assert t.send_frame(b"abc", 2) == 5 and t.dirty and len(tls) == 1
        assert t.send_copy(bytearray(b"xy")) == 7 and len(tls) == 1    # marked once
        big = memoryview(bytearray(32768))
        assert t.send_frame(big, 2) == -2 and t.send_copy(big) == -2
        assert t.send_copy(big[:-1]) == 7 + 32767                      # under: copied
        assert batch.pending_bytes == 7 + 32767
        res = []
        th = threading.Thread(target=lambda: res.append((t.send_frame(b"q", 2),
                                                         t.send_copy(b"q"))))
        th.start()
        th.join()
        assert res == [(-1, -1)] and batch.pending_bytes == 7 + 32767
        tls.flush()                         # app not set: nothing encrypted, unmarked
        assert not t.dirty and len(tls) == 0
        th = threading.Thread(target=lambda: res.append(t.send_copy(b"q")))
        th.start()
        th.join()
        assert res[-1] == -1 and not t.dirty and len(tls) == 0          # no mark
        t.byref_min = -1                    # none left to the session
        assert t.send_copy(big) == 7 + 32767 + 32768 and t.dirty
        t.close()
        assert t.send_frame(b"abc", 2) == -2 and t.send_copy(b"abc") == -2
        assert batch.pending_bytes == 7 + 32767 + 32768
        batch.clear()
    finally:
        a.close()
        b.close()


def test_u16_large_frames_echo_by_reference(make_server, tls_certs):
    """Frames above the by-reference threshold: the echo's batch holds the receive view
    (Session.send's path) and TLSFlush encrypts from it; every byte back, slots back."""
    srv = make_server(Echo(), framing="u16", ssl=tls_certs.server_ctx())
    payloads = [bytes([i]) * (60000 - i) for i in range(8)]
    stream = b"".join(frame(p) for p in payloads)
    assert echo_one_thread(srv, tls_certs.client_ctx(), stream, len(stream)) == stream
