"""Soak: the echo and chat apps (u16) with workers=0 and workers=2, under mixed load, with
their resources sampled once per second.  Run by ``.ci/soak [SECONDS]`` (default 60) and,
for 5 s, by tests/server/test_soak.py.

    python tests/support/soak.py [SECONDS]                 # the whole soak; exit 0 when it passed
    python tests/support/soak.py --load echo|chat PORT SECONDS SEED     # one load process

Each server is a subprocess (``python -m aoprim serve probe_app:ProbeEcho|ProbeChat``)
driven by its own load process (threads):

- echo: two ping-pong clients, one pipelining batches of random frames, one churning
  (connect, a few frames, close -- or reset right after a partial frame, SO_LINGER 0);
- chat: three members broadcasting sequenced frames and checking every frame they receive
  (the body is a function of sender and sequence; a sender's sequence only increases),
  one churning connection that says one thing and leaves (close or reset).

Every second the driver samples each server: RSS, open fds, threads (/proc), receive and send
pool slots in use (a probe frame, see probe_app.py).  At the end: zero byte mismatches and
zero unexpected disconnects; after warm-up, RSS, threads and fds flat (the last samples
within a small bound of the first ones); once the load stops, the pools back to idle
(rx 1, tx 0) and the fd count back to its start; on_close exactly once per session.
"""
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HOST = "127.0.0.1"
RSS_SLACK_KIB = 8 << 10         # flat: the last RSS within max(8 MiB, 10 %) of the first
FD_SLACK = 24                   # churning connections come and go between samples

CONFIGS = [("echo", 0), ("echo", 2), ("chat", 0), ("chat", 2)]


# == load (runs in its own process) ===========================================================

class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {"frames": 0, "bytes": 0, "mismatches": 0, "disconnects": 0,
                  "churned": 0, "resets": 0, "errors": 0}
        self.notes = []

    def add(self, k, n=1):
        with self.lock:
            self.c[k] += n

    def bad(self, k, note):
        with self.lock:
            self.c[k] += 1
            if len(self.notes) < 10:
                self.notes.append(note)


def _conn():
    s = socket.create_connection((HOST, PORT), timeout=15)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        c = s.recv(n - len(buf))
        if not c:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += c
    return bytes(buf)


def _read_frame(s):
    (n,) = struct.unpack(">H", _recv_exact(s, 2))
    return _recv_exact(s, n)


def _fr(p):
    return struct.pack(">H", len(p)) + p


def _reset(s):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _persistent(fn, name, counts, t_end):
    """Run fn(sock, rnd) on one connection until t_end; a disconnect is a failure."""
    def run():
        rnd = random.Random(f"{SEED}-{name}")
        try:
            with _conn() as s:
                fn(s, rnd, t_end)
        except (OSError, ConnectionError) as e:
            counts.bad("disconnects", f"{name}: {e!r}")
    return run


def echo_pingpong(counts):
    def fn(s, rnd, t_end):
        while time.monotonic() < t_end:
            p = b"E" + rnd.randbytes(rnd.randrange(0, 300))
            s.sendall(_fr(p))
            if _read_frame(s) != p:
                counts.bad("mismatches", "pingpong echo differs")
            counts.add("frames")
            counts.add("bytes", len(p))
    return fn


def echo_pipelined(counts):
    def fn(s, rnd, t_end):
        while time.monotonic() < t_end:
            ps = [b"P" + rnd.randbytes(rnd.randrange(0, 4000)) for _ in range(rnd.randrange(1, 50))]
            s.sendall(b"".join(_fr(p) for p in ps))
            for p in ps:
                if _read_frame(s) != p:
                    counts.bad("mismatches", "pipelined echo differs")
            counts.add("frames", len(ps))
            counts.add("bytes", sum(map(len, ps)))
    return fn


