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

from server_support import recv_exact, recv_until_closed, wait_for

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
        assert recv_until_closed(c) == (b"", "eof")   # nothing more: no duplicate, no reset
    forks = 3 if hook == "on_read" else 1
    # the fork's status as its parent saw it: 0 after a return, 1 after an exception, on
    # the loop thread and on a worker alike
    status = 1 if how == "raise" else 0
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
            # (the next request once this one's fork has ended: 1 after an exception that
            # reached the server, 0 after a return -- a task keeps its own exception, and a
            # loop callback's goes to the loop's exception handler, as on asyncio's loop)
            status = "1" if how == "raise" and where == "data_received" else "0"
            assert p.stdout.readline().decode().split() == [where, status]
        c.shutdown(socket.SHUT_WR)
        assert recv_until_closed(c) == (b"", "eof")
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


POOL_BESIDE_A_FORK = textwrap.dedent("""
    import multiprocessing, os, sys
    from aoprim.server import Handler, Server

    backend, workers = sys.argv[1], int(sys.argv[2])

    def square_when_told(started, go, x):
        started.set()
        go.wait(30)
        return x * x

    class H(Handler):
        def on_read(self, session, data):
            started, go = manager_events
            res = pool.apply_async(square_when_told, (started, go, 7))
            assert started.wait(30)                 # the parent's task runs on the Pool
            pid = os.fork()
            if pid == 0:
                return                              # a fork that comes back: ended
            os.waitpid(pid, 0)
            go.set()
            try:
                session.send(b"result %d" % res.get(timeout=30))
            except multiprocessing.TimeoutError:
                session.send(b"lost")

    if __name__ == "__main__":
        multiprocessing.set_start_method("fork")
        manager = multiprocessing.Manager()
        manager_events = (manager.Event(), manager.Event())
        pool = multiprocessing.Pool(1)
        srv = Server(H(), "127.0.0.1", 0, backend=backend, workers=workers)
        print(srv.address[1], flush=True)
        srv.serve_forever()
        pool.terminate()
        manager.shutdown()
        print("stopped", flush=True)
""")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ending_a_fork_leaves_the_parents_pool_workers_alone(run_script, backend, workers):
    # the fork is ended without the interpreter's exit, whose atexit handlers -- inherited
    # from the parent -- include multiprocessing's, which terminates the Pool workers the
    # fork takes for its own: the parent's task on one was lost
    p = run_script(POOL_BESIDE_A_FORK, backend, str(workers))
    port = int(p.stdout.readline())
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        c.sendall(b"go")
        assert recv_exact(c, 9, timeout=60) == b"result 49"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 0
    assert p.stdout.read() == b"stopped\n"


LIVE_FORK = textwrap.dedent("""
    import os, sys, time
    from aoprim.server import Handler, Server

    backend, workers = sys.argv[1], int(sys.argv[2])

    class H(Handler):
        def on_read(self, session, data):
            if bytes(data) == b"fork":
                if os.fork() == 0:              # a job that lives on (a Pool worker)
                    time.sleep(60)
                    os._exit(0)
                session.send(b"forked")
            elif bytes(data) == b"abort":
                session.abort()
            else:
                session.close()

    srv = Server(H(), "127.0.0.1", 0, backend=backend, workers=workers)
    print(srv.address[1], flush=True)
    srv.serve_forever()
""")


