"""--procs N and serve, at their edges: a stdout nobody reads, restarts that fail while the
service serves, a child's output held open by a process it started, the supervisor's
timeouts on the command line, and a handler module whose import raises a BaseException
(supervisor.py, cli.py; docs/server.md, **`--procs N`**).
"""
import fcntl
import io
import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import termios
import textwrap
import threading
import time

import pytest

from aoprim.server import supervisor as supervisor_module
from aoprim.server.supervisor import Supervisor

from proc_support import child_env
from server_support import HOST, recv_exact, wait_for
from test_supervisor import (Lines, SignalWhen, alive, children_of, cleanup, echo_once,
                             run_supervisor)

CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time

    mode, port, status = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def bye(signum, frame):
        print("bye", os.getpid(), flush=True)
        os.write(status, b"stopped\\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, bye)
    if mode == "fail2":                    # its handler cannot be loaded (mid-deploy)
        sys.exit(2)
    if mode == "chatty":                   # 2 MB of output before it says "ready"
        for i in range(2000):
            print("%04d " % i + "x" * 995, flush=True)
    if mode in ("helper", "helper-crash"):
        # a process it starts (a sidecar, a cache warmer) inherits its stdout and keeps it
        # open after the child exits
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("child", mode, "up", flush=True)
    os.write(status, b"ready\\n")
    if mode in ("crash", "helper-crash"):
        time.sleep(0.1)
        sys.exit(3)
    time.sleep(60)
""")


@pytest.fixture
def child_script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def argv_of(script, *modes):
    """child_argv: the n-th child started runs modes[n] (the last repeats); mode "missing"
    names a program that does not exist (the spawn itself fails)."""
    calls = []

    def child_argv(port, status_fd):
        mode = modes[min(len(calls), len(modes) - 1)]
        calls.append(mode)
        if mode == "missing":
            return [os.path.join(os.path.dirname(script), "no-such-program"), str(port)]
        return [sys.executable, script, mode, str(port), str(status_fd)]
    return child_argv


def unread(fd):
    """Bytes waiting in a pipe."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)


def close_pipe(r, out):
    """The read end first: closing ``out`` then never blocks on a full pipe (it fails)."""
    os.close(r)
    try:
        out.close()
    except OSError:
        pass


# -- a stdout nobody reads ----------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_stdout_nobody_reads_never_blocks_the_supervisor(child_script, caplog):
    """A full stdout pipe whose reader stalled (not closed): the supervisor blocked in its
    write, its children blocked printing into it, and SIGTERM was never handled."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    sup = Supervisor(argv_of(child_script, "chatty"), 2, HOST, 0, stdout=out,
                     stop_timeout=10)
    drained = []
    done = threading.Event()

    def unblock():
        # the safety net of this test only: if the supervisor still runs 40 s on, read the
        # pipe so that it can end (and the test fails below)
        if done.wait(40):
            return
        while unread(r) or not done.is_set():
            if unread(r):
                drained.append(os.read(r, 65536))
            else:
                done.wait(0.05)
    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    try:
        # SIGTERM once the pipe is full and both children printed all and said "ready"
        rc = run_supervisor(sup, lambda: unread(r) >= 60000 and len(sup.spawned) == 2 and
                            all(c.ready for c in sup._children))
        done.set()
        t.join(10)
        assert not drained, "the supervisor stopped only once the test read its stdout"
        assert rc == 0, caplog.text
        assert caplog.text.count("stdout is not being read") == 1       # said once
        m = re.search(r"(\d+) lines of the server processes' output were dropped",
                      caplog.text)
        assert m and int(m.group(1)) > 0, caplog.text
        assert not any(alive(pid) for _, _, pid in sup.spawned)
    finally:
        done.set()
        t.join(10)
        close_pipe(r, out)


@pytest.mark.timeout(120)
def test_a_stdout_read_again_gets_the_lines_in_order_and_the_count_of_the_dropped(
        child_script, caplog):
    """The reader comes back: what was kept is written in order, and how many lines were
    dropped meanwhile is logged once."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    sup = Supervisor(argv_of(child_script, "chatty", "serve"), 2, HOST, 0, stdout=out)
    got = bytearray()
    reading = []

    def take():
        while unread(r):
            got.extend(os.read(r, unread(r)))

    def stop_when():
        if not reading:
            if unread(r) < 60000 or not all(c.ready for c in sup._children):
                return False
            reading.append(True)                # the reader is back
        take()
        return b"listening on" in got and "stdout is read again" in caplog.text
    try:
        assert run_supervisor(sup, stop_when) == 0
        take()
        lines = got.decode().splitlines()
        numbered = [int(x[:4]) for x in lines if re.match(r"\d{4} x", x)]
        assert numbered == sorted(numbered) and numbered[0] == 0      # in order, from 0
        assert all(len(x) == 1000 for x in lines if re.match(r"\d{4} x", x))   # whole lines
        dropped = [int(n) for n in re.findall(r"stdout is read again: (\d+) lines",
                                              caplog.text)]
        assert len(dropped) == 1 and dropped[0] > 0
        # every line the children printed before the stop: passed on, or counted as dropped
        ups = sum(f"child {m} up" in lines for m in ("chatty", "serve"))
        assert len(numbered) + ups + dropped[0] == 2002
        assert lines.count(f"listening on {HOST}:{sup.address[1]}") == 1   # never dropped
    finally:
        close_pipe(r, out)


STALLED_PRINTER = """
from aoprim.server import Handler

class Printer(Handler):
    def on_read(self, session, data):
        print("x" * 1000, flush=True)     # blocks once nobody reads stdout
        session.send(data)
"""


def _fill_stdout(port):
    """Requests until one is not answered: the handler is blocked printing."""
    for i in range(1000):
        try:
            with socket.create_connection((HOST, port), timeout=3) as s:
                s.sendall(b"hi")
                recv_exact(s, 2, timeout=3)
        except OSError:
            return i
    raise AssertionError("every request was answered: stdout never filled")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("procs", [1, 2])
def test_sigterm_stops_serve_whose_stdout_nobody_reads(tmp_path, procs):
    """`serve` whose stdout reader stalled (not closed): each request prints 1000 bytes.
    The supervisor (--procs 2) blocked writing, its children blocked printing, and SIGTERM
    was never handled; it now drops what does not fit, every request is answered, and
    SIGTERM is a clean stop.  Alone (--procs 1) the process's stdout is the user's: the
    handler blocks in print(), and serve's stop watchdog ends the process --stop-timeout
    after the SIGTERM, with status 1, where it never stopped."""
    (tmp_path / "printer.py").write_text(STALLED_PRINTER)
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", str(procs), "--stop-timeout", "2",
                          "printer:Printer"], stdout=w, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), env=child_env())
    os.close(w)
    err = Lines(p.stderr)
    try:
        first = b""
        while not first.endswith(b"\n"):
            byte = os.read(r, 1)
            if not byte:                           # it exited
                break
            first += byte
        assert first.startswith(b"listening on "), err.text()
        port = int(first.rsplit(b":", 1)[1])
        if procs == 1:
            _fill_stdout(port)
        else:
            for i in range(1300):              # 1.3 MB: more than the pipe and the buffer
                assert echo_once(port, b"hi") == b"hi"
            err.wait("stdout is not being read")
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError("still running 60 s after SIGTERM: " + err.text())
        err.join()
        if procs == 1:
            assert rc == 1, err.text()                  # a forced stop is not a clean one
            assert "did not stop within 2 s of SIGTERM" in err.text(), err.text()
        else:
            assert rc == 0, err.text()
            assert err.text().count("stdout is not being read") == 1
            assert "lines of the server processes' output were dropped" in err.text()
        assert "Traceback" not in err.text()
    finally:
        cleanup(p)
        os.close(r)


