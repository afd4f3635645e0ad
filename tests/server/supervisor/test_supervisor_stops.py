"""--procs N: the supervisor's processes and signals at their edges (aoprim/server/supervisor.py,
docs/server.md "--procs N", *Signals*).

- As a container's PID 1 or a subreaper, the supervisor reaps every process re-parented to it
  (the orphans of its children's handlers: ``cmd &``, a double fork), not only its children.
- What a child started is stopped when that child exits on its own (a crash, an operator's
  ``kill PID``): SIGTERM, then SIGKILL after ``--stop-timeout``; so it does not outlive a
  supervisor that is killed later.
- A SIGHUP or SIGQUIT ignored when the supervisor starts (``nohup``) stays ignored.
- During a stop, a repeated SIGTERM or SIGHUP changes nothing (``timeout`` sends SIGTERM twice);
  a second SIGINT (Ctrl-C twice) or a SIGQUIT kills the children at once.
- The supervisor's own log line brackets an IPv6 address, as its stdout does.
- A stop held by a handler's non-daemon thread ends with a line that names the thread, from
  the child itself under --procs (the supervisor kills 1 s after --stop-timeout).
- A relative --app-dir in a working directory that was deleted is one line and exit 2.
"""
import io
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from aoprim.server.supervisor import _SAME_CTRL_C, Supervisor

from proc_support import child_env
from server_support import HOST, wait_for
from test_supervisor import Lines, alive, children_of, cleanup, echo_once, serve
from test_supervisor_serving import _has_ipv6_loopback


def _stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    head, rest = data.rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], fields[0], int(fields[1])     # comm, state, ppid


def zombies_of(pid, comm):
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(d)
            if st is not None and st[0] == comm and st[1] == "Z" and st[2] == pid:
                found.append(int(d))
    return found


def processes_named(comm, ppid=None):
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(d)
            if st is not None and st[0] == comm and st[1] not in ("Z", "X") and \
                    (ppid is None or st[2] == ppid):
                found.append(int(d))
    return found


def start(tmp_path, source, spec, *extra, prefix=(), **popen):
    (tmp_path / (spec.split(":")[0] + ".py")).write_text(source)
    p = subprocess.Popen([*prefix, sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                          "--port", "0", "--procs", "2", "--log-level", "INFO", *extra,
                          spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), env=child_env(), **popen)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        cleanup(p)
        raise AssertionError(f"did not start: {line!r}")
    return p, int(line.rsplit(":", 1)[1])


# -- orphans re-parented to the supervisor -----------------------------------------------------

ORPHANS = """
import subprocess
from aoprim.server import Handler

class Orphans(Handler):
    # each frame starts a short process the way a shell script's `cmd &` does: the shell
    # exits at once, and its child is re-parented (to the subreaper, or PID 1)
    def on_read(self, session, data):
        subprocess.run(["sh", "-c", "sleep 0.05 &"])
        session.send(data)
"""

# the supervisor as a subreaper (PR_SET_CHILD_SUBREAPER survives exec): what a container's
# PID 1 is sent, without a PID namespace
SUBREAPER = ["-c", "import ctypes, os, sys; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
             "os.execv(sys.argv[1], sys.argv[1:])"]


def _unshare_pid():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    if subprocess.run(["unshare", "-fp", "--mount-proc", "true"],
                      capture_output=True).returncode != 0:
        return None
    return ["unshare", "-fp", "--mount-proc"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["subreaper", "pid1"])
