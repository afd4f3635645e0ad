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


FORK_BACK = textwrap.dedent("""
    import logging, os, sys
    from aoprim.server import Handler, Server

    backend, workers, hook, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    logging.basicConfig(level=logging.WARNING, format="%(process)d %(levelname)s %(message)s")

    def fork_and_come_back(where):
        # a job in a fork that does not end it: it returns, or raises, into the server
        pid = os.fork()
        if pid == 0:
            if how == "raise":
                raise ValueError("the job failed in the fork")
            return
        _, st = os.waitpid(pid, 0)          # (the fork must end by itself)
        print(where, os.waitstatus_to_exitcode(st), flush=True)

    class ForkBack(Handler):
        def on_connect(self, session):
            session.send(b"hello")          # queued before the fork: sent once, by the parent
            if hook == "on_connect":
                fork_and_come_back(hook)

        def on_read(self, session, data):
            session.send(bytes(data))
            if hook == "on_read":
                fork_and_come_back(hook)

        def on_close(self, session, exc):
            if hook == "on_close":
                fork_and_come_back(hook)

    srv = Server(ForkBack(), "127.0.0.1", 0, backend=backend, workers=workers)
    print(srv.address[1], flush=True)
    srv.serve_forever()
    print("stopped", flush=True)
""")


def _read_to_eof(sock):
    out = b""
    while True:
        b = sock.recv(65536)
        if not b:
            return out
        out += b


@pytest.mark.parametrize("how", ["return", "raise"])
@pytest.mark.parametrize("hook", ["on_connect", "on_read", "on_close"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_that_comes_back_into_the_server_ends_there_and_sends_nothing(
        run_script, backend, workers, hook, how):
    # a handler's fork that does not end itself -- its job returns, or raises, back into
    # the server -- ends at that point: no reply the parent queued is sent a second time,
    # no later frame is handled there, the parent's connection is neither closed nor reset
    p = run_script(FORK_BACK, backend, str(workers), hook, how)
    port = int(p.stdout.readline())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        assert recv_exact(c, 5) == b"hello"
        for i in range(3):
            c.sendall(b"ping%d" % i)
            assert recv_exact(c, 5) == b"ping%d" % i
        c.shutdown(socket.SHUT_WR)
        assert _read_to_eof(c) == b""           # nothing more: no duplicate, no reset
    forks = 3 if hook == "on_read" else 1
    # the fork's status as its parent saw it: a sys.exit() at the point it came back, with
    # 0 after a return, 1 after an exception -- as a thread's SystemExit does on a worker
    # (the fork's only thread then), where the process ends with 0
    on_main = workers == 0 or hook == "on_connect"
    status = 1 if how == "raise" and on_main else 0
    lines = [p.stdout.readline().decode().split() for _ in range(forks)]
    assert lines == [[hook, str(status)]] * forks
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    assert p.stdout.read() == b"stopped\n"
    err = p.stderr.read().decode()
    if how == "return":
        assert err.count(f"returned into the server from {hook}") == forks, err
    else:
        assert err.count(f"forked by handler code: {hook} raised; the fork ends") == forks, err
        assert err.count("ValueError: the job failed in the fork") == forks, err
    assert "closing this session" not in err and "crashed" not in err, err


PROTOCOL_FORK_BACK = textwrap.dedent("""
    import asyncio, logging, os, signal, sys
    from aoprim.server import serve_protocol

    backend, workers, where, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    logging.basicConfig(level=logging.WARNING, format="%(process)d %(levelname)s %(message)s")

    def fork_and_come_back():
        pid = os.fork()
        if pid == 0:
            if how == "raise":
                raise ValueError("the job failed in the fork")
            return
        _, st = os.waitpid(pid, 0)
        print(where, os.waitstatus_to_exitcode(st), flush=True)

    async def job():
        fork_and_come_back()

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(data)      # queued before the fork (workers: unsent)
            if where == "data_received":
                fork_and_come_back()
            elif where == "call_soon":
                asyncio.get_running_loop().call_soon(fork_and_come_back)
            else:
                asyncio.get_running_loop().create_task(job())

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    srv = serve_protocol(P, "127.0.0.1", 0, backend=backend, workers=workers)
    print(srv.address[1], flush=True)
    signal.sigwait({signal.SIGTERM})
    srv.shutdown()
    print("stopped", flush=True)
""")


@pytest.mark.parametrize("how", ["return", "raise"])
@pytest.mark.parametrize("where", ["data_received", "call_soon", "task"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_protocols_fork_that_comes_back_into_the_server_ends_there(
        run_script, backend, workers, where, how):
    # serve_protocol: a fork made by a protocol callback, a loop callback or a task that
    # comes back -- returns, or raises -- ends there; the parent's connection carries on
    p = run_script(PROTOCOL_FORK_BACK, backend, str(workers), where, how)
    port = int(p.stdout.readline())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        for i in range(3):
            c.sendall(b"ping%d" % i)
            assert recv_exact(c, 5) == b"ping%d" % i
            # (the next request once this one's fork has ended)
            assert p.stdout.readline().decode().split() == [where, "0"]
        c.shutdown(socket.SHUT_WR)
        assert _read_to_eof(c) == b""
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    assert p.stdout.read() == b"stopped\n"
    err = p.stderr.read().decode()
    assert err.count("forked by handler code") == 3, err
    assert "Traceback" not in err or err.count("ValueError: the job failed") == 3, err
    assert "closing this session" not in err and "crashed" not in err, err


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
