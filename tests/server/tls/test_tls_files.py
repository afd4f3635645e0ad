"""What ``tls.server_context`` (the CLI's ``--certfile/--keyfile/--ca-certs``) does with the
files it is given (docs/server.md, "Mistakes, and what they say"):

- only a regular file is read, and only up to a bound (1 MiB for a certificate chain or a
  key, 16 MiB for a CA bundle): a pipe, a device, ``/dev/stdin`` or a directory is refused
  without being read, a larger file is refused naming its size -- one ``aoprim: TLS: ...``
  line and exit 2 from the CLI, never a hang or a MemoryError;
- a path is a ``str``, ``bytes`` (decoded with ``os.fsdecode``) or ``os.PathLike``; anything
  else is a ``TypeError`` naming the parameter -- an int is never taken for a file
  descriptor (``open()`` would adopt it and close it);
- a key of another algorithm than the certificate's (RSA / ECDSA / Ed25519) gets the same
  "does not match" message as a key of the same algorithm, and an OpenSSH-format key (an
  ``~/.ssh/id_*`` file) is named as such.

Keys and certificates are made at test time with ``openssl`` (and ``ssh-keygen`` for the
OpenSSH keys); the tests that need them skip without those programs.
"""
import os
import pathlib
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from aoprim.server import tls
from aoprim.server.tls import server_context

from tlscerts import tls_certs  # noqa: F401  (a fixture)

CWD = tempfile.gettempdir()
MiB = 1 << 20
FLAGS = {"certfile": "--certfile", "keyfile": "--keyfile", "ca_certs": "--ca-certs"}


def serve_cli(*args, stdin=subprocess.DEVNULL, limit_memory=False):
    """``python -m aoprim serve --port 0 ARGS`` expected to fail at start: its one stderr
    line.  ``limit_memory``: 1.5 GB of address space, so a file read without bound ends in a
    MemoryError instead of eating the machine."""
    def preexec():
        resource.setrlimit(resource.RLIMIT_AS, (1_500_000_000, 1_500_000_000))
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--host", "127.0.0.1",
                        "--port", "0", *args], stdin=stdin, capture_output=True, text=True,
                       timeout=60, cwd=CWD, preexec_fn=preexec if limit_memory else None)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aoprim: TLS: "), r.stderr[-2000:]
    return lines[0]


def call(certs, param, path, **kw):
    """server_context with the good files except ``param``, which is ``path``."""
    args = {"certfile": certs.server_cert, "keyfile": certs.server_key, "ca_certs": None}
    args[param] = path
    if param == "ca_certs":
        kw.setdefault("client_cert", "required")
    return server_context(args["certfile"], args["keyfile"], args["ca_certs"], **kw)


def cli_args(certs, param, path):
    args = {"certfile": certs.server_cert, "keyfile": certs.server_key}
    args[param] = path
    argv = [a for p, v in args.items() for a in (FLAGS[p], v)]
    return argv + (["--client-cert", "required"] if param == "ca_certs" else [])


# -- only a regular file is read, and only so much -----------------------------------------

@pytest.mark.parametrize("param", sorted(FLAGS))
def test_a_character_device_is_refused_unread(tls_certs, param):  # noqa: F811
    # /dev/null here (an empty device: reading it is harmless whatever the code does);
    # the endless /dev/zero is tried only in a child process with its memory limited
    with pytest.raises(ValueError) as info:
        call(tls_certs, param, "/dev/null")
    assert str(info.value).startswith(
        f"{FLAGS[param]} '/dev/null' is a character device, not a regular file"), info.value


@pytest.mark.timeout(30)    # reading a FIFO without a writer would wait for ever
@pytest.mark.parametrize("param", sorted(FLAGS))
def test_a_fifo_is_refused_without_waiting_for_a_writer(tls_certs, tmp_path, param):  # noqa: F811
    fifo = tmp_path / "pipe.pem"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as info:
        call(tls_certs, param, str(fifo))
    assert str(info.value).startswith(
        f"{FLAGS[param]} {str(fifo)!r} is a pipe (FIFO), not a regular file"), info.value


