"""Faults caused for real on `dpserve serve --data-parallel-size 2` (tiny model):
SIGKILL, SIGSTOP and a hung forward on one engine, a killed coordinator, the
restart limit and the isolate / stop policies. What the user sees is asserted:
every stream's text (equal to an undisturbed greedy run), /health per rank,
new requests, exit codes."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import pytest
from helpers import (
    FAULT_PROMPTS,
    FAULT_SEQS,
    all_gone,
    complete_n,
    descendants,
    expected_greedy,
    finished_by_engine,
    metric_sum,
    output,
    premise_held,
    premise_moved,
    proc_named,
    process_names,
    rank_health,
    serve,
    serve_all,
    stopping,
    streams_with_fault,
    wait_rank,
    wait_until,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]

DP_ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256")


# Servers for two tests each, started at once (their start-ups overlap): each test
# still has a server of its own, stopped when it ends (`stopping`).
@pytest.fixture(scope="module")
def sigkill_servers(tiny_llama):
    model = str(tiny_llama)
    with serve_all(*([model, *DP_ARGS, *FAULT_SEQS, "--api-server-count", str(n)]
                     for n in (1, 2))) as (
            servers):
        yield dict(zip((1, 2), servers))


@pytest.fixture(scope="module")
def plain_servers(tiny_llama):
    """For the SIGSTOP and the killed-coordinator tests."""
    with serve_all(*[[str(tiny_llama), *DP_ARGS, *FAULT_SEQS]] * 2) as servers:
        yield dict(zip(("sigstop", "coordinator"), servers))


@pytest.fixture(scope="module")
def dead_rank_servers(tiny_llama):
    """For the restart-limit and the isolate tests."""
    model = str(tiny_llama)
    with serve_all([model, *DP_ARGS, "--max-engine-restarts", "1"],
                   [model, *DP_ARGS, "--engine-failure-policy", "isolate"]) as servers:
        yield dict(zip(("restart_limit", "isolate"), servers))


@pytest.fixture(scope="module")
def policy_stop_servers(tiny_llama):
    with serve_all(*[[str(tiny_llama), *DP_ARGS, "--engine-failure-policy", "stop"]] * 2) as (
            servers):
        yield dict(zip(("EngineCore_1", "DPCoordinator"), servers))


# Long streams (the tiny model's context is 256 here): the API server can stream to
# the client well behind the engine on a loaded machine, so with 128 tokens the
# engine once had finished every stream of rank 1 by the kill.
KILL_TOKENS = 240


@pytest.mark.parametrize("api_servers", [1, 2])
def test_sigkill_one_engine_every_stream_completes_and_it_comes_back(sigkill_servers,
                                                                     tiny_llama, api_servers):
    model = str(tiny_llama)
    expected = expected_greedy(model, max_tokens=KILL_TOKENS)
    with stopping(sigkill_servers[api_servers]) as (proc, url):
        victim = proc_named(descendants(proc.pid), "EngineCore_1")

        def kill_while_it_runs_streams() -> None:
            victim.send_signal(signal.SIGKILL)

        try:
            got = asyncio.run(streams_with_fault(url, model, kill_while_it_runs_streams,
                                                 max_tokens=KILL_TOKENS, on_rank=1))
        except Exception:
            print("server log:", "\n".join(line for line in output(proc).splitlines()
                                            if "ERROR" in line or "WARN" in line)[-4000:])
            raise
        assert got == expected  # migrated streams equal an undisturbed greedy run
        premise_moved(url, 0, "rank 1 was killed holding streams")
        # The rank is out (dead, restarting or back already), the server serves on: at once.
        assert rank_health(url).status_code == 200
        assert asyncio.run(complete_n(url, model, 20)) == [200] * 20
        # It comes back as a new process, and serves again.
        wait_rank(url, 1, lambda e: e["state"] == "serving" and e["incarnation"] == 1)
        assert proc_named(descendants(proc.pid), "EngineCore_1").pid != victim.pid
        before = finished_by_engine(url).get(1, 0)
        assert asyncio.run(complete_n(url, model, 4, rank=1)) == [200] * 4
        assert finished_by_engine(url).get(1, 0) - before == 4
        assert metric_sum(url, "dpserve:engine_restarts_total") == 1
        assert "rank 1: " in output(proc) and "restarting it" in output(proc)


def test_sigstop_one_engine_is_unhealthy_then_rejoins(plain_servers, tiny_llama):
    model = str(tiny_llama)
    prompts = FAULT_PROMPTS[:16]
    expected = expected_greedy(model, prompts)
    with stopping(plain_servers["sigstop"]) as (proc, url):
        victim = proc_named(descendants(proc.pid), "EngineCore_1")
        stopped_at: list[float] = []

        def stop() -> None:
            victim.send_signal(signal.SIGSTOP)
            stopped_at.append(time.monotonic())

        try:
            got = asyncio.run(streams_with_fault(url, model, stop, prompts, on_rank=1))
            assert got == expected  # moved off the frozen rank, nothing doubled
            premise_moved(url, 0, "rank 1 was frozen holding streams", retries=True)
            entry = wait_rank(url, 1, lambda e: e["state"] == "unhealthy", timeout=30)
            print(f"unhealthy {time.monotonic() - stopped_at[0]:.2f} s after SIGSTOP "
                  f"(heartbeat timeout 3 s): {entry['reason']}")
            assert "heartbeat" in entry["reason"]
            assert rank_health(url, 1).status_code == 503 and rank_health(url).status_code == 200
            before = finished_by_engine(url)
            assert asyncio.run(complete_n(url, model, 10)) == [200] * 10
            after = finished_by_engine(url)
            assert after.get(1, 0) == before.get(1, 0)  # new work avoids it
            assert after.get(0, 0) - before.get(0, 0) == 10
            pinned = httpx.post(url + "/v1/completions", headers={"X-data-parallel-rank": "1"},
                                json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=10)
            assert pinned.status_code == 503 and "unhealthy" in pinned.json()["error"]["message"]
        finally:
            victim.send_signal(signal.SIGCONT)
        wait_rank(url, 1, lambda e: e["state"] == "serving", timeout=30)
        assert victim.is_running() and proc_named(descendants(proc.pid), "EngineCore_1").pid == \
            victim.pid  # the same process rejoined
        # The requests it held were aborted there: it drains to empty, and serves anew.
        deadline = time.monotonic() + 30
        while metric_sum(url, 'dpserve:num_requests_running{model_name="' + model
                      + '",engine="1"}') > 0:
            assert time.monotonic() < deadline, "the resumed rank still runs moved requests"
            time.sleep(0.2)
        assert asyncio.run(complete_n(url, model, 4, rank=1)) == [200] * 4


def test_hung_forward_is_caught_by_the_stall_timeout(tiny_llama):
    model = str(tiny_llama)
    prompts = FAULT_PROMPTS[:12]
    expected = expected_greedy(model, prompts)
    env = {"DPSERVE_FAULT_FORWARD_HANG_AT": "40", "DPSERVE_FAULT_RANK": "1"}
    with serve(model, *DP_ARGS, "--engine-stall-timeout", "2", env=env) as (proc, url):
        got = asyncio.run(streams_with_fault(url, model, lambda: None, prompts))
        assert got == expected
        entry = wait_rank(url, 1, lambda e: e["state"] == "unhealthy", timeout=30)
        assert "step" in entry["reason"], entry
        premise_moved(url, 0, "rank 1's forward hung holding streams")
        assert asyncio.run(complete_n(url, model, 8)) == [200] * 8


def test_killed_coordinator_is_restarted_and_requests_still_served(plain_servers, tiny_llama):
    model = str(tiny_llama)
    with stopping(plain_servers["coordinator"]) as (proc, url):
        victim = proc_named(descendants(proc.pid), "DPCoordinator")
        victim.send_signal(signal.SIGKILL)
        assert asyncio.run(complete_n(url, model, 10)) == [200] * 10
        deadline = time.monotonic() + 30
        while True:
            coordinators = [p for p in descendants(proc.pid)
                            if p.is_running() and p.name() == "dpserve::DPCoordinator"]
            if coordinators and coordinators[0].pid != victim.pid:
                break
            assert time.monotonic() < deadline, "no new coordinator"
            time.sleep(0.1)
        served = finished_by_engine(url)
        assert asyncio.run(complete_n(url, model, 16)) == [200] * 16
        assert rank_health(url).json()["status"] == "ok"
        after = finished_by_engine(url)
        assert sum(after.values()) - sum(served.values()) == 16


def test_restart_limit_keeps_the_rank_out(dead_rank_servers, tiny_llama):
    model = str(tiny_llama)
    with stopping(dead_rank_servers["restart_limit"]) as (proc, url):
        proc_named(descendants(proc.pid), "EngineCore_1").send_signal(signal.SIGKILL)
        wait_rank(url, 1, lambda e: e["state"] == "serving" and e["incarnation"] == 1)
        proc_named(descendants(proc.pid), "EngineCore_1").send_signal(signal.SIGKILL)
        entry = wait_rank(url, 1, lambda e: e["state"] == "dead", timeout=30)
        assert "--max-engine-restarts" in entry["reason"]
        # No restart comes: once the launcher has decided (its log line) and the server
        # has moved on (requests served), the rank is still dead, with no process, and
        # the restart count has not moved past the one restart.
        wait_until(lambda: "stays out" in output(proc), 30, "the launcher's decision")
        assert asyncio.run(complete_n(url, model, 6)) == [200] * 6
        assert rank_health(url, 1).json()["ranks"][0]["state"] == "dead"
        assert "EngineCore_1" not in process_names(descendants(proc.pid))
        assert metric_sum(url, "dpserve:engine_restarts_total") == 1


def test_isolate_with_every_rank_dead_gives_clear_503s(dead_rank_servers, tiny_llama):
    model = str(tiny_llama)
    with stopping(dead_rank_servers["isolate"]) as (proc, url):
        engines = [proc_named(descendants(proc.pid), f"EngineCore_{r}") for r in (0, 1)]
        engines[1].send_signal(signal.SIGKILL)
        wait_rank(url, 1, lambda e: e["state"] == "dead", timeout=30)
        assert asyncio.run(complete_n(url, model, 4)) == [200] * 4  # rank 0 serves on
        engines[0].send_signal(signal.SIGKILL)
        wait_rank(url, 0, lambda e: e["state"] == "dead", timeout=30)
        health = rank_health(url)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        resp = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "x",
                                                         "max_tokens": 2}, timeout=10)
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert "no engine is serving" in error["message"] and "rank 0 dead" in error["message"]
        assert proc.poll() is None  # the server stays up, saying why


@pytest.mark.parametrize("victim", ["EngineCore_1", "DPCoordinator"])
def test_policy_stop_stops_the_dp_server(policy_stop_servers, victim):
    with stopping(policy_stop_servers[victim]) as (proc, url):
        children = descendants(proc.pid)
        proc_named(children, victim).send_signal(signal.SIGKILL)
        assert proc.wait(30) != 0
        assert all_gone(children, timeout=10), [p for p in children if p.is_running()]


# SIGTERM to one API server alone: it drains (no request in flight) and the launcher
# lets it exit at once (it holds on only while the launcher drains them all).
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_api_server_is_restarted_and_the_other_serves_on(tiny_llama, how):
    model = str(tiny_llama)
    with serve(model, *DP_ARGS, "--api-server-count", "2") as (proc, url):
        victim = proc_named(descendants(proc.pid), "APIServer_1")
        victim.send_signal(how)
        if how == signal.SIGTERM:  # it answers 503 while it drains: a moment
            victim.wait(30)
        no_reuse = httpx.Limits(max_keepalive_connections=0)  # a new connection each

        async def complete(n: int) -> list[int]:
            async with httpx.AsyncClient(timeout=60, limits=no_reuse) as client:
                resps = await asyncio.gather(*(client.post(
                    url + "/v1/completions", json={"model": model, "prompt": f"p{i}",
                                                   "max_tokens": 4}) for i in range(n)))
            return [r.status_code for r in resps]

        assert asyncio.run(complete(12)) == [200] * 12  # the other one serves on
        deadline = time.monotonic() + 60
        while True:
            servers = [p for p in descendants(proc.pid)
                       if p.is_running() and p.name() == "dpserve::APIServer_1"]
            if servers and servers[0].pid != victim.pid and "restarted" in output(proc):
                break
            assert time.monotonic() < deadline, output(proc)[-3000:]
            time.sleep(0.2)
        text = httpx.get(url + "/metrics", timeout=5).text
        before = float(re.search(r'api_server_requests_finished_total\{.*api_server="1".*\} '
                                 r'(\S+)', text).group(1))
        assert asyncio.run(complete(24)) == [200] * 24
        deadline = time.monotonic() + 10
        while True:  # the new APIServer_1 takes connections and finishes requests
            text = httpx.get(url + "/metrics", headers={"Connection": "close"}, timeout=5).text
            after = float(re.search(r'api_server_requests_finished_total\{.*api_server="1".*\} '
                                    r'(\S+)', text).group(1))
            if after > before:
                break
            assert time.monotonic() < deadline, "the restarted API server served nothing"
            assert asyncio.run(complete(8)) == [200] * 8
        assert proc.poll() is None


def _feature_requests(model: str) -> list[tuple[str, dict]]:
    """Greedy requests of every shape a move must carry over (route, body)."""
    chat = [{"role": "user", "content": "Tell me a long story about data parallel serving."}]
    long = {"max_tokens": 120, "temperature": 0, "ignore_eos": True}
    return [
        ("/v1/chat/completions", {"model": model, "messages": chat, "stream": True, **long}),
        ("/v1/chat/completions", {"model": model, "messages": chat, **long}),
        ("/v1/chat/completions", {"model": model, "messages": chat, "logprobs": True,
                                  "top_logprobs": 2, **long}),
        ("/v1/completions", {"model": model, "prompt": "Once upon a time", "n": 2, **long}),
        ("/v1/completions", {"model": model, "prompt": "A B C", "presence_penalty": 1.5,
                             "frequency_penalty": 0.5, "repetition_penalty": 1.3, **long}),
        ("/v1/completions", {"model": model, "prompt": "1 2 3", "min_tokens": 100,
                             "max_tokens": 110, "temperature": 0}),
        ("/v1/completions", {"model": model, "prompt": "x y z", "logprobs": 3, "stream": True,
                             **long}),
    ] * 2


async def _send_all(url: str, requests: list[tuple[str, dict]], fault=None) -> list:
    """Every request at once; streamed ones are collected chunk by chunk. When `fault`
    is given it runs once every stream has begun."""
    chunks = [0] * len(requests)

    async def one(client: httpx.AsyncClient, i: int, route: str, body: dict):
        if not body.get("stream"):
            resp = await client.post(url + route, json=body)
            assert resp.status_code == 200, resp.text
            data = resp.json()
            return [(c["index"], c.get("text") or c["message"]["content"], c["finish_reason"],
                     c.get("logprobs")) for c in data["choices"]], data["usage"]
        parts = []
        async with client.stream("POST", url + route, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    chunks[i] += 1
                    for c in chunk["choices"]:
                        parts.append((c.get("text") or (c.get("delta") or {}).get("content"),
                                      c.get("finish_reason"), c.get("logprobs")))
        return parts

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(one(client, i, r, b)) for i, (r, b) in enumerate(requests)]
        if fault is not None:
            deadline = time.monotonic() + 60
            while min(n for n, (_, b) in zip(chunks, requests) if b.get("stream")) < 3:
                assert time.monotonic() < deadline, chunks
                await asyncio.sleep(0.02)
            await asyncio.to_thread(fault)
        return await asyncio.gather(*tasks)


def _same(a, b) -> bool:
    """Equal, but logprob floats within 1e-3 (a recomputed prefix may differ in the
    last bits; the tokens themselves must not)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-3
    if isinstance(a, dict) and isinstance(b, dict):
        # Prefix-cache hits depend on what the other requests left in the cache,
        # which a move changes: `cached_tokens` may differ, nothing else may.
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a
                                            if k != "prompt_tokens_details")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_moved_requests_keep_every_feature(tiny_llama):
    """Chat and completions, streamed and not, n > 1, logprobs, penalties, min_tokens:
    a SIGKILL mid-run changes nothing the client sees."""
    model = str(tiny_llama)
    requests = _feature_requests(model)
    with serve(model, *DP_ARGS) as (proc, url):
        undisturbed = asyncio.run(_send_all(url, requests))
        before = metric_sum(url, "dpserve:request_migrations_total")
        victim = proc_named(descendants(proc.pid), "EngineCore_1")

        def kill_while_it_runs_requests() -> None:
            premise_held(url, 1, "SIGKILL")
            victim.send_signal(signal.SIGKILL)

        disturbed = asyncio.run(_send_all(url, requests, kill_while_it_runs_requests))
        assert not victim.is_running()
        # (moved mid-stream, or re-sent before the API server read a token of theirs)
        premise_moved(url, before, "rank 1 was killed holding requests", retries=True)
        assert _same(disturbed, undisturbed)
