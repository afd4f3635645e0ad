"""The run's header: the machine, the Python, the aoprim build."""
import datetime
import os
import platform
import subprocess
import sys
import sysconfig

import aoprim

__all__ = ["describe"]


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
    """What the compiler saw when it built aoprim's extensions (aoprim._benchcore is built
    by setup.py with the same flags as every other one), and Python's own CFLAGS, which
    setuptools puts in front of setup.py's."""
    cc = (sysconfig.get_config_var("CC") or "").split()
    out = {"python_cflags": sysconfig.get_config_var("CFLAGS") or "",
           "cc": cc[0] if cc else ""}
    try:
        from aoprim import _benchcore
        out.update(_benchcore.compiler_info())
    except ImportError as e:
        out["error"] = f"aoprim._benchcore is not built: {e}"
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