def echo_churn(counts, t_end):
    rnd = random.Random(f"{SEED}-churn")
    while time.monotonic() < t_end:
        try:
            s = _conn()
        except OSError as e:
            counts.bad("errors", f"churn connect: {e!r}")
            time.sleep(0.05)
            continue
        try:
            k = rnd.random()
            if k < 0.2:                     # a partial frame, then RST
                s.sendall(struct.pack(">H", 1000) + b"r" * rnd.randrange(1, 999))
                _reset(s)
                counts.add("resets")
            elif k < 0.3:                   # unread echoes, then RST
                s.sendall(_fr(b"C" * 100) * 5)
                _reset(s)
                counts.add("resets")
            else:
                ps = [b"C" + rnd.randbytes(rnd.randrange(0, 500)) for _ in range(3)]
                s.sendall(b"".join(_fr(p) for p in ps))
                for p in ps:
                    if _read_frame(s) != p:
                        counts.bad("mismatches", "churn echo differs")
                counts.add("frames", 3)
                s.close()
            counts.add("churned")
        except (OSError, ConnectionError) as e:
            counts.bad("errors", f"churn: {e!r}")
            s.close()


def _chat_body(sender, seq, n):
    """The body of a chat frame: a function of its sender and sequence number."""
    seed = (sender * 1000003 + seq) & 0xFF
    return bytes((seed + i) & 0xFF for i in range(n))


def chat_member(counts, me, t_end, ready, stop_sending):
    """Send sequenced frames; a reader thread checks every frame from the others."""
    def run():
        rnd = random.Random(f"{SEED}-member{me}")
        try:
            s = _conn()
        except OSError as e:
            counts.bad("disconnects", f"member {me}: {e!r}")
            ready.wait(5)
            return
        last = {}
        done = threading.Event()

        def reader():
            try:
                s.settimeout(15)
                while not done.is_set():
                    try:
                        p = _read_frame(s)
                    except socket.timeout:
                        if done.is_set():
                            return
                        raise
                    if p[:1] == b"M":
                        sender, seq, n = struct.unpack(">BIH", p[1:8])
                        if p[8:] != _chat_body(sender, seq, n) or len(p) != 8 + n:
                            counts.bad("mismatches", f"member {me}: corrupt frame from {sender}")
                        elif seq <= last.get(sender, -1):
                            counts.bad("mismatches", f"member {me}: {sender} seq {seq} after "
                                                     f"{last[sender]}")
                        last[sender] = seq
                    elif p[:1] == b"X":
                        n = struct.unpack(">H", p[1:3])[0]
                        if p[3:] != _chat_body(255, n, n):
                            counts.bad("mismatches", f"member {me}: corrupt churn frame")
                    else:
                        counts.bad("mismatches", f"member {me}: unknown frame {p[:8]!r}")
                    counts.add("frames")
                    counts.add("bytes", len(p))
            except (OSError, ConnectionError) as e:
                if not done.is_set():
                    counts.bad("disconnects", f"member {me} reader: {e!r}")

        rt = threading.Thread(target=reader, daemon=True)
        rt.start()
        ready.wait(10)                  # every member is connected before anyone talks
        seq = 0
        try:
            while time.monotonic() < t_end and not stop_sending.is_set():
                burst = []
                for _ in range(rnd.randrange(1, 8)):
                    n = rnd.randrange(0, 1500)
                    burst.append(_fr(b"M" + struct.pack(">BIH", me, seq, n) +
                                     _chat_body(me, seq, n)))
                    seq += 1
                s.sendall(b"".join(burst))
                time.sleep(0.002)
        except OSError as e:
            counts.bad("disconnects", f"member {me} writer: {e!r}")
        time.sleep(1.0)                 # let the last broadcasts arrive
        done.set()
        try:
            s.shutdown(socket.SHUT_RDWR)    # wakes the reader (close alone would not)
        except OSError:
            pass
        s.close()
        rt.join(20)
    return run


def chat_churn(counts, t_end):
    rnd = random.Random(f"{SEED}-chatchurn")
    while time.monotonic() < t_end:
        try:
            s = _conn()
        except OSError as e:
            counts.bad("errors", f"chat churn connect: {e!r}")
            time.sleep(0.05)
            continue
        try:
            n = rnd.randrange(0, 1000)
            s.sendall(_fr(b"X" + struct.pack(">H", n) + _chat_body(255, n, n)))
            time.sleep(rnd.random() * 0.02)         # hears a few broadcasts, unread
            if rnd.random() < 0.3:
                _reset(s)
                counts.add("resets")
            else:
                s.close()
            counts.add("churned")
        except OSError as e:
            counts.bad("errors", f"chat churn: {e!r}")
            s.close()


