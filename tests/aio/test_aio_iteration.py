"""aoprim.aio's compiled iteration (aoprim.aio._aioloop.run_once) against
asyncio's own ``_run_once``: the same scenarios on both loops must record the same order of
callbacks, timers and fd events, the same clean-up of cancelled timers and reader handles;
debug mode, a mocked ``_process_events`` and a caller's selector take asyncio's path."""
import asyncio
import heapq
import logging
import selectors
import socket
import sys
import time

import pytest

import aoprim.aio
from aoprim.aio import _aioloop

pytestmark = pytest.mark.timeout(30)

LOOPS = {"asyncio": asyncio.SelectorEventLoop, "aoprim": aoprim.aio.new_event_loop}


@pytest.fixture(params=list(LOOPS))
def pair(request):
    """(name, loop) for each loop."""
    lp = LOOPS[request.param]()
    yield request.param, lp
    lp.close()


def _order_scenario(loop):
    """call_soon, a due timer, a readable fd and callbacks queued by callbacks, over a few
    iterations: the order they ran in."""
    out = []
    a, b = socket.socketpair()
    a.setblocking(False)

    def on_read():
        out.append("read:" + a.recv(100).decode())
        loop.call_soon(out.append, "soon-from-read")
        if len(out) > 12:
            loop.remove_reader(a)

    async def main():
        loop.add_reader(a, on_read)
        b.send(b"x")
        loop.call_soon(out.append, "soon1")
        loop.call_later(0, out.append, "later0")
        loop.call_at(loop.time() - 1, out.append, "past")
        h = loop.call_later(0, out.append, "cancelled")
        h.cancel()
        loop.call_soon(lambda: (out.append("soon2"), loop.call_soon(out.append, "nested")))
        for _ in range(5):
            await asyncio.sleep(0)
        b.send(b"y")
        await asyncio.sleep(0.01)
        loop.remove_reader(a)

    loop.run_until_complete(main())
    a.close()
    b.close()
    return out


def test_same_order_as_asyncio():
    runs = {}
    for name, make in LOOPS.items():
        lp = make()
        try:
            runs[name] = _order_scenario(lp)
        finally:
            lp.close()
    assert runs["aoprim"] == runs["asyncio"], runs
    assert "cancelled" not in runs["aoprim"] and "read:y" in runs["aoprim"]


def test_iteration_is_compiled():
    """No Python frame of the selector or of _process_events runs per iteration (asyncio's
    _run_once runs selectors' select and _process_events in Python each time)."""
    loop = aoprim.aio.new_event_loop()
    seen = set()

    def prof(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_name)

    async def main():
        for _ in range(20):
            await asyncio.sleep(0)

    try:
        sys.setprofile(prof)
        loop.run_until_complete(main())
    finally:
        sys.setprofile(None)
        loop.close()
    assert type(aoprim.aio.Loop.__dict__["_run_once"]).__name__ != "function"
    assert not seen & {"_run_once", "select", "_process_events", "_key_from_fd"}, seen


def test_ready_queue_call_is_compiled():
    """asyncio.Handle / TimerHandle run from C: no Handle._run frame and no Context.run call
    per callback (asyncio's iteration makes both); the callback still runs in its own
    Context.  A Handle subclass still runs through its _run()."""
    import contextvars
    loop = aoprim.aio.new_event_loop()
    seen = []
    var = contextvars.ContextVar("v", default="-")
    got = []

    class Sub(asyncio.Handle):
        __slots__ = ()

        def _run(self):
            got.append("sub")
            super()._run()

    def cb(tag):
        got.append((tag, var.get()))
        var.set(tag)

    def prof(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)
        elif event == "c_call":
            seen.append(getattr(arg, "__qualname__", ""))

    try:
        ctx = contextvars.copy_context()
        ctx.run(var.set, "c")
        loop.call_soon(cb, "a")
        loop.call_later(0, cb, "t")
        loop.call_soon(cb, "b", context=ctx)
        loop.call_soon(cb, "b2", context=ctx)
        sys.setprofile(prof)
        loop.run_until_complete(asyncio.sleep(0))
        sys.setprofile(None)
        assert "_run" not in seen and "Context.run" not in seen, seen
        assert _aioloop.ready_call_compiled()
        assert got == [("a", "-"), ("b", "c"), ("b2", "b"), ("t", "-")], got
        loop._ready.append(Sub(cb, ("s",), loop))
        loop.run_until_complete(asyncio.sleep(0))
        assert got[-2:] == ["sub", ("s", "-")]
        assert var.get() == "-" and ctx[var] == "b2"
    finally:
        sys.setprofile(None)
        loop.close()


