"""``max_pending`` on a TLS session counts the plaintext not yet encrypted as well
as the ciphertext not yet sent.  test_server_tls.py's max_pending tests reach the limit with
ciphertext left unsent by an earlier flush; these reach it with plaintext alone, queued in
one ``on_read`` before any flush encrypts it -- and show that a burst under the limit is
delivered whole (so the cut is the limit's doing, not the burst's size).  Both backends; the
fixture checks every slot and fd back after each test."""
import socket

import pytest

from aoprim.server import Handler
from aoprim.server.loop import BACKENDS

from tlscerts import tls_certs  # noqa: F401  (fixture)
from server_support import make_server, recv_exact, wait_for  # noqa: F401
from test_server_tls import tls_connect

pytestmark = pytest.mark.timeout(60)

LIMIT = 300 << 10
PIECE = 50 << 10


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


class Burst(Handler):
    """In reply to one byte: ``n`` pieces of 50 KiB sent back to back in on_read (one flush
    afterwards would encrypt them all); records whether the session was closed by then."""
    def __init__(self, n):
        self.n = n
        self.closed_after = []

    def on_read(self, session, data):
        for i in range(self.n):
            session.send(bytes([65 + i]) * PIECE)
        self.closed_after.append(session.closed)


def test_plaintext_not_yet_encrypted_counts_toward_max_pending(make_server, tls_certs,
                                                                caplog):
    h = Burst(8)                                # 400 KiB of plaintext, no flush between
    srv = make_server(h, ssl=tls_certs.server_ctx(), framing="raw", max_pending=LIMIT,
                      high_water=LIMIT)
    s = tls_connect(srv, tls_certs.client_ctx())
    try:
        s.sendall(b"g")
        wait_for(lambda: srv.stats()["connections"] == 0, 20, "cut for max_pending")
    finally:
        s.close()
    assert h.closed_after == [True]
    assert srv.stats()["closes"].get("max_pending") == 1
    assert any("max_pending" in r.getMessage() for r in caplog.records)


def test_a_burst_under_max_pending_is_delivered_whole(make_server, tls_certs):
    h = Burst(5)                                # 250 KiB: under the 300 KiB limit
    srv = make_server(h, ssl=tls_certs.server_ctx(), framing="raw", max_pending=LIMIT,
                      high_water=LIMIT)
    with tls_connect(srv, tls_certs.client_ctx()) as s:
        s.sendall(b"g")
        got = recv_exact(s, 5 * PIECE)
    assert got == b"".join(bytes([65 + i]) * PIECE for i in range(5))
    assert h.closed_after == [False]
    assert srv.stats()["closes"].get("max_pending") is None


class ReplyThenClose(Handler):
    def on_read(self, session, data):
        session.send(bytes(data))
        session.close()


def test_close_sends_the_reply_then_close_notify_then_the_tcp_eof(make_server, tls_certs):
    """session.close(): the reply, then close_notify (a client that does not forgive a ragged
    EOF gets b"", not SSLEOFError), then -- once the client answers with its own
    close_notify -- the TCP EOF of the lingering close, and the session is gone."""
    srv = make_server(ReplyThenClose(), ssl=tls_certs.server_ctx(), framing="raw")
    s = tls_connect(srv, tls_certs.client_ctx(), strict_eof=True)
    try:
        s.sendall(b"bye")
        assert recv_exact(s, 3) == b"bye"
        assert s.recv(10) == b""            # close_notify (a bare FIN raises SSLEOFError)
        plain = s.unwrap()                  # ours back; the server then ends the TCP stream
        assert plain.recv(10) == b""
        plain.close()
    finally:
        s.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 10, "closed")
