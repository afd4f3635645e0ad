"""Issue 19, "Compiled core": hostile offsets, counts and failure paths in the compiled
modules change nothing and raise a clear exception (never a crash, a leak or a half-done
operation)."""
import pytest

from aoprim import BlockTable, SlabPool

pytestmark = pytest.mark.timeout(60)

HUGE = [2**63 - 1, 2**63 - 8, 2**63, 2**64 + 5, 10**30, -1, -2**63, -2**63 - 1, -10**30]


@pytest.fixture
def table():
    pool = SlabPool(64, 8)
    t = BlockTable(pool)
    t.append(bytes(range(100)))
    yield t
    t.release()


@pytest.mark.parametrize("pos", HUGE)
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_blocktable_uint_huge_or_negative_pos_raises(table, pos, size):
    # item 16: p + n > nbytes overflowed for p near 2**63 and read far out of bounds
    with pytest.raises(ValueError):
        table.uint(pos, size)
    assert table.uint(100 - size, size) == int.from_bytes(bytes(range(100 - size, 100)), "big")
    with pytest.raises(ValueError):
        table.uint(101 - size, size)


@pytest.mark.parametrize("pos", HUGE)
def test_blocktable_frame_huge_or_negative_pos_raises(table, pos):
    with pytest.raises(ValueError):
        table.frame(pos, 8)


@pytest.mark.parametrize("n", HUGE)
def test_blocktable_consume_commit_huge_raise_and_change_nothing(table, n):
    with pytest.raises(ValueError):
        table.consume(n)
    with pytest.raises(ValueError):
        table.commit(n)
    assert len(table) == 100 and table.read() == bytes(range(100))


@pytest.mark.parametrize("a", HUGE + [0, 50, 100])
@pytest.mark.parametrize("b", HUGE + [None, 0, 50, 100])
def test_blocktable_view_read_clamp_like_slices(table, a, b):
    ref = bytes(range(100))[a:b]
    assert table.read(a, b) == ref
    assert bytes(table.view(a, b)) == ref
