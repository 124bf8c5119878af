"""bench/kv_tier.py --smoke on the tiny model: the script the lead runs for issue 26's
benchmark starts both rows (a DP=2 cache-aware server without and with
--kv-offload-memory), sends its 4 requests to each, and writes the BENCHMARKS.md
section with both rows complete and their prompt tokens by tier. Measures nothing
(no timing asserts): it checks that the script runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/bench/...)


def test_the_kv_tier_benchmark_runs_in_smoke_mode(tiny_llama, tmp_path):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kv_tier.py"), "--smoke",
                           "--model", str(tiny_llama), "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    text = out.read_text()
    assert text.strip() == proc.stdout.strip()  # the section, printed and appended
    assert "## KV host tier at DP=2 (bench/kv_tier.py)" in text
    assert "--kv-offload-memory 64MiB" in text
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (no tier|tier) \|.*$", text,
                                                        re.M)}
    assert set(rows) == {"no tier", "tier"}, text
    for row in rows.values():
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1] == "4 ok", row  # every request of the row completed
        assert float(cells[1]) > 0  # output tok/s
        assert all(c.endswith("%") for c in cells[4:7]), row  # own cache, tier, computed
    no_tier = [c.strip() for c in rows["no tier"].strip("|").split("|")]
    assert no_tier[5] == "0.0%"  # without a tier no prompt token comes from one
