"""What test tools patch on a running loop is honoured, as on asyncio's loop.

- the selector instance's ``select`` (aiotools' ``VirtualClock().patch_loop()`` and looptime
  replace it to fast-forward time: ``await asyncio.sleep(3600)`` returns at once);
- ``asyncio.events.Handle._run`` (aiodebug's ``log_slow_callbacks.enable()`` wraps it to
  time every callback).

aoprim.aio's compiled iteration calls neither; where either is patched it must run asyncio's
Python iteration (which calls both), never sleep or run callbacks past the patch silently.
Each scenario runs on asyncio's loop (asserted too) and on aoprim.aio; uvloop has no
``_selector`` and a compiled Handle (aiotools refuses it, a Handle._run patch never runs
there), so its runs are skipped with that reason.  Hand-written patches make each
behaviour tested without the libraries; the libraries' own runs skip when missing.
Every sleep that a patch must shorten is at most 5 s, so a loop that ignores the patch
fails the elapsed-time check instead of hanging.
"""
import asyncio
import importlib.util
import logging
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)

import aoprim.aio

KINDS = ("asyncio", "uvloop", "aoprim")
REAL = time.monotonic


def new_loop(kind):
    if kind == "asyncio":
        return asyncio.new_event_loop()
    if kind == "uvloop":
        pytest.skip("uvloop has no loop._selector and runs its own Handle: these patches "
                    "do not apply there (aiotools refuses it with an AssertionError)")
    return aoprim.aio.new_event_loop()


def run(loop, coro):
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.mark.parametrize("kind", KINDS)
def test_select_replaced_on_the_selector_instance_is_called(kind):
    loop = new_loop(kind)
    seen = []

    async def main():
        sel = loop._selector
        orig = sel.select

        def select(timeout=None):
            seen.append(timeout)
            return orig(timeout)
        sel.select = select
        try:
            await asyncio.sleep(0.05)
        finally:
            del sel.select
        n = len(seen)
        await asyncio.sleep(0)
        return n

    n = run(loop, main())
    # every iteration while patched went through it, among them the 0.05 s wait
    assert n >= 2 and len(seen) == n and any(t and t > 0.01 for t in seen), seen


@pytest.mark.parametrize("kind", KINDS)
def test_hand_written_virtual_clock_fast_forwards_sleep(kind):
    # the shape of aiotools' and looptime's patches: loop.time() on the instance reads a
    # virtual clock, select() on the selector instance advances it by the timeout and polls
    loop = new_loop(kind)

    async def main():
        sel = loop._selector
        orig = sel.select
        now = [loop.time()]

        def select(timeout=None):
            if timeout:
                now[0] += timeout
            return orig(0)
        sel.select = select
        loop.time = lambda: now[0]
        start = now[0]
        t0 = REAL()
        try:
            await asyncio.sleep(5)
        finally:
            del sel.select
            del loop.time
        return now[0] - start, REAL() - t0

    virtual, real = run(loop, main())
    assert virtual >= 5 and real < 2.5, (virtual, real)


@pytest.mark.parametrize("kind", KINDS)
def test_aiotools_virtual_clock(kind):
    aiotools = pytest.importorskip("aiotools", reason="aiotools is not installed")
    loop = new_loop(kind)

    async def main():
        t0 = REAL()
        with aiotools.VirtualClock().patch_loop():
            await asyncio.sleep(5)
            await asyncio.sleep(3600)
        return REAL() - t0

    took = run(loop, main())
    assert took < 2.5, took


_LOOPTIME_CHILD = """
import asyncio, sys, time
import looptime
kind = sys.argv[1]
if kind == "aoprim":
    import aoprim.aio
    loop = aoprim.aio.new_event_loop()
else:
    loop = asyncio.new_event_loop()
loop = looptime.patch_event_loop(loop)
async def main():
    t0 = time.monotonic()
    await asyncio.sleep(3600)
    return time.monotonic() - t0, loop.time()
try:
    real, virtual = loop.run_until_complete(main())
finally:
    loop.close()
print(f"{real:.3f} {virtual:.1f}")
"""


