"""How aoprim.aio's compiled modules reach each other's state: through the cdef interface
their .pxd files declare (cdef classes, their fields and cdef methods, which Cython
type-checks at each use), never by a memory offset read out of a member descriptor.  The
one exception is asyncio's own ``Handle`` / ``TimerHandle`` (Python classes with
``__slots__``; asyncio ships no .pxd), whose slots ``_aioloop.pyx`` reads by offset with the
C in ``aoprim/include/aop_aioloop.h`` (docs/aio-compiled.md).

These read the sources, so they run from a checkout or an sdist (which ship the .pyx files)
and skip where only the built package is present.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
AIO = ROOT / "aoprim" / "aio"
HEADER = ROOT / "aoprim" / "include" / "aop_aioloop.h"

# what reading a slot by its offset looks like in C: the offset taken out of a member
# descriptor, or a pointer computed from an object's address plus an offset
OFFSET_READ = re.compile(r"d_member->offset|\(char \*\)\s*\w+\s*\+\s*off")


def _sources():
    found = sorted(AIO.glob("*.pyx")) + sorted(AIO.glob("*.pxd"))
    if not any(p.suffix == ".pyx" for p in found):
        pytest.skip(f"no .pyx sources under {AIO} (an installed package, not a checkout)")
    return found


def test_no_aio_module_reads_slots_by_offset_outside_the_loops_handle_code():
    readers = [p.name for p in _sources() if OFFSET_READ.search(p.read_text())]
    assert readers == [], f"slots read by offset in {readers}: use a cdef interface (.pxd)"
    assert OFFSET_READ.search(HEADER.read_text()), (
        f"{HEADER} no longer reads asyncio's handle slots: update this test's docstring")


def test_the_loop_keeps_its_c_in_the_header():
    _sources()
    src = (AIO / "_aioloop.pyx").read_text()
    assert 'cdef extern from "aop_aioloop.h"' in src
    # no C function bodies in a verbatim string: the header holds them
    verbatim = re.findall(r'cdef extern from \*:\s*"""(.*?)"""', src, re.S)
    assert verbatim == [], "C inside a string in _aioloop.pyx: move it to aop_aioloop.h"


def test_the_transport_write_calls_the_writer_through_its_pxd():
    _sources()
    pxd = (AIO / "_aiowrite.pxd").read_text()
    assert re.search(r"cdef int c_write\(self, object data\) except -1", pxd)
    src = (AIO / "_aiotransport.pyx").read_text()
    assert "from aoprim.aio._aiowrite cimport TransportWriter" in src
    assert ".c_write(data)" in src
