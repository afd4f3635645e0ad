"""BlockTable: appends across block boundaries, reads of every range, fork/COW isolation,
consume returning blocks, the receive fast path, and a stateful model test."""
import gc
import socket
import tracemalloc

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aoprim import PoolExhausted
from aoprim._blocktable import BlockTable
from aoprim._slab import SlabPool

B = 8


def data(n, seed=0):
    return bytes((seed + i * 7) % 251 for i in range(n))


@pytest.fixture
def pool():
    p = SlabPool(B, 64)
    yield p
    gc.collect()
    assert p.in_use == 0, "a test leaked blocks"


# ---- append / read ------------------------------------------------------------------------

@pytest.mark.parametrize("first", range(0, 2 * B + 2))
def test_append_across_boundaries(pool, first):
    for second in range(0, 2 * B + 2):
        for third in (0, 1, B - 1, B, B + 1):
            t = BlockTable(pool)
            a, b, c = data(first, 1), data(second, 2), data(third, 3)
            t.append(a)
            t.append(bytearray(b))
            t.append(memoryview(c))
            n = first + second + third
            assert len(t) == n
            assert bytes(t) == a + b + c
            assert len(t.blocks) == -(-n // B)      # the last block is filled first
            assert len(set(t.blocks)) == len(t.blocks)
            assert pool.in_use == len(t.blocks)
            t.release()


def test_constructor_needs_a_pool():
    for bad in (None, 4096, object()):
        with pytest.raises(TypeError):
            BlockTable(bad)


def test_append_accepts_bytes_like_and_rejects_others(pool):
    t = BlockTable(pool)
    t.append(memoryview(b"abc"))
    t.append(bytearray(b"de"))
    t.append(b"")
    assert bytes(t) == b"abcde"
    for bad in ("str", 3, None, [1]):
        with pytest.raises(TypeError):
            t.append(bad)
    assert bytes(t) == b"abcde"
    t.release()


def test_reads_of_every_range(pool):
    t = BlockTable(pool)
    model = data(3 * B + 3)
    t.append(model[:5])
    t.append(model[5:])
    n = len(model)
    for a in range(-n - 2, n + 3):
        for b in list(range(-n - 2, n + 3)) + [None]:
            assert t.read(a, b) == model[a:b], (a, b)
            v = t.view(a, b)
            assert bytes(v) == model[a:b], (a, b)
            if isinstance(v, memoryview):
                v.release()
    assert t.read() == model and t.read(None, None) == model
    with pytest.raises(TypeError):
        t.read(1.0)
    with pytest.raises(TypeError):
        t.read(0, "3")
    t.release()


def test_view_is_zero_copy_within_a_block_and_copies_across(pool):
    t = BlockTable(pool)
    t.append(data(2 * B))
    v = t.view(1, B - 1)
    assert isinstance(v, memoryview) and bytes(v) == data(2 * B)[1:B - 1]
    w = t.view(B - 2, B + 2)
    assert isinstance(w, bytes)
    v.release()
    t.release()


def test_exhaustion_leaves_table_unchanged():
    p = SlabPool(B, 3)
    t = BlockTable(p)
    t.append(data(B + 3))
    before = (bytes(t), t.blocks)
    with pytest.raises(PoolExhausted):
        t.append(data(2 * B + 1))          # needs 2 more blocks, only 1 free
    assert (bytes(t), t.blocks) == before and p.in_use == 2
    t.append(data(B - 3 + B))              # exactly fills the free block
    assert len(t) == 3 * B and p.available == 0
    with pytest.raises(PoolExhausted):
        t.append(b"x")
    assert len(t) == 3 * B
    t.release()
    assert p.available == 3


# ---- fork / COW ---------------------------------------------------------------------------

def test_fork_shares_blocks_and_cow_both_ways(pool):
    t = BlockTable(pool)
    t.append(data(B + 3))
    f = t.fork()
    assert f.blocks == t.blocks and pool.in_use == 2      # shared, not copied
    f.append(b"FORK")
    assert bytes(t) == data(B + 3)
    assert bytes(f) == data(B + 3) + b"FORK"
    assert f.blocks[0] == t.blocks[0] and f.blocks[1] != t.blocks[1]
    t.append(b"ORIG")
    assert bytes(t) == data(B + 3) + b"ORIG"
    assert bytes(f) == data(B + 3) + b"FORK"
    t.release()
    assert bytes(f) == data(B + 3) + b"FORK"
    f.release()


def test_fork_of_full_last_block_needs_no_copy(pool):
    t = BlockTable(pool)
    t.append(data(2 * B))
    f = t.fork()
    f.append(b"x")
    assert f.blocks[:2] == t.blocks and pool.in_use == 3
    assert bytes(t) == data(2 * B)
    t.release()
    f.release()


def test_fork_then_original_appends_first(pool):
    t = BlockTable(pool)
    t.append(b"abc")
    f = t.fork()
    t.append(b"T")             # t copies (shared)
    f.append(b"F")             # f is now the only holder of the old block: in place
    assert bytes(t) == b"abcT" and bytes(f) == b"abcF"
    assert t.blocks != f.blocks
    t.release()
    f.release()


# ---- consume / release --------------------------------------------------------------------

def test_consume_returns_blocks_as_they_empty(pool):
    t = BlockTable(pool)
    model = data(4 * B)
    t.append(model)
    blocks = t.blocks
    t.consume(3)
    assert t.blocks == blocks and bytes(t) == model[3:]
    t.consume(B - 3)
    assert t.blocks == blocks[1:] and pool.in_use == 3
    t.consume(B + 1)
    assert t.blocks == blocks[2:] and bytes(t) == model[2 * B + 1:]
    t.consume(0)
    t.append(b"zz")
    assert bytes(t) == model[2 * B + 1:] + b"zz"
    t.consume(len(t))
    assert len(t) == 0 and t.blocks == () and pool.in_use == 0
    with pytest.raises(ValueError):
        t.consume(1)
    with pytest.raises(ValueError):
        t.consume(-1)
    with pytest.raises(TypeError):
        t.consume(1.0)


def test_release_empties_and_table_is_reusable(pool):
    t = BlockTable(pool)
    t.append(data(3 * B))
    t.release()
    assert len(t) == 0 and t.blocks == () and pool.in_use == 0
    t.append(b"again")
    assert bytes(t) == b"again"
    t.release()
    t.release()


def test_view_pins_its_block_after_consume(pool):
    t = BlockTable(pool)
    t.append(data(2 * B))
    v = t.view(0, 4)
    blk = t.blocks[0]
    t.consume(B)                        # the table drops block 0
    assert blk not in t.blocks
    assert pool.in_use == 2             # ... but the view keeps it out of the pool
    assert bytes(v) == data(4)
    v.release()
    assert pool.in_use == 1
    t.release()


def test_dropping_a_table_returns_its_blocks(pool):
    t = BlockTable(pool)
    t.append(data(3 * B))
    f = t.fork()
    del t
    gc.collect()
    assert pool.in_use == 3
    del f
    gc.collect()
    assert pool.in_use == 0


# ---- receive fast path --------------------------------------------------------------------

def test_tail_commit(pool):
    t = BlockTable(pool)
    tail = t.tail()
    assert len(tail) == B and t.tail_room == B
    memoryview(tail)[:3] = b"abc"
    t.commit(3)
    assert bytes(t) == b"abc" and t.tail_room == B - 3
    assert t.tail() is tail
    m = memoryview(t.tail())
    assert len(m) == B - 3
    with pytest.raises(BufferError):
        t.commit(1)
    with pytest.raises(BufferError):
        t.append(b"x")
    with pytest.raises(BufferError):
        t.consume(1)
    m[:] = b"defgh"
    m.release()
    t.commit(B - 3)
    assert bytes(t) == b"abcdefgh" and t.tail_room == 0
    with pytest.raises(ValueError):
        t.commit(1)
    assert len(memoryview(t.tail())) == B   # a new block
    t.commit(0)
    with pytest.raises(ValueError):
        t.commit(-1)
    with pytest.raises(TypeError):
        t.commit(1.5)
    t.release()


def test_tail_copies_a_shared_block(pool):
    t = BlockTable(pool)
    t.append(b"abc")
    f = t.fork()
    with memoryview(t.tail()) as m:
        m[:2] = b"XY"
    t.commit(2)
    assert bytes(t) == b"abcXY" and bytes(f) == b"abc"
    assert t.blocks != f.blocks
    t.release()
    f.release()


def test_recv_into_tail_and_cut_frames(pool):
    a, b = socket.socketpair()
    try:
        t = BlockTable(pool)
        msgs = [data(n, n) for n in (1, 5, 9, 17, 2, 30)]
        stream = b"".join(len(m).to_bytes(2, "big") + m for m in msgs)
        a.sendall(stream)
        got = []
        while len(got) < len(msgs):
            n = b.recv_into(t.tail())
            t.commit(n)
            while len(t) >= 2 and len(t) >= 2 + t.uint(0, 2):
                size = t.uint(0, 2)
                v = t.view(2, 2 + size)
                got.append(bytes(v))
                if isinstance(v, memoryview):
                    v.release()
                t.consume(2 + size)
        assert got == msgs and len(t) == 0
    finally:
        a.close()
        b.close()


def test_uint(pool):
    t = BlockTable(pool)
    t.append(bytes(range(1, 20)))
    assert t.uint(0, 1) == 1
    assert t.uint(6, 4) == int.from_bytes(bytes(range(7, 11)), "big")   # spans blocks
    assert t.uint(0, 8) == int.from_bytes(bytes(range(1, 9)), "big")
    for bad in ((0, 0), (0, 9), (-1, 2), (18, 2)):
        with pytest.raises(ValueError):
            t.uint(*bad)
    with pytest.raises(TypeError):
        t.uint(0.0, 2)
    t.release()


def test_tail_outliving_table_refuses_export(pool):
    t = BlockTable(pool)
    tail = t.tail()
    del t
    gc.collect()
    with pytest.raises(BufferError):
        memoryview(tail)


def test_receive_path_allocates_nothing_when_warm():
    p = SlabPool(4096, 8)
    t = BlockTable(p)
    chunk = b"".join(len(m).to_bytes(2, "big") + m for m in [b"x" * 20, b"y" * 40] * 10)

    def one_read():
        tail = t.tail()
        m = memoryview(tail)
        m[:len(chunk)] = chunk
        m.release()
        t.commit(len(chunk))
        pos = 0
        while pos + 2 <= len(t):
            size = t.uint(pos, 2)
            v = t.view(pos + 2, pos + 2 + size)
            v.release()
            pos += 2 + size
        t.consume(pos)

    for _ in range(1000):
        one_read()
    tracemalloc.start()
    try:
        s0 = tracemalloc.take_snapshot()
        for _ in range(20_000):
            one_read()
        s1 = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    growth = sum(x.size_diff for x in s1.compare_to(s0, "filename"))
    assert growth < 2048
    assert p.in_use == 0
    t.release()


# ---- stateful model test ------------------------------------------------------------------

class TableModel(RuleBasedStateMachine):
    """Several tables (forks included) against bytearray models; every block accounted."""

    def __init__(self):
        super().__init__()
        self.pool = SlabPool(B, 40)
        self.tables = [(BlockTable(self.pool), bytearray())]

    def pick(self, i):
        return self.tables[i % len(self.tables)]

    @rule(i=st.integers(0, 7), chunk=st.binary(max_size=3 * B + 1))
    def append(self, i, chunk):
        t, m = self.pick(i)
        try:
            t.append(chunk)
        except PoolExhausted:
            pass
        else:
            m += chunk

    @rule(i=st.integers(0, 7), data=st.data())
    def consume(self, i, data):
        t, m = self.pick(i)
        n = data.draw(st.integers(0, len(m)))
        t.consume(n)
        del m[:n]

    @precondition(lambda self: len(self.tables) < 6)
    @rule(i=st.integers(0, 7))
    def fork(self, i):
        t, m = self.pick(i)
        self.tables.append((t.fork(), bytearray(m)))

    @rule(i=st.integers(0, 7))
    def release(self, i):
        t, m = self.pick(i)
        t.release()
        m.clear()

    @rule(i=st.integers(0, 7), n=st.integers(0, B))
    def tail_commit(self, i, n):
        t, m = self.pick(i)
        try:
            tail = t.tail()
        except PoolExhausted:
            return
        k = min(n, t.tail_room)
        payload = bytes([0xA0 + len(m) % 16]) * k
        with memoryview(tail) as v:
            v[:k] = payload
        t.commit(k)
        m += payload

    @rule(i=st.integers(0, 7), a=st.integers(-40, 40), b=st.integers(-40, 40) | st.none())
    def read(self, i, a, b):
        t, m = self.pick(i)
        assert t.read(a, b) == bytes(m[a:b])
        v = t.view(a, b)
        assert bytes(v) == bytes(m[a:b])
        if isinstance(v, memoryview):
            v.release()

    @invariant()
    def contents_match(self):
        for t, m in self.tables:
            assert len(t) == len(m)
            assert bytes(t) == bytes(m)
            assert len(t.blocks) >= -(-len(m) // B)

    @invariant()
    def blocks_accounted(self):
        used = set()
        for t, _ in self.tables:
            used.update(t.blocks)
        assert self.pool.in_use == len(used)

    def teardown(self):
        for t, _ in self.tables:
            t.release()
        assert self.pool.in_use == 0


TestTableModel = TableModel.TestCase
TestTableModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("header", [1, 2, 4])
def test_frame_cuts_length_prefixed_frames_split_at_every_point(header):
    p = SlabPool(B, 64)
    payloads = [b"", b"a", data(B - 1, 1), data(B, 2), data(B + 3, 3), data(2, 4)]
    stream = b"".join(len(x).to_bytes(header, "big") + x for x in payloads)
    for cut in range(len(stream) + 1):
        t = BlockTable(p)
        got = []
        for part in (stream[:cut], stream[cut:]):
            t.append(part)
            pos = 0
            while (f := t.frame(pos, header)) is not None:
                got.append(bytes(f))
                pos += header + len(f)
                if isinstance(f, memoryview):
                    assert f.readonly
                    f.release()
            t.consume(pos)
        assert got == payloads, cut
        assert len(t) == 0
        t.release()
    assert p.in_use == 0


def test_frame_argument_errors(pool):
    t = BlockTable(pool)
    t.append(b"\x00\x05ab")
    assert t.frame(0, 2) is None          # payload incomplete
    assert t.frame(3, 2) is None          # header incomplete
    assert t.frame(4, 2) is None
    for bad in ((0, 0), (0, 9), (-1, 2), (5, 2)):
        with pytest.raises(ValueError):
            t.frame(*bad)
    with pytest.raises(TypeError):
        t.frame(0, 2.0)
    t.release()


def test_frame_views_are_read_only_so_forks_stay_isolated(pool):
    t = BlockTable(pool)
    t.append(b"\x03abc")
    f = t.fork()
    v = t.frame(0, 1)
    assert isinstance(v, memoryview) and v.readonly
    with pytest.raises(TypeError):
        v[0] = 0
    v.release()
    assert bytes(f) == b"\x03abc"
    t.release()
    f.release()
