"""--procs: the supervisor (aoprim/server/supervisor.py).

Two kinds of tests: the command line (`python -m aoprim serve --procs N`, real server
children), for how it treats its children and its port, and the Supervisor class with small
stand-in children (a script that prints "listening on" and exits as told), for its rules
with short back-offs.
"""
import errno
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from aoprim.server.loop import BACKENDS
from aoprim.server.supervisor import Supervisor, reserve_port

from proc_support import child_env, signal_masks
from server_support import HOST, recv_exact, wait_for

CWD = tempfile.gettempdir()


# -- helpers --------------------------------------------------------------------------------

def _stat(pid):
    """(state, ppid) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    return rest[0], int(rest[1])


def alive(pid):
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def children_of(pid):
    """Live processes whose parent is ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and st[1] == pid and st[0] not in ("Z", "X"):
                out.append(int(d))
    return sorted(out)


def serve(*args, cwd=CWD):
    """Start `python -m aoprim serve --procs ...`; returns (process, port) once it listens."""
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--log-level", "INFO", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         env=child_env())
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        out, err = p.communicate(timeout=10)
        raise AssertionError(f"did not start: {line!r} {err}")
    return p, int(line.rsplit(":", 1)[1])


class Lines:
    """The lines a stream gives, collected by a thread (for waiting on one with a deadline)."""

    def __init__(self, stream):
        self.lines = []
        self._t = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._t.start()

    def _run(self, stream):
        try:
            for line in stream:
                self.lines.append(line)
        except ValueError:          # the test closed the stream (its process is done with)
            pass

    def text(self):
        return "".join(self.lines)

    def wait(self, needle, count=1, timeout=60):
        wait_for(lambda: self.text().count(needle) >= count, timeout=timeout,
                 what=f"{needle!r} x{count}")

    def join(self):
        self._t.join(30)
        assert not self._t.is_alive()


def echo_once(port, payload=b"ping"):
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(payload)
        return recv_exact(s, len(payload))


def cleanup(p, pids=()):
    pids = set(pids) | set(children_of(p.pid) if p.poll() is None else ())
    if p.poll() is None:
        p.kill()
        p.wait()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    for f in (p.stdout, p.stderr):      # the pipes: an unclosed one is a ResourceWarning
        if f is not None:
            f.close()


# -- the command line: each test failed on the supervisor before supervisor.py ---------------

def test_a_child_exiting_2_stops_the_supervisor_with_2():
    """A child that exits 2 (a usage error: it would fail the same way again) stops the
    supervisor with 2, without "listening on" and without respawning it."""
    # (bad settings are refused by the supervisor itself, before any child starts: a
    # handler that cannot be imported is what only a child finds out)
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port", "0",
                        "--procs", "2", "no_such_module_for_this_test:Handler"],
                       capture_output=True, text=True, timeout=30, cwd=CWD)
    assert r.returncode == 2, r.stderr
    assert "cannot import 'no_such_module_for_this_test'" in r.stderr
    assert "exited with status 2 (a usage or configuration error)" in r.stderr
    assert "listening on" not in r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_child_stopped_by_someone_else_is_replaced(backend):
    """SIGTERM to one child (an operator's kill, an OOM daemon) stopped it for good: the
    service went on with one process fewer, and ended (exit 0) once each child had one."""
    p, port = serve("--procs", "2", "--stats-json", "--backend", backend)
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        err = Lines(p.stderr)
        for n, kid in enumerate(kids, 1):
            os.kill(kid, signal.SIGTERM)
            err.wait("(restarted) is listening", count=n, timeout=30)
        now = children_of(p.pid)
        assert len(now) == 2 and not set(now) & set(kids)
        assert p.poll() is None
        for i in range(4):
            assert echo_once(port, b"ok%d" % i) == b"ok%d" % i
        p.send_signal(signal.SIGTERM)
        out = p.stdout.read()
        assert p.wait(60) == 0, err.text()
        err.join()
        assert out.count("stats ") == 4                  # the two stopped, the two stopping
        assert err.text().count("without the supervisor asking: replacing it") == 2
        assert "Traceback" not in err.text()
    finally:
        cleanup(p, kids)


START_ONCE = """
import os
from aoprim.server import Handler

# the first process to import this module serves; the second exits 3 before it listens
try:
    os.close(os.open(os.path.join(os.path.dirname(__file__), "first.flag"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY))
except FileExistsError:
    os._exit(3)

class Echo(Handler):
    def on_read(self, session, data):
        session.send(data)
"""


