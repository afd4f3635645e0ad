"""--procs: what the supervisor does about processes that do not behave (supervisor.py): a
restart that never says it listens, the processes a child started (each child leads a
process group), and a stderr nobody reads.

The Supervisor class with small stand-in children (their modes below), and one supervisor
in a subprocess for its stderr.
"""
import io
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from aoprim.server import supervisor as supervisor_mod
from aoprim.server.supervisor import Supervisor

from proc_support import child_env, end
from server_support import HOST, wait_for
from test_supervisor import Lines, alive, argv_of, run_supervisor

pytestmark = pytest.mark.timeout(120)

CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time

    mode, port, status = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def bye(signum, frame):
        print("bye", os.getpid(), flush=True)
        os.write(status, b"stopped\\n")      # told to stop, and done
        sys.exit(0)

    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, bye)
    if mode.startswith(("hang", "helper")):
        # a process it starts, as a handler's subprocess.Popen: one that stops on SIGTERM
        # and SIGINT, or (stubborn) ignores both
        stubborn = mode.endswith("stubborn")
        code = ("import os, signal, time\\n"
                + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                   "signal.signal(signal.SIGINT, signal.SIG_IGN)\\n" if stubborn else "")
                + "print('helper', os.getpid(), flush=True)\\n"     # (its signals set)
                + "time.sleep(120)\\n")
        helper = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        print(helper.stdout.readline().decode().strip(), flush=True)   # it is set up
    if mode.startswith("hang"):            # an import that blocks: never says it listens
        time.sleep(120)
    os.write(status, b"ready\\n")
    if mode in ("crash", "helper-crash"):  # a crash while serving
        time.sleep(0.05)
        os._exit(3)
    time.sleep(120)
""")


@pytest.fixture
def child_script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def helpers(out):
    return [int(pid) for pid in re.findall(r"helper (\d+)", out.getvalue())]


@pytest.fixture
def out():
    """The supervisor's stdout; the helpers it names are killed after the test if a failed
    one left them."""
    stream = io.StringIO()
    yield stream
    for pid in helpers(stream):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def stop_when(pred, limit=30.0):
    """``pred``, or ``limit`` seconds gone (a supervisor that never gets there is stopped
    all the same, and the test's assertions say what it did not do)."""
    end = time.monotonic() + limit
    return lambda: pred() or time.monotonic() > end


def test_a_restart_that_never_listens_is_killed_with_its_group_and_retried(child_script,
                                                                          caplog, out):
    """A restarted child whose start-up blocks is killed at start_timeout with what it
    started, logged, and its place restarted after the back-off: not waited for without
    end, the service one process short and nothing logged."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    # start_timeout: long enough for a hanging child to start its helper first (two
    # interpreter start-ups; on a loaded 3.13t CI machine 0.5 s was not), so that the kill
    # has a helper to take with it
    sup = Supervisor(argv_of(child_script, "serve", "crash", "hang", "hang", "serve"), 2,
                     HOST, 0, stdout=out, start_timeout=3.0, backoff=0.05, backoff_max=0.1)
    assert run_supervisor(sup, stop_when(lambda: len(sup.spawned) == 5 and
                                         sup._children[1].ready)) == 0
    assert [i for _, i, _ in sup.spawned] == [0, 1, 1, 1, 1]
    assert caplog.text.count("did not listen within 3 s and was killed, with the processes "
                             "it started: restarting it in") == 2, caplog.text
    times = [t for t, _, _ in sup.spawned]
    assert times[3] - times[2] >= 3.0 and times[4] - times[3] >= 3.0
    assert len(helpers(out)) == 2
    assert not any(alive(pid) for pid in helpers(out))
    assert not any(alive(pid) for _, _, pid in sup.spawned)


def test_restarts_that_never_listen_count_toward_giving_up(child_script, capfd, out):
    """With no other process serving, restarts killed at start_timeout are start-ups that
    fail every time: after give_up_after of them the supervisor exits 1."""
    sup = Supervisor(argv_of(child_script, "crash", "hang"), 1, HOST, 0, stdout=out,
                     start_timeout=0.3, backoff=0.01, backoff_max=0.01, give_up_after=1)
    assert run_supervisor(sup, stop_when(lambda: False)) == 1
    assert len(sup.spawned) == 3
    assert ("did not listen within 0.3 s and was killed, with the processes it started; 2 "
            "crashes in a row, each before it listened: giving up") in capfd.readouterr().err
    assert not any(alive(pid) for _, _, pid in sup.spawned)


def test_without_a_start_timeout_a_slow_restart_is_logged_once(child_script, caplog,
                                                               monkeypatch, out):
    """No start_timeout: a restart is waited for as long as it lives (a model that loads
    for minutes), and said once to be slow."""
    monkeypatch.setattr(supervisor_mod, "_SLOW_START", 0.3)
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "serve", "crash", "hang"), 2, HOST, 0,
                     stdout=out, backoff=0.01)
    seen = []

    def slow_seen():
        if "has not listened after" not in caplog.text:
            return False
        seen.append(sup._children[1].proc is not None and not sup._children[1].ready)
        return True
    assert run_supervisor(sup, stop_when(slow_seen)) == 0
    assert seen == [True]                  # still there, still starting
    assert caplog.text.count("(restarted) has not listened after 0 s") == 1, caplog.text
    assert "did not listen within" not in caplog.text
    assert not any(alive(pid) for _, _, pid in sup.spawned)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_reaches_what_the_children_started(child_script, sig, out):
    """A stop signal goes to each child's process group: the processes a child started do
    not outlive the supervisor, and each child still has its graceful stop ("bye",
    exit 0)."""
    sup = Supervisor(argv_of(child_script, "helper"), 2, HOST, 0, stdout=out)
    assert run_supervisor(sup, stop_when(lambda: "listening on" in out.getvalue() and
                                         len(helpers(out)) == 2), sig) == 0
    text = out.getvalue()
    assert sorted(int(x) for x in re.findall(r"bye (\d+)", text)) == \
        sorted(pid for _, _, pid in sup.spawned)
    assert len(helpers(out)) == 2
    assert not any(alive(pid) for pid in helpers(out))


def test_what_a_crashed_child_started_is_stopped_when_it_crashes(child_script, out, caplog):
    """What a crashed child's handlers started (a worker forked for a job) gets SIGTERM at
    the crash, while the service serves on: left for the service's stop, it would outlive a
    supervisor killed meanwhile."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "serve", "helper-crash", "serve"), 2, HOST, 0,
                     stdout=out, backoff=0.01)
    gone_then = []

    def restarted():
        if not (len(sup.spawned) == 3 and sup._children[1].ready and helpers(out)):
            return False
        if any(alive(pid) for pid in helpers(out)):
            return False                        # (stop_when's limit ends a wait in vain)
        gone_then.append(True)
        return True
    assert run_supervisor(sup, stop_when(restarted)) == 0
    assert gone_then == [True], caplog.text
    assert re.search(r"stopping what server process \d+ started", caplog.text), caplog.text


