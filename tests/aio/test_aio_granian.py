"""granian (a Rust HTTP server for Python apps) and aoprim.aio: what works, what does not.

granian's Rust runtime accepts the connections and does the socket reads and writes; the
Python event loop of a worker only runs the application's coroutines.  So aoprim.aio's
batched transports are never used under granian: running the app on aoprim's loop is
possible in one way, but gains nothing.

- ``granian --loop`` takes only its own names (auto, asyncio, rloop, uvloop, winloop):
  ``--loop aoprim.aio:new_event_loop`` is refused.
- ``aoprim.aio.install()`` at the top of the app module has no effect with the CLI: a
  granian worker process builds its loop (``--loop asyncio``: ``asyncio.new_event_loop()``)
  before it imports the application, so the policy is set too late.
- granian's embedded server (``granian.server.embed.Server``, which granian marks
  experimental) serves on the running loop: ``aoprim.aio.run(server.serve())`` runs the app on
  aoprim's loop.  Its shutdown sometimes ends in a Rust panic message on asyncio's own loop
  too, so only the exit status is checked there.

Each server is a subprocess on a free port this test picks (granian logs the port it was
given, not the one bound), run with ``cwd=tmp_path`` and ``proc_support.child_env()``.
"""
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from proc_support import HOST, child_env

pytest.importorskip("granian", reason="granian is not installed")

pytestmark = pytest.mark.timeout(120)

APP = r'''
import asyncio
import json
import os

if os.environ.get("APP_CALLS_INSTALL"):
    import aoprim.aio
    aoprim.aio.install()


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    loop = asyncio.get_running_loop()
    body = json.dumps({"loop": [type(loop).__module__, type(loop).__qualname__],
                       "path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
'''

EMBED = r'''
import asyncio
import signal
import sys

import aoprim.aio
from granian.server.embed import Server

from app import app


async def main():
    server = Server(app, interface="asgi", address="127.0.0.1", port=int(sys.argv[1]))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, server.stop)
    await server.serve()

aoprim.aio.run(main())
'''

AOPRIM = ["aoprim.aio.loop", "Loop"]


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture
def appdir(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "embed.py").write_text(EMBED)
    return tmp_path


def serve(cmd, cwd, port, env_extra=None, n=20):
    """Start ``cmd``, GET /r0 .. /r{n-1} on ``port`` once it answers, SIGTERM it; return
    (the responses' JSON, exit status, log)."""
    env = child_env()
    env.update(env_extra or {})
    with open(cwd / "server.log", "w+") as log:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:                    # ready when a connection is accepted
                try:
                    socket.create_connection((HOST, port), timeout=5).close()
                    break
                except OSError:
                    if p.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise AssertionError(f"{cmd} did not start:\n{log.read()[-4000:]}")
                    time.sleep(0.05)       # polling for the listening socket
            got = []
            for i in range(n):
                with urllib.request.urlopen(f"http://{HOST}:{port}/r{i}", timeout=30) as r:
                    got.append(json.loads(r.read()))
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
                rc = None
        log.seek(0)
        return got, rc, log.read()


def test_granian_loop_option_refuses_a_loop_factory(appdir):
    p = subprocess.run([sys.executable, "-m", "granian", "--interface", "asgi", "--loop",
                        "aoprim.aio:new_event_loop", "app:app"], cwd=appdir, env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "Invalid value for '--loop'" in p.stderr, p.stderr


def test_install_in_the_app_module_comes_too_late_for_granians_worker(appdir):
    port = free_port()
    got, rc, log = serve([sys.executable, "-m", "granian", "--interface", "asgi", "--loop",
                          "asyncio", "--host", HOST, "--port", str(port), "app:app"],
                         appdir, port, {"APP_CALLS_INSTALL": "1"})
    assert [g["path"] for g in got] == [f"/r{i}" for i in range(20)]
    # the worker's loop was made before the app module (and its install()) was imported
    assert {tuple(g["loop"]) for g in got} == {("asyncio.unix_events", "_UnixSelectorEventLoop")}
    assert rc == 0, log[-4000:]


def test_embedded_server_under_aoprim_run_serves_on_aoprims_loop(appdir):
    port = free_port()
    got, rc, log = serve([sys.executable, "embed.py", str(port)], appdir, port)
    assert [g["path"] for g in got] == [f"/r{i}" for i in range(20)]
    assert all(g["loop"] == AOPRIM for g in got), got
    assert rc == 0, log[-4000:]