def test_listening_is_printed_only_once_every_child_listens(tmp_path):
    """"listening on" is printed once every child listens: a child that fails to start
    stops the others and the supervisor exits non-zero, without printing it."""
    (tmp_path / "startonce.py").write_text(START_ONCE)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--procs", "2", "startonce:Echo"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 1, err
        assert "listening on" not in out
        assert "exited with status 3 before it listened: stopping" in err
        assert "Traceback" not in err
        assert children_of(p.pid) == []      # the child that did start was stopped
    finally:
        cleanup(p)


STOP_WHILE_LOGGING = """
import logging, os, signal
from aoprim.server import Handler

class _Signalling(logging.StreamHandler):
    # SIGTERM arrives while the "listening" line is being written: inside StreamHandler's
    # emit, whose `except Exception` reports a logging error and carries on
    def format(self, record):
        if "listening" in record.getMessage():
            os.kill(os.getpid(), signal.SIGTERM)
        return super().format(record)

logging.getLogger("aoprim.server").addHandler(_Signalling())

class Echo(Handler):
    def on_read(self, session, data):
        session.send(data)
"""


@pytest.mark.timeout(60)
def test_a_stop_signal_during_start_up_is_not_swallowed(tmp_path):
    """The supervisor stops a sibling with SIGTERM while it is still starting (before
    serve_forever's own handlers), here while it logs.  The start-up handler's stop must be
    a BaseException: an Exception subclass would be swallowed by any `except Exception` it
    lands in -- logging's emit, here -- with a "Logging error" traceback, and the child would
    serve on until the supervisor killed it 15 s later.  The child exits 0 at once, quietly."""
    (tmp_path / "stoplog.py").write_text(STOP_WHILE_LOGGING)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "stoplog:Echo"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise AssertionError(f"the stop was swallowed: the server kept serving\n{err}")
        assert p.returncode == 0, err
        assert "Traceback" not in err and "Logging error" not in err
        assert "listening on" not in out
    finally:
        cleanup(p)


def test_children_die_with_a_killed_supervisor():
    """SIGKILL of the supervisor left its children serving (orphans)."""
    p, port = serve("--procs", "2")
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        assert echo_once(port) == b"ping"
        p.kill()
        p.wait()
        wait_for(lambda: not any(alive(k) for k in kids), timeout=15,
                 what="the children to die with their supervisor")
        with pytest.raises(OSError):
            echo_once(port)
    finally:
        cleanup(p, kids)


def test_the_port_stays_reserved_while_no_child_runs():
    """Once every child had died, the port was free for anyone until the restart (the
    reservation was closed after the start); now it is held for the supervisor's life and
    the restarted children get the same port."""
    p, port = serve("--procs", "2")
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        for k in kids:
            os.kill(k, signal.SIGKILL)
        wait_for(lambda: not any(alive(k) for k in kids), timeout=5, what="children dead")
        # another program, binding as asyncio does (SO_REUSEADDR), cannot take the port
        thief = socket.socket()
        try:
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as ei:
                thief.bind((HOST, port))
                thief.listen()
            assert ei.value.errno == errno.EADDRINUSE
        finally:
            thief.close()
        # the restarted children serve the same port
        wait_for(lambda: len(children_of(p.pid)) == 2, timeout=15, what="restarted children")

        def serves():
            try:
                return echo_once(port, b"again") == b"again"
            except OSError:
                return False
        wait_for(serves, timeout=15, what="the port to be served again")
        rc = (p.send_signal(signal.SIGTERM), p.wait(20))[1]
        err = p.stderr.read()
        assert rc == 0, err
        assert "exited with signal SIGKILL: restarting it" in err
    finally:
        cleanup(p, kids)


CRASHER = """
import os
from aoprim.server import Handler

class CrashOnRequest(Handler):
    def on_read(self, session, data):
        if bytes(data) == b"crash":
            os._exit(3)
        session.send(data)
"""


def test_a_crashed_child_is_restarted_and_the_port_keeps_serving(tmp_path):
    (tmp_path / "crasher.py").write_text(CRASHER)
    p, port = serve("--procs", "2", "crasher:CrashOnRequest", cwd=str(tmp_path))
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"crash")
            assert s.recv(10) == b""         # that child is gone
        wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid) != kids,
                 timeout=15, what="a restarted child")
        for i in range(6):
            assert echo_once(port, b"ok%d" % i) == b"ok%d" % i
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0, err
        assert "exited with status 3: restarting it in 0.5 s" in err
    finally:
        cleanup(p, kids)