def test_orphans_re_parented_to_the_supervisor_are_reaped(tmp_path, how):
    """They were reaped only once the child whose handler made them exited: while it
    served they stayed zombies, one per request, without bound."""
    if how == "subreaper":
        if not sys.platform.startswith("linux"):
            pytest.skip("PR_SET_CHILD_SUBREAPER is Linux's")
        prefix = [sys.executable, *SUBREAPER]
    else:
        prefix = _unshare_pid()
        if prefix is None:
            pytest.skip("needs root and unshare(1) for a PID namespace")
    p, port = start(tmp_path, ORPHANS, "orphans:Orphans", prefix=prefix,
                    start_new_session=True)
    err = Lines(p.stderr)
    try:
        # the supervisor: the process (or, in a PID namespace, the one unshare forked)
        # that the sleeps are re-parented to
        sup = p.pid if how == "subreaper" else wait_for(
            lambda: (processes_named("python3", p.pid) + processes_named(
                os.path.basename(sys.executable)[:15], p.pid) or [None])[0],
            what="the supervisor")
        for i in range(20):
            assert echo_once(port, b"x%d" % i) == b"x%d" % i
        # every sleep (0.05 s) ends; none may stay a zombie of the supervisor
        wait_for(lambda: not processes_named("sleep", sup) and not zombies_of(sup, "sleep"),
                 timeout=20, what="no sleep left with the supervisor, not even a zombie")
        assert p.poll() is None
        os.killpg(p.pid, signal.SIGTERM) if how == "pid1" else p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, err.text()
        err.join()
        assert "Traceback" not in err.text()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        cleanup(p)


# -- what a crashed child started ---------------------------------------------------------------

CRASHER = """
import os, subprocess
from aoprim.server import Handler

class Crasher(Handler):
    # a frame starts a long helper (in the child's process group, as any subprocess) and
    # then crashes the server process
    def on_read(self, session, data):
        # (its "ready" once its signal dispositions are set: a stop signal sent before
        # would find a helper that does not ignore it yet)
        p = subprocess.Popen(COMMAND, stdout=subprocess.PIPE)
        p.stdout.readline()
        print("spawned", p.pid, flush=True)
        os._exit(3)
"""

SLEEPS = ["sh", "-c", "echo ready; exec sleep 300"]
IGNORES_TERM = ["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"]


def _crash(tmp_path, command, *extra):
    p, port = start(tmp_path, CRASHER.replace("COMMAND", repr(command)), "crasher:Crasher",
                    *extra)
    err = Lines(p.stderr)
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(b"x")
        said = p.stdout.readline()
    assert said.startswith("spawned "), said
    return p, port, err, int(said.split()[1])


@pytest.mark.timeout(120)
def test_what_a_crashed_child_started_does_not_outlive_a_killed_supervisor(tmp_path):
    """It went on after the crash, to be stopped with the service: a supervisor killed
    with SIGKILL (an OOM kill, `docker kill`) left it running for good."""
    p, port, err, pid = _crash(tmp_path, SLEEPS)
    try:
        err.wait("(restarted) is listening")
        p.kill()
        p.wait(30)
        wait_for(lambda: not alive(pid), timeout=20, what=f"process {pid} gone")
    finally:
        cleanup(p, [pid])


@pytest.mark.timeout(120)
def test_what_a_crashed_child_started_is_killed_after_stop_timeout_if_it_stays(tmp_path):
    """A helper that ignores SIGTERM: killed --stop-timeout after the crash, while the
    service serves on."""
    p, port, err, pid = _crash(tmp_path, IGNORES_TERM, "--stop-timeout", "1")
    try:
        err.wait("(restarted) is listening")
        wait_for(lambda: not alive(pid), timeout=20, what=f"process {pid} gone")
        assert p.poll() is None
        # (logged before the kill; the reader thread may not have taken the line yet)
        err.wait("did not stop: killing them", timeout=20)
        assert re.search(r"processes started by server process \d+ did not stop: killing "
                         r"them", err.text()), err.text()
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, err.text()
    finally:
        cleanup(p, [pid])


# -- signals ignored at the start -------------------------------------------------------------

def _ignore(*sigs):
    def pre():
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
    return pre


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGHUP", "SIGQUIT"])
def test_a_signal_ignored_at_the_start_stays_ignored(tmp_path, sig):
    """`nohup serve --procs 2`: the supervisor put its own handler over the inherited
    SIG_IGN, and the terminal's hang-up stopped the whole service.  The children inherit
    the ignore and keep it too (`pkill -HUP` reaches them as well)."""
    p, port = start(tmp_path, "from aoprim.server.apps import Echo\n", "ignored:Echo",
                    preexec_fn=_ignore(signal.SIGHUP, signal.SIGQUIT))
    err = Lines(p.stderr)
    try:
        kids = children_of(p.pid)
        assert len(kids) == 2, kids
        for pid in (p.pid, *kids):
            os.kill(pid, getattr(signal, sig))
        for i in range(6):                      # it serves on: the signal was ignored
            assert echo_once(port, b"hup%d" % i) == b"hup%d" % i
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, err.text()
        err.join()
        assert f"received {sig}" not in err.text(), err.text()
        assert "received SIGTERM: stopping 2 server processes" in err.text()
    finally:
        cleanup(p)


