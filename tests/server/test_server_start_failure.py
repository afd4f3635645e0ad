"""A start that fails or is interrupted before its loop runs -- a ``KeyboardInterrupt`` (a
Ctrl-C) while ``serve_forever()`` starts its worker threads, a worker or loop thread that
cannot start -- gives back everything it started: the worker threads are stopped and
joined, every fd is closed, and ``shutdown()``/``close()`` afterwards return at once."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from aoprim.server import Server
from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS
from aoprim.server.workers import WorkerPool

from server_support import HOST

pytestmark = pytest.mark.timeout(60)


def _fds():
    return sorted(os.listdir("/proc/self/fd"))


def _aoprim_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("aoprim"))


def _fail_after_two_workers(monkeypatch, exc):
    """WorkerPool.start starts two of its threads, then ``exc`` comes: the KeyboardInterrupt
    of a Ctrl-C landing between two thread starts, or the third thread refused."""
    def start(pool):
        for t in pool.threads[:2]:
            t.start()
        raise exc
    monkeypatch.setattr(WorkerPool, "start", start)


def _assert_given_back(srv, fds, threads):
    assert _aoprim_threads() == threads, "threads of the failed start left running"
    assert _fds() == fds, "fds of the failed start left open"
    srv.shutdown(timeout=2)         # (TimeoutError if it thought a loop was still running)
    srv.close()
    assert _aoprim_threads() == threads and _fds() == fds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("can't start new thread")],
                         ids=["KeyboardInterrupt", "RuntimeError"])
def test_serve_forever_interrupted_while_its_workers_start_stops_them(monkeypatch, backend,
                                                                       exc):
    fds, threads = _fds(), _aoprim_threads()
    handler = signal.getsignal(signal.SIGINT)
    srv = Server(Echo(), HOST, backend=backend, workers=4, shutdown_timeout=0.5)
    _fail_after_two_workers(monkeypatch, exc)
    with pytest.raises(type(exc)):
        srv.serve_forever()
    assert signal.getsignal(signal.SIGINT) is handler, "SIGINT's handler not put back"
    _assert_given_back(srv, fds, threads)


def _signal_between_starts(sig, started):
    """A WorkerPool.start that sends ``sig`` to this process between the first worker's
    start and the others', then appends how many workers started to ``started``."""
    def start(pool):
        pool.threads[0].start()
        os.kill(os.getpid(), sig)               # its handler runs at the next check
        for _ in range(1000):
            pass
        for t in pool.threads[1:]:
            t.start()
        started.append(sum(t.ident is not None for t in pool.threads))
    return start


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sigint_while_the_workers_start_waits_until_they_have_all_started(monkeypatch,
                                                                           backend):
    """A Ctrl-C that comes between two thread starts is held until the start is done (a
    KeyboardInterrupt inside Thread.start() could leave a thread half started), then raised:
    every worker started, and every one joined."""
    started = []
    start = _signal_between_starts(signal.SIGINT, started)
    fds, threads = _fds(), _aoprim_threads()
    handler = signal.getsignal(signal.SIGINT)
    srv = Server(Echo(), HOST, backend=backend, workers=4, shutdown_timeout=0.5)
    monkeypatch.setattr(WorkerPool, "start", start)
    with pytest.raises(KeyboardInterrupt):
        srv.serve_forever()
    assert started == [4], "the KeyboardInterrupt came inside the workers' start"
    assert signal.getsignal(signal.SIGINT) is handler
    _assert_given_back(srv, fds, threads)


