"""``python -m aoprim bench``: the subcommand's options and its main.

    python -m aoprim bench [--quick] [--only NAME ...] [--json FILE] [--compare OLD.json]
                           [--plot DIR] [--load FILE] [--markdown] [--list]

Tables go to stdout, each as soon as its group ends (the header first, the run's length, load
and warnings last); the progress bar, and each server run's figure as it ends, to stderr.
``--markdown`` prints its tables at the end instead.  Exit status: 0 when every selected group
ran (entries that cannot run here -- an optional library, a server -- are listed as skipped,
with the reason); 1 when a server run failed its echo verification; 2 for a usage error
(an unknown --only name, an unreadable or invalid JSON file, --plot without matplotlib).
"""
import argparse
import json
import os
import sys

__all__ = ["build_parser", "main"]

DESCRIPTION = (
    "Measure every aoprim primitive beside its baselines (Python level and C level), the "
    "lock and queues under contention (1-8 threads), and aoprim's server beside asyncio and "
    "uvloop under the project's load generator; print a table per group (median, spread, "
    "ratio to the baseline, winner), and optionally write JSON, compare with an earlier run "
    "and draw charts.  The full run takes about 11 minutes; --quick under one.")


def build_parser(p=None):
    p = p or argparse.ArgumentParser(prog="python -m aoprim bench", description=DESCRIPTION)
    p.add_argument("--quick", action="store_true",
                   help="fewer rounds, smaller sizes, 4 server scenarios (about a minute)")
    p.add_argument("--only", nargs="+", action="extend", metavar="NAME",
                   help="run only these: a family (atomic, lock, queue, slab, blocktable, "
                        "sendbatch, flushgroup, receiver, contention, server; ft: 1 vs 2 threads, on a "
                        "free-threaded Python only; aio: asyncio, uvloop, rloop and "
                        "aoprim.aio side by side, only when named), a kind (python, c, contention, "
                        "server), a group id or a glob over ids (see --list)")
    p.add_argument("--json", metavar="FILE", help="write every figure here (schema: "
                   "bench/README.md, aoprim/benchmarks/schema.py)")
    p.add_argument("--compare", metavar="OLD.json",
                   help="also print the change against an earlier run's --json file")
    p.add_argument("--plot", metavar="DIR",
                   help="write PNG charts here (needs matplotlib: pip install 'aoprim[plot]')")
    p.add_argument("--load", metavar="FILE",
                   help="measure nothing: report (and --compare / --plot) a saved --json run")
    p.add_argument("--markdown", action="store_true",
                   help="print Markdown tables (aoprim's entries against their baselines; the "
                        "servers) instead of the terminal tables -- what the README shows")
    p.add_argument("--list", action="store_true", help="list the groups and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)   # the test suite's
    return p


def _fail(msg):
    print(f"aoprim bench: {msg}", file=sys.stderr, flush=True)
    return 2


def _read(path, what):
    from .schema import validate
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from None
    problems = validate(doc)
    if problems:
        raise ValueError(f"{what} {path} is not an aoprim bench document: "
                         + "; ".join(problems[:5]))
    return doc


def main(a):
    from . import report, suite
    from .runner import Progress
    mode = "tiny" if a.tiny else "quick" if a.quick else "full"
    if a.list:
        for g in suite._all_groups(mode):
            print(f"{g.id:<28} {g.family:<16} {g.kind:<10} "
                  f"{'' if g.default else '(only when named) '}{g.title}")
        return 0
    if a.plot:
        from .plot import MissingMatplotlib, _plt
        try:
            _plt()
        except MissingMatplotlib as e:
            return _fail(str(e))
    try:
        old = _read(a.compare, "--compare file") if a.compare else None
        if a.load:
            doc = _read(a.load, "--load file")
        else:
            groups = suite.plan(mode, a.only)
    except (ValueError, suite.UnknownSelection) as e:
        return _fail(str(e))
    if a.load:
        print(report.markdown(doc) if a.markdown else report.render(doc), flush=True)
    else:
        prog = Progress(1, enabled=not a.no_progress)

        def show(text):
            if not a.markdown:
                prog.above(lambda: print(text, flush=True))
        try:
            doc = suite.run(groups, mode, prog, only=a.only,
                            on_header=lambda h: show(report.render_header({"header": h})),
                            on_group=lambda g: show(report.render_group(g)))
        except KeyboardInterrupt:
            prog.close()
            print("aoprim bench: interrupted", file=sys.stderr)
            return 130
        prog.close()
        if a.markdown:
            print(report.markdown(doc), flush=True)
        else:
            foot = report.render_footer(doc)
            if foot:
                print(foot, flush=True)
    if a.json:
        d = os.path.dirname(os.path.abspath(a.json))
        os.makedirs(d, exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {a.json}")
    if old is not None:
        print(report.compare(old, doc))
    if a.plot:
        from .plot import plot
        made = plot(doc, a.plot)
        print("\nplots: " + (", ".join(made) if made else "none (no group with data for a "
                                                          "chart was run)"))
    failed = [s for g in doc["groups"] if g["kind"] == "server" for s in g["skipped"]
              if "verification" in s["reason"] or "differ" in s["reason"]]
    return 1 if failed else 0
