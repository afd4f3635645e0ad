"""AtomicInt and RefCount: every semantic and error case of docs/api.md, plus threaded stress."""
import operator
import re
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


@pytest.mark.parametrize("spec", [",", "_", "x", "#x", "X", "o", "b", "d", ">12", "<12,",
                                  "+d", "012d", "e", ".2f", "%"])
@pytest.mark.parametrize("value", [1234567, -255, 0])
def test_format_spec_as_int(spec, value):
    a = AtomicInt(value)
    assert format(a, spec) == format(value, spec)
    assert f"{a:{spec}}" == f"{value:{spec}}"


def test_format_empty_spec_is_str():
    a = AtomicInt(7)
    assert format(a, "") == f"{a}" == str(a) == "AtomicInt(7)"


def test_format_bad_spec_is_ints_error():
    with pytest.raises(ValueError, match="Unknown format code 'Q'"):
        format(AtomicInt(1), "Q")


def test_wraps_modulo_2_64():
    a = AtomicInt(I64_MAX)
    assert a.fetch_add(1) == I64_MAX
    assert a.load() == I64_MIN
    assert a.fetch_sub(1) == I64_MIN
    assert a.load() == I64_MAX
    b = AtomicInt(I64_MIN)
    b.fetch_add(I64_MIN)
    assert b.load() == 0


def _wrap(x):
    return (x + 2**63) % 2**64 - 2**63


class IntSub(int):
    pass


def test_every_int_form_reads_as_python_does():
    # Small exact ints are read in place, every other argument through operator.index: the
    # values around each digit boundary (2**30, 2**60) and the 64-bit limits, as an exact
    # int, a bool, an int subclass and an __index__ object, against Python's own arithmetic.
    import random
    rng = random.Random(1234)
    edges = [0, 1, 2**15, 2**30, 2**31, 2**60, 2**62, I64_MAX]
    values = {s * e + k for e in edges for s in (1, -1) for k in (-2, -1, 0, 1, 2)}
    values |= {rng.randrange(I64_MIN, I64_MAX + 1) for _ in range(200)}
    values = sorted(v for v in values if I64_MIN <= v <= I64_MAX)
    forms = [lambda v: v, IntSub, Idx]
    start = 5
    for v in values:
        for form in forms:
            x = form(v)
            assert AtomicInt(x).load() == v
            a = AtomicInt(start)
            assert a.fetch_add(x) == start and a.load() == _wrap(start + v), (v, form)
            assert a.fetch_sub(x) == _wrap(start + v) and a.load() == start, (v, form)
            a += x
            assert a.load() == _wrap(start + v), (v, form)
            a -= x
            a ^= x
            assert a.load() == start ^ v, (v, form)
            assert a.exchange(x) == start ^ v and a.load() == v
            assert a.compare_exchange(x, 7) and a.load() == 7
    for b in (True, False):
        a = AtomicInt(start)
        a.fetch_add(b)
        a += b
        assert a.load() == start + 2 * b


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


# ---- AtomicInt as a number ---------------------------------------------------------------
# One atomic step: a += n, a -= n, a &= n, a |= n, a ^= n (seq_cst fetch_add / fetch_sub /
# fetch_and / fetch_or / fetch_xor; `a` stays the same object).  A load followed by Python's
# int operation (the result is a plain int): comparisons, a + n, a - n, a & n, a | n, a ^ n
# (and reflected), -a, +a, ~a, abs(a), bool(a).  Not provided: *, /, //, %, **, <<, >>.

CMP_VALUES = [I64_MIN, -5, -1, 0, 1, 5, I64_MAX, 2**63, -(2**63) - 1, 2**100]


@pytest.mark.parametrize("v", [I64_MIN, -1, 0, 1, I64_MAX])
@pytest.mark.parametrize("x", CMP_VALUES)
def test_comparisons_against_ints(v, x):
    a = AtomicInt(v)
    assert (a == x) is (v == x)
    assert (a != x) is (v != x)
    assert (a < x) is (v < x)
    assert (a <= x) is (v <= x)
    assert (a > x) is (v > x)
    assert (a >= x) is (v >= x)
    # reflected: the int on the left
    assert (x == a) is (x == v)
    assert (x != a) is (x != v)
    assert (x < a) is (x < v)
    assert (x <= a) is (x <= v)
    assert (x > a) is (x > v)
    assert (x >= a) is (x >= v)


def test_comparisons_read_the_current_value():
    a = AtomicInt(1)
    assert a == 1 and a == True  # noqa: E712 - bool is an int
    a.store(2)
    assert a == 2 and a != 1 and a > 1 and 1 < a