RAISER = """
from aoprim.server import Handler

class Raiser(Handler):
    # what argparse or click do on bad input, and what an interrupted handler raises
    def on_read(self, session, data):
        what = bytes(data)
        if what == b"exit2":
            raise SystemExit(2)
        if what == b"exit0":
            raise SystemExit(0)
        if what == b"kbd":
            raise KeyboardInterrupt
        session.send(data)
"""
RAISED = {b"exit2": "SystemExit(2)", b"exit0": "SystemExit(0)", b"kbd": "KeyboardInterrupt()"}


def _raise_in_a_handler(port, what):
    """Send ``what``; the handler raises: the session is closed (its server, with
    workers=0, stops)."""
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(what)
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:
            pass


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handlers_exit_status_is_a_crash_of_its_child(tmp_path, backend):
    """A handler raising SystemExit(2) made its child exit 2, which the supervisor took for
    bad settings: every child stopped, exit 2.  SystemExit(0) or KeyboardInterrupt made it
    exit 0, taken for a stop it was told to make: never restarted.  Each is a crash now:
    the child exits 1, is restarted, and the service goes on."""
    (tmp_path / "raiser.py").write_text(RAISER)
    p, port = serve("--procs", "2", "--backend", backend, "--workers", "0", "raiser:Raiser",
                    cwd=str(tmp_path))
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        err = Lines(p.stderr)
        for n, what in enumerate((b"exit2", b"exit0", b"kbd"), 1):
            _raise_in_a_handler(port, what)
            # the restarted child listens again (before that, a request to the other child
            # could meet no listener at all)
            err.wait("(restarted) is listening", count=n)
            assert len(children_of(p.pid)) == 2 and p.poll() is None
            kids += children_of(p.pid)
            for i in range(4):
                assert echo_once(port, b"ok%d" % i) == b"ok%d" % i
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, err.text()
        err.join()
        text = err.text()
        assert text.count("exited with status 1: restarting it") == 3, text
        for name in RAISED.values():
            assert f"a handler raised {name} while serving" in text, text
        assert "configuration error" not in text and "not restarting it" not in text
    finally:
        cleanup(p, kids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", list(RAISED))
def test_a_handlers_exit_status_with_procs_1_is_1(tmp_path, what):
    """With --procs 1 the process exited with the handler's status: 2 (as if the settings
    were wrong) or 0 (as if told to stop)."""
    (tmp_path / "raiser.py").write_text(RAISER)
    p, port = serve("raiser:Raiser", "--stats-json", cwd=str(tmp_path))
    try:
        _raise_in_a_handler(port, what)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 1, err
        assert f"a handler raised {RAISED[what]} while serving: the server stopped (exit " \
            "status 1)" in err
        assert out.count("stats ") == 1
    finally:
        cleanup(p)


@pytest.mark.timeout(120)
def test_a_handlers_exit_on_a_worker_closes_its_session_only(tmp_path):
    """With workers=N a handler's SystemExit/KeyboardInterrupt closes its session and the
    worker lives on (handler.py): the children are the same ones afterwards."""
    (tmp_path / "raiser.py").write_text(RAISER)
    p, port = serve("--procs", "2", "--workers", "2", "raiser:Raiser", cwd=str(tmp_path))
    kids = []
    try:
        kids = wait_for(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid),
                        what="2 children")
        for what in RAISED:
            for _ in range(2):
                _raise_in_a_handler(port, what)
        for i in range(4):
            assert echo_once(port, b"ok%d" % i) == b"ok%d" % i
        assert children_of(p.pid) == kids
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert "restarting it" not in err
    finally:
        cleanup(p, kids)


def test_the_reservation_refuses_other_binders():
    r = reserve_port(HOST, 0)
    try:
        port = r.getsockname()[1]
        for opts in ((), (socket.SO_REUSEADDR,)):
            s = socket.socket()
            try:
                for o in opts:
                    s.setsockopt(socket.SOL_SOCKET, o, 1)
                with pytest.raises(OSError):
                    s.bind((HOST, port))
            finally:
                s.close()
        # a server process of ours (SO_REUSEADDR + SO_REUSEPORT) binds beside it
        s = socket.socket()
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((HOST, port))
            s.listen()
        finally:
            s.close()
    finally:
        r.close()


