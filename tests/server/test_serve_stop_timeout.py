"""``serve --stop-timeout S`` bounds the whole stop, and the server's graceful shutdown takes
its share of it: a request still running on a worker at SIGTERM finishes and is answered
when the operator gives the stop the time (docs/server.md, "serve")."""
import signal
import socket
import subprocess
import sys

import pytest

from proc_support import NEUTRAL_CWD, child_env

HANDLER = '''
import sys, threading
class H:
    def on_connect(self, s): pass
    def on_close(self, s, exc=None): pass
    def on_read(self, s, data):
        print("started", flush=True)
        threading.Event().wait(6.5)     # a request that takes 6.5 s (a database call)
        s.send(b"reply:" + bytes(data))
'''


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_longer_stop_timeout_lets_a_request_in_progress_finish(tmp_path, workers):
    (tmp_path / "slow_h.py").write_text(HANDLER)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "slow_h:H", "--app-dir",
                          str(tmp_path), "--host", "127.0.0.1", "--port", "0", "--framing",
                          "raw", "--workers", str(workers), "--stop-timeout", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=NEUTRAL_CWD, env=child_env())
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on "), (line, p.stderr.read())
        port = int(line.split()[-1].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            c.sendall(b"req")
            assert p.stdout.readline() == "started\n"
            p.send_signal(signal.SIGTERM)
            got = b""
            while (d := c.recv(100)):
                got += d
        out, err = p.communicate(timeout=40)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert got == b"reply:req", err
    assert p.returncode == 0 and "shutdown timeout" not in err, err
