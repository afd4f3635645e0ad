"""What happens when the cyclic GC clears a compiled object first (STYLE.md habit 13).

For every compiled type: build a garbage cycle through it, collect it, then touch whatever
survives (objects held from outside, borrowed pointers, exported views).  Each scenario runs
in a fresh interpreter under PYTHONMALLOC=debug, where freed memory is overwritten, so a
use-after-free crashes visibly instead of reading stale bytes that happen to look right.

The decisions these tests pin (each is commented at its class):
- BlockTable, _TailBuffer, _FrameExporter, Slot, SlabPool, SpinLock, AtomicInt: not
  GC-tracked (no cycle can pass through them), so they die by reference count only, with
  their fields intact when __dealloc__ runs;
- RefCount: no_gc_clear (on_zero must still be there when a decref reaches 0 while the GC
  breaks the cycle elsewhere);
- MPMCQueue / SPSCQueue: tracked, and their tp_clear only drops the queued items: a queue
  the GC cleared first is a valid, empty queue.
"""
import os
import subprocess
import sys
import textwrap

import pytest

import aoprim

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(aoprim.__file__)))


def run_debug(code, extra_path=(), timeout=120):
    """Run ``code`` in a fresh interpreter under the debug allocator; return its stdout."""
    env = dict(os.environ)
    env["PYTHONMALLOC"] = "debug"
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, *extra_path])
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr
    return r.stdout


def test_blocktable_tail_survives_its_collected_table():
    # the reported repro: the tail exporter outlives a table that died in a cycle
    run_debug("""
        import gc
        from aoprim import SlabPool, BlockTable
        pool = SlabPool(64, 4)
        tails = []
        for _ in range(3):
            t = BlockTable(pool); t.append(b"xy"); tb = t.tail()
            c = [t]; c.append(c); del t, c
            tails.append(tb)
        gc.collect()
        junk = [bytearray(200) for _ in range(10000)]     # reuse the freed memory
        for tb in tails:
            assert len(tb) == 0
            try:
                memoryview(tb)[:4] = b"ABCD"
            except BufferError:
                pass
            else:
                raise AssertionError("exported the tail of a dead table")
        assert pool.in_use == 0, pool.in_use
        t = BlockTable(pool)
        assert not gc.is_tracked(t) and not gc.is_tracked(t.tail())
        print("OK")
    """)


def test_blocktable_with_exported_views_in_the_cycle():
    # a tail view and a frame view inside the garbage, a frame view outside it
    run_debug("""
        import gc
        from aoprim import SlabPool, BlockTable
        pool = SlabPool(64, 4)
        t = BlockTable(pool)
        t.append(b"hello world")
        tb = t.tail()
        inside_tail = memoryview(tb)           # pins the table (exports > 0)
        inside_frame = t.view(0, 5)
        outside = t.view(6, 11)
        c = [t, inside_tail, inside_frame]; c.append(c)
        del t, inside_tail, inside_frame, c
        gc.collect()
        junk = [bytearray(200) for _ in range(10000)]
        assert bytes(outside) == b"world"      # the block is pinned by the survivor
        try:
            memoryview(tb)
        except BufferError:
            pass
        else:
            raise AssertionError("exported the tail of a dead table")
        assert pool.in_use == 1, pool.in_use
        outside.release()
        assert pool.in_use == 0, pool.in_use
        print("OK")
    """)


def test_slot_and_pool_in_cycles():
    run_debug("""
        import gc, warnings
        from aoprim import SlabPool
        pool = SlabPool(64, 3)
        assert not gc.is_tracked(pool)
        s = pool.acquire()
        assert not gc.is_tracked(s)
        s.length = 3
        view = memoryview(s)
        c = [s, view, pool, s.data]; c.append(c)      # views of the slot in the garbage
        del view, c
        lost = pool.acquire()                          # a held slot only garbage reaches
        c = [lost]; c.append(c); del lost, c
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        junk = [bytearray(200) for _ in range(10000)]
        assert s.views == 0 and s.refs == 1
        memoryview(s)[:3] = b"abc"
        assert bytes(s.data) == b"abc"
        assert pool.in_use == 1                        # the lost slot came back
        s.release()
        assert pool.in_use == 0
        # a pool only garbage reaches, with a slot held outside: the slot keeps it alive
        p2 = SlabPool(32, 2)
        kept = p2.acquire()
        c = [p2]; c.append(c); del p2, c
        gc.collect()
        junk = [bytearray(200) for _ in range(10000)]
        memoryview(kept)[:2] = b"ok"
        kept.release()
        print("OK")
    """)


