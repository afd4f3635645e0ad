"""TLS on aoprim.server, broken on purpose: each test here is a hostile or racy scenario
the server must survive unharmed, against the real server on loopback, both backends, every
slot and fd back to idle after each test (make_server's teardown)."""
import socket
import ssl
import struct

import pytest

from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS

from tlscerts import bio_handshake, tls_certs  # noqa: F401  (a fixture)
from server_support import make_server, wait_for  # noqa: F401
from test_server_tls_differential import Peer, split_frames

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("notify", [False, True])
def test_peer_eof_without_close_notify_still_gets_its_replies(make_server, tls_certs, workers,
                                                              notify):
    """A client that half-closes right after its requests, without close_notify (a bare TCP
    EOF), gets every reply and then the server's close_notify -- as over plain TCP it gets
    every reply and a clean EOF.  Before: the EOF was fed to OpenSSL, which turned it into a
    fatal error (UNEXPECTED_EOF_WHILE_READING): a decode_error alert instead of close_notify,
    and with workers the replies not yet encrypted were dropped ("TLS send failed")."""
    srv = make_server(Echo(), framing="u16", workers=workers, ssl=tls_certs.server_ctx())
    for _ in range(5):
        p = Peer(srv, tls_certs.client_ctx())
        payloads = [bytes([i]) * (i * 97 % 5000) for i in range(20)]
        p.send_stream([b"".join(struct.pack(">H", len(x)) + x for x in payloads)], [0])
        p.half_close(notify=notify)
        data, end = p.finish()
        assert split_frames(data, 2) == (payloads, b"")
        assert end == "eof"                 # the server's close_notify, then its EOF
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")
    assert srv.stats()["closes"] == {"eof": 5}


class BigReplyThenClose(Echo):
    """The first frame gets a reply of ``n`` bytes, then the session closes (the server's
    kernel buffer is made large enough to take the whole reply unread)."""

    def __init__(self, n):
        self.n = n
        self.sessions = []

    def on_connect(self, session):
        session.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.sessions.append(session)

    def on_read(self, session, data):
        session.send(bytes(range(256)) * (self.n // 256))
        session.close()


@pytest.mark.parametrize("tls", [False, True])
def test_close_with_the_reply_in_flight_survives_late_input(make_server, tls_certs, tls):
    """The server closes after a large reply that is still in its kernel's send queue (the
    peer reads slowly), and the peer sends a few more bytes afterwards (it had not seen the
    close yet).  The peer still gets the whole reply and a clean EOF.  Before: once the
    reply was handed to the kernel and nothing was unread at that moment, the lingering
    close closed the fd at once; the late bytes then hit a closed socket, whose kernel
    answered with a reset and dropped the unsent rest of the reply (found by the TLS vs plain
    differential test: the TLS client lost ~70 KB of a reply after a CLOSE op)."""
    n = 300 << 10
    h = BigReplyThenClose(n)
    kw = {"ssl": tls_certs.server_ctx()} if tls else {}
    srv = make_server(h, **kw)
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)    # a slow reader
    raw.settimeout(20)
    raw.connect(srv.address)
    s = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost") if tls else raw
    try:
        s.sendall(b"go")
        wait_for(lambda: h.sessions, what="on_connect")
        sess = h.sessions[0]
        # the whole reply is in the server's kernel (and close_notify with it): the session
        # has left the flush, and is either lingering or gone
        wait_for(lambda: sess._state == 2 or sess._lingering, 10, "the close to be done")
        try:
            s.sendall(b"late bytes the server will not read")
        except OSError:
            pass
        got = bytearray()
        while True:
            try:
                d = s.recv(1 << 16)
            except ssl.SSLZeroReturnError:
                break
            if not d:
                break
            got += d
        assert len(got) == n and got == bytes(range(256)) * (n // 256)
    finally:
        s.close()
    wait_for(lambda: srv.stats()["connections"] == 0, what="closed")


class PauseOnConnect(Echo):
    """on_connect pauses reading; the test resumes it (from another thread)."""

    def __init__(self):
        self.sessions = []

    def on_connect(self, session):
        session.pause_reading()
        self.sessions.append(session)


def test_request_in_the_handshakes_last_flight_is_read_after_resume(make_server, tls_certs):
    """The client's request arrives in the same TCP write as its handshake Finished, and
    on_connect pauses reading (say, to check something first); once reading resumes the
    request is answered -- as over plain TCP, where it waits in the socket.  The request's
    record waits in the incoming BIO, where no readiness event will come for it:
    resume_reading() must look there, or the session stalls for good."""
    h = PauseOnConnect()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx())
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = tls_certs.client_ctx().wrap_bio(inc, out, server_hostname="localhost")
    with socket.create_connection(srv.address, timeout=10) as s:
        bio_handshake(s, obj, inc, out, hold_last_flight=True)
        obj.write(struct.pack(">H", 5) + b"hello")
        s.sendall(out.read())           # Finished + the request: one write
        wait_for(lambda: h.sessions, what="on_connect")
        h.sessions[0].resume_reading()
        got = b""
        while len(got) < 7:
            d = s.recv(65536)
            assert d, "EOF before the reply"
            inc.write(d)
            try:
                got += obj.read(65536)
            except ssl.SSLWantReadError:
                pass
        assert got == struct.pack(">H", 5) + b"hello"
