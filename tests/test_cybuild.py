"""aoprim.cybuild.build_module: a module built once is imported from the cache afterwards, the
cache key changes with every input that changes the built extension, a build leaves nothing
in the temporary folder, the cache moves with AOPRIM_CYBUILD_CACHE / XDG_CACHE_HOME, two
processes building one module at once both get it whole, and ``workdir=`` builds there,
every time, without the cache (docs/cython.md)."""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

import aoprim
from aoprim import cybuild

pytest.importorskip("Cython", reason="build_module needs Cython (the [test] extra has it)")
pytest.importorskip("setuptools", reason="build_module needs setuptools")

FAST = ("-O0",)            # these modules only prove what was compiled, not how fast it runs
SRC_1 = "def value():\n    return 1\n"
SRC_2 = "def value():\n    return 2\n"


def _suffix():
    return cybuild._ext_suffix()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh cache (through AOPRIM_CYBUILD_CACHE) and a fresh temporary folder (what
    tempfile and the compiler use), a counter of compiles, and the names of the modules
    imported, removed from sys.modules afterwards."""
    cache = tmp_path / "cache"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv(cybuild.CACHE_ENV, str(cache))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    compiles = []
    real = cybuild._compile

    def counting(name, source, builddir, cflags):
        compiles.append(name)
        return real(name, source, builddir, cflags)

    monkeypatch.setattr(cybuild, "_compile", counting)
    names = []

    def build(name, source, **kw):
        names.append(name)
        kw.setdefault("cflags", FAST)
        return cybuild.build_module(name, source, **kw)

    yield type("Env", (), {"cache": cache, "tmp": tmp, "compiles": compiles, "build": build})
    for n in names:
        sys.modules.pop(n, None)


def _listing(folder):
    folder = pathlib.Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def _subprocess_env(cache):
    env = dict(os.environ)
    env[cybuild.CACHE_ENV] = str(cache)
    # the aoprim this test run imports (installed, or an in-place build on purpose)
    pkg_parent = str(pathlib.Path(aoprim.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_a_second_call_imports_the_cached_module_without_compiling(env, tmp_path):
    mod = env.build("cyb_same", SRC_1)
    assert mod.value() == 1 and env.compiles == ["cyb_same"]
    files = _listing(env.cache)
    assert len(files) == 1 and files[0].startswith("cyb_same-") and files[0].endswith(_suffix())
    built = env.cache / files[0]
    before = built.stat()
    assert env.build("cyb_same", SRC_1).value() == 1
    assert env.compiles == ["cyb_same"], "the second call compiled again"
    # another process, whose compiler would raise: it imports the cached file
    script = tmp_path / "again.py"
    script.write_text(textwrap.dedent(f"""\
        from aoprim import cybuild
        def no_compile(*args):
            raise AssertionError("compiled although the module is in the cache")
        cybuild._compile = no_compile
        print(cybuild.build_module("cyb_same", {SRC_1!r}, cflags={FAST!r}).value())
        """))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=_subprocess_env(env.cache))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1"]
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert _listing(env.cache) == files


def test_a_changed_source_or_flag_compiles_again(env):
    assert env.build("cyb_changed", SRC_1).value() == 1
    assert env.build("cyb_changed", SRC_2).value() == 2
    assert env.build("cyb_changed", SRC_2, cflags=("-O1",)).value() == 2
    assert env.compiles == ["cyb_changed"] * 3
    assert len(_listing(env.cache)) == 3
    assert env.build("cyb_changed", SRC_1).value() == 1      # the first build, still cached
    assert len(env.compiles) == 3


def test_a_build_leaves_only_the_module(env):
    env.build("cyb_clean", SRC_1)
    assert _listing(env.tmp) == [], "the build folder was left in the temporary folder"
    files = _listing(env.cache)
    assert len(files) == 1 and files[0].endswith(_suffix()), files


def test_a_failed_build_leaves_nothing(env):
    with pytest.raises(Exception):
        env.build("cyb_broken", "def value(:\n")
    assert _listing(env.tmp) == []
    assert _listing(env.cache) == []


def test_workdir_builds_there_every_time_and_not_in_the_cache(env, tmp_path):
    work = tmp_path / "work"
    assert env.build("cyb_work", SRC_1, workdir=str(work)).value() == 1
    sys.modules.pop("cyb_work")
    assert env.build("cyb_work", SRC_1, workdir=str(work)).value() == 1
    assert env.compiles == ["cyb_work"] * 2
    assert "cyb_work.pyx" in _listing(work) and "cyb_work.c" in _listing(work)
    assert any(f.endswith(_suffix()) for f in _listing(work))
    assert not env.cache.exists()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cybuild.CACHE_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cybuild.cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv(cybuild.CACHE_ENV)
    assert cybuild.cache_dir() == str(tmp_path / "xdg" / "aoprim" / "cybuild")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")    # not absolute: ignored (XDG spec)
    assert cybuild.cache_dir() == str(tmp_path / "home" / ".cache" / "aoprim" / "cybuild")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cybuild.cache_dir() == str(tmp_path / "home" / ".cache" / "aoprim" / "cybuild")


def test_the_cache_dir_env_var_is_where_builds_go(env):
    mod = env.build("cyb_where", SRC_1)
    assert pathlib.Path(mod.__file__).parent == env.cache


def _copy_tree(src, dst, patterns):
    shutil.copytree(src, dst, ignore=lambda d, names: [
        n for n in names if not os.path.isdir(os.path.join(d, n))
        and not n.endswith(patterns)])


def test_the_key_changes_with_every_input(monkeypatch, tmp_path):
    def key(name="k", source=SRC_1, cflags=FAST):
        return cybuild._cache_key(name, source, cflags)

    base = key()
    assert key() == base
    changed = {
        "name": key(name="k2"),
        "source": key(source=SRC_2),
        "cflags": key(cflags=("-O1",)),
    }
    with monkeypatch.context() as m:
        m.setattr(aoprim, "__version__", aoprim.__version__ + "+other")
        changed["aoprim version"] = key()
    with monkeypatch.context() as m:
        inc = tmp_path / "include"
        shutil.copytree(aoprim.get_include(), inc)
        assert key() == base
        m.setattr(aoprim, "get_include", lambda: str(inc))
        assert key() == base, "the same headers elsewhere are the same input"
        with open(inc / "aop_atomic.h", "a") as f:
            f.write("\n/* changed */\n")
        changed["a header"] = key()
    with monkeypatch.context() as m:
        pkg = tmp_path / "pkg"
        _copy_tree(cybuild._package_dir(), pkg, (".pxd", ".pxi", ".h"))
        m.setattr(cybuild, "_package_dir", lambda: str(pkg))
        assert key() == base
        with open(pkg / "_atomic.pxd", "a") as f:
            f.write("\n# changed\n")
        changed["a .pxd"] = key()
    with monkeypatch.context() as m:
        m.setattr(cybuild, "_ext_suffix", lambda: ".cpython-399t-x86_64-linux-gnu.so")
        changed["Python ABI"] = key()
    with monkeypatch.context() as m:
        import Cython
        m.setattr(Cython, "__version__", "0.0.0")
        changed["Cython version"] = key()
    with monkeypatch.context() as m:
        m.setenv("CFLAGS", os.environ.get("CFLAGS", "") + " -fsanitize=address")
        changed["CFLAGS"] = key()
    same = [what for what, k in changed.items() if k == base]
    assert not same, f"the cache key ignores: {same}"
    assert len(set(changed.values())) == len(changed)


def test_two_processes_building_one_module_both_get_it_whole(env, tmp_path):
    # each process, once it has missed the cache and started compiling, waits until the other
    # has too: both builds overlap, both publish, and both import a whole module
    gate = tmp_path / "gate"
    gate.mkdir()
    script = tmp_path / "race.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys, time
        from aoprim import cybuild
        real = cybuild._compile
        def gated(*args):
            open(os.path.join({str(gate)!r}, str(os.getpid())), "w").close()
            deadline = time.monotonic() + 60
            while len(os.listdir({str(gate)!r})) < 2:
                if time.monotonic() > deadline:
                    sys.exit("the other process never started compiling")
                time.sleep(0.01)
            print("compiled")
            return real(*args)
        cybuild._compile = gated
        print(cybuild.build_module("cyb_race", {SRC_2!r}, cflags={FAST!r}).value())
        """))
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_subprocess_env(env.cache)) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == ["compiled", "2"]
    files = _listing(env.cache)
    assert len(files) == 1 and files[0].endswith(_suffix()), files   # no partial file left
    assert _listing(env.tmp) == []


def test_bad_arguments_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="'my-mod'"):
        cybuild.build_module("my-mod", SRC_1)
    with pytest.raises(TypeError, match="'-O3 -march=native'"):    # not split into characters
        cybuild.build_module("cyb_flags", SRC_1, cflags="-O3 -march=native")


def test_without_cython_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setenv(cybuild.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "Cython", None)     # `import Cython` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'aoprim\[cython\]'"):
        cybuild.build_module("cyb_nocython", SRC_1)


def test_the_cython_extra_brings_the_test_extras_build_tools():
    import tomllib

    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip(f"no pyproject.toml beside the tests ({pyproject})")
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]

    def tools(reqs):
        return sorted(r for r in reqs if re.match(r"(?i)(cython|setuptools)\b", r))

    assert [re.match(r"(?i)[\w-]+", r).group().lower() for r in tools(extras["cython"])] == \
        ["cython", "setuptools"]
    assert tools(extras["cython"]) == tools(extras["test"]), (
        "pip install 'aoprim[cython]' should bring the Cython and setuptools the tests use")
