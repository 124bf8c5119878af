"""The API server's log options (vLLM's names): --enable-log-requests (a line per request
arrival and finish), uvicorn's access log (on by default), --disable-uvicorn-access-log
and --disable-access-log-for-endpoints; asserted on a real server's log."""

from __future__ import annotations

import re

import httpx
import pytest
from helpers import output, serve_all, wait_until

pytestmark = pytest.mark.procs


def complete(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                                   "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """This module's three servers, started at once (their start-ups overlap); each
    test uses its own one."""
    model, name = str(tiny_llama), ("--served-model-name", "tiny")
    with serve_all([model, *name, "--enable-log-requests", "--disable-access-log-for-endpoints",
                    "/health,/metrics"],
                   [model, *name, "--disable-uvicorn-access-log"],
                   [model, *name]) as procs:
        yield dict(zip(("log_requests", "no_access_log", "default"), procs))


def test_request_log_and_access_log_filter(servers) -> None:
    proc, url = servers["log_requests"]
    rid = complete(url)["id"]
    httpx.get(url + "/metrics")
    httpx.get(url + "/v1/models")
    wait_until(lambda: '"GET /v1/models' in output(proc), 30, "the access line")
    log = output(proc)
    assert re.search(rf"request {rid}-0 arrived: 3 prompt tokens, params .*max_tokens=3", log)
    assert re.search(rf"request {rid}-0 finished \(length\): 3 output tokens", log)
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert '"GET /health' not in log and '"GET /metrics' not in log


def test_access_log_off_and_no_request_log_by_default(servers) -> None:
    proc, url = servers["no_access_log"]
    rid = complete(url)["id"]
    log = output(proc)
    assert rid not in log
    assert '"POST /v1/completions' not in log and '"GET /health' not in log


def test_access_log_on_by_default(servers) -> None:
    proc, url = servers["default"]
    complete(url)
    wait_until(lambda: '"POST /v1/completions HTTP/1.1" 200' in output(proc), 30,
               "the access line")
    assert '"GET /health HTTP/1.1" 200' in output(proc)


def test_bad_endpoint_list_is_refused(tiny_llama) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                        "--disable-access-log-for-endpoints", "health"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--disable-access-log-for-endpoints" in r.stderr and "Traceback" not in r.stderr
