"""TLS: the end of the peer's stream in the same read as its last data -- its close_notify,
a TCP FIN, a reset, a fatal alert -- is acted on at once, with no further readiness event
(the socket holds nothing more, so none comes).  The client writes its last records and the
end in ONE write (records made with ``ssl.MemoryBIO``; the FIN carried by the same TCP
segment through ``TCP_CORK``; a reset sent while the loop is held in ``on_connect``), so
the server's first read after the handshake meets both.
The native API (``on_read`` then ``on_close``) and ``serve_protocol`` (``data_received``
then ``eof_received``, checked against asyncio's own TLS transport), both backends, with and
without workers; every slot and fd back to idle after each test."""
import asyncio
import socket
import ssl
import struct
import threading

import pytest

from aoprim.server import Server, serve_protocol

from server_support import HOST, assert_no_leaks, open_fds, wait_for
from protocol_support import backend, workers  # noqa: F401  (fixtures)
from tlscerts import bio_handshake, tls_certs  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(120)

# A client that waits for an answer that never comes fails after this long (not a hang)
CLIENT_TIMEOUT = 10.0

PAYLOAD = b"the last request"


@pytest.fixture
def start(backend, workers):
    """start(kind, target, ssl) -> address: a started server, ``kind`` "native" (``target``
    a handler, raw framing) or "protocol" (``target`` a protocol factory), shut down and
    checked for leaks after the test.  The server itself is ``start.server``."""
    made = []
    fds = open_fds()

    def run(kind, target, ctx):
        if kind == "native":
            srv = Server(target, HOST, 0, framing="raw", ssl=ctx, backend=backend,
                         workers=workers).start()
        else:
            srv = serve_protocol(target, HOST, 0, ssl=ctx, backend=backend, workers=workers)
        made.append(srv)
        run.server = srv
        return srv.address

    yield run
    for srv in made:
        srv.shutdown(timeout=15)
        assert_no_leaks(srv)
    assert open_fds() == fds, "file descriptors leaked"


class Client:
    """A TLS client over a raw socket (``ssl.MemoryBIO``): the handshake, then the last
    request and the end written at once, then everything the server sends read until its
    EOF (a reset, or CLIENT_TIMEOUT without either, is reported as such)."""

    def __init__(self, address, ctx):
        self.sock = socket.create_connection(address[:2], timeout=CLIENT_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inc = ssl.MemoryBIO()
        self.out = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inc, self.out, server_hostname="localhost")
        self.data = b""
        self.notified = False       # the server's close_notify came (and unwrap() finished)
        self.end = None

    def handshake(self, hold_last_flight=False):
        """Run the handshake; ``hold_last_flight``: keep the client's last flight (TLS 1.3:
        its Finished) unsent, to go out with the next write."""
        bio_handshake(self.sock, self.obj, self.inc, self.out, hold_last_flight)

    def send_last(self, data, end):
        """``data`` and then ``end`` -- "close_notify", "fin" (a FIN without close_notify),
        "rst" (a reset) or "alert" (a fatal alert) -- in one write."""
        self.obj.write(data)
        if end == "close_notify":
            with pytest.raises(ssl.SSLWantReadError):
                self.obj.unwrap()           # writes close_notify; the answer is read later
        elif end == "alert":
            # a record that does not decrypt: the client's OpenSSL answers with a fatal
            # alert (bad_record_mac), written to its outgoing BIO after the data's record
            self.inc.write(b"\x17\x03\x03\x00\x20" + bytes(32))
            with pytest.raises(ssl.SSLError):
                self.obj.read(1)
        wire = self.out.read()
        assert wire, "no record was made"
        if end == "alert":
            self.obj = None         # its TLS session is over: only the TCP end is awaited
        if end == "fin":
            # corked, the segment is sent by shutdown() itself, with the FIN set on it
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
            self.sock.sendall(wire)
            self.sock.shutdown(socket.SHUT_WR)
        elif end == "rst":
            self.sock.sendall(wire)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()
            self.end = "reset sent"
        else:
            self.sock.sendall(wire)

    def finish(self):
        """Read what the server sends until its EOF; returns ``(data, notified, end)``."""
        if self.end is None:
            self.end = self._read_all()
            self.sock.close()
        return self.data, self.notified, self.end

    def _read_all(self):
        while True:
            try:
                wire = self.sock.recv(65536)
            except TimeoutError:
                return "timeout"
            except ConnectionResetError:
                return "reset"
            if not wire:
                return "eof"
            if self.obj is None:
                continue            # the TLS session ended: only the TCP end is awaited
            self.inc.write(wire)
            try:
                while True:
                    chunk = self.obj.read(65536)
                    if not chunk:
                        break               # the server's close_notify (ours not sent yet)
                    self.data += chunk
            except ssl.SSLWantReadError:
                continue
            except ssl.SSLZeroReturnError:
                pass                        # the server's close_notify, after ours
            except ssl.SSLError as e:
                return f"TLS error {e.reason}"
            self.obj.unwrap()               # both close_notify: unwrap() finishes
            self.notified = True
            self.obj = None


