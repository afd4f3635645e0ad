"""Real ASGI servers on aoprim.aio, started as users start them, in a subprocess.

- ``uvicorn app:app --loop aoprim.aio:new_event_loop`` (uvicorn >= 0.36 imports a
  ``module:function`` loop factory), and the same command with ``--loop asyncio`` as the
  baseline: every check below must pass on both.
- ``gunicorn app:app -k aoprim.aio.gunicorn.Worker``: aoprim's gunicorn worker class
  (uvicorn-worker's ``UvicornWorker`` with uvicorn's loop option set to aoprim.aio's loop
  factory).  The child also reports its pid and parent pid: the app runs in a worker
  process whose parent is the gunicorn master this test started.
- hypercorn takes no loop factory: its ``-k`` worker classes are only ``asyncio``, ``uvloop``
  and ``trio``.  Two ways work, both run here: its documented programmatic entry point,
  ``hypercorn.asyncio.serve(app, config)``, runs on whatever loop is running, so
  ``aoprim.aio.run(serve(app, config))`` (a loop factory: no policy); and the CLI
  (``hypercorn app_installed:app``) with ``aoprim.aio.install()`` at the top of the app
  module, which hypercorn imports before it makes its loop through asyncio's policy.
- granian (a Rust server) is covered by ``tests/aio/test_aio_granian.py``.

The application is a small Starlette app written into ``tmp_path``; each server runs with
``cwd=tmp_path`` (the checkout's ``aoprim/`` folder, which has no compiled extensions, can
never shadow the package under test) and ``proc_support.child_env()`` (the child imports the
same aoprim build as this process).  Each server is started plain and under TLS (a
self-signed certificate made with the ``openssl`` CLI; TLS cases skip if it is absent), and
is ready when its log names the port it listens on (``--port 0``), and must exit with
status 0 on SIGTERM.  The child reports which
loop it really runs (``type(asyncio.get_running_loop())``) and, on aoprim.aio, that its
FlushGroup made the sends.

Driven: keep-alive requests with bodies of up to 8 MiB both ways, 100 pipelined requests in
one send, a server-sent-events stream (3,000 events of mixed sizes, all in order), a
websocket (1,000 messages in flight, 1 MiB binary messages).  A server's log must show no
traceback, and it must stop on SIGTERM.
"""
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time

import pytest

from proc_support import HOST, child_env

pytestmark = pytest.mark.timeout(120)

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

APP = r'''
import asyncio
import os

from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute


def pattern(n):
    """n bytes that are not all alike: a misplaced chunk would show."""
    block = bytes(range(251))                   # 251 is prime: chunks of 2**k never line up
    return (block * (n // 251 + 1))[:n]


async def loop_info(request):
    loop = asyncio.get_running_loop()
    stats = dict(loop.flush_stats()) if hasattr(loop, "flush_stats") else None
    return JSONResponse({"module": type(loop).__module__, "name": type(loop).__qualname__,
                         "stats": stats, "pid": os.getpid(), "ppid": os.getppid()})


async def hello(request):
    return PlainTextResponse("hello " + request.path_params["name"])


async def echo(request):
    return Response(await request.body(), media_type="application/octet-stream")


async def big(request):
    return Response(pattern(int(request.query_params["n"])),
                    media_type="application/octet-stream")


def event(i):
    return "id: %d\ndata: %d %s\n\n" % (i, i, "x" * (i % 7 * 1000))


async def sse(request):
    n = int(request.query_params["n"])

    async def events():
        for i in range(n):
            yield event(i)
            if i % 50 == 0:
                await asyncio.sleep(0)          # let the loop flush between bursts
    return StreamingResponse(events(), media_type="text/event-stream")


async def ws(websocket):
    await websocket.accept()
    while True:
        msg = await websocket.receive()
        if msg["type"] == "websocket.disconnect":
            return
        if msg.get("text") is not None:
            await websocket.send_text(msg["text"])
        else:
            await websocket.send_bytes(msg["bytes"])


app = Starlette(routes=[
    Route("/loop", loop_info),
    Route("/hello/{name}", hello),
    Route("/echo", echo, methods=["POST"]),
    Route("/big", big),
    Route("/sse", sse),
    WebSocketRoute("/ws", ws),
])
'''

# hypercorn's CLI imports the app module, then makes its loop through asyncio's policy
APP_INSTALLED = r'''
import aoprim.aio

aoprim.aio.install()

from app import app  # noqa: E402
'''

