"""A handler that forks while the process is at its fd limit (a busy server: RLIMIT_NOFILE
reached): the fork still holds no share of the port -- after the server's shutdown a
connection is refused at once, not accepted by the kernel for the fork and never answered
(docs/server.md, "Forks and the standard fds").  Each case runs in a process of its own
(its fd limit lowered there)."""
import os
import subprocess
import sys
import textwrap

import pytest

from aoprim.server.loop import BACKENDS

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")]

SCRIPT = textwrap.dedent("""
    import os, resource, socket, sys
    from aoprim.server import Handler, Server

    backend, full = sys.argv[1], sys.argv[2] == "full"
    r, w = os.pipe()                    # the fork lives until the test ends it

    class Forks(Handler):
        def on_read(self, session, data):
            hog = []
            if full:                    # the process is at its fd limit now
                try:
                    while True:
                        hog.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    pass
            pid = os.fork()
            if pid == 0:
                os.read(r, 1)           # a job that lives on, then ends itself
                os._exit(0)
            for fd in hog:
                os.close(fd)
            session.send(b"%d" % pid)

    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    srv = Server(Forks(), "127.0.0.1", 0, backend=backend, framing="raw").start()
    port = srv.address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"go")
        pid = int(c.recv(16))
    srv.shutdown()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        print("accepted while the fork lives")
    except ConnectionRefusedError:
        print("refused")
    except OSError as e:
        print("other", e)
    os.write(w, b"x")
    os.waitpid(pid, 0)
""")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("full", ["full", "room"])
def test_a_fork_at_the_fd_limit_holds_no_share_of_the_port(backend, full):
    p = subprocess.run([sys.executable, "-c", SCRIPT, backend, full], capture_output=True,
                       text=True, timeout=40)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "refused", (p.stdout, p.stderr)
