"""The package metadata says what is true: the licence is the LICENSE file's, and
the Pythons it claims are the ones requires-python admits, the release wheels are built for
and CI runs the suite on."""
import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"

pytestmark = pytest.mark.skipif(not PYPROJECT.is_file(), reason="no pyproject.toml beside tests/")


@pytest.fixture(scope="module")
def meta():
    return tomllib.loads(PYPROJECT.read_text())


def _python_classifiers(project):
    return sorted(c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                  if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))


def _bounds(reqs, name):
    """(lower, upper) major versions of ``name`` in a requirement list: ``name>=L,<U``."""
    (req,) = [r for r in reqs if re.match(rf"{name}\b", r, re.I)]
    m = re.fullmatch(rf"{name}>=(\d+)(?:\.\d+)*(?:,<(\d+)(?:\.\d+)*)?", req.replace(" ", ""),
                     re.I)
    assert m, f"{req!r}: expected {name}>=L or {name}>=L,<U"
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


def test_licence_is_an_spdx_expression_and_shipped(meta):
    project = meta["project"]
    # PEP 639's form; setuptools 77+ refuse a License classifier beside it, and warn that
    # the older table form ({text = "MIT"}) stops building after 2027-02-18
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_build_requirements_are_bounded_to_what_reads_the_metadata(meta):
    # setuptools 77 is the first to read the SPDX licence; an upper bound below the next
    # major not tried; Cython likewise.  The test extra builds in place (.ci/sanitize,
    # `setup.py build_ext`): it needs a setuptools that reads this pyproject too.
    build = meta["build-system"]["requires"]
    low, high = _bounds(build, "setuptools")
    assert low >= 77 and high is not None and high > low
    low, high = _bounds(build, "Cython")
    assert low >= 3 and high is not None and high > low
    for extra in ("test", "bench"):
        low, _ = _bounds(meta["project"]["optional-dependencies"][extra], "setuptools")
        assert low >= 77, extra


def test_descriptive_metadata(meta):
    project = meta["project"]
    assert project["authors"] == [{"name": "aoprim developers"}]
    assert project["keywords"]
    for c in ("Programming Language :: Cython", "Framework :: AsyncIO",
              "Topic :: System :: Networking", "Operating System :: POSIX :: Linux",
              "Programming Language :: Python :: 3 :: Only"):
        assert c in project["classifiers"]
    assert [c for c in project["classifiers"] if c.startswith("Development Status :: ")]


def test_one_free_threading_classifier(meta):
    # the whole suite runs on the free-threaded 3.13t in .ci/run, and .ci/tsan's threaded
    # tests report no race (docs/reliability.md): the package says so once, at one level
    ft = [c for c in meta["project"]["classifiers"]
          if c.startswith("Programming Language :: Python :: Free Threading")]
    assert ft == ["Programming Language :: Python :: Free Threading :: 3 - Stable"]


def test_supported_pythons_agree(meta):
    # the version classifiers, requires-python, cibuildwheel's build list and the versions
    # .ci/run runs the suite on name the same Pythons; the free-threaded builds (3.13t) are
    # in cibuildwheel's list (and its enable list) and in .ci/run's, beside their version
    versions = _python_classifiers(meta["project"])
    assert versions == ["3.11", "3.12", "3.13"]
    free_threaded = ["3.13t"]
    assert meta["project"]["requires-python"] == f">={versions[0]}"
    cibw = meta["tool"]["cibuildwheel"]
    wheels = sorted(b.split("-")[0] for b in cibw["build"])
    assert wheels == sorted("cp" + v.replace(".", "") for v in versions + free_threaded)
    assert "cpython-freethreading" in cibw.get("enable", [])
    ci_run = ROOT / ".ci" / "run"
    if not ci_run.is_file():
        pytest.skip("no .ci/run here (an unpacked sdist ships no CI scripts)")
    ci = ci_run.read_text()
    m = re.search(r"^VERSIONS=\(([^)]*)\)", ci, re.M)
    assert m and m.group(1).split() == versions + free_threaded


# -- what `import aoprim` says where it cannot work -------------------------------------------

def _source_only_copy(tmp_path):
    """The installed package's Python files (no compiled module) in tmp_path/aoprim: what a
    checkout that was never built holds."""
    import aoprim
    pkg = pathlib.Path(aoprim.__file__).resolve().parent
    for src in pkg.rglob("*.py"):
        dst = tmp_path / "aoprim" / src.relative_to(pkg)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    assert not list((tmp_path / "aoprim").rglob("*.so"))
    return tmp_path


