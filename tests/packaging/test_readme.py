"""The README stays true: every fenced ```python block in it is marked runnable and runs.

A runnable block is a fenced ```python block right after a marker line:

    <!-- runnable -->                          run it
    <!-- runnable: file=mymod.py -->           also save it as mymod.py, importable by the
                                               blocks after it (and run it)
    <!-- runnable: requires=aiohttp,aoprim.aio -->   skip (saying why) when one of these
                                               modules cannot be imported here
    <!-- runnable: timeout=300 -->             seconds it may take (default 60)

Each block runs as its own test (id: its position and the README heading above it), in a
fresh Python process, as a script in an empty folder (so the checkout cannot shadow the
package) against the aoprim that this test run imports, bounded in time: a snippet that
starts a server must stop it itself.  It passes when it exits 0, writes nothing at all to
stderr (an exception an event loop logs and carries on from, a warning: what a newcomer would
see is a failure), and prints what it says.  A line ``print(...)  # TEXT`` says what it prints:
the output line must be TEXT, or TEXT must start with the output line and ": " (a comment
after the value).  Prints without such a comment may print anything.
"""
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

import aoprim

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<opts>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
PRINT = re.compile(r"^\s*print\(.*\)\s*#\s?(?P<expect>.*?)\s*$")
DEFAULT_TIMEOUT = 60.0
MAX_LINES = 250

# Links to files another branch adds: checked once they exist (delete the entry on merge).
WRITTEN_ELSEWHERE = {"docs/aio.md": "written on the aio branch"}


@dataclass
class Snippet:
    line: int                  # 1-based line of the opening fence
    heading: str
    code: str
    marked: bool
    opts: dict = field(default_factory=dict)

    @property
    def id(self):
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")[:40]
        return f"L{self.line}-{slug}"


def parse(text):
    """Every fenced python block of a Markdown text, with its marker's options."""
    out = []
    lines = text.splitlines()
    heading = "top"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        m = FENCE.match(line)
        if m and m.group("lang"):
            start = i
            i += 1
            body = []
            while i < len(lines) and not FENCE.match(lines[i]):
                body.append(lines[i])
                i += 1
            if m.group("lang") == "python":
                mark = MARKER.match(lines[start - 1]) if start > 0 else None
                opts = {}
                if mark and mark.group("opts"):
                    for item in mark.group("opts").split():
                        key, _, value = item.partition("=")
                        opts[key] = value
                out.append(Snippet(start + 1, heading, "\n".join(body) + "\n",
                                   bool(mark), opts))
        i += 1
    return out


def expected_output(code):
    """What each `print(...)  # TEXT` line of a snippet says it prints (None: anything)."""
    expect = []
    for line in code.splitlines():
        if re.match(r"^\s*print\(", line):
            m = PRINT.match(line)
            expect.append(m.group("expect") if m else None)
    return expect


def output_matches(expect, out_lines):
    if len(expect) != len(out_lines):
        return False
    for want, got in zip(expect, out_lines):
        if want is None:
            continue
        if want != got and not want.startswith(got + ": "):
            return False
    return True


