"""Layer 1 differential test: one random schedule runs on both backends
("selectors" and "epoll"); the observable traces must be identical.

A schedule is a list of rounds.  Each round does some actions on the loop thread before
``run()`` (the loop is not running yet), then runs the loop for a fixed number of
iterations -- a keep-alive writer (a socket is always writable) counts them and calls
``stop()``, so the loop never sleeps and the iteration count never depends on time -- then
may ``run_ready()`` or ``close()``.  Actions (nested: a callback or timer runs its children):

- ``call_soon``; ``call_soon_threadsafe`` from a new thread (joined at once, so the order of
  the queue does not depend on the scheduler); timers with delay 0, negative, ``-inf``,
  ``inf``, NaN (refused), equal deadlines, one in the past, one far away; cancellations;
- readers and writers on socketpairs (add, remove, bytes sent, fired with level triggering);
- ``stop()``, ``close()``, ``run()``, ``run_ready()`` (each refused while running; a
  ``run_ready()`` outside ``run()`` drains, nested in another one too), a callback raising ``Exception`` (logged)
  or a ``BaseException`` (ends ``run()``), after close: ``run()``, ``call_soon_threadsafe``.

The trace is every callback that ran with its iteration number (``iterations`` counted from
the round's start; -1 outside ``run()``), every return value and exception type of a loop
method, and per round ``pending_timers``, ``errors``, ``closed``, ``reader_of``/``writer_of``.
Readiness callbacks of one iteration are compared as a set: the contract does not order
the fds of one batch.

Scale: ``AOPRIM_DIFF_EXAMPLES`` (default 50, a few seconds); the long run is documented in
tests/README.md.
"""
import logging
import math
import os
import socket
import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings, HealthCheck   # noqa: E402
from hypothesis import strategies as st                        # noqa: E402

from aoprim.server.backends import create_loop                 # noqa: E402

EXAMPLES = int(os.environ.get("AOPRIM_DIFF_EXAMPLES", "50"))
NPAIRS = 3
ROUND_ITERATIONS = 6
TIMER_KINDS = ("zero", "neg", "ninf", "inf", "eq", "past", "future", "nan", "nan_at")


class Boom(BaseException):
    """A BaseException raised by a callback: it ends run()."""


class Driver:
    def __init__(self, backend):
        self.loop = create_loop(backend)
        self.trace = []
        self.timers = []
        self.ids = 0
        self.it0 = None         # loop.iterations at the round's start while run() runs
        self.pairs = [socket.socketpair() for _ in range(NPAIRS)]
        self.ka = socket.socketpair()
        for a, b in self.pairs + [self.ka]:
            a.setblocking(False)
            b.setblocking(False)
        self.base = self.loop.clock()   # "eq"/"past" deadlines: always in the past
        self.ka_count = 0

    # -- trace -----------------------------------------------------------------------
    def it(self):
        return -1 if self.it0 is None else self.loop.iterations - self.it0

    def rec(self, *what):
        self.trace.append((self.it(),) + what)

    def call(self, name, *args):
        """A loop method: its result or its exception's type goes into the trace."""
        try:
            r = getattr(self.loop, name)(*args)
        except Exception as e:
            self.rec(name, "raised", type(e).__name__)
            return None
        if isinstance(r, bool) or r is None:
            self.rec(name, r)
        return r

    # -- actions ---------------------------------------------------------------------
    def node(self, kind, children):
        self.ids += 1
        label = f"{kind}{self.ids}"

        def cb():
            self.rec("ran", label)
            self.do_all(children)
        return cb

    def do_all(self, actions):
        for a in actions:
            self.do(a)

    def do(self, a):
        op = a[0]
        L = self.loop
        if op == "soon":
            self.call("call_soon", self.node("s", a[1]))
        elif op == "timer":
            kind = a[1]
            cb = self.node("t" + kind, a[2])
            args = {"zero": ("call_later", 0), "neg": ("call_later", -1.5),
                    "ninf": ("call_at", -math.inf), "inf": ("call_later", math.inf),
                    "eq": ("call_at", self.base), "past": ("call_at", self.base - 1.0),
                    "future": ("call_later", 3600.0), "nan": ("call_later", math.nan),
                    "nan_at": ("call_at", math.nan)}[kind]
            t = self.call(*args, cb)
            if t is not None:
                self.timers.append(t)
        elif op == "cancel":
            if self.timers:
                self.timers[a[1] % len(self.timers)].cancel()
        elif op == "threadsafe":
            cb = self.node("x", a[1])
            res = []
            th = threading.Thread(target=lambda: res.append(L.call_soon_threadsafe(cb)))
            th.start()
            th.join(30)
            self.rec("threadsafe", res)
        elif op == "send":
            self.pairs[a[1]][1].send(b"x" * a[2])
        elif op == "add_reader":
            i = a[1]
            sock = self.pairs[i][0]

            def on_read():
                sock.recv(1)
                self.rec("io", f"r{i}")
            self.call("add_reader", sock.fileno(), on_read)
        elif op == "remove_reader":
            self.call("remove_reader", self.pairs[a[1]][0].fileno())
        elif op == "add_writer":
            i, fires = a[1], a[2]
            fd = self.pairs[i][1].fileno()
            n = [0]

            def on_write():
                n[0] += 1
                self.rec("io", f"w{i}")
                if n[0] >= fires:
                    L.remove_writer(fd)
            self.call("add_writer", fd, on_write)
        elif op == "remove_writer":
            self.call("remove_writer", self.pairs[a[1]][1].fileno())
        elif op == "stop":
            L.stop()
        elif op == "close":
            self.call("close")
        elif op == "run":               # re-entrant: refused while running
            if self.it0 is not None:    # outside run() it would start a loop nobody stops
                self.call("run")
        elif op == "run_ready":         # refused while running; outside run() it drains
            self.call("run_ready")
        elif op == "raise":
            raise ValueError("a callback's exception: logged, the loop goes on")
        elif op == "boom":
            raise Boom()
        else:                               # pragma: no cover
            raise AssertionError(op)

    # -- rounds ----------------------------------------------------------------------
    def keepalive(self):
        self.ka_count += 1
        if self.ka_count == ROUND_ITERATIONS:
            self.loop.stop()

    def round(self, pre, after):
        L = self.loop
        for a in pre:
            try:
                self.do(a)
            except (ValueError, Boom) as e:     # "raise"/"boom" outside a callback
                self.rec("pre-raised", type(e).__name__)
        if not L.closed:
            self.ka_count = 0
            self.call("add_writer", self.ka[0].fileno(), self.keepalive)
        self.it0 = L.iterations
        try:
            L.run()
            self.rec("run", "returned")
        except Boom:
            self.rec("run", "Boom")
        except RuntimeError as e:
            self.rec("run", "RuntimeError", str(e))
        self.it0 = None
        if not L.closed:
            L.remove_writer(self.ka[0].fileno())
        if after == "run_ready":
            try:
                self.call("run_ready")
            except Boom:
                self.rec("run_ready", "Boom")
        elif after == "close":
            self.call("close")
        self.rec("state", L.pending_timers, L.errors, L.closed,
                 [(L.reader_of(a.fileno()) is not None, L.writer_of(b.fileno()) is not None)
                  for a, b in self.pairs])

    def finish(self):
        if not self.loop.closed:
            for a, b in self.pairs:
                self.loop.remove(a.fileno())
                self.loop.remove(b.fileno())
            self.loop.close()
        for a, b in self.pairs + [self.ka]:
            a.close()
            b.close()


