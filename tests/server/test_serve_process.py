"""A real `dpserve serve` subprocess (launcher + API server + engine process)
hit by the official `openai` client: results, disconnects, engine death and
start-up failure (SIGTERM under load: tests/faults/test_drain.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
from helpers import all_gone, descendants, metric, serve, serve_all, stopping, wait_until

from dpserve import LLM, SamplingParams

pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(str(tiny_llama)) as (proc, url):
        yield proc, url, str(tiny_llama)


def test_openai_client_completions_and_chat(server):
    _, url, model = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    done = client.completions.create(model=model, prompt="Hello world", max_tokens=8,
                                     temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.prompt_tokens > 0 and 0 < done.usage.completion_tokens <= 8
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content


def test_32_concurrent_streams_equal_offline(server):
    _, url, model = server
    prompts = [f"Once upon a time {i}" for i in range(32)]
    expected = [o.outputs[0].text for o in LLM(model).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(run()) == expected


def test_disconnect_frees_request(server):
    _, url, model = server
    aborted = 'dpserve:request_success_total{finished_reason="abort"'
    before = metric(url, aborted) if _has_metric(url, aborted) else 0.0
    # 1000 tokens (the tiny model's context is 1024): far more than the 3 chunks read.
    body = {"model": model, "prompt": "Hello", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                break  # hang up mid-stream
    # The hang-up must abort the request (finished as "abort"), not let it run out.
    wait_until(lambda: _has_metric(url, aborted) and metric(url, aborted) == before + 1,
               timeout=30, what="the disconnected request to be aborted")
    wait_until(lambda: metric(url, "dpserve:num_requests_running") == 0
               and metric(url, "dpserve:kv_cache_usage_perc") == 0,
               timeout=30, what="the engine to free the request")


def _has_metric(url: str, name: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=5).text
    return any(line.startswith(name) for line in text.splitlines())


async def _streams_until_error(url: str, model: str, n: int, code: str) -> list[float]:
    """n long streams that must each fail with the server's in-stream error `code`
    (not a dropped connection or a timeout); when each failed."""

    async def one(client: openai.AsyncOpenAI) -> float:
        stream = await client.completions.create(
            model=model, prompt="Hello", max_tokens=400, stream=True,
            extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError) as e:
            async for _ in stream:
                pass
        assert type(e.value) is openai.APIError and e.value.code == code, e.value
        return time.monotonic()

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=120,
                                max_retries=0)
    try:
        return await asyncio.wait_for(asyncio.gather(*(one(client) for _ in range(n))), 120)
    finally:
        await client.close()


@pytest.fixture(scope="module")
def dying_servers(tiny_llama):
    """The two engine-death tests' servers, started at once (their start-ups overlap):
    the engine's 40th forward raises (test-only fault injection; under policy restart
    the new engine runs clean)."""
    model = str(tiny_llama)
    with serve_all([model], [model, "--engine-failure-policy", "stop"],
                   env=[{"DPSERVE_FAULT_FORWARD_AT": "40", "DPSERVE_FAULT_RANK": "0"},
                        {"DPSERVE_FAULT_FORWARD_AT": "40"}]) as servers:
        yield dict(zip(("restart", "stop"), servers))


def test_engine_death_with_one_engine_fails_requests_then_it_restarts(dying_servers,
                                                                      tiny_llama):
    with stopping(dying_servers["restart"]) as (proc, url):
        first = descendants(proc.pid)
        ends = asyncio.run(_streams_until_error(url, str(tiny_llama), 4, "engine_unavailable"))
        # Every in-flight request fails together, at the death (not when a 400-token
        # stream would have ended, nor at the 120 s client timeout); generous for a
        # loaded machine.
        assert max(ends) - min(ends) < 30
        wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200,
                   timeout=60, what="a new engine process to serve")
        assert proc.poll() is None
        ok = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": str(tiny_llama), "prompt": "Hello", "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        engine = [p for p in descendants(proc.pid) if p.name() == "dpserve::EngineCore_0"]
        assert engine and engine[0].pid not in {p.pid for p in first}


def test_engine_death_fails_requests_and_exits_under_policy_stop(dying_servers, tiny_llama):
    with stopping(dying_servers["stop"]) as (proc, url):
        children = descendants(proc.pid)
        assert children, "the engine should be a child process"
        ends = asyncio.run(_streams_until_error(url, str(tiny_llama), 4, "engine_dead"))
        assert max(ends) - min(ends) < 30  # together, at the death (generous)
        assert httpx.get(url + "/health", timeout=2).status_code == 503
        assert proc.wait(15) != 0
        assert all_gone(children, timeout=10)


def test_bad_model_path_fails_with_one_line_and_leaves_no_process(tmp_path):
    """The model is resolved after the engines' forkserver has started importing torch:
    the failure stops it too, so nothing of the command outlives it (its output goes
    to a file: a pipe would wait for every holder of its end, hiding a survivor)."""
    err = tmp_path / "stderr"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "dpserve.cli", "serve",
                                 str(tmp_path / "missing-model")], stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)
        code = proc.wait(60)
    left = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == proc.pid]
    for p in left:  # (not to leave them to the next test)
        p.kill()
    assert code == 2
    assert not left, [p.info for p in left]
    lines = err.read_text().strip().splitlines()
    assert len(lines) == 1 and "missing-model" in lines[0], lines


@pytest.mark.parametrize("api_servers", [1, 2])
def test_the_process_group_is_empty_when_the_main_process_exits(tiny_llama, api_servers):
    """A supervisor that checks the server's process group the moment its main
    process exits (after a SIGTERM drain, exit 0) finds nothing: the engines, the
    forkserver they came from, multiprocessing's resource tracker, the coordinator
    and the API servers are all gone and reaped by then."""
    with serve(str(tiny_llama), "--data-parallel-size", "2", "--threads-per-engine", "1",
               "--api-server-count", str(api_servers), new_session=True) as (proc, url):
        children = descendants(proc.pid)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        # The premise: the helpers this test is about were running under the server.
        assert "forkserver" in names and "resource_tracker" in names, names
        httpx.post(url + "/v1/completions", json={"model": str(tiny_llama), "prompt": "Hi",
                                                  "max_tokens": 4}, timeout=30)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        left = [p for p in psutil.process_iter(["pid", "cmdline"]) if _pgid(p.pid) == proc.pid]
    assert code == 0
    assert not left, [p.info for p in left]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def test_port_in_use_fails_before_loading(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                               "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--port {port}" in lines[0], proc.stderr


def test_sampling_extensions_and_penalties_change_the_output(server):
    """Each sampling option sent over HTTP acts on the text (not only validated)."""
    _, url, model = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompt, n = "Once upon a time", 32
    offline = LLM(model).generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                           ignore_eos=True), use_tqdm=False)
    greedy_ids = offline[0].outputs[0].token_ids
    assert len(set(greedy_ids)) < n, "no repeated token: penalties would have nothing to do"

    def complete(**kw):
        extra = {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty",
                                        "stop_token_ids", "min_tokens") if k in kw}
        done = client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                         extra_body={"ignore_eos": True, **extra}, **kw)
        return done.choices[0]

    greedy = complete(temperature=0).text
    assert greedy == offline[0].outputs[0].text
    for penalty in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0},
                    {"presence_penalty": 2.0}):
        assert complete(temperature=0, **penalty).text != greedy, penalty
    # A hot seeded sample differs from greedy; top_k=1 or min_p=1 keep only the top token.
    hot = dict(temperature=2.0, seed=11)
    assert complete(**hot).text != greedy
    assert complete(**hot, top_k=1).text == greedy
    assert complete(**hot, min_p=1.0).text == greedy
    # stop_token_ids ends the text at that token; min_tokens holds the stop back.
    stop_at = next(i for i in range(1, n) if greedy_ids[i] not in greedy_ids[:i])
    cut = complete(temperature=0, stop_token_ids=[greedy_ids[stop_at]])
    assert cut.finish_reason == "stop" and greedy.startswith(cut.text) and cut.text != greedy
    later = complete(temperature=0, stop_token_ids=[greedy_ids[stop_at]], min_tokens=n)
    assert later.finish_reason == "length"
