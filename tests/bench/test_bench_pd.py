"""bench/pd.py --smoke on the tiny model: the script behind the prefill/decode
figures starts both rows (DP=2 colocated, and `--data-parallel-roles
prefill:1,decode:1`, both with a host tier), sends its 4 requests to each, and
writes its markdown section with both rows complete; the roles row's handoffs
are counted by the server. Measures nothing (no timing asserts): it checks that the
script runs."""

from __future__ import annotations

import pytest
from bench_smoke import run_smoke, table_rows

pytestmark = [pytest.mark.procs, pytest.mark.slow]


def test_the_pd_benchmark_runs_in_smoke_mode(tiny_llama, tmp_path):
    text = run_smoke("pd.py", tiny_llama, tmp_path / "benchmarks.md")
    assert "## Prefill/decode disaggregation at DP=2 (bench/pd.py)" in text
    assert "--data-parallel-roles prefill:1,decode:1" in text
    cells = table_rows(text, "colocated|pd")
    assert set(cells) == {"colocated", "pd"}, text
    for row in cells.values():
        assert row[-1] == "4 ok", row  # every request of the row completed
        assert float(row[1]) > 0  # output tok/s
        assert row[5].endswith(" ms"), row  # the decoding streams' ITL p99
    assert cells["colocated"][6] == "0"  # no roles: no handoff
    assert cells["pd"][6] == "4"  # every request was handed off (none asks for 1 token)
