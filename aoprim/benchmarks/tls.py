"""The ``tls`` groups: echo servers speaking TLS, aoprim's server beside asyncio's
``create_server(ssl=...)``, uvloop's and aoprim.aio's, every server in its own fresh process.

Scenarios (``SCENARIOS``):
  tls-u16-64x16-10  u16-framed 64 B messages pipelined 16 deep on 10 connections; the baseline
                    servers write every frame with its own ``transport.write`` (as in the
                    plain u16 group), so each frame becomes its own TLS record there
  tls-raw-1k-10     raw 1 KiB ping-pong on 10 connections
  tls-handshake     4 client threads, each in a loop: connect, full TLS 1.3 handshake (no
                    resumption), one 64 B u16 request and its reply, close_notify, close.
                    The figure is server CPU per handshake; "msgs/s" is handshakes/s

Figures per run (``run_one``), besides the load's messages/s, latency p50/p99 and the
server's CPU per message (user+sys from /proc/PID/stat over the measured window) and its
minor page faults per message (the same file):
``records_per_msg`` -- TLS records the server sent per message (every record header in the
server-to-client byte stream is counted, handshake and session-ticket records included) --
and ``wire_bytes_per_msg`` -- server-to-client bytes on the wire (ciphertext, record headers
and tags) per message.  ``syscalls_per_msg`` with ``perf``, as in the plain server groups.

The key and certificate (ECDSA P-256, self-signed, for 127.0.0.1) are made once per run with
``openssl req`` (or the ``cryptography`` package when there is no ``openssl`` binary); every
server loads them into ``ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)``.  The client
(``python tls.py load ...``, this file run by path) speaks TLS through ``ssl.MemoryBIO`` so
that it sees the records on the wire; it does not verify the certificate (that cost is the
client's, not the server's), and the handshake scenario pins TLS 1.3.

Besides the standard library this module imports only ``servers`` and the load generator's
``proc_cpu`` and ``_percentile`` (aoprim.tools.loadgen), so it also runs by path.
"""
import argparse
import atexit
import json
import os
import select
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

from aoprim.tools.loadgen import _percentile, proc_cpu

try:
    from . import servers
except ImportError:                    # run by path: the load client needs none of it
    servers = None

__all__ = ["SCENARIOS", "TITLES", "certs", "server_cmd", "warm_up",
           "run_one", "load_echo", "load_handshakes"]

HERE = os.path.dirname(os.path.abspath(__file__))
HOST = "127.0.0.1"

SCENARIOS = {
    "tls-u16-64x16-10": dict(mode="echo", framing="u16", size=64, conns=10, pipeline=16),
    "tls-raw-1k-10": dict(mode="echo", framing="raw", size=1024, conns=10, pipeline=1),
    "tls-handshake": dict(mode="handshake", framing="u16", size=64, conns=4, pipeline=1),
}
TITLES = {
    "tls-u16-64x16-10": "TLS: u16-framed 64 B messages pipelined 16 deep, 10 connections "
                        "(one reply per frame)",
    "tls-raw-1k-10": "TLS: raw ping-pong echo, 1 KiB, 10 connections",
    "tls-handshake": "TLS 1.3 handshakes: new connection, one 64 B request, close "
                     "(4 client threads; msgs/s = handshakes/s)",
}

_CERTS = {}


# -- certificates -----------------------------------------------------------------------------

def certs():
    """(certfile, keyfile) of a self-signed ECDSA P-256 certificate for 127.0.0.1/localhost,
    made once per process in a temporary directory (removed at exit).  Raises RuntimeError
    when neither ``openssl`` nor the ``cryptography`` package is there to make one."""
    if "pair" in _CERTS:
        return _CERTS["pair"]
    d = tempfile.mkdtemp(prefix="aoprim-bench-tls-")
    atexit.register(shutil.rmtree, d, True)
    cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
    openssl = shutil.which("openssl")
    if openssl:
        r = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out",
                            cert, "-days", "2", "-subj", "/CN=localhost", "-addext",
                            "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"openssl req failed: {r.stderr.strip()[-300:]}")
    else:
        try:
            _certs_with_cryptography(cert, key)
        except ImportError:
            raise RuntimeError("no openssl binary and no cryptography package to make a "
                               "test certificate (apt install openssl)") from None
    _CERTS["pair"] = (cert, key)
    return cert, key


def _certs_with_cryptography(cert_path, key_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    crt = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
           .public_key(key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - datetime.timedelta(hours=1))
           .not_valid_after(now + datetime.timedelta(days=2))
           .add_extension(x509.SubjectAlternativeName(
               [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(HOST))]),
               critical=False)
           .sign(key, hashes.SHA256()))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(cert_path, "wb") as f:
        f.write(crt.public_bytes(serialization.Encoding.PEM))


