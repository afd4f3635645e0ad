# cython: language_level=3
"""``as_index(v, what)``: an argument that must be an integer, as ``operator.index(v)``
takes it -- an exact int as is, any other type through its ``__index__`` -- and never a
float, truncated or not: TypeError naming ``what`` and the type.  One copy, cimported by the
compiled modules whose constructors and methods take sizes and offsets (SlabPool, Slot,
RxArena, Receiver).  An int beyond Py_ssize_t raises OverflowError."""
from cpython.number cimport PyNumber_Index
from cpython.long cimport PyLong_CheckExact, PyLong_AsSsize_t


cdef inline Py_ssize_t as_index(object v, str what) except? -1:
    if not PyLong_CheckExact(v):
        if isinstance(v, float) or not hasattr(type(v), "__index__"):
            raise TypeError(f"{what} must be an integer, not {type(v).__name__}")
        v = PyNumber_Index(v)
    return PyLong_AsSsize_t(v)