def test_iteration_calls_no_python_time_unless_overridden():
    """BaseEventLoop.time (a Python frame calling time.monotonic) is not called by the
    compiled iteration (step 1 called it once or twice per iteration); a time() replaced
    on the instance or in a subclass is called, and decides which timers are due."""
    loop = aoprim.aio.new_event_loop()
    seen = []

    def prof(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    when = loop.time()              # (call_later itself calls time())

    async def main():
        loop.call_at(when, lambda: None)
        for _ in range(5):
            await asyncio.sleep(0)

    try:
        sys.setprofile(prof)
        loop.run_until_complete(main())
        sys.setprofile(None)
        assert "time" not in seen, seen
        now = [loop.time()]
        loop.time = lambda: now[0]
        out = []
        loop.call_at(now[0] + 1000, out.append, "late")
        loop.call_soon(out.append, "soon")
        loop.run_until_complete(asyncio.sleep(0))
        assert out == ["soon"]
        now[0] += 1000
        loop.call_soon(out.append, "soon2")
        loop.run_until_complete(asyncio.sleep(0))
        assert out == ["soon", "soon2", "late"], out
    finally:
        sys.setprofile(None)
        loop.close()


def test_cancelled_timers_cleaned_as_asyncio(pair):
    """More than 100 timers, more than half cancelled: one iteration rebuilds the heap
    without them; cancelled ones at the head are popped."""
    name, loop = pair
    hs = [loop.call_later(100 + i, lambda: None) for i in range(300)]
    for h in hs[:200]:
        h.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    assert len(loop._scheduled) == 100 and loop._timer_cancelled_count == 0
    assert all(not h._scheduled for h in hs[:200])
    for h in hs[200:210]:
        h.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    assert len(loop._scheduled) == 90 and loop._timer_cancelled_count == 0
    for h in hs:
        h.cancel()


def test_cancelled_reader_handle_removes_the_reader(pair):
    name, loop = pair
    a, b = socket.socketpair()
    calls = []
    loop.add_reader(a, calls.append, 1)
    loop._selector.get_key(a).data[0].cancel()
    b.send(b"x")
    loop.run_until_complete(asyncio.sleep(0.01))
    assert calls == []
    with pytest.raises(KeyError):
        loop._selector.get_key(a)
    a.close()
    b.close()


def test_timers_never_early_and_sleep_wakes(pair):
    name, loop = pair
    t0 = time.monotonic()
    fired = []
    loop.call_later(0.05, lambda: fired.append(time.monotonic()))
    loop.run_until_complete(asyncio.sleep(0.08))
    assert fired and fired[0] - t0 >= 0.05 - 0.001


def test_debug_mode_takes_asyncio_path_slow_callback_logged(caplog):
    loop = aoprim.aio.new_event_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.01
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            loop.call_soon(time.sleep, 0.03)
            loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert any("took" in r.getMessage() for r in caplog.records)


def test_process_events_overridden_on_instance_is_called():
    loop = aoprim.aio.new_event_loop()
    seen = []
    orig = loop._process_events
    loop._process_events = lambda ev: (seen.append(len(ev)), orig(ev))
    try:
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert seen


def test_callers_selector_takes_asyncio_path():
    sel = selectors.SelectSelector()
    loop = aoprim.aio.Loop(sel)
    try:
        a, b = socket.socketpair()
        got = loop.create_future()
        loop.add_reader(a, lambda: got.done() or got.set_result(a.recv(10)))
        b.send(b"hi")
        assert loop.run_until_complete(asyncio.wait_for(got, 5)) == b"hi"
        loop.remove_reader(a)
        a.close()
        b.close()
    finally:
        loop.close()


def test_signal_handler_during_wait_runs_and_loop_goes_on():
    import os
    import signal
    import threading
    loop = aoprim.aio.new_event_loop()
    got = []
    try:
        loop.add_signal_handler(signal.SIGUSR1, got.append, 1)
        t = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1))
        t.start()
        loop.run_until_complete(asyncio.sleep(0.2))
        t.join()
        loop.remove_signal_handler(signal.SIGUSR1)
    finally:
        loop.close()
    assert got == [1]


