"""Model-based tests: random sequences of operations on MPMCQueue / SPSCQueue, checked step
by step against a collections.deque model with the same capacity and close() rules."""
import collections

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aoprim import Closed, Empty, Full, MPMCQueue, SPSCQueue

SETTINGS = settings(max_examples=200, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def machine(cls):
    class QueueModel(RuleBasedStateMachine):
        @initialize(asked=st.integers(min_value=1, max_value=20))
        def make(self, asked):
            self.q = cls(asked)
            cap = 1
            while cap < asked:
                cap *= 2
            assert self.q.capacity == cap
            self.cap = cap
            self.model = collections.deque()
            self.closed = False
            self.next = 0

        def _item(self):
            self.next += 1
            return ("item", self.next)

        # ---- producers
        def _expect_put(self, fn, item):
            if self.closed:
                try:
                    fn(item)
                except Closed:
                    return
                raise AssertionError("put on a closed queue succeeded")
            if len(self.model) >= self.cap:
                try:
                    fn(item)
                except Full:
                    return
                raise AssertionError("put on a full queue succeeded")
            fn(item)
            self.model.append(item)

        @rule()
        def put_nowait(self):
            self._expect_put(self.q.put_nowait, self._item())

        @rule()
        def put_nonblocking(self):
            self._expect_put(lambda x: self.q.put(x, block=False), self._item())

        @rule()
        def put_timeout_zero(self):
            self._expect_put(lambda x: self.q.put(x, timeout=0), self._item())

        @rule(k=st.integers(min_value=0, max_value=40),
              kind=st.sampled_from(["list", "tuple", "iter"]))
        def put_many(self, k, kind):
            items = [self._item() for _ in range(k)]
            arg = {"list": items, "tuple": tuple(items), "iter": iter(items)}[kind]
            if self.closed:
                try:
                    self.q.put_many(arg)
                except Closed:
                    return
                raise AssertionError("put_many on a closed queue succeeded")
            n = self.q.put_many(arg)
            assert n == min(k, self.cap - len(self.model))
            self.model.extend(items[:n])
            if kind == "iter":
                assert list(arg) == items[n:]      # nothing taken that was not enqueued

        # ---- consumers
        def _expect_get(self, fn):
            if not self.model:
                exc = Closed if self.closed else Empty
                try:
                    fn()
                except exc:
                    return
                raise AssertionError(f"get on an empty queue did not raise {exc.__name__}")
            assert fn() == self.model.popleft()

        @rule()
        def get_nowait(self):
            self._expect_get(self.q.get_nowait)

        @rule()
        def get_nonblocking(self):
            self._expect_get(lambda: self.q.get(False))

        @rule()
        def get_timeout_zero(self):
            self._expect_get(lambda: self.q.get(timeout=0))

        @rule()
        def get_blocking_when_ready(self):
            # a blocking get may only be called when it cannot block forever
            if self.model or self.closed:
                self._expect_get(self.q.get)

        @rule(k=st.integers(min_value=0, max_value=40))
        def get_many(self, k):
            if not self.model and self.closed:
                try:
                    self.q.get_many(k)
                except Closed:
                    return
                raise AssertionError("get_many on a closed, drained queue did not raise")
            want = [self.model.popleft() for _ in range(min(k, len(self.model)))]
            assert self.q.get_many(k) == want

        @rule()
        def close(self):
            self.q.close()
            self.closed = True

        @invariant()
        def sizes_agree(self):
            if not hasattr(self, "q"):
                return
            n = len(self.model)
            assert self.q.qsize() == n and len(self.q) == n
            assert self.q.empty() == (n == 0)
            assert self.q.full() == (n == self.cap)

    QueueModel.__name__ = f"{cls.__name__}Model"
    return QueueModel


TestMPMCModel = machine(MPMCQueue).TestCase
TestMPMCModel.settings = SETTINGS
TestSPSCModel = machine(SPSCQueue).TestCase
TestSPSCModel.settings = SETTINGS
