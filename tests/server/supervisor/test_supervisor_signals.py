"""--procs N: the supervisor's end by any signal, and its children's output passed on as
bytes (aoprim/server/supervisor.py, docs/server.md "--procs N").

- SIGHUP (a hang-up of its terminal, ``kill -HUP``) and SIGQUIT stop the service as SIGTERM
  does: the children and what their handlers started stop, and the supervisor exits 0.
- A child takes SIGHUP and SIGQUIT as SIGTERM: sent to every process of the service
  (``pkill -HUP -f 'aoprim serve'``, systemd's ``SendSIGHUP=yes``) the service stops
  cleanly, each child with its stats line and its replies in flight sent, and the
  supervisor exits 0; sent to one child alone, that child stops cleanly and is replaced,
  as after a SIGTERM of its own -- not counted as a crash.
- A supervisor killed with SIGKILL takes its children with it (``PR_SET_PDEATHSIG``), and
  each child stops its own process group before it exits: what a handler started does not
  outlive the service, also when it ignores SIGTERM (then it is killed after
  ``--stop-timeout``).
- What a child writes on its stdout reaches the supervisor's stdout byte for byte, as with
  ``--procs 1``: never decoded and encoded again.
"""
import os
import signal
import socket
import subprocess
import sys

import pytest

from proc_support import child_env
from server_support import HOST, recv_exact, wait_for
from test_supervisor import Lines, _stat, alive, children_of, cleanup, echo_once

SPAWNER = """
import subprocess
from aoprim.server import Handler

class Spawner(Handler):
    # each connection starts a process that would run for 5 minutes and says its pid
    def on_connect(self, session):
        # (its "ready" once its signal dispositions are set: a stop signal sent before
        # would find a helper that does not ignore it yet)
        p = subprocess.Popen(COMMAND, stdout=subprocess.PIPE)
        p.stdout.readline()
        print("spawned", p.pid, flush=True)

    def on_read(self, session, data):
        session.send(data)
"""

SLEEPS = ["sh", "-c", "echo ready; exec sleep 300"]
IGNORES_TERM = ["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"]   # (exec keeps the ignore)

BYTES = """
import sys
from aoprim.server import Handler

class Bytes(Handler):
    # a line in the process's own encoding, then bytes that are no UTF-8 at all
    def on_connect(self, session):
        print("caf\\u00e9", flush=True)
        sys.stdout.buffer.write(b"raw:\\xff\\xfe\\x80\\n")
        sys.stdout.flush()
        session.send(b"done")

    def on_read(self, session, data):
        session.send(data)
"""


def _default_stop_signals():
    # the supervisor keeps a stop signal its parent ignored (nohup: SIGHUP) ignored; these
    # tests mean the default disposition, whatever the test run inherited
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def start(tmp_path, source, spec, *extra, **env):
    (tmp_path / (spec.split(":")[0] + ".py")).write_text(source)
    return subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                             "--port", "0", "--procs", "2", "--log-level", "WARNING",
                             *extra, spec], stdout=subprocess.PIPE,
                            cwd=str(tmp_path), env=child_env(**env),
                            preexec_fn=_default_stop_signals)