# -- the Supervisor class with stand-in children ---------------------------------------------

CHILD = textwrap.dedent("""
    import os, resource, signal, sys, time

    mode, port, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # (SIGQUIT's default action: no core)

    def bye(signum, frame):
        print("bye", os.getpid(), flush=True)
        os.write(status, b"stopped\\n")      # told to stop, and done
        sys.exit(0)

    def dies_of(sig):
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    # hup-starting: still starting when the stop comes, and ended by the default action of
    # a SIGHUP that reached it too (pkill -HUP of every process of the service)
    signal.signal(signal.SIGTERM, bye if mode != "hup-starting" else
                  lambda signum, frame: dies_of(signal.SIGHUP))
    signal.signal(signal.SIGINT, bye)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "silent":                   # never says it listens
        time.sleep(60)
    if mode == "fail2":                    # a configuration error before listening
        sys.exit(2)
    if mode == "early":                    # a crash before listening (a start-up crash)
        sys.exit(3)
    if mode == "hup-starting":
        time.sleep(60)
    # before "ready": a stop signal, sent once every child listens, could otherwise land
    # inside this print (the child then wrote "child" + "bye ...": a test race)
    print("child", mode, "up", flush=True)
    os.write(status, b"ready\\n")
    # exit2/exit0: a status chosen while serving (a handler's sys.exit, os._exit);
    # stop0: the child stops by itself as if told to, saying so first; killed: it dies of
    # SIGTERM that the supervisor did not send; hup, quit: of a SIGHUP or SIGQUIT's default
    # action (one that came before a server's handlers were in place)
    lifetime = {"crash": 0.05, "late": 0.4, "exit2": 0.2, "exit0": 0.2, "stop0": 0.2,
                "killed": 0.2, "hup": 0.2, "quit": 0.2}.get(mode)
    if lifetime is None:
        time.sleep(60)
    else:
        time.sleep(lifetime)
        if mode == "stop0":
            os.write(status, b"stopped\\n")
        if mode in ("killed", "hup", "quit"):
            dies_of({"killed": signal.SIGTERM, "hup": signal.SIGHUP,
                     "quit": signal.SIGQUIT}[mode])
        sys.exit({"crash": 3, "late": 3, "exit2": 2, "exit0": 0, "stop0": 0}[mode])
""")


@pytest.fixture
def child_script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def argv_of(script, *modes):
    """child_argv for a Supervisor: the n-th child started runs modes[n] (the last repeats)."""
    calls = []

    def child_argv(port, status_fd):
        mode = modes[min(len(calls), len(modes) - 1)]
        calls.append(mode)
        return [sys.executable, script, mode, str(port), str(status_fd)]
    return child_argv


class SignalWhen:
    """Send ``sig`` to this process once ``pred()`` holds, from a thread (the supervisor
    runs in the main thread, where signals are handled)."""

    def __init__(self, pred, sig=signal.SIGTERM):
        self._done = threading.Event()
        self.sent = False

        def run():
            while not self._done.wait(0.01):
                if pred():
                    self.sent = True
                    os.kill(os.getpid(), sig)
                    return
        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()

    def close(self):
        self._done.set()
        self._t.join(5)


def run_supervisor(sup, stop_when=None, sig=signal.SIGTERM):
    sw = SignalWhen(stop_when, sig) if stop_when is not None else None
    try:
        return sup.run()
    finally:
        if sw is not None:
            sw.close()


def delays_logged(caplog):
    return [float(m) for m in re.findall(r"restarting it in ([0-9.e+-]+) s", caplog.text)]