HYPERCORN = r'''
import asyncio
import sys

import aoprim.aio
from hypercorn.asyncio import serve
from hypercorn.config import Config

from app import app

config = Config()
config.bind = ["127.0.0.1:0"]
config.errorlog = "-"
config.accesslog = None
if len(sys.argv) > 2:
    config.certfile, config.keyfile = sys.argv[2], sys.argv[3]
run = {"aoprim": aoprim.aio.run, "asyncio": asyncio.run}[sys.argv[1]]
run(serve(app, config))
'''

READY = re.compile(r"(?:Uvicorn running on|Running on|Listening at:) https?://127\.0\.0\.1:(\d+)")

# (server, loop): the loop the test asks the server for
SERVERS = [("uvicorn", "aoprim"), ("uvicorn", "asyncio"), ("gunicorn", "aoprim"),
           ("hypercorn", "aoprim"), ("hypercorn-cli", "aoprim")]
LOOP_CLASS = {"aoprim": ("aoprim.aio.loop", "Loop"),
              "asyncio": ("asyncio.unix_events", "_UnixSelectorEventLoop")}


def pattern(n):
    block = bytes(range(251))
    return (block * (n // 251 + 1))[:n]


def event(i):
    return "id: %d\ndata: %d %s\n\n" % (i, i, "x" * (i % 7 * 1000))


class Served:
    """A server subprocess; ``port``, ``scheme``, ``ssl`` (a client context or None)."""

    def __init__(self, cmd, cwd, tls_ctx, timeout=60):
        self.log_path = cwd / f"server-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w+")
        self.p = subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdin=subprocess.DEVNULL,
                                  stdout=self._log, stderr=subprocess.STDOUT)
        self.ssl = tls_ctx
        self.scheme = "https" if tls_ctx else "http"
        deadline = time.monotonic() + timeout
        while True:                        # ready when the log names the port it listens on
            m = READY.search(self.log())
            if m:
                self.port = int(m.group(1))
                break
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not start: {cmd}\n{self.log()[-4000:]}")
            time.sleep(0.02)               # polling the log file, not a guess at a duration
        self.base = f"{self.scheme}://{HOST}:{self.port}"

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout=30):
        """SIGTERM; return the process's exit code (killed after ``timeout`` s: None)."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
            return None
        finally:
            self._log.close()


def make_cert(tmp):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl CLI is absent: no certificate for the TLS cases")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    if not cert.exists():
        subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True, timeout=60)
    return key, cert


def command(server, loop, tls):
    py = sys.executable
    if server == "uvicorn":
        cmd = [py, "-m", "uvicorn", "app:app", "--loop",
               "aoprim.aio:new_event_loop" if loop == "aoprim" else "asyncio",
               "--host", HOST, "--port", "0", "--no-access-log"]
        if tls:
            cmd += ["--ssl-keyfile", str(tls[0]), "--ssl-certfile", str(tls[1])]
    elif server == "gunicorn":
        cmd = [py, "-m", "gunicorn", "app:app", "-k", "aoprim.aio.gunicorn.Worker", "-w", "1",
               "-b", f"{HOST}:0"]
        if tls:
            cmd += ["--keyfile", str(tls[0]), "--certfile", str(tls[1])]
    elif server == "hypercorn-cli":
        cmd = [py, "-m", "hypercorn", "app_installed:app", "--bind", f"{HOST}:0"]
        if tls:
            cmd += ["--keyfile", str(tls[0]), "--certfile", str(tls[1])]
    else:
        cmd = [py, "hc.py", loop] + ([str(tls[1]), str(tls[0])] if tls else [])
    return cmd


@pytest.fixture(scope="module")
def appdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("asgi")
    (d / "app.py").write_text(APP)
    (d / "hc.py").write_text(HYPERCORN)
    (d / "app_installed.py").write_text(APP_INSTALLED)
    return d


@pytest.fixture(scope="module", params=[(s, lp, tls) for s, lp in SERVERS
                                        for tls in ("plain", "tls")],
                ids=lambda p: "-".join(p))
def server(request, appdir):
    name, loop, tls = request.param
    if name == "gunicorn":
        pytest.importorskip("gunicorn", reason="gunicorn is not installed")
        pytest.importorskip("uvicorn_worker", reason="uvicorn-worker is not installed: "
                            "aoprim.aio.gunicorn.Worker builds on it")
    if name.startswith("hypercorn"):
        pytest.importorskip("hypercorn", reason="hypercorn is not installed")
    ctx = files = None
    if tls == "tls":
        files = make_cert(appdir)
        ctx = ssl.create_default_context(cafile=str(files[1]))
    s = Served(command(name, loop, files), appdir, ctx)
    s.loop = loop
    s.name = name
    s.cafile = str(files[1]) if files else None
    try:
        yield s
    finally:
        rc = s.stop()
        log = s.log()
        # uvicorn re-raises the signal it caught once its graceful shutdown is done (on every
        # loop): its clean exit is death by SIGTERM after "Finished server process"
        clean = ((0, -signal.SIGTERM) if name == "uvicorn" and "Finished server process" in log
                 else (0,))
        assert rc in clean, f"{name} did not stop cleanly on SIGTERM (exit {rc}):\n{log[-4000:]}"
        assert "Traceback" not in log, log[-8000:]


def client(server):
    return httpx.Client(base_url=server.base, verify=server.ssl or False, timeout=30)


def test_the_loop_is_the_one_asked_for(server):
    with client(server) as c:
        for _ in range(3):
            c.get("/hello/x")
        info = c.get("/loop").json()
    assert (info["module"], info["name"]) == LOOP_CLASS[server.loop]
    if server.loop == "aoprim":
        # the responses above went out through the loop's FlushGroup
        assert info["stats"]["syscalls"] > 0 and info["stats"]["bytes"] > 0
    if server.name == "gunicorn":
        # served inside a gunicorn worker: a child of the master process this test started
        assert info["ppid"] == server.p.pid != info["pid"]


def test_keep_alive_requests(server):
    with client(server) as c:
        for i in range(50):
            r = c.get(f"/hello/n{i}")
            assert (r.status_code, r.text) == (200, f"hello n{i}")
        for n in (0, 1, 1000, 65_536, 1 << 20, 3 << 20 | 7):
            body = pattern(n)[::-1]
            r = c.post("/echo", content=body)
            assert r.status_code == 200 and r.content == body, n
        r = c.get("/big", params={"n": 8 << 20})
        assert r.content == pattern(8 << 20)


def _connect(server):
    raw = socket.create_connection((HOST, server.port), timeout=30)
    if server.ssl:
        return server.ssl.wrap_socket(raw, server_hostname=HOST)
    return raw


def _read_response(sock, buf):
    """One HTTP/1.1 response with a Content-Length from ``sock``: (status, body, rest)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"EOF inside a header: {bytes(buf[:200])!r}"
        buf += chunk
    head, _, buf = bytes(buf).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = next(int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:])
                  if k.strip().lower() == b"content-length")
    buf = bytearray(buf)
    while len(buf) < length:
        chunk = sock.recv(65536)
        assert chunk, "EOF inside a body"
        buf += chunk
    return status, bytes(buf[:length]), buf[length:]