def test_configure_refuses_non_epoll_selector():
    _aioloop.configure(aoprim.aio.loop._base_run_once, selectors.SelectSelector)
    try:
        loop = aoprim.aio.new_event_loop()
        try:
            assert loop.run_until_complete(asyncio.sleep(0, "ok")) == "ok"
        finally:
            loop.close()
    finally:
        _aioloop.configure(aoprim.aio.loop._base_run_once, aoprim.aio.loop._Selector)


def test_nan_timer_as_asyncio(pair):
    """asyncio accepts call_at(nan).  A nan timer at the top of the heap: before 3.13
    asyncio's timeout is min(max(0, nan), MAX) = 0 and the timer runs in the next iteration
    (``nan >= end_time`` is False); from 3.13 the nan reaches selectors, whose ceil raises
    ValueError out of run_forever.  The compiled wait made <int>ceil(nan * 1e3) of it
    (INT_MIN: epoll_wait without a limit) and the loop slept forever.  A timer 2**40 s away
    and one at inf stay pending."""
    name, loop = pair
    out = []
    loop.call_at(float("nan"), lambda: (out.append("nan"), loop.stop()))
    # queued after the nan timer, they stay below it in the heap (x < nan is False)
    loop.call_at(loop.time() + 2 ** 40, out.append, "far")
    loop.call_later(float("inf"), out.append, "inf")
    guard = loop.call_later(5, loop.stop)
    t0 = time.monotonic()
    if sys.version_info < (3, 13):
        loop.run_forever()
        assert out == ["nan"], name
    else:
        with pytest.raises(ValueError, match="NaN"):
            loop.run_forever()
        assert out == [] and not loop.is_running(), name
    guard.cancel()
    assert time.monotonic() - t0 < 2.5, name


# ---- the scheduling calls (call_soon / call_at / call_later / create_future in C) ---------

def _frames(fn):
    """The Python functions fn() runs (their code names)."""
    seen = []

    def prof(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)
    try:
        sys.setprofile(prof)
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_scheduling_calls_run_no_python_frame_and_make_asyncio_handles():
    """call_soon / call_at / call_later / create_future run no Python frame (asyncio's ran
    call_soon, _call_soon, Handle.__init__, get_debug, _check_closed, call_at,
    TimerHandle.__init__, TimerHandle.__lt__ per heap comparison, time, create_future) and
    return asyncio's own handle types with the slots asyncio's __init__ sets."""
    import contextvars
    loop = aoprim.aio.new_event_loop()
    try:
        made = {}

        def make():
            made["s"] = loop.call_soon(print, 1, 2)
            made["a"] = loop.call_at(5.0, print)
            made["l"] = [loop.call_later(d, print) for d in (3.0, 1.0, 2.0, 1.0)]
            made["f"] = loop.create_future()

        # (get_debug, which asyncio.Future's own __init__ asks the loop, is compiled too)
        assert set(_frames(make)) - {"make", "<listcomp>"} == set()
        s, a = made["s"], made["a"]
        assert type(s) is asyncio.Handle and type(a) is asyncio.TimerHandle
        assert (s._callback, s._args, s._loop, s._cancelled, s._repr,
                s._source_traceback) == (print, (1, 2), loop, False, None, None)
        assert isinstance(s._context, contextvars.Context)
        assert (a._when, a._scheduled) == (5.0, True) and a.when() == 5.0
        assert list(loop._ready) == [s] and len(loop._scheduled) == 5
        assert type(made["f"]) is asyncio.Future and made["f"].get_loop() is loop
        ctx = contextvars.copy_context()
        assert loop.call_soon(print, context=ctx)._context is ctx
        assert "print" in repr(s)
        s.cancel()
        assert s.cancelled() and s._callback is None
        loop.close()
        with pytest.raises(RuntimeError, match="Event loop is closed"):
            loop.call_soon(print)
        with pytest.raises(RuntimeError, match="Event loop is closed"):
            loop.call_later(1, print)
        with pytest.raises(TypeError, match="when cannot be None"):
            loop.call_at(None, print)
        with pytest.raises(TypeError, match="delay must not be None"):
            loop.call_later(None, print)
    finally:
        loop.close()


