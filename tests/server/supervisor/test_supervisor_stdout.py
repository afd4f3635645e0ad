"""--procs N with the supervisor's stdout gone: a pipe whose reader exited (``| head -1``, a
dead log shipper) or no stdout at all (``>&-``).  The lines are dropped, every process keeps
serving, and SIGTERM still ends it all with status 0 and no traceback (supervisor.py).
"""
import os
import signal
import socket
import subprocess
import sys

import pytest

from aoprim.server.loop import BACKENDS

from proc_support import child_env, end
from server_support import HOST, recv_exact
from test_supervisor import Lines

PRINTER = """
from aoprim.server import Handler

class PrintingEcho(Handler):
    # every frame is one line on stdout (which the supervisor passes on), then its echo
    def on_read(self, session, data):
        print("got", bytes(data).decode(), flush=True)
        session.send(data)
"""


def echo(port, payload):
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(payload)
        return recv_exact(s, len(payload), timeout=30)


def start(tmp_path, backend, **popen):
    (tmp_path / "printer.py").write_text(PRINTER)
    return subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                             "--port", "0", "--procs", "2", "--backend", backend,
                             "printer:PrintingEcho"], stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path), env=child_env(), **popen)


def finish(p, err):
    """SIGTERM: every process stops, status 0, no traceback."""
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0, err.text()
    err.join()
    text = err.text()
    assert "Traceback" not in text and "Exception ignored" not in text, text
    assert text.count("received SIGTERM: shutting down") == 2, text   # both children


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pipe_whose_reader_exited_drops_the_lines_and_serving_goes_on(tmp_path, backend):
    """`serve --procs 2 | head -1`: the supervisor took the EPIPE of the next line for a
    failed port reservation, killed every child and exited 2."""
    p = start(tmp_path, backend, stdout=subprocess.PIPE)
    err = Lines(p.stderr)
    try:
        line = p.stdout.readline()              # what `head -1` reads, and then it exits
        assert line.startswith("listening on "), err.text()
        port = int(line.rsplit(":", 1)[1])
        p.stdout.close()
        assert echo(port, b"one") == b"one"     # its "got one" line meets the broken pipe
        err.wait("stdout is unusable (Broken pipe): the server processes' output is dropped")
        for i in range(4):                      # both children still serve
            assert echo(port, b"after%d" % i) == b"after%d" % i
        assert p.poll() is None
        finish(p, err)
    finally:
        end(p)
        p.stderr.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_stdout_at_all_drops_the_lines_and_serving_goes_on(tmp_path, backend):
    """`serve --procs 2 >&-`: sys.stdout is None, and the supervisor died with an
    AttributeError traceback at its "listening on" line."""
    p = start(tmp_path, backend, stdout=None, preexec_fn=lambda: os.close(1))
    err = Lines(p.stderr)
    try:
        err.wait("supervising 2 server processes on ")
        port = int(err.text().split("supervising 2 server processes on ")[1].split()[0]
                   .rsplit(":", 1)[1])
        assert echo(port, b"one") == b"one"
        err.wait("stdout is unusable (no stdout): the server processes' output is dropped")
        for i in range(4):
            assert echo(port, b"after%d" % i) == b"after%d" % i
        finish(p, err)
    finally:
        end(p)
        p.stderr.close()
