"""The command line: ``python -m aoprim serve ...`` and ``python -m aoprim loadgen ...``.

``serve`` prints ``listening on HOST:PORT`` (one line, flushed) once it accepts connections,
logs lifecycle and close reasons to stderr, and on SIGINT/SIGTERM shuts down cleanly (flushes
what is pending), prints one ``stats {...}`` JSON line and exits 0 with no traceback.

``--procs N`` runs N server processes on one port (``SO_REUSEPORT``: the kernel spreads the
connections over them).  The parent reserves the port, starts the children, supervises them
(a child that dies is restarted) and forwards SIGINT/SIGTERM to them.
"""
import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from aoprim.tools import loadgen
from .apps import APPS
from .framing import FRAMINGS
from .loop import BACKENDS, BackendUnavailable
from .session import Server

log = logging.getLogger("aoprim.server")


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop()


def _seconds_or_none(v):
    if v.lower() in ("none", "0", "off"):
        return None
    x = float(v)
    if x <= 0:
        raise argparse.ArgumentTypeError("must be > 0 (or 'none')")
    return x


def build_parser():
    p = argparse.ArgumentParser(prog="python -m aoprim")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the server with a built-in app")
    s.add_argument("--app", choices=sorted(APPS), default="echo")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8888)
    s.add_argument("--framing", choices=FRAMINGS, default="raw")
    s.add_argument("--workers", type=int, default=0, help="on_read worker threads (0: loop)")
    s.add_argument("--procs", type=int, default=1, help="server processes (SO_REUSEPORT)")
    s.add_argument("--max-frame", type=int, default=65536)
    s.add_argument("--idle-timeout", type=_seconds_or_none, default=None)
    s.add_argument("--frame-timeout", type=_seconds_or_none, default=30.0)
    s.add_argument("--max-connections", type=int, default=10000)
    s.add_argument("--max-pending", type=int, default=4 << 20)
    s.add_argument("--backend", choices=BACKENDS, default="selectors")
    s.add_argument("--log-level", default="INFO")
    s.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    lg = sub.add_parser("loadgen", help="echo load generator")
    loadgen.build_parser(lg)
    return p


def _serve_one(a):
    kw = dict(framing=a.framing, max_frame=a.max_frame, max_connections=a.max_connections,
              max_pending=a.max_pending, idle_timeout=a.idle_timeout,
              frame_timeout=a.frame_timeout, workers=a.workers, backend=a.backend,
              reuse_port=a.reuse_port)
    srv = Server(APPS[a.app](), a.host, a.port, **kw)
    host, port = srv.address
    print(f"listening on {host}:{port}", flush=True)
    srv.serve_forever()
    print("stats " + json.dumps(srv.stats()), flush=True)
    return 0


def _serve_procs(a):
    """Parent of --procs N: reserve the port, start and supervise the children."""
    infos = socket.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    reserve = socket.socket(family, socket.SOCK_STREAM)
    reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserve.bind(addr)                  # bound, never listening: it only holds the port
    host, port = reserve.getsockname()[:2]
    argv = [sys.executable, "-m", "aoprim", "serve", "--app", a.app, "--host", a.host,
            "--port", str(port), "--framing", a.framing, "--workers", str(a.workers),
            "--max-frame", str(a.max_frame), "--idle-timeout", str(a.idle_timeout),
            "--frame-timeout", str(a.frame_timeout), "--max-connections",
            str(a.max_connections), "--max-pending", str(a.max_pending), "--backend",
            a.backend, "--log-level", a.log_level, "--reuse-port"]
    stopping = threading.Event()
    children = {}

    def relay(proc, ready):
        for line in proc.stdout:
            if line.startswith("listening on"):
                ready.set()
            else:
                sys.stdout.write(line)
                sys.stdout.flush()
        ready.set()

    def spawn(i):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        ready = threading.Event()
        t = threading.Thread(target=relay, args=(proc, ready), daemon=True)
        t.start()
        children[i] = (proc, t)
        return ready

    def on_signal(signum, frame):
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    readies = [spawn(i) for i in range(a.procs)]
    for r in readies:
        r.wait(30)
    reserve.close()
    print(f"listening on {host}:{port}", flush=True)
    log.info("supervising %d server processes on %s:%s", a.procs, host, port)
    rc = 0
    while not stopping.is_set():
        stopping.wait(0.2)
        for i, (proc, t) in list(children.items()):
            if proc.poll() is not None and not stopping.is_set():
                log.error("server process %d exited with %s: restarting it", proc.pid,
                          proc.returncode)
                time.sleep(0.5)
                spawn(i)
    for proc, _ in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc, t in children.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("server process %d did not stop: killing it", proc.pid)
            proc.kill()
            proc.wait()
        t.join(5)
        if proc.returncode != 0:
            rc = 1
    return rc


def main(argv=None):
    # until the server installs its own handlers, SIGINT/SIGTERM end the process quietly
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "loadgen":
            signal.signal(signal.SIGINT, signal.default_int_handler)
            return loadgen.main(a)
        logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        if a.procs < 1:
            print("--procs must be >= 1", file=sys.stderr)
            return 2
        if a.procs > 1:
            return _serve_procs(a)
        return _serve_one(a)
    except (_Stop, KeyboardInterrupt):
        return 0
    except (ValueError, TypeError, OSError, BackendUnavailable) as e:
        print(f"aoprim: {e}", file=sys.stderr)
        return 2