def _import_there(python, folder):
    """``import aoprim`` with ``folder`` as the current directory and first on sys.path, and
    no site-packages (-S): nothing else can provide a built aoprim."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([python, "-S", "-c", "import aoprim"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=60)


def test_import_from_an_unbuilt_checkout_says_to_install(tmp_path):
    r = _import_there(sys.executable, _source_only_copy(tmp_path))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: aoprim's compiled modules are missing"), r.stderr
    assert "`pip install .`" in last and "outside the checkout" in last, last
    assert str(tmp_path / "aoprim") in last           # which folder it imported


def _python310():
    """A CPython 3.10 (on PATH, or pyenv's), or None."""
    cands = [shutil.which("python3.10")]
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    cands += sorted(glob.glob(os.path.join(root, "versions", "3.10.*", "bin", "python3.10")),
                    reverse=True)
    for c in filter(None, cands):
        try:
            out = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout
        except OSError:
            continue
        if out.strip() == "(3, 10)":
            return c
    return None


def test_import_on_python_310_names_the_supported_pythons(tmp_path):
    py = _python310()
    if py is None:
        pytest.skip("no CPython 3.10 here (python3.10 on PATH or pyenv's versions/3.10.*)")
    r = _import_there(py, _source_only_copy(tmp_path))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: aoprim supports CPython 3.11, 3.12 and 3.13"), r.stderr
    assert "this is Python 3.10." in last, last


def test_the_supported_pythons_named_on_import_are_the_classifiers(meta):
    import aoprim
    versions = _python_classifiers(meta["project"])
    assert aoprim._SUPPORTED == "CPython " + ", ".join(versions[:-1]) + " and " + versions[-1]


# -- a second build does not compile again what the first compiled ---------------------------

TINY = """
# cython: language_level=3
def answer():
    return 42
"""


def _build(folder, *args, **env):
    e = dict(os.environ, **env)
    e.pop("AOPRIM_SANITIZE", None)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", *args], cwd=folder, env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout + r.stderr


BUILDING = "building 'aoprim._tiny' extension"


def _tiny_checkout(folder):
    """A scratch copy of the build files with one small extension, aoprim/_tiny.pyx."""
    pytest.importorskip("Cython")
    if not (ROOT / "setup.py").is_file():
        pytest.skip("no setup.py beside tests/")
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copyfile(ROOT / name, folder / name)
    (folder / "aoprim" / "include").mkdir(parents=True)
    shutil.copyfile(ROOT / "aoprim" / "_version.py", folder / "aoprim" / "_version.py")
    (folder / "aoprim" / "__init__.py").write_text("")
    pyx = folder / "aoprim" / "_tiny.pyx"
    pyx.write_text(TINY)
    return pyx


def test_a_second_build_recompiles_only_what_changed(tmp_path):
    """pip builds a checkout in place, each time in a fresh isolated environment whose newly
    installed Cython makes cythonize rewrite every .c with the same bytes; setup.py must not
    compile those again -- and must when the source or the flags change."""
    pyx = _tiny_checkout(tmp_path)
    building = BUILDING
    assert building in _build(tmp_path)
    c = tmp_path / "aoprim" / "_tiny.c"
    before, written = c.read_bytes(), os.stat(c).st_mtime_ns
    t = os.stat(c).st_mtime + 5              # newer than the .c: cythonize writes it again
    os.utime(pyx, (t, t))
    out = _build(tmp_path)
    assert os.stat(c).st_mtime_ns != written and c.read_bytes() == before  # same bytes
    assert building not in out and "aoprim._tiny: its sources" in out, out
    pyx.write_text(TINY.replace("42", "43"))            # another source: compiled
    assert building in _build(tmp_path)
    assert building not in _build(tmp_path)
    assert building in _build(tmp_path, CFLAGS="-DAOPRIM_TEST_FLAG=1")   # other flags too


def test_a_module_another_build_wrote_is_rebuilt(tmp_path):
    """The skip holds only for the very module the matching inputs built: a build with
    another build folder (as .ci/sanitize's AOPRIM_SANITIZE=1 --build-temp) and other
    flags writes the same module, and the next ordinary build must compile again."""
    _tiny_checkout(tmp_path)
    assert BUILDING in _build(tmp_path)
    (built,) = (tmp_path / "build").glob("lib*/aoprim/_tiny*.so")
    ordinary = built.read_bytes()
    other = _build(tmp_path, "--build-temp", str(tmp_path / "other-temp"),
                   CFLAGS="-DAOPRIM_TEST_OTHER=1")
    assert BUILDING in other
    assert built.read_bytes() != ordinary, "the other flags built the same bytes"
    out = _build(tmp_path)
    assert BUILDING in out, "the module of the other build was kept: " + out
    assert built.read_bytes() == ordinary
    assert BUILDING not in _build(tmp_path)
    built.write_bytes(built.read_bytes() + b"\0")     # a module the stamp did not record
    assert BUILDING in _build(tmp_path)


def test_build_ext_options_are_inputs_of_the_module(tmp_path):
    # build_ext's own -D / -U / -l / -L / -R options change the compile or the link
    _tiny_checkout(tmp_path)
    assert BUILDING in _build(tmp_path)
    for option in (["-D", "AOPRIM_TEST_MACRO=1"], ["-U", "NDEBUG"], ["-L", str(tmp_path)],
                   ["-R", str(tmp_path)]):
        assert BUILDING in _build(tmp_path, *option), f"{option} did not recompile"
        assert BUILDING not in _build(tmp_path, *option), f"{option} recompiled twice"


# -- compiled modules at any depth of the package ---------------------------------------------

BASE_PXD = """
cdef inline int forty_two() noexcept:
    return 42
"""
BASE_PYX = """
# cython: language_level=3
def base():
    return forty_two()
"""
INNER_PYX = """
# cython: language_level=3
from aoprim._base cimport forty_two

def answer():
    return forty_two() + 1
"""


def _nested_checkout(folder):
    """A scratch copy of the build files with a module at the top of the package
    (aoprim/_base) and one in a subpackage (aoprim/sub/_inner) that cimports it, each with
    its .pxd and .pyi, as the server's and the asyncio loop's modules sit beside their users."""
    _tiny_checkout(folder)
    shutil.copyfile(ROOT / "MANIFEST.in", folder / "MANIFEST.in")
    pkg = folder / "aoprim"
    (pkg / "_tiny.pyx").unlink()
    (pkg / "_base.pxd").write_text(BASE_PXD)
    (pkg / "_base.pyx").write_text(BASE_PYX)
    (pkg / "_base.pyi").write_text("def base() -> int: ...\n")
    (pkg / "sub").mkdir()
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "_inner.pyx").write_text(INNER_PYX)
    (pkg / "sub" / "_inner.pxd").write_text("# no C API\n")
    (pkg / "sub" / "_inner.pyi").write_text("def answer() -> int: ...\n")


