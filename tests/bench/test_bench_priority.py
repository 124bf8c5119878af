"""bench/priority.py --smoke on the tiny model: the script behind the priority
figures starts its five rows (DP=2 servers under --scheduling-policy priority and
fcfs, with a key file of four tenants), sends each its load and writes its
markdown section with every urgent request complete and tokens counted for both
tenants of the fairness rows. Measures nothing (no timing asserts): it checks that the
script runs."""

from __future__ import annotations

import pytest
from bench_smoke import run_smoke, table_rows

pytestmark = [pytest.mark.procs, pytest.mark.slow]


def test_the_priority_benchmark_runs_in_smoke_mode(tiny_llama, tmp_path):
    text = run_smoke("priority.py", tiny_llama, tmp_path / "benchmarks.md")
    assert "## Priorities and tenant fairness at DP=2 (bench/priority.py)" in text
    assert "--scheduling-policy priority" in text and "--api-key-file KEYS" in text
    rows = table_rows(text, "idle|priority|fcfs|fair|fair fcfs")
    assert set(rows) == {"idle", "priority", "fcfs", "fair", "fair fcfs"}, text
    for name in ("idle", "priority", "fcfs"):
        assert rows[name][3] == "3 ok", rows[name]  # every urgent request completed
        assert rows[name][1].endswith(" s"), rows[name]  # a TTFT p50
    assert int(rows["priority"][4]) > 0 and int(rows["fcfs"][4]) > 0  # batch load ran
    for name in ("fair", "fair fcfs"):
        assert int(rows[name][1]) > 0 and int(rows[name][2]) > 0, rows[name]
    assert "urgent TTFT p50 **" in text and "(target >= 5x)" in text
