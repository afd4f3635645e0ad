"""Deterministic user-space cost per message of the TLS echo servers: instructions
counted by valgrind's callgrind in the server process, immune to the machine's noise.

    python bench/tls_callgrind.py [--server aoprim|aoprim-epoll|uvloop|asyncio ...]
                                  [--mode raw|u16|handshake] [--size 1024] [--n 2000]
                                  [--tree CHECKOUT] [--by-function K]

Each server (the ``bench --only tls`` commands: ``python -m aoprim serve --framing raw`` with
``--certfile``, or echo_asyncio.py on uvloop/asyncio) runs under ``valgrind --tool=callgrind``
twice: one TLS connection exchanges N raw messages of ``--size`` bytes one at a time, then 2N;
the difference of the two totals divided by N is the instructions per message, with start-up,
the handshake and shutdown cancelled out.  ``--mode u16``: u16-framed messages of ``--size``
bytes pipelined 16 deep (the tls-u16-64x16-10 scenario on one connection; N counts messages).
``--mode handshake``: N (then 2N) new connections one after another, each a full TLS 1.3
handshake (no ticket), one u16 request of ``--size`` bytes and its reply, close_notify, close
(the tls-handshake scenario on one thread): instructions per handshake.  Kernel work is not
counted.  ``--by-function K``
prints the K C functions with most instructions per message (as bench/aio_callgrind.py).
"""
import argparse
import os
import socket
import ssl
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from aoprim.benchmarks import callgrind            # noqa: E402
from aoprim.benchmarks import tls as btls          # noqa: E402


def _client_handshakes(port, n, size):
    ctx = btls.client_context(tls13=True)
    ctx.options |= ssl.OP_NO_TICKET
    msg = struct.pack(">H", size) + b"x" * size
    for _ in range(n):
        s = _connect(ctx, port)
        s.sendall(msg)
        _recv_exact(s, len(msg))
        _close(s)


def _connect(ctx, port):
    raw = socket.create_connection(("127.0.0.1", port), timeout=300)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ctx.wrap_socket(raw)


def _close(s):
    """close_notify (whatever the server does with it), then close."""
    try:
        s.unwrap()
    except (OSError, ssl.SSLError):
        pass
    s.close()


def _recv_exact(s, size):
    got = 0
    while got < size:
        chunk = s.recv(size - got)
        if not chunk:
            raise RuntimeError("server closed")
        got += len(chunk)


def _client(port, n, size, mode="raw"):
    if mode == "handshake":
        return _client_handshakes(port, n, size)
    s = _connect(btls.client_context(), port)
    msg = b"x" * size
    if mode == "u16":
        msg = (struct.pack(">H", size) + msg) * 16
        n //= 16
    for _ in range(n):
        s.sendall(msg)
        _recv_exact(s, len(msg))
    _close(s)


def instructions(server, n, size, tree, keep, mode="raw"):
    """(instructions, callgrind output file or None) of ``server`` for N messages."""
    cert, key = btls.certs()
    env = dict(os.environ)                  # callgrind.run pins PYTHONHASHSEED=0
    if tree:
        env["PYTHONPATH"] = tree
    return callgrind.run(btls.server_cmd(server, "raw" if mode == "raw" else "u16", cert, key),
                         lambda port: _client(port, n, size, mode), env=env, keep=keep,
                         name=server)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", help="aoprim, aoprim-BACKEND (aoprim-epoll), "
                    "uvloop or asyncio")
    ap.add_argument("--mode", choices=("raw", "u16", "handshake"), default="raw")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--tree")
    ap.add_argument("--by-function", type=int, default=0, metavar="K")
    a = ap.parse_args()
    res = {}
    for sv in a.server or ("aoprim", "uvloop"):
        res[sv], tops = callgrind.per_message(
            lambda k, keep: instructions(sv, k, a.size, a.tree, keep, a.mode), a.n,
            a.by_function)
        unit = "handshake" if a.mode == "handshake" else "message"
        print(f"tls-{a.mode}-{a.size} {sv:<12} {res[sv]:>10.0f} instructions/{unit}", flush=True)
        if tops:
            callgrind.print_top(tops)
    for ao in [sv for sv in res if sv.startswith("aoprim")]:
        for sv in res:
            if not sv.startswith("aoprim"):
                print(f"{ao} vs {sv} x{res[ao] / res[sv]:.2f}")

if __name__ == "__main__":
    main()
