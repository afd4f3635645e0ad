"""The server groups: aoprim's echo server beside asyncio echo servers, under the project's
load generator (``python -m aoprim loadgen``), every server in its own fresh process.

Servers (``server_cmd``):
  aoprim            ``python -m aoprim serve --app echo`` (the default Layer 1 backend)
  aoprim-NAME       the same with ``--backend NAME``, for every other backend in
                    ``aoprim.server.loop.BACKENDS`` (e.g. aoprim-epoll; a backend joins
                    automatically when it lands)
  aoprim-base       aoprim served from another checkout (``TREES``; echo_compare's
                    ``--baseline-tree``)
  asyncio           ``echo_asyncio.py``: an asyncio Protocol echo on the default loop (the
                    baseline of every server group)
  uvloop            the same Protocol on uvloop (when uvloop is installed)
  aoprim.aio        the same Protocol on aoprim's asyncio loop (when ``aoprim.aio`` exists)
  floor             ``echo_floor.py``: the smallest Python epoll echo loop (raw only)

Every server is measured warm (``warm_up``: one connection exchanges a few messages of the
scenario and closes before the load starts): a fresh asyncio process serves its 256 KiB
``recv`` with glibc mmap/mremap/munmap on every read until one such block has been freed,
a start-up artefact, not asyncio's cost.

Figures per run (``run_one``): messages/s, latency p50/p99 (send of a message to the arrival
of its last byte), server CPU per message (user+sys of the server process over the measured
window, from /proc/PID/stat), minor page faults per message (field 10 of the same file, over
the same window: ~0 when the server's buffers stay resident; a page per page of message
when memory is handed back to the kernel and touched afresh), and syscalls per message: ``perf stat -e
raw_syscalls:sys_enter -p PID`` counts every system call the server makes over a window
inside the measured one (it starts once the server holds every connection of the load --
its /proc/PID/fd count says so -- plus the generator's warm-up and a tenth of the window, and
lasts half of it); syscalls/msg = count / (msgs/s x perf's window).  Without a working
``perf`` the figure is absent and ``syscall_method()`` says why.

This module imports only the standard library, so the checkout's bench/echo_compare.py can
load it by path whatever aoprim is installed.
"""
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["HOST", "SCENARIOS", "TREES", "server_cmd", "warm_up", "run_one", "one_cpu",
           "available_servers", "start_server", "stop_server", "ServerUnavailable",
           "syscall_method", "count_syscalls", "syscall_counter"]

HERE = os.path.dirname(os.path.abspath(__file__))
HOST = "127.0.0.1"
# never run `python -m aoprim` from a checkout: it would import the uncompiled aoprim/ there
CWD = tempfile.gettempdir()

# name -> load.  raw: ping-pong (pipeline 1); u16 pipelined: every frame gets its own reply.
SCENARIOS = {
    "raw-1k-10": dict(framing="raw", size=1024, conns=10, pipeline=1),
    "raw-1k-100": dict(framing="raw", size=1024, conns=100, pipeline=1),
    "u16-64x16-10": dict(framing="u16", size=64, conns=10, pipeline=16),
    "raw-1k-1000": dict(framing="raw", size=1024, conns=1000, pipeline=1),
    "raw-64-10": dict(framing="raw", size=64, conns=10, pipeline=1),
    "raw-16k-10": dict(framing="raw", size=16384, conns=10, pipeline=1),
    # the large messages run with the server and the load generator on one CPU (one_cpu:
    # why below)
    "raw-64k-10": dict(framing="raw", size=65536, conns=10, pipeline=1, one_cpu=True),
    "raw-256k-10": dict(framing="raw", size=262144, conns=10, pipeline=1, one_cpu=True),
    "raw-1m-10": dict(framing="raw", size=1048576, conns=10, pipeline=1, one_cpu=True),
    # u32 frames of 1 MiB, ping-pong (aoprim: --max-frame 1 MiB)
    "u32-1m-10": dict(framing="u32", size=1048576, conns=10, pipeline=1, max_frame=1048576,
                      one_cpu=True),
}


