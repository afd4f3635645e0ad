"""aoprim.aio's loop by a loop factory, and by asyncio's event loop policies where they exist.

The loop factory is the way asyncio documents from Python 3.14, which deprecates the policy
system (``asyncio.set_event_loop_policy``, ``get_event_loop_policy``, the policy classes;
removal planned for 3.16): ``asyncio.run(main(), loop_factory=aoprim.aio.new_event_loop)``
(3.12+), ``asyncio.Runner(loop_factory=aoprim.aio.new_event_loop)`` (3.11+) and
``aoprim.aio.run(main())``, which is such a Runner.

- On the running Python, with every warning an error (``-W error``, in a child process, so the
  import of aoprim.aio is covered too), each of those ways and ``install()`` run ``main()`` on
  an ``aoprim.aio.Loop``; the suite runs on 3.11, 3.12 and 3.13, where none may warn.
- ``aoprim.aio.run()`` never asks the policy for its loop.
- The 3.14 branch is chosen by what the asyncio module holds (``loop._policy_api``): it is
  exercised on stand-in modules shaped as 3.13's, 3.14's and a policy-free asyncio are (per
  their documented source), and ``install()`` is run on the branch it picks.  Python 3.14
  itself is not installed here: that run is the part not covered.
"""
import asyncio
import json
import subprocess
import sys
import types
import warnings

import pytest

import aoprim.aio
from aoprim.aio import loop as aioloop

from proc_support import child_env

pytestmark = pytest.mark.timeout(60)

LOOP = ["aoprim.aio.loop", "Loop"]

SCRIPT = r'''
import asyncio, json, sys
import aoprim.aio

async def main():
    loop = asyncio.get_running_loop()
    return [type(loop).__module__, type(loop).__qualname__]

got = {"run": aoprim.aio.run(main())}
with asyncio.Runner(loop_factory=aoprim.aio.new_event_loop) as runner:
    got["Runner"] = runner.run(main())
if sys.version_info >= (3, 12):
    got["asyncio.run"] = asyncio.run(main(), loop_factory=aoprim.aio.new_event_loop)
else:
    coro = main()
    try:
        asyncio.run(coro, loop_factory=aoprim.aio.new_event_loop)
    except TypeError:
        got["asyncio.run"] = "TypeError"
    coro.close()
if not aoprim.aio.loop.POLICIES_DEPRECATED:
    aoprim.aio.install()
    got["install"] = asyncio.run(main())
    lp = asyncio.new_event_loop()
    got["new_event_loop"] = [type(lp).__module__, type(lp).__qualname__]
    lp.close()
    asyncio.set_event_loop_policy(None)
print(json.dumps(got))
'''


def test_each_documented_way_runs_on_aoprims_loop_with_warnings_as_errors(tmp_path):
    p = subprocess.run([sys.executable, "-W", "error", "-c", SCRIPT], cwd=tmp_path,
                       env=child_env(), capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    got = json.loads(p.stdout)
    assert got["run"] == got["Runner"] == LOOP
    # asyncio.run() takes loop_factory from 3.12; on 3.11 asyncio.Runner is the way
    assert got["asyncio.run"] == (LOOP if sys.version_info >= (3, 12) else "TypeError")
    if not aioloop.POLICIES_DEPRECATED:
        assert got["install"] == got["new_event_loop"] == LOOP
    else:
        assert "install" not in got


class _RefusingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        raise AssertionError("the policy was asked for a loop")


@pytest.mark.skipif(aioloop.POLICIES_DEPRECATED, reason="asyncio's policies are deprecated "
                    "on this Python: a policy cannot be set without a warning")
def test_run_takes_its_loop_from_the_factory_not_the_policy():
    async def main():
        return type(asyncio.get_running_loop())
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_RefusingPolicy())
    try:
        coro = main()
        with pytest.raises(AssertionError, match="asked for a loop"):
            asyncio.run(coro)                # the policy is in force ...
        coro.close()
        assert aoprim.aio.run(main()) is aoprim.aio.Loop    # ... and run() never asks it
        with asyncio.Runner(loop_factory=aoprim.aio.new_event_loop) as runner:
            assert runner.run(main()) is aoprim.aio.Loop
    finally:
        asyncio.set_event_loop_policy(old)


# Stand-ins for the asyncio module, shaped as each version's is.
class _Policy:
    pass


def _asyncio_313():
    """3.11-3.13: public, silent policy names."""
    m = types.ModuleType("asyncio_313")
    m.DefaultEventLoopPolicy = _Policy
    m.set_event_loop_policy = lambda policy: m.set.append(policy)
    m.events = types.SimpleNamespace()
    m.set = []
    return m


