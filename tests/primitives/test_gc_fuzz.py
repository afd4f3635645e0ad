"""GC-order fuzzer: random object graphs of every compiled type, wired into reference cycles,
dropped, collected at random points; then every survivor is touched.

A program is a list of small instructions (hypothesis draws it).  An interpreter runs it
over a list of roots:
  new KIND         make an object (a pool, a slot, views of a slot, a table, its tail(), a
                   view(), a fork, queues, a SendBatch with data pending, RefCount with an
                   on_zero closure, SpinLock, AtomicInt, a list / dict / closure / an object
                   with __del__ that touches what it holds and may resurrect it)
  link A B         make A refer to B (append, put into a queue, add to a batch, ...)
  cycle A          put A into a self-referencing list (or a __del__ object that does)
  orphan A         move root A into a cycle that is dropped at once (garbage, unless
                   another root or a survivor reaches A)
  drop A           forget root A (it lives on only through the graph)
  keep A           make A a survivor (held by the harness until the end)
  collect          gc.collect()
  touch A          use A now
At the end every root is dropped, the collector runs, and every survivor (and everything a
__del__ resurrected) is touched: views read and written, tables appended to and read,
queues got from and put to, batches added to and flushed, counts incremented.

Invariants, after each example: no crash; no unraisable exception (sys.unraisablehook);
for every pool, the slots visibly held by survivors (Slots with references or views, the
blocks of live tables) are distinct tenures and fit in ``in_use``; once everything is
dropped and collected, every pool's ``in_use`` is exactly 0.

Scale: AOPRIM_FUZZ_EXAMPLES (default 300: about 5 s; 100 on a free-threaded build).  Long
run, under the sanitizers:
    AOPRIM_FUZZ_EXAMPLES=5000 .ci/sanitize tests/primitives/test_gc_fuzz.py

The defect shape it guards: were BlockTable's Cython-generated tp_clear to empty ``_tail``
and ``_blocks`` before ``__dealloc__`` runs, a table that the collector cleared (it sat in a
cycle) would (a) leave its tail() exporter with a dangling pointer to the freed table -- the
next len() or memoryview() of it reads freed memory -- and (b) not return its blocks: they
would come back only through Slot.__del__, with a ResourceWarning.  BlockTable is not
GC-tracked (nothing it holds can refer back to it), so the fuzzer lets the collector meet
tables in cycles; test_known_* below keep both shapes fixed.  AOPRIM_FUZZ_SAFE=1 keeps every
table alive until released (a run that looks past a defect of this kind for others).
"""
import gc
import os
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from aoprim import (AtomicInt, BlockTable, Closed, Empty, FlushGroup, Full, MPMCQueue,
                    PoolExhausted, RefCount, RefCountError, SendBatch, SlabPool, Slot, SPSCQueue,
                    SpinLock)
from aoprim.server._eloop import EpollCore
from aoprim.server._receiver import Receiver
from aoprim.server._rxbuf import RxArena
from support import FREE_THREADED

# The free-threaded build's collector walks every object in the process on each collection,
# frozen ones too (gc.freeze() only spares them the analysis): in a full suite's heap 300
# examples there take over 120 s (about 5 s with the GIL), so its default is 100.
EXAMPLES = int(os.environ.get("AOPRIM_FUZZ_EXAMPLES", "100" if FREE_THREADED else "300"))
SAFE = os.environ.get("AOPRIM_FUZZ_SAFE") == "1"     # keep tables out of the collector

TailBuffer = type(BlockTable(SlabPool(8, 1)).tail())
# what touching an object may legitimately raise (anything else is a finding)
EXPECTED = (Full, Empty, Closed, PoolExhausted, RefCountError, BufferError, BlockingIOError)


class Fin:
    """An object with __del__: touches what it holds when collected, and may resurrect it."""

    def __init__(self, h, refs, resurrect):
        self.h = h
        self.refs = refs
        self.resurrect = resurrect

    def __del__(self):
        for r in list(self.refs):
            self.h.touch(r)
        if self.resurrect:
            self.h.resurrected.append(self.refs)


