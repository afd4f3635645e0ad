"""True parallelism: a Cython module compiled here, against the *installed* .pxd files and
header (which proves that ``cimport`` works from outside the package), runs its loops
without the GIL; several Python threads call it at once, so the loops really run in
parallel on all cores.  Spin-locked critical sections and atomic counters must be exact.

aoprim's headers are included by every cimporting module: each one, and a module cimporting
every .pxd, must compile without a single warning under -Wall -Wextra (a helper a module does
not call must not give ``defined but not used``)."""
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading

import pytest

import aoprim
from aoprim import AtomicInt, RefCount, SpinLock
from support import run_threads, scaled

SOURCE = r"""
from libc.stdint cimport int64_t
from aoprim._atomic cimport AtomicInt, RefCount
from aoprim._spinlock cimport SpinLock
from aoprim.atomic_h cimport (
    AOP_RELAXED, AOP_SEQ_CST, aop_atomic_i64, aop_fetch_add_i64, aop_load_i64,
    aop_cas_weak_i64, aop_spin_lock, aop_spin_unlock, aop_spin_trylock,
)

cdef int64_t plain_counter = 0      # a plain C global: only the spin lock protects it

def reset():
    global plain_counter
    plain_counter = 0

def plain():
    return plain_counter

def locked_increments(SpinLock lk, int64_t n):
    # non-atomic read-modify-write of a C global, made exclusive by the lock; lost updates
    # would show as a short total
    global plain_counter
    cdef int64_t i, v
    with nogil:
        for i in range(n):
            aop_spin_lock(&lk.lock)
            v = plain_counter
            plain_counter = v + 1
            aop_spin_unlock(&lk.lock)

def trylock_increments(SpinLock lk, int64_t n):
    global plain_counter
    cdef int64_t i = 0
    with nogil:
        while i < n:
            if aop_spin_trylock(&lk.lock):
                plain_counter += 1
                aop_spin_unlock(&lk.lock)
                i += 1

def atomic_adds(AtomicInt a, int64_t n, int64_t d):
    cdef int64_t i
    with nogil:
        for i in range(n):
            aop_fetch_add_i64(&a.cell, d, AOP_SEQ_CST)

def cas_adds(AtomicInt a, int64_t n):
    cdef int64_t i, cur
    with nogil:
        for i in range(n):
            cur = aop_load_i64(&a.cell, AOP_RELAXED)
            while not aop_cas_weak_i64(&a.cell, &cur, cur + 1, AOP_SEQ_CST, AOP_RELAXED):
                pass

def ref_churn(RefCount r, int64_t n):
    # incref/decref pairs in C, without the GIL; never reaches 0 while we hold ours
    cdef int64_t i, bad = 0
    with nogil:
        for i in range(n):
            if r.c_incref() < 2:
                bad += 1
            if r.c_decref() < 1:
                bad += 1
    return bad

def ref_drop(RefCount r):
    cdef int64_t n
    with nogil:
        n = r.c_decref()
    if n == 0:
        r.run_on_zero()
    return n
"""


@pytest.fixture(scope="module")
def hammer(cybuild):
    return cybuild("aop_hammer", SOURCE)


def test_get_include_has_header():
    assert os.path.isfile(os.path.join(aoprim.get_include(), "aop_atomic.h"))
    pkg = os.path.dirname(aoprim.__file__)
    for pxd in ("_atomic.pxd", "_spinlock.pxd", "atomic_h.pxd"):
        assert os.path.isfile(os.path.join(pkg, pxd)), pxd
    for stub in ("_atomic.pyi", "_spinlock.pyi", "py.typed"):
        assert os.path.isfile(os.path.join(pkg, stub)), stub


def test_spinlock_critical_sections_exact_in_parallel(hammer):
    lk = SpinLock()
    n = scaled(500_000)
    hammer.reset()
    run_threads([lambda: hammer.locked_increments(lk, n)] * 4, timeout=120)
    assert hammer.plain() == 4 * n
    assert not lk.locked()


def test_spinlock_c_and_python_exclude_each_other(hammer):
    # the same lock used from C (no GIL) and from Python: still exclusive
    lk = SpinLock()
    n = scaled(200_000)
    hammer.reset()
    run_threads([lambda: hammer.locked_increments(lk, n),
                 lambda: hammer.trylock_increments(lk, n)], timeout=120)
    assert hammer.plain() == 2 * n


