"""The aio groups (``python -m aoprim bench --only aio``): asyncio's loop, uvloop,
rloop and aoprim.aio side by side, the same application code on each.

Scenarios (``SCENARIOS``), every server in its own fresh process, warmed first:
  aio-raw-1k-10, aio-raw-1k-100   Protocol echo, raw 1 KiB ping-pong, 10 / 100 connections
  aio-u16-64x16-10                Protocol, u16-framed 64 B pipelined 16 deep, one write per frame
  aio-streams-u16-64x16-10        the same load on streams (StreamReader/StreamWriter: a write
                                  per frame, ``await drain()`` per read)
  aio-streams-raw-1k-10           streams, raw 1 KiB ping-pong (a write + drain per read)
      load: ``python -m aoprim loadgen`` (echo verified); figure: server CPU per message
  aio-http-uvicorn                uvicorn + httptools + a minimal Starlette app
                                  (``python -m uvicorn ... --loop L``), ``wrk -t1 -c50``
  aio-http-aiohttp                aiohttp.web's "Hello, World!", ``wrk -t1 -c50``
      figure: server CPU per request
  aio-sse-400                     uvicorn + Starlette streaming server-sent events: 400
                                  streams, one token per stream per 20 ms engine step;
                                  the client reads every stream (raw sockets, one selector
                                  thread); figure: server CPU per token
Server CPU is user+sys of the server process (/proc/PID/stat) over the measured window only.
The raw 1 KiB and u16 groups also carry ``instr_per_msg``: user-space instructions per message
counted by valgrind's callgrind (``callgrind_per_msg``: one connection, N then 2N messages,
the difference over N; deterministic, so counted once).

Loop microbenchmarks (in-process, kind ``python``, CPU ns/op of the measuring thread):
  aio-loop-call_soon    ``call_soon`` of n callbacks, run to completion
  aio-loop-call_later   ``call_later`` of n timers (distinct sub-millisecond delays, in
                        reverse order: the heap orders them), run to completion
  aio-loop-future       n futures: ``add_done_callback`` + ``set_result``, callbacks run

``TARGETS`` holds the goals aoprim.aio is measured against; ``markdown(doc)`` the README's table (``--markdown``).
"""
import contextlib
import gc
import json
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from aoprim.tools.loadgen import proc_cpu

from . import callgrind, runner, servers
from .fmt import num, spread, wrap

__all__ = ["LOOPS", "SCENARIOS", "TARGETS", "available_loops", "groups", "callgrind_per_msg",
           "callgrind_client", "run_one", "markdown", "render_group"]

HOST = "127.0.0.1"
CWD = tempfile.gettempdir()       # never import an uncompiled checkout by accident
LOOPS = ("asyncio", "uvloop", "rloop", "aoprim.aio")
# how each loop is named to aio_servers.py (--loop) and to uvicorn (--loop)
SERVER_LOOP = {"asyncio": "asyncio", "uvloop": "uvloop", "rloop": "rloop",
               "aoprim.aio": "aoprim"}
UVICORN_LOOP = {"asyncio": "asyncio", "uvloop": "uvloop", "rloop": "rloop:new_event_loop",
                "aoprim.aio": "aoprim.aio:new_event_loop"}