@pytest.mark.parametrize("v,w", [(0, 0), (-3, 4), (4, -3), (I64_MIN, I64_MAX), (7, 7)])
def test_comparisons_between_atomicints(v, w):
    a, b = AtomicInt(v), AtomicInt(w)
    assert (a == b) is (v == w)
    assert (a != b) is (v != w)
    assert (a < b) is (v < w)
    assert (a <= b) is (v <= w)
    assert (a > b) is (v > w)
    assert (a >= b) is (v >= w)
    assert a == a and not (a < a)
    assert sorted([AtomicInt(3), AtomicInt(1), AtomicInt(2)]) == [1, 2, 3]


@pytest.mark.parametrize("other", [1.0, "1", None, [1], Idx(1)])
def test_comparisons_with_non_ints(other):
    a = AtomicInt(1)
    # not compared: equality falls back to identity, ordering names both types
    assert (a == other) is False
    assert (a != other) is True
    for op in (operator.lt, operator.le, operator.gt, operator.ge):
        with pytest.raises(TypeError, match="AtomicInt"):
            op(a, other)


def test_hash_refused():
    with pytest.raises(TypeError, match="unhashable"):
        hash(AtomicInt(1))
    with pytest.raises(TypeError):
        {AtomicInt(1)}


@pytest.mark.parametrize("d", [0, 1, -1, 5, I64_MAX, I64_MIN, Idx(3), True, AtomicInt(4)])
def test_inplace_add_sub_are_fetch_add_sub(d):
    n = operator.index(d)
    a = AtomicInt(10)
    b = a
    a += d
    assert a is b and type(a) is AtomicInt
    assert a.load() == (10 + n + 2**63) % 2**64 - 2**63     # wraps modulo 2**64
    a -= d
    assert a is b and a.load() == 10


def test_inplace_wraps_modulo_2_64():
    a = AtomicInt(I64_MAX)
    a += 1
    assert a.load() == I64_MIN
    a -= 1
    assert a.load() == I64_MAX
    a -= -1
    assert a.load() == I64_MIN
    a += I64_MIN
    assert a.load() == 0


@pytest.mark.parametrize("v,d", [(0b1100, 0b1010), (-1, 0x0F0F), (I64_MIN, -1), (0, 0),
                                 (I64_MAX, I64_MIN), (-6, 5)])
def test_inplace_bitwise_are_atomic_and_same_object(v, d):
    for op, pyop in ((operator.iand, operator.and_), (operator.ior, operator.or_),
                     (operator.ixor, operator.xor)):
        a = AtomicInt(v)
        r = op(a, d)
        assert r is a
        assert a.load() == pyop(v, d)         # two's complement: Python's & | ^ agree


def test_bitwise_fetch_methods_return_old_value():
    a = AtomicInt(0b1100)
    assert a.fetch_and(0b0110) == 0b1100 and a.load() == 0b0100
    assert a.fetch_or(0b0011) == 0b0100 and a.load() == 0b0111
    assert a.fetch_xor(0b0101) == 0b0111 and a.load() == 0b0010
    assert a.fetch_or(I64_MIN) == 0b0010 and a.load() == I64_MIN | 0b0010


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 2**64, 2**100])
def test_inplace_overflow_error_changes_nothing(bad):
    a = AtomicInt(1)
    b = a
    for op in (operator.iadd, operator.isub, operator.iand, operator.ior, operator.ixor):
        with pytest.raises(OverflowError):
            op(a, bad)
    for m in (a.fetch_and, a.fetch_or, a.fetch_xor):
        with pytest.raises(OverflowError):
            m(bad)
    assert a is b and a.load() == 1


@pytest.mark.parametrize("bad", [1.0, 1.5, "1", None, [1], 1j])
def test_inplace_type_error_changes_nothing(bad):
    a = AtomicInt(1)
    for op, sym in ((operator.iadd, "+="), (operator.isub, "-="), (operator.iand, "&="),
                    (operator.ior, "|="), (operator.ixor, "^=")):
        with pytest.raises(TypeError, match=re.escape(sym) + ".*AtomicInt"):
            op(a, bad)
    for m in (a.fetch_and, a.fetch_or, a.fetch_xor):
        with pytest.raises(TypeError):
            m(bad)
    assert a.load() == 1


class TakesAnything:
    """Not an integer, but its reflected operators accept an AtomicInt (through __index__)
    and return a plain int -- as numpy's bool_ does."""
    def _r(self, other):
        return operator.index(other) + 1000
    __radd__ = __rsub__ = __rand__ = __ror__ = __rxor__ = _r


def test_inplace_operator_never_rebinds_through_the_other_operand():
    a = AtomicInt(7)
    for op, sym in ((operator.iadd, "+="), (operator.isub, "-="), (operator.iand, "&="),
                    (operator.ior, "|="), (operator.ixor, "^=")):
        with pytest.raises(TypeError, match=re.escape(sym) + ".*AtomicInt.*TakesAnything"):
            op(a, TakesAnything())
    b = a
    with pytest.raises(TypeError):
        b += TakesAnything()
    assert b is a and a.load() == 7


