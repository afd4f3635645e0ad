"""aoprim.aio against asyncio's default loop, uvloop and rloop (issues 12, 23): the same server
code (bench/aio_servers.py) on every loop, the same load generators, in one run.
(``python -m aoprim bench --only aio`` is the issue-23 table: every loop, every scenario.)

    python bench/aio_compare.py [--duration 3] [--rounds 3] [--scenario NAME ...]
                                [--tree CHECKOUT] [--base-tree CHECKOUT] [--syscalls]
                                [--json out.json]

Scenarios:
  proto-u16    u16-framed 64 B messages pipelined 16 deep on 10 connections; the server is
               a Protocol calling transport.write once per frame  (python -m aoprim loadgen)
  streams-u16  the same load; the server uses streams: writer.write per frame, await
               writer.drain() per read                            (python -m aoprim loadgen)
  raw-1k       raw 1 KiB ping-pong on 10 connections              (python -m aoprim loadgen)
  raw-64k, raw-256k, raw-1m
               raw 64 KiB / 256 KiB / 1 MiB ping-pong on 10 connections (issue 20)
  http         aiohttp, GET / "Hello, World!", HTTP/1.1 keep-alive, 50 connections  (wrk)

Method (as bench/echo_compare.py, whose warm-up and median it reuses): each server runs in its
own fresh process, is warmed by one connection (a few messages, then closed) before the
load starts, and its CPU time (user+sys, /proc/PID/stat) over the measured window is divided
by the messages (requests) served; minor page faults per message (/proc/PID/stat field 10)
are counted over the whole load generator run (its warm-up window included) and divided by
the messages that window would serve at the measured rate.  Rounds are interleaved (asyncio, uvloop, aoprim, asyncio,
...) and the median of each figure is reported; ratios are taken within the run only.

``--base-tree CHECKOUT`` adds a fourth server, ``aoprim-base``: aoprim.aio imported from
another in-place build (the code before a change), measured in the same interleaved rounds.

``--syscalls`` adds one pass per server under ``strace -f -c`` (attached after the warm-up,
for the whole load, which then runs without its own warm-up window): system calls per
message, by kind.  strace slows the server several-fold, so these runs give syscall counts
only, never CPU figures.
"""
import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from echo_compare import HOST, _median, warm_up  # noqa: E402

CWD = tempfile.gettempdir()       # never import the uncompiled checkout by accident
LOOPS = ("asyncio", "uvloop", "rloop", "aoprim")
SCENARIOS = {
    "proto-u16": dict(app="proto-u16", framing="u16", size=64, conns=10, pipeline=16),
    "streams-u16": dict(app="streams-u16", framing="u16", size=64, conns=10, pipeline=16),
    "streams-raw": dict(app="streams-raw", framing="raw", size=1024, conns=10, pipeline=1),
    "raw-1k": dict(app="raw", framing="raw", size=1024, conns=10, pipeline=1),
    "raw-64k": dict(app="raw", framing="raw", size=65536, conns=10, pipeline=1),
    "raw-256k": dict(app="raw", framing="raw", size=262144, conns=10, pipeline=1),
    "raw-1m": dict(app="raw", framing="raw", size=1 << 20, conns=10, pipeline=1),
    "http": dict(app="aiohttp", conns=50),
}
TARGETS = {   # aoprim's CPU per message at most this times the other loop's (issue 12)
    "proto-u16": {"asyncio": 0.4, "uvloop": 0.4},
    "streams-u16": {"asyncio": 0.4, "uvloop": 0.4},
    "raw-1k": {"asyncio": 1.0},
    "raw-64k": {"asyncio": 1.0},
    "raw-256k": {"asyncio": 1.0},
    "raw-1m": {"asyncio": 1.0},
    "http": {"asyncio": 1.0},
}
SEND = ("sendmsg", "sendto", "write", "writev", "send")
RECV = ("recvfrom", "recvmsg", "read", "recv")
POLL = ("epoll_wait", "epoll_pwait", "select", "poll")


def proc_cpu(pid):
    from aoprim.tools.loadgen import proc_cpu as _pc
    return _pc(pid)