def test_pipelined_requests(server):
    reqs, want = [], []
    for i in range(100):
        if i % 3 == 2:
            body = pattern(500 * i)
            reqs.append(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
                        % len(body) + body)
            want.append(body)
        else:
            reqs.append(b"GET /hello/p%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
            want.append(b"hello p%d" % i)
    with _connect(server) as s:
        s.sendall(b"".join(reqs))          # all 100 in one send: the server reads ahead
        buf = bytearray()
        for i, body in enumerate(want):
            status, got, buf = _read_response(s, buf)
            assert (status, got) == (200, body), i
        assert not buf


def test_server_sent_events_arrive_in_order(server):
    n = 3000
    with client(server) as c, c.stream("GET", "/sse", params={"n": n}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = b"".join(r.iter_bytes())
    assert got == "".join(event(i) for i in range(n)).encode()


def test_websocket_echo(server):
    from websockets.sync.client import connect
    url = f"{'wss' if server.ssl else 'ws'}://{HOST}:{server.port}/ws"
    ctx = server.ssl
    if ctx is not None:
        # TLS 1.2 for this client: websockets' sync client reads the socket on its own
        # thread while the caller's thread writes the upgrade request, and one OpenSSL
        # connection must not be used by two threads at once.  With TLS 1.3 the server's
        # session tickets arrive in that window: a few connects in a thousand lose the
        # request, and the server closes the connection at its keep-alive timeout or never
        # answers (on asyncio's own loop as on aoprim.aio, and more often on a free-threaded
        # build; none with TLS 1.2, or with no tickets)
        ctx = ssl.create_default_context(cafile=server.cafile)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with connect(url, ssl=ctx, max_size=4 << 20, open_timeout=30,
                 close_timeout=30) as w:
        for i in range(1000):                  # all in flight before the first reply is read
            w.send(f"m{i}")
        for i in range(1000):
            assert w.recv(timeout=30) == f"m{i}"
        big = pattern(1 << 20)
        for k in range(3):
            w.send(big[k:] + big[:k])
            assert w.recv(timeout=30) == big[k:] + big[:k]
        w.send(b"")
        assert w.recv(timeout=30) == b""
