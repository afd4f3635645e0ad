"""The in-process harness: warm-up, interleaved rounds, median and spread, ratios.

For one group, every case is set up at once, then measured in rounds; within a round each
case is sampled once, in an order that rotates from round to round, so drift on the machine
(another process, frequency changes) hits baseline and candidates alike.  A sample is ``k``
back-to-back calls of the case's ``fn`` (``n`` operations each), ``k`` calibrated during the
warm-up so that one sample lasts about ``sample_s``; a *heavy* case (a whole threaded run)
is one call per sample.  The figure kept is wall time per operation (ns/op); the group's
result holds every sample, the median, min, max and quartiles, and each entry's ratio to the
baseline (``baseline / entry``: above 1 is faster than the baseline).
"""
import contextlib
import math
import statistics
import sys
import time

from .cases import Unavailable

__all__ = ["Progress", "summarize", "measure_group", "finish_group", "Settings"]


class Settings:
    """How hard to measure.  ``scale`` multiplies every case's n (threaded cases included);
    ``rounds``/``heavy_rounds``: samples per case; ``sample_s``: target length of a sample."""

    def __init__(self, rounds=7, heavy_rounds=3, sample_s=0.02, scale=1.0, heavy_scale=0.2):
        self.rounds = rounds
        self.heavy_rounds = heavy_rounds
        self.sample_s = sample_s
        self.scale = scale
        self.heavy_scale = heavy_scale

    def n(self, case):
        s = self.heavy_scale if case.heavy else self.scale
        return max(16, int(case.n * s))


class Progress:
    """A plain-text progress bar on stderr: ``[#####.....]  42%  12/40  0:31  what``.  On a
    terminal it redraws one line; otherwise it prints a line each time the group changes.
    ``note(text)`` prints a line of its own (a server run's figure as soon as the run ends),
    and ``above(fn)`` lets ``fn`` print to stdout without the bar's line in the way."""

    WIDTH = 100

    def __init__(self, total, stream=None, width=28, enabled=True):
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.label = ""
        self._last_label = None

    def step(self, k=1, label=None):
        self.done = min(self.total, self.done + k)
        if label is not None:
            self.label = label
        self.draw()

    def _line(self):
        frac = self.done / self.total
        fill = int(frac * self.width)
        el = int(time.monotonic() - self.t0)
        line = (f"[{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:3.0f}%  "
                f"{self.done}/{self.total}  {el // 60}:{el % 60:02d}  {self.label}")
        return line[:self.WIDTH - 1]

    def draw(self):
        if not self.enabled:
            return
        line = self._line()
        if self.tty:
            self.stream.write("\r" + line.ljust(self.WIDTH - 1))
            self.stream.flush()
        elif self.label.split(":")[0] != self._last_label:     # one line per group
            self._last_label = self.label.split(":")[0]
            self.stream.write(line + "\n")
            self.stream.flush()

    def _clear(self):
        if self.tty:
            self.stream.write("\r" + " " * (self.WIDTH - 1) + "\r")

    def note(self, text):
        """Print ``text`` on a line of its own now (above the bar on a terminal)."""
        if not self.enabled:
            return
        self._clear()
        self.stream.write(text[:self.WIDTH] + "\n")
        self.stream.flush()
        if self.tty:
            self.draw()

    def above(self, fn):
        """Call ``fn`` (which prints to stdout) with the bar's line cleared, then redraw it."""
        if self.tty:
            self._clear()
            self.stream.flush()
        fn()
        if self.tty:
            self.draw()

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
        elif self.enabled:
            self._last_label = None
            self.label = "done"
            self.draw()


def summarize(samples):
    """median, min, max, q1, q3 of a list of numbers (quartiles: inclusive method)."""
    xs = sorted(samples)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3}


def _time_calls(fn, k):
    """Seconds for k calls of fn, and what the last call returned.  A case whose fn has a
    ``prepare`` attribute gets it called, untimed, before each call (refill a socket, drain
    a peer); then each call is timed on its own and the times are summed."""
    r = None
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        total = 0.0
        clock = time.perf_counter
        for _ in range(k):
            prepare()
            t0 = clock()
            r = fn()
            total += clock() - t0
        return total, r
    t0 = time.perf_counter()
    for _ in range(k):
        r = fn()
    return time.perf_counter() - t0, r


def plan_steps(grp, settings):
    """How many progress steps measure_group() will make for this group."""
    return sum(settings.heavy_rounds if c.heavy else settings.rounds for c in grp.cases)


def measure_group(grp, settings, progress=None):
    """Measure every case of ``grp``; returns the group's result dict (see schema.py)."""
    entries, skipped = [], []
    with contextlib.ExitStack() as stack:
        live = []
        for c in grp.cases:
            n = settings.n(c)
            try:
                fn = stack.enter_context(c.setup(n))
            except Unavailable as e:
                skipped.append({"name": c.name, "reason": str(e)})
                if progress:
                    progress.step(settings.heavy_rounds if c.heavy else settings.rounds)
                continue
            # warm-up + calibration: k calls make one sample of about sample_s
            t = _time_calls(fn, 1)[0]
            if c.heavy:
                k = 1
            else:
                k = max(1, min(100000, math.ceil(settings.sample_s / max(t, 1e-7))))
                _time_calls(fn, max(1, k // 4))     # a little more warm-up
            live.append({"case": c, "fn": fn, "n": n, "k": k, "samples": [], "metrics": {},
                         "rounds": settings.heavy_rounds if c.heavy else settings.rounds})
        rounds = max((e["rounds"] for e in live), default=0)
        for r in range(rounds):
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for e in order:
                if r >= e["rounds"]:
                    continue
                dt, ret = _time_calls(e["fn"], e["k"])
                e["samples"].append(dt * 1e9 / (e["k"] * e["n"]))
                if isinstance(ret, dict):       # a case's own per-sample figures
                    for key, v in ret.items():
                        e["metrics"].setdefault(key, []).append(v)
                if progress:
                    progress.step(1, f"{grp.id}: {e['case'].name}")
        for e in live:
            c = e["case"]
            ent = {"name": c.name, "role": c.role, "n": e["n"], "calls_per_sample": e["k"],
                   "samples": [round(x, 4) for x in e["samples"]]}
            ent.update(summarize(e["samples"]))
            if e["metrics"]:
                ent["metrics"] = {k: summarize(v) for k, v in e["metrics"].items()}
            entries.append(ent)
    return finish_group(grp, entries, skipped)


def finish_group(grp, entries, skipped, better="lower", extra=None):
    """The group's result dict: ratios to the baseline and the winner marked."""
    base = next((e for e in entries if e["role"] == "baseline"), None)
    for e in entries:
        if base is None or not e["median"] or not base["median"]:
            e["ratio"] = None
        elif better == "lower":
            e["ratio"] = base["median"] / e["median"]
        else:
            e["ratio"] = e["median"] / base["median"]
        e["winner"] = False
    if grp.compete:
        eligible = [e for e in entries if e["role"] != "reference"]
        if len(eligible) >= 2:
            key = (lambda e: e["median"]) if better == "lower" else (lambda e: -e["median"])
            min(eligible, key=key)["winner"] = True
    out = {"id": grp.id, "family": grp.family, "kind": grp.kind, "title": grp.title,
           "unit": grp.unit, "better": better, "compete": grp.compete, "params": dict(grp.params),
           "series": grp.series, "baseline": base["name"] if base else None,
           "entries": entries, "skipped": skipped}
    if getattr(grp, "note", None):
        out["note"] = grp.note
    if extra:
        out.update(extra)
    return out