def normalised(trace):
    """Readiness callbacks of one iteration sorted (a batch has no order)."""
    out, batch = [], []
    for e in trace:
        if len(e) > 1 and e[1] == "io":
            if batch and batch[0][0] != e[0]:
                out.extend(sorted(batch))
                batch = []
            batch.append(e)
            continue
        out.extend(sorted(batch))
        batch = []
        out.append(e)
    out.extend(sorted(batch))
    return out


def run_schedule(backend, rounds):
    d = Driver(backend)
    logger = logging.getLogger("aoprim.server")
    was = logger.disabled
    logger.disabled = True          # "raise" actions log tracebacks: not the point here
    try:
        for pre, after in rounds:
            d.round(pre, after)
    finally:
        logger.disabled = was
        d.finish()
    return normalised(d.trace)


# -- the schedule strategy ----------------------------------------------------------------
pair = st.integers(0, NPAIRS - 1)
leaf = st.one_of(
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("send"), pair, st.integers(1, 3)),
    st.tuples(st.just("add_reader"), pair),
    st.tuples(st.just("remove_reader"), pair),
    st.tuples(st.just("add_writer"), pair, st.integers(1, 3)),
    st.tuples(st.just("remove_writer"), pair),
    st.tuples(st.just("stop")),
    st.tuples(st.just("close")),
    st.tuples(st.just("run")),
    st.tuples(st.just("run_ready")),
    st.tuples(st.just("raise")),
    st.tuples(st.just("boom")),
)


def _extend(children):
    kids = st.lists(children, max_size=3)
    return st.one_of(
        st.tuples(st.just("soon"), kids),
        st.tuples(st.just("timer"), st.sampled_from(TIMER_KINDS), kids),
        st.tuples(st.just("threadsafe"), kids),
    )


action = st.recursive(leaf, _extend, max_leaves=12)
rounds = st.lists(
    st.tuples(st.lists(action, max_size=6),
              st.sampled_from(("none", "none", "run_ready", "close"))),
    min_size=1, max_size=4)


@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rounds)
# pinned cases: schedules where the two backends can diverge, tried on every run
@example([([("timer", "nan", [])], "none")])                         # NaN delay
@example([([("timer", "nan_at", []), ("timer", "zero", [])], "none")])  # NaN deadline
@example([([("timer", "inf", []), ("timer", "future", [("stop",)])], "none")])
@example([([("threadsafe", [])], "run_ready"), ([], "none")])        # run_ready clears wake-up
@example([([], "close"), ([("add_reader", 0), ("soon", [])], "none")])
def test_both_backends_leave_the_same_trace(rounds):
    a = run_schedule("selectors", rounds)
    b = run_schedule("epoll", rounds)
    assert a == b