def one_cpu():
    """The CPU a ``one_cpu`` scenario puts both the server and the load generator on (this
    process's last allowed CPU), or None where there is nothing to choose.

    Why: a large message's CPU is mostly the kernel copying it, and what that copy costs
    depends on where the sender's cache lines are.  With the two processes free to run on
    either vCPU of this VM, one round's sys time per 64 KiB message was 24 us and the next
    35-50 us, for every server alike (the host places the vCPUs), so a median of a few rounds
    ranked the servers by luck.  On one CPU the spread is a few per cent and every server
    pays the same copy; the server's CPU per message is what the scenario measures."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return cpus[-1] if len(cpus) > 1 else None


def _pin(pid, cpu):
    if cpu is not None:
        try:
            os.sched_setaffinity(pid, {cpu})
        except OSError:         # the process is already gone: its run reports that
            pass


# where each aoprim variant is imported from: None = this interpreter's aoprim; a path = a
# checkout with an in-place build (echo_compare's --tree / --baseline-tree)
TREES = {"aoprim": None, "aoprim-base": None}


def _aoprim_pythonpath():
    """The folder holding the aoprim that this process imported (if it did), so that the
    server and load-generator children import the same build from any working directory."""
    mod = sys.modules.get("aoprim")
    if mod is None or not getattr(mod, "__file__", None):
        return None
    return os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__)))


def _env(tree=None):
    env = dict(os.environ)
    path = tree or _aoprim_pythonpath()
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
    env.pop("LD_PRELOAD", None)
    return env


def _backend_of(server):
    """``aoprim-NAME`` -> NAME (the Layer 1 backend it is served on); None for ``aoprim``,
    ``aoprim-base`` and the other servers."""
    m = re.fullmatch(r"aoprim-(\w+)", server)
    return m.group(1) if m and m.group(1) != "base" else None


def _tree_of(server):
    """The checkout ``server`` is imported from (None: this process's aoprim): a backend
    variant and aoprim.aio are the same package as "aoprim" unless TREES names them, so
    large_compare's --baseline-tree swaps aoprim.aio too."""
    if server in TREES:
        return TREES[server]
    return TREES.get("aoprim") if _backend_of(server) or server == "aoprim.aio" else None


def _prints_stats_on_request(server):
    """Whether ``server``'s command line prints its stats JSON line only with --stats-json
    (a baseline checkout from before that flag prints it always, and refuses the flag)."""
    tree = _tree_of(server)
    if tree is None:
        return True
    try:
        with open(os.path.join(tree, "aoprim", "server", "cli.py")) as f:
            return "--stats-json" in f.read()
    except OSError:
        return False


def server_cmd(server, framing, max_frame=None):
    """The argv that starts ``server`` (see the module docstring) on a free port;
    ``max_frame``: aoprim's --max-frame (the asyncio servers take any frame)."""
    if server == "floor":
        return [sys.executable, os.path.join(HERE, "echo_floor.py"), "--host", HOST,
                "--port", "0", "--framing", framing]
    if server in TREES or _backend_of(server) or server == "aoprim":
        cmd = [sys.executable, "-m", "aoprim", "serve", "--app", "echo", "--host", HOST,
               "--port", "0", "--framing", framing, "--log-level", "WARNING"]
        if _prints_stats_on_request(server):
            cmd += ["--stats-json"]         # the stats JSON line run_one reads at the stop
        if _backend_of(server):
            cmd += ["--backend", _backend_of(server)]
        if max_frame is not None:
            cmd += ["--max-frame", str(max_frame)]
        return cmd
    loop = {"asyncio": "asyncio", "uvloop": "uvloop", "aoprim.aio": "aio"}[server]
    return [sys.executable, os.path.join(HERE, "echo_asyncio.py"), "--host", HOST, "--port",
            "0", "--framing", framing, "--loop", loop]


def aio_missing():
    """Why aoprim.aio cannot serve here (None when it can): the one check behind
    available_servers() and aio.available_loops()."""
    try:
        import aoprim.aio
    except ImportError as e:
        return f"aoprim.aio is not available ({e})"
    if not hasattr(aoprim.aio, "new_event_loop"):
        return "aoprim.aio is not available (aoprim.aio has no new_event_loop())"
    return None


def available_servers():
    """([server names that can run here], [(name, reason) skipped]).  The extra Layer 1
    backends and aoprim.aio are found at run time: they join once they exist."""
    run, skipped = ["aoprim"], []
    try:
        from aoprim.server.loop import BACKENDS
    except ImportError as e:
        BACKENDS = ("selectors",)
        skipped.append(("aoprim-BACKEND", f"aoprim.server.loop not importable: {e}"))
    others = [b for b in BACKENDS if b != "selectors"]
    run += [f"aoprim-{b}" for b in others]
    if not others:
        skipped.append(("aoprim-BACKEND", "aoprim.server.loop.BACKENDS has only "
                        "'selectors' (no other Layer 1 backend is built into this aoprim)"))
    run.append("asyncio")
    try:
        import uvloop  # noqa: F401
        run.append("uvloop")
    except ImportError:
        skipped.append(("uvloop", "uvloop is not installed (pip install uvloop)"))
    why = aio_missing()
    if why:
        skipped.append(("aoprim.aio", why))
    else:
        run.append("aoprim.aio")
    return run, skipped


# -- syscalls ---------------------------------------------------------------------------------

_PERF = {}


def syscall_method():
    """(how syscalls are counted, or None, and why not).  Checked once: ``perf stat`` on the
    raw_syscalls:sys_enter tracepoint of a short-lived child."""
    if "m" in _PERF:
        return _PERF["m"]
    perf = shutil.which("perf")
    if not perf:
        _PERF["m"] = (None, "perf is not installed (apt install linux-perf), so syscalls per "
                            "message are not measured")
        return _PERF["m"]
    p = subprocess.Popen([sys.executable, "-c", "import os, time\nt = time.monotonic() + 1.0\n"
                          "while time.monotonic() < t: os.getppid()"])
    try:
        time.sleep(0.2)
        n, why = count_syscalls(p.pid, 0.2)
    finally:
        p.kill()
        p.wait()
    if n is None:
        _PERF["m"] = (None, f"perf stat cannot count syscalls here: {why}")
    else:
        _PERF["m"] = ("perf stat -e raw_syscalls:sys_enter -p PID over half the measured "
                      "window, once every connection is up; syscalls/msg = count / (msgs/s x "
                      "perf's window); first round only", None)
    return _PERF["m"]


def count_syscalls(pid, seconds):
    """(system calls made by process ``pid``, all threads, over ``seconds``; None and the
    reason if perf cannot count them)."""
    perf = shutil.which("perf")
    if not perf:
        return None, "no perf"
    try:
        r = subprocess.run([perf, "stat", "-x,", "-e", "raw_syscalls:sys_enter", "-p", str(pid),
                            "--", "sleep", repr(seconds)], capture_output=True, text=True,
                           timeout=seconds + 30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    for line in r.stderr.splitlines():
        parts = line.split(",")
        if len(parts) >= 3 and "raw_syscalls:sys_enter" in parts[2]:
            try:
                return int(parts[0]), None
            except ValueError:
                return None, line.strip()
    return None, (r.stderr.strip().splitlines() or ["no output"])[-1]


def syscall_counter(pid, conns, lead, window):
    """Count the system calls of process ``pid`` (count_syscalls) over ``window`` seconds, in
    a thread: once the process holds ``conns`` more file descriptors than now (every
    connection of the load that is about to start is up), then ``lead`` seconds later (the
    load's warm-up and a margin).  Returns a function that waits for the count and gives
    (count, None), or (None, the reason)."""
    fds0 = _fds(pid)
    counted = {}

    def count():
        until = time.monotonic() + 60
        while _fds(pid) < fds0 + conns and time.monotonic() < until:
            time.sleep(0.01)
        time.sleep(lead)
        counted["n"], counted["why"] = count_syscalls(pid, window)

    th = threading.Thread(target=count, daemon=True)
    th.start()

    def result(timeout=60):
        th.join(timeout)
        return counted.get("n"), counted.get("why")
    return result


# -- one run ----------------------------------------------------------------------------------

def echo_exchange(s, msg, messages, what):
    """Send ``msg`` on the connected socket ``s`` (plain or TLS) ``messages`` times, one at
    a time, each echo read back whole and checked (RuntimeError naming ``what`` if not)."""
    for _ in range(messages):
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            chunk = s.recv(len(msg) - len(got))
            if not chunk:
                raise RuntimeError(f"{what}: the server closed the connection")
            got += chunk
        if got != msg:
            raise RuntimeError(f"{what}: the echo differs from what was sent")


def warm_up(port, framing, size, messages=8, wait_close=True):
    """Bring a fresh server to its steady state: one connection that exchanges ``messages``
    echoes of the scenario's size and framing, one at a time, then closes (and, with
    ``wait_close``, is seen closed: the server's EOF handling runs before the measured load
    starts)."""
    payload = (bytes(range(256)) * (size // 256 + 1))[:size]
    msg = payload if framing == "raw" else \
        struct.pack(">H" if framing == "u16" else ">I", size) + payload
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        echo_exchange(s, msg, messages, "warm-up")
        s.shutdown(socket.SHUT_WR)
        if wait_close:
            s.settimeout(10)
            if s.recv(1):
                raise RuntimeError("warm-up: unexpected bytes after the echoes")
    time.sleep(0.05)


# syscalls are counted over this fraction of the measured window (see run_one)
SYSCALL_WINDOW = 0.5


def _fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class ServerUnavailable(RuntimeError):
    """The server did not start (an unknown or unavailable backend, a missing module)."""


def start_server(cmd, what, env=None, error=ServerUnavailable, started=None):
    """(Popen, port): ``cmd`` -- a server that prints ``listening on HOST:PORT`` first, as
    every server the benchmarks compare does -- started in CWD with its stdout and stderr
    piped (text), once it has said so.  ``started(p)`` runs at once after the start (a CPU
    pin must precede the server's threads).  A server that says anything else is stopped and
    ``error("WHAT did not start: ...")`` raised with its first line and its last stderr
    line."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=CWD, env=env)
    try:
        if started is not None:
            started(p)
        line = p.stdout.readline()
        if line.startswith("listening on"):
            return p, int(line.rsplit(":", 1)[1])
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        err = p.stderr.read() if p.poll() is not None else ""
        raise error(f"{what} did not start: {line.strip()!r} "
                    f"{err.strip().splitlines()[-1:] or ''}")
    except BaseException:
        stop_server(p, 0)
        raise


def stop_server(p, timeout=30):
    """(stdout, stderr) a server started by start_server (or any piped Popen) wrote until it
    ended: SIGINT (the servers shut down cleanly on it, aoprim's printing its stats), then
    up to ``timeout`` seconds for it to exit, then SIGKILL.  Its pipes are closed; a second
    call, or one for a process already reaped, returns ("", "")."""
    out = err = ""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    if not any(f is not None and not f.closed for f in (p.stdout, p.stderr)):
        p.wait()
        return out, err
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    finally:
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()
    return out or "", err or ""


def run_one(server, scenario, duration=3.0, procs=1, warmup=0.5, warm=True, syscalls=False):
    """One server process, one load run; returns the load generator's summary plus
    ``server``, ``scenario``, ``warm``, and (aoprim) ``server_stats`` /
    ``send_syscalls_per_msg``, and with ``syscalls`` ``syscalls_per_msg`` when perf can count.
    ``warm``: warm_up() it first (the steady state); otherwise it is measured as started."""
    sc = SCENARIOS[scenario]
    env = _env(_tree_of(server))
    cpu = one_cpu() if sc.get("one_cpu") else None
    p, port = start_server(server_cmd(server, sc["framing"], sc.get("max_frame")), server,
                           env=env, started=lambda p: _pin(p.pid, cpu))
    try:
        if warm:
            warm_up(port, sc["framing"], sc["size"])
        lg_env = _env()
        lg = subprocess.Popen(
            [sys.executable, "-m", "aoprim", "loadgen", "--host", HOST, "--port", str(port),
             "--conns", str(sc["conns"]), "--size", str(sc["size"]), "--pipeline",
             str(sc["pipeline"]), "--framing", sc["framing"], "--duration", str(duration),
             "--warmup", str(warmup), "--procs", str(procs), "--cpu-pid", str(p.pid),
             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=CWD,
            env=lg_env)
        _pin(lg.pid, cpu)       # before its warm-up ends and the measured window opens
        counted = {}
        window = SYSCALL_WINDOW * duration
        if syscalls:
            # a window inside the measured one: once the server holds every connection of
            # the load (its fd count says so), after the generator's warm-up and a margin
            counter = syscall_counter(p.pid, sc["conns"], warmup + 0.1 * duration, window)
        out, err = lg.communicate(timeout=duration + 120)
        if syscalls:
            counted["n"], counted["why"] = counter()
        if not out.strip():
            raise RuntimeError(f"loadgen failed against {server}: {err}")
        res = json.loads(out)
        fl = (res.get("server_cpu") or {}).get("faults_per_msg")
        if fl is not None:
            res["faults_per_msg"] = fl
        if counted.get("n") is not None and res.get("msgs_per_s"):
            res["syscalls_per_msg"] = counted["n"] / (res["msgs_per_s"] * window)
        elif syscalls:
            res["syscalls_error"] = counted.get("why")
        sout, _ = stop_server(p)
        if "stats " in sout:
            st = json.loads(sout.split("stats ", 1)[1].splitlines()[0])
            res["server_stats"] = st
            if st.get("frames_out"):
                res["send_syscalls_per_msg"] = st["send_syscalls"] / st["frames_out"]
                if "messages_per_send" in st:
                    res["msgs_per_send"] = st["messages_per_send"]
        res["server"] = server if warm else f"{server}-cold"
        res["scenario"] = scenario
        res["warm"] = warm
        if cpu is not None:
            res["one_cpu"] = cpu
        return res
    finally:
        stop_server(p, 0)