# -- restarts that fail while the service serves ----------------------------------------------

def delays_logged(caplog, what="restarting it in"):
    return [float(m) for m in re.findall(what + r" ([0-9.e+-]+) s", caplog.text)]


@pytest.mark.timeout(60)
def test_a_replacement_that_exits_2_while_the_service_serves_is_retried(child_script, caplog):
    """A child crashes while serving and its replacement exits 2 before "ready" (its handler
    file is being replaced): that stopped every child, the healthy ones included, and the
    supervisor exited 2.  Exit 2 before "ready" stops everything only at the first start."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "serve", "crash", "fail2", "fail2", "serve"), 2,
                     HOST, 0, stdout=io.StringIO(), backoff=0.05, give_up_after=1)
    assert run_supervisor(sup, lambda: len(sup.spawned) == 5 and
                          all(c.ready for c in sup._children)) == 0
    assert [i for _, i, _ in sup.spawned] == [0, 1, 1, 1, 1]
    # each failure logged once, with its back-off step
    assert caplog.text.count("exited with status 2 before it listened") == 2
    assert delays_logged(caplog) == [0.05, 0.1, 0.2]
    assert "giving up" not in caplog.text
    assert not any(alive(pid) for _, _, pid in sup.spawned)


@pytest.mark.timeout(60)
def test_a_restart_whose_spawn_fails_is_retried(child_script, caplog):
    """Spawning a replacement fails (EMFILE from os.pipe, EAGAIN from fork; here: no such
    program): that stopped the whole service."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "serve", "crash", "missing", "missing", "serve"),
                     2, HOST, 0, stdout=io.StringIO(), backoff=0.05, give_up_after=1)
    assert run_supervisor(sup, lambda: len(sup.spawned) == 3 and
                          all(c.ready for c in sup._children)) == 0
    assert [i for _, i, _ in sup.spawned] == [0, 1, 1]
    assert caplog.text.count("cannot start server process 2 of 2") == 2
    assert delays_logged(caplog, "retrying in") == [0.1, 0.2]
    assert delays_logged(caplog) == [0.05]
    assert "giving up" not in caplog.text
    assert not any(alive(pid) for _, _, pid in sup.spawned)


