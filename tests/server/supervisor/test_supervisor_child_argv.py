"""--procs N: the command line each server process is started with (cli.py's part that builds
it; docs/server.md "--procs N").

- A child runs under the interpreter's own options, as the supervisor does (``-u``,
  ``-X dev``, ``-W``, ``-O``; ``-X gil`` on a free-threaded build), as multiprocessing
  starts its children.
- A child gets the supervisor's settings as they were given, a value that starts with ``-``
  (``--app-dir=-apps``) included: argparse never takes one for an option.
"""
import signal
import socket
import subprocess
import sys
import sysconfig

import pytest

from proc_support import child_env
from server_support import HOST, recv_exact
from test_supervisor import children_of, cleanup

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))

FLAGS = """
import io, os, sys
from aoprim.server import Handler

class Flags(Handler):
    # tells what options the interpreter serving this connection runs with
    def on_read(self, session, data):
        std = sys.__stdout__ if sys.__stdout__ is not None else sys.__stderr__
        gil = getattr(sys, "_is_gil_enabled", lambda: None)()
        said = "%d dev=%d optimize=%d warnings=%s unbuffered=%d gil=%s\\n" % (
            os.getpid(), sys.flags.dev_mode, sys.flags.optimize, ",".join(sys.warnoptions),
            isinstance(std.buffer, io.FileIO), gil)
        session.send(said.encode())
"""


def _ask(port):
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(b"?")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(256)
            assert chunk, data
            data += chunk
    pid, rest = data.decode().split(" ", 1)
    return int(pid), rest.strip()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("procs", ["1", "2"])
def test_children_run_under_the_interpreters_options(tmp_path, procs):
    """`python -u -X dev -W error::DeprecationWarning -O -m aoprim serve --procs 2`: the
    children ran without any of them (a handler's print reached the log only at the stop:
    its stdout was block-buffered)."""
    (tmp_path / "flagsapp.py").write_text(FLAGS)
    options = ["-u", "-X", "dev", "-W", "error::DeprecationWarning", "-O"]
    # what sys._is_gil_enabled() says (3.13+; None before): on a GIL build always True
    gil = True if hasattr(sys, "_is_gil_enabled") else None
    if FREE_THREADED:
        options += ["-X", "gil=1"]          # (the build's default is off: on shows it passed)
    env = child_env()
    env.pop("PYTHONUNBUFFERED", None)       # -u alone says it
    env.pop("PYTHONDEVMODE", None)
    env.pop("PYTHONOPTIMIZE", None)
    env.pop("PYTHONWARNINGS", None)
    env.pop("PYTHON_GIL", None)
    p = subprocess.Popen([sys.executable, *options, "-m", "aoprim", "serve", "--host", HOST,
                          "--port", "0", "--procs", procs, "--app-dir", str(tmp_path),
                          "flagsapp:Flags"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), env=env)
    kids = []
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on "), (line, p.stderr.read() if p.poll() else "")
        port = int(line.rsplit(":", 1)[1])
        kids = children_of(p.pid) if procs != "1" else [p.pid]
        seen = {}
        for _ in range(400):                # until every server process answered
            pid, said = _ask(port)
            seen[pid] = said
            if len(seen) == len(kids):
                break
        assert sorted(seen) == sorted(kids), (seen, kids)
        want = ("dev=1 optimize=1 warnings=default,error::DeprecationWarning unbuffered=1 "
                f"gil={gil}")
        assert set(seen.values()) == {want}, seen
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1]
        assert p.returncode == 0, err
    finally:
        cleanup(p, kids)


DASHED = ["--app-dir=-apps", "--host=-h", "--certfile=-cert.pem", "--keyfile=-key.pem",
          "--ca-certs=-ca.pem", "--trusted-proxy=-net", "--trusted-proxy=::1"]


def test_a_value_starting_with_a_dash_reaches_the_child_as_given():
    """A child's settings came as `--app-dir -apps`, two arguments: argparse took `-apps`
    for an option (`aoprim: --app-dir: expected one argument`, exit 2)."""
    from aoprim.server.cli import build_parser
    p = build_parser()
    a = p.parse_args(["serve", *DASHED, "--procs", "2", "--port", "0"])
    argv = a.child_argv(a, port=1234, procs=1, reuse_port=True, status_fd=7)
    b = p.parse_args(["serve", *argv])
    for name in ("app_dir", "host", "certfile", "keyfile", "ca_certs", "trusted_proxy"):
        assert getattr(b, name) == getattr(a, name), (name, argv)
    assert (b.port, b.procs, b.reuse_port, b.status_fd) == (1234, 1, True, 7)
    assert b.app_dir == "-apps" and b.trusted_proxy == ["-net", "::1"]


ECHO = "from aoprim.server.apps import Echo\n"


@pytest.mark.timeout(120)
def test_an_app_dir_starting_with_a_dash_serves_under_procs(tmp_path):
    """`serve h:H --app-dir=-apps --procs 2`: each child exited 2 (`--app-dir: expected one
    argument`), where `--procs 1` served."""
    (tmp_path / "-apps").mkdir()
    (tmp_path / "-apps" / "dash_echo.py").write_text(ECHO)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", "2", "--app-dir=-apps", "dash_echo:Echo"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), env=child_env())
    kids = []
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on "), (line, p.stderr.read() if p.poll() else "")
        port = int(line.rsplit(":", 1)[1])
        kids = children_of(p.pid)
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"ping")
            assert recv_exact(s, 4) == b"ping"
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1]
        assert p.returncode == 0, err
    finally:
        cleanup(p, kids)