SCENARIOS = {
    "aio-raw-1k-10": dict(kind="echo", app="raw", framing="raw", size=1024, conns=10,
                          pipeline=1, callgrind="raw"),
    "aio-raw-1k-100": dict(kind="echo", app="raw", framing="raw", size=1024, conns=100,
                           pipeline=1),
    "aio-u16-64x16-10": dict(kind="echo", app="proto-u16", framing="u16", size=64, conns=10,
                             pipeline=16, callgrind="proto-u16"),
    "aio-streams-u16-64x16-10": dict(kind="echo", app="streams-u16", framing="u16", size=64,
                                     conns=10, pipeline=16),
    "aio-streams-raw-1k-10": dict(kind="echo", app="streams-raw", framing="raw", size=1024,
                                  conns=10, pipeline=1),
    "aio-http-uvicorn": dict(kind="http", app="uvicorn", conns=50),
    "aio-http-aiohttp": dict(kind="http", app="aiohttp", conns=50),
    "aio-sse-400": dict(kind="sse", app="uvicorn-sse", streams=400, step_ms=20),
}
TITLES = {
    "aio-raw-1k-10": "Protocol echo, raw 1 KiB ping-pong, 10 connections",
    "aio-raw-1k-100": "Protocol echo, raw 1 KiB ping-pong, 100 connections",
    "aio-u16-64x16-10": "Protocol, u16-framed 64 B x 16 pipelined, 10 connections",
    "aio-streams-u16-64x16-10": "streams (drain per read), u16 64 B x 16, 10 connections",
    "aio-streams-raw-1k-10": "streams (drain per read), raw 1 KiB ping-pong, 10 connections",
    "aio-http-uvicorn": "uvicorn + httptools + Starlette hello, wrk -t1 -c50",
    "aio-http-aiohttp": "aiohttp.web hello, wrk -t1 -c50",
    "aio-sse-400": "uvicorn + Starlette SSE, 400 streams, a token per stream per 20 ms step",
}
UNITS = {"echo": "CPU us/msg", "http": "CPU us/req", "sse": "CPU us/token"}
# the goal: aoprim.aio's figure at most LIMIT times uvloop's (lower is better), or, for the
# loop microbenchmarks (ns/op), at most uvloop's time per operation (= ops/s >= uvloop's)
TARGETS = {
    "aio-raw-1k-10": 1.0, "aio-raw-1k-100": 1.0, "aio-u16-64x16-10": 0.2,
    "aio-streams-u16-64x16-10": 0.3, "aio-streams-raw-1k-10": 1.0,
    "aio-http-uvicorn": 0.95, "aio-http-aiohttp": 0.95, "aio-sse-400": 0.95,
    "aio-loop-call_soon": 1.0, "aio-loop-call_later": 1.0, "aio-loop-future": 1.0,
}
INSTR_TARGET = {"aio-raw-1k-10": 1.3}     # callgrind instructions/msg vs uvloop's
# per mode: rounds, seconds per run, warm-up seconds, SSE streams, callgrind N (0: skip).
# The callgrind figure is (run of 2N - run of N) / N: a one-off cost in one of the two runs
# (a lazy import, a collection of the whole heap: 1-2 M instructions) moves it by up to
# 500-1,000 instructions at N = 2,000, by a fifth of that at 10,000 (each run is mostly
# start-up either way).
MODES = {
    "full": dict(rounds=3, duration=2.0, warmup=0.5, streams=400, callgrind_n=10000),
    "quick": dict(rounds=1, duration=1.0, warmup=0.3, streams=400, callgrind_n=3000),
    "tiny": dict(rounds=1, duration=0.3, warmup=0.1, streams=20, callgrind_n=0),
}


# -- which loops can run ------------------------------------------------------------------------

def available_loops():
    """([loops that can run here], [(loop, why not)])."""
    run, skipped = ["asyncio"], []
    for name, mod, hint in (("uvloop", "uvloop", "pip install uvloop"),
                            ("rloop", "rloop", "pip install rloop, or aoprim[bench]")):
        try:
            __import__(mod)
            run.append(name)
        except ImportError as e:
            skipped.append((name, f"{mod} is not installed ({e}; {hint})"))
    why = servers.aio_missing()
    if why:
        skipped.append(("aoprim.aio", why))
    else:
        run.append("aoprim.aio")
    return run, skipped


def _new_loop(name):
    if name == "uvloop":
        import uvloop
        return uvloop.new_event_loop()
    if name == "rloop":
        import rloop
        return rloop.new_event_loop()
    if name == "aoprim.aio":
        import aoprim.aio
        return aoprim.aio.new_event_loop()
    import asyncio
    return asyncio.new_event_loop()


