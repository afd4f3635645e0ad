"""A lean echo load generator (a client of the server): ``python -m aoprim loadgen``.

Every connection keeps ``pipeline`` messages in flight; each echoed message is answered by a
new one.  Every echoed byte is checked against what was sent on that connection (the
stream must come back identical: 64 distinct message contents rotate per connection, so a
lost, duplicated or reordered message is caught).  Only messages completed inside the
measured window (after ``warmup``) are counted.  Latency is the time from the send of a
message to the arrival of its last byte.

Lean by design (the generator, not the server, is usually the bottleneck on a small box):
one ``epoll`` per process, ``recv_into`` one reused buffer, verification with one
``bytearray.startswith`` per read, messages of a read answered with one ``send``, latencies
kept per send group (not per message), and ``--procs N`` processes splitting the
connections.  ``--cpu-pid PID`` also reports that process's CPU time over the window (from
``/proc/PID/stat``), divided per message -- how the benchmarks measure a server -- and its
minor page faults over the window (field 10, ``minflt``: a page first touched, or touched
again after the allocator gave it back to the kernel).
"""
import argparse
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections import deque

from aoprim.server.framing import Framing

__all__ = ["run", "main", "proc_cpu"]

_CLK = os.sysconf("SC_CLK_TCK")
_VARIANTS = 64


