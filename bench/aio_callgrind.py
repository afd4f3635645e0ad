"""Deterministic user-space cost per message of the three loops: instructions counted by
valgrind's callgrind in the server process, immune to the machine's noise.

    python bench/aio_callgrind.py [--app raw|proto-u16|streams-u16] [--size 1024] [--n 10000]
                                  [--tree CHECKOUT]
                                  [--base-tree CHECKOUT] [--loop L ...] [--by-function K]

For each loop (asyncio, uvloop, rloop, aoprim), the aio servers
(``python -m aoprim.benchmarks.aio_servers``) run under ``valgrind --tool=callgrind`` twice: one
connection exchanges N messages, then 2N (one at a time, raw messages of ``--size`` bytes,
1 KiB by default, or 16 pipelined u16 frames of 64 B per burst, answered by a Protocol
(``proto-u16``) or by streams (``streams-u16``)); the difference of the two totals divided by N is the
instructions per message, with start-up, warm-up and shutdown cancelled out.  Kernel work is
not counted (callgrind sees user space only).

``--by-function K`` also prints, per loop, the K C functions with the most instructions per
message, inclusive (the function and all it calls) and self, from ``callgrind_annotate`` of
the same two runs (subtracted, divided by N).  Python code shows up as the interpreter's
own functions (``_PyEval_EvalFrameDefault`` self cost is the bytecode executed); compiled
modules' functions (``__pyx_...``) show by name.

``--base-tree CHECKOUT`` adds ``aoprim-base``: aoprim.aio imported from another in-place build
(the code before a change), counted in the same run.
"""
import argparse
import os

from aoprim.benchmarks import callgrind
from aoprim.benchmarks.aio import callgrind_run

LOOPS = ("asyncio", "uvloop", "rloop", "aoprim")
BASE_TREE = None


def instructions(loop, app, n, tree, keep=False, size=1024):
    """(instructions, output file or None) of the server for N messages: the package's
    callgrind_run (``python -m aoprim bench --only aio`` counts the same way); loop
    ``aoprim-base`` imports aoprim.aio from --base-tree."""
    if loop == "aoprim-base":
        loop, tree = "aoprim", BASE_TREE
    return callgrind_run(loop, app, n, tree, keep, size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--app", choices=("raw", "proto-u16", "streams-u16", "streams-raw"),
                    default="raw")
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--size", type=int, default=1024, help="raw message bytes")
    ap.add_argument("--tree")
    ap.add_argument("--base-tree", help="also count aoprim.aio from this checkout "
                                        "('aoprim-base')")
    ap.add_argument("--loop", action="append", choices=LOOPS)
    ap.add_argument("--by-function", type=int, default=0, metavar="K")
    a = ap.parse_args()
    loops = tuple(a.loop or LOOPS)
    if a.base_tree:
        global BASE_TREE
        BASE_TREE = os.path.abspath(a.base_tree)
        loops += ("aoprim-base",)
    res = {}
    for lp in loops:
        res[lp], tops = callgrind.per_message(
            lambda k, keep: instructions(lp, a.app, k, a.tree, keep, a.size), a.n,
            a.by_function)
        label = f"{a.app}-{a.size if a.app == 'raw' else 64}"
        print(f"{label:<10} {lp:<11} {res[lp]:>10.0f} instructions/message", flush=True)
        if tops:
            callgrind.print_top(tops)
    for lp in loops:
        if lp != "aoprim" and "aoprim" in res:
            print(f"aoprim vs {lp} x{res['aoprim'] / res[lp]:.2f}")


if __name__ == "__main__":
    main()