@pytest.mark.parametrize("param", sorted(FLAGS))
def test_a_directory_is_refused(tls_certs, tmp_path, param):  # noqa: F811
    with pytest.raises(IsADirectoryError) as info:
        call(tls_certs, param, str(tmp_path))
    assert str(info.value).endswith(
        f"{FLAGS[param]} {str(tmp_path)!r}: is a directory, not a regular file: give the "
        f"PEM file in it"), info.value


def test_cli_certfile_dev_zero_is_one_line(tls_certs):  # noqa: F811
    line = serve_cli("--certfile", "/dev/zero", "--keyfile", tls_certs.server_key,
                     limit_memory=True)
    assert line.startswith("aoprim: TLS: --certfile '/dev/zero' is a character device, not "
                           "a regular file"), line


@pytest.mark.timeout(90)
def test_cli_keyfile_dev_stdin_a_pipe_is_one_line(tls_certs):  # noqa: F811
    # stdin is a pipe that stays open and empty while the server starts: reading it would
    # wait for ever (the subprocess timeout then fails the test)
    r, w = os.pipe()
    try:
        line = serve_cli("--certfile", tls_certs.server_cert, "--keyfile", "/dev/stdin",
                         stdin=r)
    finally:
        os.close(r)
        os.close(w)
    assert line.startswith("aoprim: TLS: --keyfile '/dev/stdin' is a pipe (FIFO), not a "
                           "regular file"), line


def sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


@pytest.mark.parametrize("param, size, limit", [
    ("certfile", MiB + 1, "1 MiB"), ("keyfile", 2 * MiB, "1 MiB"),
    ("ca_certs", 16 * MiB + 1, "16 MiB")])
def test_a_file_over_the_bound_is_refused_naming_its_size(tls_certs, tmp_path, param, size,  # noqa: F811
                                                          limit):
    big = sparse(tmp_path / "big.pem", size)
    with pytest.raises(ValueError) as info:
        call(tls_certs, param, big)
    text = str(info.value)
    assert text.startswith(f"{FLAGS[param]} {big!r} is {size / MiB:.1f} MiB ({size} bytes): "
                           f"more than"), text
    assert f"(at most {limit})" in text, text


def test_cli_a_file_over_the_bound_is_one_line(tls_certs, tmp_path):  # noqa: F811
    big = sparse(tmp_path / "big.pem", 64 * MiB)
    line = serve_cli("--certfile", big, "--keyfile", tls_certs.server_key, limit_memory=True)
    assert line.startswith(f"aoprim: TLS: --certfile {big!r} is 64.0 MiB ({64 * MiB} "
                           f"bytes): more than"), line


def test_the_read_itself_is_bounded(tls_certs, monkeypatch):  # noqa: F811
    # a regular file whose st_size (0) says less than it holds: the bound is on the bytes
    # read, not only on the size the file claims
    status = "/proc/self/status"
    if not os.path.isfile(status) or os.stat(status).st_size:
        pytest.skip("needs Linux's /proc/self/status (a regular file of st_size 0)")
    monkeypatch.setattr(tls, "_PEM_LIMIT", 64)
    with pytest.raises(ValueError) as info:
        call(tls_certs, "certfile", status)
    assert str(info.value).startswith(f"--certfile {status!r} is more than 64 bytes"), \
        info.value


