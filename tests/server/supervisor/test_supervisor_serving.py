"""--procs N while serving: what the processes around the service do to it (supervisor.py and
the serve parts of cli.py): systemd's stop, which signals every process at once; a handler's
output without newlines; a process a handler forked; the status pipe kept from handler code;
IPv6 addresses on the ``listening on`` line.
"""
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading

import pytest

from aoprim.server.loop import BACKENDS

from proc_support import child_env
from server_support import HOST, recv_exact, wait_for
from test_supervisor import Lines, alive, children_of, cleanup, echo_once, serve


def _stop_all_at_once(p, kids):
    """systemd's stop (KillMode=control-group): SIGTERM to the supervisor and every child in
    one go."""
    for pid in [p.pid, *kids]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:      # already gone: the supervisor's own stop was faster
            pass


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_to_every_process_at_once_is_a_clean_stop(backend):
    for round_ in range(10):
        p, port = serve("--procs", "3", "--backend", backend)
        kids = []
        try:
            kids = wait_for(lambda: len(children_of(p.pid)) == 3 and children_of(p.pid),
                            what="3 children")
            assert echo_once(port) == b"ping"
            _stop_all_at_once(p, kids)
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, f"round {round_}: {err}"
            assert "Traceback" not in err and "Exception ignored" not in err, err
            assert err.count("aoprim server stopped") == 3, err
            assert not any(alive(k) for k in kids)
        finally:
            cleanup(p, kids)


NO_NEWLINE = """
import sys
from aoprim.server import Handler

class Dots(Handler):
    # progress output without a newline: 1 MiB per request
    def on_read(self, session, data):
        sys.stdout.write("x" * (1 << 20))
        sys.stdout.flush()
        session.send(data)
"""


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def _cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_output_without_newlines_keeps_the_supervisor_small(tmp_path, backend):
    """50 MiB on one line: the supervisor passes it on in pieces instead of keeping (and
    joining again on each read) the whole line."""
    (tmp_path / "dots.py").write_text(NO_NEWLINE)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", "2", "--backend", backend, "--log-level", "ERROR",
                          "dots:Dots"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=str(tmp_path), env=child_env())
    kids = []
    try:
        line = p.stdout.readline().decode()
        assert line.startswith("listening on "), p.stderr.read() if p.poll() else line
        port = int(line.rsplit(":", 1)[1])
        got = [0]

        def count():
            while True:
                chunk = p.stdout.read1(1 << 16)
                if not chunk:
                    return
                got[0] += chunk.count(b"x")
        reader = threading.Thread(target=count, daemon=True)
        reader.start()
        kids = children_of(p.pid)
        rss0, cpu0 = _rss_kib(p.pid), _cpu_s(p.pid)
        for i in range(50):
            assert echo_once(port, b"n%02d" % i) == b"n%02d" % i
        wait_for(lambda: got[0] == 50 << 20, timeout=60, what="50 MiB passed on")
        grew, cpu = _rss_kib(p.pid) - rss0, _cpu_s(p.pid) - cpu0
        assert grew < 16 << 10, f"supervisor RSS grew by {grew} KiB"
        assert cpu < 5.0, f"supervisor used {cpu:.1f} s of CPU"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        reader.join(30)
        assert got[0] == 50 << 20
    finally:
        cleanup(p, kids)


FORKER = """
import os, select, signal
from aoprim.server import Handler

class Forker(Handler):
    # a handler that starts a long-lived process by fork (a multiprocessing worker with the
    # 'fork' start method), then a request that crashes its server process
    def on_read(self, session, data):
        if bytes(data) == b"fork":
            # a pipe of the handler's own, opened after the server started: the forked
            # process keeps it (it tells its pid on it)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                # a group of its own (as a daemonizing worker makes): it is not stopped with
                # its server process's group when that one crashes, and outlives it
                os.setpgid(0, 0)
                os.write(w, b"%d\\n" % os.getpid())
                while True:            # lives until a signal ends it (the test's)
                    signal.pause()
            told = os.read(r, 64) if select.select([r], [], [], 10)[0] else b"lost\\n"
            os.close(r)
            os.close(w)
            session.send(told)
            return
        if bytes(data) == b"crash":
            os._exit(3)
        session.send(data)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_process_forked_by_a_handler_takes_no_connection(tmp_path, backend):
    """The forked process outlives its crashed server process: it must not keep the
    listening socket (the kernel would hand it a share of new connections, never accepted)
    nor ignore SIGTERM."""
    (tmp_path / "forker.py").write_text(FORKER)
    p, port = serve("--procs", "2", "--backend", backend, "forker:Forker", cwd=str(tmp_path))
    kids, grandchild = [], None
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        err = Lines(p.stderr)
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"fork")
            buf = b""
            while not buf.endswith(b"\n"):
                more = s.recv(64)
                assert more
                buf += more
            grandchild = int(buf)
            # (no EOF to wait for: the forked process, as after any fork, holds this
            # connection too)
            s.sendall(b"crash")
            err.wait("(restarted) is listening")
        assert alive(grandchild)
        served = 0
        for i in range(40):
            with socket.create_connection((HOST, port), timeout=10) as s:
                s.sendall(b"c%02d" % i)
                served += recv_exact(s, 3, timeout=5) == b"c%02d" % i
        assert served == 40
        os.kill(grandchild, signal.SIGTERM)      # the default action again: it ends
        wait_for(lambda: not alive(grandchild), timeout=10, what="the forked process to end")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, err.text()
    finally:
        if grandchild is not None and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        cleanup(p, kids)


CLOSE_HELPER = """
import os
from aoprim.server import Handler

