"""bench/pd.py --smoke on the tiny model: the script the lead runs for issue 27's
benchmark starts both rows (DP=2 colocated, and `--data-parallel-roles
prefill:1,decode:1`, both with a host tier), sends its 4 requests to each, and
writes the BENCHMARKS.md section with both rows complete; the roles row's handoffs
are counted by the server. Measures nothing (no timing asserts): it checks that the
script runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/bench/...)


def test_the_pd_benchmark_runs_in_smoke_mode(tiny_llama, tmp_path):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pd.py"), "--smoke",
                           "--model", str(tiny_llama), "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    text = out.read_text()
    assert text.strip() == proc.stdout.strip()  # the section, printed and appended
    assert "## Prefill/decode disaggregation at DP=2 (bench/pd.py)" in text
    assert "--data-parallel-roles prefill:1,decode:1" in text
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (colocated|pd) \|.*$", text,
                                                        re.M)}
    assert set(rows) == {"colocated", "pd"}, text
    cells = {name: [c.strip() for c in row.strip("|").split("|")] for name, row in rows.items()}
    for row in cells.values():
        assert row[-1] == "4 ok", row  # every request of the row completed
        assert float(row[1]) > 0  # output tok/s
        assert row[5].endswith(" ms"), row  # the decoding streams' ITL p99
    assert cells["colocated"][6] == "0"  # no roles: no handoff
    assert cells["pd"][6] == "4"  # every request was handed off (none asks for 1 token)
