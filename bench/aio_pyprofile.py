"""Which Python functions one raw echo message runs on a loop, and their share of the time
(the Python-level companion of bench/aio_callgrind.py, whose counts see only C functions).

    python bench/aio_pyprofile.py [--loop aoprim|asyncio|uvloop] [--size 1024] [--n 4000]
                                  [--tree CHECKOUT] [--top 25]

aoprim/benchmarks/aio_servers.py (raw echo) runs under cProfile in a child process; one connection
exchanges N messages, one at a time.  Printed for the functions that run for (nearly) every
message -- at least one call per two messages, so start-up imports drop out: calls per
message (exact) and microseconds per message, self (tottime) and inclusive (cumtime).  The
epoll wait's time includes the time it slept (the client's turn).  cProfile's own overhead
inflates short functions: use the figures to rank, callgrind for the cost.
"""
import argparse
import os
import pstats
import sys
import tempfile

from aoprim.benchmarks.aio import callgrind_client as _client
from aoprim.benchmarks.servers import start_server, stop_server


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loop", default="aoprim", choices=("aoprim", "asyncio", "uvloop"))
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--tree")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    out = tempfile.mktemp(prefix="aio_prof_")
    env = dict(os.environ)
    if a.tree:
        env["PYTHONPATH"] = os.path.abspath(a.tree)
    p, port = start_server([sys.executable, "-m", "cProfile", "-o", out, "-m",
                            "aoprim.benchmarks.aio_servers", "--loop", a.loop, "--app", "raw"],
                           f"{a.loop} under cProfile", env=env, error=RuntimeError)
    try:
        _client(port, "raw", a.n, a.size)
    finally:
        stop_server(p, 120)
    st = pstats.Stats(out)
    os.unlink(out)
    rows = [kv for kv in st.stats.items() if kv[1][1] >= a.n / 2]
    rows = sorted(rows, key=lambda kv: -kv[1][2])[:a.top]
    print(f"{a.loop}, raw {a.size} B, {a.n} messages: calls/msg, self us/msg, incl. us/msg")
    for (fn, ln, name), (cc, nc, tt, ct, _) in rows:
        where = f"{os.path.basename(fn)}:{ln}" if ln else fn
        print(f"  {nc / a.n:>6.2f}  {1e6 * tt / a.n:>7.2f}  {1e6 * ct / a.n:>7.2f}  "
              f"{name}  ({where})")


if __name__ == "__main__":
    main()