def test_crash_loop_backs_off_exponentially_with_a_cap_then_gives_up(child_script, caplog):
    """Crashes before "ready" (a start-up that fails every time) end the service."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "crash", "early"), 1, HOST, 0, stdout=out, backoff=0.05,
                     backoff_max=0.2, give_up_after=4, stable_after=10)
    assert sup.run() == 1
    # the first child crashed while serving (not counted), then 5 start-ups failed
    assert delays_logged(caplog) == [0.05, 0.1, 0.2, 0.2, 0.2]
    times = [t for t, _, _ in sup.spawned]
    assert len(times) == 6
    for gap, delay in zip([b - a for a, b in zip(times, times[1:])],
                          [0.05, 0.1, 0.2, 0.2, 0.2]):
        assert gap >= delay
    assert out.getvalue().count("listening on") == 1
    assert not any(alive(pid) for _, _, pid in sup.spawned)


def test_crash_loop_message_names_the_give_up(child_script, capfd):
    sup = Supervisor(argv_of(child_script, "crash", "early"), 1, HOST, 0, stdout=io.StringIO(),
                     backoff=0.01, backoff_max=0.01, give_up_after=2)
    assert sup.run() == 1
    err = capfd.readouterr().err
    assert "3 crashes in a row, each before it listened: giving up" in err


def test_crashes_while_serving_never_end_the_service(child_script, caplog):
    """A child that crashes after "ready" (a request that kills it) counted toward the
    crash loop: a few bad requests stopped the whole service for good."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    # twelve children crash while serving; the two after them serve on ("stay"), so the
    # stop, sent once both are started, never meets a child in the middle of its crash (a
    # crash during the stop is a stop that was not clean: exit status 1)
    modes = ["crash"] * 12 + ["stay"]
    sup = Supervisor(argv_of(child_script, *modes), 2, HOST, 0, stdout=io.StringIO(),
                     backoff=0.01, backoff_max=0.04, give_up_after=2, stable_after=10)
    assert run_supervisor(sup, lambda: len(sup.spawned) >= 14) == 0
    assert len(sup.spawned) == 14
    delays = delays_logged(caplog)
    assert max(delays) == 0.04 and delays.count(0.04) >= 2        # doubled, then capped
    assert "giving up" not in caplog.text
    assert not any(alive(pid) for _, _, pid in sup.spawned)


@pytest.mark.timeout(120)
def test_the_record_of_spawns_keeps_the_newest_only(child_script, caplog, monkeypatch):
    """Supervisor.spawned kept every process ever started: a service whose children crash
    while serving is restarted for as long as it runs, and the record grew with each
    restart (about 130 bytes each, for ever)."""
    from aoprim.server import supervisor
    monkeypatch.setattr(supervisor, "_SPAWNS_KEPT", 3, raising=False)
    caplog.set_level(logging.DEBUG, logger="aoprim.server")

    def started():
        return [r.args[0] for r in list(caplog.records)
                if r.msg.startswith("started server process")]
    sup = Supervisor(argv_of(child_script, "crash"), 1, HOST, 0, stdout=io.StringIO(),
                     backoff=0.01, backoff_max=0.01)
    run_supervisor(sup, lambda: len(started()) >= 10)
    pids = started()
    assert len(pids) >= 10
    assert [pid for _, _, pid in sup.spawned] == pids[-3:]      # the newest 3, in order
    assert [i for _, i, _ in sup.spawned] == [0, 0, 0]
    assert not any(alive(pid) for pid in pids)


@pytest.mark.parametrize("mode", ["stop0", "killed", "hup", "quit"])
def test_a_child_stopped_without_the_supervisor_asking_is_replaced(child_script, caplog,
                                                                    mode):
    """A child that said "stopped" (an operator's SIGTERM to it) was never restarted: the
    service shrank for good, and ended with exit 0 when every child had been stopped.  A
    child that died of SIGHUP or SIGQUIT (their default action: a signal that came before
    its handlers) was restarted as a crash, where one that died of SIGTERM is replaced."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, mode, mode, "serve"), 2, HOST, 0,
                     stdout=io.StringIO(), backoff=0.01, give_up_after=0)
    assert run_supervisor(sup, lambda: len(sup.spawned) == 4 and
                          all(c.ready for c in sup._children)) == 0
    assert sorted(i for _, i, _ in sup.spawned) == [0, 0, 1, 1]   # both places filled again
    assert caplog.text.count("without the supervisor asking: replacing it") == 2
    assert not any(alive(pid) for _, _, pid in sup.spawned)


@pytest.mark.timeout(60)
def test_a_child_still_starting_ended_by_a_sighup_at_the_stop_stopped_cleanly(child_script,
                                                                              caplog):
    """`pkill -HUP -f 'aoprim serve'` reaching a child that is still starting, before its
    handlers are in place: the SIGHUP's default action ends it, as the SIGTERM the
    supervisor sends it would -- a clean stop, exit 0 (it was "exited with signal SIGHUP
    while stopping" and exit 1)."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "hup-starting"), 1, HOST, 0, stdout=io.StringIO())
    caught = 1 << (signal.SIGTERM - 1)

    def starting():         # its SIGTERM handler is in place (the kernel's view)
        try:
            return sup.spawned and signal_masks(sup.spawned[0][2])["SigCgt"] & caught
        except OSError:
            return False
    assert run_supervisor(sup, starting) == 0, caplog.text
    assert not any(c.ready for c in sup._children)
    assert "while stopping" not in caplog.text, caplog.text
    assert not any(alive(pid) for _, _, pid in sup.spawned)


