"""The serving process and what handler code does to it (docs/server.md): a handler's fork
is the parent's server's business only in the parent -- a fork that ends with ``sys.exit()``
ends (on the loop thread and on a worker alike) and leaves the parent serving; a fork that
lives on holds no listening socket and stops on SIGTERM; a handler that closes fd 1 or 2
sends no later client the process's output.  Each server runs in a process of its own (a
session group), every process of which is counted and gone at the end."""
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from aoprim.server.loop import BACKENDS

from server_support import recv_exact, wait_for

FORKER = textwrap.dedent("""
    import logging, os, signal, sys, time
    from aoprim.server import Handler, Server

    backend, workers, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)       # the forks reap themselves

    class Forker(Handler):
        def on_read(self, session, data):
            if os.fork() == 0:
                if mode == "linger":                    # a job that outlives its server
                    time.sleep(60)
                    os._exit(0)
                sys.exit(0)                             # a job done
            session.send(data)

    srv = Server(Forker(), "127.0.0.1", 0, backend=backend, workers=workers)
    print(srv.address[1], flush=True)
    srv.serve_forever()
    print("stopped", flush=True)
""")


def _stat(pid):
    """(state, ppid, session id) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[3])


def _group(sid):
    """The live (not zombie) processes of session ``sid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[2] == sid and st[0] != "Z":
                out.append(int(name))
    return sorted(out)


@pytest.fixture
def run_script(tmp_path):
    """run_script(source, *args) -> Popen of ``python script args`` in a session of its own,
    stdout a pipe; at teardown every process of that session is killed and counted gone."""
    procs = []

    def run(source, *args, stderr=subprocess.PIPE, shell_redirect=""):
        path = tmp_path / "script.py"
        path.write_text(source)
        argv = [sys.executable, str(path), *args]
        if shell_redirect:
            argv = ["sh", "-c", 'exec "$@" ' + shell_redirect, "sh", *argv]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr,
                             start_new_session=True, cwd=tmp_path)
        procs.append(p)
        return p

    yield run
    for p in procs:
        for pid in _group(p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=30)
        finally:
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
        wait_for(lambda: not _group(p.pid), 10, "every process of the script gone")


def _echo(port, payload=b"x"):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(payload)
        return recv_exact(c, len(payload))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_ending_with_sys_exit_ends_and_the_parent_serves_on(run_script, backend,
                                                                   workers):
    p = run_script(FORKER, backend, str(workers), "exit")
    port = int(p.stdout.readline())
    for i in range(4):
        # every request forks once; each fork calls sys.exit(0)
        assert _echo(port, b"x%d" % i) == b"x%d" % i
    wait_for(lambda: _group(p.pid) == [p.pid], 10, "every fork to end")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    assert p.stdout.read() == b"stopped\n"
    err = p.stderr.read().decode()
    assert "Traceback" not in err and "crashed" not in err, err


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_that_lives_on_holds_no_listening_socket_and_stops_on_sigterm(
        run_script, backend, workers):
    p = run_script(FORKER, backend, str(workers), "linger")
    port = int(p.stdout.readline())
    assert _echo(port) == b"x"
    forks = wait_for(lambda: [q for q in _group(p.pid) if q != p.pid], 10, "the fork")
    assert len(forks) == 1
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    assert _stat(forks[0]) is not None          # the fork outlives its server ...
    with pytest.raises(ConnectionRefusedError):
        # ... and the port is closed with the server: the fork does not hold it
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    os.kill(forks[0], signal.SIGTERM)           # the default action: it ends
    wait_for(lambda: not _group(p.pid), 10, "the fork to end on SIGTERM")


CLOSER = textwrap.dedent("""
    import logging, os, sys
    from aoprim.server import Handler, Server

    backend, workers = sys.argv[1], int(sys.argv[2])
    logging.basicConfig(level=logging.WARNING)

    class Closer(Handler):
        def on_read(self, session, data):
            data = bytes(data)
            if data == b"close":                # a "daemonize" helper closing 1 and 2
                os.close(1)
                os.close(2)
            elif data == b"say":
                os.write(2, b"SECRET2")
                print("SECRET1", flush=True)
                logging.getLogger("app").error("SECRET-LOG")
            session.send(data)

    srv = Server(Closer(), "127.0.0.1", 0, backend=backend, workers=workers)
    # the port on a pipe of its own (fd 1 is closed later by the handler)
    os.write(int(os.environ["PORT_FD"]), b"%d\\n" % srv.address[1])
    srv.serve_forever()
""")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handler_closing_fds_1_and_2_sends_no_client_the_output(tmp_path, backend,
                                                                  workers):
    r, w = os.pipe()
    path = tmp_path / "closer.py"
    path.write_text(CLOSER)
    p = subprocess.Popen([sys.executable, str(path), backend, str(workers)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, cwd=tmp_path, pass_fds=(w,),
                         env={**os.environ, "PORT_FD": str(w)})
    os.close(w)
    victims = []
    try:
        with os.fdopen(r, "rb") as f:
            port = int(f.readline())
        a = socket.create_connection(("127.0.0.1", port), timeout=10)
        victims.append(a)
        a.sendall(b"close")
        assert recv_exact(a, 5) == b"close"
        for i in range(4):                      # the next connections: fds 1 and 2 are free
            v = socket.create_connection(("127.0.0.1", port), timeout=10)
            victims.append(v)
            v.sendall(b"ping")
            assert recv_exact(v, 4) == b"ping"
        a.sendall(b"say")
        assert recv_exact(a, 3) == b"say"
        for v in victims[1:]:
            # what reached a victim's connection before this echo comes first
            v.sendall(b"end")
            assert recv_exact(v, 3) == b"end"
        for fd in (1, 2):
            assert os.readlink(f"/proc/{p.pid}/fd/{fd}") == os.devnull
    finally:
        for v in victims:
            v.close()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    assert not _group(p.pid)


STARTS_CLOSED = textwrap.dedent("""
    import os, sys
    from aoprim.server import Server
    from aoprim.server.apps import Echo

    srv = Server(Echo(), "127.0.0.1", 0, backend=sys.argv[1])
    print(os.readlink("/proc/self/fd/0"), os.readlink("/proc/self/fd/2"), flush=True)
    srv.close()
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_server_started_with_fds_0_and_2_closed_puts_dev_null_there(run_script, backend):
    p = run_script(STARTS_CLOSED, backend, stderr=subprocess.DEVNULL,
                   shell_redirect="<&- 2>&-")
    assert p.stdout.read().split() == [os.devnull.encode()] * 2
    assert p.wait(timeout=30) == 0