def test_a_ca_bundle_larger_than_a_key_bound_loads(tls_certs, tmp_path):  # noqa: F811
    # 2 MiB of CA certificates: over the certificate/key bound, well under the CA bundle's
    ca = pathlib.Path(tls_certs.ca_cert).read_bytes()
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(ca * (2 * MiB // len(ca) + 1))
    assert bundle.stat().st_size > 2 * MiB
    ctx = call(tls_certs, "ca_certs", str(bundle))
    assert ctx.cert_store_stats()["x509_ca"] == 1


def test_the_system_ca_bundle_is_under_the_bound(tls_certs):  # noqa: F811
    system = "/etc/ssl/certs/ca-certificates.crt"
    if not os.path.isfile(system):
        pytest.skip(f"no {system} (Debian's ca-certificates package)")
    assert os.stat(system).st_size * 10 < tls._CA_LIMIT
    ctx = call(tls_certs, "ca_certs", system)
    assert ctx.cert_store_stats()["x509_ca"] > 50


@pytest.mark.timeout(30)    # OpenSSL opening the FIFO by its name would wait for ever
def test_the_files_checked_are_the_files_loaded(tls_certs, tmp_path, monkeypatch):  # noqa: F811
    # the path is swapped for a FIFO once it was checked (as another process could): what
    # OpenSSL loads is the file that was checked and read, never the path opened again
    cert = tmp_path / "cert.pem"
    shutil.copy(tls_certs.server_cert, cert)
    real_open = os.open

    def open_then_swap(path, *a, **kw):
        fd = real_open(path, *a, **kw)
        if os.fspath(path) == str(cert):
            os.replace(cert, tmp_path / "moved.pem")
            os.mkfifo(cert)
        return fd
    monkeypatch.setattr(tls.os, "open", open_then_swap)
    ctx = call(tls_certs, "certfile", str(cert))
    assert stat.S_ISFIFO(os.stat(cert).st_mode)
    assert ctx.verify_mode.name == "CERT_NONE"


# -- what a path is ------------------------------------------------------------------------

@pytest.mark.parametrize("param", sorted(FLAGS))
def test_an_int_is_a_type_error_and_the_fd_stays_open(tls_certs, param):  # noqa: F811
    with socket.socket() as s:
        fd = s.fileno()
        with pytest.raises(TypeError) as info:
            call(tls_certs, param, fd)
        assert str(info.value) == (f"{param} must be a file path (str, bytes or "
                                   f"os.PathLike), not int {fd}")
        os.fstat(fd)                    # still open: raises EBADF if it was closed
        assert s.fileno() == fd


@pytest.mark.parametrize("value", [0, 3.0, True, ["cert.pem"]])
def test_other_non_paths_are_type_errors(tls_certs, value):  # noqa: F811
    with pytest.raises(TypeError, match=f"^keyfile must be a file path .*, not "
                                        f"{type(value).__name__} "):
        call(tls_certs, "keyfile", value)


def test_bytes_and_pathlike_paths_are_accepted(tls_certs):  # noqa: F811
    c = tls_certs
    ctx = server_context(os.fsencode(c.server_cert), pathlib.Path(c.server_key),
                         os.fsencode(c.ca_cert), client_cert="required")
    assert ctx.verify_mode.name == "CERT_REQUIRED"
    assert ctx.cert_store_stats()["x509_ca"] == 1


def test_a_bytes_path_is_named_as_text(tls_certs, tmp_path):  # noqa: F811
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(FileNotFoundError) as info:
        call(tls_certs, "keyfile", os.fsencode(missing))
    assert str(info.value).endswith(f"--keyfile {missing!r}: no such file"), info.value


@pytest.mark.parametrize("path", ["cert\0.pem", b"cert\0.pem"])
def test_a_path_with_a_nul_names_the_option(tls_certs, path):  # noqa: F811
    with pytest.raises(ValueError) as info:
        call(tls_certs, "keyfile", path)
    assert str(info.value) == "--keyfile 'cert\\x00.pem': a path cannot hold a NUL character"


# -- keys of another algorithm, OpenSSH keys -----------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """An RSA, an ECDSA P-256 and an Ed25519 key, each with a self-signed certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary (Debian's openssl package)")
    d = tmp_path_factory.mktemp("keys")

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
    for name, alg in (("rsa", ["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"]),
                      ("ec", ["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"]),
                      ("ed", ["-algorithm", "ED25519"])):
        openssl("genpkey", *alg, "-out", name + ".key")
        openssl("req", "-x509", "-new", "-key", name + ".key", "-days", "2",
                "-subj", "/CN=" + name, "-out", name + ".crt")
    return {n: str(d / n) for n in os.listdir(d)}


MISMATCHES = [("rsa.crt", "ec.key"), ("ec.crt", "rsa.key"), ("ed.crt", "rsa.key"),
              ("rsa.crt", "ed.key"), ("ec.crt", "ed.key"), ("ed.crt", "ec.key")]


def test_each_key_loads_with_its_own_certificate(keys):
    for name in ("rsa", "ec", "ed"):
        assert server_context(keys[name + ".crt"], keys[name + ".key"]).verify_mode.name \
            == "CERT_NONE"


@pytest.mark.parametrize("crt, key", MISMATCHES)
def test_a_key_of_another_algorithm_does_not_match(keys, crt, key):
    with pytest.raises(ValueError) as info:
        server_context(keys[crt], keys[key])
    assert str(info.value) == (
        f"the private key in --keyfile {keys[key]!r} does not match the certificate in "
        f"--certfile {keys[crt]!r}: give the key the certificate was issued for")


def test_cli_a_key_of_another_algorithm_is_one_line(keys):
    line = serve_cli("--certfile", keys["rsa.crt"], "--keyfile", keys["ec.key"])
    assert line == (f"aoprim: TLS: the private key in --keyfile {keys['ec.key']!r} does not "
                    f"match the certificate in --certfile {keys['rsa.crt']!r}: give the key "
                    f"the certificate was issued for")


@pytest.fixture(scope="module")
def ssh_keys(tmp_path_factory):
    """OpenSSH-format private keys (``ssh-keygen``'s default), as in ~/.ssh."""
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen binary (Debian's openssh-client package)")
    d = tmp_path_factory.mktemp("ssh")
    for t in ("ed25519", "rsa", "ecdsa"):
        subprocess.run(["ssh-keygen", "-q", "-t", t, "-N", "", "-f", str(d / ("id_" + t))],
                       check=True, capture_output=True, timeout=60)
    return {t: str(d / ("id_" + t)) for t in ("ed25519", "rsa", "ecdsa")}


@pytest.mark.parametrize("kind", ["ed25519", "rsa", "ecdsa"])
def test_an_openssh_key_is_named_as_one(keys, ssh_keys, kind):
    key = ssh_keys[kind]
    assert pathlib.Path(key).read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    with pytest.raises(ValueError) as info:
        server_context(keys["rsa.crt"], key)
    assert str(info.value).startswith(
        f"--keyfile {key!r} holds an OpenSSH private key, not a PEM one: "), info.value
    assert "ssh-keygen -p -m PEM -f" in str(info.value)


def test_cli_an_openssh_key_is_one_line(keys, ssh_keys):
    line = serve_cli("--certfile", keys["ed.crt"], "--keyfile", ssh_keys["ed25519"])
    assert line.startswith(f"aoprim: TLS: --keyfile {ssh_keys['ed25519']!r} holds an OpenSSH "
                           f"private key, not a PEM one: "), line


def test_an_openssh_key_in_the_certfile_is_named_too(keys, ssh_keys, tmp_path):
    both = tmp_path / "both.pem"
    both.write_bytes(pathlib.Path(keys["ec.crt"]).read_bytes() +
                     pathlib.Path(ssh_keys["ecdsa"]).read_bytes())
    with pytest.raises(ValueError) as info:
        server_context(str(both))
    assert str(info.value).startswith(
        f"--certfile {str(both)!r} holds an OpenSSH private key, not a PEM one: "), \
        info.value


@pytest.mark.parametrize("mode", ["bogus", "REQUIRED", ""])
def test_an_unknown_client_cert_mode_is_a_value_error_naming_it(tls_certs, mode):  # noqa: F811
    with pytest.raises(ValueError, match=r"--client-cert .*none, optional, required") as e:
        server_context(tls_certs.server_cert, tls_certs.server_key, client_cert=mode)
    assert repr(mode) in str(e.value)