def test_spinlock_and_atomicint_in_cycles():
    run_debug("""
        import gc, threading, weakref
        from aoprim import AtomicInt, SpinLock
        lk, a = SpinLock(), AtomicInt(5)
        assert not gc.is_tracked(lk) and not gc.is_tracked(a)
        lk.acquire()
        cond = threading.Condition(lk)
        c = [lk, a, cond]; c.append(c); del c, cond
        class L(SpinLock): pass                        # subclasses are tracked (a __dict__)
        class A(AtomicInt): pass
        sub_l, sub_a = L(), A(7)
        sub_l.me, sub_a.me = sub_l, sub_a
        wl, wa = weakref.ref(sub_l), weakref.ref(sub_a)
        sub_l.acquire()
        del sub_l, sub_a
        gc.collect()
        junk = [bytearray(200) for _ in range(10000)]
        assert wl() is None and wa() is None
        assert lk.locked()
        lk.release()
        assert lk.acquire(timeout=1)
        lk.release()
        assert a.fetch_add(1) == 5 and a.load() == 6
        print("OK")
    """)


@pytest.mark.parametrize("qname", ["MPMCQueue", "SPSCQueue"])
def test_queue_cleared_by_the_gc(qname):
    run_debug(f"""
        import gc, sys, weakref
        from aoprim import {qname} as Q
        class Node:
            pass
        survivor = Node()                      # queued, but also held from outside
        base = sys.getrefcount(survivor)
        q = Q(8)
        node = Node()
        node.q = q                             # queue -> node -> queue
        q.put(node); q.put(survivor); q.put(q) # and queue -> queue
        wq, wn = weakref.ref(q), weakref.ref(node)
        del q, node
        gc.collect()
        junk = [bytearray(200) for _ in range(10000)]
        assert wq() is None and wn() is None
        assert sys.getrefcount(survivor) == base
        survivor.x = 1
        print("OK")
    """)


REFCOUNT_HOLDER = r'''
# cython: language_level=3
cimport cython
from aoprim._atomic cimport RefCount

FIRED = []

@cython.no_gc_clear
cdef class Box:
    """An object the GC cannot clear, whose item is set after construction."""
    cdef public object item
    def fire(self):
        FIRED.append(1)

@cython.no_gc_clear
cdef class Holder:
    """C code holding one reference of a RefCount: it gives it back in __dealloc__."""
    cdef RefCount rc
    def __cinit__(self, RefCount rc):
        self.rc = rc
    def __dealloc__(self):
        if self.rc.c_decref() == 0:
            self.rc.run_on_zero()
'''


def test_refcount_on_zero_survives_the_gc_breaking_its_cycle(cybuild):
    """rc -> on_zero (Box.fire) -> Box -> [Holder] -> rc.  The list is the only member
    (besides RefCount, without no_gc_clear) that the GC can clear; it is allocated after
    the RefCount, so the GC meets the RefCount first.  Clearing on_zero there would make
    the Holder's decref to 0 skip on_zero: it must run exactly once."""
    mod = cybuild("gc_refcount_holder", REFCOUNT_HOLDER)
    run_debug(f"""
        import gc
        import {mod.__name__} as m
        from aoprim import RefCount
        assert gc.is_tracked(RefCount(1, on_zero=print))
        box = m.Box()
        rc = RefCount(1, on_zero=box.fire)
        holder = m.Holder(rc)
        box.item = [holder]
        del box, rc, holder
        gc.collect()
        junk = [bytearray(200) for _ in range(10000)]
        assert m.FIRED == [1], m.FIRED
        print("OK")
    """, extra_path=[os.path.dirname(mod.__file__)])


def test_tls_conn_cycle_collected_and_closed_conn_inert():
    """TLSConn (aoprim.server._tls) and its session reference each other until the session's
    teardown calls close(): a cycle the GC must be able to collect (tracked, traversed; the
    session dies, its BIOs with it).  A TLSConn the GC cleared first has its object fields
    None, as close() leaves them: every entry point then acts closed -- the receive source
    reports EOF, mark/feed/on_readable/send_ct do nothing, the flush skips it."""
    run_debug("""
        import gc, socket, ssl, weakref
        from aoprim import SendBatch
        from aoprim.server._tls import TLSConn, TLSFlush

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        class Sess:
            pass
        tls = TLSFlush()
        a, b = socket.socketpair()
        s = Sess()
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        s.t = TLSConn(tls, s, a, ctx.wrap_bio(inc, out, server_side=True), inc, out,
                      SendBatch(a, auto_flush=False), 65536)
        w = weakref.ref(s)
        del s, inc, out
        gc.collect()
        assert w() is None, "the TLSConn <-> session cycle was not collected"

        s = Sess()
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        t = TLSConn(tls, s, a, ctx.wrap_bio(inc, out, server_side=True), inc, out,
                    SendBatch(a, auto_flush=False), 65536)
        t.mark()
        t.close()
        assert t.pending == 0
        assert t(bytearray(10)) == 0        # the source: EOF
        t.mark(); t.feed(b"x"); t.on_readable()
        assert t.send_ct() == 0
        tls.flush()                         # marked before close: skipped
        a.close(); b.close()
        print("OK")
    """)