def test_timer_heap_is_heapqs_over_random_deadlines():
    """The C heap push / pop (heapq's algorithm, _when compared directly) leave
    ``_scheduled`` in exactly the layout asyncio's heapq + TimerHandle.__lt__ leave, over
    random deadlines with many ties, ints mixed with floats, cancels and runs -- so timers
    with equal deadlines run in asyncio's order."""
    import random
    rnd = random.Random(23)
    for trial in range(30):
        ops = [(rnd.choice([rnd.randrange(8), rnd.randrange(8) * 0.5, -1.0]),
                rnd.random() < 0.2) for _ in range(rnd.randrange(1, 60))]
        layouts = {}
        for name, make in LOOPS.items():
            lp = make()
            base = int(lp.time()) + 1000      # an int: int + int deadlines stay ints
            out, hs = [], []
            try:
                for i, (d, cancel) in enumerate(ops):
                    h = lp.call_at(base + d if d >= 0 else base, out.append, i)
                    hs.append(h)
                    if cancel:
                        h.cancel()
                index = {id(h): i for i, h in enumerate(hs)}
                layout = [index[id(h)] for h in lp._scheduled]
                # run them all: the pops (the iteration's C heappop) in heap order
                for h in lp._scheduled:
                    h._when -= 2000.0
                lp.run_until_complete(asyncio.sleep(0))
                layouts[name] = (layout, out)
            finally:
                lp.close()
        assert layouts["aoprim"] == layouts["asyncio"], (trial, ops)


def test_scheduling_falls_back_to_asyncio_in_debug_mode_and_on_overrides():
    """Debug mode: asyncio's call_soon (a source traceback ending at the caller, the
    thread check); a subclass overriding _call_soon is called; patching the class after
    its first call_soon (its version tag changes) is seen."""
    loop = aoprim.aio.new_event_loop()
    try:
        loop.set_debug(True)
        h = loop.call_soon(print)
        assert h._source_traceback and h._source_traceback[-1].name == (
            "test_scheduling_falls_back_to_asyncio_in_debug_mode_and_on_overrides")
        t = loop.call_later(1, print)
        assert t._source_traceback[-1].name == h._source_traceback[-1].name
    finally:
        loop.set_debug(False)
        loop.close()

    calls = []

    class Sub(aoprim.aio.Loop):
        pass

    lp = Sub()
    try:
        lp.call_soon(print)
        assert calls == []

        def _call_soon(self, callback, args, context):
            calls.append(callback)
            return asyncio.SelectorEventLoop._call_soon(self, callback, args, context)
        Sub._call_soon = _call_soon             # after the class was checked and cached
        lp.call_soon(print)
        assert calls == [print]
        t0 = []
        Sub.time = lambda self: (t0.append(1), 100.0)[1]
        assert lp.call_later(1.5, print).when() == 101.5 and t0 == [1]
    finally:
        lp.close()


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("name, lead", [("call_soon", ()), ("call_later", (1,)),
                                        ("call_at", (1,)), ("call_soon_threadsafe", ())])
def test_unexpected_keyword_raises_as_asyncio(name, lead, debug):
    """``loop.call_soon(cb, x=1)`` raises asyncio's TypeError word for word (the compiled
    call_soon/call_at/call_later once said "call_soon() got ..." without the class); also
    with several unknown keywords and with ``context=`` beside them, compiled and debug."""
    for kw in ({"x": 1}, {"context": None, "y": 2, "z": 3}):
        msgs = []
        for loop in (asyncio.new_event_loop(), aoprim.aio.new_event_loop()):
            try:
                loop.set_debug(debug)
                with pytest.raises(TypeError) as info:
                    getattr(loop, name)(*lead, print, **kw)
                msgs.append(str(info.value))
                assert not loop._ready and not loop._scheduled
            finally:
                loop.close()
        assert msgs[1] == msgs[0], (name, kw)


