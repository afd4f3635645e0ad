"""The run's header: the machine, the Python, the aoprim build; and how busy the machine was.

A benchmark on a machine where other programs compete for the CPUs measures them too, so the
run samples the load at its start and at its end (``cpu_sample``) and ``load_check`` turns
the two into the facts the report prints and, when they say the figures cannot be trusted,
a warning.
"""
import datetime
import os
import platform
import subprocess
import sys
import sysconfig
import time

import aoprim

__all__ = ["describe", "cpu_sample", "load_check", "START_LOAD", "OTHERS_BUSY"]

# A warning when the 1-minute load average at the start is at least this share of the cores
# (the bench's own processes have not run yet: the load is other programs').
START_LOAD = 0.5
# ... or when, during the run, other processes kept at least this share of the cores busy:
# the CPU time every CPU spent busy (/proc/stat, steal included) less the bench's own and its
# children's.  Where /proc/stat is missing, the 1-minute load average at the end less the
# CPUs the bench itself kept busy over its last minute stands in for it.
OTHERS_BUSY = 0.25


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _commit():
    """The git commit of the checkout aoprim was imported from, if it is one."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(aoprim.__file__)))
    if not os.path.isdir(os.path.join(here, ".git")) and \
            not os.path.isfile(os.path.join(here, ".git")):
        return None
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                           capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _compiler():
    """What the compiler saw when it built aoprim's extensions (aoprim.benchmarks._benchcore is
    built by setup.py with the same flags as every other one), and Python's own CFLAGS, which
    setuptools puts in front of setup.py's."""
    cc = (sysconfig.get_config_var("CC") or "").split()
    out = {"python_cflags": sysconfig.get_config_var("CFLAGS") or "",
           "cc": cc[0] if cc else ""}
    try:
        from aoprim.benchmarks import _benchcore
        out.update(_benchcore.compiler_info())
    except ImportError as e:
        out["error"] = f"aoprim.benchmarks._benchcore is not built: {e}"
    return out


def describe():
    """The header dict (see schema.py; mode, settings, selected and duration are added by
    the caller)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": _cpu_model(),
        "cores": _cores(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "python_executable": sys.executable,
        "aoprim_version": getattr(aoprim, "__version__", "?"),
        "aoprim_path": os.path.dirname(os.path.abspath(aoprim.__file__)),
        "commit": _commit(),
        "compiler": _compiler(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _busy_seconds():
    """CPU seconds the CPUs this process may run on have spent busy since boot (/proc/stat's
    ``cpuN`` lines: user, nice, system, irq, softirq and steal; guest time is inside user),
    or None where there is no /proc/stat."""
    try:
        mine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        mine = None
    try:
        total = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                fields = line.split()
                if mine is not None and int(fields[0][3:]) not in mine:
                    continue
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
                total += user + nice + system + irq + softirq + steal
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_sample():
    """A point to measure the machine's load between: the monotonic time, the load averages,
    the CPU seconds of this process and of its children that have been waited for (the
    servers and load generators), and the machine's busy CPU seconds (None off Linux)."""
    t = os.times()
    return {"t": time.monotonic(),
            "load": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "own": t.user + t.system + t.children_user + t.children_system,
            "busy": _busy_seconds()}


def load_check(cores, start, end=None, recent=None):
    """What the samples say about the machine's load: ``(facts, warnings)``.

    ``start`` and ``end`` come from cpu_sample() at the run's start and end; ``recent``, a
    sample about a minute before ``end`` (the load average's window), for the fallback.
    ``facts``: ``load_average_end``, ``own_cpus`` (CPUs the bench kept busy on average),
    ``other_cpus`` (CPUs other processes kept busy on average; None when unknown).
    ``warnings``: one sentence per reason the figures are unreliable."""
    warnings = []
    la = start.get("load")
    if la and la[0] >= START_LOAD * cores:
        warnings.append(
            f"the load average was {la[0]:.2f} at the start, on {cores} cores: other programs "
            "were using the CPUs, so the figures are unreliable (the ratios less so: each "
            "group's rows are measured interleaved)")
    facts = {"load_average_end": None, "own_cpus": None, "other_cpus": None}
    if end is None:
        return facts, warnings
    wall = end["t"] - start["t"]
    facts["load_average_end"] = end.get("load")
    if wall <= 0:
        return facts, warnings
    own = (end["own"] - start["own"]) / wall
    facts["own_cpus"] = round(own, 1)
    if start.get("busy") is not None and end.get("busy") is not None:
        others = round(max(0.0, (end["busy"] - start["busy"]) / wall - own), 1)
        facts["other_cpus"] = others
        if others >= OTHERS_BUSY * cores:
            warnings.append(
                f"other processes kept {others:.1f} of the {cores} cores busy during the run "
                "(on average): the figures are unreliable; run again on a quiet machine")
    elif end.get("load"):
        r = recent if recent is not None and end["t"] > recent["t"] else start
        own_recent = (end["own"] - r["own"]) / (end["t"] - r["t"])
        if end["load"][0] - own_recent >= START_LOAD * cores:
            warnings.append(
                f"the load average was {end['load'][0]:.2f} at the end, on {cores} cores, "
                f"while the bench kept {own_recent:.1f} busy: other programs were using the "
                "CPUs, so the figures are unreliable")
    return facts, warnings
