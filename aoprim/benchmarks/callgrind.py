"""User-space instructions a server process runs, counted by valgrind's callgrind: the one
implementation behind ``python -m aoprim bench --only aio``'s ``instr/msg`` column and the
scripts bench/aio_callgrind.py, bench/raw_callgrind.py and bench/tls_callgrind.py.

A count (``run``) starts a server command under ``valgrind --tool=callgrind``, waits for its
first line of output (``listening on HOST:PORT``), hands the port to a client function that
exchanges the messages, stops the server with SIGINT and reads callgrind's total.  The cost
per message (``per_message``) is the difference between a run of 2N messages and a run of N,
divided by N: start-up, warm-up and shutdown cancel out, and the figure does not move with
the machine's load (kernel work is not counted: callgrind sees user space only).  The
server runs with ``PYTHONHASHSEED=0`` unless the caller's environment names a seed: str
hashes decide CPython's type-cache slots, and a random seed moves a per-message count by up
to ~2.5k instructions between runs (a collision on a hot attribute name).
``by_function`` splits a run's total by C function (``callgrind_annotate``).
"""
import os
import re
import subprocess
import tempfile

from .servers import start_server, stop_server

__all__ = ["run", "per_message", "by_function", "print_top", "with_fixed_hash_seed"]



def run(cmd, client, env=None, keep=False, name=None, timeout=600):
    """Instructions ``cmd`` (a server that prints ``listening on HOST:PORT`` first) ran under
    callgrind while ``client(port)`` talked to it, and, with ``keep``, its callgrind output
    file (the caller removes it; None without ``keep``)."""
    name = name or os.path.basename(cmd[0])
    env = with_fixed_hash_seed(env)
    out = tempfile.mktemp(prefix="aoprim_cg_")
    p = None
    try:
        p, port = start_server(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
                               + cmd, f"{name} under valgrind", env=env, error=RuntimeError)
        client(port)
        _, err = stop_server(p, timeout)
    except BaseException:
        if p is not None:
            stop_server(p, 0)
        if os.path.exists(out):
            os.unlink(out)
        raise
    m = re.search(r"Collected : (\d+)", err)
    if not m:
        if os.path.exists(out):
            os.unlink(out)
        raise RuntimeError(f"no callgrind total for {name}: {err[-2000:]}")
    if keep:
        return int(m.group(1)), out
    os.unlink(out)
    return int(m.group(1)), None


def with_fixed_hash_seed(env=None):
    """``env`` (or os.environ) copied, with PYTHONHASHSEED=0 unless it names a seed."""
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def by_function(out_file, inclusive):
    """{function: instructions} from ``callgrind_annotate`` of one output file; inclusive
    (the function and all it calls) or self."""
    r = subprocess.run(["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}",
                        "--threshold=100", out_file], capture_output=True, text=True)
    res = {}
    for ln in r.stdout.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*)$", ln)
        if m and ":" in m.group(2):
            name = re.sub(r"\s*\[[^\]]*\]\s*$", "", m.group(2)).strip()
            name = name.split(":", 1)[1] if not name.startswith("???") else name
            name = re.sub(r"\s*\([\d,]+x\)$", "", name)          # call count
            if not inclusive:                   # recursion levels: one function
                name = re.sub(r"'\d+$", "", name)
            res[name] = res.get(name, 0) + int(m.group(1).replace(",", ""))
    return res


def per_message(count, n, top=0, attempts=3):
    """(instructions per message, top functions): ``count(messages, keep)`` is one callgrind
    run returning ``run``'s pair; the figure is (run of 2N - run of N) / N.  With ``top`` > 0
    the second item is {"inclusive": [(function, instructions/message)], "self": [...]}, the
    ``top`` costliest of each from the same two runs (subtracted, over N); else None.

    A pair whose difference is not positive measured noise, not messages (the N run paid
    for something the 2N run did not: a collection, a client whose pipelined frames arrived
    in smaller batches on a busy machine): it is measured again, up to ``attempts`` pairs,
    and the last figure is returned as it is."""
    for _ in range(attempts - 1):
        per, tops = _per_message_once(count, n, top)
        if per > 0:
            return per, tops
    return _per_message_once(count, n, top)


def _per_message_once(count, n, top):
    keep = top > 0
    i1, f1 = count(n, keep)
    try:
        i2, f2 = count(2 * n, keep)
    except BaseException:
        if f1:
            os.unlink(f1)
        raise
    tops = None
    try:
        if keep:
            tops = {}
            for inclusive in (True, False):
                b1, b2 = by_function(f1, inclusive), by_function(f2, inclusive)
                per = {k: (b2.get(k, 0) - b1.get(k, 0)) / n for k in b2}
                tops["inclusive" if inclusive else "self"] = sorted(
                    per.items(), key=lambda kv: -kv[1])[:top]
    finally:
        for f in (f1, f2):
            if f:
                os.unlink(f)
    return (i2 - i1) / n, tops


def print_top(tops, log=print):
    """The ``per_message`` top functions, as the bench/*_callgrind.py scripts print them."""
    for kind in ("inclusive", "self"):
        log(f"  {kind}, instructions/message:")
        for k, v in tops[kind]:
            log(f"    {v:>9.0f}  {k}")
