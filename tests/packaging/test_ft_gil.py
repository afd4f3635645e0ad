"""On a free-threaded interpreter the GIL stays disabled after importing every part of aoprim.

CPython re-enables the GIL at run time when it imports an extension module that does not
declare ``Py_mod_gil = Py_MOD_GIL_NOT_USED`` (Cython's ``freethreading_compatible``
directive); it prints a RuntimeWarning and every thread is serialised again, silently for
whoever does not read stderr.  Each import runs in a fresh interpreter so the module that
turns the GIL back on is named.
"""
import os
import pkgutil
import subprocess
import sys
import sysconfig

import pytest

import aoprim

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))

pytestmark = pytest.mark.skipif(
    not FREE_THREADED, reason="needs a free-threaded (--disable-gil) interpreter; this one has a GIL")


def _modules():
    """Every module of the installed package: the extension modules found on disk (this
    interpreter's EXT_SUFFIX: an in-place build keeps other versions' .so files beside
    them), and the Python modules and packages (aoprim.benchmarks.plot needs matplotlib, an optional extra,
    so it is left to the extension check of what it imports)."""
    root = os.path.dirname(aoprim.__file__)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    exts = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.endswith(suffix):
                rel = os.path.relpath(os.path.join(dirpath, f[: -len(suffix)]), root)
                exts.append("aoprim." + rel.replace(os.sep, "."))
    pys = ["aoprim"] + [m.name for m in pkgutil.walk_packages(aoprim.__path__, "aoprim.")]
    return sorted(set(exts)), sorted(set(pys) - set(exts))


EXTENSIONS, PYMODULES = _modules()

CHECK = r"""
import importlib, sys
optional = set(sys.argv[2].split(","))
assert not sys._is_gil_enabled(), "the GIL is on before importing anything"
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
    except ImportError as e:
        if name not in optional:
            raise
        print("optional", name, e)
        continue
    # the GIL, once re-enabled, stays on: the first module after which it is on is the one
    if sys._is_gil_enabled():
        print("enabled-by", name)
        sys.exit(0)
    print("ok", name)
"""

# modules whose import needs an optional dependency (matplotlib: the plot extra; gunicorn and
# uvicorn-worker: aoprim.aio's gunicorn worker, for who runs gunicorn)
OPTIONAL = ["aoprim.benchmarks.plot", "aoprim.aio.gunicorn"]


def test_there_are_extension_modules_to_check():
    # at least the public primitives' modules; a packaging change that moved them must not
    # leave this file checking nothing
    assert len(EXTENSIONS) >= 10, EXTENSIONS
    assert any(m.endswith("._atomic") for m in EXTENSIONS), EXTENSIONS


def test_the_gil_stays_disabled_after_importing_every_module():
    """Extension modules first (each one's flag), then aoprim, aoprim.server, aoprim.aio and
    every other Python module (what they import: the stdlib and third-party modules)."""
    env = dict(os.environ)
    env.pop("PYTHON_GIL", None)   # PYTHON_GIL=0 would force it off and hide the fault
    names = EXTENSIONS + PYMODULES
    r = subprocess.run([sys.executable, "-W", "default", "-c", CHECK, ",".join(names),
                        ",".join(OPTIONAL)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"an import failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    enabled = [ln for ln in lines if ln.startswith("enabled-by")]
    assert not enabled, f"{enabled[0]}: importing it re-enabled the GIL\n{r.stderr[-2000:]}"
    checked = {ln.split()[1] for ln in lines if ln.startswith(("ok ", "optional "))}
    assert checked == set(names), sorted(set(names) - checked)
    for name in ("aoprim", "aoprim.server", "aoprim.aio"):
        assert name in checked
