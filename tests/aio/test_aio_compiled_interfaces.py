"""Where aoprim.aio's compiled loop keeps its C: in a header
(``aoprim/include/aop_aioloop.h``, with its invariants at the top, as the primitives keep
theirs in ``aoprim/include/``), not in a string inside ``_aioloop.pyx``.

This reads the sources, so it runs from a checkout or an sdist (which ship the .pyx files)
and skips where only the built package is present.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
AIO = ROOT / "aoprim" / "aio"


def _sources():
    found = sorted(AIO.glob("*.pyx")) + sorted(AIO.glob("*.pxd"))
    if not any(p.suffix == ".pyx" for p in found):
        pytest.skip(f"no .pyx sources under {AIO} (an installed package, not a checkout)")
    return found


def test_the_loop_keeps_its_c_in_the_header():
    _sources()
    src = (AIO / "_aioloop.pyx").read_text()
    assert 'cdef extern from "aop_aioloop.h"' in src
    # no C function bodies in a verbatim string: the header holds them
    verbatim = re.findall(r'cdef extern from \*:\s*"""(.*?)"""', src, re.S)
    assert verbatim == [], "C inside a string in _aioloop.pyx: move it to aop_aioloop.h"