@pytest.mark.parametrize("v", [I64_MIN, -7, -1, 0, 1, 7, I64_MAX])
@pytest.mark.parametrize("x", [-3, 0, 2, I64_MAX, 2**64, AtomicInt(5)])
def test_binary_operators_are_load_then_int(v, x):
    a = AtomicInt(v)
    n = operator.index(x)
    for op in (operator.add, operator.sub, operator.and_, operator.or_, operator.xor):
        r = op(a, x)
        assert type(r) is int and r == op(v, n)    # Python's int: no wrap
        if not isinstance(x, AtomicInt):
            r = op(x, a)
            assert type(r) is int and r == op(n, v)
    assert a.load() == v                           # a binary operator never stores


@pytest.mark.parametrize("v", [I64_MIN, -7, -1, 0, 1, 7, I64_MAX])
def test_unary_operators_and_bool(v):
    a = AtomicInt(v)
    for f in (operator.neg, operator.pos, operator.invert, abs):
        r = f(a)
        assert type(r) is int and r == f(v)        # -AtomicInt(-2**63) is 2**63: no wrap
    assert bool(a) is bool(v)
    assert float(a) == float(v)
    assert a.load() == v


def test_unprovided_operators_refuse_and_never_rebind():
    a = AtomicInt(6)
    b = a
    for op in (operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
               operator.lshift, operator.rshift, divmod):
        with pytest.raises(TypeError, match="AtomicInt"):
            op(a, 2)
    for op in (operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
               operator.ipow, operator.ilshift, operator.irshift):
        with pytest.raises(TypeError, match="AtomicInt"):
            op(a, 2)
    assert a is b and a.load() == 6
    with pytest.raises(TypeError, match="AtomicInt"):
        a + 1.5
    with pytest.raises(TypeError, match="AtomicInt"):
        a + "x"


@pytest.mark.timeout(60)
def test_inplace_add_threads_exact_total():
    a = AtomicInt()
    box = [a]
    n = scaled(50_000)

    def work():
        x = box[0]
        for _ in range(n):
            x += 1
        assert x is a           # the in-place operator never rebound the name

    def work_sub():
        x = box[0]
        for _ in range(n):
            x -= -1

    run_threads([work, work, work, work_sub])
    assert a.load() == 4 * n


@pytest.mark.timeout(60)
def test_inplace_bitwise_threads_no_lost_bits():
    # each thread owns 16 bits and toggles them with ^= / sets with |= / clears with &=;
    # a lost update (a load-then-store) would leave some other thread's bit wrong
    a = AtomicInt()
    n = scaled(20_000)

    def work(k):
        def run():
            x = a
            for i in range(n):
                bit = 1 << (k * 16 + i % 16)
                x |= bit
                x ^= bit
                x ^= bit
                x &= ~bit
        return run

    a |= 1 << 62            # a bit no thread touches: must survive
    run_threads([work(k) for k in range(3)])
    assert a.load() == 1 << 62


# ---- true parallelism (free-threaded builds run these threads at once; the GIL build
# interleaves them): exact results from 2 to 8 threads ------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [2, 4, 8])
def test_fetch_add_tickets_are_unique_across_threads(threads):
    """fetch_add(1) as a ticket dispenser: every value 0..total-1 is handed out exactly once
    (a lost or duplicated increment shows as a missing or repeated ticket), while other
    threads' fetch_sub/fetch_add pairs cancel out."""
    a = AtomicInt()
    noise = AtomicInt(1000)
    n = scaled(20_000)
    got = [None] * threads

    def work(i):
        def run():
            take, up, down = a.fetch_add, noise.fetch_add, noise.fetch_sub
            mine = []
            for _ in range(n):
                mine.append(take(1))
                up(3)
                down(3)
            got[i] = mine
        return run

    run_threads([work(i) for i in range(threads)], timeout=110)
    tickets = sorted(t for mine in got for t in mine)
    assert tickets == list(range(threads * n))
    assert a.load() == threads * n and noise.load() == 1000
    for mine in got:                 # each thread saw its own tickets in increasing order
        assert mine == sorted(mine)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [2, 4, 8])
def test_refcount_shared_then_dropped_on_zero_once(threads):
    """Every thread increfs and decrefs one shared RefCount, then drops its share; on_zero
    runs exactly once, in the thread whose decref reached 0, and only after every share
    was dropped."""
    per = scaled(5_000)
    for _ in range(scaled(20)):
        calls, dropped = [], AtomicInt()
        r = RefCount(threads, on_zero=lambda: calls.append((threading.get_ident(),
                                                             dropped.load())))
        idents = [None] * threads

        def work(i):
            def run():
                idents[i] = threading.get_ident()
                inc, dec = r.incref, r.decref
                for _ in range(per):
                    assert inc() >= 2
                    assert dec() >= 1
                dropped.fetch_add(1)
                dec()
            return run

        run_threads([work(i) for i in range(threads)], timeout=110)
        assert len(calls) == 1 and r.count == 0
        assert calls[0][0] in idents and calls[0][1] == threads