@pytest.mark.parametrize("kind", KINDS)
def test_looptime_patched_loop(kind, tmp_path):
    # looptime ships a pytest plugin that needs pytest-asyncio: it runs in a child process,
    # so this suite never loads it
    if importlib.util.find_spec("looptime") is None:
        pytest.skip("looptime is not installed")
    new_loop(kind).close()          # (skips uvloop with the reason)
    out = subprocess.run([sys.executable, "-c", _LOOPTIME_CHILD, kind], capture_output=True,
                         text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    real, virtual = map(float, out.stdout.split())
    assert real < 2.5 and virtual >= 3600, out.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_handle_run_replaced_on_the_class_is_called(kind):
    loop = new_loop(kind)
    orig = asyncio.events.Handle._run
    ran = []

    def _run(self):
        ran.append(self._callback)
        return orig(self)

    async def main():
        fut = loop.create_future()
        loop.call_soon(fut.set_result, 1)
        loop.call_later(0.01, lambda: None)
        await fut
        await asyncio.sleep(0.02)

    asyncio.events.Handle._run = _run
    try:
        run(loop, main())
    finally:
        asyncio.events.Handle._run = orig
    assert any(getattr(cb, "__self__", None) is not None for cb in ran), ran
    assert len(ran) >= 3, ran


@pytest.mark.parametrize("kind", KINDS)
def test_aiodebug_logs_a_slow_callback(kind):
    lsc = pytest.importorskip("aiodebug.log_slow_callbacks", reason="aiodebug is not installed")
    loop = new_loop(kind)
    orig = asyncio.events.Handle._run
    slow = []

    def blocking():
        time.sleep(0.1)             # the slow callback the monitor must see

    async def main():
        loop.call_soon(blocking)
        await asyncio.sleep(0.01)

    lsc.enable(0.05, on_slow_callback=lambda name, duration: slow.append((name, duration)))
    try:
        run(loop, main())
    finally:
        asyncio.events.Handle._run = orig   # (aiodebug has no disable())
    assert len(slow) == 1 and "blocking" in slow[0][0] and slow[0][1] >= 0.1, slow


# the loop state aoprim.aio keeps in C fields (not in vars(loop)) and a value of each
# that the loop still runs with; mock.patch.object restores such an attribute by deleting
# its patch and, when the name is then missing, assigning the original back
_FIELD_PATCHES = (("_clock_resolution", 0.001), ("_debug", False), ("_stopping", False),
                  ("_timer_cancelled_count", 0))


@pytest.mark.parametrize("name,value", _FIELD_PATCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_mock_patch_object_of_loop_state_restores_it(kind, name, value):
    from unittest import mock
    loop = new_loop(kind)

    async def main():
        before = getattr(loop, name)
        with mock.patch.object(loop, name, value):
            assert getattr(loop, name) == value
            await asyncio.sleep(0.001)
        after = getattr(loop, name)
        t0 = REAL()
        fired = await asyncio.wait_for(asyncio.sleep(0.01, "timer"), 5)
        return before, after, fired, REAL() - t0

    before, after, fired, took = run(loop, main())
    assert after == before and type(after) is type(before), (before, after)
    assert fired == "timer" and took >= 0.01 - 0.002, took


@pytest.mark.parametrize("kind", KINDS)
def test_deleted_loop_state_reads_as_missing_until_assigned(kind):
    loop = new_loop(kind)
    try:
        res = loop._clock_resolution
        del loop._clock_resolution
        with pytest.raises(AttributeError, match="_clock_resolution"):
            loop._clock_resolution
        with pytest.raises(AttributeError):
            del loop._clock_resolution
        loop._clock_resolution = res
        assert loop.run_until_complete(asyncio.sleep(0.001, "ran")) == "ran"
    finally:
        loop.close()


@pytest.mark.parametrize("kind", KINDS)
def test_loop_runs_timers_after_aiotools_virtual_clock_ends(kind):
    aiotools = pytest.importorskip("aiotools", reason="aiotools is not installed")
    loop = new_loop(kind)

    async def main():
        res = loop._clock_resolution
        with aiotools.VirtualClock().patch_loop():
            await asyncio.sleep(3600)
        t0 = REAL()
        fired = await asyncio.wait_for(asyncio.sleep(0.01, "timer"), 5)
        return res, loop._clock_resolution, fired, REAL() - t0

    before, after, fired, took = run(loop, main())
    assert after == before and fired == "timer" and took >= 0.01 - 0.002, (before, after, took)