# -- a second stop signal ----------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import os, signal, sys, time

    port, status = sys.argv[1], int(sys.argv[2])

    def bye(signum, frame):
        time.sleep(0.5)                    # a clean stop that takes a moment
        print("bye", os.getpid(), flush=True)
        os.write(status, b"stopped\\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, bye)
    os.write(status, b"ready\\n")
    while True:
        time.sleep(60)
""")


def _twice(sup, first, second, then=lambda: True, gap=0.0):
    """Once both children serve: ``first``, then ``second`` a few ms later (as `timeout`
    sends SIGTERM to the command and then to its group), or once ``then()`` holds (a
    signal sent again before the first was handled is one: the kernel merges them) and
    ``gap`` seconds have passed (a person's second Ctrl-C)."""
    done = threading.Event()
    done.sent = []              # the signals sent, in order

    def run():
        while not done.wait(0.01):
            if len(sup.spawned) == 2 and all(c.ready for c in sup._children):
                os.kill(os.getpid(), first)
                done.sent.append(first)
                sent = time.monotonic()
                done.wait(0.003)
                while not then() or time.monotonic() - sent < gap:
                    if done.wait(0.01):
                        return
                os.kill(os.getpid(), second)
                done.sent.append(second)
                return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return done, t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGHUP])
def test_a_repeated_sigterm_during_a_stop_changes_nothing(tmp_path, caplog, second):
    """The second SIGTERM killed the children a few ms into their clean stop ("did not
    stop: killing it", exit 1)."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = io.StringIO()
    sup = Supervisor(lambda port, fd: [sys.executable, str(script), str(port), str(fd)], 2,
                     HOST, 0, stdout=out, stop_timeout=20)
    done, t = _twice(sup, signal.SIGTERM, second)
    try:
        assert sup.run() == 0, caplog.text
        assert "did not stop" not in caplog.text
        assert sorted(int(x) for x in re.findall(r"bye (\d+)", out.getvalue())) == \
            sorted(pid for _, _, pid in sup.spawned)
    finally:
        done.set()
        t.join(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT),
                                           (signal.SIGTERM, signal.SIGINT),
                                           (signal.SIGTERM, signal.SIGQUIT)],
                         ids=["int-int", "term-int", "term-quit"])
def test_a_second_sigint_or_a_sigquit_during_a_stop_kills_at_once(tmp_path, caplog, first,
                                                                  second):
    caplog.set_level(logging.INFO, logger="aoprim.server")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = io.StringIO()
    # the supervisor keeps a SIGQUIT its process inherited ignored (a shell's background
    # job, nohup) ignored: this test means the default disposition, whatever the run had
    old_quit = signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    sup = Supervisor(lambda port, fd: [sys.executable, str(script), str(port), str(fd)], 2,
                     HOST, 0, stdout=out, stop_timeout=20)
    # (a second SIGINT within _SAME_CTRL_C of the first is that Ctrl-C relayed: see below)
    done, t = _twice(sup, first, second, lambda: "stopping 2 server processes" in caplog.text,
                     gap=2 * _SAME_CTRL_C)
    try:
        assert sup.run() == 1, caplog.text
        assert caplog.text.count("did not stop: killing it") == 2, caplog.text
        assert not any(alive(pid) for _, _, pid in sup.spawned)
    finally:
        done.set()
        t.join(10)
        signal.signal(signal.SIGQUIT, old_quit)


@pytest.mark.timeout(60)
def test_one_ctrl_c_relayed_by_a_wrapper_is_one_clean_stop(tmp_path, caplog):
    """One Ctrl-C at a terminal under `timeout` (or any wrapper that relays SIGINT): the
    terminal's SIGINT and the wrapper's reach the supervisor milliseconds apart -- one
    Ctrl-C, a clean stop (it was taken for Ctrl-C twice: every child killed, exit 1)."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = io.StringIO()
    sup = Supervisor(lambda port, fd: [sys.executable, str(script), str(port), str(fd)], 2,
                     HOST, 0, stdout=out, stop_timeout=20)
    done, t = _twice(sup, signal.SIGINT, signal.SIGINT,
                     lambda: "stopping 2 server processes" in caplog.text)
    try:
        assert sup.run() == 0, caplog.text
        t.join(10)
        assert done.sent == [signal.SIGINT, signal.SIGINT]
        assert "did not stop" not in caplog.text and "killing" not in caplog.text
        assert sorted(int(x) for x in re.findall(r"bye (\d+)", out.getvalue())) == \
            sorted(pid for _, _, pid in sup.spawned)
    finally:
        done.set()
        t.join(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_stopped_child_is_continued_at_the_stop(sig):
    """A child stopped by SIGSTOP (a debugger, `kill -STOP`, job control) when the service is
    told to stop gets SIGCONT right after its stop signal, as systemd sends it: it acts on
    the signal, stops cleanly and the supervisor exits 0 -- instead of waiting
    --stop-timeout, killing it and exiting 1."""
    p, port = serve("--procs", "2", "--stop-timeout", "5", "--stats-json")
    kids = []
    try:
        kids = children_of(p.pid)
        assert len(kids) == 2, kids
        assert echo_once(port) == b"ping"
        os.kill(kids[0], signal.SIGSTOP)
        wait_for(lambda: (_stat(kids[0]) or ("", "T"))[1] in ("T", "t"), timeout=30,
                 what="the child stopped")
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert "did not stop" not in err, err
        assert "while stopping" not in err, err
        assert out.count("stats {") == 2, out      # a clean stop each, the stopped one too
        assert not any(alive(pid) for pid in kids)
    finally:
        cleanup(p, kids)


# -- IPv6 in the log -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_the_supervisors_log_line_brackets_an_ipv6_address():
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", "::1", "--port",
                          "0", "--procs", "2", "--log-level", "INFO"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env())
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on [::1]:"), line
        port = line.rsplit(":", 1)[1].strip()
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1]
        assert p.returncode == 0, err
        assert f"supervising 2 server processes on [::1]:{port}\n" in err, err
    finally:
        cleanup(p)


