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

    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip(f"no pyproject.toml beside the tests ({pyproject})")
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]

    def tools(reqs):
        return sorted(r for r in reqs if re.match(r"(?i)(cython|setuptools)\b", r))

    assert [re.match(r"(?i)[\w-]+", r).group().lower() for r in tools(extras["cython"])] == \
        ["cython", "setuptools"]
    assert tools(extras["cython"]) == tools(extras["test"]), (
        "pip install 'aoprim[cython]' should bring the Cython and setuptools the tests use")


# -- a name that is taken, a cache file that does not load, a cache that cannot be written -----

def test_a_name_already_imported_is_refused_naming_it(env):
    import json
    with pytest.raises(ValueError, match=r"'json'.*sys\.modules") as e:
        env.build("json", SRC_1)
    assert json.__file__ in str(e.value)
    assert sys.modules["json"] is json and hasattr(json, "dumps")
    assert env.compiles == [], "compiled although the name is refused"


def test_a_name_importable_from_sys_path_is_refused_naming_where(env, tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "cyb_taken.py").write_text("VALUE = 'theirs'\n")
    monkeypatch.syspath_prepend(str(lib))
    with pytest.raises(ValueError, match=r"'cyb_taken'") as e:
        env.build("cyb_taken", SRC_1)
    assert str(lib / "cyb_taken.py") in str(e.value)
    assert "cyb_taken" not in sys.modules and env.compiles == []
    import cyb_taken                          # still the module on sys.path
    assert cyb_taken.VALUE == "theirs"
    sys.modules.pop("cyb_taken")


def test_a_module_it_built_in_a_workdir_on_sys_path_can_be_built_again(env, tmp_path,
                                                                        monkeypatch):
    work = tmp_path / "work"
    assert env.build("cyb_again", SRC_1, workdir=str(work)).value() == 1
    sys.modules.pop("cyb_again")
    monkeypatch.syspath_prepend(str(work))     # its own extension is now importable there
    assert env.build("cyb_again", SRC_1, workdir=str(work)).value() == 1
    assert env.compiles == ["cyb_again"] * 2


def test_a_cache_file_that_does_not_load_is_deleted_and_rebuilt(env, tmp_path, monkeypatch):
    assert env.build("cyb_damaged", SRC_1).value() == 1
    (name,) = _listing(env.cache)
    size = (env.cache / name).stat().st_size
    sys.modules.pop("cyb_damaged")
    # a damaged copy in another cache: another path and file than the one this process has
    # loaded (the dynamic loader would hand back the loaded one for either)
    other = tmp_path / "other-cache"
    other.mkdir()
    (other / name).write_bytes((env.cache / name).read_bytes()[:100])
    monkeypatch.setenv(cybuild.CACHE_ENV, str(other))
    assert env.build("cyb_damaged", SRC_1).value() == 1
    assert env.compiles == ["cyb_damaged"] * 2, "the damaged file was not rebuilt"
    assert _listing(other) == [name] and (other / name).stat().st_size == size
    sys.modules.pop("cyb_damaged")
    assert env.build("cyb_damaged", SRC_1).value() == 1
    assert len(env.compiles) == 2, "the rebuilt file is not used from the cache"


def test_a_cache_file_that_fails_again_after_its_rebuild_names_the_cache(env, monkeypatch):
    def junk(name, source, builddir, cflags):
        env.compiles.append(name)
        out = os.path.join(builddir, name + _suffix())
        with open(out, "wb") as f:
            f.write(b"not an ELF file")
        return out

    monkeypatch.setattr(cybuild, "_compile", junk)
    with pytest.raises(ImportError) as first:
        env.build("cyb_junk", SRC_1)
    (name,) = _listing(env.cache)
    assert str(env.cache / name) in str(first.value)
    assert env.compiles == ["cyb_junk"], "a file it has just built is not built again"
    with pytest.raises(ImportError) as again:
        env.build("cyb_junk", SRC_1)
    assert env.compiles == ["cyb_junk"] * 2, "a cache file that fails is rebuilt once"
    assert str(env.cache / name) in str(again.value) and cybuild.CACHE_ENV in str(again.value)
    assert "cyb_junk" not in sys.modules


def test_a_module_whose_code_raises_is_not_rebuilt(env):
    src = "import cyb_no_such_module_anywhere\n"
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError, match="cyb_no_such_module_anywhere"):
            env.build("cyb_raises", src)
        assert "cyb_raises" not in sys.modules
    assert env.compiles == ["cyb_raises"], "a file that loads was taken for a damaged one"
    assert len(_listing(env.cache)) == 1


def test_a_cache_dir_that_cannot_be_made_warns_and_the_module_still_loads(env, tmp_path,
                                                                         monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "cache"                  # mkdir fails: ENOTDIR
    monkeypatch.setenv(cybuild.CACHE_ENV, str(cache))
    with pytest.warns(RuntimeWarning, match=re.escape(str(cache))) as w:
        mod = env.build("cyb_nocache", SRC_1)
    assert mod.value() == 1
    assert cybuild.CACHE_ENV in str(w[0].message)
    assert not cache.exists()
    assert env.build("cyb_nocache", SRC_1).value() == 1
    assert env.compiles == ["cyb_nocache"], "compiled again in the same process"


def test_a_read_only_cache_dir_warns_and_the_module_still_loads(tmp_path):
    # a read-only filesystem (EROFS), as a container's read-only HOME: a private mount
    # namespace (unshare -m) with a tmpfs remounted read-only; root ignores chmod 0555
    if not shutil.which("unshare"):
        pytest.skip("no unshare here (util-linux)")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.strip()}")
    ro = tmp_path / "ro"
    ro.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "ro.py"
    script.write_text(textwrap.dedent(f"""\
        import warnings
        from aoprim import cybuild
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            print(cybuild.build_module("cyb_ro", {SRC_1!r}, cflags={FAST!r}).value())
            print(cybuild.build_module("cyb_ro", {SRC_1!r}, cflags={FAST!r}).value())
        for m in w:
            print("WARNING", m.category.__name__, m.message)
        """))
    env = _subprocess_env(ro / "cache")
    env["TMPDIR"] = str(tmp)
    sh = (f'mount -t tmpfs tmpfs "{ro}" && mkdir "{ro}/cache" && '
          f'mount -o remount,ro "{ro}" && exec "{sys.executable}" "{script}"')
    proc = subprocess.run(["unshare", "-m", "sh", "-c", sh], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["1", "1"], proc.stdout + proc.stderr
    warned = [line for line in lines[2:] if line.startswith("WARNING RuntimeWarning")]
    assert len(warned) == 1, proc.stdout
    assert str(ro / "cache") in warned[0] and cybuild.CACHE_ENV in warned[0]
    assert "Read-only file system" in warned[0]
    assert _listing(tmp) == [], "the private copy outlived the process"