# -- servers ----------------------------------------------------------------------------------

def server_cmd(server, framing, cert, key):
    """The argv that starts ``server`` (a name from servers.available_servers()) as a TLS
    echo server on a free port: its plain command plus ``--certfile`` / ``--keyfile`` (both
    ``python -m aoprim serve`` and echo_asyncio.py take them)."""
    return servers.server_cmd(server, framing) + ["--certfile", cert, "--keyfile", key]


def client_context(tls13=False):
    """The load's client context: no certificate check (the client's cost, not the
    server's); ``tls13`` pins TLS 1.3."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if tls13:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def _message(k, size, framing):
    payload = bytes(((k * 131 + i * 7) ^ (i >> 8)) & 0xFF for i in range(size))
    return payload if framing == "raw" else struct.pack(">H", size) + payload


def warm_up(port, framing, size, messages=8):
    """One TLS connection exchanges ``messages`` echoes of the scenario, one at a time, then
    closes (close_notify) and is seen closed, before the measured load starts."""
    msg = _message(0, size, framing)
    ctx = client_context()
    with socket.create_connection((HOST, port), timeout=10) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s = ctx.wrap_socket(raw)
        servers.echo_exchange(s, msg, messages, "TLS warm-up")
        try:
            s.unwrap()
        except (OSError, ssl.SSLError):
            pass
    time.sleep(0.05)


def run_one(server, scenario, duration=3.0, warmup=0.5, syscalls=False, **_ignored):
    """One TLS server process, one load run; returns the load's summary (as
    servers.run_one's, plus ``records_per_msg`` and ``wire_bytes_per_msg``).  Raises
    servers.ServerUnavailable when this server cannot serve TLS here."""
    sc = SCENARIOS[scenario]
    try:
        cert, key = certs()
    except RuntimeError as e:
        raise servers.ServerUnavailable(str(e)) from None
    tree = servers.TREES.get("aoprim") if (server == "aoprim" or servers._backend_of(server)) \
        else None
    p, port = servers.start_server(server_cmd(server, sc["framing"], cert, key),
                                   f"{server} with TLS", env=servers._env(tree))
    try:
        warm_up(port, sc["framing"], sc["size"])
        cmd = [sys.executable, os.path.join(HERE, "tls.py"), "load", "--port", str(port),
               "--mode", sc["mode"], "--conns", str(sc["conns"]), "--size", str(sc["size"]),
               "--pipeline", str(sc["pipeline"]), "--framing", sc["framing"], "--duration",
               str(duration), "--warmup", str(warmup), "--cpu-pid", str(p.pid)]
        lg = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=servers.CWD, env=servers._env())
        counted = {}
        window = servers.SYSCALL_WINDOW * duration
        th = None
        if syscalls:
            def count():
                time.sleep(0.3 + warmup + 0.1 * duration)    # the load is up and warm
                counted["n"], counted["why"] = servers.count_syscalls(p.pid, window)
            th = threading.Thread(target=count, daemon=True)
            th.start()
        out, err = lg.communicate(timeout=duration + 120)
        if th is not None:
            th.join(60)
        if not out.strip():
            raise RuntimeError(f"the TLS load failed against {server}: {err.strip()[-500:]}")
        res = json.loads(out)
        if counted.get("n") is not None and res.get("msgs_per_s"):
            res["syscalls_per_msg"] = counted["n"] / (res["msgs_per_s"] * window)
        elif syscalls:
            res["syscalls_error"] = counted.get("why")
        sout, _ = servers.stop_server(p)
        if "stats " in sout:
            st = json.loads(sout.split("stats ", 1)[1].splitlines()[0])
            res["server_stats"] = st
            if st.get("frames_out") and sc["mode"] == "echo":
                res["send_syscalls_per_msg"] = st["send_syscalls"] / st["frames_out"]
        res["server"] = server
        res["scenario"] = scenario
        res["warm"] = True
        return res
    finally:
        servers.stop_server(p, 0)


# -- the load client (this file run by path: ``python tls.py load ...``) ----------------------

_VARIANTS = 64


class _Records:
    """Counts the TLS records and bytes of one direction of a byte stream (record header:
    type, version, 16-bit length)."""
    __slots__ = ("records", "bytes", "hdr", "left")

    def __init__(self):
        self.records = 0
        self.bytes = 0
        self.hdr = bytearray()
        self.left = 0

    def feed(self, data):
        n = len(data)
        self.bytes += n
        i = 0
        while i < n:
            if self.left:
                take = min(self.left, n - i)
                self.left -= take
                i += take
                continue
            need = 5 - len(self.hdr)
            self.hdr += data[i:i + need]
            i += need
            if len(self.hdr) == 5:
                self.left = (self.hdr[3] << 8) | self.hdr[4]
                self.hdr.clear()
                self.records += 1


class _TLSConn:
    """A client TLS connection over a blocking socket, through MemoryBIOs so that every byte
    from the server passes the record counter."""

    def __init__(self, sock, ctx, rec):
        self.sock = sock
        self.inc = ssl.MemoryBIO()
        self.out = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inc, self.out, server_side=False)
        self.rec = rec

    def _flush(self):
        data = self.out.read()
        if data:
            self.sock.sendall(data)

    def _fill(self):
        data = self.sock.recv(1 << 18)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.rec.feed(data)
        self.inc.write(data)

    def handshake(self):
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
        self._flush()

    def send(self, data):
        self.obj.write(data)
        self._flush()

    def read_available(self):
        """Decrypt what has arrived (after one recv), as bytes (may be empty: a session
        ticket, a partial record)."""
        self._fill()
        parts = []
        while True:
            try:
                parts.append(self.obj.read(1 << 17))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                raise ConnectionError("the server sent close_notify") from None
        return b"".join(parts)

    def recv_exact(self, n):
        got = bytearray()
        while len(got) < n:
            got += self.read_available()
        return bytes(got)

    def close(self, notify=True):
        if notify:
            try:
                self.obj.unwrap()
            except (ssl.SSLError, OSError):
                pass
            try:
                self._flush()
            except OSError:
                pass
        self.sock.close()


def _summary(msgs, duration, hist, errors, cpu, rec, extra):
    out = {"msgs": msgs, "duration": duration, "errors": errors,
           "msgs_per_s": msgs / duration, "p50_us": _percentile(hist, 0.5),
           "p99_us": _percentile(hist, 0.99)}
    out.update(extra)
    if msgs:
        out["records_per_msg"] = rec[0] / msgs
        out["wire_bytes_per_msg"] = rec[1] / msgs
        if cpu is not None:
            user, sys_, minflt = cpu
            out["server_cpu"] = {"user_s": user, "sys_s": sys_, "minflt": minflt,
                                 "user_us_per_msg": user / msgs * 1e6,
                                 "sys_us_per_msg": sys_ / msgs * 1e6,
                                 "cpu_us_per_msg": (user + sys_) / msgs * 1e6,
                                 "faults_per_msg": minflt / msgs}
            out["faults_per_msg"] = minflt / msgs
    return out


def load_echo(port, conns=10, size=64, pipeline=16, framing="u16", duration=2.0, warmup=0.5,
              cpu_pid=None, host=HOST):
    """Echo over TLS: every connection keeps ``pipeline`` messages in flight and answers the
    echoed ones with as many new ones, written as one TLS record.  Every echoed byte is
    checked; only messages completed inside the window count."""
    msgs = [_message(k, size, framing) for k in range(_VARIANTS)]
    mlen = len(msgs[0])
    ctx = client_context()
    ep = select.epoll()
    cs = {}
    for i in range(conns):
        s = socket.create_connection((host, port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = _TLSConn(s, ctx, _Records())
        c.handshake()
        c.idx, c.sent, c.rx, c.done = i, 0, 0, 0
        c.expected = bytearray()
        c.times = deque()
        cs[s.fileno()] = c
        ep.register(s.fileno(), select.EPOLLIN)

    def queue(c, k, t):
        base = c.idx + c.sent
        data = b"".join(msgs[(base + j) % _VARIANTS] for j in range(k))
        c.sent += k
        c.expected += data
        c.times.append([k, t])
        c.send(data)

    t_begin = time.monotonic()
    t0 = t_begin + warmup
    t1 = t0 + duration
    for c in cs.values():
        queue(c, pipeline, t_begin)
    counted = 0
    hist = {}
    errors = []
    cpu0 = cpu1 = None
    rec0 = rec1 = None
    live = dict(cs)

    def rec_totals():
        return (sum(c.rec.records for c in cs.values()), sum(c.rec.bytes for c in cs.values()))

    while live:
        now = time.monotonic()
        if cpu0 is None and now >= t0:
            cpu0 = proc_cpu(cpu_pid) if cpu_pid else (0.0, 0.0, 0)
            rec0 = rec_totals()
        if now >= t1:
            if cpu1 is None:
                cpu1 = proc_cpu(cpu_pid) if cpu_pid else (0.0, 0.0, 0)
                rec1 = rec_totals()
            if now >= t1 + 5 or all(not c.expected for c in live.values()):
                break
        for fd, _ in ep.poll(0.05):
            c = live.get(fd)
            if c is None:
                continue
            try:
                pt = c.read_available()
            except (OSError, ssl.SSLError) as e:
                errors.append(f"conn {c.idx}: {type(e).__name__}: {e}")
                ep.unregister(fd)
                del live[fd]
                continue
            if not pt:
                continue
            if not c.expected.startswith(pt):
                errors.append(f"conn {c.idx}: echoed bytes differ from what was sent (at "
                              f"stream offset {c.rx})")
                ep.unregister(fd)
                del live[fd]
                continue
            del c.expected[:len(pt)]
            c.rx += len(pt)
            k = c.rx // mlen - c.done
            if not k:
                continue
            c.done += k
            t = time.monotonic()
            in_window = t0 <= t < t1
            if in_window:
                counted += k
            left = k
            while left:
                g = c.times[0]
                take = min(g[0], left)
                if in_window:
                    us = int((t - g[1]) * 1e6)
                    hist[us] = hist.get(us, 0) + take
                g[0] -= take
                left -= take
                if not g[0]:
                    c.times.popleft()
            if t < t1:
                queue(c, k, t)
    if cpu1 is None and cpu0 is not None:
        cpu1 = proc_cpu(cpu_pid) if cpu_pid else (0.0, 0.0, 0)
        rec1 = rec_totals()
    for c in cs.values():
        c.close()
    ep.close()
    cpu = (tuple(b - a for a, b in zip(cpu0, cpu1)) if cpu_pid and cpu0 is not None
           else None)
    rec = (rec1[0] - rec0[0], rec1[1] - rec0[1]) if rec0 is not None else (0, 0)
    return _summary(counted, duration, hist, errors, cpu, rec,
                    {"conns": conns, "size": size, "pipeline": pipeline, "framing": framing,
                     "message_bytes": mlen, "mode": "echo"})


def load_handshakes(port, threads=4, size=64, duration=2.0, warmup=0.5, cpu_pid=None,
                    host=HOST, **_ignored):
    """``threads`` client threads, each in a loop: connect, a full TLS 1.3 handshake, one
    u16 request of ``size`` bytes and its reply (checked), close_notify, close.  A
    handshake counts when its reply arrives inside the window."""
    ctx = client_context(tls13=True)
    ctx.options |= ssl.OP_NO_TICKET           # no resumption: every handshake is a full one
    msg = _message(1, size, "u16")
    t0 = time.monotonic() + warmup
    t1 = t0 + duration
    lock = threading.Lock()
    state = {"n": 0, "hist": {}, "errors": [], "rec": [0, 0]}

    def worker():
        while True:
            t = time.monotonic()
            if t >= t1:
                return
            rec = _Records()
            try:
                s = socket.create_connection((host, port), timeout=10)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c = _TLSConn(s, ctx, rec)
                try:
                    c.handshake()
                    c.send(msg)
                    got = c.recv_exact(len(msg))
                    if got != msg:
                        raise RuntimeError("the reply differs from the request")
                finally:
                    c.close()
            except (OSError, ssl.SSLError, RuntimeError) as e:
                with lock:
                    if len(state["errors"]) < 20:
                        state["errors"].append(f"{type(e).__name__}: {e}")
                    if len(state["errors"]) >= 20:
                        return
                continue
            done = time.monotonic()
            if t0 <= done < t1:
                with lock:
                    state["n"] += 1
                    us = int((done - t) * 1e6)
                    state["hist"][us] = state["hist"].get(us, 0) + 1
                    state["rec"][0] += rec.records
                    state["rec"][1] += rec.bytes

    ths = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for th in ths:
        th.start()
    time.sleep(max(0.0, t0 - time.monotonic()))
    cpu0 = proc_cpu(cpu_pid) if cpu_pid else None
    time.sleep(max(0.0, t1 - time.monotonic()))
    cpu1 = proc_cpu(cpu_pid) if cpu_pid else None
    for th in ths:
        th.join(30)
    cpu = tuple(b - a for a, b in zip(cpu0, cpu1)) if cpu_pid else None
    return _summary(state["n"], duration, state["hist"], state["errors"], cpu,
                    tuple(state["rec"]),
                    {"conns": threads, "size": size, "framing": "u16", "mode": "handshake"})


def _cli(argv=None):
    p = argparse.ArgumentParser(prog="tls.py load", description="the tls groups' TLS client")
    p.add_argument("cmd", choices=("load",))
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=("echo", "handshake"), default="echo")
    p.add_argument("--conns", type=int, default=10)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--framing", choices=("raw", "u16"), default="u16")
    p.add_argument("--duration", type=float, default=2.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--cpu-pid", type=int, default=None)
    a = p.parse_args(argv)
    if a.mode == "echo":
        res = load_echo(a.port, a.conns, a.size, a.pipeline, a.framing, a.duration, a.warmup,
                        a.cpu_pid, a.host)
    else:
        res = load_handshakes(a.port, a.conns, a.size, a.duration, a.warmup, a.cpu_pid,
                              a.host)
    print(json.dumps(res), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(_cli())
