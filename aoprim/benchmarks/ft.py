"""The ``ft`` groups: scaling without the GIL, at 1 thread and at 2 (or 2 + 2) threads.

Only on a free-threaded interpreter (``sys._is_gil_enabled()`` false): under the GIL two
threads take turns and a 2/1 ratio says nothing about parallel scaling, so ``plan`` leaves
the groups out and ``python -m aoprim bench`` prints one line saying so.

Each group is one workload; each entry one implementation of it, measured as a *solo* run
(1 thread) and a *parallel* run (2 threads; the 2P2C queue group: 2 producers + 2
consumers), rounds interleaved with the implementation order rotating.  A sample is one whole
threaded run of ``n`` operations in all (the threads start together at a barrier; wall time
from the barrier to the last join).  The figure is total operations per second; the group's
ratio column compares the parallel figure with the baseline's (the stdlib's lock-based way),
and ``2/1`` is the entry's own parallel figure over its solo one (1.0: a second core adds
nothing; 2.0: perfect scaling).  ``cores`` is the process's CPU time over the wall time of
the solo and of the parallel run: the cores the run kept busy.  A solo run that keeps both
cores busy already (the queues' producer and consumer, the server's worker beside its loop
thread and client) leaves a parallel run no core to add: its 2/1 is then bounded by how much
less CPU an operation costs, not by the second core.

Every thread binds the bound methods it calls once, before the barrier (``add =
counter.fetch_add``): on a free-threaded build each reference taken to an object that
another thread owns is an atomic add on its shared reference count, so the loop body touches
the shared object only through the operation being measured.  Every implementation gets the
same treatment.  Every run checks its count: the counter's final value, every item got back
exactly once, every slot back in the pool.
"""
import queue
import sys
import threading
import time

from aoprim import AtomicInt, MPMCQueue, SlabPool, SPSCQueue, SpinLock

from . import runner
from .fmt import heading, label, ratio_cell, spread, wrap
from .cases import Unavailable

__all__ = ["FtGroup", "available", "groups", "skip_reason", "render_group"]

# the operations of one sample (all threads together), per mode; tiny: the test suite's
MODES = {"full": dict(rounds=5, scale=1.0),
         "quick": dict(rounds=3, scale=0.25),
         "tiny": dict(rounds=1, scale=0.01)}
N = 1_000_000
N_QUEUE = 400_000
BATCH = 64          # items a put_many / get_many moves in the batch rows
N_SERVER = 40_000


def skip_reason():
    """None on a free-threaded interpreter; otherwise why the ft groups do not run."""
    probe = getattr(sys, "_is_gil_enabled", None)
    if probe is None:
        return (f"Python {sys.version.split()[0]} has no free-threaded build (3.13t and up); "
                "under the GIL threads take turns, so 2-thread scaling is not measured")
    if probe():
        return ("the GIL is enabled (this is not a free-threaded build, or PYTHON_GIL=1); "
                "run `python3.13t -m aoprim bench --only ft` for the scaling figures")
    return None


def available():
    return skip_reason() is None


def _peer(module, attr):
    """An optional peer's class, or Unavailable naming what to install."""
    try:
        mod = __import__(module, fromlist=[attr])
    except ImportError as e:
        pkg = {"ft_utils.concurrency": "ft-utils", "cereggii": "cereggii"}[module]
        raise Unavailable(f"{pkg} is not installed here ({e}); `pip install {pkg}` (on 3.13t "
                          "there may be no wheel: pip then builds the sdist, which needs its "
                          "build tools to find this interpreter)") from None
    return getattr(mod, attr)


def _run_threads(bodies):
    """Start one thread per body (each a callable returning its own count), release them
    together, join; returns (wall seconds, [counts])."""
    go = threading.Barrier(len(bodies) + 1)
    counts = [None] * len(bodies)
    errors = []

    def work(i, body):
        try:
            go.wait()
            counts[i] = body()
        except BaseException as e:       # reported below: a failed run is never a figure
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i, b)) for i, b in enumerate(bodies)]
    for t in ts:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join(300)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in ts):
        raise RuntimeError("a benchmark thread did not finish in 300 s")
    return wall, counts


# -- workloads: make(threads, n) -> run() -> wall seconds for n operations in all -------------

