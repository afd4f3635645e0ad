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
               raw 64 KiB / 256 KiB / 1 MiB ping-pong on 10 connections
  http         aiohttp, GET / "Hello, World!", HTTP/1.1 keep-alive, 50 connections  (wrk)

Method (the package's harness, ``aoprim.benchmarks.aio.run_one``, which ``python -m aoprim
bench --only aio`` measures with; this script adds its scenarios, page faults, strace and the
issue-12 targets): each server runs in its own fresh process, is warmed by one connection (a
few messages, then closed) before the load starts, and its CPU time (user+sys,
/proc/PID/stat) over the measured window is divided by the messages (requests) served; minor
page faults per message (/proc/PID/stat field 10) are counted over the whole load generator
run (its warm-up window included) and divided by the messages that window would serve at the
measured rate.  Rounds are interleaved (asyncio, uvloop, aoprim, asyncio, ...) and the median
of each figure is reported; ratios are taken within the run only.

``--base-tree CHECKOUT`` adds a fourth server, ``aoprim-base``: aoprim.aio imported from
another in-place build (the code before a change), measured in the same interleaved rounds.

``--syscalls`` adds one pass per server under ``strace -f -c`` (attached after the warm-up,
for the whole load, which then runs without its own warm-up window): system calls per
message, by kind.  strace slows the server several-fold, so these runs give syscall counts
only, never CPU figures.
"""
import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import tempfile

from aoprim.benchmarks import aio

HERE = os.path.dirname(os.path.abspath(__file__))
LOOPS = ("asyncio", "uvloop", "rloop", "aoprim")
# the package's scenario format (aoprim/benchmarks/aio.py SCENARIOS), run by its run_one
SCENARIOS = {
    "proto-u16": dict(kind="echo", app="proto-u16", framing="u16", size=64, conns=10,
                      pipeline=16),
    "streams-u16": dict(kind="echo", app="streams-u16", framing="u16", size=64, conns=10,
                        pipeline=16),
    "streams-raw": dict(kind="echo", app="streams-raw", framing="raw", size=1024, conns=10,
                        pipeline=1),
    "raw-1k": dict(kind="echo", app="raw", framing="raw", size=1024, conns=10, pipeline=1),
    "raw-64k": dict(kind="echo", app="raw", framing="raw", size=65536, conns=10, pipeline=1),
    "raw-256k": dict(kind="echo", app="raw", framing="raw", size=262144, conns=10,
                     pipeline=1),
    "raw-1m": dict(kind="echo", app="raw", framing="raw", size=1 << 20, conns=10, pipeline=1),
    "http": dict(kind="http", app="aiohttp", conns=50),
}
TARGETS = {   # aoprim's CPU per message at most this times the other loop's
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
WARMUP = 0.5                      # the load generator's warm-up window, seconds

BASE_TREE = None                  # --base-tree: where the aoprim-base server imports from


def proc_minflt(pid):
    """Minor page faults of process ``pid`` so far (/proc/PID/stat field 10)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[7])


def _run(loop, scenario, duration, tree, warmup=WARMUP, during=None):
    """The package's aio.run_one for this script's loop names: ``aoprim`` is aoprim.aio
    imported from --tree, ``aoprim-base`` from --base-tree."""
    if loop == "aoprim-base":
        loop, tree = "aoprim", BASE_TREE
    env = None
    if tree:
        env = {"PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return aio.run_one("aoprim.aio" if loop == "aoprim" else loop, SCENARIOS[scenario],
                       duration, warmup, env_extra=env, during=during)


def run_one(loop, scenario, duration, tree):
    """One fresh server, one measured load: CPU per message (and its user/sys parts),
    messages/s and minor page faults per message (echo scenarios; NaN for http)."""
    faults = []

    @contextlib.contextmanager
    def count_faults(pid):          # over the whole loadgen run, its warm-up included
        f0 = proc_minflt(pid)
        yield
        faults.append(proc_minflt(pid) - f0)

    echo = SCENARIOS[scenario]["kind"] == "echo"
    r = _run(loop, scenario, duration, tree, during=count_faults if echo else None)
    out = {"msgs": r["msgs"], "msgs_per_s": r["msgs_per_s"], "cpu_us_per_msg": r["value"],
           "user_us_per_msg": r["user_us_per_msg"], "sys_us_per_msg": r["sys_us_per_msg"],
           "faults_per_msg": float("nan")}
    if echo:
        out["faults_per_msg"] = faults[0] / (r["msgs"] * (duration + WARMUP) / duration)
    return out


def count_syscalls(loop, scenario, duration, tree):
    """One run under strace -f -c: {kind: calls per message} and the top calls."""
    out_file = tempfile.mktemp(prefix="aio_strace_")

    @contextlib.contextmanager
    def strace(pid):
        st = subprocess.Popen(["strace", "-f", "-c", "-o", out_file, "-p", str(pid)],
                              stderr=subprocess.PIPE, text=True)
        try:
            # strace says so on stderr once attached: no sleep standing in for it
            line = st.stderr.readline()
            if "attached" not in line:
                raise RuntimeError(f"strace did not attach: {line!r}")
            yield
        finally:
            st.send_signal(signal.SIGINT)
            st.communicate(timeout=30)

    # the load runs without its own warm-up window: the server was warmed before strace
    r = _run(loop, scenario, duration, tree, warmup=0, during=strace)
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
    return {lp: {k: statistics.median_high([r[k] for r in rs]) for k in
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
