# cython: language_level=3, freethreading_compatible=True
# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""AtomicInt and RefCount: 64-bit hardware atomics for Python.

Invariants
- ``AtomicInt.cell`` is only ever read or written through aop_*_i64 (GCC __atomic builtins),
  never with a plain load or store, so no access is torn and none is reordered past another.
- Every Python-level AtomicInt operation is sequentially consistent (the module rule, in
  docs/atomics-and-lock.md): one total order of all of them exists that every thread agrees on.
- An AtomicInt operator either is one atomic read-modify-write or performs exactly one
  seq_cst load (per AtomicInt operand) and then works on plain Python ints; no operator is
  a load followed by a store.  One atomic step: ``+= -= &= |= ^=`` (fetch_add, fetch_sub,
  fetch_and, fetch_or, fetch_xor; ``a`` stays the same object).  A load, then Python: the
  comparisons, binary ``+ - & | ^`` (either side), unary ``- + ~``, ``abs()``, ``bool()``,
  ``int()``, ``float()``.  No other arithmetic operator is defined, so that ``a *= 2`` can
  never fall back to ``a = a * 2`` and silently rebind ``a`` to a plain int.
- 0 <= ``RefCount.cell`` <= 2**63-1 always.  Increments and decrements are CAS loops that
  refuse to move the count away from 0 (and an increment past 2**63-1: it raises
  OverflowError having stored nothing), so 0 is terminal and the 1 -> 0 transition happens
  exactly once: exactly one thread (the one whose CAS performed it) runs ``on_zero``.