def _counter_shared(kind):
    """One counter shared by every thread, n increments in all (a fresh counter per run)."""
    def fresh(per):
        """(the body every thread runs, a function reading the final count)"""
        if kind == "AtomicInt":
            c = AtomicInt()

            def body():
                add = c.fetch_add
                for _ in range(per):
                    add(1)
                return per
            return body, c.load
        if kind == "ft_utils":
            c = _peer("ft_utils.concurrency", "AtomicInt64")(0)

            def body():
                incr = c.incr
                for _ in range(per):
                    incr()
                return per
            return body, c.get
        if kind in ("AtomicInt +=", "ft_utils +="):
            # the in-place form: one atomic add, no argument parsing; the name it rebinds is
            # the thread's own local (the operator returns the same object), so no shared
            # variable is written
            c = (AtomicInt() if kind == "AtomicInt +=" else
                 _peer("ft_utils.concurrency", "AtomicInt64")(0))

            def body():
                mine = c
                for _ in range(per):
                    mine += 1
                return per
            return body, (c.load if kind == "AtomicInt +=" else c.get)
        if kind == "cereggii":
            c = _peer("cereggii", "AtomicInt64")(0)
            name = next((m for m in ("increment_and_get", "get_and_increment")
                         if hasattr(c, m)), None)
            if name is None:
                raise Unavailable("this cereggii's AtomicInt64 has neither increment_and_get "
                                  "nor get_and_increment")

            def body():
                add = getattr(c, name)
                for _ in range(per):
                    add(1)
                return per
            return body, c.get
        box = [0]
        if kind == "no lock":
            # the floor of the locked rows: the same shared list and int, unprotected
            # (increments are lost on a free-threaded build: the row counts operations done)
            def body():
                for _ in range(per):
                    box[0] += 1
                return per
            return body, lambda: None
        lk = SpinLock() if kind == "SpinLock" else threading.Lock()   # a lock around an int

        def body():
            for _ in range(per):
                with lk:
                    box[0] += 1
            return per
        return body, lambda: box[0]

    def make(threads, n):
        per = n // threads
        fresh(per)                       # a missing peer raises Unavailable here, at set-up

        def run():
            body, final = fresh(per)
            wall, counts = _run_threads([body] * threads)
            got = final()
            if got is not None:         # (None: the unlocked floor, whose count is not exact)
                assert got == per * threads == sum(counts), (kind, got, per * threads)
            return wall, per * threads
        return run
    return make


def _counter_own(kind):
    """One counter per thread (nothing shared but the code): n increments in all."""
    def make(threads, n):
        per = n // threads
        if kind in ("AtomicInt", "AtomicInt +="):
            cs = [AtomicInt() for _ in range(threads)]
        elif kind in ("ft_utils", "ft_utils +="):
            cs = [_peer("ft_utils.concurrency", "AtomicInt64")(0) for _ in range(threads)]
        else:
            cs = [(threading.Lock(), [0]) for _ in range(threads)]

        def body_of(c):
            if kind == "AtomicInt":
                def body():
                    add = c.fetch_add
                    for _ in range(per):
                        add(1)
                    return c.load()
            elif kind == "ft_utils":
                def body():
                    incr = c.incr
                    for _ in range(per):
                        incr()
                    return c.get()
            elif kind in ("AtomicInt +=", "ft_utils +="):
                def body():
                    mine = c               # the operator returns the same object
                    for _ in range(per):
                        mine += 1
                    return mine.load() if kind == "AtomicInt +=" else mine.get()
            else:
                lk, box = c

                def body():
                    for _ in range(per):
                        with lk:
                            box[0] += 1
                    return box[0]
            return body

        def run():
            for c in cs:                 # fresh counts per sample
                if kind == "Lock":
                    c[1][0] = 0
                elif kind in ("AtomicInt", "AtomicInt +="):
                    c.store(0)
                else:
                    c.set(0)
            wall, counts = _run_threads([body_of(c) for c in cs])
            assert counts == [per] * threads, (kind, counts, per)
            return wall, per * threads
        return run
    return make