class CloseHelper(Handler):
    # on_close hands the session's summary to a forked helper through a pipe of its own
    # and reads the answer through another (as a 'fork' multiprocessing worker's queues
    # do) -- at every close, a stop's too, when the server's fds are closing and their
    # numbers are free for the handler's pipes
    def on_read(self, session, data):
        session.send(data)

    def on_close(self, session, exc):
        task_r, task_w = os.pipe()
        answer_r, answer_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                task = os.read(task_r, 100)
                os.write(answer_w, b"helper got " + (task or b"nothing"))
            finally:
                os._exit(0)
        os.close(task_r)
        os.close(answer_w)
        os.write(task_w, b"the summary")
        os.close(task_w)
        answer = os.read(answer_r, 100)
        os.close(answer_r)
        os.waitpid(pid, 0)
        print(answer.decode(), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["0", "2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_helper_forked_while_a_child_stops_keeps_the_handlers_pipes(tmp_path, backend,
                                                                      workers):
    # what a supervised child hides in a fork is what is still the server's at the fork:
    # a pipe the handler opened on a number the server had freed is the handler's
    (tmp_path / "closehelper.py").write_text(CLOSE_HELPER)
    p, port = serve("--procs", "2", "--backend", backend, "--workers", workers,
                    "closehelper:CloseHelper", cwd=str(tmp_path))
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        assert echo_once(port) == b"ping"                   # a close while serving
        out = Lines(p.stdout)
        out.wait("helper got the summary")
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"open")
            assert recv_exact(s, 4) == b"open"              # open at the stop
            p.send_signal(signal.SIGTERM)
            assert p.wait(60) == 0
        out.join()
        text = out.text()
        assert text.count("helper got the summary") == 2 and "nothing" not in text, text
    finally:
        cleanup(p, kids)


ARGV = """
import os, stat, sys
from aoprim.server import Handler

class Argv(Handler):
    # tells what handler code sees of the status pipe: its flag in sys.argv, pipes among
    # the fds that a process it starts would inherit (besides stdin/stdout/stderr)
    def on_read(self, session, data):
        inheritable_pipes = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                fd = int(name)
                if fd > 2 and stat.S_ISFIFO(os.fstat(fd).st_mode) and os.get_inheritable(fd):
                    inheritable_pipes += 1
            except OSError:
                pass
        session.send(b"%d %d\\n" % ("--status-fd" in " ".join(sys.argv), inheritable_pipes))
"""


@pytest.mark.timeout(120)
def test_handler_code_does_not_see_the_status_pipe(tmp_path):
    (tmp_path / "argvapp.py").write_text(ARGV)
    p, port = serve("--procs", "2", "argvapp:Argv", cwd=str(tmp_path))
    kids = []
    try:
        kids = children_of(p.pid)
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"?")
            assert recv_exact(s, 4) == b"0 0\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        cleanup(p, kids)


def test_stopped_is_written_only_while_the_fd_is_still_the_pipe(tmp_path, monkeypatch):
    """A handler that closed the pipe's fd and opened a file under the number must not get
    the child's last word in its file."""
    from aoprim.server import cli
    monkeypatch.setattr(sys, "argv", ["aoprim", "serve", "--status-fd", "7", "--port", "0"])
    r, w = os.pipe()
    pipe = cli._StatusPipe(w)
    try:
        assert sys.argv == ["aoprim", "serve", "--port", "0"]
        assert pipe.tell(b"ready")
        assert os.read(r, 64) == b"ready\n"
        with open(tmp_path / "users.txt", "wb") as f:
            os.dup2(f.fileno(), pipe.fd)            # the handler's file takes the number
            assert not pipe.tell(b"stopped")
        assert (tmp_path / "users.txt").read_bytes() == b""
    finally:
        os.close(pipe.fd)
        os.close(r)


