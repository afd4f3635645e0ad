"""aoprim.aio's compiled iteration against asyncio's own ``_run_once``, over random
operation sequences (hypothesis; docs/aio-compiled.md, parts 1 and 2).

One random program -- loop operations done before the loop runs and by the callbacks it
runs: call_soon, call_later / call_at with equal and distinct deadlines, cancel (before the
handle is queued, while it waits in the ready queue, its own handle while it runs), add_reader / remove_reader /
cancelling a reader's handle on socketpairs with data sent at chosen moments, add_writer,
callbacks that schedule callbacks, callbacks that raise (reported, or SystemExit /
KeyboardInterrupt out of run_forever), loop.stop() from a callback, many cancelled timers
(the heap clean-up thresholds), contextvars set in a callback, handles with a shared
Context, with a Context the loop already runs in, created in debug mode (a
source_traceback), handles of another type or with a context that is not a Context put in
the ready queue directly -- runs on three loops:

- ``aoprim``: aoprim.aio.Loop, its compiled iteration (a fall-back to the Python path,
  counted by ``aoprim.aio._aioloop.python_iterations()``, fails the test);
- ``aoprim-py``: the same Loop forced onto asyncio's Python ``_run_once`` (a
  ``_process_events`` in the instance's dict);
- ``asyncio``: asyncio.SelectorEventLoop.

The observable trace must be equal: which callback ran in which iteration, in what order,
what each saw (its context variable, the lengths of ``_ready`` and ``_scheduled``,
``_timer_cancelled_count``), every exception-handler call (message, exception, handle,
source_traceback), every run_forever return or exception.  Time is a fake clock (the
iteration count times a power-of-two step, so deadlines compare exactly); a ticker keeps
most iterations from waiting; where it is off an idle wait is at most a millisecond.
"""
import asyncio
import contextvars
import re
import socket
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import aoprim.aio
from aoprim.aio import _aioloop

pytestmark = pytest.mark.timeout(240)

STEP = 2.0 ** -20          # fake seconds per iteration: exact in float, a wait rounds to 1 ms
END = 48                   # the iteration at which the program ends (a timer stops the loop)
NODES = 10
NSOCK = 2
CV = contextvars.ContextVar("aioq", default="-")