def run_client(address, ctx, end, hold_last_flight=False):
    c = Client(address, ctx)
    try:
        c.handshake(hold_last_flight)
        c.send_last(PAYLOAD, end)
        return c.finish()
    finally:
        c.sock.close()


class Native:
    """A native handler: echoes each read, logs the reads and the close."""

    def __init__(self):
        self.log = []
        self.closed = threading.Event()

    def on_connect(self, session):
        pass

    def on_read(self, session, data):
        self.log.append(("read", bytes(data)))
        session.send(data)

    def on_close(self, session, exc):
        self.log.append(("close", type(exc).__name__ if exc is not None else None))
        self.closed.set()


class Proto(asyncio.Protocol):
    """A protocol that echoes what it gets and logs its callbacks."""

    def __init__(self, log, done):
        self.log, self.done = log, done

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.log.append(("data", data))
        self.t.write(data)

    def eof_received(self):
        self.log.append("eof")

    def connection_lost(self, exc):
        self.log.append(("lost", type(exc).__name__ if exc is not None else None))
        self.done.set()


def on_asyncio(server_ctx, client, factory=Proto):
    """``client(address)`` against ``factory(log, done)`` (a Proto) served by asyncio's own
    TLS transport: returns (client's result, the protocol's log)."""
    async def main():
        log, done = [], threading.Event()
        srv = await asyncio.get_running_loop().create_server(
            lambda: factory(log, done), HOST, 0, ssl=server_ctx)
        try:
            got = await asyncio.to_thread(client, srv.sockets[0].getsockname())
            assert await asyncio.to_thread(done.wait, CLIENT_TIMEOUT)
        finally:
            srv.close()
        return got, log
    return asyncio.run(main())


# -- the peer's EOF: close_notify, or a FIN without it -----------------------------------------

EOF_CASES = [("close_notify", "1.3", False), ("close_notify", "1.2", False),
             ("close_notify", "1.3", True), ("fin", "1.3", False), ("fin", "1.3", True)]
EOF_IDS = ["close_notify", "close_notify-tls12", "close_notify-with-finished", "fin",
           "fin-with-finished"]


@pytest.mark.parametrize("end,version,with_finished", EOF_CASES, ids=EOF_IDS)
def test_native_end_with_the_last_data_closes_after_the_reply(start, tls_certs, end, version,
                                                             with_finished):
    """on_read gets the data, the reply goes out, then the peer's EOF closes the session:
    on_close, close_notify (which the client's unwrap() waits for) and the server's EOF.
    ``with_finished``: the client's Finished, the data and the end in one write (the data
    is read by the handshake's last step)."""
    h = Native()
    address = start("native", h, tls_certs.server_ctx(version=version))
    data, notified, how = run_client(address, tls_certs.client_ctx(version=version), end,
                                     with_finished)
    assert (data, notified, how) == (PAYLOAD, True, "eof")
    assert h.closed.wait(CLIENT_TIMEOUT)
    assert h.log == [("read", PAYLOAD), ("close", None)]
    wait_for(lambda: start.server.stats()["connections"] == 0, what="the session to close")
    assert start.server.stats()["closes"] == {"eof": 1}


