"""A TLS session's life on aoprim.server, broken on purpose: what on_close sends, asyncio's
TLS names, writes from resume_writing, a close during the handshake, a flush report that
raises, the PROXY header's deadline, freeing, closes and shutdowns from threads, the idle
clock.  Each test here is a hostile or racy scenario, against the real server on loopback,
both backends, every slot and fd back to idle after each test (make_server's teardown), no
ERROR log line."""
import asyncio
import gc
import logging
import socket
import ssl
import struct
import threading
import time
import weakref

import pytest

from aoprim.server import Handler, Server, serve_protocol
from aoprim.server.loop import BACKENDS

from tls_clients import RawTLS, client_hello
from tlscerts import tls_certs  # noqa: F401  (fixture)
from server_support import (error_lines, frame, logs, make_server,  # noqa: F401
                                 open_fds, read_frame, wait_for)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def every_session(srv):
    """Every session the server holds, those still in their TLS handshake included.  The
    public ``Server.sessions`` lists only sessions whose ``on_connect`` ran; these tests reach
    a session before that on purpose, to prove a send or close that gets there anyway is safe."""
    return list(srv._sessions.values())


def connect(srv, certs):
    raw = socket.create_connection(srv.address, timeout=10)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if certs is None:
        return raw
    return certs.client_ctx().wrap_socket(raw, server_hostname="localhost")


# -- what on_close sends, when the close finished inside the iteration's flush ------------------

class Chat(Handler):
    """Echo; ``bye`` closes the session (``bye!`` after a reply); on_close tells the others."""

    def on_read(self, session, data):
        d = bytes(data)
        if d == b"bye!":
            session.send(b"ok")
        if d.startswith(b"bye"):
            session.close()
        else:
            session.send(d)

    def on_close(self, session, exc):
        session.server.broadcast(b"left %d" % session.id, exclude=session)


@pytest.mark.parametrize("tls, how", [(True, "bye"), (True, "eof"), (True, "bye!"),
                                      (False, "bye!")])
def test_what_on_close_sends_leaves_without_waiting_for_another_event(
        make_server, tls_certs, logs, monkeypatch, tls, how):
    """A close that waits for its output (over TLS every graceful close does: close_notify;
    over plain TCP one with a reply still owed) finishes inside the iteration's flush, and
    the handler's on_close runs there: what it sends (here a broadcast to the others) must
    still leave at once.  Before: it marked the other sessions after the flush had passed
    them and waited for the loop's next wake-up -- the next event, or the 1 s sweep (taken
    away here, with every other timer pushed beyond the client's timeout, so the wait is
    the client's 10 s timeout and the test fails instead of being merely slow; with the
sweep, the notice came 1 s late)."""
    ticked = threading.Event()
    monkeypatch.setattr(Server, "_sweep", lambda self: ticked.set())  # one tick, no more
    kw = {"ssl": tls_certs.server_ctx(), "handshake_timeout": 60.0} if tls else {}
    srv = make_server(Chat(), framing="u16", close_linger=60.0, **kw)
    certs = tls_certs if tls else None
    a, b = connect(srv, certs), connect(srv, certs)
    try:
        for s in (a, b):
            s.sendall(frame(b"hi"))
            assert read_frame(s) == b"hi"
        wait_for(lambda: srv.stats()["connections"] == 2, what="both sessions")
        aid = min(s.id for s in srv.sessions)
        assert ticked.wait(10), "the sweep's first tick"    # from here on no timer is due
        if how == "eof":
            a.unwrap().shutdown(socket.SHUT_WR)     # close_notify, then the TCP EOF
        else:
            a.sendall(frame(how.encode()))
        assert read_frame(b, timeout=10) == b"left %d" % aid
    finally:
        a.close()
        b.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    assert not error_lines(logs), error_lines(logs)[:5]


# -- an asyncio protocol served over TLS sees asyncio's TLS names --------------------------------

TLS_NAMES = ("sslcontext", "ssl_object", "peercert", "cipher", "compression")


class Seen(asyncio.Protocol):
    """Records what its transport answers for asyncio's TLS names at connection_made."""

    seen = None
    done = None

    def connection_made(self, transport):
        type(self).seen = {k: transport.get_extra_info(k) for k in TLS_NAMES}
        type(self).done.set()
        transport.write(b"ok")