def spawned_pid(tmp_path, command, *extra):
    """A supervisor whose handler started a process: (supervisor, that process's pid)."""
    p = start(tmp_path, SPAWNER.replace("COMMAND", repr(command)), "spawner:Spawner", *extra)
    line = p.stdout.readline()
    assert line.startswith(b"listening on "), line
    port = int(line.rsplit(b":", 1)[1])
    with socket.create_connection((HOST, port), timeout=30):
        said = p.stdout.readline()
    assert said.startswith(b"spawned "), said
    return p, int(said.split()[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGHUP", "SIGQUIT"])
def test_a_hang_up_or_quit_stops_the_service_with_what_handlers_started(tmp_path, sig):
    """The supervisor had no handler for either: it died of the signal's default action
    without stopping its children, and a handler's subprocess lived on (ppid 1)."""
    p, pid = spawned_pid(tmp_path, SLEEPS)
    try:
        assert alive(pid)
        p.send_signal(getattr(signal, sig))
        assert p.wait(60) == 0                  # a stop, as SIGTERM's
        wait_for(lambda: not alive(pid), timeout=30, what=f"process {pid} gone")
    finally:
        cleanup(p, [pid])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [SLEEPS, IGNORES_TERM], ids=["stops", "ignores-term"])
def test_what_handlers_started_dies_with_a_killed_supervisor(tmp_path, command):
    """The children died of their death signal but left their process group running."""
    p, pid = spawned_pid(tmp_path, command, "--stop-timeout", "2")
    try:
        assert alive(pid)
        p.kill()
        p.wait(30)
        # a child stops on its death signal; what it started gets SIGTERM with it, and
        # SIGKILL at --stop-timeout if still there
        wait_for(lambda: not alive(pid), timeout=30, what=f"process {pid} gone")
    finally:
        cleanup(p, [pid])


SLOW_IMPORT = """
import subprocess, time
from aoprim.server import Handler

p = subprocess.Popen(["sleep", "300"])      # a helper started at import
print("spawned", p.pid, flush=True)
time.sleep(300)                             # a module that loads for minutes

class Slow(Handler):
    def on_read(self, session, data):
        session.send(data)
"""


@pytest.mark.timeout(120)
def test_what_an_import_started_dies_with_a_supervisor_killed_during_the_start(tmp_path):
    """The child is stopped while its handler's module loads: its group goes with it."""
    p = start(tmp_path, SLOW_IMPORT, "slow:Slow")
    pids = []
    try:
        for _ in range(2):                      # each child's import says its helper
            said = p.stdout.readline()
            assert said.startswith(b"spawned "), said
            pids.append(int(said.split()[1]))
        assert all(alive(pid) for pid in pids)
        p.kill()
        p.wait(30)
        wait_for(lambda: not any(alive(pid) for pid in pids), timeout=30,
                 what=f"processes {pids} gone")
    finally:
        cleanup(p, pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_the_children_s_stdout_bytes_are_passed_on_as_written(tmp_path, encoding):
    """The supervisor decoded each child's stdout as UTF-8 (errors replaced) and encoded it
    again: bytes that were not UTF-8 came out as U+FFFD."""
    p = start(tmp_path, BYTES, "bytes:Bytes", PYTHONIOENCODING=encoding)
    try:
        line = p.stdout.readline()
        assert line.startswith(b"listening on "), line
        port = int(line.rsplit(b":", 1)[1])
        with socket.create_connection((HOST, port), timeout=30) as s:
            assert s.recv(4) == b"done"
        assert p.stdout.readline() == "caf\u00e9\n".encode(encoding)
        assert p.stdout.readline() == b"raw:\xff\xfe\x80\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        cleanup(p)


def _state(pid):
    """The process's state letter (T: stopped), or None once it is gone."""
    st = _stat(pid)
    return st and st[0]


def _tstp_default():
    _default_stop_signals()
    signal.signal(signal.SIGTSTP, signal.SIG_DFL)


@pytest.mark.timeout(120)
def test_ctrl_z_stops_and_continues_the_whole_service(tmp_path):
    """SIGTSTP (Ctrl-Z) stops the supervisor, every server process and what a handler
    started, as a shell stops a job; SIGCONT (``fg``/``bg``) continues them all, and the
    service serves again.  Each child leads a process group of its own, which the
    terminal's SIGTSTP does not reach: they served on while the supervisor was stopped."""
    (tmp_path / "spawner.py").write_text(SPAWNER.replace("COMMAND", repr(SLEEPS)))
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                          "--port", "0", "--procs", "2", "--log-level", "WARNING",
                          "spawner:Spawner"], stdout=subprocess.PIPE, cwd=str(tmp_path),
                         env=child_env(), preexec_fn=_tstp_default)
    helper = None
    try:
        line = p.stdout.readline()
        assert line.startswith(b"listening on "), line
        port = int(line.rsplit(b":", 1)[1])
        with socket.create_connection((HOST, port), timeout=30):
            helper = int(p.stdout.readline().split()[1])
        kids = children_of(p.pid)
        assert len(kids) == 2
        everyone = [p.pid, *kids, helper]
        p.send_signal(signal.SIGTSTP)
        wait_for(lambda: all(_state(pid) == "T" for pid in everyone), timeout=30,
                 what="the supervisor, its children and the helper stopped")
        p.send_signal(signal.SIGCONT)
        wait_for(lambda: not any(_state(pid) == "T" for pid in everyone), timeout=30,
                 what="all of them continued")
        for _ in range(4):                      # both children serve again
            with socket.create_connection((HOST, port), timeout=30) as c:
                c.sendall(b"ping")
                assert c.recv(4) == b"ping"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        cleanup(p, [helper] if helper else [])


# -- a child's own SIGHUP or SIGQUIT --------------------------------------------------------