def run_snippet(snippet, earlier, workdir):
    """Run one snippet as a script in workdir, after saving the `file=` snippets before it.
    Returns None when it ran as the README says, else a message saying what went wrong."""
    workdir = pathlib.Path(workdir)
    for s in earlier:
        if "file" in s.opts:
            (workdir / s.opts["file"]).write_text(s.code)
    script = workdir / "_snippet.py"
    script.write_text(snippet.code)
    env = dict(os.environ)
    # the aoprim this test run imports (installed, or an in-place build on purpose)
    pkg_parent = str(pathlib.Path(aoprim.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    # aoprim.cybuild's cache of built modules: in the test's folder, not the user's ~/.cache
    env["AOPRIM_CYBUILD_CACHE"] = str(workdir / ".cybuild-cache")
    timeout = float(snippet.opts.get("timeout", DEFAULT_TIMEOUT))
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        return f"did not finish within {timeout:g} s (stdout: {e.stdout!r})"
    if proc.returncode != 0:
        return f"exited {proc.returncode}\n--- stderr:\n{proc.stderr}\n--- stdout:\n{proc.stdout}"
    if proc.stderr:
        # a traceback logged by the event loop, a warning, a compiler's complaint: a newcomer
        # who runs the snippet sees it, so it is a failure even when the exit status is 0
        return f"wrote to stderr\n--- stderr:\n{proc.stderr}\n--- stdout:\n{proc.stdout}"
    expect = expected_output(snippet.code)
    got = proc.stdout.splitlines()
    if not output_matches(expect, got):
        return f"printed {got!r}, the README says {expect!r}\n--- stderr:\n{proc.stderr}"
    return None


SNIPPETS = parse(README.read_text())
RUNNABLE = [s for s in SNIPPETS if s.marked]


def _missing(modules):
    for name in modules:
        try:
            __import__(name)
        except ImportError as e:
            return f"{name}: {e}"
    return None


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_readme_snippet_runs(snippet, tmp_path, request):
    requires = [m for m in snippet.opts.get("requires", "").split(",") if m]
    why = _missing(requires)
    if why:
        pytest.skip(f"needs {why}")
    timeout = float(snippet.opts.get("timeout", DEFAULT_TIMEOUT))
    request.node.add_marker(pytest.mark.timeout(timeout + 30))
    earlier = [s for s in RUNNABLE if s.line < snippet.line]
    problem = run_snippet(snippet, earlier, tmp_path)
    assert problem is None, f"README.md line {snippet.line}: {problem}"


def test_every_python_block_is_runnable():
    assert len(RUNNABLE) >= 6, "the README's paths in are runnable snippets"
    unmarked = [s.line for s in SNIPPETS if not s.marked]
    assert not unmarked, (f"README.md: python blocks at lines {unmarked} are not marked "
                          "<!-- runnable -->: mark them (and make them run), or fence them "
                          "as another language")


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, "the README is a front door: details go to docs/"
    root = README.parent
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        if target in WRITTEN_ELSEWHERE and not (root / target).exists():
            continue
        assert (root / target).exists(), f"README.md links to {target}, which does not exist"


def test_docs_links_resolve():
    root = README.parent
    for doc in sorted((root / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            path = (doc.parent / target).resolve()
            rel = os.path.relpath(path, root)
            if rel in WRITTEN_ELSEWHERE and not path.exists():
                continue
            assert path.exists(), f"{doc.name} links to {target}, which does not exist"


# -- the harness itself can fail ------------------------------------------------------------

BROKEN = '''\
# t

<!-- runnable -->
```python
raise SystemExit("broken")
```

<!-- runnable -->
```python
print(1 + 1)   # 3
```

<!-- runnable: timeout=2 -->
```python
import time
time.sleep(30)
```

<!-- runnable: file=helper.py -->
```python
VALUE = 42
```

<!-- runnable -->
```python
from helper import VALUE
print(VALUE)   # 42: from the earlier file= snippet
```

<!-- runnable -->
```python
import sys
print("ok")    # ok
print("Exception in callback ...", file=sys.stderr)
```

```python
print("not marked")
```
'''


def test_a_broken_snippet_fails(tmp_path):
    snippets = parse(BROKEN)
    assert [s.marked for s in snippets] == [True, True, True, True, True, True, False]
    runnable = [s for s in snippets if s.marked]
    results = []
    for i, s in enumerate(runnable):
        d = tmp_path / str(i)
        d.mkdir()
        results.append(run_snippet(s, runnable[:i], d))
    assert "exited 1" in results[0] and "broken" in results[0]
    assert "printed ['2'], the README says ['3']" in results[1]
    assert "did not finish within 2 s" in results[2]
    assert results[3] is None
    assert results[4] is None
    assert "wrote to stderr" in results[5] and "Exception in callback" in results[5]


def test_expected_output_rules():
    code = textwrap.dedent("""\
        print(x)          # 0: back in the pool
        print(y)
        print(z)  # b'ping'
        """)
    assert expected_output(code) == ["0: back in the pool", None, "b'ping'"]
    assert output_matches(["0: back in the pool", None, "b'ping'"], ["0", "anything", "b'ping'"])
    assert not output_matches(["0: back in the pool"], ["1"])
    assert not output_matches(["499500"], ["4"])
    assert not output_matches(["1"], ["1", "2"])
