"""The soak (tests/support/soak.py, also ``.ci/soak [SECONDS]``) for AOP_SOAK_SECONDS (default 5):
echo and chat, u16, workers=0 and 2, under mixed load; flat resources, zero mismatches."""
import io
import os

import pytest

import soak

SECONDS = float(os.environ.get("AOP_SOAK_SECONDS", "5"))


@pytest.mark.timeout(SECONDS + 150)
def test_soak():
    out = io.StringIO()
    ok, rows = soak.run(SECONDS, out=out)
    print(out.getvalue())
    assert ok, out.getvalue()
    assert len(rows) == len(soak.CONFIGS)
    for row, _ in rows:
        assert row["mismatch"] == 0 and row["frames"] > 0, row
