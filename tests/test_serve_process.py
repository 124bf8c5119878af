"""A real `dpserve serve` subprocess (launcher + API server + engine process)
hit by the official `openai` client: results, disconnects, engine death and
start-up failure (SIGTERM under load: tests/test_drain.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx
import openai
import psutil
import pytest

from dpserve import LLM, SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(model: str, *extra: str, env: dict[str, str] | None = None, timeout: float = 120,
          host: str = "127.0.0.1", new_session: bool = False):
    """Start `dpserve serve`, wait for /health, yield (process, base_url); always clean up.

    The server's output goes to a temporary file: `output(proc)` reads it.
    `new_session`: its own process group (for signals to the whole group, as Ctrl-C).
    """
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="dpserve-serve-", suffix=".log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpserve.cli", "serve", model, "--host", host, "--port",
         str(port), *extra],
        env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, text=True,
        start_new_session=new_session)
    proc.log = log  # type: ignore[attr-defined]
    url = f"http://{host}:{port}"
    try:
        wait_healthy(proc, url, timeout, describe=lambda: output(proc))
        yield proc, url
    finally:
        _stop(proc)
        log.close()


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, describe=lambda: "") -> None:
    """Poll `url`/health until 200; fail (with `describe()`) if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited early:\n{describe()[-3000:]}"
        assert time.monotonic() < deadline, \
            f"server did not become healthy in time:\n{describe()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def output(proc: subprocess.Popen) -> str:
    """Everything a process started by `serve` has written so far."""
    with open(proc.log.name) as f:  # type: ignore[attr-defined]
        return f.read()


def _stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM (a drain); if it still runs after `timeout` s, a second SIGTERM (stop
    at once), then SIGKILL."""
    for stop in (proc.terminate, proc.terminate, proc.kill):
        if proc.poll() is not None:
            return
        stop()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _all_gone(procs: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(str(tiny_llama)) as (proc, url):
        yield proc, url, str(tiny_llama)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    assert values, f"metric {name} missing"
    return sum(values)


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
    body = {"model": model, "prompt": "Hello", "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                break  # hang up mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (_metric(url, "dpserve:num_requests_running") == 0
                and _metric(url, "dpserve:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    assert _metric(url, "dpserve:num_requests_running") == 0
    assert _metric(url, "dpserve:kv_cache_usage_perc") == 0


def test_engine_death_fails_requests_and_exits(tiny_llama):
    # The engine's 40th forward raises (test-only fault injection).
    with serve(str(tiny_llama), env={"DPSERVE_FAULT_FORWARD_AT": "40"}) as (proc, url):
        children = _descendants(proc.pid)
        assert children, "the engine should be a child process"

        async def stream_until_error(client: openai.AsyncOpenAI) -> float:
            stream = await client.completions.create(
                model=str(tiny_llama), prompt="Hello", max_tokens=400, stream=True,
                extra_body={"ignore_eos": True})
            with pytest.raises(openai.APIError):
                async for _ in stream:
                    pass
            return time.monotonic()

        async def run() -> list[float]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=60,
                                        max_retries=0)
            try:
                return await asyncio.gather(*(stream_until_error(client) for _ in range(4)))
            finally:
                await client.close()

        ends = asyncio.run(run())
        assert max(ends) - min(ends) < 2.0  # every in-flight request fails together
        assert httpx.get(url + "/health", timeout=2).status_code == 503
        assert proc.wait(15) != 0
        assert _all_gone(children, timeout=5)


def test_bad_model_path_fails_fast_with_one_line(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve",
                           str(tmp_path / "missing-model")], capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - start < 10
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing-model" in lines[0], proc.stderr


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
