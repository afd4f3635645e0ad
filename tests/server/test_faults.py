"""Faults under Layer 2: a server subprocess runs under tests/support/faultinject.c (LD_PRELOAD),
which makes its socket calls fail with EINTR/EAGAIN, move fewer bytes than asked, and now
and then fail with ECONNRESET/EPIPE/ENOBUFS (see the C file for the knobs).

Checked: every connection that survives gets back exactly the bytes it sent; one that dies
got a prefix of them; every session's on_close runs exactly once; the receive pool returns
to its idle value while serving and to 0 after shutdown; the server's fd count returns to
its start; no ERROR line.  And EMFILE on accept (a lowered RLIMIT_NOFILE): accepting pauses
without spinning and recovers when descriptors come free.

Knobs: AOP_FAULT_SEED (default 11), AOP_FAULT_SECONDS (client load per server, default 3),
AOP_FAULT_KILL_RATE (connection-killing faults per socket call, default 0.0005).
"""
import os
import random
import resource
import shutil
import socket
import struct
import subprocess
import threading
import time

import pytest

from proc_support import (HOST, TESTS, ServerProc, child_env, cpu_seconds, fd_count,
                          free_port, query)
from probe_app import PROBE

SEED = int(os.environ.get("AOP_FAULT_SEED", "11"))
SECONDS = float(os.environ.get("AOP_FAULT_SECONDS", "3"))
CLIENTS = 4
KILL_RATE = float(os.environ.get("AOP_FAULT_KILL_RATE", "0.0005"))

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler (gcc) to build the fault-injection shim")
    out = tmp_path_factory.mktemp("faultinject") / "faultinject.so"
    r = subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-o", str(out),
                        str(TESTS / "faultinject.c"), "-ldl"], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        pytest.skip(f"the fault-injection shim does not build here: {r.stderr[-500:]}")
    return str(out)


def probe_server(args, env=None, **kw):
    return ServerProc(["probe_app:ProbeEcho", "--app-dir", str(TESTS), "--framing", "u16",
                       "--log-level", "WARNING", *args], env=env, **kw)


def wait_until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def idle_stats(srv):
    """Stats once only the probe's own session is open and nothing is buffered."""
    box = {}

    def ok():
        box["st"] = st = query(srv.address, PROBE)
        return (st["connections"] == 1 and st["rx_slots_in_use"] == 1 and
                st["tx_slots_in_use"] == 0)
    try:
        wait_until(ok, 15, "the server to go idle")
    except AssertionError:
        raise AssertionError(f"not idle: {box.get('st')}") from None
    return box["st"]


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.rounds = self.bytes = self.connections = self.killed = 0
        self.mismatch = []

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


def _random_frames(rnd):
    frames = []
    total = 0
    for _ in range(rnd.randrange(1, 40)):
        r = rnd.random()
        n = (0 if r < 0.05 else rnd.randrange(1, 200) if r < 0.6 else
             rnd.randrange(200, 5000) if r < 0.95 else rnd.randrange(5000, 40000))
        if total + n > 120000:
            break
        frames.append(struct.pack(">H", n) + rnd.randbytes(n))
        total += n + 2
    return b"".join(frames)


def client(port, seed, t_end, tally):
    """Pipelined random u16 frames; each round's echo must be byte-identical.  A connection
    the faults kill must have delivered a prefix; then a new one is opened."""
    rnd = random.Random(seed)
    while time.monotonic() < t_end:
        try:
            s = socket.create_connection((HOST, port), timeout=10)
        except OSError:
            time.sleep(0.01)
            continue
        tally.add(connections=1)
        with s:
            s.settimeout(10)
            while time.monotonic() < t_end:
                out = _random_frames(rnd)
                got = bytearray()
                try:
                    s.sendall(out)
                    while len(got) < len(out):
                        chunk = s.recv(len(out) - len(got))
                        if not chunk:
                            raise ConnectionResetError("EOF")
                        got += chunk
                except socket.timeout:
                    tally.mismatch.append(("timeout", len(out), len(got)))
                    return
                except OSError:         # reset, broken pipe, not connected: killed
                    if bytes(got) != out[:len(got)]:
                        tally.mismatch.append(("prefix", len(out), len(got)))
                    tally.add(killed=1)
                    break
                if bytes(got) != out:
                    tally.mismatch.append(("round", len(out), len(got)))
                tally.add(rounds=1, bytes=len(out))


