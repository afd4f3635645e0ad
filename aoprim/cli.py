"""The ``python -m aoprim`` command line (the installed ``aoprim`` script too): it dispatches

    serve    aoprim's server          (aoprim.server.cli)
    loadgen  the echo load generator  (aoprim.tools.loadgen)
    bench    the benchmarks           (aoprim.benchmarks.cli)

Each command's module is imported only when that command runs (``serve`` loads neither the
load generator nor the benchmarks), and none of them imports this module or another command's:
the dispatch lives here, above all three.  ``serve`` runs wholly in aoprim.server.cli (its
signals, messages and exit statuses are described there).  For ``loadgen`` and ``bench``,
SIGINT/SIGTERM while the command line is read end the process quietly with status 0; once
the command runs, SIGINT is a KeyboardInterrupt (``bench`` says ``interrupted`` and exits 130)
and SIGTERM still ends it quietly with 0.  A usage error is one ``aoprim: ...`` line, exit 2.
"""
from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from aoprim.server import cli as server_cli
from aoprim.server.cli import CommandParser, add_serve_command

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = ("serve", "loadgen", "bench")


class _Stop(BaseException):
    """SIGINT/SIGTERM outside the command's own handling: a BaseException, so that no
    ``except Exception`` on the way swallows the stop."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser; ``only``: the command about to run (the other
    commands' options are then not loaded -- their modules are not imported)."""
    p = CommandParser(prog="python -m aoprim",
                      description="aoprim's server and its load generator")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    add_serve_command(sub)
    lg = sub.add_parser("loadgen", help="echo load generator (a client; verifies every byte)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bp = sub.add_parser("bench",
                        help="benchmark the primitives and the server beside their baselines")
    if only in (None, "loadgen"):
        from aoprim.tools import loadgen
        loadgen.build_parser(lg)
    if only in (None, "bench"):
        from aoprim.benchmarks import cli as bench_cli
        bp.description = bench_cli.DESCRIPTION
        bench_cli.build_parser(bp)
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    cmd = args[0] if args and args[0] in COMMANDS else None
    if cmd == "serve":
        return server_cli.main(args)
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        a = build_parser(cmd).parse_args(args)      # no command: --help or a usage error
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if a.cmd == "loadgen":
            from aoprim.tools import loadgen
            return loadgen.main(a)
        if a.cmd == "bench":
            from aoprim.benchmarks import cli as bench_cli
            return bench_cli.main(a)
        return server_cli.main(args)        # "serve" reached past a leading "--"
    except (_Stop, KeyboardInterrupt):
        return 0