class _Boom(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt: reported."""


RAISES = {"ValueError": ValueError, "Base": _Boom, "Cancelled": asyncio.CancelledError,
          "SystemExit": SystemExit, "KeyboardInterrupt": KeyboardInterrupt}


class _SubHandle(asyncio.Handle):
    """A handle type of a caller's own (as a test's or a library's): run by its _run()."""
    __slots__ = ()

    def _run(self):
        self._callback.__self__.rec("sub", self._args[0])
        super()._run()


class _FakeClock:
    n_iter = 0

    def time(self):
        return self.n_iter * STEP


class CompiledLoop(_FakeClock, aoprim.aio.Loop):
    def _run_once(self):
        self.n_iter += 1
        _aioloop.run_once(self)


class FallbackLoop(_FakeClock, aoprim.aio.Loop):
    def __init__(self):
        super().__init__()
        self._process_events = self._process_events     # forces asyncio's _run_once

    def _run_once(self):
        self.n_iter += 1
        _aioloop.run_once(self)


class AsyncioLoop(_FakeClock, asyncio.SelectorEventLoop):
    def _run_once(self):
        self.n_iter += 1
        super()._run_once()


LOOPS = {"aoprim": CompiledLoop, "aoprim-py": FallbackLoop, "asyncio": AsyncioLoop}

_ADDR = re.compile(r"0x[0-9a-fA-F]+")


def _norm(s):
    return _ADDR.sub("0x?", str(s))


class Driver:
    def __init__(self, loop, prog):
        self.loop = loop
        self.setup, self.nodes, self.in_outer, self.ticker = prog
        self.trace = []
        self.done = set()
        self.handles = {}
        self.bulk = []
        self.socks = []
        for _ in range(NSOCK):
            a, b = socket.socketpair()
            a.setblocking(False)
            b.setblocking(False)
            self.socks.append((a, b))
        self.shared = contextvars.Context()
        self.outer = contextvars.Context()
        self.end = False
        loop.set_exception_handler(self.on_exc)

    # ---- what is recorded ---------------------------------------------------------------

    def rec(self, *what):
        lp = self.loop
        self.trace.append((lp.n_iter,) + what + (
            CV.get(), len(lp._ready), len(lp._scheduled), lp._timer_cancelled_count))

    def on_exc(self, lp, ctx):
        exc = ctx.get("exception")
        h = ctx.get("handle")
        tb = ctx.get("source_traceback")
        self.trace.append((lp.n_iter, "exc", sorted(ctx), _norm(ctx.get("message")),
                           type(exc).__name__, _norm(exc), type(h).__name__,
                           getattr(h, "_args", None), tb is not None,
                           tb is not None and tb is h._source_traceback, CV.get()))

    # ---- callbacks ----------------------------------------------------------------------

    def fire(self, j):
        self.rec("cb", j)
        self.node(j)

    def fire_reader(self, s, j, n):
        try:        # a reader handle left queued by a raise out of run_forever is queued
            got = len(self.socks[s][0].recv(n))     # again by the next wait: may find none
        except BlockingIOError:
            got = -1
        self.rec("rd", s, j, got)
        self.node(j)

    def fire_writer(self, s, j):
        self.rec("wr", s, j)
        self.loop.remove_writer(self.socks[s][0])
        self.node(j)

    def tick(self):
        if not self.end:
            self.tick_h = self.loop.call_soon(self.tick)

    def finish(self):
        self.rec("end")
        self.end = True
        self.loop.stop()

    def node(self, j):
        if j in self.done:
            return
        self.done.add(j)
        acts, exc = self.nodes[j]
        for a in acts:
            self.act(a, j)
        if exc is not None:
            raise RAISES[exc](f"node {j}")

    def act(self, a, j):
        lp = self.loop
        op = a[0]
        if op == "soon":
            self.handles[a[1]] = lp.call_soon(self.fire, a[1])
        elif op == "later":
            self.handles[a[1]] = lp.call_later(a[2] * STEP, self.fire, a[1])
        elif op == "at":
            self.handles[a[1]] = lp.call_at((lp.n_iter + a[2]) * STEP, self.fire, a[1])
        elif op == "soon_shared":
            self.handles[a[1]] = lp.call_soon(self.fire, a[1], context=self.shared)
        elif op == "soon_outer":
            self.handles[a[1]] = lp.call_soon(self.fire, a[1], context=self.outer)
        elif op == "soon_debug":
            lp.set_debug(True)
            try:
                self.handles[a[1]] = lp.call_soon(self.fire, a[1])
            finally:
                lp.set_debug(False)
        elif op == "sub":           # queued directly, as asyncio's own code never does
            self.handles[a[1]] = h = _SubHandle(self.fire, (a[1],), lp)
            lp._ready.append(h)
        elif op == "badctx":        # not a Context: Handle._run's ctx.run raises
            h = asyncio.Handle(self.fire, (a[1],), lp, context=object())
            lp._ready.append(h)
        elif op == "cancel":
            h = self.handles.get(a[1])
            if h is not None:
                h.cancel()
        elif op == "send":
            self.socks[a[1]][1].send(b"x" * a[2])
        elif op == "add_reader":
            lp.add_reader(self.socks[a[1]][0], self.fire_reader, a[1], a[2], a[3])
        elif op == "remove_reader":
            lp.remove_reader(self.socks[a[1]][0])
        elif op == "cancel_reader":
            try:
                key = lp._selector.get_key(self.socks[a[1]][0])
            except KeyError:
                return
            if key.data[0] is not None:
                key.data[0].cancel()
        elif op == "add_writer":
            lp.add_writer(self.socks[a[1]][0], self.fire_writer, a[1], a[2])
        elif op == "remove_writer":
            lp.remove_writer(self.socks[a[1]][0])
        elif op == "setvar":
            CV.set(f"v{j}")
        elif op == "stop":
            lp.stop()
        elif op == "bulk":
            hs = [lp.call_at((END + 1000 + i % 7) * STEP, self.fire, -1) for i in range(a[1])]
            for h in hs[:a[1] * a[2] // 100]:
                h.cancel()
            self.bulk.extend(hs)
        else:
            raise AssertionError(op)

    # ---- the run ------------------------------------------------------------------------

    def main(self):
        lp = self.loop
        for a in self.setup:
            self.act(a, -1)
        lp.call_at(END * STEP, self.finish)
        if self.ticker:
            self.tick()
        for _ in range(4 * NODES):
            if self.end:
                break
            try:
                lp.run_forever()
                self.trace.append((lp.n_iter, "returned"))
            except (SystemExit, KeyboardInterrupt) as e:
                self.trace.append((lp.n_iter, "raised", type(e).__name__, str(e)))
        self.trace.append(("left", len(lp._ready), len(lp._scheduled),
                           lp._timer_cancelled_count, CV.get()))

    def run(self):
        try:
            # the setup runs in a Context of its own (its setvar must not reach the next run)
            (self.outer if self.in_outer else contextvars.Context()).run(self.main)
        finally:
            lp = self.loop
            for a, b in self.socks:
                lp.remove_reader(a)
                lp.remove_writer(a)
                a.close()
                b.close()
            lp.close()
        return self.trace


NODE = st.integers(0, NODES - 1)
SOCK = st.integers(0, NSOCK - 1)
ACT = st.one_of(
    st.tuples(st.just("soon"), NODE),
    st.tuples(st.just("later"), NODE, st.integers(0, 4)),
    st.tuples(st.just("at"), NODE, st.integers(-2, 4)),
    st.tuples(st.just("soon_shared"), NODE),
    st.tuples(st.just("soon_outer"), NODE),
    st.tuples(st.just("soon_debug"), NODE),
    st.tuples(st.just("sub"), NODE),
    st.tuples(st.just("badctx"), NODE),
    st.tuples(st.just("cancel"), NODE),
    st.tuples(st.just("send"), SOCK, st.integers(1, 3)),
    st.tuples(st.just("add_reader"), SOCK, NODE, st.sampled_from([1, 4096])),
    st.tuples(st.just("remove_reader"), SOCK),
    st.tuples(st.just("cancel_reader"), SOCK),
    st.tuples(st.just("add_writer"), SOCK, NODE),
    st.tuples(st.just("remove_writer"), SOCK),
    st.tuples(st.just("setvar")),
    st.tuples(st.just("stop")),
    st.tuples(st.just("bulk"), st.integers(40, 160), st.integers(0, 100)),
)
EXC = st.sampled_from([None] * 6 + list(RAISES))
PROGRAM = st.tuples(
    st.lists(ACT, min_size=1, max_size=6),
    st.lists(st.tuples(st.lists(ACT, max_size=4), EXC), min_size=NODES, max_size=NODES),
    st.booleans(),                  # run inside a Context some handles also use
    st.booleans(),                  # a ticker keeps the ready queue non-empty
)


def _run(name, prog):
    loop = LOOPS[name]()
    before = _aioloop.python_iterations()
    trace = Driver(loop, prog).run()
    if name == "aoprim":
        assert _aioloop.python_iterations() == before, \
            "the compiled iteration fell back to the Python path"
    return trace


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PROGRAM)
def test_compiled_iteration_trace_equals_asyncio(prog):
    want = _run("asyncio", prog)
    assert _run("aoprim-py", prog) == want
    assert _run("aoprim", prog) == want


def test_trace_sees_what_it_claims():
    """The recorder is able to fail: a program exercising exceptions, contexts, a shared
    and an already-entered Context, debug handles, timers and an fd shows all of them."""
    prog = ([("soon", 0), ("soon_outer", 1), ("soon_shared", 2), ("soon_shared", 3),
             ("soon_debug", 4), ("at", 5, -1), ("later", 6, 0), ("send", 0, 2),
             ("add_reader", 0, 7, 1), ("bulk", 150, 80)],
            [([("setvar",), ("soon", 8)], "ValueError"), ([], None), ([("setvar",)], None),
             ([], None), ([], "Base"), ([("cancel", 6)], None), ([], None), ([], None),
             ([("stop",)], "KeyboardInterrupt"), ([], None)],
            True, False)
    tr = _run("aoprim", prog)
    assert tr == _run("asyncio", prog)
    excs = [t for t in tr if t[1] == "exc"]
    if sys.version_info < (3, 12):
        assert [e[4] for e in excs] == ["ValueError", "RuntimeError", "_Boom"], excs
        assert "already entered" in excs[1][5]
    else:       # the handler runs in the handle's Context too: it fails to enter it (logged)
        assert [e[4] for e in excs] == ["ValueError", "_Boom"], excs
        excs.insert(1, None)
    assert excs[2][2] == ["exception", "handle", "message", "source_traceback"]
    assert excs[2][9] is True
    cbs = {t[2]: t for t in tr if t[1] == "cb"}
    assert cbs[8][3] == "v0" and cbs[3][3] == "v2" and cbs[4][3] == "-"
    assert 6 not in cbs and 1 not in cbs
    assert [t[2:] for t in tr if t[1] == "raised"] == [("KeyboardInterrupt", "node 8")]
    assert any(t[1] == "rd" for t in tr)
