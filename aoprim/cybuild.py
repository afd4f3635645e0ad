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
"""
import hashlib
import importlib.util
import os
import sys
import tempfile
import textwrap

import aoprim

__all__ = ["build_module"]

DIRECTIVES = {
    "language_level": 3,
    "freethreading_compatible": True,
    "boundscheck": False,
    "wraparound": False,
}


def build_module(name, source, workdir=None, cflags=("-O2",)):
    """Cythonize and compile ``source`` as module ``name`` in ``workdir`` (a fresh temporary
    folder by default), then import and return it.  Raises on any compile error."""
    from Cython.Build import cythonize
    from setuptools import Extension
    from setuptools.dist import Distribution

    source = textwrap.dedent(source)
    tag = hashlib.sha1(source.encode()).hexdigest()[:10]
    workdir = workdir or tempfile.mkdtemp(prefix=f"aoprim-{name}-{tag}-")
    os.makedirs(workdir, exist_ok=True)
    pyx = os.path.join(workdir, name + ".pyx")
    with open(pyx, "w") as f:
        f.write(source)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(aoprim.__file__)))
    ext = Extension(name, [pyx], include_dirs=[aoprim.get_include()],
                    extra_compile_args=list(cflags))
    exts = cythonize([ext], compiler_directives=DIRECTIVES, include_path=[pkg_parent],
                     quiet=True, force=True)
    dist = Distribution({"name": name, "ext_modules": exts, "script_name": "setup.py"})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = workdir
    cmd.build_temp = os.path.join(workdir, "tmp")
    cmd.inplace = False
    cmd.ensure_finalized()
    cmd.run()
    path = cmd.get_ext_fullpath(name)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