def _answers(serve, certs):
    """What a Seen protocol's transport answered, for a client with a certificate."""
    Seen.seen, Seen.done = None, threading.Event()
    address, stop = serve()
    raw = socket.create_connection(address, timeout=10)
    try:
        s = certs.client_ctx(with_cert=True).wrap_socket(raw, server_hostname="localhost")
        with s:
            assert s.recv(2) == b"ok"
        assert Seen.done.wait(10)
        return Seen.seen
    finally:
        raw.close()
        stop()


def test_an_asyncio_protocol_over_tls_sees_asyncios_tls_extra_info(backend, tls_certs):
    """serve_protocol(..., ssl=ctx): the protocol's transport answers asyncio's TLS names as
    asyncio's own TLS transport does ("sslcontext" is what uvicorn asks to choose the
    https scheme).  Before: None for every one of them (the adapter's get_extra_info knew
    peername, sockname and socket only)."""
    ctx = tls_certs.server_ctx(client_cert="required")

    def aoprim_server():
        srv = serve_protocol(Seen, backend=backend, ssl=ctx)
        return srv.address, lambda: srv.shutdown(timeout=15)

    def asyncio_server():
        loop = asyncio.new_event_loop()
        srv = loop.run_until_complete(loop.create_server(Seen, "127.0.0.1", 0, ssl=ctx))
        th = threading.Thread(target=loop.run_forever)
        th.start()

        def stop():
            loop.call_soon_threadsafe(loop.stop)
            th.join(10)
            srv.close()
            loop.run_until_complete(srv.wait_closed())
            loop.close()
        return srv.sockets[0].getsockname(), stop

    ours, theirs = _answers(aoprim_server, tls_certs), _answers(asyncio_server, tls_certs)
    assert ours["sslcontext"] is ctx and theirs["sslcontext"] is ctx
    assert isinstance(ours["ssl_object"], ssl.SSLObject)
    assert ours["ssl_object"].context is ctx
    assert ours["peercert"] and ours["peercert"] == theirs["peercert"]
    assert ours["cipher"] == theirs["cipher"]
    assert ours["compression"] == theirs["compression"]


def test_an_asyncio_protocol_over_plain_tcp_sees_no_tls(backend):
    srv = serve_protocol(Seen, backend=backend)
    Seen.seen, Seen.done = None, threading.Event()
    try:
        with socket.create_connection(srv.address, timeout=10) as s:
            assert s.recv(2) == b"ok"
        assert Seen.done.wait(10)
        assert Seen.seen == dict.fromkeys(TLS_NAMES)
    finally:
        srv.shutdown(timeout=15)


