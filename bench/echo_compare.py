"""Echo benchmark: the same load generator against the aoprim server and asyncio echo servers
(default loop and uvloop), in one session, on loopback.

    python bench/echo_compare.py [--duration 3] [--rounds 1] [--procs 1] [--floor] [--cold]
                                 [--json out.json]
    pytest bench/bench_echo.py --benchmark-enable -s      (the same, as a pytest run)

Scenarios:
  raw-1k-10     raw echo, 1 KiB ping-pong, 10 connections
  raw-1k-100    raw echo, 1 KiB ping-pong, 100 connections
  u16-64x16-10  u16-framed 64 B messages pipelined 16 deep on 10 connections; every frame
                gets its own reply (asyncio: one transport.write per frame)

``--floor`` adds aoprim/benchmarks/echo_floor.py to the raw scenarios: the smallest Python epoll echo
loop, a same-run measure of what CPython itself costs per message.

The servers, the warm-up and one run are aoprim/benchmarks/servers.py's (shared with
``python -m aoprim bench``, which also runs the scaling curves); this script keeps its own
scenarios, table and targets.

Each server runs in its own process; ``python -m aoprim loadgen`` drives it and reads the
server's CPU time (user+sys from /proc/PID/stat) over the measured window.  Reported per
server: messages/s, server CPU us/message (user, sys), and for aoprim the send syscalls per
message from Server.stats() (printed by the server at exit).

Every server is measured warm, in its steady state: before the load generator starts, one
connection exchanges a few messages of the scenario and closes (``warm_up``).  A fresh
process is not in a steady state: until one connection has come and gone, glibc serves
asyncio's ``recv(262144)`` with mmap + mremap + munmap on every read (the buffer is above
the mmap threshold, and the threshold only adapts once such a block is freed), which makes
asyncio's raw echo cost 28-35 us of CPU per message instead of the ~8-9 us it costs from then
on -- a start-up artefact, not asyncio's cost.  Every server gets the same warm-up, aoprim
included.  ``--cold`` also measures each server fresh (no warm-up), as separate rows named
``SERVER-cold``; the ratios are always against the warm rows.
"""
import argparse
import importlib.util
import json
import os
import platform


HERE = os.path.dirname(os.path.abspath(__file__))

# The servers, the warm-up and one run live in the package (aoprim/benchmarks/servers.py,
# shared with `python -m aoprim bench`); loaded by path from this checkout, whatever aoprim
# is installed (the module imports only the standard library).
_spec = importlib.util.spec_from_file_location(
    "aoprim_bench_servers", os.path.join(HERE, os.pardir, "aoprim", "benchmarks", "servers.py"))
servers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(servers)

HOST = servers.HOST
CWD = servers.CWD
SCENARIOS = {k: servers.SCENARIOS[k] for k in ("raw-1k-10", "raw-1k-100", "u16-64x16-10")}
SERVERS = ("aoprim", "aoprim-epoll", "asyncio", "uvloop")
# where each aoprim variant is imported from: None = the installed package; a path = a
# checkout with an in-place build (--tree / --baseline-tree).  "aoprim-epoll" is the same
# package as "aoprim" served on the compiled Layer 1 backend (--backend epoll: servers.py
# serves "aoprim-NAME" with --backend NAME).  The same dict as servers.TREES.
TREES = servers.TREES
TREES.setdefault("aoprim-epoll", None)
CANDIDATES = ("aoprim", "aoprim-epoll")       # what the ratios and targets are about
server_cmd = servers.server_cmd
warm_up = servers.warm_up
run_one = servers.run_one


def have_uvloop():
    try:
        import uvloop  # noqa: F401
        return True
    except ImportError:
        return False


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def compare(scenario, duration=3.0, rounds=1, procs=1, servers=SERVERS, log=print,
            cold=False):
    """Run every server on one scenario (rounds interleaved), each warmed up first; with
    ``cold`` also each one fresh, as ``SERVER-cold``.  Returns {server: summary}."""
    servers = [s for s in servers if s != "uvloop" or have_uvloop()]
    plan = [(s, True) for s in servers] + ([(s, False) for s in servers] if cold else [])
    runs = {s if warm else f"{s}-cold": [] for s, warm in plan}
    for _ in range(rounds):
        for s, warm in plan:
            r = run_one(s, scenario, duration, procs, warm=warm)
            if r["errors"]:
                raise AssertionError(f"{s}: echo verification failed: {r['errors'][:3]}")
            runs[r["server"]].append(r)
    out = {}
    for s, rs in runs.items():
        cpu = [r["server_cpu"] for r in rs]
        out[s] = {
            "msgs_per_s": _median([r["msgs_per_s"] for r in rs]),
            "cpu_us_per_msg": _median([c["cpu_us_per_msg"] for c in cpu]),
            "user_us_per_msg": _median([c["user_us_per_msg"] for c in cpu]),
            "sys_us_per_msg": _median([c["sys_us_per_msg"] for c in cpu]),
            "p50_us": _median([r["p50_us"] for r in rs]),
            "p99_us": _median([r["p99_us"] for r in rs]),
        }
        if "send_syscalls_per_msg" in rs[0]:
            out[s]["send_syscalls_per_msg"] = _median([r["send_syscalls_per_msg"] for r in rs])
    return out


