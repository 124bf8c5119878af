"""Scaling the number of DP engines at run time, for real (`dpserve serve`, tiny model):
`POST /scale_elastic_ep` and `dpserve scale` up and down under streams (none cut,
each equal to an undisturbed greedy run), every API server routing to a new rank
and none to a removed one, the 400 / 409 / 404 / 401 answers, lockstep mode, and
the autoscaler."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading

import httpx
import pytest
from helpers import (
    FAULT_PROMPTS,
    FAULT_SEQS,
    complete_n,
    descendants,
    expected_greedy,
    finished_by_engine,
    metric_sum,
    output,
    process_names,
    serve,
    serve_all,
    stopping,
    stream_completion,
    streams_with_fault,
    wait_until,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]

ARGS = ("--threads-per-engine", "1", "--max-model-len", "256", "--enable-admin-api",
        "--allow-unauthenticated-admin", "--shutdown-timeout", "120")
PROMPTS = FAULT_PROMPTS[:16]
FRESH = {"Connection": "close"}  # a new connection each: every API server answers some


def _scale(url: str, size: object, **kw: object) -> httpx.Response:
    return httpx.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": size},
                      timeout=300, **kw)


def _health_views(url: str, n: int = 12) -> list[dict]:
    """/health from `n` fresh connections (with 2 API servers: both answer some)."""
    return [httpx.get(url + "/health", headers=FRESH, timeout=5).json() for _ in range(n)]


def _engines(proc: subprocess.Popen) -> set[str]:
    return {n for n in process_names(descendants(proc.pid)) if n.startswith("EngineCore_")}


def _streams_while(url: str, model: str, action, held_by_rank: int,
                   what: str) -> tuple[list[str], list]:
    """16 greedy streams; `action()` (the `what`) at once when rank `held_by_rank` runs
    some of them (asked of its engine: the premise); (texts, [its result])."""
    result: list = []
    print(f"{what}: on rank {held_by_rank}'s streams")
    texts = asyncio.run(streams_with_fault(url, model, lambda: result.append(action()),
                                           prompts=PROMPTS, on_rank=held_by_rank))
    return texts, result


# Servers for two tests each, started at once (their start-ups overlap): each test
# still has a server of its own, stopped when it ends (`stopping`).
@pytest.fixture(scope="module")
def scale_servers(tiny_llama):
    with serve_all(*([str(tiny_llama), *ARGS, *FAULT_SEQS, "--data-parallel-size-max", "2",
                      "--api-server-count", str(n)] for n in (1, 2))) as servers:
        yield dict(zip((1, 2), servers))


@pytest.fixture(scope="module")
def answer_servers(tiny_llama, tmp_path_factory):
    """For the 400 / 409 test (its rank 1 holds its start until the test's file exists:
    a change stays in progress for as long as the test needs), and the `dpserve scale`
    test (with an API key)."""
    model = str(tiny_llama)
    release = tmp_path_factory.mktemp("hold") / "release-rank-1"
    with serve_all([model, *ARGS, "--data-parallel-size-max", "2"],
                   [model, *ARGS, "--api-key", "sesame-123", "--data-parallel-size-max",
                    "2"],
                   env=[{"DPSERVE_FAULT_HOLD_START": f"1:{release}"}, {}]) as servers:
        yield {**dict(zip(("plain", "key"), servers)), "release": release}


@pytest.mark.parametrize("api_servers", [1, 2])
def test_scale_1_2_1_under_streams(scale_servers, tiny_llama, api_servers):
    model = str(tiny_llama)
    expected = expected_greedy(model, PROMPTS)
    with stopping(scale_servers[api_servers]) as (proc, url):
        assert _engines(proc) == {"EngineCore_0"}
        # Up, while 16 streams run on rank 0: none is cut.
        texts, (resp,) = _streams_while(url, model, lambda: _scale(url, 2), 0, "scale-up")
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"message": "Scaled to 2 data parallel engines",
                               "old_data_parallel_size": 1, "new_data_parallel_size": 2}
        assert texts == expected
        assert _engines(proc) == {"EngineCore_0", "EngineCore_1"}
        for view in _health_views(url):  # every API server knows the new rank serves
            assert view["data_parallel_size"] == 2, view
            assert [r["state"] for r in view["ranks"]] == ["serving", "serving"], view
        assert metric_sum(url, "dpserve:data_parallel_size") == 2
        # Every API server routes to it: pinned and by load, over fresh connections.
        before = finished_by_engine(url).get(1, 0)
        assert asyncio.run(complete_n(url, model, 8, rank=1)) == [200] * 8
        assert finished_by_engine(url)[1] - before == 8
        statuses = [httpx.post(url + "/v1/completions", headers=FRESH, timeout=60, json={
            "model": model, "prompt": f"spread {i}", "max_tokens": 2}).status_code
            for i in range(12)]
        assert statuses == [200] * 12
        text = httpx.get(url + "/metrics", timeout=5).text
        by_server = {m[0]: float(m[1]) for m in re.findall(
            r'api_server_requests_finished_total\{.*api_server="(\d+)".*\} (\S+)', text)}
        assert len(by_server) == api_servers and all(v > 0 for v in by_server.values())

        # Down, while 16 streams run on both ranks: rank 1 drains, nothing is cut or moved.
        texts, (resp,) = _streams_while(url, model, lambda: _scale(url, 1), 1, "scale-down")
        assert resp.status_code == 200, resp.text
        assert resp.json()["new_data_parallel_size"] == 1
        assert texts == expected
        assert metric_sum(url, "dpserve:request_migrations_total") == 0
        assert metric_sum(url, "dpserve:request_retries_total") == 0
        wait_until(lambda: _engines(proc) == {"EngineCore_0"}, 30, "EngineCore_1 to exit")
        for view in _health_views(url):  # no API server knows rank 1 any more
            assert view["data_parallel_size"] == 1 and len(view["ranks"]) == 1, view
        done_by_1 = finished_by_engine(url).get(1, 0)
        assert asyncio.run(complete_n(url, model, 12)) == [200] * 12
        assert finished_by_engine(url).get(1, 0) == done_by_1
        pinned = httpx.post(url + "/v1/completions", headers={"X-data-parallel-rank": "1"},
                            json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert pinned.status_code == 400, pinned.text
        assert metric_sum(url, "dpserve:data_parallel_size") == 1
        assert proc.poll() is None


def test_bad_sizes_400_and_a_second_change_409(answer_servers):
    with stopping(answer_servers["plain"]) as (proc, url):
        for body in ({"new_data_parallel_size": "2"}, {"new_data_parallel_size": 2.5},
                     {"new_data_parallel_size": True}, {"new_data_parallel_size": 0},
                     {"new_data_parallel_size": 3}, {}, [2],
                     {"new_data_parallel_size": 2, "drain": 1}):
            resp = httpx.post(url + "/scale_elastic_ep", json=body, timeout=30)
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["error"]["type"] == "invalid_request_error", resp.text
        resp = httpx.post(url + "/scale_elastic_ep", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert "[1, 2]" in _scale(url, 3).json()["error"]["message"]
        # A change runs (the new rank is STARTING, held there until the file exists): a
        # second one gets 409, then the first ends once rank 1 may start.
        first: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: first.append(_scale(url, 2)))
        thread.start()
        wait_until(lambda: any(r["state"] == "starting" for r in
                               httpx.get(url + "/health", timeout=5).json()["ranks"]),
                   60, "rank 1 to start")
        second = _scale(url, 1)
        answer_servers["release"].touch()
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "scale_in_progress"
        thread.join(timeout=300)
        assert first and first[0].status_code == 200, first
        # The same size again: 200, nothing to do.
        again = _scale(url, 2)
        assert again.status_code == 200 and again.json()["old_data_parallel_size"] == 2
        assert proc.poll() is None


def test_scale_cli_one_line_errors(answer_servers):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dpserve.cli", "scale", *args],
                              capture_output=True, text=True, timeout=300)

    with stopping(answer_servers["key"]) as (proc, url):
        headers = {"Authorization": "Bearer sesame-123"}
        assert _scale(url, 2).status_code == 401  # the admin route needs the key
        done = cli("2", "--url", url, "--api-key", "sesame-123")
        assert done.returncode == 0 and "Scaled to 2" in done.stdout, done.stderr
        assert httpx.get(url + "/health", timeout=5).json()["data_parallel_size"] == 2
        bad = cli("5", "--url", url, "--api-key", "sesame-123")
        assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert "[1, 2]" in bad.stderr and "HTTP 400" in bad.stderr
        no_key = cli("1", "--url", url)
        assert no_key.returncode == 1 and "HTTP 401" in no_key.stderr, no_key.stderr
        assert _scale(url, 1, headers=headers).status_code == 200
    gone = cli("2", "--url", url)  # the server has stopped
    assert gone.returncode == 1 and gone.stderr.startswith("dpserve: error: cannot reach")
    assert len(gone.stderr.strip().splitlines()) == 1


def test_without_the_flag_or_the_max(tiny_llama):
    model = str(tiny_llama)
    plain = ("--threads-per-engine", "1", "--max-model-len", "256")
    # The four refused command lines run while the two servers start (all at once).
    refused = [("--data-parallel-autoscale", "3"), ("--data-parallel-autoscale", "2:1"),
               ("--data-parallel-size-max", "0"), ("--autoscale-up-window", "0")]
    clis = [subprocess.Popen(
        [sys.executable, "-m", "dpserve.cli", "serve", model, *plain, "--port", "0", option,
         value, *(() if option == "--data-parallel-autoscale" else (
             "--data-parallel-autoscale", "1:2"))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for option, value in refused]
    try:
        with serve_all([model, *plain], [model, *plain, "--enable-admin-api",
                                          "--allow-unauthenticated-admin",
                                          "--no-enable-elastic-ep"]) as [
                (plain_proc, no_admin), (_, admin)]:
            assert _scale(no_admin, 2).status_code == 404  # no --enable-admin-api: no route
            # The default server starts nothing for scaling: no coordinator at DP=1.
            names = process_names(descendants(plain_proc.pid))
            assert "EngineCore_0" in names and "DPCoordinator" not in names, names
            resp = _scale(admin, 1)  # --no-enable-elastic-ep: the one engine stays
            assert resp.status_code == 400 and "--no-enable-elastic-ep" in resp.text
        for (option, _), cli in zip(refused, clis):
            _, stderr = cli.communicate(timeout=120)
            assert cli.returncode == 2, stderr
            last = stderr.strip().splitlines()[-1]
            assert last.startswith(f"dpserve: error: {option} "), stderr
    finally:
        for cli in clis:
            if cli.poll() is None:
                cli.kill()
                cli.wait(10)


def test_lockstep_scale_up_and_down(tiny_llama):
    model = str(tiny_llama)
    expected = expected_greedy(model, PROMPTS)
    with serve(model, *ARGS, *FAULT_SEQS, "--data-parallel-size", "2",
               "--data-parallel-size-max", "3", "--data-parallel-lockstep") as (proc, url):
        texts, (resp,) = _streams_while(url, model, lambda: _scale(url, 3), 0, "scale-up")
        assert resp.status_code == 200, resp.text
        assert texts == expected
        # Rank 2 steps only inside a DP group: serving it proves the group took it in.
        assert asyncio.run(complete_n(url, model, 4, rank=2)) == [200] * 4
        assert "ranks [0, 1, 2]" in output(proc)
        texts, (resp,) = _streams_while(url, model, lambda: _scale(url, 2), 2, "scale-down")
        assert resp.status_code == 200, resp.text
        assert texts == expected
        wait_until(lambda: _engines(proc) == {"EngineCore_0", "EngineCore_1"}, 30,
                   "EngineCore_2 to exit")
        # Waves go on with the group formed again without rank 2.
        assert asyncio.run(complete_n(url, model, 8)) == [200] * 8
        log = output(proc)
        assert log.rindex("ranks [0, 1]") > log.index("ranks [0, 1, 2]")
        assert proc.poll() is None


def test_autoscale_up_under_a_burst_and_down_when_idle(tiny_llama):
    model = str(tiny_llama)
    # 32 streams of 240 tokens one at a time: the queue outlasts the 2 s up window many
    # times over (16 of 128 tokens, two at a time, drained within about 2 s here).
    prompts, tokens = FAULT_PROMPTS, 240
    expected = expected_greedy(model, prompts, max_tokens=tokens)
    with serve(model, *ARGS, "--data-parallel-autoscale", "1:2", "--max-num-seqs", "1",
               "--autoscale-up-queue", "1", "--autoscale-up-window", "2",
               "--autoscale-down-load", "0.5", "--autoscale-down-window", "2",
               "--autoscale-cooldown", "2") as (proc, url):
        def size() -> int:
            return httpx.get(url + "/health", timeout=5).json()["data_parallel_size"]

        assert size() == 1
        # A burst: 31 of the 32 streams wait on rank 0 (one runs at a time).
        async def burst() -> list[str]:
            chunks = [0] * len(prompts)
            async with httpx.AsyncClient(timeout=300) as client:
                streams = asyncio.gather(*(stream_completion(client, url, model, p, chunks, i,
                                                             max_tokens=tokens)
                                           for i, p in enumerate(prompts)))
                await asyncio.to_thread(wait_until, lambda: size() == 2, 120,
                                        "the autoscaler to add a rank")
                return await streams

        assert asyncio.run(burst()) == expected
        wait_until(lambda: size() == 1, 120, "the autoscaler to remove the idle rank")
        assert metric_sum(url, 'dpserve:autoscale_decisions_total{direction="up"}') >= 1
        assert metric_sum(url, 'dpserve:autoscale_decisions_total{direction="down"}') >= 1
        log = output(proc)
        assert "autoscale up: 1 -> 2 engines: mean waiting requests per serving rank" in log
        assert "autoscale down: 2 -> 1 engines: mean waiting + running" in log
        assert asyncio.run(complete_n(url, model, 4)) == [200] * 4


@pytest.mark.alone
def test_ray_scale_up_and_down(tiny_llama):
    """The Ray backend, with no ceiling declared: a new engine actor in a new placement
    group, then drained and killed; streams run throughout and none is cut. A size
    beyond the cluster's CPUs (one each; Ray counts at most this host's) is refused at
    once, naming what is missing."""
    pytest.importorskip("ray")
    model = str(tiny_llama)
    expected = expected_greedy(model, PROMPTS)
    with serve(model, *ARGS, *FAULT_SEQS, "--data-parallel-backend", "ray",
               timeout=180) as (proc, url):
        texts, (resp,) = _streams_while(url, model, lambda: _scale(url, 2), 0, "scale-up")
        assert resp.status_code == 200, resp.text
        assert texts == expected
        # (Ray titles the actor's process once its run() task starts: wait for it.)
        wait_until(lambda: "EngineCore_1" in _engines(proc), 60, "actor 1's process title")
        before = finished_by_engine(url).get(1, 0)
        assert asyncio.run(complete_n(url, model, 4, rank=1)) == [200] * 4
        assert finished_by_engine(url)[1] - before == 4
        beyond = _scale(url, os.cpu_count() + 1)
        assert beyond.status_code == 409, beyond.text
        assert re.search(r"cannot place DP rank \d+ .*missing: CPU", beyond.text), beyond.text
        assert httpx.get(url + "/health", timeout=5).json()["data_parallel_size"] == 2
        texts, (resp,) = _streams_while(url, model, lambda: _scale(url, 1), 1, "scale-down")
        assert resp.status_code == 200, resp.text
        assert texts == expected
        assert metric_sum(url, "dpserve:request_migrations_total") == 0
        wait_until(lambda: "EngineCore_1" not in _engines(proc), 60, "actor 1 to be gone")
        assert httpx.get(url + "/health", timeout=5).json()["data_parallel_size"] == 1
        assert asyncio.run(complete_n(url, model, 4)) == [200] * 4
        assert proc.poll() is None