class _Stop(BaseException):
    """What the caller's SIGTERM handler raises (the command line's start-up stop)."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sighup_taken_as_sigterm_while_the_workers_start_is_held_as_sigterm(monkeypatch,
                                                                              backend):
    """``serve`` takes SIGHUP as SIGTERM: its SIGHUP handler calls the handler in place for
    SIGTERM with SIGHUP's number (cli._forward_to_sigterm).  Landing while the workers
    start, it was held under SIGHUP's number, which has no held handler: a KeyError out of
    serve_forever once they had started.  It is held as a SIGTERM, and given to the
    caller's SIGTERM handler, with its own number, once the start is done."""
    got = []

    def on_term(signum, frame):
        got.append(signum)
        raise _Stop

    def as_sigterm(signum, frame):
        signal.getsignal(signal.SIGTERM)(signum, frame)
    started = []
    start = _signal_between_starts(signal.SIGHUP, started)
    fds, threads = _fds(), _aoprim_threads()
    old = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
           signal.SIGHUP: signal.signal(signal.SIGHUP, as_sigterm)}
    try:
        srv = Server(Echo(), HOST, backend=backend, workers=4, shutdown_timeout=0.5)
        monkeypatch.setattr(WorkerPool, "start", start)
        with pytest.raises(_Stop):
            srv.serve_forever()
        assert started == [4], "the stop came inside the workers' start"
        assert got == [signal.SIGHUP]
        assert signal.getsignal(signal.SIGTERM) is on_term
        _assert_given_back(srv, fds, threads)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_whose_workers_cannot_all_start_stops_those_started(monkeypatch, backend):
    fds, threads = _fds(), _aoprim_threads()
    srv = Server(Echo(), HOST, backend=backend, workers=4, shutdown_timeout=0.5)
    _fail_after_two_workers(monkeypatch, RuntimeError("can't start new thread"))
    with pytest.raises(RuntimeError, match="can't start new thread"):
        srv.start()
    _assert_given_back(srv, fds, threads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workers", [0, 4])
def test_start_whose_loop_thread_cannot_start_gives_everything_back(monkeypatch, backend,
                                                                     workers):
    """The loop thread refused (the process at its thread limit: RLIMIT_NPROC, a pids
    cgroup) after the workers started: they are stopped, the loop and socket closed."""
    real = threading.Thread.start

    def start(thread):
        if thread.name == "aoprim-loop":
            raise RuntimeError("can't start new thread")
        real(thread)
    fds, threads = _fds(), _aoprim_threads()
    srv = Server(Echo(), HOST, backend=backend, workers=workers, shutdown_timeout=0.5)
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        srv.start()
    monkeypatch.undo()
    _assert_given_back(srv, fds, threads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_interrupted_once_its_loop_serves_stops_it(monkeypatch, backend):
    """A KeyboardInterrupt in start()'s wait for its loop thread, which already serves:
    start() raises it, and the server it started is shut down, not left serving."""
    waited = []

    class Interrupted(threading.Event):
        def wait(self, timeout=None):
            super().wait(timeout)       # (the loop thread is serving then)
            waited.append(self)
            raise KeyboardInterrupt
    made = []

    def event():
        # start()'s own event is the first one made (workers=0: no worker threads)
        made.append(Interrupted() if not made else real_event())
        return made[-1]
    real_event = threading.Event
    fds, threads = _fds(), _aoprim_threads()
    srv = Server(Echo(), HOST, backend=backend, shutdown_timeout=0.5)
    monkeypatch.setattr(threading, "Event", event)
    with pytest.raises(KeyboardInterrupt):
        srv.start()
    monkeypatch.undo()
    assert waited, "the interruption did not happen in start()'s wait"
    _assert_given_back(srv, fds, threads)


# A real Ctrl-C at a random moment of serve_forever()'s first milliseconds, in a process of
# its own (the signal goes to the whole process): each start ends in a clean return (the
# SIGINT found serve_forever's handler) or a KeyboardInterrupt (it came before), and no
# thread or fd of any of them is left.
RACE = textwrap.dedent("""
    import gc, os, random, signal, sys, threading
    from aoprim.server import Server
    from aoprim.server.apps import Echo

    backend, n = sys.argv[1], int(sys.argv[2])
    random.seed(int(sys.argv[3]))
    fds = len(os.listdir("/proc/self/fd"))
    outcomes = {"returned": 0, "KeyboardInterrupt": 0}
    for _ in range(n):
        srv = t = stop = None
        try:
            try:
                srv = Server(Echo(), "127.0.0.1", 0, backend=backend, workers=4,
                             shutdown_timeout=5)
                # (a bound: a KeyboardInterrupt raised in a weakref callback or a __del__
                # is only printed, and that SIGINT is lost)
                stop = threading.Timer(10, srv.shutdown)
                stop.start()
                t = threading.Timer(random.random() * 0.004, os.kill,
                                    (os.getpid(), signal.SIGINT))
                t.start()
                srv.serve_forever()
                outcomes["returned"] += 1
            finally:
                if t is not None:
                    t.join()                # the SIGINT is sent: its handler runs here
                for _ in range(1000):
                    pass
        except KeyboardInterrupt:
            outcomes["KeyboardInterrupt"] += 1
        if stop is not None:
            stop.cancel()
            stop.join()
        if srv is not None:
            srv.shutdown(timeout=5)
            srv.close()
        # freed here, not in the next start: a free-threaded build may free it late, and a
        # KeyboardInterrupt raised in its WeakSet callback would only be printed
        srv = None
        gc.collect()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print(outcomes["returned"], outcomes["KeyboardInterrupt"], len(left),
          len(os.listdir("/proc/self/fd")) - fds, sorted(set(left)), flush=True)
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_racing_serve_forever_start_leaves_no_thread(backend):
    n = 30
    r = subprocess.run([sys.executable, "-c", RACE, backend, str(n), "7"],
                       capture_output=True, text=True, timeout=45)
    assert r.returncode == 0, r.stderr[-3000:]
    returned, interrupted, threads_left, fds_left, names = r.stdout.split(maxsplit=4)
    assert int(returned) + int(interrupted) == n, r.stdout
    assert (int(threads_left), int(fds_left)) == (0, 0), \
        f"{r.stdout} (returned, interrupted, threads and fds left, their names)"


# -- a real thread limit: `serve` as an unprivileged user under RLIMIT_NPROC ---------------

NOBODY = 65534


def _tasks_of(uid):
    """Threads of every process of ``uid`` (RLIMIT_NPROC counts them all)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                st = dict(ln.split(":", 1) for ln in f if ":" in ln)
        except (OSError, ValueError):
            continue
        if int(st["Uid"].split()[1]) == uid:
            n += int(st["Threads"])
    return n


def _serve_limited(limit, *args):
    """``python -m aoprim serve ARGS`` as uid 65534 with RLIMIT_NPROC ``limit`` (root may
    read what it reads: CAP_DAC_OVERRIDE kept in its ambient set)."""
    from proc_support import NEUTRAL_CWD, child_env
    pre = ["prlimit", f"--nproc={limit}", "setpriv", f"--reuid={NOBODY}",
           f"--regid={NOBODY}", "--clear-groups", "--inh-caps=+dac_override",
           "--ambient-caps=+dac_override"]
    return subprocess.Popen(pre + [sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                                   "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=NEUTRAL_CWD, env=child_env(HOME=NEUTRAL_CWD))


needs_root_and_tools = pytest.mark.skipif(
    os.geteuid() != 0 or not all(map(shutil.which, ("prlimit", "setpriv"))),
    reason="runs `serve` as another user under RLIMIT_NPROC: needs root, prlimit and setpriv")


@needs_root_and_tools
def test_serve_at_its_thread_limit_stops_cleanly_and_one_thread_more_is_one_line():
    """``serve --workers W`` whose threads -- main and W workers -- are exactly what
    RLIMIT_NPROC allows serves, and SIGTERM stops it cleanly: the stop's watchdog cannot
    start its thread, and says that the kernel keeps the bound instead (SIGALRM); one
    worker more is refused with one ``aoprim:`` line and exit 2, as a
    port in use is; ``--procs 2`` over the limit the same, once the children find it.
    (One test for both backends: the limit counts every process of the user, so two of
    these at once would share it.)"""
    for backend in BACKENDS:
        _at_the_thread_limit(backend)


def _run_limited(limit, backend, *args):
    """Serve under ``limit``: if it listens, one echo and a SIGTERM.  What it did ("served"
    or "refused"), its exit status and its stderr."""
    p = _serve_limited(limit, *args, "--backend", backend)
    try:
        line = p.stdout.readline()
        if not line.startswith("listening on "):
            out, err = p.communicate(timeout=30)
            return "refused", p.returncode, line + out + err
        port = int(line.split()[-1].rsplit(":", 1)[1])
        with socket.create_connection((HOST, port), timeout=10) as c:
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        return "served", p.returncode, err
    finally:
        if p.poll() is None:        # (a failure above: not left to count against the next)
            p.kill()
            p.communicate()


def _at_the_thread_limit(backend):
    w = 6
    limit = _tasks_of(NOBODY) + 1 + w
    did, rc, err = _run_limited(limit, backend, "--workers", str(w))
    assert (did, rc) == ("served", 0) and "Traceback" not in err and "ERROR" not in err, err
    assert "cannot start the stop's watchdog thread" in err and "SIGALRM" in err, err
    for args in (["--workers", str(w + 1)], ["--procs", "2", "--workers", str(w)]):
        did, rc, err = _run_limited(limit, backend, *args)
        # (a server that took every thread the limit allows must still stop cleanly)
        assert "Traceback" not in err and "crashed" not in err, (args, did, err)
        assert (did, rc) == ("refused", 2), (args, did, rc, err)
        lines = [ln for ln in err.splitlines() if ln.startswith("aoprim: ")]
        assert lines and "thread limit" in lines[0], (args, err)
