"""HAProxy in front of test servers (TCP mode, PROXY protocol v2): the configuration, the
start-up and the teardown shared by test_proxy_protocol.py and test_server_tls_peers.py."""
import contextlib
import shutil
import socket
import subprocess
import time

import pytest

from proc_support import free_port

HOST = "127.0.0.1"

needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None,
    reason="haproxy is not installed (apt-get install haproxy; .ci/run does)")


def _config(front, ports):
    servers = "".join(
        f"    server s{i} {HOST}:{port} send-proxy-v2 check inter 300ms check-send-proxy\n"
        for i, port in enumerate(ports, 1))
    return f"""
global
    maxconn 200
defaults
    mode tcp
    timeout connect 2s
    timeout client 20s
    timeout server 20s
frontend fe
    bind {HOST}:{front}
    default_backend be
backend be
    balance roundrobin
{servers}"""


@contextlib.contextmanager
def haproxy_v2(tmp_path, ports):
    """HAProxy forwarding a fresh front port round-robin to the servers on ``ports`` (on
    HOST), each connection preceded by a PROXY v2 header, with a v2 health check (a LOCAL
    header) to each every 300 ms.  Yields (front port, its Popen) once the front accepts
    connections; the test may terminate it early (no more health checks from there on).
    Stopped (killed if it does not stop) on the way out."""
    front = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(_config(front, ports))
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:                 # HAProxy says nothing when it listens: poll its port
            try:
                socket.create_connection((HOST, front), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read() if proc.poll() is not None else b""
                    pytest.fail(f"haproxy did not start: {out.decode(errors='replace')}")
                time.sleep(0.05)
        yield front, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