def _slab(kind):
    """acquire + release of a 4096-byte buffer, n in all; SlabPool: one pool shared by every
    thread (16 slots, so never exhausted at 2 threads)."""
    def make(threads, n):
        per = n // threads
        if kind == "SlabPool":
            pool = SlabPool(4096, 16)

            def body():
                acq = pool.acquire
                for _ in range(per):
                    acq().release()
                return per
        else:
            def body():
                for _ in range(per):
                    bytearray(4096)
                return per

        def run():
            wall, counts = _run_threads([body] * threads)
            assert sum(counts) == per * threads
            if kind == "SlabPool":
                assert pool.in_use == 0, pool.stats
            return wall, per * threads
        return run
    return make


def _queue(kind, producers, consumers, immortal=False):
    """``producers`` threads put n items in all, ``consumers`` threads get them (blocking
    gets); every item is got exactly once.  The solo run (``threads`` 1): one thread putting
    then getting each item.  ``MPMCQueue(n)``: a capacity of every item of the run, so that
    its producers never wait for room, as SimpleQueue's (unbounded) never do.

    The items: a new int per item (made by its producer thread), or with ``immortal`` the
    ints 0-255, which CPython never reference-counts.  On a free-threaded build a consumer
    that drops the last reference to an object another thread made, while that thread is
    still running, hands the object back to it (biased reference counting: the owner merges
    the count and frees it); the immortal items measure the queue without that cost.

    ``... batch`` kinds: the same ring of 1024, items moved BATCH at a time with
    ``put_many``/``get_many`` (one claim of the ring per batch); a producer that finds the
    ring full, or a consumer that finds it empty, waits in a blocking ``put``/``get`` for one
    item and goes on with batches."""
    batched = kind.endswith(" batch")

    def new(n):
        if kind in ("MPMCQueue", "MPMCQueue batch"):
            return MPMCQueue(1024)
        if kind == "SPSCQueue batch":
            return SPSCQueue(1024)
        if kind == "MPMCQueue(n)":
            return MPMCQueue(n)
        if kind == "SPSCQueue":
            return SPSCQueue(1024)
        if kind == "SimpleQueue":
            return queue.SimpleQueue()
        if kind == "Queue":
            return queue.Queue(1024)
        return _peer("ft_utils.concurrency", "ConcurrentQueue")()

    def names(q):
        if kind == "ft_utils":
            return q.push, q.pop
        return q.put, q.get

    def make(threads, n):
        if threads == 1:
            def run():
                q = new(n)
                put, get = names(q)
                items = [i & 255 for i in range(n)] if immortal else range(n)
                t0 = time.perf_counter()
                s = 0
                if batched:
                    put_many, get_many = q.put_many, q.get_many
                    for i in range(0, n, BATCH):
                        put_many(list(items[i:i + BATCH]))   # a list: moved in one claim
                        s += sum(get_many(BATCH))
                else:
                    for i in items:
                        put(i)
                        s += get()
                wall = time.perf_counter() - t0
                assert s == sum(items), (kind, s)
                return wall, n
            return run
        per_p, per_c = n // producers, n // consumers
        total = per_p * producers
        assert per_c * consumers == total

        def run():
            q = new(total)

            def producer(base):
                items = ([i & 255 for i in range(base, base + per_p)] if immortal
                         else range(base, base + per_p))

                def body():
                    put = names(q)[0]
                    if batched:
                        put_many, i = q.put_many, 0
                        while i < per_p:
                            # a list (put_many moves a list in one claim), its ints made
                            # here, by the producer thread, as the one-at-a-time rows make them
                            k = put_many(list(items[i:i + BATCH]))
                            if not k:               # full: wait for room for one
                                put(items[i])
                                k = 1
                            i += k
                        return per_p
                    for i in items:
                        put(i)
                    return per_p
                return body

            def consumer():
                get = names(q)[1]
                s = 0
                if batched:
                    get_many, got = q.get_many, 0
                    while got < per_c:
                        b = get_many(min(BATCH, per_c - got))
                        if not b:                   # empty: wait for one
                            b = (get(),)
                        s += sum(b)
                        got += len(b)
                    return s
                for _ in range(per_c):
                    s += get()
                return s

            bodies = [producer(p * per_p) for p in range(producers)] + [consumer] * consumers
            wall, counts = _run_threads(bodies)
            want = (sum(i & 255 for i in range(total)) if immortal
                    else total * (total - 1) // 2)
            assert sum(counts[producers:]) == want, (kind, counts)
            return wall, total
        return run
    return make


# -- groups --------------------------------------------------------------------------------

class FtGroup:
    """One workload measured solo and in parallel for every implementation (module doc)."""
    kind = "contention"
    family = "ft"
    compete = True
    default = True
    unit = "M ops/s"

    def __init__(self, gid, title, entries, n, mode, parallel=2, solo=1, note=None,
                 unit=None, per_unit=1e6):
        self.id = gid
        if unit is not None:
            self.unit = unit
        self.per_unit = per_unit        # operations per unit of the figure
        self.title = title
        self.entries = entries        # [(name, role, make)]
        self.mode = MODES[mode]
        self.n = max(64, int(n * self.mode["scale"]))
        self.threads = (solo, parallel)
        self.params = {"n": self.n, "threads": parallel}
        self.series = ["ft"]
        self.note = note

    def steps(self, n_loops=0):
        return self.mode["rounds"] * len(self.entries)

    def measure(self, loops=(), loop_skips=(), progress=None):
        skipped, live = [], []
        for name, role, make in self.entries:
            try:
                solo, par = make(self.threads[0], self.n), make(self.threads[1], self.n)
                solo()                          # warm-up (and the peer's first import)
            except Unavailable as e:
                skipped.append({"name": name, "reason": str(e)})
                if progress:
                    progress.step(self.mode["rounds"])
                continue
            live.append({"name": name, "role": role, "solo": solo, "par": par,
                         "s": [], "p": [], "cs": [], "cp": []})
        for r in range(self.mode["rounds"]):
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for e in order:
                c0, t0 = time.process_time(), time.perf_counter()
                wall, ops = e["solo"]()
                e["cs"].append(_cores(c0, t0))
                e["s"].append(ops / wall / self.per_unit)
                c0, t0 = time.process_time(), time.perf_counter()
                wall, ops = e["par"]()
                e["cp"].append(_cores(c0, t0))
                e["p"].append(ops / wall / self.per_unit)
                if progress:
                    progress.step(1, f"{self.id}: {e['name']}")
        entries = []
        for e in live:
            ent = {"name": e["name"], "role": e["role"], "n": self.n, "calls_per_sample": 1,
                   "samples": [float(f"{x:.6g}") for x in e["p"]]}
            ent.update(runner.summarize(e["p"]))
            solo = runner.summarize(e["s"])
            ent["metrics"] = {"solo_mops": solo,
                              "scaling": runner.summarize(
                                  [p / s for p, s in zip(e["p"], e["s"])]),
                              # the cores busy (process CPU / wall), solo and parallel
                              "cores_solo": runner.summarize(e["cs"]),
                              "cores": runner.summarize(e["cp"])}
            entries.append(ent)
        return runner.finish_group(self, entries, skipped, better="higher",
                                   extra={"threads": list(self.threads)})


def _cores(cpu0, wall0):
    """The cores kept busy since (``time.process_time()``, ``time.perf_counter()``) were
    ``cpu0``, ``wall0``: the whole sample, its threads' start and end included (the process
    clock cannot tell those apart from the timed part)."""
    return (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)


def _spin(work):
    """The handlers' CPU work: a pure-Python loop of ``work`` steps."""
    x = 0
    for i in range(work):
        x += i * i
    return x


def _bare(work):
    """The server rows' ceiling: the handler's work alone, ``n`` calls split over the
    threads, no server, no sockets -- how far this interpreter scales that Python code on
    this machine."""
    def make(threads, n):
        per = n // threads

        def body():
            for _ in range(per):
                _spin(work)
            return per

        def run():
            wall, counts = _run_threads([body] * threads)
            assert sum(counts) == per * threads
            return wall, per * threads
        return run
    return make


def _server(work):
    """The server (u16 framing, selectors backend) with ``workers`` = the thread count, and
    a handler that spends ``work`` iterations of a pure-Python loop on each frame before
    echoing it.  The client is one thread of this process keeping 16 frames in flight on
    each of 8 connections (replies read in batches: a few syscalls per 16 frames); a sample
    is the wall time of ``n`` frames, the server started and connected before the clock."""
    import selectors
    import socket
    import struct

    from aoprim.server import Handler, Server

    payload = b"x" * 16
    fr = struct.pack(">H", len(payload)) + payload
    conns_n, window = 8, 16

    class Busy(Handler):
        def on_read(self, session, data):
            _spin(work)
            session.send(data)

    def make(threads, n):
        def run():
            srv = Server(Busy(), "127.0.0.1", 0, framing="u16", workers=threads).start()
            socks = []
            try:
                socks = [socket.create_connection(srv.address) for _ in range(conns_n)]
                sel = selectors.DefaultSelector()
                for s in socks:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sel.register(s, selectors.EVENT_READ)
                per = max(window, n // conns_n)
                sent = {s: 0 for s in socks}
                got = {s: 0 for s in socks}
                t0 = time.perf_counter()
                for s in socks:
                    sent[s] = window
                    s.sendall(fr * window)
                left = conns_n
                while left:
                    for key, _ in sel.select(30):
                        s = key.fileobj
                        b = s.recv(65536)
                        if not b:
                            raise RuntimeError("the server closed a benchmark connection")
                        before = got[s] // len(fr)
                        got[s] += len(b)
                        done = got[s] // len(fr) - before
                        more = min(done, per - sent[s])
                        if more > 0:
                            sent[s] += more
                            s.sendall(fr * more)
                        if got[s] == per * len(fr):
                            sel.unregister(s)
                            left -= 1
                wall = time.perf_counter() - t0
                sel.close()
                return wall, per * conns_n
            finally:
                for s in socks:
                    s.close()
                srv.shutdown(timeout=10)
        return run
    return make


def groups(mode):
    cs, co, sl, q = _counter_shared, _counter_own, _slab, _queue
    return [
        FtGroup("ft-atomic-shared", "one counter shared by every thread: n increments in all",
                [("threading.Lock + int", "baseline", cs("Lock")),
                 ("AtomicInt.fetch_add", "candidate", cs("AtomicInt")),
                 ("ft_utils AtomicInt64.incr", "candidate", cs("ft_utils")),
                 ("AtomicInt +=", "candidate", cs("AtomicInt +=")),
                 ("ft_utils AtomicInt64 +=", "candidate", cs("ft_utils +=")),
                 ("cereggii AtomicInt64", "candidate", cs("cereggii"))], N, mode,
                note="fetch_add(1) passes an argument that incr() does not have (about 95 "
                     "instructions of 640 per call on 3.13t); the += rows do the same work "
                     "on both"),
        FtGroup("ft-atomic-own", "one counter per thread: n increments in all",
                [("threading.Lock + int", "baseline", co("Lock")),
                 ("AtomicInt.fetch_add", "candidate", co("AtomicInt")),
                 ("ft_utils AtomicInt64.incr", "candidate", co("ft_utils")),
                 ("AtomicInt +=", "candidate", co("AtomicInt +=")),
                 ("ft_utils AtomicInt64 +=", "candidate", co("ft_utils +="))], N, mode),
        FtGroup("ft-lock-counter", "`with lock: n += 1` on one shared lock and counter",
                [("threading.Lock + int", "baseline", cs("Lock")),
                 ("SpinLock + int", "candidate", cs("SpinLock")),
                 ("no lock (the floor; updates lost)", "reference", cs("no lock"))], N, mode,
                note="the floor row does the same shared-list increment with no lock: no lock "
                     "can beat it, so baseline/floor bounds any lock's ratio to the baseline"),
        FtGroup("ft-slab", "a 4096-byte buffer: acquire + release (one shared SlabPool of 16)",
                [("bytearray(4096)", "baseline", sl("bytearray")),
                 ("SlabPool.acquire().release()", "candidate", sl("SlabPool"))], N, mode),
        FtGroup("ft-mpmc-1p1c", "1 producer + 1 consumer thread, blocking put/get "
                "(solo: one thread, put then get)",
                [("queue.Queue(1024)", "baseline", q("Queue", 1, 1)),
                 ("queue.SimpleQueue", "candidate", q("SimpleQueue", 1, 1)),
                 ("MPMCQueue(1024)", "candidate", q("MPMCQueue", 1, 1)),
                 ("MPMCQueue(n): never full", "candidate", q("MPMCQueue(n)", 1, 1)),
                 ("MPMCQueue(1024), batches of 64", "candidate", q("MPMCQueue batch", 1, 1)),
                 ("ft_utils ConcurrentQueue", "candidate", q("ft_utils", 1, 1))],
                N_QUEUE, mode),
        FtGroup("ft-mpmc-2p2c", "2 producer + 2 consumer threads on 2 cores, blocking put/get "
                "(solo: one thread, put then get)",
                [("queue.Queue(1024)", "baseline", q("Queue", 2, 2)),
                 ("queue.SimpleQueue", "candidate", q("SimpleQueue", 2, 2)),
                 ("MPMCQueue(1024)", "candidate", q("MPMCQueue", 2, 2)),
                 ("MPMCQueue(n): never full", "candidate", q("MPMCQueue(n)", 2, 2)),
                 ("MPMCQueue(1024), batches of 64", "candidate", q("MPMCQueue batch", 2, 2)),
                 ("ft_utils ConcurrentQueue", "candidate", q("ft_utils", 2, 2))],
                N_QUEUE, mode, parallel=4),
        FtGroup("ft-spsc-1p1c", "1 producer + 1 consumer thread, blocking put/get "
                "(solo: one thread, put then get)",
                [("queue.Queue(1024)", "baseline", q("Queue", 1, 1)),
                 ("queue.SimpleQueue", "candidate", q("SimpleQueue", 1, 1)),
                 ("SPSCQueue(1024)", "candidate", q("SPSCQueue", 1, 1)),
                 ("SPSCQueue(1024), batches of 64", "candidate", q("SPSCQueue batch", 1, 1))],
                N_QUEUE, mode),
        FtGroup("ft-queue-immortal", "1 producer + 1 consumer thread as above, the items the "
                "ints 0-255 (immortal: no reference count handed back between the threads)",
                [("queue.Queue(1024)", "baseline", q("Queue", 1, 1, True)),
                 ("queue.SimpleQueue", "candidate", q("SimpleQueue", 1, 1, True)),
                 ("MPMCQueue(1024)", "candidate", q("MPMCQueue", 1, 1, True)),
                 ("MPMCQueue(n): never full", "candidate", q("MPMCQueue(n)", 1, 1, True)),
                 ("SPSCQueue(1024)", "candidate", q("SPSCQueue", 1, 1, True))], N_QUEUE, mode,
                note="the same queues with items that need no reference-count hand-back: "
                     "what is left is the queue's own cost"),
    ] + [
        FtGroup(gid, f"the server: u16 echo after a {work}-step Python loop a frame; "
                "workers=1, 2",
                [("the loop alone, in threads", "baseline", _bare(work)),
                 ("Server(workers=N)", "candidate", _server(work))], n, mode,
                unit="k frames/s", per_unit=1e3,
                note="the baseline runs the handler's loop in 1 and 2 plain threads (no server: "
                     "the ceiling); for the server the client thread, the loop thread and the "
                     "workers share the machine's cores")
        for gid, work, n in (("ft-server-400", 400, N_SERVER),
                             ("ft-server-2000", 2000, N_SERVER // 4),
                             ("ft-server-10000", 10000, N_SERVER // 20))
    ]


def render_group(g):
    """The ft table: M ops/s with the parallel thread count and its spread, the ratio to
    the baseline's parallel figure, M ops/s solo, and the entry's parallel/solo."""
    solo_t, par_t = g.get("threads", [1, 2])
    lines = heading(g)
    ents = sorted(g["entries"], key=lambda e: e["median"], reverse=True)
    base = next((e for e in g["entries"] if e["role"] == "baseline"), None)
    nw = max([len(label(e)) for e in ents] + [8])
    lines.append(f"{'  entry':<{nw}} {f'{par_t} thr':>8} {'spread':>13} {'ratio':>7} "
                 f"{f'{solo_t} thr':>8} {f'{par_t}/{solo_t}':>6} {'cores':>9}")
    for e in ents:
        m = e["metrics"]
        cores = (f"{m['cores_solo']['median']:.1f}->{m['cores']['median']:.1f}"
                 if "cores" in m else "")
        lines.append(f"{label(e):<{nw}} {e['median']:>8.2f} {spread(e, '-'):>13} "
                     f"{ratio_cell(e, base):>7} {m['solo_mops']['median']:>8.2f} "
                     f"{m['scaling']['median']:>6.2f} {cores:>9}")
    if g.get("note"):
        lines += wrap(g["note"], "  note: ", "        ")
    for s in g["skipped"]:
        lines += wrap(f"{s['name']}: {s['reason']}", "  (skipped ", "    ")
    return "\n".join(lines)
