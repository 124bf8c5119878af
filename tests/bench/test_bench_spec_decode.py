"""bench/spec_decode.py --smoke on the tiny model: the script the lead runs for issue
30's speculative decoding starts its four rows (copy-heavy requests one at a time and
the W16 load, each with and without --speculative-config), and writes the
BENCHMARKS.md section with every request complete, drafts proposed on the `on` rows
and the copy texts identical (float32 greedy). Measures nothing (no timing asserts)."""

from __future__ import annotations

import pytest
from bench_smoke import run_smoke, table_rows

pytestmark = [pytest.mark.procs, pytest.mark.slow]
# One token of match is enough: the random tiny model's outputs repeat single tokens
# of its prompt, seldom its n-grams.
SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, '
        '"prompt_lookup_min": 1}')


def test_the_spec_decode_benchmark_runs_in_smoke_mode(tiny_llama, tmp_path):
    text = run_smoke("spec_decode.py", tiny_llama, tmp_path / "benchmarks.md",
                     "--speculative-config", SPEC)
    assert "## Speculative decoding, n-gram (bench/spec_decode.py)" in text
    rows = table_rows(text, "copy off|copy on|W16 off|W16 on")
    assert set(rows) == {"copy off", "copy on", "W16 off", "W16 on"}, text
    assert rows["copy on"][2] == rows["copy off"][2] == "2 / 0"
    assert rows["W16 on"][2] == rows["W16 off"][2] == "4 / 0"
    for name in ("copy on", "W16 on"):
        assert int(rows[name][5]) > 0, rows[name]  # drafts proposed
        assert "--speculative-config" in rows[name][9]
    assert rows["copy off"][5] == "0"
    assert "greedy texts identical: **2 of 2**" in text
