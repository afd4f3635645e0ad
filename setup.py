"""Build: cythonize every .pyx under aoprim/ into its own extension, named by its dotted path
(aoprim/_atomic.pyx -> aoprim._atomic, aoprim/server/_receiver.pyx -> aoprim.server._receiver):
the primitives sit at the top of the package, each compiled part of the server, the asyncio
loop and the bench command beside the Python code that uses it.  One extension per .pyx, so
each can be cimported on its own.  Generated C is never committed nor shipped in the sdist
(MANIFEST.in); a clean checkout or an sdist builds with ``pip install .``.

Debug info: an in-place build (``setup.py build_ext --inplace``, what the tests and
.ci/sanitize use) keeps Python's default ``-g``.  A wheel (``pip install .``, ``python -m
build``, cibuildwheel) is built without it (``-g0``, and the linker drops what is left with
``-Wl,--strip-debug``): the extensions' DWARF is most of a wheel's size.  AOPRIM_DEBUG_INFO=1
keeps it in a wheel too (for perf / gdb on an installed build)."""
import glob
import hashlib
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext as _build_ext

try:                                        # setuptools >= 70.1 has its own
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:                         # older setuptools: the wheel package's (its
    import warnings                         # FutureWarning says what the line above does)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:                     # neither: no wheel can be built here anyway
        _bdist_wheel = None                 # (`setup.py build_ext` in .ci/sanitize's venv)

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join("aoprim", "include")

COMPILER_DIRECTIVES = {
    "language_level": 3,
    "freethreading_compatible": True,   # no module relies on the GIL for its own correctness
    "boundscheck": False,                # indices are computed, masked and checked by hand
    "wraparound": False,                 # no negative indexing anywhere in the .pyx files
    "initializedcheck": False,
    "cdivision": True,                   # divisors are checked non-zero where they come in
    "embedsignature": True,
    # plain method descriptors instead of CyFunction objects: ~5 ns less per Python call
    # (measured on AtomicInt.fetch_add: 30.8 -> 25.7 ns); signatures stay in the docstrings
    "binding": False,
}

CFLAGS = ["-O3", "-fno-strict-aliasing", "-Wno-unused-function"]
LDFLAGS = []

# AOPRIM_SANITIZE=1: an AddressSanitizer + UndefinedBehaviorSanitizer build for .ci/sanitize
# (-O1 -g keeps stack traces exact; these replace -O3, which would otherwise come last on the
# command line and win).  Unset, the normal build is unchanged.
if os.environ.get("AOPRIM_SANITIZE") == "1":
    SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    CFLAGS = ["-O1", "-g"] + SANITIZE + ["-fno-strict-aliasing", "-Wno-unused-function"]
    LDFLAGS = SANITIZE


def _env_jobs():
    """AOPRIM_BUILD_JOBS (0 when unset): parallel jobs for cythonize, and for the C compile."""
    return int(os.environ.get("AOPRIM_BUILD_JOBS", "0"))


def _pyx_files():
    """Every .pyx under aoprim/ (any depth), sorted by path."""
    found = []
    for folder, dirs, names in os.walk("aoprim"):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [os.path.join(folder, n) for n in names if n.endswith(".pyx")]
    return sorted(found)


def _module_name(pyx):
    """aoprim/server/_receiver.pyx -> aoprim.server._receiver"""
    return os.path.splitext(pyx)[0].replace(os.sep, ".")


def extensions():
    exts = []
    for pyx in _pyx_files():
        exts.append(Extension(_module_name(pyx), [pyx], include_dirs=[INCLUDE],
                              extra_compile_args=CFLAGS, extra_link_args=LDFLAGS,
                              depends=glob.glob(INCLUDE + "/*.h")))
    # include_path ".": a cimport names the module by its full dotted path from the checkout's
    # root (`from aoprim._slab cimport Slot` in aoprim/server/_receiver.pyx)
    return cythonize(exts, compiler_directives=COMPILER_DIRECTIVES, include_path=["."],
                     nthreads=_env_jobs() or None)


def _package_data():
    """The .pxd and .pyi files of every package that holds a compiled module (cimport and
    type checkers read them from the installed package), the C headers, py.typed."""
    data = {"aoprim.include": ["*.h"]}
    for pyx in _pyx_files():
        data[os.path.dirname(pyx).replace(os.sep, ".")] = ["*.pxd", "*.pyi"]
    data["aoprim"] = ["*.pxd", "*.pyi", "py.typed"]
    return data


# Appended after CFLAGS when a wheel is built (the last -g option wins over Python's -g).
RELEASE_CFLAGS = ["-g0"]
RELEASE_LDFLAGS = ["-Wl,--strip-debug"]