def proc_cpu(pid):
    """(user_seconds, system_seconds, minor_page_faults) of process ``pid`` so far, its
    threads included: fields 14, 15 and 10 (``utime``, ``stime``, ``minflt``) of
    /proc/PID/stat -- the one reader of that file for the load generator, the bench command
    and the repository's bench/ scripts."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2:].split()      # the name in (...) may hold spaces
    return int(fields[11]) / _CLK, int(fields[12]) / _CLK, int(fields[7])


def _cpu_delta(a, b):
    return {"user_s": b[0] - a[0], "sys_s": b[1] - a[1], "minflt": b[2] - a[2]}


def _payload(k, size):
    """Variant k's payload: byte i is ((k * 131 + i * 7) ^ (i >> 8)) & 0xFF -- built with one
    translate and one big-integer XOR, so a 1 MiB message costs milliseconds, not seconds."""
    if not size:
        return b""
    ramp = bytes((i * 7) & 0xFF for i in range(256))        # (i * 7) & 0xFF repeats every 256
    a = (k * 131) & 0xFF
    added = (ramp * (size // 256 + 1))[:size].translate(bytes((a + v) & 0xFF
                                                                for v in range(256)))
    # (i >> 8) & 0xFF: 256 copies of each byte value in turn
    high = (b"".join(bytes((j,)) * 256 for j in range(256)) * (size // 65536 + 1))[:size]
    return (int.from_bytes(added, "big") ^ int.from_bytes(high, "big")).to_bytes(size, "big")


def _messages(size, framing):
    fr = Framing(framing, max(size, 1))
    return [fr.encode(_payload(k, size)) for k in range(_VARIANTS)]


class _Conn:
    __slots__ = ("sock", "fd", "idx", "expected", "out", "groups", "rx", "done", "sent",
                 "want_write")

    def __init__(self, sock, idx):
        self.sock = sock
        self.fd = sock.fileno()
        self.idx = idx
        self.expected = bytearray()
        self.out = bytearray()
        self.groups = deque()     # [messages_left_in_group, t_sent]
        self.rx = 0
        self.done = 0
        self.sent = 0
        self.want_write = False


def run(host="127.0.0.1", port=0, conns=10, size=1024, pipeline=1, duration=5.0,
        framing="raw", warmup=0.5, t_start=None, cpu_pid=None, conn_offset=0):
    """Run one load-generating process; returns a result dict (see main)."""
    msgs = _messages(size, framing)
    mlen = len(msgs[0])
    ep = select.epoll()
    cs = {}
    for i in range(conns):
        s = socket.create_connection((host, port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        c = _Conn(s, i + conn_offset)
        cs[c.fd] = c
        ep.register(c.fd, select.EPOLLIN)
    now = time.monotonic()
    t0 = t_start if t_start is not None else now + warmup
    t1 = t0 + duration
    counted = 0
    hist = {}                 # latency in whole microseconds -> messages
    errors = []
    cpu0 = None

    def queue_msgs(c, k, t):
        base = c.idx + c.sent
        parts = [msgs[(base + j) % _VARIANTS] for j in range(k)]
        c.sent += k
        data = b"".join(parts)
        c.expected += data
        c.out += data
        c.groups.append([k, t])
        try:
            n = c.sock.send(c.out)
        except BlockingIOError:
            n = 0
        del c.out[:n]
        if c.out and not c.want_write:
            c.want_write = True
            ep.modify(c.fd, select.EPOLLIN | select.EPOLLOUT)

    start = time.monotonic()
    for c in cs.values():
        queue_msgs(c, pipeline, start)
    buf = bytearray(1 << 18)
    mv = memoryview(buf)
    stopping = False
    open_conns = len(cs)
    while open_conns:
        now = time.monotonic()
        if cpu_pid is not None and cpu0 is None and now >= t0:
            cpu0 = proc_cpu(cpu_pid)
        if not stopping and now >= t1:
            stopping = True
            if cpu_pid is not None:
                cpu1 = proc_cpu(cpu_pid)
        if stopping:
            # drain what is in flight (bounded), then stop
            if now >= t1 + 5 or all(not c.expected for c in cs.values()):
                break
        timeout = 0.05
        for fd, ev in ep.poll(timeout):
            c = cs[fd]
            if ev & select.EPOLLOUT:
                try:
                    n = c.sock.send(c.out)
                except BlockingIOError:
                    n = 0
                del c.out[:n]
                if not c.out:
                    c.want_write = False
                    ep.modify(fd, select.EPOLLIN)
            if not ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                continue
            try:
                n = c.sock.recv_into(buf)
            except BlockingIOError:
                continue
            except OSError as e:
                errors.append(f"conn {c.idx}: {e}")
                ep.unregister(fd)
                open_conns -= 1
                continue
            if not n:
                if c.expected:
                    errors.append(f"conn {c.idx}: closed by the server with "
                                  f"{len(c.expected)} bytes outstanding")
                ep.unregister(fd)
                open_conns -= 1
                continue
            if not c.expected.startswith(mv[:n]):
                errors.append(f"conn {c.idx}: echoed bytes differ from what was sent "
                              f"(at stream offset {c.rx})")
                ep.unregister(fd)
                open_conns -= 1
                continue
            del c.expected[:n]
            c.rx += n
            k = c.rx // mlen - c.done
            if not k:
                continue
            c.done += k
            t = time.monotonic()
            in_window = t0 <= t < t1
            if in_window:
                counted += k
            left = k
            groups = c.groups
            while left:
                g = groups[0]
                take = g[0] if g[0] <= left else left
                if in_window:
                    us = int((t - g[1]) * 1e6)
                    hist[us] = hist.get(us, 0) + take
                g[0] -= take
                left -= take
                if not g[0]:
                    groups.popleft()
            if not stopping:
                queue_msgs(c, k, t)
    if cpu_pid is not None and cpu0 is not None and not stopping:
        cpu1 = proc_cpu(cpu_pid)
    for c in cs.values():
        c.sock.close()
    ep.close()
    res = {"msgs": counted, "duration": duration, "conns": conns, "size": size,
           "pipeline": pipeline, "framing": framing, "message_bytes": mlen,
           "errors": errors, "hist": hist}
    if cpu_pid is not None and cpu0 is not None:
        res["server_cpu"] = _cpu_delta(cpu0, cpu1)
    return res


def _percentile(hist, q):
    total = sum(hist.values())
    if not total:
        return None
    want = q * total
    acc = 0
    for us in sorted(hist):
        acc += hist[us]
        if acc >= want:
            return us
    return max(hist)


def summarize(res):
    msgs = res["msgs"]
    d = res["duration"]
    out = {k: v for k, v in res.items() if k != "hist"}
    out["msgs_per_s"] = msgs / d
    out["mib_per_s"] = msgs * res["message_bytes"] / d / (1 << 20)
    out["p50_us"] = _percentile(res["hist"], 0.50)
    out["p99_us"] = _percentile(res["hist"], 0.99)
    cpu = res.get("server_cpu")
    if cpu is not None and msgs:
        cpu["user_us_per_msg"] = cpu["user_s"] / msgs * 1e6
        cpu["sys_us_per_msg"] = cpu["sys_s"] / msgs * 1e6
        cpu["cpu_us_per_msg"] = (cpu["user_s"] + cpu["sys_s"]) / msgs * 1e6
        if "minflt" in cpu:
            cpu["faults_per_msg"] = cpu["minflt"] / msgs
    return out


def _merge(results):
    total = dict(results[0])
    total["hist"] = {}
    total["errors"] = []
    total["msgs"] = 0
    total["conns"] = 0
    for r in results:
        total["msgs"] += r["msgs"]
        total["conns"] += r["conns"]
        total["errors"] += r["errors"]
        for us, k in r["hist"].items():
            us = int(us)
            total["hist"][us] = total["hist"].get(us, 0) + k
    return total


def build_parser(p=None):
    p = p or argparse.ArgumentParser(prog="python -m aoprim loadgen",
                                     description="echo load generator (verifies every byte)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the server's address")
    p.add_argument("--port", type=int, required=True, default=argparse.SUPPRESS,
                   help="the server's port (required)")
    p.add_argument("--conns", type=int, default=10, help="connections")
    p.add_argument("--size", type=int, default=1024, help="payload bytes per message")
    p.add_argument("--pipeline", type=int, default=1, help="messages in flight per connection")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=0.5,
                   help="seconds of load before the measured window")
    p.add_argument("--procs", type=int, default=1, help="load-generating processes")
    p.add_argument("--framing", choices=("raw", "u16", "u32"), default="raw",
                   help="as the server's --framing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--cpu-pid", type=int, default=None,
                   help="also report this process's CPU time per message over the window")
    p.add_argument("--_child", nargs=2, type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_offset", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main(args):
    if args.conns < 1 or args.size < 1 or args.pipeline < 1 or args.duration <= 0:
        print("loadgen: --conns, --size, --pipeline must be >= 1 and --duration > 0",
              file=sys.stderr)
        return 2
    if args._child is not None:     # a child of --procs: fixed window, raw JSON out
        res = run(args.host, args.port, args.conns, args.size, args.pipeline, args._child[1],
                  args.framing, t_start=args._child[0], conn_offset=args._offset)
        sys.stdout.write(json.dumps(res))
        return 0
    procs = max(1, args.procs)
    if procs == 1:
        res = run(args.host, args.port, args.conns, args.size, args.pipeline, args.duration,
                  args.framing, args.warmup, cpu_pid=args.cpu_pid)
    else:
        per = [args.conns // procs + (1 if i < args.conns % procs else 0) for i in range(procs)]
        per = [k for k in per if k]
        t0 = time.monotonic() + 0.5 + len(per) * 0.2 + args.warmup
        children = []
        off = 0
        for k in per:
            cmd = [sys.executable, "-m", "aoprim", "loadgen", "--host", args.host, "--port",
                   str(args.port), "--conns", str(k), "--size", str(args.size), "--pipeline",
                   str(args.pipeline), "--framing", args.framing, "--_child", repr(t0),
                   repr(args.duration), "--_offset", str(off)]
            off += k
            children.append(subprocess.Popen(cmd, stdout=subprocess.PIPE))
        cpu0 = cpu1 = None
        if args.cpu_pid is not None:
            time.sleep(max(0.0, t0 - time.monotonic()))
            cpu0 = proc_cpu(args.cpu_pid)
            time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
            cpu1 = proc_cpu(args.cpu_pid)
        results = []
        for ch in children:
            out, _ = ch.communicate(timeout=args.duration + 60)
            if ch.returncode != 0:
                print(f"loadgen: a child process failed ({ch.returncode})", file=sys.stderr)
                return 1
            results.append(json.loads(out))
        res = _merge(results)
        if cpu0 is not None:
            res["server_cpu"] = _cpu_delta(cpu0, cpu1)
        res["procs"] = len(per)
    out = summarize(res)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['msgs']} messages in {out['duration']:g} s on {out['conns']} connections: "
              f"{out['msgs_per_s']:.0f} msgs/s, {out['mib_per_s']:.2f} MiB/s, "
              f"p50 {out['p50_us']} us, p99 {out['p99_us']} us")
        if "server_cpu" in out and "cpu_us_per_msg" in out["server_cpu"]:
            c = out["server_cpu"]
            print(f"server CPU: {c['cpu_us_per_msg']:.2f} us/msg "
                  f"(user {c['user_us_per_msg']:.2f}, sys {c['sys_us_per_msg']:.2f})")
        for e in out["errors"][:10]:
            print("ERROR:", e)
    return 1 if out["errors"] else 0
