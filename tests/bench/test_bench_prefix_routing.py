"""bench/prefix_routing.py, the benchmark behind the default balancer: its
rows (the default against each alternative, two workloads, one and two API servers,
one thread per engine and the default threads), and a --smoke run on the tiny model
that starts a server per row, sends each row's requests and writes the BENCHMARKS.md
section with every row complete and the default's ratios. Measures nothing (no
timing asserts): it checks that the script runs and what it would start."""

from __future__ import annotations

import re
import sys

import pytest
from bench_smoke import ROOT, run_smoke

sys.path.insert(0, str(ROOT / "bench"))

import prefix_routing  # noqa: E402  (bench/ is not a package)


def test_every_row_of_the_full_run_and_its_server_options():
    args = prefix_routing.parse_args([])
    rows = prefix_routing.make_rows(args)
    assert len(rows) == 2 * 2 * 2 * 4  # workloads x API servers x threads x balancers
    assert {r.policy for r in rows} == {"default", "least-loaded", "round-robin",
                                        "cache-aware"}
    options = {r.name: prefix_routing.serve_options(args, r) for r in rows}
    default = options["uniform api2 threads-default default"]
    assert "--load-balance" not in default and "--threads-per-engine" not in default
    assert ("--api-server-count", "2") == default[2:4] and "--num-kv-blocks" not in default
    plain = options["prefix api1 threads-1 least-loaded"]
    assert plain[plain.index("--load-balance") + 1] == "least-loaded"
    assert plain[plain.index("--threads-per-engine") + 1] == "1"
    assert plain[plain.index("--num-kv-blocks") + 1] == str(prefix_routing.kv_blocks(args))
    w16 = prefix_routing.uniform_prompts(args, vocab=49152)
    assert len(w16) == 64 and {len(p) for p in w16} == {128}
    assert len({tuple(p[:16]) for p in w16}) == 64  # no shared prefixes


@pytest.mark.procs
@pytest.mark.slow
def test_the_balancer_benchmark_runs_in_smoke_mode(tiny_llama, tmp_path):
    text = run_smoke("prefix_routing.py", tiny_llama, tmp_path / "benchmarks.md",
                     "--api-server-counts", "2", "--threads", "1",
                     "--policies", "default,least-loaded")
    assert "## balancers at DP=2: the default against each" in text
    rows = re.findall(r"^\| (uniform|prefix) \| 2 \| 1 \| ([^|]+) \|.*\| (\d+) ok \|$",
                      text, re.M)
    assert sorted((w, b.strip(), n) for w, b, n in rows) == [
        ("prefix", "default (cache-aware)", "4"), ("prefix", "least-loaded", "4"),
        ("uniform", "default (cache-aware)", "4"), ("uniform", "least-loaded", "4")], text
    for workload in ("uniform", "prefix"):
        assert re.search(rf"^- {workload}, 2 API server\(s\), threads 1: default / "
                         r"least-loaded: output tok/s \*\*[\d.]+x\*\*", text, re.M), text