def _env(extra=None):
    """The children's environment: they import the aoprim this process imported; ``extra``
    (run_one's ``env_extra``) is set on top."""
    e = servers._env()
    e.update(extra or {})
    return e


def _missing(kind):
    """Why the scenario kind cannot run here (None when it can)."""
    if kind == "http" and not shutil.which("wrk"):
        return "wrk is not installed (apt install wrk)"
    return None


def _missing_app(app):
    need = {"uvicorn": ("uvicorn", "starlette", "httptools"),
            "uvicorn-sse": ("uvicorn", "starlette", "httptools"), "aiohttp": ("aiohttp",)}
    for mod in need.get(app, ()):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (pip install {mod})"
    return None


# -- servers ------------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(loop, sc, env_extra=None):
    """(Popen, port) of the scenario's server on ``loop``, accepting connections."""
    env = _env(env_extra)
    if sc["app"] in ("uvicorn", "uvicorn-sse"):
        port = _free_port()
        target = "aoprim.benchmarks.aio_asgi:" + ("hello" if sc["app"] == "uvicorn" else "sse")
        p = subprocess.Popen([sys.executable, "-m", "uvicorn", target, "--host", HOST,
                              "--port", str(port), "--loop", UVICORN_LOOP[loop],
                              "--http", "httptools", "--no-access-log", "--log-level", "info",
                              "--lifespan", "off"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             cwd=CWD, env=env)
        seen = []
        while True:                 # uvicorn says so once its socket listens
            line = p.stderr.readline()
            if not line:
                p.wait(10)
                raise RuntimeError(f"uvicorn on {loop} did not start: {''.join(seen)[-800:]}")
            seen.append(line)
            if "Uvicorn running on" in line:
                return p, port
    return servers.start_server(
        [sys.executable, "-m", "aoprim.benchmarks.aio_servers", "--loop", SERVER_LOOP[loop],
         "--app", sc["app"], "--host", HOST, "--port", "0"], f"{loop}/{sc['app']}", env=env,
        error=RuntimeError)


def _cpu(pid):
    return proc_cpu(pid)[:2]            # (user, sys) seconds


def _per(c0, c1, n):
    u, s = c1[0] - c0[0], c1[1] - c0[1]
    return {"cpu_us": (u + s) / n * 1e6, "user_us": u / n * 1e6, "sys_us": s / n * 1e6}


def _load_echo(sc, port, pid, duration, warmup, env_extra=None):
    lg = subprocess.run(
        [sys.executable, "-m", "aoprim", "loadgen", "--host", HOST, "--port", str(port),
         "--conns", str(sc["conns"]), "--size", str(sc["size"]), "--pipeline",
         str(sc["pipeline"]), "--framing", sc["framing"], "--duration", str(duration),
         "--warmup", str(warmup), "--cpu-pid", str(pid), "--json"],
        capture_output=True, text=True, timeout=duration + 120, cwd=CWD, env=_env(env_extra))
    if not lg.stdout.strip():
        raise RuntimeError(f"loadgen failed: {lg.stderr[-800:]}")
    r = json.loads(lg.stdout)
    if r["errors"]:
        raise AssertionError(f"echo verification failed: {r['errors'][:3]}")
    c = r["server_cpu"]
    return {"value": c["cpu_us_per_msg"], "msgs": r["msgs"], "msgs_per_s": r["msgs_per_s"],
            "user_us_per_msg": c["user_us_per_msg"], "sys_us_per_msg": c["sys_us_per_msg"]}


def _warm_http(port, requests=4):
    import http.client
    c = http.client.HTTPConnection(HOST, port, timeout=10)
    for _ in range(requests):
        c.request("GET", "/")
        r = c.getresponse()
        if r.status != 200 or r.read() != b"Hello, World!":
            raise RuntimeError("warm-up: unexpected HTTP response")
    c.close()


def _load_http(sc, port, pid, duration):
    c0 = _cpu(pid)
    t0 = time.monotonic()
    w = subprocess.run(["wrk", "-t1", f"-c{sc['conns']}", f"-d{max(1, round(duration))}s",
                        f"http://{HOST}:{port}/"], capture_output=True, text=True,
                       timeout=duration + 60)
    elapsed = time.monotonic() - t0
    c1 = _cpu(pid)
    m = re.search(r"(\d+) requests in", w.stdout)
    if not m or "Non-2xx" in w.stdout or "Socket errors" in w.stdout:
        raise RuntimeError(f"wrk failed or saw errors: {w.stdout[-800:]}{w.stderr[-400:]}")
    n = int(m.group(1))
    per = _per(c0, c1, n)
    return {"value": per["cpu_us"], "msgs": n, "msgs_per_s": n / elapsed,
            "user_us_per_msg": per["user_us"], "sys_us_per_msg": per["sys_us"]}


def sse_client(port, streams, duration, warmup, pid, tokens_per_stream=10 ** 7):
    """Open ``streams`` SSE streams and read them all from one selector thread (raw
    sockets); once every stream has delivered a token and ``warmup`` has passed, count the
    tokens received and the server's CPU over ``duration``.  Returns the figures."""
    sel = selectors.DefaultSelector()
    req = (f"GET /sse?n={tokens_per_stream} HTTP/1.1\r\nHost: {HOST}\r\n"
           f"Accept: text/event-stream\r\n\r\n").encode()
    conns = []
    try:
        for _ in range(streams):
            s = socket.create_connection((HOST, port), timeout=30)
            s.sendall(req)
            s.setblocking(False)
            st = {"sock": s, "tokens": 0, "tail": b""}
            sel.register(s, selectors.EVENT_READ, st)
            conns.append(st)
        total = [0]
        started = [0]

        def pump(until, all_started=False):
            while time.monotonic() < until:
                for key, _ in sel.select(0.05):
                    st = key.data
                    try:
                        data = st["sock"].recv(65536)
                    except BlockingIOError:
                        continue
                    if not data:
                        raise RuntimeError("the server closed an SSE stream")
                    buf = st["tail"] + data
                    k = buf.count(b"\n\n")          # one per event; chunk framing has none
                    st["tail"] = buf[-1:]
                    if k and not st["tokens"]:
                        started[0] += 1
                    st["tokens"] += k
                    total[0] += k
                if all_started and started[0] == streams:
                    return True
            return False
        if not pump(time.monotonic() + 60, all_started=True):
            raise RuntimeError(f"only {started[0]} of {streams} SSE streams started in 60 s")
        pump(time.monotonic() + warmup)
        n0, c0, t0 = total[0], _cpu(pid), time.monotonic()
        pump(t0 + duration)
        n1, c1, t1 = total[0], _cpu(pid), time.monotonic()
        # CPU time comes in 10 ms ticks: a server starved by a busy machine can show none
        # in a short window; the window grows (up to 4x, at least 10 s) until it shows 5
        while sum(c1) - sum(c0) < 0.05 and t1 - t0 < max(4 * duration, 10.0):
            pump(t1 + 0.25)
            n1, c1, t1 = total[0], _cpu(pid), time.monotonic()
    finally:
        for st in conns:
            sel.unregister(st["sock"])
            st["sock"].close()
        sel.close()
    n = n1 - n0
    if n <= 0:
        raise RuntimeError("no token arrived in the measured window")
    per = _per(c0, c1, n)
    return {"value": per["cpu_us"], "msgs": n, "msgs_per_s": n / (t1 - t0),
            "user_us_per_msg": per["user_us"], "sys_us_per_msg": per["sys_us"]}


def run_one(loop, scenario, duration, warmup, streams=400, env_extra=None, during=None):
    """One fresh server on ``loop``, warmed, one measured load; the figures ({"value": ...,
    "msgs": ..., ...}).  ``scenario``: a SCENARIOS name or such a dict; ``env_extra``: set
    in the server's and the load generator's environment; ``during(pid)``: a context manager
    entered after the warm-up (SSE: before its streams open) and left once the load is done
    (bench/aio_compare.py counts page faults and system calls in it)."""
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    p, port = start_server(loop, sc, env_extra)
    try:
        if sc["kind"] == "echo":
            # rloop 0.5 runs eof_received/connection_lost on the client's EOF but leaves the
            # socket open (the peer never sees the close): do not wait for it there
            servers.warm_up(port, sc["framing"], sc["size"], wait_close=(loop != "rloop"))
        elif sc["kind"] == "http":
            _warm_http(port)
        with during(p.pid) if during else contextlib.nullcontext():
            if sc["kind"] == "echo":
                return _load_echo(sc, port, p.pid, duration, warmup, env_extra)
            if sc["kind"] == "http":
                return _load_http(sc, port, p.pid, duration)
            # CPU time comes in 10 ms ticks: an SSE window shorter than 1 s may count none
            return sse_client(port, streams, max(duration, 1.0), warmup, p.pid)
    finally:
        servers.stop_server(p, 20)


# -- callgrind ----------------------------------------------------------------------------------

def callgrind_client(port, app, n, size=1024):
    """One connection exchanging ``n`` messages, one at a time (raw ``size`` bytes) or in
    bursts of 16 pipelined u16 frames of 64 B."""
    import struct
    s = socket.create_connection((HOST, port), timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if app == "raw":
        msg, per = b"x" * size, 1
    else:
        msg, per = (struct.pack(">H", 64) + b"y" * 64) * 16, 16
    for _ in range(n // per):
        s.sendall(msg)
        got = 0
        while got < len(msg):
            chunk = s.recv(1 << 20)
            if not chunk:
                raise RuntimeError("server closed")
            got += len(chunk)
    s.close()


def callgrind_run(loop, app, n, tree=None, keep=False, size=1024):
    """(instructions, callgrind output file or None) of the server (``aio_servers --loop
    loop --app app``) for N messages, counted by ``callgrind.run``; with ``keep`` the caller
    removes the file."""
    env = _env()
    if tree:
        env["PYTHONPATH"] = tree
    cmd = [sys.executable, "-m", "aoprim.benchmarks.aio_servers", "--loop",
           SERVER_LOOP.get(loop, loop), "--app", app]
    return callgrind.run(cmd, lambda port: callgrind_client(port, app, n, size), env=env,
                         keep=keep, name=loop)


def callgrind_per_msg(loop, app, n, tree=None, size=1024):
    """User-space instructions per message: (run of 2N - run of N) / N."""
    return callgrind.per_message(
        lambda k, keep: callgrind_run(loop, app, k, tree, keep, size), n)[0]


# -- loop microbenchmarks -----------------------------------------------------------------------

def _call_soon(loop, n):
    count = [0]

    def cb():
        count[0] += 1

    def fn():
        count[0] = 0
        cs = loop.call_soon
        for _ in range(n):
            cs(cb)
        cs(loop.stop)
        loop.run_forever()
        assert count[0] == n, (count[0], n)
    return fn


def _call_later(loop, n):
    count = [0]

    def cb():
        count[0] += 1
        if count[0] == n:
            loop.stop()

    def fn():
        count[0] = 0
        cl = loop.call_later
        # distinct due times, pushed in reverse order, all at least 1 ms away: uvloop rounds
        # a delay to whole milliseconds and serves one that rounds to 0 by call_soon (a
        # Handle, no timer), so delays under 0.5 ms measured its call_soon against the
        # other loops' timer heaps
        for i in range(n, 0, -1):
            cl(1e-3 + i * 1e-7, cb)
        loop.run_forever()
        assert count[0] == n, (count[0], n)
    return fn


def _future(loop, n):
    count = [0]

    def cb(f):
        count[0] += 1

    def fn():
        count[0] = 0
        cf = loop.create_future
        for _ in range(n):
            f = cf()
            f.add_done_callback(cb)
            f.set_result(None)
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert count[0] == n, (count[0], n)
    return fn


MICRO = {
    "aio-loop-call_soon": ("loop.call_soon(cb) x n, run to completion", _call_soon, 20000),
    "aio-loop-call_later": ("loop.call_later(distinct delays >= 1 ms, cb) x n, run to completion",
                            _call_later, 5000),
    "aio-loop-future": ("create_future + add_done_callback + set_result x n, callbacks run",
                        _future, 10000),
}


class AioMicroGroup:
    """One loop microbenchmark: every loop, in-process, rounds interleaved (the loop order
    rotating).  A sample is ``k`` calls of the body (``n`` operations each, ``k`` calibrated
    so a sample takes about ``sample_s``) timed by this thread's CPU clock
    (``time.thread_time_ns``), so that time the thread spends preempted on a loaded machine
    is not counted; the figure is CPU ns per operation (ops/s = 1e9 / it).  Every sample
    starts from a collected heap (``gc.collect()`` before it, not timed): the bodies keep
    thousands of GC-tracked handles alive at once, and without it one loop's sample paid
    for collecting what the loop measured before it left (spreads of 386-579 ns around a
    470 ns median)."""
    kind = "python"
    family = "aio"
    compete = True
    default = False
    unit = "CPU ns/op"

    def __init__(self, gid, mode):
        title, self.make, n = MICRO[gid]
        self.id = gid
        self.title = title
        self.mode = MICRO_MODES[mode]
        self.n = max(16, int(n * self.mode["scale"]))
        self.params = {"n": self.n}
        self.series = []

    def steps(self, n_loops):
        return self.mode["rounds"] * n_loops

    def measure(self, loops, loop_skips, progress=None):
        m = self.mode
        skipped = [{"name": n, "reason": r} for n, r in loop_skips]
        live = {}
        try:
            for lp in loops:
                loop = _new_loop(lp)
                fn = self.make(loop, self.n)
                fn()                                     # warm-up
                t0 = time.thread_time_ns()
                fn()
                dt = max(time.thread_time_ns() - t0, 1)
                live[lp] = (loop, fn, max(1, min(1000, round(m["sample_s"] * 1e9 / dt))), [])
            for r in range(m["rounds"]):
                order = loops[r % len(loops):] + loops[:r % len(loops)]
                for lp in order:
                    _, fn, k, samples = live[lp]
                    gc.collect()
                    t0 = time.thread_time_ns()
                    for _ in range(k):
                        fn()
                    samples.append((time.thread_time_ns() - t0) / (k * self.n))
                    if progress:
                        progress.step(1, f"{self.id}: {lp}")
        finally:
            for loop, *_ in live.values():
                loop.close()
        entries = []
        for lp in loops:
            _, _, k, samples = live[lp]
            e = {"name": lp, "role": "baseline" if lp == "asyncio" else "candidate",
                 "n": self.n, "calls_per_sample": k, "samples": [round(x, 4) for x in samples]}
            e.update(runner.summarize(samples))
            e["metrics"] = {"ops_per_s": runner.summarize([1e9 / x for x in samples])}
            entries.append(e)
        return runner.finish_group(self, entries, skipped)


MICRO_MODES = {"full": dict(rounds=15, sample_s=0.1, scale=1.0),
               "quick": dict(rounds=5, sample_s=0.02, scale=1.0),
               "tiny": dict(rounds=2, sample_s=0.002, scale=0.05)}


# -- the server groups --------------------------------------------------------------------------

class AioServerGroup:
    kind = "server"
    family = "aio"
    compete = True
    default = False

    def __init__(self, scenario, mode):
        sc = SCENARIOS[scenario]
        self.scenario = scenario
        self.id = scenario
        self.title = TITLES[scenario]
        self.unit = UNITS[sc["kind"]]
        self.params = {k: v for k, v in sc.items() if k != "kind"}
        self.series = []
        self.mode = MODES[mode]
        self.callgrind = sc.get("callgrind") if self.mode["callgrind_n"] else None

    def steps(self, n_loops):
        return (self.mode["rounds"] + (1 if self.callgrind else 0)) * n_loops

    def measure(self, loops, loop_skips, progress=None):
        m = self.mode
        sc = SCENARIOS[self.scenario]
        skipped = [{"name": n, "reason": r} for n, r in loop_skips]
        why = _missing(sc["kind"]) or _missing_app(sc["app"])
        if why:
            if progress:
                progress.step(self.steps(len(loops)), f"{self.id}: skipped")
            return runner.finish_group(
                self, [], skipped + [{"name": lp, "reason": why} for lp in loops])
        runs = {lp: [] for lp in loops}
        failed = {}
        for r in range(m["rounds"]):
            order = loops[r % len(loops):] + loops[:r % len(loops)]
            for lp in order:
                if progress:
                    progress.step(0, f"{self.id}: {lp} (round {r + 1}/{m['rounds']})")
                try:
                    runs[lp].append(run_one(lp, self.scenario, m["duration"], m["warmup"],
                                            m["streams"]))
                except Exception as e:      # a failed run is reported, the others go on
                    failed.setdefault(lp, f"round {r + 1}: {type(e).__name__}: {e}"[:400])
                if progress:
                    progress.step(1)
        instr = {}
        if self.callgrind:
            if not shutil.which("valgrind"):
                skipped.append({"name": "callgrind", "reason": "valgrind is not installed"})
            for lp in loops:
                if progress:
                    progress.step(0, f"{self.id}: {lp} (callgrind)")
                if shutil.which("valgrind"):
                    try:
                        instr[lp] = callgrind_per_msg(lp, self.callgrind, m["callgrind_n"])
                    except Exception as e:
                        skipped.append({"name": f"{lp} callgrind", "reason": str(e)[:400]})
                if progress:
                    progress.step(1)
        entries = []
        for lp in loops:
            rs = runs[lp]
            if not rs:
                skipped.append({"name": lp, "reason": failed.get(lp, "no run completed")})
                continue
            vals = [x["value"] for x in rs]
            e = {"name": lp, "role": "baseline" if lp == "asyncio" else "candidate",
                 "samples": [round(v, 4) for v in vals], "rounds": len(rs)}
            e.update(runner.summarize(vals))
            metrics = {}
            for key in ("msgs_per_s", "user_us_per_msg", "sys_us_per_msg"):
                metrics[key] = runner.summarize([x[key] for x in rs])
            if lp in instr:
                metrics["instr_per_msg"] = runner.summarize([instr[lp]])
            e["metrics"] = metrics
            entries.append(e)
        return runner.finish_group(self, entries, skipped)


def groups(mode):
    return [AioServerGroup(s, mode) for s in SCENARIOS] + [AioMicroGroup(g, mode) for g in MICRO]


# -- reporting ----------------------------------------------------------------------------------

def _med(e, key=None):
    if key is None:
        return e["median"]
    return e.get("metrics", {}).get(key, {}).get("median")


def _by_name(g):
    return {e["name"]: e for e in g["entries"]}


def render_group(g):
    """The terminal table of one aio group: every loop's figure, its spread (with more than
    one round), its cost relative to asyncio and to uvloop (entry / other: below 1 is
    cheaper), and the callgrind count; within fmt.WIDTH columns."""
    ents = sorted(g["entries"], key=lambda e: e["median"], reverse=(g["better"] == "higher"))
    names = _by_name(g)
    lines = wrap(g["title"], f"\n[{g['id']}] ", "  ")
    lines.append(f"  {g['unit']}, {g['better']} is better; /asyncio, /uvloop = the row's "
                 "median / theirs (below 1: cheaper)")
    server = g["kind"] == "server"
    lines.append(f"  {'loop':<13} {g['unit']:>12} {'spread':>13} {'/asyncio':>9} "
                 f"{'/uvloop':>8}" + (f" {'per s':>8} {'user':>6} {'sys':>6} {'instr/msg':>10}"
                                      if server else f" {'ops/s':>9}"))
    for e in ents:
        rel = []
        for other in ("asyncio", "uvloop"):
            o = names.get(other)
            rel.append(f"x{e['median'] / o['median']:.2f}" if o and o["median"] else "-")
        name = ("* " if e["winner"] else "  ") + e["name"]
        line = (f"{name:<15} {num(e['median']):>12} "
                f"{spread(e, '-'):>13} {rel[0]:>9} {rel[1]:>8}")
        if server:
            ins = _med(e, "instr_per_msg")
            line += (f" {num(_med(e, 'msgs_per_s')):>8} {num(_med(e, 'user_us_per_msg')):>6} "
                     f"{num(_med(e, 'sys_us_per_msg')):>6} "
                     f"{'-' if ins is None else f'{ins:,.0f}':>10}")
        else:
            line += f" {num(1e9 / e['median']):>9}"
        lines.append(line)
    for s in g["skipped"]:
        lines += wrap(f"{s['name']}: {s['reason']}", "  (skipped ", "    ")
    return "\n".join(lines)


def target_rows(doc):
    """[(group id, what, aoprim.aio / uvloop, limit, held)] for every target that could be
    checked in ``doc``."""
    out = []
    for g in doc["groups"]:
        if g["family"] != "aio":
            continue
        names = _by_name(g)
        a, u = names.get("aoprim.aio"), names.get("uvloop")
        if not a or not u:
            continue
        if g["id"] in TARGETS:
            r = a["median"] / u["median"]
            out.append((g["id"], g["unit"], r, TARGETS[g["id"]], r <= TARGETS[g["id"]]))
        if g["id"] in INSTR_TARGET and _med(a, "instr_per_msg") and _med(u, "instr_per_msg"):
            r = _med(a, "instr_per_msg") / _med(u, "instr_per_msg")
            out.append((g["id"], "instructions/msg", r, INSTR_TARGET[g["id"]],
                        r <= INSTR_TARGET[g["id"]]))
    return out


def markdown(doc):
    """The README's aio table: per scenario each loop's median, aoprim.aio's and rloop's
    cost relative to uvloop and asyncio, the target and whether it holds."""
    gs = [g for g in doc["groups"] if g["family"] == "aio"]
    if not gs:
        return ""
    out = ["| load | unit | asyncio | uvloop | rloop | aoprim.aio | aoprim.aio / uvloop | "
           "aoprim.aio / asyncio | rloop / uvloop | target (aoprim.aio / uvloop) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def rel(a, b, key=None):
        if not a or not b:
            return "-"
        x, y = _med(a, key), _med(b, key)
        return f"{x / y:.2f}" if x and y else "-"
    targets = {(gid, unit): (r, lim, ok) for gid, unit, r, lim, ok in target_rows(doc)}
    for g in gs:
        n = _by_name(g)
        rows = [(g["unit"] + (" (ops/s = 1e9 / it)" if g["kind"] == "python" else ""),
                 None)]
        if any(_med(e, "instr_per_msg") for e in g["entries"]):
            rows.append(("instructions/msg (callgrind)", "instr_per_msg"))
        for unit, key in rows:
            cells = []
            for lp in LOOPS:
                e = n.get(lp)
                v = _med(e, key) if e else None
                cells.append("-" if v is None else (f"{v:,.0f}" if key else num(v)))
            t = targets.get((g["id"], "instructions/msg" if key else g["unit"]))
            lim = (TARGETS.get(g["id"]) if not key else INSTR_TARGET.get(g["id"]))
            tcell = "-" if lim is None else (
                f"<= {lim} ({'holds' if t and t[2] else 'MISSED' if t else 'not measured'})")
            out.append(f"| {g['title'] if key is None else ''} | {unit} | {' | '.join(cells)} | "
                       f"{rel(n.get('aoprim.aio'), n.get('uvloop'), key)} | "
                       f"{rel(n.get('aoprim.aio'), n.get('asyncio'), key)} | "
                       f"{rel(n.get('rloop'), n.get('uvloop'), key)} | {tcell} |")
    return "\n".join(out)