"""
cimport cython
from cpython.long cimport PyLong_Check, PyLong_CheckExact, PyLong_AsLongLong
from cpython.number cimport PyNumber_Index, PyIndex_Check
from cpython.object cimport PyObject_RichCompare, Py_TYPE
from libc.stdint cimport int64_t

from aoprim.atomic_h cimport (
    AOP_RELAXED, AOP_ACQUIRE, AOP_RELEASE, AOP_ACQ_REL, AOP_SEQ_CST,
    aop_load_i64, aop_store_i64, aop_exchange_i64, aop_fetch_add_i64, aop_fetch_sub_i64,
    aop_fetch_and_i64, aop_fetch_or_i64, aop_fetch_xor_i64,
    aop_cas_i64, aop_cas_weak_i64,
)
from aoprim.errors import RefCountError


cdef extern from *:
    """
    /* An exact int of one digit (|v| < 2**30: every counter step, most values) read in
       place, without the call PyLong_AsLongLong is: 1 and the value in *out; 0 for any other
       object, which then takes the general path. */
    static inline int aop_small_int(PyObject *v, int64_t *out) {
        if (!PyLong_CheckExact(v)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (!PyUnstable_Long_IsCompact((PyLongObject *)v)) return 0;
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)v);
    #else
        Py_ssize_t n = Py_SIZE(v);
        if (n < -1 || n > 1) return 0;
        *out = (int64_t)n * (int64_t)((PyLongObject *)v)->ob_digit[0];
    #endif
        return 1;
    }
    """
    bint aop_small_int(object v, int64_t *out) noexcept


cdef inline int64_t as_i64(object v) except? -1:
    """operator.index(v) as a signed 64-bit int: TypeError for non-integers (a float is never
    truncated), OverflowError outside [-2**63, 2**63)."""
    cdef int64_t x
    if aop_small_int(v, &x):
        return x
    if not PyLong_CheckExact(v):
        v = PyNumber_Index(v)
    return PyLong_AsLongLong(v)


cdef int _refuse_inplace(str sym, object a, object other) except -1:
    # Python's own message, the types named as Python names them (tp_name)
    raise TypeError(f"unsupported operand type(s) for {sym}: '{_tp_name(a)}' and "
                    f"'{_tp_name(other)}'")


cdef str _tp_name(object o):
    return (<bytes>Py_TYPE(o).tp_name).decode("utf-8", "replace")


cdef inline object load_of(AtomicInt a):
    return aop_load_i64(&a.cell, AOP_SEQ_CST)     # seq_cst: the module rule


cdef inline object int_operand(object x):
    """The int value of a binary operator's other operand: an int as it is, an AtomicInt's
    current value (one seq_cst load), None for anything else (the operator then returns
    NotImplemented and Python's TypeError names both types)."""
    if PyLong_Check(x):
        return x
    if isinstance(x, AtomicInt):
        return load_of(<AtomicInt>x)
    return None


# GC: not tracked: a C integer, no references.
cdef class AtomicInt:
    """A signed 64-bit integer with sequentially consistent atomic operations.

    Arithmetic wraps modulo 2**64 (two's complement), as C atomics do.  ``+= -= &= |= ^=``
    are one atomic step each; comparisons and ``+ - & | ^ -a ~a abs() bool()`` read the value
    once and return what Python's int gives (docs/atomics-and-lock.md).  Unhashable (mutable).

    Threads: shared -- any number of threads may call any method at the same time, on a
    free-threaded build too (docs/threads.md); a load is a snapshot.
    """

    def __cinit__(self, value=0):
        # relaxed: the object is not yet shared with any other thread
        aop_store_i64(&self.cell, as_i64(value), AOP_RELAXED)

    def load(self):
        """Return the current value."""
        return aop_load_i64(&self.cell, AOP_SEQ_CST)   # seq_cst: the module rule

    def store(self, v):
        """Set the value to ``v``."""
        cdef int64_t x = as_i64(v)
        aop_store_i64(&self.cell, x, AOP_SEQ_CST)      # seq_cst: the module rule

    def fetch_add(self, d=1):
        """Add ``d``; return the value before the change."""
        cdef int64_t x = as_i64(d)
        return aop_fetch_add_i64(&self.cell, x, AOP_SEQ_CST)   # seq_cst RMW: the module rule

    def fetch_sub(self, d=1):
        """Subtract ``d``; return the value before the change."""
        cdef int64_t x = as_i64(d)
        return aop_fetch_sub_i64(&self.cell, x, AOP_SEQ_CST)   # seq_cst RMW: the module rule

    def fetch_and(self, m):
        """Set the value to ``value & m``; return the value before the change."""
        cdef int64_t x = as_i64(m)
        return aop_fetch_and_i64(&self.cell, x, AOP_SEQ_CST)   # seq_cst RMW: the module rule

    def fetch_or(self, m):
        """Set the value to ``value | m``; return the value before the change."""
        cdef int64_t x = as_i64(m)
        return aop_fetch_or_i64(&self.cell, x, AOP_SEQ_CST)    # seq_cst RMW: the module rule

    def fetch_xor(self, m):
        """Set the value to ``value ^ m``; return the value before the change."""
        cdef int64_t x = as_i64(m)
        return aop_fetch_xor_i64(&self.cell, x, AOP_SEQ_CST)   # seq_cst RMW: the module rule

    def exchange(self, v):
        """Set the value to ``v``; return the old value."""
        cdef int64_t x = as_i64(v)
        return aop_exchange_i64(&self.cell, x, AOP_SEQ_CST)    # seq_cst RMW: the module rule

    def compare_exchange(self, expected, desired):
        """Store ``desired`` only if the value equals ``expected``; True if it did."""
        cdef int64_t e = as_i64(expected)
        cdef int64_t d = as_i64(desired)
        # seq_cst on success and on failure: a failed CAS is still a seq_cst load (the module rule)
        return aop_cas_i64(&self.cell, &e, d, AOP_SEQ_CST, AOP_SEQ_CST)

    @property
    def value(self):
        """The current value (read-only; same as load())."""
        return aop_load_i64(&self.cell, AOP_SEQ_CST)

    # int(), index(), repr() and pickling read with the same seq_cst load as load() (module rule)
    def __int__(self):
        return aop_load_i64(&self.cell, AOP_SEQ_CST)

    def __index__(self):
        return aop_load_i64(&self.cell, AOP_SEQ_CST)

    def __repr__(self):
        return f"AtomicInt({aop_load_i64(&self.cell, AOP_SEQ_CST)})"

    def __reduce__(self):
        return (AtomicInt, (aop_load_i64(&self.cell, AOP_SEQ_CST),))

    def __format__(self, spec):
        """format(a, spec), f"{a:,}", f"{a:x}": the loaded value formatted as an int is; an
        empty spec gives str(a), as for any object."""
        if not spec:
            return str(self)
        return format(aop_load_i64(&self.cell, AOP_SEQ_CST), spec)

    # ---- as a number ----------------------------------------------------------------------
    # In-place operators: one seq_cst read-modify-write each, the same instruction as the
    # fetch_* method of the same name, and they return self (the name stays bound to this
    # AtomicInt).  They take what the methods take (an int or any __index__ object;
    # OverflowError outside the signed 64-bit range, nothing stored); for anything else they
    # raise Python's own "unsupported operand type(s) for +=: 'AtomicInt' and 'float'"
    # themselves.  Returning NotImplemented would let Python fall back to `a + n` and then to
    # the other operand's __radd__, which may take the AtomicInt through its __index__ and
    # return a plain int -- rebinding `a` (numpy's bool_ does).

    def __iadd__(self, d):
        if not PyLong_CheckExact(d) and not PyIndex_Check(d):
            _refuse_inplace("+=", self, d)
        cdef int64_t x = as_i64(d)
        aop_fetch_add_i64(&self.cell, x, AOP_SEQ_CST)      # seq_cst RMW: the module rule
        return self

    def __isub__(self, d):
        if not PyLong_CheckExact(d) and not PyIndex_Check(d):
            _refuse_inplace("-=", self, d)
        cdef int64_t x = as_i64(d)
        aop_fetch_sub_i64(&self.cell, x, AOP_SEQ_CST)      # seq_cst RMW: the module rule
        return self

    def __iand__(self, m):
        if not PyLong_CheckExact(m) and not PyIndex_Check(m):
            _refuse_inplace("&=", self, m)
        cdef int64_t x = as_i64(m)
        aop_fetch_and_i64(&self.cell, x, AOP_SEQ_CST)      # seq_cst RMW: the module rule
        return self

    def __ior__(self, m):
        if not PyLong_CheckExact(m) and not PyIndex_Check(m):
            _refuse_inplace("|=", self, m)
        cdef int64_t x = as_i64(m)
        aop_fetch_or_i64(&self.cell, x, AOP_SEQ_CST)       # seq_cst RMW: the module rule
        return self

    def __ixor__(self, m):
        if not PyLong_CheckExact(m) and not PyIndex_Check(m):
            _refuse_inplace("^=", self, m)
        cdef int64_t x = as_i64(m)
        aop_fetch_xor_i64(&self.cell, x, AOP_SEQ_CST)      # seq_cst RMW: the module rule
        return self

    # Comparisons: one seq_cst load of each AtomicInt operand, then int's comparison (an int
    # operand of any size compares exactly).  Against anything but an int or an AtomicInt:
    # NotImplemented (== falls back to identity, < raises TypeError naming both types).
    # Unhashable (__hash__ = None below): a value that changes cannot be a dict key.

    def __richcmp__(self, other, int op):
        o = int_operand(other)
        if o is None:
            return NotImplemented
        return PyObject_RichCompare(aop_load_i64(&self.cell, AOP_SEQ_CST), o, op)  # seq_cst

    __hash__ = None

    # Binary and unary operators: one seq_cst load (of each AtomicInt operand), then Python's
    # int operation; the result is a plain int (no wrap: -AtomicInt(-2**63) is 2**63).

    def __add__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else load_of(self) + o

    def __radd__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else o + load_of(self)

    def __sub__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else load_of(self) - o

    def __rsub__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else o - load_of(self)

    def __and__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else load_of(self) & o

    def __rand__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else o & load_of(self)

    def __or__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else load_of(self) | o

    def __ror__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else o | load_of(self)

    def __xor__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else load_of(self) ^ o

    def __rxor__(self, other):
        o = int_operand(other)
        return NotImplemented if o is None else o ^ load_of(self)

    def __neg__(self):
        return -load_of(self)

    def __pos__(self):
        return load_of(self)

    def __invert__(self):
        return ~load_of(self)

    def __abs__(self):
        return abs(load_of(self))

    def __bool__(self):
        return aop_load_i64(&self.cell, AOP_SEQ_CST) != 0          # seq_cst: the module rule


# GC: tracked (on_zero may close a cycle) but no_gc_clear: a cycle through on_zero is broken
# by its other members (a function, an instance's dict, a list...).  Were the GC to clear
# on_zero first, a decref reaching 0 while the rest of the cycle is torn down (in C code's
# __dealloc__) would skip on_zero, which must run exactly once.  (A cycle made only of
# objects the GC cannot clear -- e.g. two RefCounts whose on_zero are each other's bound
# methods -- is not collected; run_on_zero drops on_zero, which breaks it once it fires.)
cdef int64_t _I64_MAX = 0x7fffffffffffffff   # a count cannot go beyond this


@cython.no_gc_clear
cdef class RefCount:
    """An atomic reference count that runs ``on_zero()`` exactly once, when it reaches 0.

    Ordering (as in Rust's Arc): increments need no ordering beyond atomicity, because a new
    reference is always made from an existing one; a decrement releases everything its holder
    wrote, and the decrement that reaches 0 acquires all of them, so ``on_zero`` sees every
    write made by every former holder.

    Threads: shared -- incref/decref/try_incref/count from any threads at once, on a
    free-threaded build too; on_zero runs once, in the thread whose decref reached 0.
    """

    def __cinit__(self, count=1, on_zero=None):
        cdef int64_t c = as_i64(count)
        if c < 0:
            raise ValueError(f"count must be >= 0, got {c}")
        if on_zero is not None and not callable(on_zero):
            raise TypeError("on_zero must be callable or None")
        self.on_zero = on_zero
        aop_store_i64(&self.cell, c, AOP_RELAXED)   # relaxed: not yet shared

    cdef int64_t c_incref(self) noexcept nogil:
        # relaxed load: only a starting guess for the CAS, which re-validates it
        cdef int64_t c = aop_load_i64(&self.cell, AOP_RELAXED)
        while True:
            if c <= 0:
                return -1
            if c == _I64_MAX:
                return -2                  # saturated: c + 1 would wrap; nothing stored
            # relaxed CAS: taking a reference from one we already hold publishes nothing;
            # the CAS (not a blind add) is what keeps 0 terminal and the count from wrapping
            # (the bounds above are checked on the very value the CAS replaces)
            if aop_cas_weak_i64(&self.cell, &c, c + 1, AOP_RELAXED, AOP_RELAXED):
                return c + 1

    cdef bint c_try_incref(self) noexcept nogil:
        cdef int64_t c = aop_load_i64(&self.cell, AOP_RELAXED)   # relaxed: a guess, see CAS
        while c > 0 and c != _I64_MAX:    # 0: dead; INT64_MAX: saturated (no wrap)
            # acquire on success: a weak-to-strong upgrade must see what the holders wrote
            # before their references were published (pairs with the release in decref)
            if aop_cas_weak_i64(&self.cell, &c, c + 1, AOP_ACQUIRE, AOP_RELAXED):
                return True
        return False

    cdef int64_t c_decref(self) noexcept nogil:
        cdef int64_t c = aop_load_i64(&self.cell, AOP_RELAXED)   # relaxed: a guess, see CAS
        while True:
            if c <= 0:
                return -1
            # acq_rel: release publishes this holder's writes; acquire (meaningful on the
            # 1 -> 0 step) makes every other holder's released writes visible to on_zero
            if aop_cas_weak_i64(&self.cell, &c, c - 1, AOP_ACQ_REL, AOP_RELAXED):
                return c - 1

    cdef int run_on_zero(self) except -1:
        cb = self.on_zero
        self.on_zero = None        # exactly once, and break any reference cycle through it
        if cb is not None:
            cb()
        return 0

    def incref(self):
        """Add a reference; return the new count.  RefCountError at 0 (no resurrection)."""
        cdef int64_t n = self.c_incref()
        if n == -2:
            raise OverflowError("incref() of a RefCount at 2**63-1 (the count is unchanged)")
        if n < 0:
            raise RefCountError("incref() of a RefCount at 0 (resurrection)")
        return n

    def try_incref(self):
        """Add a reference only if the count is above 0; True if it did.  OverflowError
        (nothing changed) when the count is at 2**63-1."""
        if self.c_try_incref():
            return True
        # relaxed: only tells the two refusals apart; the count never leaves 2**63-1 upward
        if aop_load_i64(&self.cell, AOP_RELAXED) == _I64_MAX:
            raise OverflowError("try_incref() of a RefCount at 2**63-1 (the count is unchanged)")
        return False

    def decref(self):
        """Drop a reference; return the new count.  At 0, on_zero() runs once, here."""
        cdef int64_t n = self.c_decref()
        if n < 0:
            raise RefCountError("decref() of a RefCount already at 0")
        if n == 0:
            self.run_on_zero()
        return n

    @property
    def count(self):
        """The current count (read-only; a snapshot)."""
        return aop_load_i64(&self.cell, AOP_SEQ_CST)   # seq_cst: a plain, unsurprising read

    def __repr__(self):
        return f"RefCount({aop_load_i64(&self.cell, AOP_SEQ_CST)})"