def test_a_child_that_lived_long_enough_starts_the_back_off_again(child_script, caplog):
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "late"), 1, HOST, 0, stdout=io.StringIO(),
                     backoff=0.05, backoff_max=1, give_up_after=2, stable_after=0.3)
    # each child lives 0.4 s > stable_after: never a crash loop, never given up
    assert run_supervisor(sup, lambda: len(sup.spawned) >= 4) == 0
    assert delays_logged(caplog)[:3] == [0.05, 0.05, 0.05]


@pytest.mark.parametrize("mode", ["exit2", "exit0"])
def test_a_status_chosen_while_serving_is_a_crash(child_script, caplog, mode):
    """Exit 2 after "ready" stopped every child and the supervisor exited 2 (taken for bad
    settings); exit 0 without "stopped" was never restarted (taken for a stop it was told
    to make).  Both are statuses a handler can choose: each is a crash, restarted."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    sup = Supervisor(argv_of(child_script, "serve", mode, "serve"), 2, HOST, 0,
                     stdout=io.StringIO(), backoff=0.05)
    assert run_supervisor(sup, lambda: len(sup.spawned) == 3 and sup._children[1].ready) == 0
    rc = 2 if mode == "exit2" else 0
    assert f"exited with status {rc} while serving, not told to stop (a crash): restarting " \
        "it in 0.05 s" in caplog.text
    assert [i for _, i, _ in sup.spawned] == [0, 1, 1]         # place 1 restarted
    assert not any(alive(pid) for _, _, pid in sup.spawned)


def test_exit_2_before_listening_stops_every_child_with_2(child_script):
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "serve", "fail2"), 2, HOST, 0, stdout=out)
    assert sup.run() == 2
    assert "listening on" not in out.getvalue()
    assert not any(alive(pid) for _, _, pid in sup.spawned)


def test_a_stop_asked_for_is_not_followed_by_a_restart(child_script):
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "serve"), 3, HOST, 0, stdout=out)
    assert run_supervisor(sup, lambda: "listening on" in out.getvalue()) == 0
    assert len(sup.spawned) == 3
    assert out.getvalue().count("listening on") == 1


def test_a_start_that_takes_too_long_fails(child_script, capfd):
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "serve", "silent"), 2, HOST, 0, stdout=out,
                     start_timeout=1.0)
    t0 = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - t0 < 10
    assert "listening on" not in out.getvalue()
    assert "did not all listen within 1 s" in capfd.readouterr().err
    assert not any(alive(pid) for _, _, pid in sup.spawned)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_is_forwarded_and_output_relayed(child_script, sig):
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "serve"), 2, HOST, 0, stdout=out)
    assert run_supervisor(sup, lambda: "listening on" in out.getvalue(), sig) == 0
    text = out.getvalue()
    assert text.count("listening on") == 1             # the children's own are consumed
    assert text.count("child serve up") == 2           # everything else is passed on
    assert sorted(int(x) for x in re.findall(r"bye (\d+)", text)) == \
        sorted(pid for _, _, pid in sup.spawned)
    assert text.index("listening on") < text.index("bye")


def test_a_child_that_ignores_the_stop_is_killed_after_stop_timeout(child_script, caplog):
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "serve", "stubborn"), 2, HOST, 0, stdout=out,
                     stop_timeout=0.5)
    t0 = time.monotonic()
    assert run_supervisor(sup, lambda: "listening on" in out.getvalue()) == 1
    assert time.monotonic() - t0 < 15
    assert "did not stop: killing it" in caplog.text
    assert not any(alive(pid) for _, _, pid in sup.spawned)


def test_children_get_the_supervisors_port_and_their_own_process_group(child_script):
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "serve"), 2, HOST, 0, stdout=out)
    seen = {}

    def ready():
        if "listening on" not in out.getvalue():
            return False
        for _, _, pid in sup.spawned:
            seen[pid] = os.getpgid(pid)
        return True
    assert run_supervisor(sup, ready) == 0
    host, port = sup.address
    assert f"listening on {host}:{port}\n" in out.getvalue()
    assert all(pgid == pid for pid, pgid in seen.items())
    assert all(pgid != os.getpgid(0) for pgid in seen.values())