class Pump(asyncio.Protocol):
    """Writes ``TOTAL`` bytes as fast as flow control lets it: until pause_writing, then on
    from resume_writing (called from the flush's report, once the backlog drained)."""

    TOTAL = 4 << 20
    CHUNK = 16 << 10

    def connection_made(self, transport):
        self.t = transport
        self.sent = 0
        self.paused = False
        self.pump()

    def pump(self):
        while not self.paused and self.sent < self.TOTAL:
            n = min(self.CHUNK, self.TOTAL - self.sent)
            self.t.write(bytes([self.sent // self.CHUNK & 0xFF]) * n)
            self.sent += n
        if self.sent >= self.TOTAL:
            self.t.close()

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        self.pump()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tls", [False, True])
def test_writes_made_by_resume_writing_leave_at_once(backend, tls_certs, monkeypatch, tls):
    """An asyncio protocol that writes from resume_writing (asyncio's flow control, through
    the session's write limits) gets 4 MiB out to a reader that reads slowly (small
    buffers) without stalling.  resume_writing runs from the flush's report: before, what
    it wrote waited for the loop's next event -- none came (no timer: the sweep is taken
    away, as above) and the client's 20 s read timeout ran out after the first few
    hundred KiB."""
    ticked = threading.Event()
    monkeypatch.setattr(Server, "_sweep", lambda self: ticked.set())
    kw = {"ssl": tls_certs.server_ctx(), "handshake_timeout": 600.0} if tls else {}
    srv = serve_protocol(Pump, backend=backend, close_linger=600.0, **kw)
    try:
        assert ticked.wait(10)
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        raw.settimeout(20)
        raw.connect(srv.address)
        s = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost") if tls else raw
        with s:
            got = bytearray()
            while True:
                d = s.recv(8192)
                if not d:
                    break
                got += d
        assert len(got) == Pump.TOTAL
        assert all(got[i] == i // Pump.CHUNK & 0xFF for i in range(0, Pump.TOTAL, 4096))
        wait_for(lambda: srv.stats()["connections"] == 0, 15, "the session to close")
    finally:
        srv.shutdown(timeout=15)


def test_close_during_the_handshake_with_plaintext_queued_closes_at_once(make_server,
                                                                         tls_certs, logs):
    """A session still in its handshake (reached through the server's own table: ``Server.sessions`` lists only sessions
    the handler met) is sent to and
    closed from another thread: that plaintext can never be encrypted (no handshake), so
    nothing is owed -- the connection closes at once, nothing in clear reaches the peer, no
    on_connect, no close_linger wait, no WARNING."""
    h = Chat()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), handshake_timeout=600.0,
                      close_linger=600.0)
    hello = client_hello(tls_certs.client_ctx())
    with socket.create_connection(srv.address, timeout=10) as s:
        s.sendall(hello[:len(hello) // 2])
        sess = wait_for(lambda: every_session(srv), what="the session")[0]
        sess.send(b"in clear?")
        sess.close()
        got = bytearray()
        while True:
            d = s.recv(1 << 16)         # (10 s socket timeout: a close that waits fails)
            if not d:
                break
            got += d
        assert b"in clear?" not in got and not got
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the session to close")
    assert srv.stats()["closes"] == {"closed": 1}
    assert not [r for r in logs.records if r.levelno >= logging.WARNING]


# -- one session's report raising does not stall the others ----------------------------------------

class LimitsRaise(Handler):
    """The first session's write-limit on_low raises; every frame is broadcast to all."""

    def __init__(self):
        self.first = None

    def on_connect(self, session):
        if self.first is None:
            self.first = session
            session.set_write_limits(0, 0, lambda: None, self.on_low)

    def on_low(self):
        raise RuntimeError("on_low failed")

    def on_read(self, session, data):
        session.server.broadcast(bytes(data))


@pytest.mark.parametrize("tls", [False, True])
def test_a_flush_report_that_raises_does_not_stall_the_other_sessions(make_server, tls_certs,
                                                                      caplog, tls):
    """Session A's write-limit callback raises inside the flush's report for A; session B,
    flushed in the same iteration after A, still gets every broadcast -- the plain
    FlushGroup notifies every batch even if one notify raises.  Before, over TLS: the
    exception left TLSFlush with B's entry dropped but B still marked dirty, so no later
    send to B was ever flushed (B's client timed out)."""
    h = LimitsRaise()
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    srv = make_server(h, framing="u16", **kw)
    certs = tls_certs if tls else None
    a = connect(srv, certs)
    wait_for(lambda: h.first is not None, what="A's on_connect")
    b = connect(srv, certs)
    try:
        for k in range(3):
            a.sendall(frame(b"round %d" % k))
            assert read_frame(b, timeout=10) == b"round %d" % k
            assert read_frame(a, timeout=10) == b"round %d" % k
    finally:
        a.close()
        b.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    raised = [r for r in caplog.records if r.exc_info and "on_low failed" in str(r.exc_info[1])]
    assert raised, "the callback's exception was not logged"


# -- the PROXY header's own deadline holds in front of TLS too -----------------------------------

@pytest.mark.parametrize("sent", ["nothing", "half a header"])
def test_proxy_header_timeout_holds_in_front_of_tls(make_server, tls_certs, logs, sent):
    """With ssl= and proxy_protocol, a trusted peer that sends half a PROXY header (or
    nothing) is cut by proxy_header_timeout (from the accept, as documented in
    docs/proxy-protocol.md), not only by a longer handshake_timeout.  Before: a TLS session
    reads the header itself, the Receiver's proxy_pending was never set, and the deadline
    was not checked at all (cut after handshake_timeout, 60 s here)."""
    hdr_to = 0.5
    srv = make_server(Chat(), framing="u16", ssl=tls_certs.server_ctx(), proxy_protocol="v2",
                      proxy_header_timeout=hdr_to, handshake_timeout=60.0)
    v2 = b"\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c" + bytes(12)
    with socket.create_connection(srv.address, timeout=10) as s:
        if sent == "half a header":
            s.sendall(v2[:10])
        assert s.recv(100) == b""   # (a 10 s socket timeout: a later cut fails the test)
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the session to close")
    assert srv.stats()["closes"] == {"timeout": 1}
    assert any("PROXY header timeout" in r.getMessage() for r in logs.records)
    assert not error_lines(logs), error_lines(logs)[:5]
    # a whole header and a TLS handshake within the deadline's reach are not cut by it
    t = RawTLS(srv.address, tls_certs.client_ctx()).handshake(prefix=v2)
    try:
        assert t.echo(b"fine") == b"fine"
        t0 = srv.stats()["closes"]
        deadline = time.monotonic() + 4 * hdr_to
        while time.monotonic() < deadline:      # past the header's deadline, still served
            assert t.echo(b"still") == b"still"
        assert srv.stats()["closes"] == t0
    finally:
        t.sock.close()


# -- a closed TLS session is freed by reference counting -----------------------------------------

@pytest.mark.parametrize("how", ["close_notify", "server close", "abort", "bad handshake",
                                 "handshake timeout"])
def test_a_closed_tls_session_is_freed_without_the_cyclic_gc(make_server, tls_certs, how):
    """With the cyclic GC off, every way a TLS session ends leaves nothing of it (its
    SSLObject and BIOs are tens of KiB) once its last reference is dropped, as a plain
    session.  Before: its Rx held the session's bound _wire (the idle and frame clocks over
    the ciphertext), a cycle only the cyclic GC freed."""
    srv = make_server(Chat(), framing="u16", ssl=tls_certs.server_ctx(),
                      handshake_timeout=0.5 if how == "handshake timeout" else 10.0)
    gc.collect()
    gc.disable()
    try:
        raw = s = socket.create_connection(srv.address, timeout=10)
        sess = weakref.ref(wait_for(lambda: every_session(srv), what="the session")[0])
        try:
            if how == "bad handshake":
                raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
                raw.recv(100)
            elif how == "handshake timeout":
                assert raw.recv(100) == b""
            else:
                s = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost")
                s.sendall(frame(b"hi"))
                assert read_frame(s) == b"hi"
                if how == "close_notify":
                    s.unwrap()
                elif how == "server close":
                    s.sendall(frame(b"bye"))
                    assert s.recv(10) == b""
                else:
                    srv.loop.call_soon_threadsafe(sess().abort)
                    assert s.recv(10) == b""
        finally:
            s.close()
        wait_for(lambda: srv.live_sessions == 0, 10, "the session's last reference")
        wait_for(lambda: sess() is None, 5, "the session to be freed (no cyclic GC)")
    finally:
        gc.enable()


# -- threads: closes from everywhere while workers send and a thread broadcasts ------------------

BPAY = b"B" + bytes(range(256)) * 12        # 3073 bytes: a send-pool Slot per broadcast


class Storm(Handler):
    """Echo from the workers; some frames also close/abort the session (from the worker),
    broadcast a Slot-sized payload, pause and resume reading from another thread, or ask
    get_extra_info from the worker thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.connects = self.closes = 0

    def on_connect(self, session):
        with self.lock:
            self.connects += 1

    def on_close(self, session, exc):
        with self.lock:
            self.closes += 1

    def on_read(self, session, data):
        d = bytes(data)
        op = d[:1]
        session.send(d)
        if op == b"c":
            session.close()
        elif op == b"a":
            session.abort()
        elif op == b"b":
            session.server.broadcast(BPAY)
        elif op == b"p":
            session.pause_reading()
            threading.Thread(target=session.resume_reading).start()
        elif op == b"x":
            assert session.get_extra_info("cipher") is not None
            assert session.get_extra_info("ssl_object") is not None


def _storm_client(srv, certs, seed, conns, problems):
    import random
    rnd = random.Random(seed)
    for k in range(conns):
        raw = socket.create_connection(srv.address, timeout=20)
        if k % 7 == 3:              # half a ClientHello, then a reset
            hello = client_hello(certs.client_ctx())
            raw.sendall(hello[:rnd.randrange(1, len(hello))])
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.close()
            continue
        try:
            s = certs.client_ctx().wrap_socket(raw, server_hostname="localhost")
        except (OSError, ssl.SSLError):
            raw.close()             # closed by the closer thread mid-handshake
            continue
        sent, echoed, buf = [], 0, b""
        try:
            for i in range(rnd.randrange(1, 30)):
                op = bytes([rnd.choices(b"ecabpx", [60, 2, 2, 10, 5, 5])[0]])
                msg = op + b"%d-%d-%d-" % (seed, k, i) + bytes([i]) * rnd.randrange(3000)
                s.sendall(frame(msg))
                sent.append(msg)
                if op in b"ca":
                    break
                while echoed < len(sent):       # every echo, in order; broadcasts whole
                    while len(buf) < 2 or len(buf) < 2 + struct.unpack(">H", buf[:2])[0]:
                        d = s.recv(65536)
                        if not d:
                            raise EOFError
                        buf += d
                    n = struct.unpack(">H", buf[:2])[0]
                    m, buf = buf[2:2 + n], buf[2 + n:]
                    if m != BPAY:
                        if m != sent[echoed]:
                            problems.append(f"client {seed}/{k}: echo {echoed} differs")
                            raise EOFError
                        echoed += 1
            how = rnd.random()
            if how < 0.3:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif how < 0.6:
                s.unwrap()
        except (OSError, ssl.SSLError, EOFError, ValueError):
            pass                    # closed by the server (an op, or the closer thread)
        finally:
            s.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 2, 4])
def test_closes_from_every_thread_while_workers_send_and_a_thread_broadcasts(
        make_server, tls_certs, logs, workers):
    """4 TLS clients x 25 connections (every 7th a half ClientHello and a reset; the rest
    echo random frames, each checked in order, and leave with a reset, close_notify or a
    bare close), while the handler closes, aborts, broadcasts Slot-sized payloads,
    pauses/resumes from a new thread and asks get_extra_info on worker threads; a closer
    thread closes, aborts, pauses, resumes and sends to random sessions (some mid-handshake)
    and a broadcaster thread broadcasts.  Afterwards: no session or reference left, the
    receive pool at its idle value, no send slot held, the fd count back, no ERROR log,
    on_close once per on_connect, and no echo lost, reordered or corrupted."""
    import random
    h = Storm()
    srv = make_server(h, framing="u16", workers=workers, ssl=tls_certs.server_ctx(),
                      handshake_timeout=2.0)
    fds = open_fds()
    problems = []
    clients = [threading.Thread(target=_storm_client, args=(srv, tls_certs, i, 25, problems))
               for i in range(4)]
    busy = threading.Event()

    def closer():
        rnd = random.Random(7)
        while busy.is_set():
            ss = every_session(srv)
            if ss:
                s = rnd.choice(ss)
                (s.close if rnd.random() < 0.5 else s.abort)()
                (s.pause_reading if rnd.random() < 0.3 else s.resume_reading)()
                s.send(b"after the close")
            time.sleep(0.02)        # a pace, not a synchronisation

    def broadcaster():
        while busy.is_set():
            srv.broadcast(BPAY)
            time.sleep(0.002)       # a pace, not a synchronisation

    busy.set()
    helpers = [threading.Thread(target=closer), threading.Thread(target=broadcaster)]
    for t in clients + helpers:
        t.start()
    for t in clients:
        t.join(150)
    busy.clear()
    for t in helpers:
        t.join(10)
    assert not any(t.is_alive() for t in clients + helpers), "a thread did not finish"
    assert not problems, problems[:5]
    wait_for(lambda: srv.stats()["connections"] == 0, 20, "the sessions to close")
    wait_for(lambda: srv.live_sessions == 0, 10, "the sessions' last references")
    wait_for(lambda: srv.stats()["rx_slots_in_use"] == 1, 5, "the receive slots")
    st = srv.stats()
    assert st["tx_slots_in_use"] == 0, st
    wait_for(lambda: open_fds() == fds, 5, "the fd count")
    assert not error_lines(logs), error_lines(logs)[:5]
    wait_for(lambda: h.closes == h.connects, 10, "on_close once per on_connect")
    assert h.connects > 10


# -- shutdown from two threads: both return with the loop thread gone ------------------------------

class _SlowSet(threading.Event):
    """An Event whose set() returns late: widens the window between the loop's "done" and
    its thread's exit (where a second shutdown() must not return yet)."""

    def set(self):
        super().set()
        time.sleep(0.5)         # widens a race window (no synchronisation rests on it)


def test_a_concurrent_shutdown_returns_only_once_the_loop_thread_is_gone(backend, tls_certs):
    """shutdown() from another thread while one is under way (test_shutdown_sends_close_notify
    does this) must, like the first, return only once the loop thread has ended.  Before:
    the second call saw the loop "done" and returned at once, with the thread still running
    (assert_no_leaks: "loop thread still running", seen flaky on 3.13)."""
    srv = Server(Chat(), "127.0.0.1", 0, framing="u16", backend=backend,
                 ssl=tls_certs.server_ctx())
    srv._done = _SlowSet()
    srv.start()
    first = threading.Thread(target=srv.shutdown)
    first.start()
    assert srv._done.wait(30)
    srv.shutdown()
    alive = srv._thread.is_alive()
    first.join(30)
    assert not alive, "shutdown() returned with the loop thread still running"


# -- the idle clock counts what the peer takes of a reply we owe (ciphertext, for TLS) ----------

class OneBigReply(Handler):
    SIZE = 4 << 20

    def on_read(self, session, data):
        session.send(b"\xab" * self.SIZE)      # one send: one segment, encrypted at once


@pytest.mark.parametrize("tls", [True, False])
def test_a_peer_reading_one_large_reply_steadily_is_not_cut_by_the_idle_timeout(
        make_server, tls_certs, logs, tls):
    """A peer taking a reply we owe is not idle.  Over TLS, with the plaintext handed to
    OpenSSL as the progress measure, one large send is encrypted in one go, and while its
    ciphertext drains to a peer reading it steadily that figure stands still -- the session
    would be cut by idle_timeout mid-reply (5 of 6 MiB arriving).  Over plain TCP, once the
    reply's tail sits in the kernel's send queue (no back-pressure any more), something must
    count it too, or this slower reader is cut as well."""
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    srv = make_server(OneBigReply(), framing="raw", idle_timeout=0.4, max_pending=64 << 20,
                      **kw)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    raw.settimeout(10)
    raw.connect(srv.address)
    s = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost") if tls else raw
    try:
        s.sendall(b"go")
        got = 0
        t0 = time.monotonic()
        while got < OneBigReply.SIZE:
            # ~2 MB/s: the reply takes ~2 s, five idle timeouts, and the peer is never
            # silent on our side for longer than a few ms
            d = s.recv(min(16 << 10, OneBigReply.SIZE - got))
            if not d:
                break
            got += len(d)
            time.sleep(0.008)
        assert got == OneBigReply.SIZE, f"{got} bytes of {OneBigReply.SIZE}"
        assert time.monotonic() - t0 > 1.0      # the scenario: longer than the idle timeout
        assert not [r for r in logs.records if "idle timeout" in r.getMessage()]
    finally:
        s.close()


@pytest.mark.parametrize("size", [200 << 10, 4 << 20])
@pytest.mark.parametrize("tls", [True, False])
def test_a_peer_that_takes_none_of_a_reply_is_still_cut_by_the_idle_timeout(
        make_server, tls_certs, tls, size):
    """The other side of the test above: output owed to a peer that reads nothing is no
    activity -- whether it waits in the batch (back-pressure) or only in the kernel's send
    queue (a reply below the high-water mark)."""
    class Reply(Handler):
        def on_read(self, session, data):
            session.send(b"\xcd" * size)

    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    srv = make_server(Reply(), framing="raw", idle_timeout=0.3, frame_timeout=None,
                      max_pending=64 << 20, **kw)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.settimeout(10)
    raw.connect(srv.address)
    s = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost") if tls else raw
    try:
        s.sendall(b"go")
        wait_for(lambda: srv.stats()["closes"].get("timeout") == 1, 10, "the idle timeout")
    finally:
        s.close()


class ReplyThenResetClose(asyncio.Protocol):
    """Answers a request with 1 MB, then SO_LINGER (on, 0 s) and close(): an abortive close
    (no TIME_WAIT), which asyncio's TLS transport makes only once the peer has answered its
    close_notify."""
    SIZE = 1_000_000

    def __init__(self, closed):
        self.closed = closed

    def connection_made(self, t):
        self.t = t

    def data_received(self, data):
        self.t.write(b"r" * self.SIZE)
        self.t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                   struct.pack("ii", 1, 0))
        self.t.close()
        self.closed.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_abortive_tls_close_waits_for_the_peers_answer_before_the_reset(backend, tls_certs,
                                                                          workers):
    """A reset right after the last records reach the kernel would discard what the peer
    has not yet read; as asyncio's, the TLS close waits for the peer's answer to its
    close_notify (or its EOF), then resets: the peer reads the whole reply, then
    close_notify."""
    closed = threading.Event()
    srv = serve_protocol(lambda: ReplyThenResetClose(closed), backend=backend,
                         workers=workers, ssl=tls_certs.server_ctx())
    try:
        raw = socket.create_connection(srv.address, timeout=20)
        with tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"go")
            assert closed.wait(10)      # the close is made before the reply is read
            got = 0
            while (d := s.recv(65536)):         # b"": the server's close_notify
                got += len(d)
            assert got == ReplyThenResetClose.SIZE
        wait_for(lambda: srv.stats()["connections"] == 0, 15, "the session to close")
    finally:
        srv.shutdown(timeout=15)