def churn(port, seed, t_end, tally):
    """Short connections: a few frames, then a half-close; the echo of every frame must
    come back before the server's EOF (unless a fault killed the connection: a prefix)."""
    rnd = random.Random(seed)
    while time.monotonic() < t_end:
        out = _random_frames(rnd)[:20000]
        try:
            s = socket.create_connection((HOST, port), timeout=10)
        except OSError:
            time.sleep(0.01)
            continue
        tally.add(connections=1)
        got = bytearray()
        with s:
            try:
                s.sendall(out)
                s.shutdown(socket.SHUT_WR)
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    got += chunk
            except socket.timeout:
                tally.mismatch.append(("churn timeout", len(out), len(got)))
                return
            except OSError:             # reset, broken pipe, not connected: killed
                tally.add(killed=1)
        if bytes(got) != out[:len(got)]:
            tally.mismatch.append(("churn prefix", len(out), len(got)))
        elif len(got) == len(out):
            tally.add(rounds=1, bytes=len(out))


def guarded(fn, tally):
    """A client thread's unexpected exception fails the test (recorded as a mismatch)."""
    def run(*args):
        try:
            fn(*args)
        except BaseException as e:      # noqa: BLE001 - reported by the test
            tally.mismatch.append(("client raised", repr(e)))
    return run


@pytest.mark.parametrize("workers", [0, 2])
def test_echo_survives_injected_faults(shim, tmp_path, workers):
    port = free_port()
    report = tmp_path / "faults.json"
    env = child_env(LD_PRELOAD=shim, AOP_FAULT_PORT=port, AOP_FAULT_SEED=SEED + workers,
                    AOP_FAULT_REPORT=report, AOP_FAULT_KILL=KILL_RATE)
    srv = probe_server(["--port", str(port), "--workers", str(workers)], env=env)
    try:
        fds0 = fd_count(srv.pid)
        tally = Tally()
        t_end = time.monotonic() + SECONDS
        threads = [threading.Thread(target=guarded(churn if i == 0 else client, tally),
                                    args=(port, SEED * 100 + i, t_end, tally))
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 60)
        assert not any(t.is_alive() for t in threads), "a client thread hung"
        st = idle_stats(srv)
        wait_until(lambda: fd_count(srv.pid) == fds0, 10,
                   f"the server's fd count to return to {fds0} (now {fd_count(srv.pid)})")
    finally:
        done = srv.stop()
    faults = __import__("json").loads(report.read_text())
    print(f"[faults] workers={workers}: rounds={tally.rounds} bytes={tally.bytes} "
          f"connections={tally.connections} killed={tally.killed} injected={faults} "
          f"closes={done.stats['closes']}")
    assert not tally.mismatch, tally.mismatch[:5]
    assert tally.rounds > 20 and tally.connections > 0
    assert done.rc == 0, done.err[-3000:]
    assert not done.error_lines(), done.error_lines()[:10]
    fin = done.stats
    assert fin["rx_slots_in_use"] == 0 and fin["tx_slots_in_use"] == 0, fin
    assert fin["live_sessions"] == 0 and fin["connections"] == 0, fin
    pr = done.probe
    assert pr["not_once"] == {}, f"on_close ran other than once: {pr['not_once']}"
    assert pr["connects"] == pr["closed_sessions"] == fin["connections_total"], (pr, fin)
    assert pr["read_after_close"] == 0
    assert st["probe"]["close_calls"] == st["probe"]["closed_sessions"]
    for k in ("eintr", "eagain", "short", "accept"):
        assert faults[k] > 0, f"no {k} fault was injected: {faults}"