def test_what_ignores_the_stop_is_killed_after_stop_timeout(child_script, caplog, out):
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "helper-stubborn"), 1, HOST, 0, stdout=out,
                     stop_timeout=0.5)
    t0 = []
    assert run_supervisor(sup, stop_when(lambda: helpers(out) and "listening on" in
                                         out.getvalue() and not t0.append(time.monotonic())
                                         )) == 0
    assert time.monotonic() - t0[0] >= 0.5     # the helper had its stop_timeout
    assert "processes started by server process" in caplog.text
    assert "did not stop: killing them" in caplog.text
    # (SIGKILL is not waited for: its end is the kernel's, a moment later)
    wait_for(lambda: not any(alive(pid) for pid in helpers(out)), timeout=10,
             what="the helper killed")


SUPERVISOR = textwrap.dedent("""
    import logging, sys
    from aoprim.server.supervisor import Supervisor

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    script = sys.argv[1]

    def child_argv(port, status_fd):
        return [sys.executable, script, "crash", str(port), str(status_fd)]

    sys.exit(Supervisor(child_argv, 1, "127.0.0.1", 0, backoff=0.01, backoff_max=0.01).run())
""")


def _fill(fd):
    """Write into pipe ``fd`` until it is full."""
    os.set_blocking(fd, False)
    n = 0
    try:
        while True:
            n += os.write(fd, b"f" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(fd, True)
    return n


@pytest.mark.timeout(180)
def test_a_stalled_stderr_does_not_stop_the_supervisor(child_script, tmp_path):
    """A stderr pipe nobody reads (a log shipper that stopped) must not block the
    supervisor at its first log line: its lines wait (past 256 KiB of a stderr that takes
    nothing, they are dropped and counted), crashes go on being restarted, and the lines
    come out, all of them, once the stderr is read again."""
    (tmp_path / "sup.py").write_text(SUPERVISOR)
    r, w = os.pipe()
    prefilled = _fill(w)
    p = subprocess.Popen([sys.executable, str(tmp_path / "sup.py"), child_script],
                         stdout=subprocess.PIPE, stderr=w, text=True, env=child_env())
    os.close(w)
    reader = None
    try:
        out = Lines(p.stdout)               # (its "listening on" line)
        seen = set()                        # every restart is a new child of the supervisor

        def restarts():
            try:
                with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                    seen.update(f.read().split())
            except OSError:
                pass
            return len(seen) >= 20
        wait_for(restarts, timeout=60, what="20 restarts with stderr stalled")
        assert p.poll() is None
        got = bytearray()

        def read_all():
            while True:
                chunk = os.read(r, 65536)
                if not chunk:
                    return
                got.extend(chunk)
        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        wait_for(lambda: got.count(b"restarting it in") >= 19, timeout=60,
                 what="the log lines once stderr is read")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        reader.join(30)
        assert not reader.is_alive()
        text = got[prefilled:].decode()
        assert "received SIGTERM" in text
        assert "dropped" not in text
        out.join()
    finally:
        end(p)
        p.stdout.close()
        os.close(r)
