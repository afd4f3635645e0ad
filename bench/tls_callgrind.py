"""Deterministic user-space cost per message of the TLS echo servers (issue 21): instructions
counted by valgrind's callgrind in the server process, immune to the machine's noise.

    python bench/tls_callgrind.py [--server aoprim|uvloop|asyncio ...] [--size 1024]
                                  [--n 2000] [--tree CHECKOUT] [--by-function K]

Each server (the ``bench --only tls`` commands: ``python -m aoprim serve --framing raw`` with
``--certfile``, or echo_asyncio.py on uvloop/asyncio) runs under ``valgrind --tool=callgrind``
twice: one TLS connection exchanges N raw messages of ``--size`` bytes one at a time, then 2N;
the difference of the two totals divided by N is the instructions per message, with start-up,
the handshake and shutdown cancelled out.  Kernel work is not counted.  ``--by-function K``
prints the K C functions with most instructions per message (as bench/aio_callgrind.py).
"""
import argparse
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from aoprim.benchmarks import tls as btls          # noqa: E402
from aio_callgrind import by_function             # noqa: E402


def _client(port, n, size):
    ctx = btls.client_context()
    raw = socket.create_connection(("127.0.0.1", port), timeout=300)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s = ctx.wrap_socket(raw)
    msg = b"x" * size
    for _ in range(n):
        s.sendall(msg)
        got = 0
        while got < size:
            chunk = s.recv(size - got)
            if not chunk:
                raise RuntimeError("server closed")
            got += len(chunk)
    try:
        s.unwrap()
    except (OSError, ssl.SSLError):
        pass
    s.close()


def instructions(server, n, size, tree, keep):
    cert, key = btls.certs()
    cmd = btls.server_cmd(server, "raw", cert, key)
    out = tempfile.mktemp(prefix="tls_cg_")
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    p = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + cmd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
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
    if keep:
        return int(m.group(1)), out
    os.unlink(out)
    return int(m.group(1)), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", choices=("aoprim", "aoprim-epoll", "uvloop", "asyncio"))
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--tree")
    ap.add_argument("--by-function", type=int, default=0, metavar="K")
    a = ap.parse_args()
    res = {}
    for sv in a.server or ("aoprim", "uvloop"):
        keep = a.by_function > 0
        i1, f1 = instructions(sv, a.n, a.size, a.tree, keep)
        i2, f2 = instructions(sv, 2 * a.n, a.size, a.tree, keep)
        res[sv] = (i2 - i1) / a.n
        print(f"tls-raw-{a.size} {sv:<8} {res[sv]:>10.0f} instructions/message", flush=True)
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
    for sv in res:
        if sv != "aoprim" and "aoprim" in res:
            print(f"aoprim vs {sv} x{res['aoprim'] / res[sv]:.2f}")


if __name__ == "__main__":
    main()
