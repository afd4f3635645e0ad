"""Helpers for tests that run servers or clients in subprocesses (no tests in here).

A subprocess must import the same aoprim build as the test process: an installed package
(CI) or an in-place build in a checkout (``AOPRIM_ALLOW_CHECKOUT=1``).  ``child_env()`` puts
the folder that holds the imported ``aoprim`` package first on ``PYTHONPATH``, so both work
whatever the child's working directory.
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aoprim

TESTS = pathlib.Path(__file__).resolve().parent
PKG_PARENT = str(pathlib.Path(aoprim.__file__).resolve().parent.parent)
NEUTRAL_CWD = tempfile.gettempdir()     # never the checkout: its aoprim/ has no extensions
HOST = "127.0.0.1"


def child_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, str(TESTS)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["AOPRIM_ALLOW_CHECKOUT"] = "1"
    env.pop("LD_PRELOAD", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


# -- /proc figures of a process ------------------------------------------------------------

def _status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_kib(pid="self"):
    """Resident set size in KiB (VmRSS)."""
    return _status(pid, "VmRSS")


def thread_count(pid="self"):
    return _status(pid, "Threads")


def fd_count(pid="self"):
    return len(os.listdir(f"/proc/{pid}/fd"))


def signal_masks(pid):
    """The signal sets /proc shows for ``pid`` -- SigBlk, SigIgn, SigCgt -- as ints (bit
    ``n - 1`` is signal ``n``)."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v, 16) for k, v in (line.split(":", 1) for line in f)
                if k in ("SigBlk", "SigIgn", "SigCgt")}


def end(p):
    """Kill the subprocess ``p`` if it still runs, reap it and close its pipes: a test that
    failed midway leaves neither a process nor a pipe, which a later test's garbage
    collection would report (as an unraisable ResourceWarning) in that test's name."""
    if p.poll() is None:
        p.kill()
        p.wait()
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            f.close()


def cpu_seconds(pid):
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- a server subprocess (python -m aoprim serve ...) ----------------------------------------

class ServerProc:
    """``python -m aoprim serve --stats-json ARGS`` in a subprocess; ``port``, ``pid``;
    ``stop()`` sends SIGTERM and returns a :class:`Stopped`."""

    def __init__(self, args, env=None, timeout=30, preexec_fn=None):
        cmd = [sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port", "0",
               "--stats-json", *args]      # (stop() reads the stats JSON line)
        # stderr goes to a file: a pipe nobody reads until the end would fill up with log
        # lines and block the server
        self._err = tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err,
                                  text=True, cwd=NEUTRAL_CWD, env=env or child_env(),
                                  preexec_fn=preexec_fn)
        self.pid = self.p.pid
        line = _readline(self.p, timeout)
        if not line.startswith("listening on "):
            self.p.kill()
            out, _ = self.p.communicate(timeout=10)
            raise RuntimeError(f"server did not start: {line!r}\n{out}\n{self.stderr()}")
        self.port = int(line.rsplit(":", 1)[1])
        self.address = (HOST, self.port)

    def stderr(self):
        self._err.seek(0)
        return self._err.read()

    def alive(self):
        return self.p.poll() is None

    def stop(self, timeout=30):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            out, _ = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.communicate(timeout=10)
            raise AssertionError(f"server did not stop within {timeout}s:\n"
                                 f"{self.stderr()[-4000:]}")
        err = self.stderr()
        self._err.close()
        stats = probe = None
        for line in out.splitlines():
            if line.startswith("stats "):
                stats = json.loads(line[6:])
            elif line.startswith("probe "):
                probe = json.loads(line[6:])
        return Stopped(self.p.returncode, stats, probe, out, err)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.communicate(timeout=10)
        if not self._err.closed:
            self._err.close()


class Stopped:
    """What a stopped server left: ``rc``, ``stats`` (its final stats() dict), ``probe``
    (probe_app's counts, if it served a probe_app handler), ``out``, ``err``."""

    def __init__(self, rc, stats, probe, out, err):
        self.rc, self.stats, self.probe, self.out, self.err = rc, stats, probe, out, err

    def error_lines(self):
        return [ln for ln in self.err.splitlines() if " ERROR " in ln or "Traceback" in ln]


def free_port():
    """A port that was free a moment ago (for a server that must know it before binding)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _readline(p, timeout):
    """One stdout line of ``p`` within ``timeout`` seconds (a server that never prints must
    not hang the test)."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            p.kill()
            raise AssertionError(f"no output within {timeout}s")
        return p.stdout.readline()
    finally:
        sel.close()


def query(address, request, timeout=5.0, attempts=20):
    """Send one u16 frame ``request`` on a fresh connection and return the decoded JSON
    reply (retried: under fault injection a connection may be killed)."""
    import struct
    last = None
    for _ in range(attempts):
        try:
            with socket.create_connection(address, timeout=timeout) as s:
                s.sendall(struct.pack(">H", len(request)) + request)
                hdr = _recv_exact(s, 2)
                (n,) = struct.unpack(">H", hdr)
                return json.loads(_recv_exact(s, n))
        except (OSError, ValueError, ConnectionError) as e:
            last = e
            time.sleep(0.05)
    raise AssertionError(f"query {request!r} failed {attempts} times: {last!r}")


def _recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        c = s.recv(n - len(buf))
        if not c:
            raise ConnectionError("EOF")
        buf += c
    return bytes(buf)