def proc_minflt(pid):
    """Minor page faults of process ``pid`` so far (/proc/PID/stat field 10)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[7])


BASE_TREE = None                  # --base-tree: where the aoprim-base server imports from


def _env(tree):
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_server(loop, app, tree):
    if loop == "aoprim-base":
        loop, tree = "aoprim", BASE_TREE
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "aio_servers.py"), "--loop", loop,
                          "--app", app, "--host", HOST, "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=CWD,
                         env=_env(tree))
    line = p.stdout.readline()
    if not line.startswith("listening on"):
        p.kill()
        raise RuntimeError(f"{loop}/{app} did not start: {line!r} {p.stderr.read()}")
    return p, int(line.rsplit(":", 1)[1])


def stop_server(p):
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def warm_http(port, requests=4):
    import http.client
    c = http.client.HTTPConnection(HOST, port, timeout=10)
    for _ in range(requests):
        c.request("GET", "/")
        r = c.getresponse()
        if r.read() != b"Hello, World!":
            raise RuntimeError("warm-up: unexpected HTTP response")
    c.close()
    time.sleep(0.05)


def load_echo(sc, port, pid, duration, tree, warmup=0.5):
    f0 = proc_minflt(pid) if pid else None
    lg = subprocess.run(
        [sys.executable, "-m", "aoprim", "loadgen", "--host", HOST, "--port", str(port),
         "--conns", str(sc["conns"]), "--size", str(sc["size"]), "--pipeline",
         str(sc["pipeline"]), "--framing", sc["framing"], "--duration", str(duration),
         "--warmup", str(warmup), "--json"] + (["--cpu-pid", str(pid)] if pid else []),
        capture_output=True, text=True, timeout=duration + 120, cwd=CWD, env=_env(tree))
    f1 = proc_minflt(pid) if pid else None
    if not lg.stdout.strip():
        raise RuntimeError(f"loadgen failed: {lg.stderr}")
    r = json.loads(lg.stdout)
    if r["errors"]:
        raise AssertionError(f"echo verification failed: {r['errors'][:3]}")
    out = {"msgs": r["msgs"], "msgs_per_s": r["msgs_per_s"]}
    if pid:
        c = r["server_cpu"]
        out.update(cpu_us_per_msg=c["cpu_us_per_msg"], user_us_per_msg=c["user_us_per_msg"],
                   sys_us_per_msg=c["sys_us_per_msg"],
                   faults_per_msg=(f1 - f0) / (r["msgs"] * (duration + warmup) / duration))
    return out


def load_http(sc, port, pid, duration):
    c0 = proc_cpu(pid) if pid else None
    t0 = time.monotonic()
    w = subprocess.run(["wrk", "-t1", f"-c{sc['conns']}", f"-d{max(1, round(duration))}s",
                        f"http://{HOST}:{port}/"], capture_output=True, text=True,
                       timeout=duration + 60)
    elapsed = time.monotonic() - t0
    c1 = proc_cpu(pid) if pid else None
    m = re.search(r"(\d+) requests in", w.stdout)
    if not m or "Non-2xx" in w.stdout or "Socket errors" in w.stdout:
        raise RuntimeError(f"wrk failed or saw errors:\n{w.stdout}{w.stderr}")
    n = int(m.group(1))
    out = {"msgs": n, "msgs_per_s": n / elapsed}
    if pid:
        u, s = c1[0] - c0[0], c1[1] - c0[1]
        out.update(cpu_us_per_msg=(u + s) / n * 1e6, user_us_per_msg=u / n * 1e6,
                   sys_us_per_msg=s / n * 1e6, faults_per_msg=float("nan"))
    return out


def run_one(loop, scenario, duration, tree):
    sc = SCENARIOS[scenario]
    p, port = start_server(loop, sc["app"], tree)
    try:
        if scenario == "http":
            warm_http(port)
            return load_http(sc, port, p.pid, duration)
        warm_up(port, sc["framing"], sc["size"], wait_close=(loop != "rloop"))
        return load_echo(sc, port, p.pid, duration, tree)
    finally:
        stop_server(p)


def count_syscalls(loop, scenario, duration, tree):
    """One run under strace -f -c: {kind: calls per message} and the top calls."""
    sc = SCENARIOS[scenario]
    p, port = start_server(loop, sc["app"], tree)
    out_file = tempfile.mktemp(prefix="aio_strace_")
    try:
        if scenario == "http":
            warm_http(port)
        else:
            warm_up(port, sc["framing"], sc["size"], wait_close=(loop != "rloop"))
        st = subprocess.Popen(["strace", "-f", "-c", "-o", out_file, "-p", str(p.pid)],
                              stderr=subprocess.PIPE, text=True)
        # strace says so on stderr once attached: no sleep standing in for it
        line = st.stderr.readline()
        if "attached" not in line:
            raise RuntimeError(f"strace did not attach: {line!r}")
        if scenario == "http":
            r = load_http(sc, port, None, duration)
        else:
            r = load_echo(sc, port, None, duration, tree, warmup=0)
        st.send_signal(signal.SIGINT)
        st.communicate(timeout=30)
    finally:
        stop_server(p)
    calls = {}
    with open(out_file) as f:
        for ln in f:
            parts = ln.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls[parts[-1]] = int(parts[3])
    os.unlink(out_file)
    n = r["msgs"]
    return {
        "msgs": n,
        "send": sum(calls.get(k, 0) for k in SEND) / n,
        "recv": sum(calls.get(k, 0) for k in RECV) / n,
        "poll": sum(calls.get(k, 0) for k in POLL) / n,
        "total": sum(calls.values()) / n,
        "top": sorted(calls.items(), key=lambda kv: -kv[1])[:6],
    }


def compare(scenario, duration, rounds, tree, loops=LOOPS, log=print):
    runs = {lp: [] for lp in loops}
    for rnd in range(rounds):
        for lp in loops:
            r = run_one(lp, scenario, duration, tree)
            runs[lp].append(r)
            log(f"    round {rnd + 1} {lp:<8} {r['msgs_per_s']:>9.0f}/s "
                f"{r['cpu_us_per_msg']:>7.2f} us/msg")
    return {lp: {k: _median([r[k] for r in rs]) for k in
                 ("msgs_per_s", "cpu_us_per_msg", "user_us_per_msg", "sys_us_per_msg",
                  "faults_per_msg")}
            for lp, rs in runs.items()}


def report(scenario, res, sysc=None, log=print):
    unit = "req" if scenario == "http" else "msg"
    log(f"\n[{scenario}] {SCENARIOS[scenario]}")
    log(f"  {'loop':<11} {unit + '/s':>10} {'CPU us/' + unit:>11} {'user':>7} {'sys':>7} "
        f"{'flt/' + unit:>8}"
        + (f" {'send/' + unit:>9} {'recv/' + unit:>9} {'poll/' + unit:>9} {'all/' + unit:>8}"
           if sysc else ""))
    for lp, r in res.items():
        line = (f"  {lp:<11} {r['msgs_per_s']:>10.0f} {r['cpu_us_per_msg']:>11.2f} "
                f"{r['user_us_per_msg']:>7.2f} {r['sys_us_per_msg']:>7.2f} "
                f"{r['faults_per_msg']:>8.2f}")
        if sysc and lp in sysc:
            s = sysc[lp]
            line += f" {s['send']:>9.3f} {s['recv']:>9.3f} {s['poll']:>9.3f} {s['total']:>8.3f}"
        log(line)
    a = res["aoprim"]
    for base in ("asyncio", "uvloop", "aoprim-base"):
        if base in res:
            b = res[base]
            log(f"  aoprim vs {base}: CPU/{unit} x{a['cpu_us_per_msg'] / b['cpu_us_per_msg']:.2f}, "
                f"{unit}/s x{a['msgs_per_s'] / b['msgs_per_s']:.2f}")


def check_targets(results):
    out = []
    for sc, r in results.items():
        for base, limit in TARGETS.get(sc, {}).items():
            if base in r:
                ratio = r["aoprim"]["cpu_us_per_msg"] / r[base]["cpu_us_per_msg"]
                out.append((f"{sc}: CPU/msg <= {limit}x {base}'s", ratio <= limit,
                            f"x{ratio:.2f}"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scenario", action="append", choices=list(SCENARIOS))
    ap.add_argument("--base-tree", help="also run aoprim.aio from this checkout (in-place "
                                        "build) as 'aoprim-base', in the same rounds")
    ap.add_argument("--loop", action="append", choices=LOOPS,
                    help="only these loops (default: all of them)")
    ap.add_argument("--tree", help="import aoprim from this checkout (in-place build) instead "
                                   "of the installed package")
    ap.add_argument("--syscalls", action="store_true",
                    help="also count system calls per message under strace -f -c")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a.tree:
        sys.path.insert(0, os.path.abspath(a.tree))     # for loadgen's proc_cpu, in-process
    loops = tuple(a.loop or LOOPS)
    if a.base_tree:
        global BASE_TREE
        BASE_TREE = os.path.abspath(a.base_tree)
        loops += ("aoprim-base",)
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, Python "
          f"{platform.python_version()}, commit {commit}, duration {a.duration}s, "
          f"rounds {a.rounds} (interleaved, medians)")
    results, sysc = {}, {}
    for sc in a.scenario or list(SCENARIOS):
        print(f"  {sc} ...", flush=True)
        results[sc] = compare(sc, a.duration, a.rounds, a.tree, loops)
        if a.syscalls:
            sysc[sc] = {lp: count_syscalls(lp, sc, min(a.duration, 2.0), a.tree)
                        for lp in loops}
        report(sc, results[sc], sysc.get(sc))
    if "aoprim" in loops:
        print("\ntargets:")
        for name, ok, detail in check_targets(results):
            print(f"  [{'met' if ok else 'MISSED'}] {name}: {detail}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "syscalls": sysc, "commit": commit}, f, indent=1)


if __name__ == "__main__":
    main()