class Harness:
    def __init__(self):
        self.roots = []
        self.survivors = []
        self.resurrected = []
        self.pools = []            # every pool (a pool references nothing of the graph)
        self.tables = []           # AOPRIM_FUZZ_SAFE=1: every table, kept until released
        self.socks = []
        self.peers = []

    # ---- construction ------------------------------------------------------------------

    def pick(self, i, kind=None):
        cands = [o for o in self.roots if kind is None or isinstance(o, kind)]
        return cands[i % len(cands)] if cands else None

    def pool(self, i):
        p = self.pick(i, SlabPool)
        if p is None or i % 16 == 0:
            p = SlabPool(16 << (i % 3), 6 + i % 5)
            self.pools.append(p)
        return p

    def table(self, t):
        if SAFE:
            self.tables.append(t)
        return t

    def sockpair(self):
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        self.socks.append(a)
        self.peers.append(b)
        return a

    def new(self, k, i, j):
        kinds = self.KINDS
        name = kinds[k % len(kinds)]
        obj = getattr(self, "new_" + name)(i, j)
        if obj is not None:
            self.roots.append(obj)

    def new_pool(self, i, j):
        return self.pool(0)

    def new_slot(self, i, j):
        s = self.pool(i).try_acquire()
        if s is not None:
            s.length = j % (s.size + 1)
        return s

    def new_slot_view(self, i, j):
        s = self.pick(i, Slot)
        if s is not None and s.refs:
            return memoryview(s) if j % 2 else s.data
        return None

    def new_table(self, i, j):
        t = self.table(BlockTable(self.pool(i)))
        try:
            t.append(bytes([j]) * (j % 70))
        except PoolExhausted:
            pass
        return t

    def new_tail(self, i, j):
        t = self.pick(i, BlockTable)
        try:
            tb = t.tail() if t is not None else None
        except (PoolExhausted, BufferError):
            return None
        if tb is not None and j % 2:
            return memoryview(tb)          # a live export: the table cannot change meanwhile
        return tb

    def new_view(self, i, j):
        t = self.pick(i, BlockTable)
        if t is None or not len(t):
            return None
        a = j % len(t)
        return t.view(a, a + 1 + j % 20)

    def new_fork(self, i, j):
        t = self.pick(i, BlockTable)
        try:
            return self.table(t.fork()) if t is not None else None
        except BufferError:
            return None

    def new_mpmc(self, i, j):
        return MPMCQueue(1 + i % 4)

    def new_spsc(self, i, j):
        return SPSCQueue(1 + i % 4)

    def new_batch(self, i, j):
        a = self.sockpair()
        b = SendBatch(a if j % 2 else a.fileno(), max_msgs=4, auto_flush=bool(i % 2))
        b.add(b"pending" * (1 + j % 3))
        return b

    def new_refcount(self, i, j):
        held = [self.pick(i)]
        return RefCount(1 + j % 2, on_zero=lambda: self.touch(held[0]))

    def new_lock(self, i, j):
        return SpinLock()

    def new_atomic(self, i, j):
        return AtomicInt(i)

    def new_list(self, i, j):
        return [self.pick(i)]

    def new_dict(self, i, j):
        return {j: self.pick(i)}

    def new_closure(self, i, j):
        held = self.pick(i)
        return lambda: held

    def new_fin(self, i, j):
        return Fin(self, [self.pick(i)], resurrect=bool(j % 2))

    def new_bytes(self, i, j):
        return bytes([i]) * (1 + j)

    def new_group(self, i, j):
        g = FlushGroup()
        b = self.pick(i, SendBatch)
        if b is not None:
            try:
                g.attach(b, owner=self.pick(j))
            except (RuntimeError, ValueError):
                pass
        return g

    def new_receiver(self, i, j):
        a = self.sockpair()
        peer = self.peers[-1]
        try:
            arena = RxArena(self.pool(i))
        except PoolExhausted:       # every slot held by live objects (an event loop's
            return None             # timer may hold them until the GC frees the loop)
        held = [self.pick(j)]
        rx = Receiver(arena, a.fileno(), 2, 1024, lambda owner, data: self.touch(held[0]),
                      lambda owner, ev, exc: None, held)
        peer.send(b"\x00\x03abc\x00\x05de")     # one frame and an unfinished one
        return rx

    def new_eloop(self, i, j):
        """An event loop core in cycles: its fd table, timer heap, ready queue and hooks
        hold callbacks that reach picked objects (which may reach the loop: it is in
        ``held``)."""
        lp = EpollCore()
        a = self.sockpair()
        self.peers[-1].send(b"x")               # readable: the reader runs when touched
        held = [self.pick(i), self.pick(j), lp]
        lp.set_callbacks(a.fileno(), lambda: self.touch(held[0]), None)
        lp.call_at(1e9, self.touch, held[1])    # a far timer, pending while the loop lives
        lp.call_later(0, self.touch, held)
        lp.call_soon(self.touch, held)
        lp.add_iteration_hook(lambda: held)
        return lp

    KINDS = ["pool", "slot", "slot_view", "table", "tail", "view", "fork", "mpmc", "spsc",
             "batch", "refcount", "lock", "atomic", "list", "dict", "closure", "fin",
             "bytes", "group", "receiver", "eloop"]

    # ---- wiring --------------------------------------------------------------------------

    def link(self, a, b, j):
        src, dst = self.pick(a), self.pick(b)
        if src is None:
            return
        try:
            if isinstance(src, list):
                src.append(dst)
            elif isinstance(src, dict):
                src[j] = dst
            elif isinstance(src, Fin):
                src.refs.append(dst)
            elif isinstance(src, (MPMCQueue, SPSCQueue)):
                src.put_nowait(dst)
            elif isinstance(src, SendBatch) and isinstance(dst, (bytes, memoryview, Slot)):
                src.add(dst)
            elif isinstance(src, BlockTable) and isinstance(dst, (bytes, memoryview, Slot)):
                src.append(dst)
            else:
                self.roots.append([src, dst, lambda: (src, dst)])
        except (Full, Closed, BufferError, PoolExhausted, RefCountError, ValueError):
            pass      # a released memoryview, a slot back in the pool, a full queue: fine

    def cycle(self, a, j):
        o = self.pick(a)
        if j % 2:
            c = [o]
            c.append(c)
        else:
            c = Fin(self, [o], resurrect=j % 4 == 1)
            c.refs.append(c)
        self.roots.append(c)

    def orphan(self, a, j):
        """Root a lives on only inside a cycle that is itself dropped (garbage, unless some
        other root or survivor reaches it)."""
        if not self.roots:
            return
        o = self.roots.pop(a % len(self.roots))
        if j % 3:
            c = [o]
            c.append(c)
        else:
            c = Fin(self, [o], resurrect=j % 5 == 1)
            c.refs.append(c)

    def drop(self, a):
        if self.roots:
            del self.roots[a % len(self.roots)]

    def keep(self, a):
        if self.roots:
            self.survivors.append(self.roots.pop(a % len(self.roots)))

    # ---- touching ------------------------------------------------------------------------

    def touch(self, o, depth=0, seen=None):
        """Use o as its API allows; only EXPECTED exceptions are acceptable."""
        if seen is None:
            seen = set()
        if id(o) in seen or depth > 3:
            return
        seen.add(id(o))
        try:
            self._touch(o, depth, seen)
        except EXPECTED:
            pass

    def _touch(self, o, depth, seen):
        if isinstance(o, SlabPool):
            assert 0 <= o.in_use <= o.slots, o
            s = o.try_acquire()
            if s is not None:
                s.length = 1
                s.release()
        elif isinstance(o, Slot):
            if o.refs:
                o.length = min(o.size, 3)
                with o.data as d:
                    bytes(d)
                with memoryview(o) as m:
                    m[0] = 7
                o.retain().release()
            else:
                with pytest.raises(RefCountError):
                    o.retain()
        elif isinstance(o, memoryview):
            try:
                bytes(o[:8])
                if len(o) and not o.readonly:
                    o[0] = o[0]
            except ValueError:       # released
                pass
        elif isinstance(o, BlockTable):
            o.append(b"ab")
            assert bytes(o) == o.read()
            v = o.view(0, 3)
            if isinstance(v, memoryview):
                v.release()
            f = o.fork()
            f.append(b"c")
            f.release()
            if len(o):
                o.consume(1)
        elif isinstance(o, TailBuffer):
            len(o)
            with memoryview(o) as m:
                if len(m):
                    m[0] = 1
        elif isinstance(o, (MPMCQueue, SPSCQueue)):
            len(o)
            x = o.get_nowait()
            self.touch(x, depth + 1, seen)
            o.put_nowait(x)
        elif isinstance(o, SendBatch):
            o.add(b"zz")
            o.flush()
            assert o.pending_bytes >= 0 and o.pending_msgs >= 0
        elif isinstance(o, RefCount):
            if o.try_incref():
                o.decref()
        elif isinstance(o, SpinLock):
            if o.acquire(False):
                o.release()
        elif isinstance(o, AtomicInt):
            o.fetch_add(1)
        elif isinstance(o, (list, tuple)):
            for x in list(o):
                self.touch(x, depth + 1, seen)
        elif isinstance(o, dict):
            for x in list(o.values()):
                self.touch(x, depth + 1, seen)
        elif isinstance(o, Fin):
            for x in list(o.refs):
                self.touch(x, depth + 1, seen)
        elif callable(o) and getattr(o, "__name__", "") == "<lambda>":
            self.touch(o(), depth + 1, seen)
        elif FlushGroup is not None and isinstance(o, FlushGroup):
            o.flush()
        elif Receiver is not None and isinstance(o, Receiver):
            if not o.closed:
                o.on_readable()
        elif EpollCore is not None and isinstance(o, EpollCore):
            assert o.pending_timers >= 0
            o.reader_of(0)
            # one iteration (every callback kind runs) -- but never a loop inside another
            # loop's callback: nested runs would only exhaust the stack
            if not o.closed and not o.running and not getattr(self, "_in_loop", False):
                self._in_loop = True
                try:
                    o.call_soon(o.stop)
                    o.run()
                finally:
                    self._in_loop = False

    def touch_survivors(self):
        for o in list(self.survivors) + list(self.resurrected):
            self.touch(o)

    # ---- invariants ----------------------------------------------------------------------

    def held(self):
        """Per pool: (indices of live Slots seen from the survivors, blocks of live tables)."""
        slots, blocks = {}, {}
        seen = set()
        stack = list(self.survivors) + list(self.resurrected)
        while stack:
            o = stack.pop()
            if id(o) in seen:
                continue
            seen.add(id(o))
            if isinstance(o, Slot):
                if o.refs or o.views:
                    slots.setdefault(o.index, set()).add(id(o))
            elif isinstance(o, BlockTable):
                blocks.setdefault(id(o.pool), set()).update(o.blocks)
            elif isinstance(o, memoryview):
                try:
                    stack.append(o.obj)
                except ValueError:       # released
                    pass
            elif isinstance(o, (list, tuple)):
                stack.extend(o)
            elif isinstance(o, dict):
                stack.extend(o.values())
            elif isinstance(o, Fin):
                stack.extend(o.refs)
        return slots, blocks

    def check_pools(self):
        if len(self.pools) == 1:
            slots, blocks = self.held()
            p = self.pools[0]
            tenures = {i: ids for i, ids in slots.items()}
            for i, ids in tenures.items():
                assert len(ids) == 1, f"slot {i} has {len(ids)} live Slot objects at once"
            mine = blocks.get(id(p), set())
            assert not (set(tenures) & mine), "a block of a table is also a user's Slot"
            assert len(set(tenures) | mine) <= p.in_use <= p.slots, p
        for p in self.pools:
            assert 0 <= p.in_use <= p.slots, p

    def drop_all(self):
        """Drop every root and survivor; collect until no __del__ resurrects anything more
        (a Fin reachable from a survivor is finalized only now, and may resurrect)."""
        for _ in range(20):
            self.roots.clear()
            self.survivors.clear()
            self.resurrected.clear()
            gc.collect()
            if not (self.roots or self.survivors or self.resurrected):
                break

    def teardown(self):
        self.drop_all()
        for t in self.tables:
            try:
                t.release()
            except BufferError:      # a tail view still exported somewhere: a leak, below
                pass
        self.tables.clear()
        gc.collect()
        gc.collect()
        for p in self.pools:
            assert p.in_use == 0, f"{p}: slots not returned after everything was collected"
        for s in self.socks + self.peers:
            s.close()


