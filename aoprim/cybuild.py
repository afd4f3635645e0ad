"""Compile a small Cython module against the *installed* aoprim, and import it.

This is how the test-suite proves that ``cimport`` works from outside the package (and runs
nogil loops on both cores), and how the benchmarks measure C-level costs.  It is also a
working example for users: the only things a cimporting extension needs are the package on
the Cython include path and ``aoprim.get_include()`` on the C include path.

    mod = build_module("hammer", '''
        from aoprim._atomic cimport AtomicInt
        from aoprim.atomic_h cimport aop_fetch_add_i64, AOP_SEQ_CST
        def add(AtomicInt a, long n):
            with nogil:
                for i in range(n):
                    aop_fetch_add_i64(&a.cell, 1, AOP_SEQ_CST)
    ''')

It needs Cython (>= 3.1) and setuptools: ``pip install 'aoprim[cython]'``.

Without ``workdir``, a built module is cached: the first call compiles in a temporary folder
(removed afterwards) and keeps only the built extension, as one file in ``cache_dir()``; a
later call with the same inputs imports that file without compiling.  The file's name
carries a digest of everything that changes the built module: the source, the module name,
the compiler flags, aoprim's version and the contents of its installed ``.pxd``/``.pxi``
files and C headers, the Python ABI (the extension suffix), the Cython version, the Cython
directives, and the compiler environment variables setuptools reads (``CC``, ``CFLAGS``,
...).  Two processes building the same module at once each compile in their own temporary
folder and move the result into place with one ``os.replace`` (atomic on a POSIX
filesystem): a reader sees the whole file or no file.  The cache may be deleted at any time.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import aoprim

__all__ = ["build_module", "cache_dir", "CACHE_ENV"]

# Moves the cache (any path; created on first use).  Unset: $XDG_CACHE_HOME/aoprim/cybuild,
# else ~/.cache/aoprim/cybuild.
CACHE_ENV = "AOPRIM_CYBUILD_CACHE"

DIRECTIVES = {
    "language_level": 3,
    "freethreading_compatible": True,
    "boundscheck": False,
    "wraparound": False,
}

# What setuptools' build_ext reads from the environment to choose and drive the compiler
# (distutils' customize_compiler): each one can change the built module.
COMPILER_ENV = ("CC", "CXX", "CPP", "LDSHARED", "CFLAGS", "CPPFLAGS", "LDFLAGS", "AR",
                "ARFLAGS")

NEEDS = "aoprim.cybuild needs Cython>=3.1 and setuptools: pip install 'aoprim[cython]'"


def cache_dir() -> str:
    """The folder that holds built modules: ``$AOPRIM_CYBUILD_CACHE`` if set, else
    ``$XDG_CACHE_HOME/aoprim/cybuild`` (an absolute XDG_CACHE_HOME only, as the XDG base
    directory specification says), else ``~/.cache/aoprim/cybuild``."""
    path = os.environ.get(CACHE_ENV)
    if path:
        return os.path.abspath(os.path.expanduser(path))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aoprim", "cybuild")


def build_module(name: str, source: str, workdir: str | os.PathLike[str] | None = None,
                 cflags: Iterable[str] = ("-O2",)) -> ModuleType:
    """Cythonize and compile ``source`` as module ``name``, then import and return it.

    With ``workdir``, the build happens there (the ``.pyx``, the generated C and the built
    extension stay, for inspection), every call compiles, and the cache is not used.
    Without it, the built extension is taken from ``cache_dir()`` when the same inputs were
    built before, else built in a temporary folder that is removed afterwards and only the
    extension is kept in the cache.  Raises on any compile error (the compiler's messages
    are on stderr), ValueError on a name that is not a Python identifier, and ImportError
    naming the ``aoprim[cython]`` extra when Cython or setuptools is missing."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"build_module: module name {name!r} is not a Python identifier")
    if isinstance(cflags, (str, bytes)):
        raise TypeError(f"build_module: cflags is a list of flags, not one string: {cflags!r}")
    source = textwrap.dedent(source)
    cflags = tuple(cflags)
    if workdir:
        os.makedirs(workdir, exist_ok=True)
        return _load(name, _compile(name, source, workdir, cflags))
    cache = cache_dir()
    path = os.path.join(cache, f"{name}-{_cache_key(name, source, cflags)}{_ext_suffix()}")
    if not os.path.isfile(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"aoprim-cybuild-{name}-") as tmp:
            _publish(_compile(name, source, tmp, cflags), path)
    return _load(name, path)


