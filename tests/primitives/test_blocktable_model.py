"""BlockTable against a bytearray model (hypothesis).

Random sequences of append / consume / read / fork / release / tail()+commit / view / drop,
over several tables sharing one small pool (tiny blocks, so every operation crosses block
boundaries and the pool runs dry).  Each table (forks included) has its own bytearray.
After every step:
- bytes(t), len(t) and read() of every live table equal its model;
- every view still held shows the bytes it showed when made (committed bytes never change,
  whatever the table and its forks do afterwards);
- pool.in_use is exact: the distinct blocks of the live tables, plus the blocks pinned by
  held views (a view pins its block even after the table dropped it).
PoolExhausted must leave a table unchanged.

Mutations this catches (each tried on a scratch build, see the commit message): a write
into a shared last block without copying it first (a fork sees the other side's append),
and consume() returning a block that a view still pins.
"""
import os

from hypothesis import HealthCheck, given, settings, strategies as st

from aoprim import BlockTable, PoolExhausted, SlabPool

EXAMPLES = int(os.environ.get("AOPRIM_MODEL_EXAMPLES", "150"))
B = 8          # bytes per block
SLOTS = 40
PATTERN = bytes(range(251)) * 2     # no two nearby bytes alike: a misplaced copy shows


def data(n, c):
    return PATTERN[c % 251:c % 251 + n] if n <= 251 else (PATTERN * (n // 251 + 1))[:n]


class Model:
    def __init__(self):
        self.pool = SlabPool(B, SLOTS)
        self.tables = []             # [table, bytearray model]
        self.views = []              # [memoryview, bytes seen, pinned block index]

    def table(self, k):
        return self.tables[k % len(self.tables)] if self.tables else None

    def start(self, t):
        """Offset of logical byte 0 in the first block, from the public properties."""
        nb = len(t.blocks)
        if nb == 0:
            return 0
        fill = B - t.tail_room
        return (nb - 1) * B + fill - len(t)

    def check(self):
        for t, m in self.tables:
            assert len(t) == len(m)
            assert bytes(t) == bytes(m)
            assert t.read() == bytes(m)
        for v, seen, _ in self.views:
            assert bytes(v) == seen, "a held view changed under the table's mutations"
        held = set()
        for t, _ in self.tables:
            held.update(t.blocks)
        held.update(idx for _, _, idx in self.views)
        assert self.pool.in_use == len(held), (self.pool.in_use, sorted(held))

    def step(self, op, k, n, c):
        e = self.table(k)
        if op == "new" or e is None:
            self.tables.append([BlockTable(self.pool), bytearray()])
            return
        t, m = e
        if op == "append":
            d = data(n % (3 * B + 2), c)
            before = (bytes(t), t.blocks)
            try:
                t.append(d)
            except PoolExhausted:
                assert (bytes(t), t.blocks) == before, "PoolExhausted changed the table"
                return
            m.extend(d)
        elif op == "consume":
            n = n % (len(m) + 1)
            t.consume(n)
            del m[:n]
        elif op == "read":
            a, b = n % (len(m) + 3) - 1, c % (len(m) + 3) - 1   # negatives and clamping too
            assert t.read(a, b) == bytes(m[a:b])
            assert t.read(a) == bytes(m[a:])
        elif op == "fork":
            self.tables.append([t.fork(), bytearray(m)])
        elif op == "release":
            t.release()
            m.clear()
        elif op == "drop":
            self.tables.remove(e)
        elif op in ("tail", "tail_nocommit"):
            try:
                tb = t.tail()
            except PoolExhausted:
                return
            with memoryview(tb) as w:
                assert 1 <= len(w) <= B and len(w) == t.tail_room
                q = n % (len(w) + 1)
                w[:q] = data(q, c)
                w[q:] = b"\xee" * (len(w) - q)      # scribble past what gets committed
            if op == "tail":
                t.commit(q)
                m.extend(data(q, c))
        elif op == "view":
            if not m:
                assert t.view() == b""
                return
            a = n % len(m)
            b = a + 1 + c % B
            v = t.view(a, b)
            assert bytes(v) == bytes(m[a:b])
            if isinstance(v, memoryview):
                assert v.readonly
                if c % 3 == 0:                      # keep it: it pins its block
                    idx = t.blocks[(self.start(t) + a) // B]
                    self.views.append([v, bytes(v), idx])
                else:
                    v.release()
        elif op == "unview" and self.views:
            v = self.views.pop(n % len(self.views))
            v[0].release()


OPS = st.lists(st.tuples(
    st.sampled_from(["new", "append", "append", "append", "consume", "read", "fork", "fork",
                     "release", "drop", "tail", "tail_nocommit", "view", "view", "unview"]),
    st.integers(0, 63), st.integers(0, 255), st.integers(0, 255)), min_size=10, max_size=100)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(OPS)
def test_blocktable_matches_bytearray_model(ops):
    md = Model()
    for op in ops:
        md.step(*op)
        md.check()
    for v in md.views:
        v[0].release()
    md.views.clear()
    md.check()
    md.tables.clear()
    assert md.pool.in_use == 0


def test_model_start_matches_views():
    """The model's start() (from public properties) agrees with what view() pins."""
    md = Model()
    md.step("new", 0, 0, 0)
    md.step("append", 0, 19, 1)
    md.step("consume", 0, 11, 0)
    t, m = md.tables[0]
    assert md.start(t) == 11 % B
    md.check()