# -- LoopCore: the loop state in C fields behind descriptors --------------------------------

CORE_FIELDS = ("_ready", "_scheduled", "_selector", "_stopping", "_debug", "_closed",
               "_clock_resolution", "_timer_cancelled_count")


def test_loop_state_lives_in_loopcore_fields_that_asyncio_code_reads_and_writes():
    """aoprim.aio.Loop's first base is LoopCore: the names asyncio's __init__ assigns are
    its data descriptors (not in the instance __dict__), holding what asyncio stored."""
    loop = aoprim.aio.new_event_loop()
    try:
        assert type(loop).__mro__[1] is _aioloop.LoopCore
        for name in CORE_FIELDS:
            assert name not in vars(loop), name
        assert type(loop._ready).__name__ == "deque" and loop._scheduled == []
        assert loop._closed is False and loop._stopping is False
        assert loop._timer_cancelled_count == 0
        assert loop._clock_resolution == time.get_clock_info("monotonic").resolution
        loop.set_debug(True)
        assert loop._debug is True and loop.get_debug() is True
        loop.set_debug(False)
        assert loop._debug is False
    finally:
        loop.close()
    assert loop._closed is True and loop.is_closed()


def test_compiled_iteration_follows_a_replaced_ready_queue_and_timer_heap():
    """The iteration reads the fields each time: a _ready deque or _scheduled list that
    Python code replaced is the one that runs (a cached old object would lose these)."""
    import collections
    import heapq
    loop = aoprim.aio.new_event_loop()
    out = []
    try:
        loop._ready = collections.deque()
        loop.call_soon(out.append, "soon")
        loop._scheduled = []
        h = asyncio.TimerHandle(loop.time() - 1, out.append, ("timer",), loop)
        heapq.heappush(loop._scheduled, h)
        h._scheduled = True
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert out == ["soon", "timer"]
        assert len(loop._ready) == 0 and loop._scheduled == []
    finally:
        loop.close()


def test_cancelled_reader_handle_is_removed_by_the_iteration(pair):
    """_process_events: a reader Handle cancelled behind the loop's back (not through
    remove_reader) is dropped by the next event on its fd, on both loops alike."""
    name, loop = pair
    a, b = socket.socketpair()
    a.setblocking(False)
    hits = []
    try:
        loop.add_reader(a, hits.append, 1)
        key = loop._selector.get_key(a)
        key.data[0].cancel()            # the reader Handle itself
        b.send(b"x")
        loop.call_later(0.05, loop.stop)
        loop.run_forever()
        assert hits == []
        with pytest.raises(KeyError):
            loop._selector.get_key(a)   # removed by the iteration
    finally:
        a.close()
        b.close()


def test_a_loop_in_a_reference_cycle_is_collected():
    """LoopCore's fields are traversed: a cycle through _ready (a handle whose callback
    holds the loop) is found by the collector and the loop freed."""
    import gc
    import weakref
    loop = aoprim.aio.new_event_loop()
    loop.close()
    loop._ready.append(asyncio.Handle(lambda lp=loop: lp, (), loop))
    loop._scheduled.append(loop)
    ref = weakref.ref(loop)
    del loop
    gc.collect()
    assert ref() is None


def test_a_ready_queue_of_another_type_is_used_through_its_own_methods():
    """The iteration calls deque.append / deque.popleft directly only on an exact deque:
    a subclass's (or another type's) append and popleft are called, as asyncio does --
    for the due timer, the fd event and the run of the queue."""
    import collections
    calls = []

    class Q(collections.deque):
        def append(self, x):
            calls.append("append")
            super().append(x)

        def popleft(self):
            calls.append("popleft")
            return super().popleft()

    loop = aoprim.aio.new_event_loop()
    a, b = socket.socketpair()
    out = []
    try:
        loop._ready = Q()
        loop.call_at(loop.time() - 1, out.append, "timer")
        loop.add_reader(a, lambda: (out.append(a.recv(10)), loop.remove_reader(a),
                                    loop.stop()))
        b.send(b"x")
        calls.clear()
        loop.run_forever()
        assert out == ["timer", b"x"] or out == [b"x", "timer"]
        # the timer and the reader handle were queued by append, each run popped by popleft
        assert calls.count("append") >= 2 and calls.count("popleft") >= 2
    finally:
        a.close()
        b.close()
        loop.close()


