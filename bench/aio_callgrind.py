"""Deterministic user-space cost per message of the three loops: instructions counted by
valgrind's callgrind in the server process, immune to the machine's noise.

    python bench/aio_callgrind.py [--app raw|proto-u16] [--n 2000] [--tree CHECKOUT]

For each loop, bench/aio_servers.py runs under ``valgrind --tool=callgrind`` twice: one
connection exchanges N messages, then 2N (one at a time, 1 KiB raw or 16 pipelined u16
frames of 64 B per burst); the difference of the two totals divided by N is the
instructions per message, with start-up, warm-up and shutdown cancelled out.  Kernel work is
not counted (callgrind sees user space only).
"""
import argparse
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LOOPS = ("asyncio", "uvloop", "aoprim")


def _client(port, app, n):
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if app == "raw":
        msg, per = b"x" * 1024, 1
    else:
        msg, per = (struct.pack(">H", 64) + b"y" * 64) * 16, 16
    for _ in range(n // per):
        s.sendall(msg)
        got = 0
        while got < len(msg):
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("server closed")
            got += len(chunk)
    s.close()


def instructions(loop, app, n, tree):
    out = tempfile.mktemp(prefix="aio_cg_")
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    p = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                          sys.executable, os.path.join(HERE, "aio_servers.py"), "--loop", loop,
                          "--app", app], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=tempfile.gettempdir())
    line = p.stdout.readline()
    if not line.startswith("listening on"):
        p.kill()
        raise RuntimeError(f"{loop} did not start: {line!r} {p.stderr.read()}")
    _client(int(line.rsplit(":", 1)[1]), app, n)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    m = re.search(r"Collected : (\d+)", err)
    os.unlink(out)
    if not m:
        raise RuntimeError(f"no callgrind total for {loop}: {err[-2000:]}")
    return int(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--app", choices=("raw", "proto-u16"), default="raw")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--tree")
    a = ap.parse_args()
    res = {}
    for lp in LOOPS:
        i1 = instructions(lp, a.app, a.n, a.tree)
        i2 = instructions(lp, a.app, 2 * a.n, a.tree)
        res[lp] = (i2 - i1) / a.n
        print(f"{a.app:<10} {lp:<8} {res[lp]:>10.0f} instructions/message", flush=True)
    print(f"aoprim vs asyncio x{res['aoprim'] / res['asyncio']:.2f}, "
          f"vs uvloop x{res['aoprim'] / res['uvloop']:.2f}")


if __name__ == "__main__":
    main()