OPS = st.tuples(
    st.sampled_from(["new"] * 6 + ["link"] * 3 + ["cycle", "orphan", "orphan", "drop", "keep",
                                                  "keep", "collect", "touch"]),
    st.integers(0, 255), st.integers(0, 255), st.integers(0, 255))


def run_program(program):
    unraisable = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    # Everything older than this example goes to the permanent generation: each collection
    # then walks only the example's own objects (a full pytest heap costs ~50 ms per walk)
    # -- with the GIL; the free-threaded collector still visits them (EXAMPLES above).
    gc.freeze()
    h = Harness()
    try:
        with warnings.catch_warnings():
            # Deliberate: the program drops held Slots; the collector gives them back with a
            # ResourceWarning (docs/api.md, `Slot`): the documented outcome, not a fault.
            warnings.filterwarnings("ignore", category=ResourceWarning,
                                    message="Slot .* was garbage-collected")
            for op, a, b, c in program:
                if op == "new":
                    h.new(a, b, c)
                elif op == "link":
                    h.link(a, b, c)
                elif op == "cycle":
                    h.cycle(a, b)
                elif op == "orphan":
                    h.orphan(a, b)
                elif op == "drop":
                    h.drop(a)
                elif op == "keep":
                    h.keep(a)
                elif op == "collect":
                    gc.collect(a % 3)      # young generations only, or all
                elif op == "touch" and h.roots:
                    h.touch(h.roots[a % len(h.roots)])
            h.roots.clear()
            gc.collect()
            h.touch_survivors()        # (no loop variable here: it would keep one alive)
            h.check_pools()
            h.teardown()
    except BaseException:
        # a failing example: drop its objects now, under the warning filter above (the
        # traceback keeps the harness alive; its Slots would warn in some later test)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            h.drop_all()
            h.tables.clear()
            gc.collect()
            for sk in h.socks + h.peers:
                sk.close()
        raise
    finally:
        gc.unfreeze()
        sys.unraisablehook = old_hook
    assert not unraisable, [(u.exc_type, u.exc_value, u.object) for u in unraisable]


