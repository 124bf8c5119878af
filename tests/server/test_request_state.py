"""No per-request state outlives its request (memory that grows under load).

A real `dpserve serve` with two engines and a small KV cache (so requests are
preempted and prefix blocks evicted) takes ~600 short requests of every kind:
streamed or not, greedy or sampled, seeded, n=2, with stop strings and logprobs,
chat, with a grammar (structured output), prompts too long (rejected), bad bodies
(400) and streams the client drops.
Afterwards `/debug/request_state` must show every per-request structure empty (the
API server's tracked requests, output processor, engine client; each engine's
scheduler queues, KV block tables, seeded generators and routing map), every KV block
free (cached or not), and /metrics no more series than after the first requests of
each kind: no label set grows with the number of requests.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import pytest
from helpers import serve

pytestmark = [pytest.mark.procs, pytest.mark.slow]

NUM_REQUESTS = 600
CONCURRENCY = 16
MAX_MODEL_LEN = 256
WORDS = "the engines share one model and each request takes its own path through them".split()


def _body(rng: random.Random, kind: str) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    body: dict = {"model": "tiny", "max_tokens": rng.randint(1, 16),
                  "temperature": rng.choice((0.0, 0.8))}
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                               "content": prompt}]}
    body["prompt"] = prompt
    if kind == "seeded":
        body.update(seed=rng.randint(0, 100), temperature=1.0)
    elif kind == "n2":
        body.update(n=2, temperature=0.8)
    elif kind == "stop":
        body.update(stop=[rng.choice(WORDS)], logprobs=2)
    elif kind == "too_long":
        body["prompt"] = " ".join(["engines"] * (MAX_MODEL_LEN + 50))
    elif kind == "bad":
        body["max_tokens"] = -1
    elif kind in ("stream", "drop"):
        body["stream"] = True
    elif kind == "json":  # a grammar per request: the engine's structured-output state
        body.update(stream=rng.random() < 0.5, structured_outputs={"choice": WORDS[:4]})
    return "/v1/completions", body


KINDS = ("plain", "chat", "seeded", "n2", "stop", "too_long", "bad", "stream", "drop",
         "json")
EXPECTED_STATUS = {"too_long": 400, "bad": 400}


async def _one(client: httpx.AsyncClient, rng: random.Random, kind: str) -> str:
    """Send one request of `kind`; returns how it ended ("ok", "dropped" or the error)."""
    path, body = _body(rng, kind)
    if not body.get("stream"):
        resp = await client.post(path, json=body)
        if resp.status_code != EXPECTED_STATUS.get(kind, 200):
            return f"{kind}: HTTP {resp.status_code} {resp.text[:200]}"
        return "ok"
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            return f"{kind}: HTTP {resp.status_code}"
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                return "ok"
            if line.startswith("data: ") and kind == "drop":
                return "dropped"  # leaving the block closes the connection mid-stream
            if line.startswith("data: ") and "error" in json.loads(line[6:]):
                return f"{kind}: in-stream error {line}"
    return f"{kind}: stream ended without [DONE]"


async def _load(url: str, kinds: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, kind: str) -> str:
        async with limit:
            return await _one(client, rng, kind)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(one(client, k) for k in kinds))


def _series(url: str) -> set[str]:
    """Every metric series (name and labels) /metrics shows."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1) for m in re.finditer(r"^([^#\s][^ ]*) \S+$", text, re.M)}


def _leftovers(url: str) -> dict[str, dict[str, int]]:
    """Per-request structures that are not empty (and KV blocks not free), by process."""
    state = httpx.get(url + "/debug/request_state", timeout=15).json()
    left = {"api_server": {k: v for k, v in state["api_server"].items() if v}}
    for rank, sizes in state["engines"].items():
        kv_totals = {"kv_blocks", "kv_free", "kv_cached"}
        left[f"engine {rank}"] = {k: v for k, v in sizes.items() if v and k not in kv_totals}
        if sizes["kv_free"] != sizes["kv_blocks"]:
            left[f"engine {rank}"]["kv_not_free"] = sizes["kv_blocks"] - sizes["kv_free"]
    return {where: sizes for where, sizes in left.items() if sizes}


def _wait_empty(url: str, timeout: float = 30.0) -> None:
    """Until nothing is left (aborts of dropped streams arrive asynchronously)."""
    deadline = time.monotonic() + timeout
    while (left := _leftovers(url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"per-request state left behind: {left}"


def test_thousands_of_requests_leave_no_per_request_state(tiny_llama):
    with serve(str(tiny_llama), "--served-model-name", "tiny", "--data-parallel-size", "2",
               "--num-kv-blocks", "48", "--block-size", "16", "--max-model-len",
               str(MAX_MODEL_LEN)) as (_, url):
        state = httpx.get(url + "/debug/request_state", timeout=15).json()
        assert set(state["engines"]) == {"0", "1"}, state
        # Every kind of request once per engine first: the series they create are the
        # fixed set; the next ~600 requests may add none.
        first = asyncio.run(_load(url, [k for k in KINDS for _ in range(8)], seed=1))
        assert first.count("dropped") == 8 and all(r in ("ok", "dropped") for r in first), \
            [r for r in first if r not in ("ok", "dropped")]
        _wait_empty(url)
        _series(url)  # (the first scrape adds /metrics' own HTTP-response series)
        series = _series(url)

        rng = random.Random(2)
        kinds = rng.choices(KINDS, weights=(4, 2, 1, 1, 2, 1, 1, 4, 2, 1), k=NUM_REQUESTS)
        outcomes = asyncio.run(_load(url, kinds, seed=3))
        failures = [r for r in outcomes if r not in ("ok", "dropped")]
        assert not failures, failures[:5]
        assert outcomes.count("dropped") == kinds.count("drop")

        # Dropped streams are aborted asynchronously: allow that to settle.
        _wait_empty(url)
        grown = _series(url) - series
        assert not grown, f"metric series added by more requests: {sorted(grown)[:10]}"
        # The engines really were busy: the cache filled and both ranks served.
        finished = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^dpserve:engine_requests_finished_total{[^}]*engine="(\d+)"[^}]*} (\S+)$',
            httpx.get(url + "/metrics", timeout=10).text, re.M)}
        assert len(finished) == 2 and min(finished.values()) > NUM_REQUESTS / 8, finished