def _ext_suffix() -> str:
    # '.cpython-311-x86_64-linux-gnu.so': interpreter, version, ABI flags (debug, free
    # threading) and platform -- what decides whether a built extension can be imported here
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def _package_dir() -> str:
    return os.path.dirname(os.path.abspath(aoprim.__file__))


def _interface_digest() -> str:
    """A digest of every file a cimporting module compiles against: the package's .pxd and
    .pxi files and the C headers in aoprim.get_include(), by path relative to their root."""
    h = hashlib.sha256()
    for root in (_package_dir(), aoprim.get_include()):
        found = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found += [os.path.join(folder, n) for n in names if n.endswith((".pxd", ".pxi", ".h"))]
        for path in sorted(found):
            with open(path, "rb") as f:
                data = f.read()
            rel = os.path.relpath(path, root).encode()
            h.update(b"%d:%s%d:" % (len(rel), rel, len(data)))
            h.update(data)
    return h.hexdigest()


def _cache_key(name: str, source: str, cflags: tuple[str, ...]) -> str:
    """The digest that names a built module in the cache: it changes with every input that
    changes the built extension (see the module docstring)."""
    parts = [
        ("name", name),
        ("source", source),
        ("cflags", "\0".join(cflags)),
        ("aoprim", aoprim.__version__),
        ("interface", _interface_digest()),
        ("abi", f"{_ext_suffix()} {sys.implementation.cache_tag}"),
        ("cython", _cython_version()),
        ("directives", repr(sorted(DIRECTIVES.items()))),
        ("env", repr([(k, os.environ.get(k)) for k in COMPILER_ENV])),
    ]
    h = hashlib.sha256()
    for label, value in parts:
        data = value.encode()
        h.update(b"%s=%d:" % (label.encode(), len(data)))
        h.update(data)
    return h.hexdigest()[:32]


def _cython_version() -> str:
    # only Cython's small top-level module: a cache hit imports neither its compiler nor
    # setuptools
    try:
        import Cython
    except ImportError as e:
        raise ImportError(f"{NEEDS} ({e})") from e
    return str(getattr(Cython, "__version__", "unknown"))


def _build_tools() -> tuple[Any, Any, Any]:
    """Cython's cythonize, setuptools' Extension and Distribution (imported by name: neither
    package ships type information); ImportError naming the extra when one is missing."""
    try:
        cython_build = importlib.import_module("Cython.Build")
        setuptools = importlib.import_module("setuptools")
        dist = importlib.import_module("setuptools.dist")
    except ImportError as e:
        raise ImportError(f"{NEEDS} ({e})") from e
    return cython_build.cythonize, setuptools.Extension, dist.Distribution


def _compile(name: str, source: str, builddir: str | os.PathLike[str],
             cflags: tuple[str, ...]) -> str:
    """Cythonize and compile ``source`` in ``builddir``; the built extension's path."""
    cythonize, Extension, Distribution = _build_tools()
    pyx = os.path.join(builddir, name + ".pyx")
    with open(pyx, "w") as f:
        f.write(source)
    pkg_parent = os.path.dirname(_package_dir())
    ext = Extension(name, [pyx], include_dirs=[aoprim.get_include()],
                    extra_compile_args=list(cflags))
    exts = cythonize([ext], compiler_directives=DIRECTIVES, include_path=[pkg_parent],
                     quiet=True, force=True)
    dist = Distribution({"name": name, "ext_modules": exts, "script_name": "setup.py"})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = builddir
    cmd.build_temp = os.path.join(builddir, "tmp")
    cmd.inplace = False
    cmd.ensure_finalized()
    cmd.run()
    return str(cmd.get_ext_fullpath(name))


def _publish(built: str, path: str) -> None:
    """Copy ``built`` to ``path`` through a temporary file in the same folder and one
    ``os.replace``: another process never sees a partly written file at ``path``."""
    fd, part = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part",
                                dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as out, open(built, "rb") as src:
            shutil.copyfileobj(src, out)
        os.chmod(part, 0o644)
        os.replace(part, path)
    except BaseException:
        try:
            os.unlink(part)
        except FileNotFoundError:
            pass
        raise


def _load(name: str, path: str) -> ModuleType:
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None) == path:
        return mod                  # this very file is already imported here
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"build_module: {path} is not an extension module this Python loads")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
