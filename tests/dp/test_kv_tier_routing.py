"""Routing with the KV host tier, end to end: `dpserve serve -dp 2 --load-balance
cache-aware --kv-offload-memory 64MiB` on the tiny model. A session's prefix is
computed on one rank (and saved to the host's tier); a burst of its turns makes
that rank busier, so the router sends part of the burst to the other rank, which
loads the prefix from the tier instead of computing it (its
dpserve:external_prefix_cache_hits grow). /metrics has the tier's series per
engine, /engines a `kv_tier` row per rank."""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest
from helpers import finished_by_engine, serve, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.slow]

ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256",
        "--load-balance", "cache-aware", "--kv-offload-memory", "64MiB")


def per_engine(url: str, name: str) -> dict[int, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        rf'^{re.escape(name)}\{{engine="(\d+)",[^}}]*\}} (\S+)$', text, re.M)}


async def completions(url: str, prompts: list[list[int]], max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(prompt: list[int]) -> None:
            resp = await client.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
        await asyncio.gather(*(one(p) for p in prompts))


def test_a_burst_spreads_to_the_other_rank_which_loads_the_prefix_from_the_tier(tiny_llama):
    rng = random.Random(0)
    prefix = [rng.randrange(10, 380) for _ in range(160)]  # 10 full blocks
    turns = [prefix + [rng.randrange(10, 380) for _ in range(8)] for _ in range(8)]
    with serve(str(tiny_llama), "--served-model-name", "tiny", *ARGS) as (_, url):
        # Both ranks' hosts are known (heartbeats): they share this host's tier.
        wait_until(lambda: all(e["host"] for e in httpx.get(url + "/engines", timeout=5)
                               .json()["engines"]), 30, "both ranks' hosts in /engines")
        asyncio.run(completions(url, [turns[0]], max_tokens=2))
        owner = next(iter(finished_by_engine(url)))
        other = 1 - owner
        wait_until(lambda: per_engine(url, "dpserve:kv_offload_store_bytes_total")
                   .get(owner, 0) > 0, 30, "the owner's saves to the tier")
        assert per_engine(url, "dpserve:external_prefix_cache_hits_total").get(other, 0) == 0
        asyncio.run(completions(url, turns[1:], max_tokens=32))  # the burst
        finished = finished_by_engine(url)
        assert finished.get(other, 0) > 0, f"the burst all went to rank {owner}: {finished}"
        hits = per_engine(url, "dpserve:external_prefix_cache_hits_total")
        assert hits.get(other, 0) >= 160, hits  # the whole prefix, loaded not computed
        assert per_engine(url, "dpserve:kv_offload_load_bytes_total").get(other, 0) > 0
        assert per_engine(url, "dpserve:kv_offload_load_time_total").get(other, 0) > 0
        usage = per_engine(url, "dpserve:kv_offload_cpu_cache_usage_perc")
        assert set(usage) == {0, 1}

        rows = httpx.get(url + "/engines", timeout=5).json()["engines"]
        tier = {r["rank"]: r["kv_tier"] for r in rows}
        assert tier[other]["hits"] >= 160 and tier[other]["loaded_bytes"] > 0, tier
        assert tier[owner]["saved_bytes"] > 0, tier


def test_without_the_tier_engines_show_none(tiny_llama):
    with serve(str(tiny_llama), "--served-model-name", "tiny", "--max-model-len", "256",
               "--threads-per-engine", "1") as (_, url):
        asyncio.run(completions(url, [[5, 6, 7, 8] * 10], max_tokens=2))
        assert [r["kv_tier"] for r in httpx.get(url + "/engines", timeout=5)
                .json()["engines"]] == [None]
        assert "dpserve:external_prefix_cache_hits_total{" not in httpx.get(
            url + "/metrics", timeout=5).text