@pytest.mark.timeout(300)
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(OPS, min_size=15, max_size=80))
def test_gc_order_fuzz(program):
    run_program(program)


def test_fuzzer_sees_a_slot_leak():
    """The in_use invariant can fail: a harness that forgets one acquired slot is caught."""
    h = Harness()
    p = h.pool(0)
    leaked = p.acquire()
    with pytest.raises(AssertionError, match="not returned"):
        h.teardown()
    leaked.release()


# ---- the tp_clear shapes, each in a subprocess (a dangling exporter crashes it) ------------

def _run_child(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        # under .ci/sanitize: the child's (expected) report goes to its stderr, here, not to
        # the run's report folder, which must stay empty
        if var in env:
            env[var] = ":".join(o for o in env[var].split(":")
                                if not o.startswith("log_path="))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, env=env)


def test_known_tail_exporter_outlives_table_cleared_in_cycle():
    """A use after free if the table's tp_clear runs before __dealloc__: the tail exporter
    must stay valid after its table is cleared in a cycle."""
    r = _run_child("""
        import gc
        from aoprim import SlabPool, BlockTable
        p = SlabPool(64, 4)
        t = BlockTable(p)          # created before the list: the collector clears it first
        tb = t.tail()
        cyc = [t]
        cyc.append(cyc)
        del t, cyc
        gc.collect()
        try:
            memoryview(tb)         # the table is gone: must be BufferError, not freed memory
        except BufferError:
            pass
        assert len(tb) == 0, len(tb)
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-3000:])


def test_known_table_cleared_in_cycle_returns_blocks_quietly():
    """Was: blocks came back only through Slot.__del__ with a ResourceWarning."""
    r = _run_child("""
        import gc, warnings
        warnings.simplefilter("error", ResourceWarning)
        import sys
        bad = []
        sys.unraisablehook = bad.append
        from aoprim import SlabPool, BlockTable
        p = SlabPool(64, 8)
        t = BlockTable(p)
        t.append(b"x" * 100)
        f = t.fork()
        cyc = [t]
        cyc.append(cyc)
        del t, cyc
        gc.collect()
        assert p.in_use == 2, p          # the fork still holds both blocks
        del f
        assert p.in_use == 0, p
        assert not bad, [str(u.exc_value) for u in bad]
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-3000:])