@pytest.mark.timeout(60)
def test_exit_2_at_the_first_start_still_stops_everything(child_script, capfd):
    sup = Supervisor(argv_of(child_script, "serve", "fail2"), 2, HOST, 0,
                     stdout=io.StringIO())
    assert sup.run() == 2
    assert "exited with status 2 (a usage or configuration error) before it listened: " \
        "stopping" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_restarts_that_keep_failing_with_no_child_serving_give_up(child_script, capfd):
    """The give-up rule stays for a service of which no process serves."""
    sup = Supervisor(argv_of(child_script, "crash", "fail2"), 1, HOST, 0,
                     stdout=io.StringIO(), backoff=0.01, backoff_max=0.01, give_up_after=2)
    assert sup.run() == 1
    assert "3 crashes in a row, each before it listened: giving up" in capfd.readouterr().err


# -- a child's output held open by a process it started -----------------------------------------

class _CountingSelector(selectors.DefaultSelector):
    made = 0

    def __init__(self):
        super().__init__()
        type(self).made += 1


@pytest.mark.timeout(120)
def test_a_dead_childs_output_held_by_its_helper_is_not_waited_for(child_script, caplog,
                                                                   monkeypatch):
    """A child's helper process keeps its stdout pipe open: the supervisor waited up to 2 s
    for its end, serially, each in a selector of its own -- 2 s of a stalled loop per crash,
    N x 2 s per stop.  It never waits on a dead child's output: its loop's selector is the
    only one it makes, and everything the children printed is passed on."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    _CountingSelector.made = 0
    monkeypatch.setattr(supervisor_module.selectors, "DefaultSelector", _CountingSelector)
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "helper-crash", "helper"), 3, HOST, 0, stdout=out,
                     backoff=0.01)
    helpers = set()

    def stop_when():
        for _, _, pid in sup.spawned:
            helpers.update(children_of(pid))
        return len(sup.spawned) >= 4 and all(c.ready for c in sup._children)
    try:
        assert run_supervisor(sup, stop_when) == 0
        assert _CountingSelector.made == 1
        text = out.getvalue()
        assert text.count("child helper-crash up") == 1 and text.count("child helper up") == 3
        assert sorted(int(x) for x in re.findall(r"bye (\d+)", text)) == \
            sorted(pid for _, _, pid in list(sup.spawned)[1:])
    finally:
        for pid in helpers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- the supervisor's timeouts on the command line ------------------------------------------------

SLOW_IMPORT = """
import time
time.sleep({secs})
from aoprim.server import Handler

