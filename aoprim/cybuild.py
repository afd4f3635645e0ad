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
filesystem): a reader sees the whole file or no file.  The cache may be deleted at any time;
a file in it is never written in place (a loaded extension whose file changes under it
crashes its process with SIGBUS), only replaced or deleted.

A cache file that the loader refuses (damaged, truncated, built elsewhere) is deleted and
built again, once.  A cache that cannot be written (a read-only filesystem, no permission)
costs a RuntimeWarning: the module is loaded from a private copy kept for this process.

The name must not be taken: a module already in ``sys.modules`` or importable from
``sys.path`` (``json``, a package of the project) is refused with ValueError, since the
built module would take its place in ``sys.modules`` for the whole process.  A name
``build_module`` itself loaded may be built again.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import warnings
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

# The files build_module has loaded in this process (real paths): a module in sys.modules
# whose file is one of these is its own, and may be replaced by another build of that name.
_loaded: set[str] = set()

# When the cache cannot be written: the cache file's name -> a private copy of the built
# module, in one temporary folder per process, removed at exit (see _keep_private).
_private: dict[str, str] = {}
_private_dir: list[str] = []


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
    are on stderr), ValueError on a name that is not a Python identifier or that is taken
    (already in ``sys.modules``, or importable, and not loaded by ``build_module``), and
    ImportError naming the ``aoprim[cython]`` extra when Cython or setuptools is missing.

    A cache file the loader refuses is deleted and built again once; if that fails too, the
    ImportError names the cache file.  When the cache cannot be written, a RuntimeWarning
    names it and the module is loaded from a private copy kept until the process exits."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"build_module: module name {name!r} is not a Python identifier")
    if isinstance(cflags, (str, bytes)):
        raise TypeError(f"build_module: cflags is a list of flags, not one string: {cflags!r}")
    _refuse_taken(name, workdir)
    source = textwrap.dedent(source)
    cflags = tuple(cflags)
    if workdir:
        os.makedirs(workdir, exist_ok=True)
        built = _compile(name, source, workdir, cflags)
        try:
            return _load(name, built)
        except _NotLoadable as e:
            raise ImportError(f"build_module: the built module {built} does not load: "
                              f"{e.__cause__}") from e.__cause__
    cache = cache_dir()
    filename = f"{name}-{_cache_key(name, source, cflags)}{_ext_suffix()}"
    path = os.path.join(cache, filename)
    private = _private.get(filename)
    if private is not None and os.path.isfile(private):
        try:
            return _load(name, private)
        except _NotLoadable:
            del _private[filename]          # built again below
    stale = False
    if os.path.isfile(path):
        try:
            return _load(name, path)
        except _NotLoadable:
            # damaged, truncated or built for another system: delete it (never write over
            # it in place: a process that has it loaded would crash) and build it again
            stale = True
            try:
                os.unlink(path)
            except OSError:
                pass                # gone already, or a read-only cache: see _keep_private
    with tempfile.TemporaryDirectory(prefix=f"aoprim-cybuild-{name}-") as tmp:
        built = _compile(name, source, tmp, cflags)
        try:
            os.makedirs(cache, exist_ok=True)
            _publish(built, path)
        except OSError as e:
            path = _keep_private(built, filename, cache, e)
    try:
        return _load(name, path)
    except _NotLoadable as e:
        again = ", deleted and built again," if stale else ""
        raise ImportError(f"build_module: the built module {path}{again} does not load: "
                          f"{e.__cause__} (the cache of built modules is {cache}, moved by "
                          f"${CACHE_ENV}; delete its files, never edit them)") from e.__cause__


class _NotLoadable(Exception):
    """The loader refused a built extension's file (the OSError or ImportError is the
    cause); the module's own code raising is not this."""


def _refuse_taken(name: str, workdir: str | os.PathLike[str] | None) -> None:
    """ValueError when ``name`` is a module in sys.modules or importable from sys.path that
    build_module did not load: registering the built module would replace it process-wide.
    A module build_module built in ``workdir`` (on sys.path) is not refused."""
    mod = sys.modules.get(name)
    if mod is not None:
        origin = getattr(mod, "__file__", None)
        if origin is not None and os.path.realpath(origin) in _loaded:
            return
        raise ValueError(f"build_module: module name {name!r} is taken: sys.modules[{name!r}] "
                         f"is {mod!r}; choose another name")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return
    where = spec.origin if spec.has_location and spec.origin else None
    if where is None:
        where = ", ".join(spec.submodule_search_locations or []) or str(spec.origin)
    elif workdir and os.path.realpath(os.path.dirname(where)) == os.path.realpath(workdir):
        return                      # the extension an earlier call built there
    elif os.path.realpath(where) in _loaded:
        return
    raise ValueError(f"build_module: module name {name!r} is taken: it is importable from "
                     f"{where}; choose another name")


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


def _keep_private(built: str, filename: str, cache: str, error: OSError) -> str:
    """The cache could not be written: copy ``built`` into this process's private folder
    (made once, removed at exit; a loaded extension's file may be deleted on POSIX) and
    warn, naming the cache and the variable that moves it."""
    if not _private_dir or not os.path.isdir(_private_dir[0]):
        folder = tempfile.mkdtemp(prefix="aoprim-cybuild-private-")
        atexit.register(shutil.rmtree, folder, True)
        _private_dir[:] = [folder]
    path = os.path.join(_private_dir[0], filename)
    shutil.copyfile(built, path)
    _private[filename] = path
    warnings.warn(f"aoprim.cybuild: cannot write the cache {cache} ({error}); the module is "
                  f"loaded from a copy kept for this process only: set ${CACHE_ENV} to a "
                  "writable folder to keep built modules", RuntimeWarning, stacklevel=3)
    return path


def _load(name: str, path: str) -> ModuleType:
    """Import the extension at ``path`` as ``name``.  _NotLoadable when the loader refuses
    the file; whatever the module's own code raises otherwise.  On failure sys.modules is
    left as it was."""
    prev = sys.modules.get(name)
    if prev is not None and getattr(prev, "__file__", None) == path:
        return prev                 # this very file is already imported here
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"build_module: {path} is not an extension module this Python loads")
    try:
        # dlopen and the module's init function (Cython's modules run their code later,
        # in exec_module: multi-phase initialisation, PEP 489)
        mod = importlib.util.module_from_spec(spec)
    except (ImportError, OSError) as e:
        raise _NotLoadable(path) from e
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        if sys.modules.get(name) is mod:
            if prev is not None:
                sys.modules[name] = prev
            else:
                del sys.modules[name]
        raise
    _loaded.add(os.path.realpath(path))
    return mod
