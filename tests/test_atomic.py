"""AtomicInt and RefCount: every semantic and error case of API.md, plus threaded stress."""
import operator
import threading

import pytest

from aoprim import AtomicInt, RefCount, RefCountError
from support import run_threads, scaled

I64_MAX = 2**63 - 1
I64_MIN = -(2**63)


class Idx:
    """Not an int, but has __index__ (operator.index accepts it)."""
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


# ---- AtomicInt ---------------------------------------------------------------------------

def test_default_and_initial_value():
    assert AtomicInt().load() == 0
    assert AtomicInt(42).load() == 42
    assert AtomicInt(value=-7).load() == -7
    assert AtomicInt(Idx(3)).load() == 3
    assert AtomicInt(True).load() == 1


def test_load_store_exchange():
    a = AtomicInt(1)
    assert a.store(5) is None
    assert a.load() == 5
    assert a.exchange(9) == 5
    assert a.load() == 9


def test_fetch_add_sub_return_old_value():
    a = AtomicInt(10)
    assert a.fetch_add() == 10
    assert a.fetch_add(5) == 11
    assert a.fetch_sub() == 16
    assert a.fetch_sub(6) == 15
    assert a.load() == 9
    assert a.fetch_add(-9) == 9
    assert a.load() == 0
    assert a.fetch_add(d=3) == 0


def test_compare_exchange():
    a = AtomicInt(3)
    assert a.compare_exchange(4, 10) is False
    assert a.load() == 3
    assert a.compare_exchange(3, 10) is True
    assert a.load() == 10


def test_int_index_repr_value():
    a = AtomicInt(12)
    assert int(a) == 12
    assert operator.index(a) == 12
    assert [0, 1, 2][AtomicInt(2)] == 2
    assert repr(a) == "AtomicInt(12)"
    assert a.value == 12
    with pytest.raises(AttributeError):
        a.value = 3


def test_wraps_modulo_2_64():
    a = AtomicInt(I64_MAX)
    assert a.fetch_add(1) == I64_MAX
    assert a.load() == I64_MIN
    assert a.fetch_sub(1) == I64_MIN
    assert a.load() == I64_MAX
    b = AtomicInt(I64_MIN)
    b.fetch_add(I64_MIN)
    assert b.load() == 0


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 2**100])
def test_overflow_error(bad):
    with pytest.raises(OverflowError):
        AtomicInt(bad)
    a = AtomicInt(1)
    for op in (a.store, a.fetch_add, a.fetch_sub, a.exchange):
        with pytest.raises(OverflowError):
            op(bad)
    with pytest.raises(OverflowError):
        a.compare_exchange(bad, 0)
    with pytest.raises(OverflowError):
        a.compare_exchange(1, bad)
    assert a.load() == 1


def test_extremes_accepted():
    a = AtomicInt(I64_MIN)
    assert a.exchange(I64_MAX) == I64_MIN
    assert a.load() == I64_MAX


@pytest.mark.parametrize("bad", [1.0, 1.5, "1", None, [1], 1j])
def test_type_error(bad):
    with pytest.raises(TypeError):
        AtomicInt(bad)
    a = AtomicInt(1)
    for op in (a.store, a.fetch_add, a.fetch_sub, a.exchange):
        with pytest.raises(TypeError):
            op(bad)
    with pytest.raises(TypeError):
        a.compare_exchange(bad, 0)
    with pytest.raises(TypeError):
        a.compare_exchange(1, bad)
    assert a.load() == 1          # a float was never silently truncated and applied


def test_fetch_add_threads_exact_total():
    a = AtomicInt()
    n = scaled(100_000)

    def work():
        f = a.fetch_add
        for _ in range(n):
            f(1)

    run_threads([work] * 4)
    assert a.load() == 4 * n


def test_compare_exchange_threads_exact_total():
    # a CAS-increment loop: lost updates would show as a short total
    a = AtomicInt()
    n = scaled(20_000)

    def work():
        for _ in range(n):
            while True:
                v = a.load()
                if a.compare_exchange(v, v + 1):
                    break

    run_threads([work] * 4)
    assert a.load() == 4 * n


# ---- RefCount ----------------------------------------------------------------------------

def test_refcount_defaults_and_counting():
    r = RefCount()
    assert r.count == 1
    assert r.incref() == 2
    assert r.incref() == 3
    assert r.decref() == 2
    assert r.decref() == 1
    with pytest.raises(AttributeError):
        r.count = 5


def test_on_zero_runs_exactly_once_in_decref_thread():
    calls = []
    r = RefCount(2, on_zero=lambda: calls.append(threading.get_ident()))
    assert r.decref() == 1
    assert calls == []
    assert r.decref() == 0
    assert calls == [threading.get_ident()]
    with pytest.raises(RefCountError):
        r.decref()
    assert calls == [threading.get_ident()]
    assert r.count == 0


def test_no_resurrection():
    r = RefCount(1)
    r.decref()
    with pytest.raises(RefCountError):
        r.incref()
    assert r.count == 0
    assert r.try_incref() is False
    assert r.count == 0


def test_zero_at_construction_is_terminal():
    calls = []
    r = RefCount(0, on_zero=lambda: calls.append(1))
    with pytest.raises(RefCountError):
        r.decref()
    with pytest.raises(RefCountError):
        r.incref()
    assert calls == []


def test_try_incref():
    r = RefCount(1)
    assert r.try_incref() is True
    assert r.count == 2


def test_refcount_errors_are_valueerrors():
    assert issubclass(RefCountError, ValueError)


def test_refcount_bad_construction():
    with pytest.raises(ValueError):
        RefCount(-1)
    with pytest.raises(TypeError):
        RefCount(1.0)
    with pytest.raises(TypeError):
        RefCount(1, on_zero=5)
    with pytest.raises(OverflowError):
        RefCount(2**64)


def test_on_zero_exception_propagates_once():
    calls = []

    def boom():
        calls.append(1)
        raise KeyError("x")

    r = RefCount(1, on_zero=boom)
    with pytest.raises(KeyError):
        r.decref()
    assert r.count == 0 and calls == [1]
    with pytest.raises(RefCountError):
        r.decref()
    assert calls == [1]


def test_refcount_threads_on_zero_exactly_once():
    """4 threads incref/decref at random; then all drop their share at once: on_zero must
    run exactly once, and the count must never have reached 0 before that."""
    rounds = scaled(200)
    per_thread = 50
    for _ in range(rounds):
        calls = []
        r = RefCount(4 * per_thread, on_zero=lambda: calls.append(threading.get_ident()))

        def work():
            for _ in range(per_thread):
                assert r.incref() >= 2
                assert r.decref() >= 1
            for _ in range(per_thread):
                r.decref()

        run_threads([work] * 4)
        assert len(calls) == 1
        assert r.count == 0


def test_try_incref_race_with_last_decref():
    """Upgraders racing the final decref: every successful try_incref is matched by a
    decref, on_zero runs once, and nobody resurrects a dead count."""
    for _ in range(scaled(300)):
        calls = []
        r = RefCount(1, on_zero=lambda: calls.append(1))
        got = []

        def upgrader():
            for _ in range(20):
                if r.try_incref():
                    got.append(1)
                    r.decref()

        def killer():
            r.decref()

        run_threads([upgrader, upgrader, killer])
        assert calls == [1]
        assert r.count == 0
