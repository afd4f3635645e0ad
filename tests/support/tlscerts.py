"""Test-time TLS material: a CA, a server certificate and a client certificate, made with
Debian's ``openssl`` binary (``openssl req`` / ``openssl x509``) into a temporary directory.
No key is ever committed.

    from tlscerts import make_certs
    certs = make_certs(tmp_path)          # or the ``tls_certs`` fixture (session scope)
    certs.server_ctx()                    # SSLContext(PROTOCOL_TLS_SERVER) with the server cert
    certs.server_ctx(client_cert="required")   # also verifies client certs against the CA
    certs.client_ctx()                    # verifies the server against the CA (no client cert)
    certs.client_ctx(with_cert=True)      # ... and presents the client certificate
    certs.client_ctx(version="1.2")       # pinned to TLS 1.2 (or "1.3")

Paths (``certs.ca_cert``, ``certs.server_cert``, ``certs.server_key``, ``certs.client_cert``,
``certs.client_key``, ``certs.other_client_cert``/``other_client_key`` -- a client certificate
signed by a *different* CA, so it does not verify) are PEM files usable by the CLI
(``--certfile/--keyfile/--ca-certs``) and by ``openssl s_client``.  The server certificate is
for ``localhost`` and ``127.0.0.1`` (subjectAltName) and the client certificate's CN is
``aoprim-test-client``.  Keys are ECDSA P-256: fast to make (tens of ms each).
"""
import dataclasses
import os
import shutil
import ssl
import subprocess

import pytest

CLIENT_CN = "aoprim-test-client"
SERVER_CN = "localhost"

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)


def _key(name, cwd):
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", name, cwd=cwd)


def _ca(prefix, cn, cwd):
    _key(prefix + ".key", cwd)
    _openssl("req", "-x509", "-new", "-key", prefix + ".key", "-days", "2", "-subj", "/CN=" + cn,
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-out", prefix + ".pem", cwd=cwd)


def _leaf(prefix, cn, ca, ext, cwd):
    """Key + CSR (``openssl req``), then the certificate signed by ``ca`` (``openssl x509``)."""
    _key(prefix + ".key", cwd)
    _openssl("req", "-new", "-key", prefix + ".key", "-subj", "/CN=" + cn,
             "-out", prefix + ".csr", cwd=cwd)
    with open(os.path.join(cwd, prefix + ".ext"), "w") as f:
        f.write(ext)
    _openssl("x509", "-req", "-in", prefix + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
             "-CAcreateserial", "-days", "2", "-sha256", "-extfile", prefix + ".ext",
             "-out", prefix + ".pem", cwd=cwd)


@dataclasses.dataclass(frozen=True)
class TLSCerts:
    dir: str
    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str
    other_client_cert: str
    other_client_key: str

    def server_ctx(self, client_cert="none", version=None, alpn=None):
        """A server context with the server certificate.  ``client_cert``: "none", "optional"
        or "required" (verified against ``ca_cert``); ``version``: None, "1.2" or "1.3" pins
        both ends of the range; ``alpn``: a list of protocols offered."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.server_cert, self.server_key)
        if client_cert != "none":
            ctx.load_verify_locations(self.ca_cert)
            ctx.verify_mode = {"optional": ssl.CERT_OPTIONAL,
                               "required": ssl.CERT_REQUIRED}[client_cert]
        _pin(ctx, version)
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx

    def client_ctx(self, with_cert=False, version=None, alpn=None, other_cert=False):
        """A client context verifying the server against ``ca_cert`` (hostname checked: connect
        with ``server_hostname="localhost"`` or ``"127.0.0.1"``).  ``with_cert``: present the
        client certificate; ``other_cert``: present the one signed by another CA instead."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(self.ca_cert)
        if other_cert:
            ctx.load_cert_chain(self.other_client_cert, self.other_client_key)
        elif with_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        _pin(ctx, version)
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx


def _pin(ctx, version):
    if version is not None:
        ctx.minimum_version = ctx.maximum_version = _VERSIONS[version]


def have_openssl():
    return shutil.which("openssl") is not None


def make_certs(directory):
    """Make every file into ``directory`` (created if missing) and return a ``TLSCerts``."""
    d = os.fspath(directory)
    os.makedirs(d, exist_ok=True)
    _ca("ca", "aoprim test CA", d)
    _leaf("server", SERVER_CN, "ca",
          "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
          "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n", d)
    _leaf("client", CLIENT_CN, "ca",
          "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n", d)
    _ca("other_ca", "aoprim other CA", d)
    _leaf("other_client", CLIENT_CN, "other_ca",
          "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n", d)
    p = lambda n: os.path.join(d, n)  # noqa: E731
    return TLSCerts(dir=d, ca_cert=p("ca.pem"), server_cert=p("server.pem"),
                    server_key=p("server.key"), client_cert=p("client.pem"),
                    client_key=p("client.key"), other_ca_cert=p("other_ca.pem"),
                    other_client_cert=p("other_client.pem"),
                    other_client_key=p("other_client.key"))


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory):
    """Session-wide ``TLSCerts`` (skips when there is no ``openssl`` binary).  Use it from a
    test module with ``from tlscerts import tls_certs  # noqa: F401`` (a fixture import)."""
    if not have_openssl():
        pytest.skip("no openssl binary")
    return make_certs(tmp_path_factory.mktemp("tlscerts"))


def bio_handshake(sock, obj, inc, out, hold_last_flight=False):
    """A TLS client's handshake over memory BIOs (``obj`` from ``ctx.wrap_bio(inc, out)``) on
    the blocking socket ``sock``; ``hold_last_flight``: keep the client's last flight (TLS
    1.3: its Finished) in ``out``, to go out with the next write."""
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            pass
        if out.pending:
            sock.sendall(out.read())
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("EOF during the handshake")
        inc.write(data)
    if not hold_last_flight and out.pending:
        sock.sendall(out.read())