class _Start:
    """Every member connected before anyone talks (a barrier that never raises)."""

    def __init__(self, parties):
        self._b = threading.Barrier(parties)

    def wait(self, timeout):
        try:
            self._b.wait(timeout)
        except threading.BrokenBarrierError:
            pass


def load_main(kind, port, seconds, seed):
    global PORT, SEED
    PORT, SEED = port, seed
    counts = Counts()
    t_end = time.monotonic() + seconds
    if kind == "echo":
        targets = [_persistent(echo_pingpong(counts), "ping1", counts, t_end),
                   _persistent(echo_pingpong(counts), "ping2", counts, t_end),
                   _persistent(echo_pipelined(counts), "pipe", counts, t_end),
                   lambda: echo_churn(counts, t_end)]
    else:
        members = 3
        r = _Start(members + 1)
        stop_sending = threading.Event()
        targets = [chat_member(counts, i, t_end, r, stop_sending) for i in range(members)]
        targets.append(lambda: (r.wait(10), chat_churn(counts, t_end)))
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    if any(t.is_alive() for t in threads):
        counts.bad("errors", "a load thread hung")
    print(json.dumps({"counts": counts.c, "notes": counts.notes}), flush=True)


# == the driver ===============================================================================

def _probe(address):
    """The server's stats (a probe frame on a fresh connection; a chat server may send
    broadcasts first: skipped)."""
    from probe_app import PROBE
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(_fr(PROBE))
        for _ in range(100000):
            p = _read_frame(s)
            if p[:1] == b"{":
                return json.loads(p)
    raise AssertionError("no probe reply")


def _sample(srv, t0):
    from proc_support import fd_count, rss_kib, thread_count
    st = _probe(srv.address)
    return {"t": round(time.monotonic() - t0, 1), "rss": rss_kib(srv.pid),
            "fds": fd_count(srv.pid), "threads": thread_count(srv.pid),
            "rx": st["rx_slots_in_use"], "tx": st["tx_slots_in_use"],
            "conns": st["connections"]}


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def run(seconds=60.0, out=sys.stdout, seed=1):
    """The soak; returns (ok, rows).  Prints the sample series and a summary table."""
    from proc_support import NEUTRAL_CWD, ServerProc, child_env, fd_count
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    servers = {}
    try:
        for app, workers in CONFIGS:
            servers[(app, workers)] = ServerProc([
                f"probe_app:Probe{app.capitalize()}", "--app-dir", tests_dir,
                "--framing", "u16", "--workers", str(workers), "--log-level", "WARNING"])
        base = {}
        for key, srv in servers.items():      # threads: counted once serving (see _judge)
            base[key] = {"fds": fd_count(srv.pid)}
        loads = {}
        for i, (key, srv) in enumerate(servers.items()):
            loads[key] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--load", key[0], str(srv.port),
                 str(seconds), str(seed * 10 + i)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=NEUTRAL_CWD,
                env=child_env())
        t0 = time.monotonic()
        samples = {k: [] for k in servers}
        next_t = t0
        while time.monotonic() < t0 + seconds:
            next_t += 1.0
            for key, srv in servers.items():
                samples[key].append(_sample(srv, t0))
            time.sleep(max(0.0, next_t - time.monotonic()))
        results = {}
        for key, p in loads.items():
            try:
                o, e = p.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
            try:
                results[key] = json.loads(o.strip().splitlines()[-1])
            except (ValueError, IndexError):
                results[key] = {"counts": {"errors": 1}, "notes": [f"load died: {e[-500:]}"]}
        rows, ok = [], True
        for key, srv in servers.items():
            fds0 = base[key]["fds"]
            idle = _wait(lambda: (lambda s: s["conns"] == 1 and s["rx"] == 1 and s["tx"] == 0)
                         (_sample(srv, t0)), 15)
            end = _sample(srv, t0)
            fds_back = _wait(lambda: fd_count(srv.pid) == fds0, 15)   # the probe's too
            end["fds"] = fd_count(srv.pid)
            row, problems = _judge(key, samples[key], results[key], base[key], end,
                                   bool(idle), bool(fds_back))
            rows.append((row, problems))
        for key, srv in servers.items():
            done = srv.stop()
            row, problems = next(r for r in rows if r[0]["server"] == _name(key))
            fin, pr = done.stats or {}, done.probe or {}
            if done.rc != 0:
                problems.append(f"exit status {done.rc}")
            if done.error_lines():
                problems.append(f"ERROR lines: {done.error_lines()[:3]}")
            if fin.get("rx_slots_in_use") != 0 or fin.get("tx_slots_in_use") != 0:
                problems.append(f"pools after shutdown: {fin}")
            if pr.get("not_once") or pr.get("connects") != pr.get("closed_sessions"):
                problems.append(f"on_close not exactly once: {pr}")
            row["sessions"] = fin.get("connections_total")
        servers = {}
    finally:
        for srv in servers.values():
            srv.kill()
    ok = all(not p for _, p in rows)
    _print(rows, samples, seconds, out)
    return ok, rows


