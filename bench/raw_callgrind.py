"""Deterministic user-space cost per message of the raw echo servers at any size:
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
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from aoprim.benchmarks import callgrind, servers     # noqa: E402

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
    """(instructions, callgrind output file or None) of ``server`` for N messages."""
    servers.TREES["aoprim"] = tree
    return callgrind.run(servers.server_cmd(server, "raw"), lambda port: _client(port, n, size),
                         env=servers._env(tree), keep=keep, name=server)


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
        res[sv], tops = callgrind.per_message(
            lambda k, keep: instructions(sv, k, a.size, a.tree, keep), a.n, a.by_function)
        print(f"raw-{a.size} {sv:<13} {res[sv]:>10.0f} instructions/message", flush=True)
        if tops:
            callgrind.print_top(tops)
    if "asyncio" in res:
        for sv in res:
            if sv != "asyncio":
                print(f"{sv} vs asyncio x{res[sv] / res['asyncio']:.2f}")


if __name__ == "__main__":
    main()