def test_due_timers_leave_the_heap_as_asyncios():
    """The iteration's due-timer pops (an exact TimerHandle's float ``_when`` compared and
    its ``_scheduled`` cleared by slot): float, int and equal deadlines, a subclass
    of TimerHandle pushed by heapq, run in asyncio's order and marked unscheduled, and a
    timer in the future stays scheduled -- the same on both loops."""
    class Sub(asyncio.TimerHandle):
        pass

    res = {}
    for name, make in LOOPS.items():
        lp = make()
        try:
            out = []
            base = lp.time()
            hs = [lp.call_at(base - 1.0, out.append, "f1"),
                  lp.call_at(int(base) - 2, out.append, "int"),
                  lp.call_at(base - 1.0, out.append, "f1b"),
                  lp.call_at(base + 3600.0, out.append, "later")]
            sub = Sub(base - 1.5, out.append, ("sub",), lp)
            heapq.heappush(lp._scheduled, sub)
            sub._scheduled = True
            hs.append(sub)
            lp.run_until_complete(asyncio.sleep(0))
            res[name] = (out, [h._scheduled for h in hs], len(lp._scheduled))
        finally:
            lp.close()
    assert res["aoprim"] == res["asyncio"]
    assert res["aoprim"][1] == [False, False, False, True, False], res


def _shadowing_subclasses(base):
    """Subclasses of ``base`` that put their own attribute in front of a name asyncio's
    loop state lives in (LoopCore's fields on aoprim.aio): a __slots__ slot, a property,
    a plain class attribute asyncio's __init__ then overrides in the instance __dict__."""
    import collections

    class Slots(base):
        __slots__ = ("_ready",)

    class ReadyProp(base):
        @property
        def _ready(self):
            return self.__dict__.setdefault("rq", collections.deque())

        @_ready.setter
        def _ready(self, v):
            self.__dict__["rq"] = v

    class DebugProp(base):
        @property
        def _debug(self):
            return self.__dict__.get("dbg", False)

        @_debug.setter
        def _debug(self, v):
            self.__dict__["dbg"] = v

    class ClassAttrs(base):
        _scheduled = None
        _selector = None
        _stopping = None
        _closed = None
        _clock_resolution = None
        _timer_cancelled_count = None

    class SchedSub(base):
        def __init__(self):
            super().__init__()

            class HeapList(list):
                pass
            self._scheduled = HeapList()

    return [Slots, ReadyProp, DebugProp, ClassAttrs, SchedSub]


def _shadow_scenario(cls):
    loop = cls()
    out = []
    try:
        loop.call_soon(out.append, "soon")
        # (due well after the first iterations, however slow a busy machine makes them:
        # the order of "later" and "fut" is then the same on both loops)
        h = loop.call_later(0.05, out.append, "later")
        loop.call_later(0.06, out.append, "cancelled").cancel()
        loop.call_at(loop.time() - 1, out.append, "past")
        fut = loop.create_future()
        fut.add_done_callback(lambda f: out.append(f.result()))
        loop.call_soon(fut.set_result, "fut")
        loop.run_until_complete(asyncio.sleep(0.1))
        out.append(("debug", loop.get_debug(), h._scheduled, len(loop._ready)))
        loop.set_debug(True)
        out.append(("debug", loop.get_debug()))
    finally:
        loop.close()
    out.append(("closed", loop.is_closed()))
    return out


@pytest.mark.parametrize("i", range(5))
def test_a_subclass_shadowing_the_loop_state_names_runs_as_on_asyncio(i):
    """A Loop subclass whose own class attribute (a slot, a property, a plain value) comes
    before LoopCore's descriptor for ``_ready``, ``_debug``, ``_scheduled``...: asyncio's
    code stores and reads through the subclass's attribute, so the compiled paths must too
    (they read LoopCore's C fields, None there) -- and a list subclass as the timer heap is
    what heapq takes.  The same scenario on asyncio's loop and the same subclass of
    aoprim.aio.Loop records the same."""
    want = _shadow_scenario(_shadowing_subclasses(asyncio.SelectorEventLoop)[i])
    got = _shadow_scenario(_shadowing_subclasses(aoprim.aio.Loop)[i])
    assert got == want


