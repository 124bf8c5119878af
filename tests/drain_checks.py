"""Drain checks shared by test_drain and test_moe_parallel: streams run against a
real `dpserve serve`, a signal once every one is under way, and what the user sees
(503s with Retry-After while draining, every stream whole, exit code 0, no process
left). Not a test module: test modules import it, never each other."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from helpers import all_gone, descendants, output, stopping

NEW_CONNECTIONS = httpx.Limits(max_keepalive_connections=0)  # spread over API servers


@dataclass
class Stream:
    status: int
    completion_tokens: int | None = None  # from the usage chunk
    finish_reason: str | None = None
    error: str | None = None  # the transport broke, or an error event came


async def _stream(client: httpx.AsyncClient, url: str, model: str, max_tokens: int,
                  started: Callable[[], None], headers: dict[str, str],
                  first_token: bool) -> Stream:
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = Stream(0)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers=headers) as resp:
            result.status = resp.status_code
            if not first_token:  # the server sends them as it hands the request on
                started()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if first_token:  # the engine runs it
                    first_token = False
                    started()
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                for choice in chunk.get("choices", []):
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def run_streams(url: str, model: str, max_tokens: list[int],
                       then: Callable[[httpx.AsyncClient], object],
                       headers: dict[str, str] | None = None,
                       first_token: bool = False) -> list[Stream]:
    """Start one stream per entry of `max_tokens`; once every one is under way
    (its response began, or with `first_token` its first chunk came), await
    `then(client)`; return how each stream ended."""
    async with httpx.AsyncClient(timeout=120, limits=NEW_CONNECTIONS) as client:
        all_started = asyncio.Event()
        count = 0

        def started() -> None:
            nonlocal count
            count += 1
            if count == len(max_tokens):
                all_started.set()

        tasks = [asyncio.create_task(_stream(client, url, model, n, started, headers or {},
                                                     first_token))
                 for n in max_tokens]
        await asyncio.wait_for(all_started.wait(), 60)
        await then(client)
        return await asyncio.wait_for(asyncio.gather(*tasks), 180)


async def wait_status(client: httpx.AsyncClient, url: str, path: str, status: int,
                       times: int = 1, timeout: float = 20) -> None:
    """Poll `path` until it answers `status` `times` times in a row (fresh connections)."""
    deadline = time.monotonic() + timeout
    seen = 0
    while seen < times:
        assert time.monotonic() < deadline, f"{path} never answered {status}"
        seen = seen + 1 if (await client.get(url + path)).status_code == status else 0
        await asyncio.sleep(0.02)


async def _assert_draining(client: httpx.AsyncClient, url: str, model: str,
                           times: int = 1) -> None:
    await wait_status(client, url, "/health", 503, times)
    for _ in range(times):  # each may reach another API server
        resp = await client.post(url + "/v1/completions",
                                 json={"model": model, "prompt": "late", "max_tokens": 4})
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["Retry-After"]) > 0
        error = resp.json()["error"]
        assert error["code"] == "server_draining" and "shutting down" in error["message"]
        assert (await client.get(url + "/v1/models")).status_code == 503


async def _assert_held(client: httpx.AsyncClient, url: str, proc: subprocess.Popen,
                       children: list, api_servers: int) -> None:
    """Once an API server has drained while the long stream still runs: every API
    server process is alive, and fresh connections (spread over them) get 503s."""
    deadline = time.monotonic() + 60
    while "drained; answering 503 until every API server has" not in output(proc):
        assert time.monotonic() < deadline, output(proc)[-3000:]
        await asyncio.sleep(0.1)
    names = [p.name() for p in children if p.is_running()]
    assert sum(n.startswith("dpserve::APIServer_") for n in names) == api_servers, names
    await wait_status(client, url, "/health", 503, times=8)
    assert "every API server has drained" not in output(proc), "the long stream ended early"


def check_drain(server: tuple[subprocess.Popen, str], model: str, draining_checks: int = 1,
                 group_signal: int | None = None, api_servers: int = 1) -> None:
    """SIGTERM to the server (or `group_signal` to its whole process group, as
    Ctrl-C in a terminal does; the server was started with `new_session`) while
    streams run: all of them finish whole. With `api_servers` > 1, one that has
    drained its own streams goes on answering 503 (it does not exit) while another
    still streams. The server is stopped at the end."""
    with stopping(server) as (proc, url):
        children = descendants(proc.pid)

        async def signal_then_check(client: httpx.AsyncClient) -> None:
            if group_signal is None:
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, group_signal)
            await _assert_draining(client, url, model, draining_checks)
            if api_servers > 1:
                await _assert_held(client, url, proc, children, api_servers)

        # Eight 96-token streams, and a long one that keeps the server draining
        # while the 503s are checked (1,000 tokens, near the tiny model's 1,024: at
        # 500 it once ended before the checks did, with another test file running
        # beside this one). A group signal reaches the engines too, so wait until
        # each one runs there (an engine that drains takes no new work).
        lengths = [96] * 8 + [1000]
        streams = asyncio.run(run_streams(url, model, lengths, signal_then_check,
                                           first_token=group_signal is not None))
        assert proc.wait(60) == 0, output(proc)[-3000:]
        for s, n in zip(streams, lengths):
            assert s == Stream(200, n, "length"), (s, output(proc)[-4000:])
        assert all_gone(children, timeout=15), [p for p in children if p.is_running()]
        assert "draining: " in output(proc)
        if api_servers > 1:
            assert output(proc).count("drained; answering 503") == api_servers
            assert "every API server has drained; closing them" in output(proc)
