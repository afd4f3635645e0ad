"""A connection accepted onto fd 0, 1 or 2 (handler code closed one) moves up and
``/dev/null`` takes its place before anything else happens to it -- a refusal under the
PROXY protocol's ``trusted_proxies`` included, whose log line must not reach that client
(docs/server.md, "Forks and the standard fds").  Each case runs in a process of its own:
it closes its fd 2."""
import subprocess
import sys
import textwrap

import pytest

from aoprim.server.loop import BACKENDS

pytestmark = pytest.mark.timeout(60)

SCRIPT = textwrap.dedent("""
    import logging, os, socket, sys
    from aoprim.server import Handler, Server

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(message)s")

    class Echo(Handler):
        def on_read(self, session, data):
            session.send(data)

    srv = Server(Echo(), "127.0.0.1", 0, backend=sys.argv[1], proxy_protocol="v1",
                 trusted_proxies=("10.0.0.0/8",)).start()
    saved = os.dup(2)
    c = socket.socket()                 # (made first: it must not take fd 2 itself)
    c.settimeout(10)
    os.close(2)                         # what a handler's os.close(2) does
    c.connect(srv.address)
    got = b""
    try:
        while True:
            b = c.recv(4096)
            if not b:
                break
            got += b
    except OSError:
        pass
    os.dup2(saved, 2)
    srv.shutdown()
    print(repr(got))
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_untrusted_connection_on_fd_2_gets_no_log_line(backend):
    p = subprocess.run([sys.executable, "-c", SCRIPT, backend], capture_output=True,
                       text=True, timeout=40)
    assert p.returncode == 0, p.stderr
    got = p.stdout.strip().splitlines()[-1]
    assert got == "b''", (p.stdout, p.stderr)