IN_FLIGHT = """
import logging, os, select
from aoprim.server import Handler

told_r, told_w = os.pipe()

class _Told(logging.Handler):
    # the server logs "received SIGxxx: shutting down" from its stop signal's handler, which
    # may have interrupted on_read's wait below: a byte on a pipe, no lock taken (an
    # Event's set() would wait for the lock its wait() holds, on the same thread)
    def emit(self, record):
        if record.getMessage().startswith("received "):
            os.write(told_w, b"!")

logging.getLogger("aoprim.server").addHandler(_Told())

class InFlight(Handler):
    # b"slow" says "busy PID" and is answered only once this process was told to stop:
    # the reply is in flight when the stop begins; anything else is echoed
    def on_read(self, session, data):
        if bytes(data) == b"slow":
            print("busy", os.getpid(), flush=True)
            told = select.select([told_r], [], [], 60)[0]
            session.send(b"done" if told else b"late")
        else:
            session.send(data)
"""


def _serve_in_flight(tmp_path):
    """A --procs 2 service of IN_FLIGHT (stats JSON lines, INFO log): (process, port, its
    children, its stderr's Lines)."""
    (tmp_path / "inflight.py").write_text(IN_FLIGHT)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", "2", "--log-level", "INFO", "--stats-json",
                          "inflight:InFlight"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=str(tmp_path), env=child_env(),
                         preexec_fn=_default_stop_signals)
    err = Lines(p.stderr)
    line = p.stdout.readline()
    assert line.startswith("listening on "), (line, err.text())
    kids = children_of(p.pid)
    assert len(kids) == 2, kids
    return p, int(line.rsplit(":", 1)[1]), kids, err


def _reply(s, err):
    """The reply to b"slow" on ``s`` (4 bytes), or a failure that shows the service's log."""
    try:
        return recv_exact(s, 4, timeout=30)
    except OSError as e:
        pytest.fail(f"no reply ({e!r}):\n{err.text()}")


def _slow_request(s, p):
    """Put b"slow" in flight on connection ``s``: the pid of the child that holds it."""
    s.sendall(b"slow")
    said = p.stdout.readline()
    assert said.startswith("busy "), said
    return int(said.split()[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_a_stop_signal_to_every_process_of_the_service_is_a_clean_stop(tmp_path, sig):
    """`pkill -HUP -f 'aoprim serve'`, systemd's SendSIGHUP=yes: the children died of the
    SIGHUP's default action (SIGQUIT's: a core file) -- no stats line, the reply in flight
    lost -- and the supervisor counted each as a crash during its stop and exited 1."""
    p, port, kids, err = _serve_in_flight(tmp_path)
    try:
        with socket.create_connection((HOST, port), timeout=30) as s:
            holder = _slow_request(s, p)
            assert holder in kids
            for pid in (p.pid, *kids):          # pkill's order: the supervisor first
                os.kill(pid, getattr(signal, sig))
            assert _reply(s, err) == b"done", err.text()
        out = p.stdout.read()
        assert p.wait(60) == 0, err.text()
        err.join()
        assert out.count("stats {") == 2, out   # each child's clean stop
        text = err.text()
        assert f"received {sig}: stopping 2 server processes" in text, text
        for bad in ("Traceback", "while stopping", "restarting", "replacing", "did not stop"):
            assert bad not in text, text
        assert children_of(p.pid) == []
    finally:
        cleanup(p, kids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_a_stop_signal_to_one_child_stops_it_cleanly_and_it_is_replaced(tmp_path, sig):
    """`kill -HUP CHILD`: the child died of the default action (no stats line, the reply in
    flight lost) and the supervisor restarted it as a crash after a back-off, where a
    SIGTERM to one child is a clean stop, replaced at once and not counted as a crash."""
    p, port, kids, err = _serve_in_flight(tmp_path)
    try:
        with socket.create_connection((HOST, port), timeout=30) as s:
            holder = _slow_request(s, p)
            os.kill(holder, getattr(signal, sig))
            assert _reply(s, err) == b"done", err.text()
        line = p.stdout.readline()              # its stats line: it stopped cleanly
        assert line.startswith("stats {"), (line, err.text())
        err.wait("(restarted) is listening", timeout=30)
        now = children_of(p.pid)
        assert len(now) == 2 and holder not in now, (holder, now)
        for i in range(4):
            assert echo_once(port, b"ok%d" % i) == b"ok%d" % i
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        out = p.stdout.read()
        assert p.wait(60) == 0, err.text()
        err.join()
        assert out.count("stats {") == 2, out   # the two at the end
        text = err.text()
        assert f"server process {holder} stopped (status 0) without the supervisor asking: " \
            "replacing it" in text, text
        assert text.count("without the supervisor asking: replacing it") == 1, text
        for bad in ("Traceback", "restarting", "crash", "while stopping", "did not stop"):
            assert bad not in text, text
    finally:
        cleanup(p, kids)
