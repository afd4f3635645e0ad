"""aoprim.aio against asyncio's default loop, uvloop and rloop: the same server code
(aoprim/benchmarks/aio_servers.py) on every loop, the same load generators, in one run.
(``python -m aoprim bench --only aio`` is the installed command's table: every loop, its own
scenarios.)

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
bench --only aio`` measures with; this script adds its scenarios, page faults, system calls
and the targets): each server runs in its own fresh process, is warmed by one connection (a
few messages, then closed) before the load starts, and its CPU time (user+sys,
/proc/PID/stat) over the measured window is divided by the messages (requests) served; minor
page faults per message (/proc/PID/stat field 10) are counted over the whole load generator
run (its warm-up window included) and divided by the messages that window would serve at the
measured rate.  Rounds are interleaved (asyncio, uvloop, aoprim, asyncio, ...) and the median
of each figure is reported; ratios are taken within the run only.

``--base-tree CHECKOUT`` adds a fourth server, ``aoprim-base``: aoprim.aio imported from
another in-place build (the code before a change), measured in the same interleaved rounds.

``--syscalls`` adds one pass per server in which the bench command's counter
(``aoprim.benchmarks.servers.count_syscalls``: ``perf stat -e raw_syscalls:sys_enter``)
counts the server's system calls over half the load's window, once every connection is up:
system calls per message, all kinds together.  Without a working ``perf`` the column says
why it is empty.
"""
import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess

from aoprim.benchmarks import aio, servers
from aoprim.tools.loadgen import proc_cpu

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
WARMUP = 0.5                      # the load generator's warm-up window, seconds

BASE_TREE = None                  # --base-tree: where the aoprim-base server imports from


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
        f0 = proc_cpu(pid)[2]
        yield
        faults.append(proc_cpu(pid)[2] - f0)

    echo = SCENARIOS[scenario]["kind"] == "echo"
    r = _run(loop, scenario, duration, tree, during=count_faults if echo else None)
    out = {"msgs": r["msgs"], "msgs_per_s": r["msgs_per_s"], "cpu_us_per_msg": r["value"],
           "user_us_per_msg": r["user_us_per_msg"], "sys_us_per_msg": r["sys_us_per_msg"],
           "faults_per_msg": float("nan")}
    if echo:
        out["faults_per_msg"] = faults[0] / (r["msgs"] * (duration + WARMUP) / duration)
    return out


def count_syscalls(loop, scenario, duration, tree):
    """System calls per message of one fresh server (None, and why, when perf cannot count
    them): servers.syscall_counter over half the load's window, once its connections are up
    and a tenth of the window has passed."""
    window = servers.SYSCALL_WINDOW * duration
    got = {}

    @contextlib.contextmanager
    def counting(pid):
        result = servers.syscall_counter(pid, SCENARIOS[scenario]["conns"], 0.1 * duration,
                                         window)
        yield
        got["n"], got["why"] = result()

    # the load runs without its own warm-up window: the server was warmed before it
    r = _run(loop, scenario, duration, tree, warmup=0, during=counting)
    if got["n"] is None or not r["msgs_per_s"]:
        return None, got["why"]
    return got["n"] / (r["msgs_per_s"] * window), None


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
        + (f" {'calls/' + unit:>10}" if sysc else ""))
    for lp, r in res.items():
        line = (f"  {lp:<11} {r['msgs_per_s']:>10.0f} {r['cpu_us_per_msg']:>11.2f} "
                f"{r['user_us_per_msg']:>7.2f} {r['sys_us_per_msg']:>7.2f} "
                f"{r['faults_per_msg']:>8.2f}")
        if sysc and lp in sysc:
            n, why = sysc[lp]
            line += f" {n:>10.3f}" if n is not None else f"  ({why})"
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
                    help="also count system calls per message (perf stat)")
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
