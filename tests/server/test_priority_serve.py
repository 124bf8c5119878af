"""`--scheduling-policy` served: a DP=2 server where urgent requests (priority -10) go
ahead of a queue of low-priority ones (priority 10) and two tenants (the names of their
`--api-key-file` keys) share each engine's queue by deficit round robin; and a fcfs
server that refuses a non-zero priority. Orders are checked by counts the engines
themselves report (/debug/request_state asks each engine; /metrics carries their
preemptions), never by timing."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from helpers import metric_sum, serve_all, wait_until

pytestmark = pytest.mark.procs

KEYS = {"batch": "batch-key-0123456789abcdef", "urgent": "urgent-key-0123456789abcd",
        "burst": "burst-key-0123456789abcdef", "steady": "steady-key-0123456789abcd"}
PROMPT = "the quick brown fox jumps over the lazy dog"
# Tokens of the request that holds each engine's one slot first (the model's context is
# 1024): long enough that the requests sent behind it all queue before it ends.
BLOCKER = 960


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    model = str(tiny_llama)
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    keys.chmod(0o600)
    # One running request per engine: everything else queues.
    small = ["--threads-per-engine", "1", "--max-num-seqs", "1", "--num-kv-blocks", "64",
             "--served-model-name", "tiny"]
    with serve_all([model, "-dp", "2", "--api-key-file", str(keys), *small],
                   [model, "--scheduling-policy", "fcfs", *small], timeout=180) as started:
        yield [url for _, url in started]


def auth(tenant: str, rank: int | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    return headers


def engine_sizes(url: str, what: str) -> dict[int, int]:
    """Engine rank -> requests `what` ("waiting", "running") in its scheduler, asked of
    each engine."""
    state = httpx.get(url + "/debug/request_state", headers=auth("batch"), timeout=15).json()
    return {int(rank): sizes[what] for rank, sizes in state["engines"].items()}


def waiting(url: str) -> dict[int, int]:
    return engine_sizes(url, "waiting")


async def stream(client: httpx.AsyncClient, url: str, tenant: str, priority: int,
                 max_tokens: int, rank: int | None = None) -> int:
    """One streamed completion; the tokens it got."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "priority": priority,
            "stream_options": {"include_usage": True}}
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers=auth(tenant, rank)) as resp:
        assert resp.status_code == 200, await resp.aread()
        # Events split on blank lines only: a random model's text may hold characters
        # that str.splitlines() (aiter_lines) would split on.
        buffer = ""
        async for text in resp.aiter_text():
            buffer += text
            *events, buffer = buffer.split("\n\n")
            for event in events:
                if event.startswith("data: {"):
                    chunk = json.loads(event.removeprefix("data: "))
                    assert "error" not in chunk, chunk
                    usage = chunk.get("usage") or usage
    assert usage is not None
    return usage["completion_tokens"]


async def complete(client: httpx.AsyncClient, url: str, tenant: str, priority: int,
                   max_tokens: int) -> int:
    resp = await client.post(url + "/v1/completions", headers=auth(tenant), json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
        "priority": priority})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["completion_tokens"]


async def until(check, what: str, timeout: float = 60.0) -> None:
    """Wait (off the event loop's thread) for `check()`, bounded."""
    await asyncio.to_thread(wait_until, check, timeout, what)


async def queue_up(client: httpx.AsyncClient, url: str, tenant: str, priority: int,
                   per_rank: int, max_tokens: int, queued: int) -> list[asyncio.Task]:
    """`per_rank` streams of `tenant` on each engine, at least `queued` of them waiting
    there once this returns: a long one (BLOCKER tokens) runs first, so that the queue
    behind it fills before anything drains."""
    tasks = [asyncio.create_task(stream(client, url, tenant, priority, BLOCKER, rank=r))
             for r in (0, 1)]
    await until(lambda: all(n == 1 for n in engine_sizes(url, "running").values()),
                f"{tenant}'s first request running on both engines")
    tasks += [asyncio.create_task(stream(client, url, tenant, priority, max_tokens,
                                         rank=i % 2)) for i in range(2 * (per_rank - 1))]
    await until(lambda: all(n >= queued for n in waiting(url).values()),
                f"{tenant}'s requests queued on both engines")
    return tasks


def test_urgent_requests_go_ahead_of_queued_low_priority_ones(servers):
    url = servers[0]

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            # 1. Eight low-priority streams per engine: one runs, the others queue.
            low = await queue_up(client, url, "batch", 10, 8, 64, queued=5)
            preemptions = metric_sum(url, "dpserve:num_preemptions_total")
            # 2. Four urgent requests from another tenant (one by the openai client).
            oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["urgent"])
            urgent = [complete(client, url, "urgent", -10, 8) for _ in range(3)]
            sdk = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                         extra_body={"priority": -10, "ignore_eos": True})
            *tokens, answer = await asyncio.gather(*urgent, sdk)
            assert tokens == [8, 8, 8] and answer.usage.completion_tokens == 8
            # 3. The engines say so: when every urgent request was done, low-priority
            #    requests queued before them still waited, and running ones had been
            #    preempted for them (one slot per engine).
            still = waiting(url)
            assert sum(still.values()) > 0, still
            await until(lambda: metric_sum(url, "dpserve:num_preemptions_total")
                        > preemptions, "an engine preempting a low-priority request")
            # 4. Every low-priority request completes in full.
            assert await asyncio.gather(*low) == [BLOCKER] * 2 + [64] * 14
            await oai.close()

    asyncio.run(run())


def test_two_tenants_share_each_engine_by_deficit_round_robin(servers):
    """Tenant `burst` queues 12 requests on each engine, then tenant `steady` sends 4 to
    each: DRR admits them alternately, where FCFS would run all of `burst`'s first."""
    url = servers[0]

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            burst = await queue_up(client, url, "burst", 0, 12, 96, queued=10)
            before = waiting(url)  # 10 or 11 on each

            async def steady_on(rank: int) -> int:
                """steady's 4 requests on `rank`; burst's requests waiting there after."""
                done = await asyncio.gather(*[stream(client, url, "steady", 0, 96, rank=rank)
                                              for _ in range(4)])
                assert done == [96] * 4
                return (await asyncio.to_thread(waiting, url))[rank]

            after = await asyncio.gather(steady_on(0), steady_on(1))
            for rank in (0, 1):
                # burst's requests admitted on this engine while steady's 4 went: one
                # each (DRR: burst, steady, burst, ...), plus those admitted after
                # steady's last finished before the engine was asked (one, or two: the
                # API server streams behind the engine); FCFS: all (10 or more) first.
                admitted = before[rank] - after[rank]
                assert 3 <= admitted <= 8, (rank, before, after)
            assert await asyncio.gather(*burst) == [BLOCKER] * 2 + [96] * 22

    asyncio.run(run())


def test_fcfs_refuses_a_priority_naming_the_option(servers):
    url = servers[1]
    for path, body in [("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": PROMPT}]}),
                       ("/v1/embeddings", {"input": PROMPT})]:
        r = httpx.post(url + path, json={"model": "tiny", "priority": 5, **body}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "priority" and "--scheduling-policy" in error["message"]
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy"):
        oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                               extra_body={"priority": 5})
    ok = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                extra_body={"priority": 0})
    assert ok.usage.completion_tokens >= 1
