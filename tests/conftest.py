"""Shared test set-up.

The suite must test the installed, compiled package.  The checkout's own aoprim/ folder has
no built extensions; if it were imported instead (``python -m pytest`` from the checkout
puts the current directory on sys.path) every test would fail confusingly, so stop with a
clear message.  Set AOPRIM_ALLOW_CHECKOUT=1 to test an in-place build on purpose.
"""
import gc
import os
import pathlib
import signal
import sys
import threading

import importlib.util

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.find_spec("aoprim")   # where it would come from, without importing it
if _spec is None:
    pytest.exit("aoprim is not installed: run `pip install '.[test]'` first", returncode=4)
_pkg = pathlib.Path(_spec.origin).resolve().parent
if _pkg.parent == ROOT and not os.environ.get("AOPRIM_ALLOW_CHECKOUT"):
    pytest.exit(f"aoprim was imported from the checkout ({_pkg}), not from the installed "
                "package: run `pip install '.[test]'` and `pytest` (not `python -m pytest`)",
                returncode=4)

# SIGINT as in an interactive Python: a suite started as a background job of a shell without
# job control (`cmd &` in a script, `nohup`) inherits SIGINT and SIGQUIT ignored, and Python
# then installs no KeyboardInterrupt handler -- nor does any Python process a test starts,
# as an ignored signal survives exec.  The tests of Ctrl-C (the server's handlers, a stop
# sent as SIGINT to a server under test) need the ordinary disposition, here and in their
# subprocesses (a Python-level handler becomes the default action at exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The shared helpers (tests/support/: support.py, server_support.py, tlscerts.py, ...) are
# imported by name from there; the checkout root never goes on sys.path.  The subject folders
# go on it too, for the test modules that take helpers and fixtures from a neighbour
# (``from test_supervisor import Lines``).  A name must then mean one file: every test module
# and helper has a basename no other one has.
TESTS = pathlib.Path(__file__).resolve().parent
_folders = [TESTS / "support", *sorted({p.parent for p in TESTS.rglob("test_*.py")})]
_names = {}
for _f in [*(TESTS / "support").glob("*.py"), *TESTS.rglob("test_*.py")]:
    if _names.setdefault(_f.name, _f) != _f:
        pytest.exit(f"two test modules named {_f.name}: {_names[_f.name]} and {_f} (they are "
                    "imported by basename: rename one)", returncode=4)
for _d in reversed(_folders):
    sys.path.insert(0, str(_d))

# Hypothesis profiles: "sanitize" (set by .ci/sanitize through AOPRIM_HYPOTHESIS_PROFILE)
# drops the per-example deadline, which sanitized code (2-10x slower) would trip at random.
try:
    from hypothesis import HealthCheck, settings as _hsettings
except ImportError:      # hypothesis is a test dependency; only its tests need it
    pass
else:
    _hsettings.register_profile("sanitize", deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])
    if os.environ.get("AOPRIM_HYPOTHESIS_PROFILE"):
        _hsettings.load_profile(os.environ["AOPRIM_HYPOTHESIS_PROFILE"])


# Tests that cause a ResourceWarning on purpose (pyproject.toml makes it an error otherwise),
# with why, keyed by the path under tests/.  Other tests say so themselves (pytest.warns / a
# filterwarnings mark).
EXPECTED_RESOURCE_WARNINGS = {
    "primitives/test_slab.py::test_length_resets_on_acquire":
        "drops the held Slot that `p.acquire().length` returns; the pool takes it back with a "
        "ResourceWarning (docs/buffers.md: a Slot garbage-collected while held)",
}


def pytest_collection_modifyitems(items):
    for item in items:
        name = getattr(item, "originalname", item.name)
        where = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        if f"{where}::{name}" in EXPECTED_RESOURCE_WARNINGS:
            item.add_marker(pytest.mark.filterwarnings(
                "ignore:Slot .* was garbage-collected:ResourceWarning"))


@pytest.fixture(scope="session")
def cybuild(tmp_path_factory):
    """build(name, source) -> module: compile a Cython module against the installed aoprim."""
    from aoprim.cybuild import build_module

    def build(name, source):
        return build_module(name, source, workdir=str(tmp_path_factory.mktemp(name)))
    return build


def pytest_collection_finish(session):
    # What collection left (every test module and the libraries they import: ~150k objects)
    # goes to the collector's permanent generation, where no collection walks it: the
    # gc.collect() after each test below then costs what the tests made since, not a full
    # walk of the heap (~50-100 ms, four thousand times a run).  The free-threaded build's
    # collector still visits frozen objects, but skips their analysis (~5x cheaper).
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _no_thread_leak():
    before = set(threading.enumerate())
    yield
    # every test's garbage is collected at its end: a ResourceWarning or unraisable
    # exception from an object it left in a cycle fails that test, not a later one
    gc.collect()
    if gc.get_freeze_count() == 0:
        gc.freeze()          # a test unfroze everything (test_gc_fuzz.py): freeze again
    leaked = [t for t in threading.enumerate() if t not in before]
    for t in leaked:
        t.join(5)   # a thread that was told to stop may still be unwinding
    leaked = [t for t in leaked if t.is_alive()]
    assert not leaked, f"threads leaked by the test: {leaked}"


@pytest.fixture
def backend():
    """The Layer 1 backend make_server uses unless a test names one: AOPRIM_TEST_BACKEND, or
    the default.  A module overrides this fixture (params=BACKENDS) to run on every backend."""
    return os.environ.get("AOPRIM_TEST_BACKEND", "selectors")