@pytest.mark.parametrize("workers", [0, 2])
def test_shutdown_under_load_and_faults(shim, tmp_path, workers):
    """SIGTERM while clients are mid-stream and faults keep coming: a clean exit, every
    session closed once, every slot back."""
    port = free_port()
    report = tmp_path / "faults.json"
    env = child_env(LD_PRELOAD=shim, AOP_FAULT_PORT=port, AOP_FAULT_SEED=SEED + 7 + workers,
                    AOP_FAULT_REPORT=report, AOP_FAULT_KILL=KILL_RATE)
    srv = probe_server(["--port", str(port), "--workers", str(workers)], env=env)
    tally = Tally()
    t_end = time.monotonic() + 2.0
    threads = [threading.Thread(target=guarded(churn if i == 0 else client, tally),
                                args=(port, SEED * 200 + i, t_end, tally))
               for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: tally.rounds > 20, 10, "the load to start")
        done = srv.stop()               # mid-stream
    finally:
        srv.kill()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    print(f"[faults] shutdown under load, workers={workers}: rounds={tally.rounds} "
          f"killed={tally.killed} closes={done.stats and done.stats['closes']}")
    assert not tally.mismatch, tally.mismatch[:5]
    assert done.rc == 0, done.err[-3000:]
    assert not done.error_lines(), done.error_lines()[:10]
    fin = done.stats
    assert fin["rx_slots_in_use"] == 0 and fin["tx_slots_in_use"] == 0, fin
    assert fin["live_sessions"] == 0 and fin["connections"] == 0, fin
    pr = done.probe
    assert pr["not_once"] == {}, f"on_close ran other than once: {pr['not_once']}"
    assert pr["connects"] == pr["closed_sessions"] == fin["connections_total"], (pr, fin)


def test_without_faults_the_shim_is_transparent(shim, tmp_path):
    """The control: the shim loaded with every rate at 0 changes nothing."""
    port = free_port()
    report = tmp_path / "faults.json"
    env = child_env(LD_PRELOAD=shim, AOP_FAULT_PORT=port, AOP_FAULT_REPORT=report,
                    AOP_FAULT_EINTR=0, AOP_FAULT_EAGAIN=0, AOP_FAULT_SHORT=0,
                    AOP_FAULT_KILL=0, AOP_FAULT_ACCEPT=0)
    srv = probe_server(["--port", str(port)], env=env)
    try:
        tally = Tally()
        client(port, 5, time.monotonic() + 0.5, tally)
    finally:
        done = srv.stop()
    faults = __import__("json").loads(report.read_text())
    assert faults["calls"] > 0, "the shim saw none of the server's socket calls"
    assert tally.killed == 0 and not tally.mismatch and tally.rounds > 0
    assert done.rc == 0 and done.probe["not_once"] == {}


# -- EMFILE on accept ---------------------------------------------------------------------------

NOFILE = 40


def _low_nofile():
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))


def _ping(s, tag):
    msg = struct.pack(">H", len(tag)) + tag
    s.sendall(msg)
    got = b""
    while len(got) < len(msg):
        c = s.recv(len(msg) - len(got))
        if not c:
            raise ConnectionError("EOF")
        got += c
    return got == msg


def test_emfile_pauses_accepting_without_spinning_and_recovers():
    srv = probe_server([], preexec_fn=_low_nofile)
    socks = []
    try:
        fds0 = fd_count(srv.pid)
        room = NOFILE - fds0
        assert room > 5, f"the server already holds {fds0} fds"
        for cycle in range(2):
            new = [socket.create_connection(srv.address, timeout=10)
                   for _ in range(room + 15)]      # 15 more than the server can hold
            socks += new
            wait_until(lambda: fd_count(srv.pid) == NOFILE, 10, "the server to run out of fds")
            c0 = cpu_seconds(srv.pid)
            time.sleep(1.0)                         # out of descriptors for a second
            busy = cpu_seconds(srv.pid) - c0
            assert busy < 0.5, f"the server spun at EMFILE ({busy:.2f} s of CPU in 1 s)"
            accepted, waiting = new[:room], new[room:]
            for i, s in enumerate(accepted):        # accepted ones are served meanwhile
                assert _ping(s, b"a%d" % i)
            for s in accepted[:20]:                 # free descriptors: the rest get in
                s.close()
                socks.remove(s)
            for i, s in enumerate(waiting):
                assert _ping(s, b"w%d" % i)
            for s in socks:
                s.close()
            socks = []
            wait_until(lambda: fd_count(srv.pid) == fds0, 10, "the fds to come back")
        st = idle_stats(srv)
        assert st["accept_errors"] > 0, st
    finally:
        for s in socks:
            s.close()
        done = srv.stop()
    assert done.rc == 0
    assert "pausing accepts" in done.err
    assert not done.error_lines(), done.error_lines()[:10]
    assert done.stats["rx_slots_in_use"] == 0 and done.stats["live_sessions"] == 0
    assert done.probe["not_once"] == {}
    assert done.probe["connects"] == done.probe["closed_sessions"]