_HOOKS = ("call_at", "call_soon", "call_later", "_run_once", "_add_callback")


def _hook_scenario(base, hooks):
    """A subclass of ``base`` overriding ``hooks`` (each counting its calls, then calling
    the base's) runs timers, sleeps, ``wait_for``, ``asyncio.timeout`` and a readable fd:
    the calls each override saw."""
    seen = dict.fromkeys(hooks, 0)

    def counting(name):
        def method(self, *args, **kwargs):
            seen[name] += 1
            return getattr(super(Sub, self), name)(*args, **kwargs)
        return method

    Sub = type("Sub", (base,), {name: counting(name) for name in hooks})
    loop = Sub()
    a, b = socket.socketpair()
    a.setblocking(False)

    async def main():
        got = loop.create_future()

        def on_read():
            loop.remove_reader(a)
            got.set_result(a.recv(10))
        loop.add_reader(a, on_read)
        b.send(b"x")
        assert await got == b"x"
        for _ in range(3):
            await asyncio.sleep(0)
        await asyncio.sleep(0.001)
        fut = loop.create_future()
        loop.call_later(0.001, fut.set_result, 1)
        await fut
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 0.001)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.001):
                await asyncio.sleep(10)
        loop.call_at(loop.time(), fut.cancel)
        await asyncio.sleep(0.001)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        a.close()
        b.close()
    return seen


@pytest.mark.parametrize("hooks", [(name,) for name in _HOOKS] + [_HOOKS],
                         ids=[*_HOOKS, "all"])
def test_a_subclass_overriding_a_scheduling_hook_sees_what_asyncio_shows_it(hooks):
    """A Loop subclass overriding ``call_at`` (a test framework's clock, an instrumenting
    loop), ``call_soon``, ``call_later``, ``_run_once`` or ``_add_callback`` is called
    wherever asyncio's own loop calls it: ``call_later`` (asyncio.sleep, wait_for on 3.11)
    goes through ``self.call_at``, a ready fd through ``self._add_callback``.  The same
    subclass of asyncio.SelectorEventLoop counts the calls to compare with (the iteration
    count depends on timing: only that it is called)."""
    want = _hook_scenario(asyncio.SelectorEventLoop, hooks)
    got = _hook_scenario(aoprim.aio.Loop, hooks)
    if "_run_once" in hooks:
        assert got.pop("_run_once") > 0 and want.pop("_run_once") > 0
    assert got == want
    assert all(want.values()), want     # each hook is one the scenario reaches


def test_a_call_at_override_set_after_the_class_was_used_is_seen_by_call_later():
    """The class check is remembered by the class's version tag: a call_at assigned to a
    Loop subclass after its call_later ran compiled is used by the next call_later, and
    removing it gives the compiled path back."""
    class Sub(aoprim.aio.Loop):
        pass

    calls = []
    loop = Sub()
    try:
        loop.call_later(10, print).cancel()

        def call_at(self, when, callback, *args, context=None):
            calls.append(when)
            return aoprim.aio.Loop.call_at(self, when, callback, *args, context=context)
        Sub.call_at = call_at
        t = loop.call_later(10, print)
        assert calls == [t.when()]
        del Sub.call_at
        loop.call_later(10, print)
        assert len(calls) == 1
    finally:
        loop.close()


def _referents_by_identity(o):
    import gc
    return sorted(map(id, gc.get_referents(o)))


