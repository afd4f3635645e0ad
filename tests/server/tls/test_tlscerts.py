"""tests/support/tlscerts.py makes a working CA, server and client certificate."""
import socket
import ssl
import threading

import pytest

from tlscerts import CLIENT_CN, tls_certs  # noqa: F401  (fixture)


def _handshake(server_ctx, client_ctx, hostname="localhost"):
    """One handshake over a socketpair; returns {"peer": server-side getpeercert()} or {"err": e}."""
    a, b = socket.socketpair()
    out = {}

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                out["peer"] = s.getpeercert()
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as e:
            out["err"] = e
    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=hostname) as c:
            c.settimeout(10)
            assert c.recv(2) == b"ok"
    finally:
        t.join(10)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_server_cert_verifies_against_ca(tls_certs, version):
    out = _handshake(tls_certs.server_ctx(version=version), tls_certs.client_ctx(), "127.0.0.1")
    assert "err" not in out and not out["peer"]   # no client cert asked for


@pytest.mark.timeout(60)
def test_client_cert_required(tls_certs):
    out = _handshake(tls_certs.server_ctx(client_cert="required"),
                     tls_certs.client_ctx(with_cert=True))
    subject = dict(x[0] for x in out["peer"]["subject"])
    assert subject["commonName"] == CLIENT_CN


@pytest.mark.timeout(60)
def test_other_ca_client_cert_refused(tls_certs):
    with pytest.raises((ssl.SSLError, OSError)):
        _handshake(tls_certs.server_ctx(client_cert="required", version="1.2"),
                   tls_certs.client_ctx(other_cert=True, version="1.2"))
