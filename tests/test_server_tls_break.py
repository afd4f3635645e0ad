"""TLS on aoprim.server, broken on purpose (issue 21): each test here is a scenario a hostile
review found to misbehave (it failed before its fix), against the real server on loopback,
both backends, every slot and fd back to idle after each test (make_server's teardown)."""
import socket
import ssl
import struct

import pytest

from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS

from tlscerts import tls_certs  # noqa: F401  (fixture)
from test_server_support import make_server, wait_for  # noqa: F401
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
