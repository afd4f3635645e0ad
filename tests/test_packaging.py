"""The package metadata says what is true (issue 22): the licence is the LICENSE file's, and
the Pythons it claims are the ones requires-python admits, the release wheels are built for
and CI runs the suite on."""
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"

pytestmark = pytest.mark.skipif(not PYPROJECT.is_file(), reason="no pyproject.toml beside tests/")


@pytest.fixture(scope="module")
def meta():
    return tomllib.loads(PYPROJECT.read_text())


def _python_classifiers(project):
    return sorted(c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                  if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))


def test_licence_is_mit_and_shipped(meta):
    project = meta["project"]
    # the table form: setuptools 64-76 refuse PEP 639's `license = "MIT"`, and an in-place
    # build uses whatever setuptools the environment has (Python 3.11's venvs: 65.5)
    assert project["license"] == {"text": "MIT"}
    assert "License :: OSI Approved :: MIT License" in project["classifiers"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "setuptools>=64" in meta["build-system"]["requires"]


def test_descriptive_metadata(meta):
    project = meta["project"]
    assert project["authors"] == [{"name": "aoprim developers"}]
    assert project["keywords"]
    for c in ("Programming Language :: Cython", "Framework :: AsyncIO",
              "Topic :: System :: Networking", "Operating System :: POSIX :: Linux",
              "Programming Language :: Python :: 3 :: Only"):
        assert c in project["classifiers"]
    assert [c for c in project["classifiers"] if c.startswith("Development Status :: ")]


def test_supported_pythons_agree(meta):
    # the version classifiers, requires-python, cibuildwheel's build list and the versions
    # .ci/run runs the suite on name the same Pythons
    versions = _python_classifiers(meta["project"])
    assert versions == ["3.11", "3.12", "3.13"]
    assert meta["project"]["requires-python"] == f">={versions[0]}"
    wheels = sorted(b.split("-")[0] for b in meta["tool"]["cibuildwheel"]["build"])
    assert wheels == ["cp" + v.replace(".", "") for v in versions]
    ci_run = ROOT / ".ci" / "run"
    if not ci_run.is_file():
        pytest.skip("no .ci/run here (an unpacked sdist ships no CI scripts)")
    ci = ci_run.read_text()
    m = re.search(r"^VERSIONS=\(([^)]*)\)", ci, re.M)
    assert m and m.group(1).split() == versions