def _name(key):
    return f"{key[0]} w={key[1]}"


def _judge(key, samples, result, base, end, idle, fds_back):
    c = result["counts"]
    problems = []
    for k in ("mismatches", "disconnects", "errors"):
        if c.get(k):
            problems.append(f"{c[k]} {k}: {result.get('notes')}")
    n = len(samples)
    warm = max(1, n // 5)
    first = samples[warm:warm + 3] or samples[-1:]
    last = samples[-3:]
    rss_first = max(s["rss"] for s in first)
    rss_last = max(s["rss"] for s in last)
    if rss_last - rss_first > max(RSS_SLACK_KIB, rss_first // 10):
        problems.append(f"RSS grew {rss_first} -> {rss_last} KiB")
    th_first = max(s["threads"] for s in first)
    if max(s["threads"] for s in last) > th_first:
        problems.append("thread count grew")
    if max(s["fds"] for s in last) > max(s["fds"] for s in first) + FD_SLACK:
        problems.append("fd count grew")
    if not idle:
        problems.append(f"not idle after the load: {end}")
    if not fds_back:
        problems.append(f"fds {end['fds']} after the load, {base['fds']} before")
    th0 = samples[0]["threads"]         # the loop and its workers, once serving
    if end["threads"] != th0 or any(s["threads"] != th0 for s in samples):
        problems.append(f"threads: {[s['threads'] for s in samples]}, {end['threads']} "
                        "after the load")
    row = {"server": _name(key), "frames": c.get("frames", 0), "MB": c.get("bytes", 0) / 1e6,
           "churned": c.get("churned", 0), "resets": c.get("resets", 0),
           "mismatch": c.get("mismatches", 0), "disc": c.get("disconnects", 0),
           "rss_first": rss_first, "rss_last": rss_last,
           "fds": f"{base['fds']}/{max(s['fds'] for s in samples)}/{end['fds']}",
           "threads": f"{samples[0]['threads']}/{end['threads']}",
           "rx_max": max(s["rx"] for s in samples), "rx_idle": end["rx"],
           "tx_max": max(s["tx"] for s in samples), "tx_idle": end["tx"]}
    return row, problems


def _print(rows, samples, seconds, out):
    w = out.write
    w(f"soak: {seconds:g} s, samples once per second (rss KiB / fds / threads / rx / tx)\n")
    for key, ss in samples.items():
        w(f"  {_name(key):10s} " + " ".join(f"{s['rss']}/{s['fds']}/{s['threads']}/{s['rx']}"
                                             f"/{s['tx']}" for s in ss) + "\n")
    cols = ["server", "frames", "MB", "churned", "resets", "mismatch", "disc", "rss_first",
            "rss_last", "fds", "threads", "rx_max", "rx_idle", "tx_max", "tx_idle",
            "sessions"]
    cells = [[(f"{r.get(c):.1f}" if isinstance(r.get(c), float) else str(r.get(c)))
              for c in cols] for r, _ in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    w("  ".join(c.ljust(widths[i]) for i, c in enumerate(cols)) + "  result\n")
    for (r, problems), x in zip(rows, cells):
        w("  ".join(v.ljust(widths[i]) for i, v in enumerate(x)) +
          ("  ok" if not problems else "  FAIL") + "\n")
        for p in problems:
            w(f"    - {p}\n")
    w("fds: before/max/after the load; threads: first sample/after the load; rx/tx: pool slots in use\n")
    out.flush()


def main(argv):
    if argv[:1] == ["--load"]:
        load_main(argv[1], int(argv[2]), float(argv[3]), int(argv[4]))
        return 0
    seconds = float(argv[0]) if argv else 60.0
    ok, _ = run(seconds)
    print("soak: " + ("PASSED" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
