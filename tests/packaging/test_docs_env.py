"""Every ``AOPRIM_*`` environment variable the docs name is one the code reads.

A documented variable that no code reads -- say, an ``AOPRIM_AIO_PURE=1`` pure-Python fallback
in docs/aio-compiled.md -- is a promise a user would set and silently not get.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bAOPRIM_[A-Z0-9_]+\b")
# Where a variable may be read: the package, the build, CI scripts, benchmarks, tests.
READERS = ("aoprim", "bench", "tests", ".ci")
SUFFIXES = {".py", ".pyx", ".pxd", ".sh", ""}


def _names(paths):
    found = set()
    for p in paths:
        if p.is_file():
            found |= set(NAME.findall(p.read_text(errors="replace")))
    return found


def _doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _code_files():
    files = [ROOT / "setup.py"]
    for d in READERS:
        for p in (ROOT / d).rglob("*"):
            # build/ inside the checkout (.ci/sanitize's copy), not a folder of that name
            # above it: the checkout may sit anywhere
            if p.is_file() and p.suffix in SUFFIXES and p.name != "test_docs_env.py" \
                    and "build" not in p.relative_to(ROOT).parts:
                files.append(p)
    return files


def test_every_documented_env_var_is_read_somewhere():
    documented = _names(_doc_files())
    assert documented, "the docs name no AOPRIM_* variable: the scan is broken"
    missing = sorted(documented - _names(_code_files()))
    assert not missing, f"docs name environment variables no code reads: {missing}"
