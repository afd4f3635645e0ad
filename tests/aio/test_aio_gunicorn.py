"""aoprim.aio.gunicorn without what it needs, and its typing.

Served by a real gunicorn in ``tests/aio/test_aio_servers.py`` (``-k aoprim.aio.gunicorn.Worker``).
Here: importing it without uvicorn-worker, with a uvicorn older than 0.36 (whose loop option
takes no ``module:function`` factory) or a uvicorn-worker older than 0.4 (which builds its loop
with ``Config.setup_event_loop()``, gone in uvicorn 0.36), raises ``ImportError`` saying what
to install; the module passes ``mypy --strict``.
"""
import os
import subprocess
import sys

import pytest

from proc_support import child_env

pytestmark = pytest.mark.timeout(120)


def _import_in_child(tmp_path, prelude):
    code = prelude + "\nimport aoprim.aio.gunicorn\n"
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=60)


def test_without_uvicorn_worker_the_import_says_what_to_install(tmp_path):
    p = _import_in_child(tmp_path, "import sys; sys.modules['uvicorn_worker'] = None")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: aoprim.aio.gunicorn.Worker needs gunicorn, "
                           "uvicorn-worker >= 0.4 and uvicorn >= 0.36"), p.stderr
    assert "pip install gunicorn 'uvicorn-worker>=0.4'" in last


def test_with_a_uvicorn_before_036_the_import_says_which_version(tmp_path):
    pytest.importorskip("uvicorn", reason="uvicorn is not installed")
    pytest.importorskip("uvicorn_worker", reason="uvicorn-worker is not installed")
    # uvicorn 0.35's Config has setup_event_loop() and no get_loop_factory()
    p = _import_in_child(tmp_path, "import uvicorn.config\n"
                                   "del uvicorn.config.Config.get_loop_factory")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "needs uvicorn >= 0.36" in last and "this is uvicorn " in last, p.stderr


def test_with_a_uvicorn_worker_before_04_the_import_says_which_version(tmp_path):
    pytest.importorskip("uvicorn_worker", reason="uvicorn-worker is not installed")
    # uvicorn-worker 0.3 builds its loop with Config.setup_event_loop(), gone in uvicorn 0.36
    p = _import_in_child(tmp_path, "import uvicorn_worker\n"
                                   "uvicorn_worker.__version__ = '0.3.0'")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "needs uvicorn-worker >= 0.4" in last and "this is uvicorn-worker 0.3.0" in last, \
        p.stderr


def test_the_worker_class_names_aoprims_loop_factory():
    pytest.importorskip("uvicorn_worker", reason="uvicorn-worker is not installed")
    import aoprim.aio
    import aoprim.aio.gunicorn as g
    from uvicorn.config import Config
    from uvicorn_worker import UvicornWorker
    assert issubclass(g.Worker, UvicornWorker)
    assert g.Worker.CONFIG_KWARGS["loop"] == "aoprim.aio:new_event_loop"
    # uvicorn resolves the option to aoprim's factory itself
    assert Config(app=None, **g.Worker.CONFIG_KWARGS).get_loop_factory() \
        is aoprim.aio.new_event_loop


def test_mypy_strict_is_clean(tmp_path):
    pytest.importorskip("uvicorn_worker", reason="uvicorn-worker is not installed")
    pytest.importorskip("mypy", reason="mypy is not installed")
    import aoprim
    env = dict(os.environ)
    parent = os.path.dirname(os.path.dirname(os.path.abspath(aoprim.__file__)))
    if os.path.basename(parent) not in ("site-packages", "dist-packages"):
        # an in-tree or editable build: mypy does not see import hooks, so point it there
        env["MYPYPATH"] = parent
    # by module name (a file path inside site-packages would make that a source root); only
    # this module's own errors: the modules it imports are checked by their own tests
    p = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
                        "-m", "aoprim.aio.gunicorn"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout + p.stderr
