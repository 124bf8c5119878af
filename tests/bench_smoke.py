"""The smoke run of a benchmark script in bench/, shared by tests/bench/test_bench_*.

`run_smoke(script, model, out, *options)` runs `bench/<script> --smoke --model MODEL
--out OUT` (bench/ scripts are not a package: each runs as its own process, as the
lead runs it), checks that it exits 0 and that the section it appends to OUT is
what it printed, and returns that section. `table_rows(text, names)` reads the
section's table: each row whose first cell matches `names` (a regex alternation),
as its cells. The smoke runs measure nothing (no timing asserts): they check that
the script runs and what it writes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (this file is tests/...)


def run_smoke(script: str, model: object, out: Path, *options: str) -> str:
    """The section `bench/<script> --smoke` appended to `out` (asserted to have run)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke",
                           "--model", str(model), "--out", str(out), *options],
                          capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    text = out.read_text()
    assert text.strip() == proc.stdout.strip()  # the section, printed and appended
    return text


def table_rows(text: str, names: str) -> dict[str, list[str]]:
    """first cell -> the row's cells (stripped), for each table row named by `names`."""
    return {m.group(1): [c.strip() for c in m.group(0).strip("|").split("|")]
            for m in re.finditer(rf"^\| ({names}) \|.*$", text, re.M)}