def _setup(folder, *args):
    e = dict(os.environ)
    e.pop("AOPRIM_SANITIZE", None)
    r = subprocess.run([sys.executable, "setup.py", *args], cwd=folder, env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout + r.stderr


def test_a_module_in_a_subpackage_is_built_under_its_dotted_name(tmp_path):
    _nested_checkout(tmp_path)
    out = _build(tmp_path, "--inplace")
    assert "building 'aoprim.sub._inner' extension" in out, out
    assert "building 'aoprim._base' extension" in out, out
    (inner,) = (tmp_path / "aoprim" / "sub").glob("_inner.*.so")
    assert not list((tmp_path / "aoprim").glob("_inner.*.so"))
    # the cimport across folders resolved: the module imports and runs
    code = "from aoprim.sub import _inner; print(_inner.answer(), _inner.__name__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["43", "aoprim.sub._inner"], r.stderr


def test_the_sdist_and_the_wheel_carry_every_folders_modules_once(tmp_path):
    import tarfile
    import zipfile
    _nested_checkout(tmp_path)
    _build(tmp_path, "--inplace")          # a built checkout: its .so must not be shipped again
    _setup(tmp_path, "-q", "sdist", "-d", str(tmp_path / "dist"))
    _setup(tmp_path, "-q", "bdist_wheel", "-d", str(tmp_path / "dist"))
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with tarfile.open(sdist) as t:
        src = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in ("aoprim/_base.pyx", "aoprim/_base.pxd", "aoprim/_base.pyi",
              "aoprim/sub/_inner.pyx", "aoprim/sub/_inner.pxd", "aoprim/sub/_inner.pyi"):
        assert f in src, f"sdist lacks {f}"
    assert not [n for n in src if n.endswith((".c", ".so", ".o"))], sorted(src)
    names = zipfile.ZipFile(wheel).namelist()
    so = sorted(n.split(".")[0] for n in names if n.endswith(".so"))
    assert so == ["aoprim/_base", "aoprim/sub/_inner"], names
    for f in ("aoprim/_base.pxd", "aoprim/_base.pyi", "aoprim/sub/_inner.pxd",
              "aoprim/sub/_inner.pyi"):
        assert f in names, f"wheel lacks {f}"
    assert not [n for n in names if n.endswith((".c", ".o"))], names


def test_ci_runs_the_readme_suite_from_a_clone_named_aoprim_without_the_debian_peers():
    # the README's command must pass where a newcomer runs it: a `git clone` (a folder named
    # aoprim) on a machine with only what `.[test]` installs (.ci/run, top comment)
    ci_run = ROOT / ".ci" / "run"
    if not ci_run.is_file():
        pytest.skip("no .ci/run here (an unpacked sdist ships no CI scripts)")
    ci = ci_run.read_text()
    m = re.search(r"^HIDDEN_PEERS=\(([^)]*)\)", ci, re.M)
    assert m and set(m.group(1).split()) >= {"wrk", "haproxy", "redis-server"}
    assert re.search(r'git clone -q \. "\$src"', ci) and 'src="$work/clone/aoprim"' in ci
    assert "unshare --mount" in ci and "mount --bind" in ci and "chmod 0644" in ci
