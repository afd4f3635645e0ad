"""A same-run comparison: raw/u32 echo of large messages, every server side by side,
optionally aoprim from two checkouts (before -> after) in the same run.

    python bench/large_compare.py [--scenarios raw-64k-10,raw-256k-10,raw-1m-10,u32-1m-10]
        [--passes 3] [--duration 2] [--baseline-tree PATH]

Servers: asyncio, uvloop, aoprim.aio, aoprim (selectors) and aoprim-epoll from this
checkout's in-place build (``@new``), and with ``--baseline-tree`` the same three from that
checkout (``@base``).  Each pass runs every scenario with the server order rotated; the
table shows medians: server CPU per message and its ratio to asyncio's and uvloop's,
syscalls per message (perf), minor page faults per message, messages/s.  The servers, the
warm-up and one run are aoprim/benchmarks/servers.py's.
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from aoprim.benchmarks import servers  # noqa: E402


def _med(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default="raw-64k-10,raw-256k-10,raw-1m-10,u32-1m-10")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--baseline-tree", help="a checkout with an in-place build (before)")
    a = ap.parse_args(argv)
    trees = {"new": ROOT, "": None}
    names = ["asyncio", "uvloop"]
    if a.baseline_tree:
        trees["base"] = os.path.abspath(a.baseline_tree)
        names += ["aoprim.aio@base", "aoprim@base", "aoprim-epoll@base"]
    names += ["aoprim.aio@new", "aoprim@new", "aoprim-epoll@new"]
    scen = a.scenarios.split(",")
    rows = {}
    for p in range(a.passes):
        for sc in scen:
            for name in names[p % len(names):] + names[:p % len(names)]:
                srv, _, tree = name.partition("@")
                servers.TREES["aoprim"] = trees[tree]
                try:
                    r = servers.run_one(srv, sc, a.duration, warmup=0.5, syscalls=True)
                except Exception as e:          # reported, the others go on
                    print(f"{sc} {name}: {type(e).__name__}: {e}", flush=True)
                    continue
                c = r.get("server_cpu", {})
                rows.setdefault((sc, name), []).append(
                    (c.get("cpu_us_per_msg"), r.get("syscalls_per_msg"),
                     r.get("faults_per_msg"), r.get("msgs_per_s"), c.get("sys_us_per_msg")))
                print(f"pass {p + 1}: {sc} {name}: {rows[(sc, name)][-1]}", flush=True)
    for sc in scen:
        asy = _med([x[0] for x in rows.get((sc, "asyncio"), [])])
        uv = _med([x[0] for x in rows.get((sc, "uvloop"), [])])
        print(f"\n== {sc} (medians of {a.passes} passes)")
        print(f"  {'server':20s} {'CPU us/msg':>10} {'x asyncio':>9} {'x uvloop':>8} "
              f"{'sys us':>7} {'syscalls':>8} {'faults':>7} {'msgs/s':>8}")
        for name in names:
            xs = rows.get((sc, name), [])
            m = [_med([x[i] for x in xs]) for i in range(5)]
            print(f"  {name:20s} {m[0]:10.2f} {m[0] / asy:9.2f} {m[0] / uv:8.2f} "
                  f"{m[4]:7.2f} {m[1]:8.2f} {m[2]:7.2f} {m[3]:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