def test_handles_are_traversed_by_the_compiled_function_exactly_as_by_cpythons():
    """asyncio's Handle and TimerHandle get a compiled tp_traverse (their slots at fixed
    offsets): the cycle collector must see exactly the references CPython's own
    subtype_traverse shows -- every slot and the type, for the exact classes and for
    subclasses (with a __dict__, with slots of their own, with a second level)."""
    import gc
    assert _aioloop.handle_traverse() is True      # installed on every supported CPython
    loop = asyncio.SelectorEventLoop()

    class Sub(asyncio.TimerHandle):
        pass

    class Slotted(asyncio.Handle):
        __slots__ = ("extra",)

    class Deeper(Slotted):
        pass

    try:
        objs = [asyncio.Handle(print, (1, [2]), loop), asyncio.TimerHandle(1.5, print, (), loop),
                Sub(2.0, print, ("s",), loop), Slotted(print, (), loop), Deeper(len, ("x",), loop)]
        objs[2].attr = [3]
        objs[3].extra = {"e": 1}
        objs[4].extra = ["deep"]
        objs[4].more = ("m", [4])
        objs[0].cancel()                    # slots cleared to None
        on = [_referents_by_identity(o) for o in objs]
        exact_on = [gc.get_referents(o) for o in objs[:2]]
        _aioloop.handle_traverse(False)
        try:
            off = [_referents_by_identity(o) for o in objs]
            exact_off = [gc.get_referents(o) for o in objs[:2]]
        finally:
            _aioloop.handle_traverse(True)
        assert on == off
        assert exact_on == exact_off        # the exact classes: the same order too
        assert all(type(o) in gc.get_referents(o) for o in objs)
    finally:
        loop.close()


def test_a_cycle_through_a_queued_handle_is_collected():
    """A handle queued by call_soon / call_later whose callback refers back to it (and to
    the loop) is found by the collector once the loop is dropped: traversed slots."""
    import gc
    import weakref
    loop = aoprim.aio.new_event_loop()
    box = []
    h = loop.call_soon(box.append, box)
    box.append(h)
    t = loop.call_later(3600, box.append, box)
    box.append(t)
    refs = [weakref.ref(h), weakref.ref(t), weakref.ref(loop)]
    loop.close()        # close() clears _ready and _scheduled; the cycle holds the handles
    del h, t, loop, box
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_instance_overrides_set_and_removed_between_iterations_are_seen_at_once():
    """The iteration and call_later remember what the loop's instance __dict__ overrides
    (``_process_events``, ``time``) until the dict changes (its version tag): an override
    set after many compiled iterations is used by the very next one, its removal too, and
    changes of other attributes or of another dict never hide one."""
    loop = aoprim.aio.new_event_loop()
    seen = []
    orig = loop._process_events
    other = {}

    def step():
        loop.run_until_complete(asyncio.sleep(0))

    try:
        for _ in range(20):
            step()                      # compiled iterations; the dict's bits remembered
        loop._process_events = lambda ev: (seen.append("pe"), orig(ev))
        step()
        assert seen, "the override set after compiled iterations was not called"
        n = len(seen)
        loop.unrelated = 1              # another key changes: the override stays seen
        other["_process_events"] = 1    # another dict changing does not matter
        step()
        assert len(seen) > n
        del loop._process_events
        n = len(seen)
        step()
        step()
        assert len(seen) == n           # removed: the compiled iteration again
        fake = [loop.time() + 1000.0]
        loop.time = lambda: fake[0]     # call_later and the due check use it at once
        h = loop.call_later(5, lambda: None)
        assert h.when() == fake[0] + 5
        del loop.time
        h2 = loop.call_later(5, lambda: None)
        assert h2.when() < fake[0]
        h.cancel()
        h2.cancel()
    finally:
        loop.close()


@pytest.mark.parametrize("debug", [False, True])
def test_call_soon_parses_its_arguments_as_asyncio(debug):
    """call_soon is a C method that parses its arguments itself (no keyword dict): every
    way of calling it gives asyncio's result or asyncio's TypeError word for word, and
    its signature is asyncio's."""
    import inspect
    calls = [((), {}), ((print, 1), {"callback": print}), ((print,), {"x": 1}),
             ((), {"callback": print}), ((print, 1, 2), {"context": None, "y": 2}),
             ((), {"context": None}), ((print, 1), {"context": None}),
             ((), {"callback": print, "context": None})]
    res = []
    for loop in (asyncio.SelectorEventLoop(), aoprim.aio.new_event_loop()):
        try:
            loop.set_debug(debug)
            out = []
            for args, kw in calls:
                try:
                    h = loop.call_soon(*args, **kw)
                    out.append(("ok", type(h), h._args, h._callback))
                except TypeError as e:
                    out.append(("TypeError", str(e)))
            out.append(str(inspect.signature(loop.call_soon)))
            res.append(out)
        finally:
            loop.close()
    assert res[1] == res[0]
