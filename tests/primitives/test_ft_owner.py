"""One-owner types under real threads: BlockTable, Receiver, RxArena, ProxyParser, EpollCore
and FlushGroup each hammered from several threads at once on ONE object.

Each type belongs to one thread at a time.  Misusing it from several threads may raise
RuntimeError (the refused call changes nothing), but it must never crash the interpreter
nor corrupt the object: every call either succeeds -- and the end state is then exact,
counted call by call -- or is refused.  On a GIL build every call succeeds (no method
releases the GIL midway); on a free-threaded build the owner claims are what keep a second
thread out.  Each hammer runs in a subprocess, so a segfault is a test failure with its
exit code instead of a dead test worker.  The subprocess prints one JSON line of counts.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

THREADS = 4


def hammer(body, timeout=240):
    """Run ``body`` (a script that prints one JSON line last) in a fresh interpreter;
    returns the parsed line.  A crash fails with the exit code and the stderr tail."""
    src = textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", src],
                       capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ), cwd=os.path.dirname(os.path.abspath(__file__)))
    assert p.returncode == 0, (
        f"hammer exited with {p.returncode} (a negative code is a signal: -11 SIGSEGV, "
        f"-6 SIGABRT)\nstderr tail:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


PRELUDE = f"""
import json, sys, threading
THREADS = {THREADS}
GIL = getattr(sys, "_is_gil_enabled", lambda: True)()