def test_atomic_counter_exact_in_parallel(hammer):
    a = AtomicInt()
    n = scaled(1_000_000)
    run_threads([lambda: hammer.atomic_adds(a, n, 1)] * 2
                + [lambda: hammer.atomic_adds(a, n, 3)] * 2, timeout=120)
    assert a.load() == 2 * n + 2 * 3 * n


def test_cas_loop_exact_in_parallel(hammer):
    a = AtomicInt()
    n = scaled(300_000)
    run_threads([lambda: hammer.cas_adds(a, n)] * 4, timeout=120)
    assert a.load() == 4 * n


def test_refcount_nogil_churn_then_single_zero(hammer):
    fired = []
    r = RefCount(4, on_zero=lambda: fired.append(1))
    n = scaled(200_000)
    drops = []
    churned = threading.Barrier(4)

    def worker():
        assert hammer.ref_churn(r, n) == 0
        churned.wait(60)          # all churn is over: the four drops see 4, 3, 2, 1
        drops.append(hammer.ref_drop(r))

    run_threads([worker] * 4, timeout=120)
    assert sorted(drops) == [0, 1, 2, 3]
    assert fired == [1]
    assert r.count == 0


# -- aoprim's headers compile without warnings in a user's build ------------------------------

HEADERS = sorted(p.name for p in pathlib.Path(aoprim.get_include()).glob("aop_*.h"))
WARN_FLAGS = ["-Wall", "-Wextra"]


def _compiler(var):
    """The compiler a user's build_ext would run (CC / CXX, else what Python was built
    with), as an argument list; skips when it is not installed."""
    cmd = shlex.split(os.environ.get(var) or sysconfig.get_config_var(var) or "")
    if not cmd or shutil.which(cmd[0]) is None:
        pytest.skip(f"no {var} compiler on PATH ({cmd[:1] or 'none configured'})")
    return cmd


@pytest.mark.parametrize("lang", ["c", "c++"])
@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_without_warnings(header, lang, tmp_path):
    # the header alone in a translation unit that calls none of its functions: an unused
    # static helper warns here (Cython-generated C includes the headers the same way)
    src = tmp_path / ("inc.c" if lang == "c" else "inc.cpp")
    src.write_text(f'#include "{header}"\n')
    cmd = _compiler("CC" if lang == "c" else "CXX") + WARN_FLAGS + [
        "-c", f"-I{aoprim.get_include()}", f"-I{sysconfig.get_paths()['include']}",
        str(src), "-o", str(tmp_path / "inc.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr.strip(), (
        f"{header} ({lang}, {' '.join(WARN_FLAGS)}):\n{proc.stderr}")


def test_headers_are_found():
    assert "aop_atomic.h" in HEADERS and len(HEADERS) >= 4, HEADERS


def test_a_module_cimporting_every_pxd_compiles_with_warnings_as_errors(tmp_path, capfd):
    from aoprim.cybuild import build_module

    pkg = pathlib.Path(aoprim.__file__).resolve().parent
    # every folder's: the primitives at the top, the server's and the loop's beside their users
    pxds = sorted(".".join(p.relative_to(pkg).with_suffix("").parts) for p in pkg.rglob("*.pxd"))
    assert {"_atomic", "atomic_h", "server._receiver", "aio._aioloop"} <= set(pxds), pxds
    source = "".join(f"cimport aoprim.{m}\n" for m in pxds) + "def ok():\n    return True\n"
    name = "cimport_every_pxd"
    try:
        mod = build_module(name, source, workdir=str(tmp_path),
                           cflags=["-O0", *WARN_FLAGS, "-Werror"])
        assert mod.ok()
    except Exception as e:   # noqa: BLE001 - the compiler's messages say what went wrong
        out, err = capfd.readouterr()
        ours = [line for line in (out + err).splitlines() if re.search(r"aop_\w+\.h:\d+", line)]
        pytest.fail(f"{e}\nin aoprim's headers:\n" + "\n".join(ours)
                    + f"\n--- compiler output:\n{err}")
    finally:
        sys.modules.pop(name, None)
    out, err = capfd.readouterr()
    assert "warning" not in (out + err), out + err