def _has_ipv6_loopback():
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
@pytest.mark.parametrize("procs", ["1", "2"])
def test_the_listening_line_brackets_an_ipv6_address(procs):
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", "::1", "--port",
                          "0", "--procs", procs], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on [::1]:"), line
        port = int(line.rsplit(":", 1)[1])
        with socket.create_connection(("::1", port), timeout=10) as s:
            s.sendall(b"v6")
            assert recv_exact(s, 2) == b"v6"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        cleanup(p)


CRASH_AT_STOP = """
import os
from aoprim.server import Handler

class CrashAtStop(Handler):
    # on_close of a session open at the stop crashes the process (os._exit: as a segfault
    # or an OOM kill would end it)
    def on_read(self, session, data):
        session.send(data)

    def on_close(self, session, exc):
        os._exit(3)
"""


@pytest.mark.timeout(120)
def test_a_child_that_crashes_during_the_stop_is_named_in_the_log(tmp_path):
    (tmp_path / "crashatstop.py").write_text(CRASH_AT_STOP)
    p, port = serve("--procs", "2", "crashatstop:CrashAtStop", cwd=str(tmp_path))
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        err = Lines(p.stderr)
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"open")
            assert recv_exact(s, 4) == b"open"          # open at the stop
            p.send_signal(signal.SIGTERM)
            assert p.wait(60) == 1                      # not a clean stop ...
        err.join()
        # ... and the log says which process and how
        assert re.search(r"server process (\d+) exited with status 3 while stopping",
                         err.text()), err.text()
    finally:
        cleanup(p, kids)


def test_children_ignore_sigttou_so_a_tostop_terminal_cannot_stop_them(tmp_path):
    # in process groups of their own, the children are a background group of the
    # supervisor's terminal: under `stty tostop` a write to it (a log line on stderr) would
    # stop them with SIGTTOU; ignored, the write proceeds
    p, port = serve("--procs", "2")
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        for pid in kids:
            with open(f"/proc/{pid}/status") as f:
                ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1],
                              16)
            assert ignored & (1 << (signal.SIGTTOU - 1)), f"server process {pid}"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        cleanup(p, kids)


def test_more_procs_than_the_supervisor_can_start_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--port", "0", "--procs",
                        "1000"], capture_output=True, text=True, timeout=60,
                       env=child_env(), preexec_fn=lambda: resource.setrlimit(
                           resource.RLIMIT_NOFILE, (256, resource.getrlimit(
                               resource.RLIMIT_NOFILE)[1])))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("aoprim: --procs 1000 is more than this supervisor can start: "
                                "at most 112 (RLIMIT_NOFILE 256: two pipes a process)")


HALF_LINES = """
import os, sys
from aoprim.server import Handler

class HalfLines(Handler):
    # "part": 30 KB of a line, no newline yet; "rest": its end; "short": a short line (not
    # in the middle of this process's own long line).  Every reply is the process's pid,
    # once what it printed is flushed.
    partial = False

    def on_read(self, session, data):
        what = bytes(data)
        if what == b"part":
            sys.stdout.write("a" * 30_000)
            HalfLines.partial = True
        elif what == b"rest":
            sys.stdout.write("a" * 30_000 + "\\n")
        elif what == b"short" and not HalfLines.partial:
            sys.stdout.write("short line\\n")
        sys.stdout.flush()
        session.send(b"%d" % os.getpid())
"""


@pytest.mark.timeout(120)
def test_a_line_up_to_64_kib_comes_out_whole_while_another_child_prints(tmp_path):
    (tmp_path / "halflines.py").write_text(HALF_LINES)
    p, port = serve("--procs", "2", "halflines:HalfLines", cwd=str(tmp_path))
    kids, others = [], []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        out = Lines(p.stdout)
        a = socket.create_connection((HOST, port), timeout=10)
        others.append(a)
        a.sendall(b"part")
        pid_a = a.recv(16)
        while True:                     # a connection served by the other process
            b = socket.create_connection((HOST, port), timeout=10)
            others.append(b)
            b.sendall(b"short")
            if b.recv(16) != pid_a:
                break
        out.wait("short line")          # the other's line is out, the long one half-written
        a.sendall(b"rest")
        assert a.recv(16) == pid_a
        out.wait("a" * 60_000)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        out.join()
        lines = out.text().splitlines()
        assert "a" * 60_000 in lines, [len(line) for line in lines]
    finally:
        for c in others:
            c.close()
        cleanup(p, kids)