def _asyncio_314():
    """3.14 (Lib/asyncio/__init__.py, events.py): the public policy class names come from a
    module ``__getattr__`` that warns, ``set_event_loop_policy`` warns and calls the private
    ``events._set_event_loop_policy``; ``_DefaultEventLoopPolicy`` is a plain global."""
    m = types.ModuleType("asyncio_314")
    m.set = []

    def __getattr__(name):
        if name in ("AbstractEventLoopPolicy", "DefaultEventLoopPolicy"):
            warnings.warn(f"'asyncio.{name}' is deprecated and slated for removal in "
                          "Python 3.16", DeprecationWarning, stacklevel=2)
            return vars(m)["_" + name]
        raise AttributeError(name)

    def _set_event_loop_policy(policy):
        m.set.append(policy)

    def set_event_loop_policy(policy):
        warnings.warn("'asyncio.set_event_loop_policy' is deprecated and slated for removal "
                      "in Python 3.16", DeprecationWarning, stacklevel=2)
        _set_event_loop_policy(policy)

    m.__getattr__ = __getattr__
    m._DefaultEventLoopPolicy = _Policy
    m.set_event_loop_policy = set_event_loop_policy
    m.events = types.SimpleNamespace(_set_event_loop_policy=_set_event_loop_policy)
    return m


def _asyncio_without_policies():
    m = types.ModuleType("asyncio_none")
    m.events = types.SimpleNamespace()
    m.set = []
    return m


@pytest.mark.parametrize("make, deprecated, base, setter", [
    (_asyncio_313, False, "DefaultEventLoopPolicy", lambda m: m.set_event_loop_policy),
    (_asyncio_314, True, "_DefaultEventLoopPolicy", lambda m: m.events._set_event_loop_policy),
    (_asyncio_without_policies, True, None, lambda m: None),
], ids=["3.13", "3.14", "none"])
def test_the_policy_branch_follows_what_asyncio_holds_and_reads_it_silently(
        make, deprecated, base, setter):
    m = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # reading a deprecated public name would raise
        got = aioloop._policy_api(m)
    assert got[0] is deprecated
    assert got[1] is (vars(m)[base] if base else None)
    assert got[2] is setter(m)


def _install_on(monkeypatch, m):
    """Run install() with the policy API that _policy_api picks for the stand-in ``m``;
    return the warnings it emitted (every one recorded)."""
    deprecated, _, setter = aioloop._policy_api(m)
    monkeypatch.setattr(aioloop, "POLICIES_DEPRECATED", deprecated)
    monkeypatch.setattr(aioloop, "_set_policy", setter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aoprim.aio.install()
    return caught


def test_install_where_policies_are_silent_sets_the_policy_and_warns_nothing(monkeypatch):
    m = _asyncio_313()
    assert _install_on(monkeypatch, m) == []
    assert len(m.set) == 1 and isinstance(m.set[0], aoprim.aio.EventLoopPolicy)


def test_install_where_policies_are_deprecated_warns_once_itself_naming_the_loop_factory(
        monkeypatch):
    m = _asyncio_314()
    caught = _install_on(monkeypatch, m)
    # one warning, aoprim's (CPython's setter would have added its own), at the caller's line
    assert [w.category for w in caught] == [DeprecationWarning]
    msg = str(caught[0].message)
    assert "aoprim.aio.install()" in msg and "loop_factory=aoprim.aio.new_event_loop" in msg
    assert caught[0].filename == __file__
    assert len(m.set) == 1 and isinstance(m.set[0], aoprim.aio.EventLoopPolicy)


def test_install_without_policies_says_to_use_the_loop_factory(monkeypatch):
    m = _asyncio_without_policies()
    with pytest.raises(RuntimeError, match=r"loop_factory=aoprim\.aio\.new_event_loop"):
        _install_on(monkeypatch, m)
    assert m.set == []


def test_run_inside_a_running_loop_is_refused_before_any_loop_is_made():
    """As asyncio.run: called from a running loop, run() raises at once -- no Loop is built
    (no self-pipe left to the GC, no ResourceWarning), the outer loop goes on."""
    made = []
    real_init = aioloop.Loop.__init__

    def counting_init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    async def inner():
        return 1

    async def outer():
        coro = inner()
        aioloop.Loop.__init__ = counting_init
        try:
            with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
                aoprim.aio.run(coro)
        finally:
            aioloop.Loop.__init__ = real_init
            coro.close()
        return "outer goes on"

    assert aoprim.aio.run(outer()) == "outer goes on"
    assert made == []