class Echo(Handler):
    def on_read(self, session, data):
        session.send(data)
"""


def _serve(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                           "--port", "0", *args], capture_output=True, text=True, timeout=60,
                          cwd=str(tmp_path), env=child_env())


@pytest.mark.timeout(120)
def test_start_timeout_on_the_command_line(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_IMPORT.format(secs=30))
    r = _serve(tmp_path, "--procs", "2", "--start-timeout", "1", "slow:Echo")
    assert r.returncode == 1, r.stderr
    assert "aoprim: the server processes did not all listen within 1 s: stopping" in r.stderr
    assert "listening on" not in r.stdout


@pytest.mark.timeout(120)
def test_the_default_start_waits_for_a_slow_import(tmp_path):
    """A start-up slower than a fixed limit (a model to load) could never run under --procs:
    by default the supervisor waits as long as its children are alive, as serve alone does."""
    from aoprim.server.cli import build_parser
    a = build_parser("serve").parse_args(["serve"])
    assert a.start_timeout is None
    (tmp_path / "slow.py").write_text(SLOW_IMPORT.format(secs=2))
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", "2", "slow:Echo"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                         env=child_env())
    try:
        assert p.stdout.readline().startswith("listening on ")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        cleanup(p)


@pytest.mark.timeout(120)
def test_backoff_max_on_the_command_line(tmp_path):
    (tmp_path / "crasher.py").write_text(textwrap.dedent("""
        import os
        from aoprim.server import Handler

        class Crasher(Handler):
            def on_read(self, session, data):
                os._exit(3)
    """))
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", "2", "--backoff-max", "0.125", "crasher:Crasher"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), env=child_env())
    err = Lines(p.stderr)
    try:
        port = int(p.stdout.readline().rsplit(":", 1)[1])
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"x")
            s.recv(1)
        err.wait("restarting it in 0.12 s")
    finally:
        cleanup(p)


@pytest.mark.parametrize("flag, value, why", [
    ("--start-timeout", "0", "above 0"),
    ("--start-timeout", "nan", "'nan'"),
    ("--start-timeout", "86401", "at most 86400"),
    ("--stop-timeout", "inf", "'inf'"),
    ("--stop-timeout", "-1", "above 0"),
    ("--stop-timeout", "none", "'none'"),
    ("--stop-timeout", "soon", "'soon'"),
    ("--backoff-max", "0", "above 0"),
    ("--backoff-max", "1e9", "at most 86400"),
])
def test_timeout_options_out_of_bounds_are_one_line_naming_the_value(tmp_path, flag, value,
                                                                      why):
    r = _serve(tmp_path, "--procs", "2", flag, value)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert line.startswith(f"aoprim: {flag}: ") and "\n" not in line, r.stderr
    assert why in line and value in line, line


@pytest.mark.parametrize("kw, value", [("start_timeout", 0.0), ("stop_timeout", float("inf")),
                                       ("backoff_max", -1.0), ("stop_timeout", None)])
def test_supervisor_refuses_timeouts_out_of_bounds(kw, value):
    with pytest.raises(ValueError, match=f"{kw} must be .*not {value}"):
        Supervisor(lambda port, fd: [], 2, **{kw: value})


# -- a handler module whose import raises a BaseException ----------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("body, said", [
    ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ("raise SystemExit(0)", "SystemExit(0)"),
    ("raise SystemExit", "SystemExit(None)"),
    ("raise SystemExit('usage: h.py ARG')", "SystemExit('usage: h.py ARG')"),
    ("raise GeneratorExit", "GeneratorExit"),
])
def test_an_import_that_raises_any_base_exception_is_exit_2_naming_it(tmp_path, body, said):
    """A handler module that runs a CLI or a prompt at import exited 0 with no message:
    only a real SIGINT/SIGTERM may exit 0."""
    (tmp_path / "h.py").write_text(body + "\nfrom aoprim.server import Handler\n"
                                   "class H(Handler):\n    pass\n")
    r = _serve(tmp_path, "h:H")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("aoprim: importing 'h' failed: " + said), r.stderr
    assert "h.py:1" in r.stderr
