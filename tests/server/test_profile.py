"""`--profile-dir` and the admin routes `POST /start_profile`, `/stop_profile` (vLLM's):
a torch profiler session on every engine worker, one Chrome trace file per worker,
on real servers (DP=2; TP=2 inside one rank), and the option's one-line errors."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import serve_all

pytestmark = pytest.mark.procs

ADMIN = ("--enable-admin-api", "--allow-unauthenticated-admin", "--threads-per-engine", "1")


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    model = str(tiny_llama)
    dp_dir, tp_dir = tmp_path_factory.mktemp("dp_traces"), tmp_path_factory.mktemp("tp_traces")
    with serve_all([model, "--data-parallel-size", "2", *ADMIN, "--profile-dir", str(dp_dir)],
                   [model, "--tensor-parallel-size", "2", *ADMIN, "--profile-dir",
                    str(tp_dir)]) as (dp, tp):
        yield model, {"dp": (dp[1], dp_dir, 2, 1), "tp": (tp[1], tp_dir, 1, 2)}


def post(url: str, route: str) -> httpx.Response:
    return httpx.post(url + route, json={}, timeout=150)


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_a_session_writes_one_trace_per_worker(servers, layout):
    model, by_layout = servers
    url, directory, ranks, workers = by_layout[layout]
    started = post(url, "/start_profile")
    assert started.status_code == 200, started.text
    assert started.json() == {"profiling": list(range(ranks))}
    again = post(url, "/start_profile")  # one session at a time
    assert again.status_code == 409 and again.json()["error"]["code"] == "profiling_running"
    for i in range(2 * ranks):  # work on every rank while it records
        done = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": f"Profile me {i}", "max_tokens": 8})
        assert done.status_code == 200, done.text
    stopped = post(url, "/stop_profile")
    assert stopped.status_code == 200, stopped.text
    files = stopped.json()["files"]
    assert sorted(files) == [str(r) for r in range(ranks)]
    for rank, paths in files.items():
        names = sorted(Path(p).name.rsplit("-", 1)[0] for p in paths)
        assert names == [f"dp{rank}-tp{w}" for w in range(workers)], paths
        for path in paths:
            assert Path(path).parent == directory
            events = json.loads(gzip.open(path).read())["traceEvents"]
            # The model ran while it recorded: torch's own ops are in every worker's trace.
            assert any(str(e.get("name", "")).startswith("aten::") for e in events), path
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        Path(p).name for paths in files.values() for p in paths)
    ended = post(url, "/stop_profile")  # nothing runs now
    assert ended.status_code == 409 and ended.json()["error"]["code"] == "profiling_not_running"


def test_a_bad_profile_dir_is_one_line_before_anything_starts(tiny_llama, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for bad in (tmp_path / "missing", a_file):
        proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                               "--profile-dir", str(bad)], capture_output=True, text=True,
                              timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "profile_dir" in lines[0] and "not a directory" in lines[0], lines