class _ReleaseWheel:
    """A wheel's extensions carry no debug info (see the module docstring).  Not applied to
    a sanitizer build (AOPRIM_SANITIZE=1 wants -g for exact stack traces) nor when
    AOPRIM_DEBUG_INFO=1 asks to keep it."""

    def run(self):
        if os.environ.get("AOPRIM_SANITIZE") != "1" and os.environ.get("AOPRIM_DEBUG_INFO") != "1":
            for ext in self.distribution.ext_modules:
                ext.extra_compile_args = list(ext.extra_compile_args) + RELEASE_CFLAGS
                ext.extra_link_args = list(ext.extra_link_args) + RELEASE_LDFLAGS
        super().run()


def _jobs():
    """C compile jobs: AOPRIM_BUILD_JOBS, else one per CPU this process may run on."""
    n = _env_jobs()
    if n > 0:
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                  # not Linux
        return os.cpu_count() or 1


def _read_files(paths):
    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read())
    return h


class build_ext(_build_ext):
    """The extensions compile in parallel (pip's build runs ``build_ext`` without ``-j``; at
    -O3 the C compile is most of an install's time); ``-j N`` on the command line wins.

    An extension is recompiled when what goes into it changed, not when a timestamp did.
    pip builds a local folder in place (build/ in the checkout) and each build gets a fresh
    isolated environment, whose newly installed Cython has .pxd files (``libc/``, ``posix/``)
    newer than the generated C: cythonize rewrites every .c (the same bytes) and setuptools,
    which compares times, recompiled everything -- ``pip install '.[test]'`` after ``pip
    install .`` took the whole compile again.  Here a digest of the C sources, the headers,
    the flags (the extension's, build_ext's -D/-U/-I/-l/-L/-R/-O options, AOPRIM_SANITIZE),
    the compiler's command line and the Python is kept beside the objects
    (build/temp.*/inputs/, one stamp per built module's full path), with the sha256 of the
    module that build wrote.  The compile is skipped only when both match: any change (a
    .pyx edit, AOPRIM_DEBUG_INFO=1, another CFLAGS) rebuilds, and so does a module that
    another build wrote there (another --build-temp, as .ci/sanitize's)."""

    def finalize_options(self):
        super().finalize_options()
        jobs = _jobs()
        if not self.parallel and jobs > 1:
            self.parallel = jobs

    def _inputs_digest(self, ext, out):
        h = _read_files(list(ext.sources) + sorted(ext.depends))
        cc = self.compiler
        for part in (out, sys.version, os.environ.get("AOPRIM_SANITIZE"),
                     ext.extra_compile_args, ext.extra_link_args, ext.define_macros,
                     ext.undef_macros, ext.include_dirs, ext.libraries, ext.library_dirs,
                     ext.runtime_library_dirs, ext.extra_objects, ext.export_symbols,
                     ext.language, self.include_dirs, self.define, self.undef, self.libraries,
                     self.library_dirs, self.rpath, self.link_objects, self.debug,
                     getattr(cc, "compiler_so", None), getattr(cc, "linker_so", None),
                     getattr(cc, "macros", None), getattr(cc, "include_dirs", None),
                     getattr(cc, "libraries", None), getattr(cc, "library_dirs", None),
                     getattr(cc, "runtime_library_dirs", None), getattr(cc, "objects", None)):
            h.update(repr(part).encode() + b"\0")
        return h.hexdigest()

    def build_extension(self, ext):
        out = os.path.abspath(self.get_ext_fullpath(ext.name))
        stamp = os.path.join(self.build_temp, "inputs",
                             hashlib.sha256(out.encode()).hexdigest()[:16] + "-" + ext.name)
        # the inputs, then the module they built: a stamp holds for that module only
        digest = self._inputs_digest(ext, out)
        try:
            with open(stamp) as f:
                same = f.read() == digest + " " + _read_files([out]).hexdigest()
        except OSError:                     # no stamp, or no module
            same = False
        if same and not self.force:
            print(f"{ext.name}: its sources, headers and flags are those of {out}: "
                  "not recompiled")
            return
        # setuptools compiles only when a source is newer than the module: without the
        # module it always does (self.force is shared by the parallel build's threads)
        if os.path.exists(out):
            os.remove(out)
        super().build_extension(ext)
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write(digest + " " + _read_files([out]).hexdigest())


CMDCLASS = {"build_ext": build_ext}
if _bdist_wheel is not None:
    CMDCLASS["bdist_wheel"] = type("bdist_wheel", (_ReleaseWheel, _bdist_wheel), {})

setup(
    cmdclass=CMDCLASS,
    ext_modules=extensions(),
    packages=find_namespace_packages(include=["aoprim", "aoprim.*"]),
    package_data=_package_data(),
    # the generated C of every package (setuptools would ship an extension's sources)
    exclude_package_data={"": ["*.c", "*.cpp", "*.html"]},
    zip_safe=False,
)
