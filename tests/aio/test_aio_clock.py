"""One clock under a patched ``time.monotonic``.

asyncio's loop reads ``time.monotonic()`` through ``loop.time()`` for every deadline
(``call_later``, the wait's timeout, which timers are due) and for ``asyncio.timeout()``,
``wait_for`` and ``call_at(loop.time() + d)``; uvloop keeps its own clock and ignores the
patch.  Either way each loop stays on one clock, so a 0.2 s timeout fires after 0.2 s of
real time whatever the patched clock says.  aoprim.aio's compiled iteration and
``call_later`` read ``time.monotonic`` directly: they must go through ``loop.time()`` as soon
as ``time.monotonic`` is not the original (``unittest.mock.patch``, freezegun).

Each scenario runs on asyncio's loop (the baseline, asserted too), uvloop and aoprim.aio;
``asyncio.base_events.time`` (the module BaseEventLoop.time() reads ``monotonic`` from)
replaced by a fake is a patched clock too.  The elapsed real time is what is observed (the
awaited sleep is 3 s, so a timeout that never fires ends the probe after 3 s instead of
hanging).
"""
import asyncio
import contextlib
import time
import types
from unittest import mock

import pytest

pytestmark = pytest.mark.timeout(120)

try:
    import uvloop
except ImportError as exc:  # pragma: no cover - depends on the venv
    uvloop = None
    _UVLOOP_WHY = f"uvloop not importable: {exc}"

import aoprim.aio

KINDS = ("asyncio", "uvloop", "aoprim")
REAL = time.monotonic
DELAY = 0.2


def new_loop(kind):
    if kind == "asyncio":
        return asyncio.new_event_loop()
    if kind == "uvloop":
        if uvloop is None:
            pytest.skip(_UVLOOP_WHY)
        return uvloop.new_event_loop()
    return aoprim.aio.new_event_loop()


def _ahead():
    return mock.patch("time.monotonic", side_effect=lambda: REAL() + 1000.0)


def _behind():
    return mock.patch("time.monotonic", side_effect=lambda: REAL() - 1000.0)


def _frozen_ticking():
    freezegun = pytest.importorskip("freezegun", reason="freezegun is not installed")
    return freezegun.freeze_time("2020-01-01", tick=True)


def _module_clock(offset):
    # the time module BaseEventLoop.time() reads by its global name, replaced: asyncio's
    # loop.time() is then the fake's monotonic() while time.monotonic itself is untouched
    fake = types.SimpleNamespace(monotonic=lambda: REAL() + offset)
    return mock.patch("asyncio.base_events.time", fake)


CLOCKS = {"unpatched": contextlib.nullcontext, "ahead": _ahead, "behind": _behind,
          "freezegun-tick": _frozen_ticking,
          "base_events.time-ahead": lambda: _module_clock(1000.0),
          "base_events.time-behind": lambda: _module_clock(-1000.0)}


async def _timeout_cm():
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DELAY):
            await asyncio.sleep(3)
            return "not fired"
    return "fired"


async def _wait_for():
    try:
        await asyncio.wait_for(asyncio.sleep(3), DELAY)
    except TimeoutError:
        return "fired"
    return "not fired"


async def _call_at():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_at(loop.time() + DELAY, fut.set_result, "fired")
    loop.call_later(3, lambda: fut.done() or fut.set_result("not fired"))
    return await fut


async def _call_later():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_later(DELAY, fut.set_result, "fired")
    return await fut


async def _sleep():
    await asyncio.sleep(DELAY)
    return "fired"


PROBES = {"asyncio.timeout": _timeout_cm, "wait_for": _wait_for, "call_at": _call_at,
          "call_later": _call_later, "sleep": _sleep}


@pytest.mark.parametrize("clock", list(CLOCKS))
@pytest.mark.parametrize("kind", KINDS)
def test_deadlines_follow_one_clock(kind, clock):
    loop = new_loop(kind)
    got = {}
    try:
        with CLOCKS[clock]():
            for name, probe in PROBES.items():
                t0 = REAL()
                outcome = loop.run_until_complete(probe())
                got[name] = (outcome, REAL() - t0)
    finally:
        loop.close()
    for name, (outcome, took) in got.items():
        assert outcome == "fired" and DELAY * 0.9 <= took < DELAY + 1.5, (name, got)


@pytest.mark.parametrize("clock", ["ahead", "behind", "base_events.time-ahead",
                                   "base_events.time-behind"])
@pytest.mark.parametrize("kind", ["asyncio", "aoprim"])
def test_call_later_deadline_is_on_loop_time(kind, clock):
    # the handle's deadline is loop.time() + delay, loop.time() reading the patched clock
    loop = new_loop(kind)
    try:
        with CLOCKS[clock]():
            before = loop.time()
            h = loop.call_later(10, lambda: None)
            after = loop.time()
            h.cancel()
    finally:
        loop.close()
    assert before + 10 <= h.when() <= after + 10, (before, h.when(), after)
