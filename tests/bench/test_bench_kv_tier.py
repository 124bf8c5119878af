"""bench/kv_tier.py --smoke on the tiny model: the script behind the KV tier's
figures starts both rows (a DP=2 cache-aware server without and with
--kv-offload-memory), sends its 4 requests to each, and writes its markdown
section with both rows complete and their prompt tokens by tier. Measures nothing
(no timing asserts): it checks that the script runs."""

from __future__ import annotations

import pytest
from bench_smoke import run_smoke, table_rows

pytestmark = [pytest.mark.procs, pytest.mark.slow]


def test_the_kv_tier_benchmark_runs_in_smoke_mode(tiny_llama, tmp_path):
    text = run_smoke("kv_tier.py", tiny_llama, tmp_path / "benchmarks.md")
    assert "## KV host tier at DP=2 (bench/kv_tier.py)" in text
    assert "--kv-offload-memory 64MiB" in text
    rows = table_rows(text, "no tier|tier")
    assert set(rows) == {"no tier", "tier"}, text
    for cells in rows.values():
        assert cells[-1] == "4 ok", cells  # every request of the row completed
        assert float(cells[1]) > 0  # output tok/s
        assert all(c.endswith("%") for c in cells[4:7]), cells  # own cache, tier, computed
    assert rows["no tier"][5] == "0.0%"  # without a tier no prompt token comes from one