def run(target):
    # every thread starts at one barrier; exceptions other than the counted ones fail it
    bar = threading.Barrier(THREADS)
    errors = []
    def wrap(k):
        bar.wait(60)
        try:
            target(k)
        except BaseException as e:
            errors.append(repr(e))
            raise
    ts = [threading.Thread(target=wrap, args=(k,)) for k in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(200)
    assert not any(t.is_alive() for t in ts), "a thread is still running"
    assert not errors, errors
"""


def check_refusals(r, names, gil_switches=False):
    """Each refusal names the type.  With the GIL there are none, unless the type calls
    Python code while claimed (``gil_switches``: a Receiver's handlers, during which the GIL
    may pass to another thread, which is then refused as it would be without the GIL)."""
    if r["gil"] and not gil_switches:
        assert r["refused"] == 0, r
    for msg in r["messages"]:
        assert any(n in msg for n in names) and "another thread" in msg, msg


def test_blocktable_from_threads():
    r = hammer(PRELUDE + """
from aoprim._blocktable import BlockTable
from aoprim._slab import SlabPool
pool = SlabPool(64, 4096)
t = BlockTable(pool)
N = 20000
ok = [dict(app=0, con=0, view=0, fork=0, tail=0, read=0) for _ in range(THREADS)]
refused = [0] * THREADS
msgs = set()

def retry(k, f):
    while True:                       # the owner finishes its call: no wait needed
        try:
            return f()
        except RuntimeError as e:
            refused[k] += 1
            msgs.add(str(e))

def work(k):
    c = ok[k]
    chunk = bytes([k]) * 24
    for i in range(N):
        # append, then consume as much: this thread's bytes are in the table between the
        # two, so the table always holds >= 24 bytes when it consumes (exact bound)
        retry(k, lambda: t.append(chunk))
        c["app"] += 1
        try:
            v = t.view(0, 8)
            if isinstance(v, memoryview):
                v.release()
            c["view"] += 1
            assert len(t.read(0, 24)) == 24
            c["read"] += 1
            f = t.fork()
            assert len(f) >= 24
            f.release()
            c["fork"] += 1
            t.tail()
            t.commit(0)
            c["tail"] += 1
        except RuntimeError as e:
            refused[k] += 1
            msgs.add(str(e))
        retry(k, lambda: t.consume(24))
        c["con"] += 1

run(work)
end_len = len(t)
t.release()
tot = {key: sum(c[key] for c in ok) for key in ok[0]}
print(json.dumps(dict(gil=GIL, ok=tot, refused=sum(refused), messages=sorted(msgs),
                      end_len=end_len, in_use=pool.in_use, n=N * THREADS)))
""")
    check_refusals(r, ["BlockTable"])
    assert r["ok"]["app"] == r["ok"]["con"] == r["n"]       # every append and consume ran
    assert r["end_len"] == 0                                  # ... exactly once each
    assert r["in_use"] == 0                                   # every block went back
    if r["gil"]:
        for key in ("view", "read", "fork", "tail"):
            assert r["ok"][key] == r["n"], key


def test_blocktable_reads_are_shared_between_threads():
    # reads (len, bytes, read, blocks, tail_room) may be shared: threads only reading one
    # table are never refused, and each read is exact
    r = hammer(PRELUDE + """
from aoprim._blocktable import BlockTable
from aoprim._slab import SlabPool
pool = SlabPool(64, 64)
t = BlockTable(pool)
DATA = bytes(range(256)) * 8                  # 2048 bytes in 32 blocks
t.append(DATA)
BLOCKS = t.blocks
N = 20000
reads = [0] * THREADS
refused = [0] * THREADS
wrong = []

def work(k):
    for i in range(N):
        try:
            a = (i * 7 + k) % 2000
            ok = (len(t) == 2048 and bytes(t) == DATA and t.read(a, a + 48) == DATA[a:a + 48]
                  and t.blocks == BLOCKS and t.tail_room == 0)
        except RuntimeError:
            refused[k] += 1
            continue
        if not ok:
            wrong.append(i)
        reads[k] += 1

run(work)
t.release()
print(json.dumps(dict(reads=sum(reads), refused=sum(refused), wrong=len(wrong),
                      n=N * THREADS, in_use=pool.in_use)))
""")
    assert r["refused"] == 0 and r["wrong"] == 0, r
    assert r["reads"] == r["n"] and r["in_use"] == 0, r


def test_blocktable_readers_beside_a_writer_are_refused_or_exact():
    # one thread appends and consumes while the others read: a read beside the change is
    # refused (RuntimeError naming the table), every read that runs sees a whole state --
    # the table holds the writer's fixed pattern, 0 or 1 copies of its chunk
    r = hammer(PRELUDE + """
from aoprim._blocktable import BlockTable
from aoprim._slab import SlabPool
pool = SlabPool(64, 64)
t = BlockTable(pool)
BASE = b"b" * 100
CHUNK = bytes(range(50))
t.append(BASE)
N = 20000
seen = [0] * THREADS
refused = [0] * THREADS
msgs = set()
wrong = []

def work(k):
    for i in range(N):
        if k == 0:                            # the writer: every change retried till done
            for f in (lambda: t.append(CHUNK), lambda: t.consume(100),
                      lambda: t.append(BASE), lambda: t.consume(50)):
                while True:
                    try:
                        f()
                        break
                    except RuntimeError as e:
                        refused[k] += 1
                        msgs.add(str(e))
            continue
        try:
            b = bytes(t)
        except RuntimeError as e:
            refused[k] += 1
            msgs.add(str(e))
            continue
        if b not in (BASE, BASE + CHUNK, CHUNK, CHUNK + BASE):
            wrong.append(len(b))
        seen[k] += 1

run(work)
end = bytes(t)
t.release()
print(json.dumps(dict(gil=GIL, seen=sum(seen), refused=sum(refused), messages=sorted(msgs),
                      wrong=wrong[:5], end=end == BASE, in_use=pool.in_use)))
""")
    check_refusals(r, ["BlockTable"], gil_switches=True)
    assert r["wrong"] == [] and r["end"] and r["in_use"] == 0, r


def test_blocktable_argument_callbacks_run_before_the_claim():
    # __index__ of an argument runs before the table is claimed: it may use the table
    r = hammer(PRELUDE + """
from aoprim._blocktable import BlockTable
from aoprim._slab import SlabPool
pool = SlabPool(64, 16)
t = BlockTable(pool)
t.append(b"abcdefgh")

class Idx:
    def __index__(self):
        t.append(b"ij")
        return 2

t.consume(Idx())
print(json.dumps(dict(data=bytes(t).decode(), view=bytes(t.view(Idx(), 4)).decode())))
""")
    assert r["data"] == "cdefghij"
    assert r["view"] == "ef"


def test_receiver_and_arena_from_threads():
    r = hammer(PRELUDE + """
import socket, struct
from aoprim.server._receiver import Receiver
from aoprim.server._rxbuf import RxArena
from aoprim._slab import SlabPool
NRX = 2
N = 20000
CHUNK = 50
pool = SlabPool(64, 64)
arena = RxArena(pool)
got = [[] for _ in range(NRX)]
socks = []
rxs = []

def on_frame(owner, data):
    got[owner].append(int.from_bytes(data, "big"))

def on_event(owner, code, arg):
    raise AssertionError(f"event {code} {arg}")

for j in range(NRX):
    a, b = socket.socketpair()
    a.setblocking(False)
    socks.append((a, b))
    rxs.append(Receiver(arena, a.fileno(), 2, 65536, on_frame, on_event, j))

# 2-byte header + 4-byte sequence number, sent CHUNK frames at a time by threads 0 and 1
wire = [b"".join(struct.pack(">HI", 4, i) for i in range(c, min(N, c + CHUNK)))
        for c in range(0, N, CHUNK)]

refused = [0] * THREADS
msgs = set()

def work(k):
    # threads 0, 2 drive receiver 0; 1, 3 receiver 1: the same receiver from two threads
    # (Receiver refusals) and two receivers of one arena at once (RxArena refusals)
    rx = rxs[k % NRX]
    mine = got[k % NRX]
    out = socks[k % NRX][1]
    sent = 0
    for i in range(10 ** 7):
        if len(mine) >= N:
            return
        if k < NRX and sent < len(wire) and (sent + 1) * CHUNK - len(mine) < 2000:
            out.sendall(wire[sent])       # (bounded ahead of the reader: never blocks)
            sent += 1
        try:
            rx.on_readable()
            rx.pending, rx.buffered, rx.frames_in, arena.scratch_swaps
        except RuntimeError as e:
            refused[k] += 1
            msgs.add(str(e))
    raise AssertionError("the frames did not all arrive")

run(work)
out = dict(gil=GIL, refused=sum(refused), messages=sorted(msgs),
           exact=[g == list(range(N)) for g in got], frames_in=[rx.frames_in for rx in rxs],
           n=N)
for rx in rxs:
    rx.close()
arena.close()
for a, b in socks:
    a.close(); b.close()
import gc; gc.collect()
out["in_use"] = pool.in_use
print(json.dumps(out))
""")
    check_refusals(r, ["Receiver", "RxArena"], gil_switches=True)
    assert r["exact"] == [True, True]          # every frame once, in stream order
    assert r["frames_in"] == [r["n"], r["n"]]
    assert r["in_use"] == 0


def test_receiver_nested_calls_from_the_owning_thread_still_work():
    # on_frame closing its receiver, reading another receiver of the same arena and closing
    # the arena: the claim is re-entrant for the owner
    r = hammer(PRELUDE + """
import socket
from aoprim.server._receiver import Receiver
from aoprim.server._rxbuf import RxArena
from aoprim._slab import SlabPool
pool = SlabPool(64, 8)
arena = RxArena(pool)
a1, b1 = socket.socketpair(); a2, b2 = socket.socketpair()
a1.setblocking(False); a2.setblocking(False)
seen = []
def on_frame(owner, data):
    seen.append((owner, bytes(data)))
    if owner == 1:
        rx2.on_readable()          # another receiver of the same arena, nested
        rx1.on_readable()          # itself, nested: does nothing
        rx1.hold = True
        rx1.close()
        arena.close()
def on_event(owner, code, arg):
    seen.append((owner, code))
rx1 = Receiver(arena, a1.fileno(), 2, 100, on_frame, on_event, 1)
rx2 = Receiver(arena, a2.fileno(), 2, 100, on_frame, on_event, 2)
b1.sendall(b"\\x00\\x01A\\x00\\x01B"); b2.sendall(b"\\x00\\x01C")
rx1.on_readable()
print(json.dumps(dict(seen=[[o, d.decode() if isinstance(d, bytes) else d] for o, d in seen],
                      closed=[rx1.closed, arena.closed])))
""")
    assert r["seen"] == [[1, "A"], [2, "C"]]
    assert r["closed"] == [True, True]


def test_proxyparser_from_threads():
    r = hammer(PRELUDE + """
import struct
from aoprim.server._proxyproto import ProxyParser
SIG = b"\\r\\n\\r\\n\\x00\\r\\nQUIT\\n"
addr = bytes([10, 0, 0, 1, 10, 0, 0, 2]) + struct.pack(">HH", 1234, 80)
tlv = bytes([0xEE]) + struct.pack(">H", 200) + b"t" * 200
body = addr + tlv
HDR = SIG + bytes([0x21, 0x11]) + struct.pack(">H", len(body)) + body
ROUNDS = 400
taken = [0] * THREADS
refused = [0] * THREADS
msgs = set()
parsers = [ProxyParser(3, 4096) for _ in range(ROUNDS)]
bar = threading.Barrier(THREADS)

def work(k):
    for i in range(ROUNDS):
        p = parsers[i]
        bar.wait(60)                      # every thread on the same parser at once
        for j in range(30):               # once done, a feed takes nothing more
            try:
                taken[k] += p.feed(HDR + b"payload")
                p.result, p.error, p.total, p.state, repr(p)
            except RuntimeError as e:
                refused[k] += 1
                msgs.add(str(e))

run(work)
want = [2, 1, 2, ["10.0.0.1", 1234], ["10.0.0.2", 80]]
bad = [repr(p) for p in parsers if not p.done or p.total != len(HDR)]
results = set(json.dumps(p.result) for p in parsers)
print(json.dumps(dict(gil=GIL, refused=sum(refused), messages=sorted(msgs), bad=bad[:5],
                      taken=sum(taken), want_taken=ROUNDS * len(HDR),
                      results=sorted(results))))
""")
    check_refusals(r, ["ProxyParser"])
    assert r["bad"] == []                     # every parser done, header length exact
    assert r["taken"] == r["want_taken"]      # exactly one feed per parser took the header
    assert len(r["results"]) == 1             # the same parse every time
    assert json.loads(r["results"][0])[3] == ["10.0.0.1", 1234]


def test_epollcore_run_and_close_from_threads():
    r = hammer(PRELUDE + """
from aoprim.server._eloop import EpollCore
ROUNDS = 300
ran = [0] * THREADS
refused = [0] * THREADS
msgs = set()
cores = [EpollCore() for _ in range(ROUNDS)]
for c in cores:
    # every run() returns after its first iteration: a stop is always queued (the hook
    # queues the next one), so a second run() after the first never blocks
    c.call_soon(c.stop)
    c.add_iteration_hook(lambda c=c: c.call_soon(c.stop))
bar = threading.Barrier(THREADS)

def work(k):
    for i in range(ROUNDS):
        c = cores[i]
        bar.wait(60)
        try:
            if k % 2:
                c.close()
            else:
                c.run()
            ran[k] += 1
        except RuntimeError as e:
            refused[k] += 1
            msgs.add(str(e))
        bar.wait(60)

run(work)
for c in cores:
    c.close()
print(json.dumps(dict(gil=GIL, ran=sum(ran), refused=sum(refused), messages=sorted(msgs),
                      closed=all(c.closed for c in cores))))
""")
    for m in r["messages"]:
        assert ("already running" in m or "cannot close a running" in m
                or "is closed" in m), m
    assert r["closed"]
    assert r["ran"] + r["refused"] == THREADS * 300     # every call ran or was refused
    if r["gil"]:
        assert r["refused"] < THREADS * 300


def test_flushgroup_flush_from_threads():
    r = hammer(PRELUDE + """
import socket
from aoprim._sendbatch import SendBatch
from aoprim._flushgroup import FlushGroup
g = FlushGroup()
pairs = [socket.socketpair() for _ in range(4)]
batches = []
for a, b in pairs:
    a.setblocking(False)
    sb = SendBatch(a)
    g.attach(sb)
    batches.append(sb)
N = 3000
sent = [0] * THREADS
refused = [0] * THREADS
msgs = set()

def work(k):
    sb = batches[k]
    a, b = pairs[k]
    for i in range(N):
        while True:
            try:
                sb.add_copy(b"x" * 10)
                break
            except RuntimeError as e:       # a flush on another thread holds the batch
                refused[k] += 1
        sent[k] += 10
        try:
            g.flush()
        except RuntimeError as e:
            refused[k] += 1
            msgs.add(str(e))
        b.recv(65536) if i % 64 == 0 else None

run(work)
while len(g):
    g.flush()
for sb in batches:
    sb.flush()
got = []
for (a, b), sb in zip(pairs, batches):
    b.setblocking(False)
    n = 0
    while True:
        try:
            d = b.recv(1 << 20)
        except BlockingIOError:
            break
        n += len(d)
    got.append(n)
print(json.dumps(dict(gil=GIL, refused=sum(refused), messages=sorted(msgs),
                      pending=[sb.pending_bytes for sb in batches], n=N)))
""")
    for m in r["messages"]:
        assert "FlushGroup" in m, m
    assert r["pending"] == [0, 0, 0, 0]


def test_readbuf_pool_is_off_without_the_gil():
    # on a GIL build, reads of at least handout_min bytes are handed out as pooled slots
    # (no copy); on a free-threaded build the pool is off and every read is copied out
    r = hammer("""
import json, socket, sys
from aoprim.aio import _readbuf
gil = getattr(sys, "_is_gil_enabled", lambda: True)()
rb = _readbuf.ReadBuffer(262144)
size = max(rb.handout_min, 4096) * 2
a, b = socket.socketpair()
a.setblocking(False)
ok = True
for i in range(20):
    b.sendall(bytes([i]) * size)
    got = b""
    while len(got) < size:
        d = rb.recv_bytes(a)
        got += bytes(d)
    ok = ok and got == bytes([i]) * size
print(json.dumps(dict(gil=gil, pool_max=_readbuf.POOL_MAX, stats=rb.pool_stats, ok=ok)))
""")
    assert r["ok"]
    if r["gil"]:
        assert r["pool_max"] > 0 and r["stats"]["handed_out"] > 0, r
    else:
        assert r["pool_max"] == 0, r
        assert r["stats"]["slots"] == 0 and r["stats"]["handed_out"] == 0, r
