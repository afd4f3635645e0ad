"""A handler that forks while the process is at its fd limit (a busy server: RLIMIT_NOFILE
reached): the fork still holds no share of the port -- none of its fds is the listening
socket, so after the server's shutdown the port is not left listening for the fork, whose
kernel queue would take connections nobody answers (docs/server.md, "Forks and the
standard fds").  Each case runs in a process of its own (its fd limit lowered there)."""
import os
import subprocess
import sys
import textwrap

import pytest

from aoprim.server.loop import BACKENDS

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"),
                                 reason="needs os.fork and /proc/PID/fd")]

SCRIPT = textwrap.dedent("""
    import os, resource, socket, sys
    from aoprim.server import Handler, Server

    backend, full = sys.argv[1], sys.argv[2] == "full"
    r, w = os.pipe()                    # the fork lives until the test ends it
    up_r, up_w = os.pipe()              # the fork says it runs (its fork hooks have run)

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
                os.write(up_w, b"u")
                os.read(r, 1)           # a job that lives on, then ends itself
                os._exit(0)
            for fd in hog:
                os.close(fd)
            session.send(b"%d" % pid)

    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    lsock = socket.create_server(("127.0.0.1", 0))
    listening = "socket:[%d]" % os.fstat(lsock.fileno()).st_ino
    srv = Server(Forks(), sock=lsock, backend=backend, framing="raw").start()
    with socket.create_connection(srv.address[:2], timeout=10) as c:
        c.sendall(b"go")
        pid = int(c.recv(16))
    srv.shutdown()
    os.read(up_r, 1)
    # the fork's fds, as the kernel sees them: none is the listening socket
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    print("fork holds the port" if listening in held else "fork holds no share")
    os.write(w, b"x")
    os.waitpid(pid, 0)
""")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("full", ["full", "room"])
def test_a_fork_at_the_fd_limit_holds_no_share_of_the_port(backend, full):
    p = subprocess.run([sys.executable, "-c", SCRIPT, backend, full], capture_output=True,
                       text=True, timeout=40)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "fork holds no share", (p.stdout, p.stderr)