# -- what holds a stop --------------------------------------------------------------------------

THREADER = """
import threading, time
from aoprim.server import Handler

class Threader(Handler):
    # each connection starts a background poller that never ends, not a daemon
    def on_connect(self, session):
        threading.Thread(target=lambda: time.sleep(10**6), name="user-poller").start()

    def on_read(self, session, data):
        session.send(data)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("procs", ["1", "2"])
def test_a_stop_held_by_a_handlers_thread_names_it(tmp_path, procs):
    """The message blamed a blocked handler or a stdout nobody reads (neither) and named no
    thread; under --procs the supervisor killed the child at the same instant, and only
    "did not stop: killing it" showed."""
    (tmp_path / "threader.py").write_text(THREADER)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", procs, "--stop-timeout", "2", "threader:Threader"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), env=child_env(), start_new_session=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on "), line
        port = int(line.rsplit(":", 1)[1])
        assert echo_once(port, b"t") == b"t"
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1]
        assert p.returncode == 1, err
        assert re.search(r"did not stop within 2 s of SIGTERM \(non-daemon threads still "
                         r"run, .*'user-poller'", err), err
        assert "did not stop: killing it" not in err, err
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        cleanup(p)


# -- a working directory that was deleted --------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("procs", ["1", "2"])
def test_a_deleted_working_directory_is_one_line_and_exit_2(tmp_path, procs):
    """`serve MODULE:ATTR` (--app-dir .) from a directory a deploy pruned: a
    FileNotFoundError traceback and exit 1."""
    d = tmp_path / "release"
    d.mkdir()
    (d / "echo_h.py").write_text("from aoprim.server.apps import Echo\n")
    start = ("import os, shutil, sys; os.chdir(sys.argv[1]); shutil.rmtree(sys.argv[1]); "
             "os.execv(sys.executable, [sys.executable] + sys.argv[2:])")
    r = subprocess.run([sys.executable, "-c", start, str(d), "-m", "aoprim", "serve",
                        "--host", HOST, "--port", "0", "--procs", procs, "echo_h:Echo"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "aoprim: --app-dir '.' is relative to the working directory, which is gone" \
        in r.stderr, r.stderr