@pytest.mark.parametrize("end,version,with_finished", EOF_CASES, ids=EOF_IDS)
def test_protocol_end_with_the_last_data_calls_eof_received(start, tls_certs, end, version,
                                                            with_finished):
    """data_received, eof_received, connection_lost(None), and the client gets the reply,
    the server's close_notify and its EOF, as from asyncio's own TLS transport -- which,
    after a FIN without close_notify, closes without one (aoprim sends it whatever ended
    the peer's stream, as a native session)."""
    def client(address):
        return run_client(address, tls_certs.client_ctx(version=version), end, with_finished)

    (data, notified, how), want = on_asyncio(tls_certs.server_ctx(version=version), client)
    assert (data, how, want) == (PAYLOAD, "eof", [("data", PAYLOAD), "eof", ("lost", None)])
    assert notified == (end == "close_notify")
    log, done = [], threading.Event()
    address = start("protocol", lambda: Proto(log, done), tls_certs.server_ctx(version=version))
    assert client(address) == (PAYLOAD, True, "eof")
    assert done.wait(CLIENT_TIMEOUT)
    assert log == want
    assert start.server.stats()["closes"] == {"eof": 1}


class PauseOnRead(Native):
    """Pauses reading in on_read; the test resumes it."""

    def __init__(self):
        super().__init__()
        self.read = threading.Event()
        self.session = None

    def on_read(self, session, data):
        session.pause_reading()
        self.session = session
        Native.on_read(self, session, data)
        self.read.set()


def test_native_end_held_while_paused_comes_after_resume(start, tls_certs):
    """A handler that pauses reading in on_read does not see the end that came with the
    data until it resumes; then on_close, and the client's unwrap() finishes."""
    h = PauseOnRead()
    address = start("native", h, tls_certs.server_ctx())
    c = Client(address, tls_certs.client_ctx())
    try:
        c.handshake()
        c.send_last(PAYLOAD, "close_notify")
        assert h.read.wait(CLIENT_TIMEOUT)
        # the reply arrives while the session stays paused, and nothing ends it
        while len(c.data) < len(PAYLOAD):
            wire = c.sock.recv(65536)
            assert wire, "the server closed a paused session"
            c.inc.write(wire)
            try:
                c.data += c.obj.read(65536)
            except ssl.SSLWantReadError:
                pass
        assert c.data == PAYLOAD
        assert not h.closed.is_set()
        h.session.resume_reading()
        assert c.finish() == (PAYLOAD, True, "eof")
    finally:
        c.sock.close()
    assert h.closed.wait(CLIENT_TIMEOUT)
    assert h.log == [("read", PAYLOAD), ("close", None)]


# -- the stream cut: a reset, or a fatal alert -------------------------------------------------

class GatedNative(Native):
    """on_connect (on the loop thread) waits for ``gate``: the loop reads nothing more
    until the client has written everything."""

    def __init__(self, gate):
        super().__init__()
        self.gate = gate

    def on_connect(self, session):
        self.gate.wait(CLIENT_TIMEOUT)


class GatedProto(Proto):
    """connection_made (on the loop thread, with workers too) waits for ``gate``."""

    def __init__(self, log, done, gate):
        super().__init__(log, done)
        self.gate = gate

    def connection_made(self, transport):
        Proto.connection_made(self, transport)
        self.gate.wait(CLIENT_TIMEOUT)


def reset_client(address, ctx, gate):
    """The client's Finished, the data and a reset, all at the server before its first read
    after the handshake (the loop is held in on_connect until the reset was sent)."""
    try:
        return run_client(address, ctx, "rst", hold_last_flight=True)
    finally:
        gate.set()