def report(scenario, res, log=print):
    log(f"\n[{scenario}]  {SCENARIOS[scenario]}  (warm: one connection came and went first)")
    log(f"  {'server':<12} {'msgs/s':>10} {'CPU us/msg':>11} {'user':>7} {'sys':>7} "
        f"{'p50 us':>7} {'p99 us':>7} {'sends/msg':>10}")
    for s, r in res.items():
        spm = r.get("send_syscalls_per_msg")
        log(f"  {s:<12} {r['msgs_per_s']:>10.0f} {r['cpu_us_per_msg']:>11.2f} "
            f"{r['user_us_per_msg']:>7.2f} {r['sys_us_per_msg']:>7.2f} {r['p50_us']:>7} "
            f"{r['p99_us']:>7} {'' if spm is None else f'{spm:.4f}':>10}")
    for cand in CANDIDATES:
        if cand not in res:
            continue
        a = res[cand]
        for base in ("aoprim-base", "asyncio", "uvloop", "floor"):
            if base in res:
                b = res[base]
                log(f"  {cand} vs {base}: CPU/msg "
                    f"x{a['cpu_us_per_msg'] / b['cpu_us_per_msg']:.2f}, "
                    f"msgs/s x{a['msgs_per_s'] / b['msgs_per_s']:.2f}")


def check_targets(results):
    """The server's targets, as (name, met, detail) tuples, for each aoprim
    backend measured."""
    t = []
    for cand in CANDIDATES:
        for sc in ("raw-1k-10", "raw-1k-100"):
            if sc in results and cand in results[sc]:
                r = results[sc]
                a = r[cand]
                t.append((f"{cand} {sc}: user/msg <= 1.5 us", a["user_us_per_msg"] <= 1.5,
                          f"{a['user_us_per_msg']:.2f} us"))
                if "uvloop" in r:
                    ratio = a["cpu_us_per_msg"] / r["uvloop"]["cpu_us_per_msg"]
                    t.append((f"{cand} {sc}: CPU/msg <= 1.05x uvloop's", ratio <= 1.05,
                              f"x{ratio:.2f}"))
        sc = "u16-64x16-10"
        if sc in results and cand in results[sc]:
            r = results[sc]
            a = r[cand]
            ratio = a["cpu_us_per_msg"] / r["asyncio"]["cpu_us_per_msg"]
            t.append((f"{cand} {sc}: CPU/msg <= 0.12x asyncio's", ratio <= 0.12,
                      f"x{ratio:.2f}"))
            if "uvloop" in r:
                ratio = a["cpu_us_per_msg"] / r["uvloop"]["cpu_us_per_msg"]
                t.append((f"{cand} {sc}: CPU/msg vs uvloop's", True, f"x{ratio:.2f}"))
            ratio = a["msgs_per_s"] / r["asyncio"]["msgs_per_s"]
            t.append((f"{cand} {sc}: msgs/s >= 3x asyncio's", ratio >= 3, f"x{ratio:.2f}"))
            spm = a.get("send_syscalls_per_msg", 1)
            t.append((f"{cand} {sc}: send syscalls/msg <= 1/10", spm <= 0.1, f"{spm:.4f}"))
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--procs", type=int, default=1, help="load generator processes")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--floor", action="store_true",
                    help="also run the minimal Python epoll loop (raw scenarios)")
    ap.add_argument("--cold", action="store_true",
                    help="also measure every server fresh, without the warm-up connection "
                         "(rows SERVER-cold)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--tree", help="serve aoprim from this checkout (in-place build) instead "
                                   "of the installed package")
    ap.add_argument("--baseline-tree", help="also serve aoprim from this checkout as "
                                            "'aoprim-base' (e.g. the previous main), same run")
    a = ap.parse_args()
    TREES["aoprim"] = TREES["aoprim-epoll"] = a.tree
    TREES["aoprim-base"] = a.baseline_tree
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, Python "
          f"{platform.python_version()}, uvloop {'yes' if have_uvloop() else 'NO'}")
    results = {}
    for sc in a.scenario or list(SCENARIOS):
        servers = (SERVERS + (("aoprim-base",) if a.baseline_tree else ()) +
                   (("floor",) if a.floor and SCENARIOS[sc]["framing"] == "raw" else ()))
        results[sc] = compare(sc, a.duration, a.rounds, a.procs, servers, cold=a.cold)
        report(sc, results[sc])
    print("\ntargets:")
    for name, ok, detail in check_targets(results):
        print(f"  [{'met' if ok else 'MISSED'}] {name}: {detail}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