@pytest.mark.parametrize("how", ["abort", "close"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_that_lives_on_holds_no_connection_the_parent_ends(run_script, backend,
                                                                  workers, how):
    # the connection open at the fork is the parent's alone: its abort resets it and its
    # close ends it at once, while the fork lives on
    p = run_script(LIVE_FORK, backend, str(workers))
    port = int(p.stdout.readline())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"fork")
        assert recv_exact(c, 6) == b"forked"
        wait_for(lambda: len(_group(p.pid)) == 2, 10, "the fork")
        c.sendall(how.encode())
        c.settimeout(5)                             # (not the fork's 60 s)
        try:
            assert c.recv(16) == b""                # the end of the stream ...
        except ConnectionResetError:                # ... or, for an abort, a reset
            assert how == "abort"
    assert len(_group(p.pid)) == 2                  # the fork is still there


LISTENS_ON_FD_0 = textwrap.dedent("""
    import os, socket, sys, time
    from aoprim.server import Handler, Server

    lsock = socket.create_server(("127.0.0.1", 0))
    os.dup2(lsock.fileno(), 0)                      # inetd's `wait`, systemd's socket stdin
    lsock.close()
    sock = socket.socket(fileno=0)

    class H(Handler):
        def on_read(self, session, data):
            if os.fork() == 0:                      # a job that outlives the server
                time.sleep(60)
                os._exit(0)
            session.send(data)

    srv = Server(H(), sock=sock, backend=sys.argv[1])
    print(srv.address[1], flush=True)
    srv.serve_forever()
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_listening_socket_on_fd_0_is_not_kept_by_a_fork(run_script, backend):
    p = run_script(LISTENS_ON_FD_0, backend)
    port = int(p.stdout.readline())
    assert _echo(port) == b"x"
    wait_for(lambda: len(_group(p.pid)) == 2, 10, "the fork")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    with pytest.raises(ConnectionRefusedError):
        # the port closed with the server: the fork holds no share of it
        socket.create_connection(("127.0.0.1", port), timeout=10).close()


FORK_ON_LOW = textwrap.dedent("""
    import asyncio, logging, os, signal, sys
    from aoprim.server import Handler, Server, serve_protocol

    backend, workers, api = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.WARNING, format="%(process)d %(levelname)s %(message)s")
    BIG = b"x" * (16 << 20)                 # more than the socket takes at once

    def fork_and_come_back():
        pid = os.fork()
        if pid == 0:
            return                          # from the flush that saw the backlog drain
        _, st = os.waitpid(pid, 0)
        print("low", os.waitstatus_to_exitcode(st), flush=True)

    class P(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            transport.set_write_buffer_limits(high=65536)

        def data_received(self, data):
            self.transport.write(BIG)

        def resume_writing(self):
            fork_and_come_back()

    class H(Handler):
        def on_read(self, session, data):
            session.set_write_limits(65536, 16384, lambda: None, fork_and_come_back)
            session.send(BIG)

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if api == "protocol":
        srv = serve_protocol(P, "127.0.0.1", 0, backend=backend, workers=workers)
    else:
        srv = Server(H(), "127.0.0.1", 0, backend=backend, workers=workers,
                     framing="raw", max_pending=64 << 20).start()
    print(srv.address[1], flush=True)
    signal.sigwait({signal.SIGTERM})
    srv.shutdown()
    print("stopped", flush=True)
""")


@pytest.mark.parametrize("api", ["protocol", "handler"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_made_as_the_write_backlog_drains_ends_when_it_comes_back(
        run_script, backend, workers, api):
    # resume_writing (serve_protocol) and a session's on_low run from the loop's flush, not
    # from a hook: a fork made there that returns is ended all the same
    p = run_script(FORK_ON_LOW, backend, str(workers), api)
    port = int(p.stdout.readline())
    with socket.socket() as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)    # a slow reader
        c.connect(("127.0.0.1", port))
        c.sendall(b"go")
        assert recv_exact(c, 16 << 20, timeout=60) == b"x" * (16 << 20)
        assert p.stdout.readline().decode().split() == ["low", "0"]
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    assert p.stdout.read() == b"stopped\n"
    err = p.stderr.read().decode()
    assert err.count("returned into the server from") == 1, err
    assert "Traceback" not in err and "Errno" not in err, err


MADE_BEFORE_A_FORK = textwrap.dedent("""
    import os, sys
    from aoprim.server import Server
    from aoprim.server.apps import Echo

    srv = Server(Echo(), "127.0.0.1", 0, backend=sys.argv[1])
    pid = os.fork()
    if pid == 0:
        try:
            srv.serve_forever()
        except RuntimeError as e:
            print(e, flush=True)
            os._exit(3)
        os._exit(0)
    _, st = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(st), flush=True)
    srv.start()                             # the parent that made it serves
    import socket
    with socket.create_connection(srv.address, timeout=10) as c:
        c.sendall(b"x")
        print(c.recv(1).decode(), flush=True)
    srv.shutdown()
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_server_made_before_a_fork_refuses_to_start_in_the_child(run_script, backend):
    p = run_script(MADE_BEFORE_A_FORK, backend)
    assert p.wait(timeout=60) == 0
    lines = p.stdout.read().decode().splitlines()
    assert lines[0].startswith("this Server was made in process ") and "reuse_port" in lines[0]
    assert lines[1:] == ["3", "x"]


HANDS_THE_CONNECTION = textwrap.dedent("""
    import os, subprocess, sys
    from aoprim.server import Handler, Server

    class H(Handler):
        def on_read(self, session, data):
            # a program that answers on the connection itself (inetd, CGI): started with a
            # preexec_fn, which runs the fork hooks in the child before its fds are set
            subprocess.run([sys.executable, "-c", "print('from-program', flush=True)"],
                           stdout=session.socket.fileno(), preexec_fn=os.setpgrp, check=True)
            session.close()

    srv = Server(H(), "127.0.0.1", 0, backend=sys.argv[1], framing="raw")
    print(srv.address[1], flush=True)
    srv.serve_forever()
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_subprocess_handed_the_connection_writes_to_it(run_script, backend):
    p = run_script(HANDS_THE_CONNECTION, backend)
    port = int(p.stdout.readline())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"go")
        assert recv_until_closed(c) == (b"from-program\n", "eof")