def test_native_reset_with_the_last_data_is_a_recv_reset(start, tls_certs, caplog):
    """A reset right behind the data: the data is delivered, then the session is closed
    for the reset the read met (not for the reply's send failing later, on a socket whose
    error that read had taken)."""
    caplog.set_level("INFO", logger="aoprim.server")
    gate = threading.Event()
    h = GatedNative(gate)
    address = start("native", h, tls_certs.server_ctx(version="1.3"))
    assert reset_client(address, tls_certs.client_ctx(version="1.3"), gate)[2] == "reset sent"
    assert h.closed.wait(CLIENT_TIMEOUT)
    assert h.log == [("read", PAYLOAD), ("close", None)]
    wait_for(lambda: start.server.stats()["connections"] == 0, what="the session to close")
    assert start.server.stats()["closes"] == {"reset": 1}
    closed = [r.getMessage() for r in caplog.records if " closed: " in r.getMessage()]
    assert len(closed) == 1 and closed[0].endswith("recv failed: Connection reset by peer")


def test_protocol_reset_with_the_last_data_gives_connection_reset(start, tls_certs):
    """A reset right behind the data: data_received, then connection_lost with a
    ConnectionResetError, as asyncio's TLS transport."""
    ctx = tls_certs.client_ctx(version="1.3")
    gate = threading.Event()
    sent, want = on_asyncio(tls_certs.server_ctx(version="1.3"),
                            lambda address: reset_client(address, ctx, gate),
                            lambda log, done: GatedProto(log, done, gate))
    assert sent[2] == "reset sent"
    assert want == [("data", PAYLOAD), ("lost", "ConnectionResetError")]
    gate = threading.Event()
    log, done = [], threading.Event()
    address = start("protocol", lambda: GatedProto(log, done, gate),
                    tls_certs.server_ctx(version="1.3"))
    assert reset_client(address, ctx, gate)[2] == "reset sent"
    assert done.wait(CLIENT_TIMEOUT)
    assert log == want
    assert start.server.stats()["closes"] == {"reset": 1}


def test_native_fatal_alert_with_the_last_data_closes_as_a_tls_error(start, tls_certs, workers,
                                                                      caplog):
    """A fatal alert right after the data: the session is closed for it (cause "tls", the
    alert named in the reason), at once -- no reply is owed to a peer that broke off the
    TLS session.  Without workers the data was delivered first (on the loop thread, before
    the alert was read)."""
    caplog.set_level("INFO", logger="aoprim.server")
    h = Native()
    address = start("native", h, tls_certs.server_ctx())
    assert run_client(address, tls_certs.client_ctx(), "alert")[2] in ("eof", "reset")
    assert h.closed.wait(CLIENT_TIMEOUT)
    if workers == 0:
        assert h.log == [("read", PAYLOAD), ("close", None)]
    else:
        assert h.log in ([("read", PAYLOAD), ("close", None)], [("close", None)])
    wait_for(lambda: start.server.stats()["connections"] == 0, what="the session to close")
    assert start.server.stats()["closes"] == {"tls": 1}
    assert [r.getMessage() for r in caplog.records
            if "closed" in r.getMessage() and "ALERT_BAD_RECORD_MAC" in r.getMessage()]


def test_protocol_fatal_alert_with_the_last_data_loses_the_connection(start, tls_certs):
    """A fatal alert right after the data: connection_lost(ssl.SSLError) and no
    eof_received, as asyncio's TLS transport (which drops the data read with the alert;
    aoprim may deliver it first, as it delivers what it read before a reset)."""
    def client(address):
        return run_client(address, tls_certs.client_ctx(), "alert")

    got, want = on_asyncio(tls_certs.server_ctx(), client)
    assert got[2] in ("eof", "reset") and want == [("lost", "SSLError")]
    log, done = [], threading.Event()
    address = start("protocol", lambda: Proto(log, done), tls_certs.server_ctx())
    assert client(address)[2] in ("eof", "reset")
    assert done.wait(CLIENT_TIMEOUT)
    assert log in ([("data", PAYLOAD), ("lost", "SSLError")], [("lost", "SSLError")])
    assert start.server.stats()["closes"] == {"tls": 1}
