"""Configuration mistakes and what they say: each error names the address or the file and
what to do, the same exception from the Python API (``Server(...)``, ``server_context``) as
the command line's one ``aoprim: ...`` line (exit 2, no traceback)."""
import errno
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import pytest

from aoprim.server import Server
from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS

from server_support import HOST
from tlscerts import tls_certs  # noqa: F401  (a fixture)

CWD = tempfile.gettempdir()


def fds():
    return sorted(os.listdir("/proc/self/fd"))


def serve_cli(*args, cwd=CWD):
    """``python -m aoprim serve ARGS`` expected to fail at start: its stderr's one line."""
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", *args],
                       capture_output=True, text=True, timeout=60, cwd=cwd)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "listening on" not in r.stdout, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aoprim: "), r.stderr
    assert "[Errno" not in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port():
    """A port something else listens on (released at teardown)."""
    s = socket.socket()
    s.bind((HOST, 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


# -- the address ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_port_in_use_names_the_address_and_the_way_out(backend, taken_port):
    before = fds()
    with pytest.raises(OSError) as info:
        Server(Echo(), HOST, taken_port, backend=backend)
    e = info.value
    assert e.errno == errno.EADDRINUSE
    assert f"cannot listen on {HOST}:{taken_port}: address already in use" in str(e)
    assert "perhaps another aoprim" in str(e) and "choose another port" in str(e)
    assert fds() == before          # the loop built before the bind is closed again


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("procs", ["1", "2"])
def test_cli_port_in_use_is_one_line(backend, procs, taken_port):
    line = serve_cli("--host", HOST, "--port", str(taken_port), "--backend", backend,
                     "--procs", procs)
    assert line == (f"aoprim: cannot listen on {HOST}:{taken_port}: address already in use: "
                    "another server -- perhaps another aoprim -- is listening there; stop it "
                    "or choose another port")


def test_cli_procs_refuses_a_port_another_procs_aoprim_serves():
    """Children bind with SO_REUSEPORT: without the check, a second ``--procs`` server of
    the same user would bind beside the first and share its port without a word."""
    first = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                              "--port", "0", "--procs", "2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=CWD)
    try:
        line = first.stdout.readline()
        assert line.startswith("listening on "), first.stderr.read() if not line else line
        port = line.rsplit(":", 1)[1].strip()
        msg = serve_cli("--host", HOST, "--port", port, "--procs", "2")
        assert f"cannot listen on {HOST}:{port}: address already in use" in msg
    finally:
        first.terminate()
        first.communicate(timeout=30)
    assert first.returncode == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("host", ["999.1.1.1", "no-such-host.invalid"])
def test_a_host_that_does_not_resolve_is_named(backend, host):
    before = fds()
    with pytest.raises(socket.gaierror) as info:
        Server(Echo(), host, 0, backend=backend)
    msg = str(info.value)
    assert f"cannot listen on {host}:0: cannot resolve {host!r}" in msg
    assert "give an IP address of this machine" in msg
    assert fds() == before
    line = serve_cli("--host", host, "--port", "0", "--backend", backend)
    assert line.startswith(f"aoprim: cannot listen on {host}:0: cannot resolve {host!r} (")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_address_of_another_machine_is_named(backend):
    host = "192.0.2.1"          # TEST-NET-1 (RFC 5737): never an address of this machine
    with pytest.raises(OSError) as info:
        Server(Echo(), host, 0, backend=backend)
    assert info.value.errno == errno.EADDRNOTAVAIL
    assert f"cannot listen on {host}:0: address not available: {host} is not an address " \
           "of this machine" in str(info.value)
    line = serve_cli("--host", host, "--port", "0", "--backend", backend)
    assert f"{host} is not an address of this machine" in line


def _ipv6():
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError as e:
        pytest.skip(f"no IPv6 sockets here: {e}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ipv6_address_in_brackets_is_told_to_drop_them(backend):
    host = "[::1]"
    with pytest.raises(socket.gaierror) as info:
        Server(Echo(), host, 0, backend=backend)
    want = ("cannot listen on [::1]:0: cannot resolve '[::1]': give the IPv6 address without "
            "brackets (::1)")
    assert str(info.value).endswith(want)
    assert "[[" not in str(info.value)
    assert serve_cli("--host", host, "--port", "0", "--backend", backend) == f"aoprim: {want}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_link_local_address_without_a_scope_is_told_it_needs_one(backend):
    _ipv6()
    host = "fe80::1"
    with pytest.raises(OSError) as info:
        Server(Echo(), host, 0, backend=backend)
    assert info.value.errno == errno.EINVAL
    want = ("cannot listen on [fe80::1]:0: fe80::1 is a link-local IPv6 address: it needs a "
            "scope id, the interface it is on (fe80::1%eth0)")
    assert info.value.strerror == want
    assert serve_cli("--host", host, "--port", "0", "--backend", backend) == f"aoprim: {want}"


def test_a_privileged_port_says_so():
    if os.geteuid() == 0:
        pytest.skip("root may bind ports below 1024")
    with pytest.raises(PermissionError, match="ports below 1024 need root or "
                                              "CAP_NET_BIND_SERVICE"):
        Server(Echo(), HOST, 1)


def test_the_privileged_port_message_keeps_the_type_and_errno():
    """(Runs as root too, where the bind above succeeds: the error as the kernel gives it.)"""
    from aoprim.server.listener import listen_error
    e = listen_error(HOST, 80, PermissionError(errno.EACCES, "Permission denied"))
    assert type(e) is PermissionError and e.errno == errno.EACCES
    assert e.strerror == (f"cannot listen on {HOST}:80: permission denied: ports below 1024 "
                          "need root or CAP_NET_BIND_SERVICE; choose a port of 1024 or above")
    e = listen_error("::1", 8080, PermissionError(errno.EACCES, "Permission denied"))
    assert e.strerror == "cannot listen on [::1]:8080: permission denied"


def test_a_host_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="host must be a str .* not int 5"):
        Server(Echo(), 5, 0)


# -- TLS files -----------------------------------------------------------------------------

@pytest.fixture
def pems(tls_certs, tmp_path):  # noqa: F811
    """The test certificates, plus files that are wrong in each way."""
    c = tls_certs
    (tmp_path / "garbage.pem").write_text("not a PEM file\n")
    (tmp_path / "both.pem").write_bytes(pathlib.Path(c.server_cert).read_bytes() +
                                        pathlib.Path(c.server_key).read_bytes())
    r = subprocess.run(["openssl", "pkey", "-in", c.server_key, "-aes256", "-passout",
                        "pass:secret", "-out", str(tmp_path / "encrypted.key")],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {"CERT": c.server_cert, "KEY": c.server_key, "OTHERKEY": c.client_key,
            "CA": c.ca_cert, "GARBAGE": str(tmp_path / "garbage.pem"),
            "BOTH": str(tmp_path / "both.pem"), "ENCRYPTED": str(tmp_path / "encrypted.key"),
            "MISSING": str(tmp_path / "missing.pem"), "DIR": str(tmp_path)}


# (server_context's arguments, the CLI's options, the exception, what its message says)
TLS_CASES = {
    "keyfile missing": (
        ("CERT", "MISSING"), FileNotFoundError, "--keyfile 'MISSING': no such file"),
    "certfile missing": (
        ("MISSING", None), FileNotFoundError, "--certfile 'MISSING': no such file"),
    "certfile a directory": (
        ("DIR", "KEY"), IsADirectoryError, "--certfile 'DIR': is a directory"),
    "certfile without key, no keyfile": (
        ("CERT", None), ValueError,
        "--certfile 'CERT' holds a certificate but no private key: give the key's file with "
        "--keyfile"),
    "certfile is the key": (
        ("KEY", "KEY"), ValueError,
        "--certfile 'KEY' holds no PEM certificate (-----BEGIN CERTIFICATE-----): it holds a "
        "private key"),
    "certfile not PEM": (
        ("GARBAGE", "KEY"), ValueError, "--certfile 'GARBAGE' holds no PEM certificate"),
    "keyfile is the certificate": (
        ("CERT", "CERT"), ValueError,
        "--keyfile 'CERT' holds no PEM private key (-----BEGIN ... PRIVATE KEY-----): it "
        "holds a certificate"),
    "key does not match": (
        ("CERT", "OTHERKEY"), ValueError,
        "the private key in --keyfile 'OTHERKEY' does not match the certificate in "
        "--certfile 'CERT'"),
    "key encrypted": (
        ("CERT", "ENCRYPTED"), ValueError,
        "--keyfile 'ENCRYPTED' is an encrypted private key: the server cannot ask for its "
        "passphrase"),
    "ca file missing": (
        ("CERT", "KEY", "MISSING"), FileNotFoundError, "--ca-certs 'MISSING': no such file"),
    "ca file not PEM": (
        ("CERT", "KEY", "GARBAGE"), ValueError,
        "--ca-certs 'GARBAGE' holds no PEM certificate"),
}


def _fill(text, pems):
    for k in sorted(pems, key=len, reverse=True):
        text = text.replace(f"'{k}'", repr(pems[k]))
    return text


@pytest.mark.parametrize("case", sorted(TLS_CASES))
def test_tls_file_errors_name_the_option_and_the_file(pems, case):
    from aoprim.server.tls import server_context
    files, exc, message = TLS_CASES[case]
    args = [pems[f] if f else None for f in files]
    with pytest.raises(exc) as info:
        server_context(*args, client_cert="required" if len(args) > 2 else "none")
    assert _fill(message, pems) in str(info.value)


@pytest.mark.parametrize("case", sorted(TLS_CASES))
def test_cli_tls_file_errors_are_one_line(pems, case):
    files, _, message = TLS_CASES[case]
    argv = []
    for flag, f in zip(("--certfile", "--keyfile", "--ca-certs"), files):
        if f:
            argv += [flag, pems[f]]
    if len(files) > 2:
        argv += ["--client-cert", "required"]
    line = serve_cli("--host", HOST, "--port", "0", *argv)
    assert line.startswith("aoprim: TLS: " + _fill(message, pems)), line


def test_certfile_with_its_key_in_it_needs_no_keyfile(pems):
    from aoprim.server.tls import server_context
    ctx = server_context(pems["BOTH"])
    assert ctx.verify_mode.name == "CERT_NONE"
