"""Deterministic user-space cost per message of the raw echo servers at any size (issue 20):
instructions counted by valgrind's callgrind in the server process, immune to the noise of a
shared machine -- the part of a large echo's CPU that is not the kernel's copies.

    python bench/raw_callgrind.py [--size 65536] [--n 400] [--server NAME ...]
                                  [--tree CHECKOUT] [--by-function K]

Servers: the ``bench`` server group's (aoprim/benchmarks/servers.py ``server_cmd``:
asyncio, uvloop, aoprim, aoprim-epoll, aoprim.aio).  Each runs under ``valgrind
--tool=callgrind`` twice: one connection exchanges N raw messages of ``--size`` bytes one at
a time, then 2N; the difference of the two totals divided by N is the instructions per
message, with start-up and shutdown cancelled out.  Kernel work is not counted (at 64 KiB and
above it is most of the CPU: compare ``perf record`` profiles for that).  How many reads a
message takes depends on timing under valgrind, so large sizes move by ~10-20% between runs;
``--by-function K`` prints the K C functions with most instructions per message (as
bench/aio_callgrind.py).
"""
import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from aoprim.benchmarks import servers                # noqa: E402
from aio_callgrind import by_function               # noqa: E402

SERVERS = ("asyncio", "uvloop", "aoprim", "aoprim-epoll", "aoprim.aio")


def _client(port, n, size):
    s = socket.create_connection(("127.0.0.1", port), timeout=300)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * size
    buf = bytearray(size)
    view = memoryview(buf)
    for _ in range(n):
        s.sendall(msg)
        got = 0
        while got < size:
            k = s.recv_into(view[got:])
            if not k:
                raise RuntimeError("the server closed the connection")
            got += k
    s.close()


def instructions(server, n, size, tree, keep):
    out = tempfile.mktemp(prefix="raw_cg_")
    servers.TREES["aoprim"] = tree
    p = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
                         + servers.server_cmd(server, "raw"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=servers._env(tree),
                         cwd=tempfile.gettempdir())
    line = p.stdout.readline()
    if not line.startswith("listening on"):
        p.kill()
        raise RuntimeError(f"{server} did not start: {line!r} {p.stderr.read()[-2000:]}")
    _client(int(line.rsplit(":", 1)[1]), n, size)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    m = re.search(r"Collected : (\d+)", err)
    if not m:
        os.unlink(out)
        raise RuntimeError(f"no callgrind total for {server}: {err[-2000:]}")
    if not keep:
        os.unlink(out)
        out = None
    return int(m.group(1)), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", choices=SERVERS)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--tree", default=ROOT, help="the aoprim checkout (an in-place build)")
    ap.add_argument("--by-function", type=int, default=0, metavar="K")
    a = ap.parse_args()
    res = {}
    for sv in a.server or SERVERS:
        keep = a.by_function > 0
        i1, f1 = instructions(sv, a.n, a.size, a.tree, keep)
        i2, f2 = instructions(sv, 2 * a.n, a.size, a.tree, keep)
        res[sv] = (i2 - i1) / a.n
        print(f"raw-{a.size} {sv:<13} {res[sv]:>10.0f} instructions/message", flush=True)
        if keep:
            for inclusive in (True, False):
                b1, b2 = by_function(f1, inclusive), by_function(f2, inclusive)
                per = {k: (b2.get(k, 0) - b1.get(k, 0)) / a.n for k in b2}
                top = sorted(per.items(), key=lambda kv: -kv[1])[:a.by_function]
                print(f"  {'inclusive' if inclusive else 'self'}, instructions/message:")
                for k, v in top:
                    print(f"    {v:>9.0f}  {k}")
            os.unlink(f1)
            os.unlink(f2)
    if "asyncio" in res:
        for sv in res:
            if sv != "asyncio":
                print(f"{sv} vs asyncio x{res[sv] / res['asyncio']:.2f}")


if __name__ == "__main__":
    main()
