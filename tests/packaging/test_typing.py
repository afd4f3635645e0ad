"""The public surface is typed (the package ships py.typed): ``mypy --strict`` accepts a
user's script over every public name of aoprim, aoprim.server and aoprim.aio, and reports
wrong uses -- wrong argument types, an unknown keyword, a result used as what it is not --
with the expected error codes.

The scripts are test data in ``tests/packaging/typing_cases/`` (never run): ``ok_public_api.py`` must
type-check clean; in each ``bad_*.py`` every line marked ``# E: code[, code]`` must be
reported with exactly those codes, and no other line may be.  mypy runs on copies of them in
a temporary folder, against the INSTALLED aoprim: from a wheel it is found in site-packages;
an editable or in-place install (which mypy cannot follow through its import hook) is put on
MYPYPATH.  As for any installed package, mypy's findings inside aoprim itself are not the
user's (``[mypy-aoprim.*] ignore_errors``): only what the scripts see of it is judged.
"""
import dataclasses
import importlib.util
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys

import pytest

mypy = pytest.importorskip("mypy", reason="mypy is not installed (pip install '.[test]')")

CASES = pathlib.Path(__file__).resolve().parent / "typing_cases"
SCRIPTS = sorted(p.name for p in CASES.glob("*.py"))
BAD = [n for n in SCRIPTS if n.startswith("bad_")]
_MARK = re.compile(r"#\s*E:\s*([\w-]+(?:\s*,\s*[\w-]+)*)\s*$")
_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[\w-]+)\]$")


def _installed_root():
    """The folder holding the installed aoprim package, and whether mypy finds it there by
    itself (site-packages) or needs it on MYPYPATH (editable / in-place installs)."""
    spec = importlib.util.find_spec("aoprim")
    assert spec is not None and spec.origin, "aoprim is not installed"
    root = pathlib.Path(spec.origin).resolve().parent.parent
    sites = {pathlib.Path(p).resolve()
             for p in site.getsitepackages() + [site.getusersitepackages()]}
    return root, root in sites


def expected_errors(path):
    """{line: {codes}} of the ``# E: ...`` markers in a case file."""
    out = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = _MARK.search(line)
        if m:
            out[i] = {c.strip() for c in m.group(1).split(",")}
    return out


def parse_errors(output):
    """{file name: {line: {codes}}} of mypy's error lines (notes are not errors)."""
    found = {}
    for line in output.splitlines():
        m = _ERROR.match(line.strip())
        if m:
            name = pathlib.Path(m["file"]).name
            found.setdefault(name, {}).setdefault(int(m["line"]), set()).add(m["code"])
    return found


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory):
    """One ``mypy --strict`` run over copies of every case script, from a temporary cwd (so
    that no checkout on the current directory shadows the installed package)."""
    work = tmp_path_factory.mktemp("typing")
    for name in SCRIPTS:
        shutil.copy(CASES / name, work / name)
    (work / "mypy.ini").write_text(
        "[mypy]\nstrict = True\nshow_error_codes = True\n"
        "[mypy-aoprim.*]\nignore_errors = True\n")
    root, in_site = _installed_root()
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    if not in_site:
        env["MYPYPATH"] = str(root)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
         "--cache-dir", str(work / ".mypy_cache"), "--no-color-output", *SCRIPTS],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout + proc.stderr, parse_errors(proc.stdout)


def test_the_cases_exist_and_every_bad_one_marks_its_errors():
    assert "ok_public_api.py" in SCRIPTS and BAD
    for name in BAD:
        assert expected_errors(CASES / name), f"{name} marks no expected error"
    assert not expected_errors(CASES / "ok_public_api.py")


@pytest.mark.timeout(600)
def test_a_script_over_the_whole_public_surface_passes_strict(mypy_run):
    output, found = mypy_run
    assert "import-not-found" not in output and "import-untyped" not in output, output
    assert "ok_public_api.py" not in found, output


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", BAD)
def test_wrong_uses_fail_with_the_expected_codes(mypy_run, name):
    output, found = mypy_run
    assert found.get(name, {}) == expected_errors(CASES / name), output


def test_the_checker_reads_markers_and_output(tmp_path):
    # the two parsers the tests above rest on: a marker with two codes, a note ignored
    p = tmp_path / "bad_x.py"
    p.write_text("x: int = f()  # E: func-returns-value, assignment\ny = 1\n")
    assert expected_errors(p) == {1: {"func-returns-value", "assignment"}}
    out = ("bad_x.py:1: error: \"f\" does not return a value  [func-returns-value]\n"
           "bad_x.py:1: note: see here\n"
           "/tmp/w/bad_x.py:3: error: Incompatible types  [assignment]\n")
    assert parse_errors(out) == {"bad_x.py": {1: {"func-returns-value"}, 3: {"assignment"}}}


def test_settings_args_names_every_keyword_setting():
    # Server(**settings: Unpack[SettingsArgs]): the TypedDict type checkers read must name
    # each Settings field that is a keyword setting (framing, ssl and handshake_timeout are
    # Server's own parameters), so none is refused by mypy and accepted at run time
    from aoprim.server.config import Settings, SettingsArgs
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert set(SettingsArgs.__annotations__) == fields - {"framing", "ssl", "handshake_timeout"}
