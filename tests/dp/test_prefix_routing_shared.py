"""The default balancer with several API servers: `dpserve serve --data-parallel-size 2
--api-server-count 2` (no `--load-balance`: cache-aware is the default; tiny random
model), hit over HTTP one request at a time, each on a new connection so that the
kernel hands them to both API servers.

Every request shares one long prefix (token ids, block-aligned) and differs after it.
Each API server's router on its own would start a new prefix from its own index
(API server 0 on rank 0, API server 1 on rank 1); because the routers share what
they placed through the DP coordinator, every request lands on the rank the first
one went to, whichever API server takes it. Seen from outside only: which engine
and which API server finished each request (/metrics, summed over the API servers)
and the user's `usage.prompt_tokens_details.cached_tokens` (the engine's prefix-cache
hits), never the routers' state.
"""

from __future__ import annotations

import httpx
import pytest
from helpers import finished_by_engine_and_api_server, serve

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

PREFIX = 96  # tokens: 6 blocks of 16
EACH = 3  # requests each API server must have answered
MAX_REQUESTS = 40


def _grown(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return [k for k, v in after.items() if v != before.get(k, 0.0)]


def test_a_shared_prefix_lands_on_one_rank_through_both_api_servers(tiny_llama):
    model = str(tiny_llama)
    prefix = [(11 + 7 * i) % 250 + 20 for i in range(PREFIX)]
    with serve(model, "--data-parallel-size", "2", "--api-server-count", "2",
               "--threads-per-engine", "1", "--max-model-len", "256", timeout=180) as (_, url):
        placed: list[tuple[str, str, int]] = []  # (API server, rank, cached tokens)
        for i in range(MAX_REQUESTS):
            engines_before, servers_before = finished_by_engine_and_api_server(url)
            resp = httpx.post(url + "/v1/completions", headers={"Connection": "close"},
                              timeout=60, json={
                                  "model": model, "prompt": prefix + [5, 6 + i % 50, 7, 8],
                                  "max_tokens": 2, "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            engines_after, servers_after = finished_by_engine_and_api_server(url)
            ranks, servers = _grown(engines_before, engines_after), _grown(servers_before,
                                                                           servers_after)
            assert len(ranks) == 1 and len(servers) == 1, (ranks, servers)
            details = resp.json()["usage"].get("prompt_tokens_details") or {}
            placed.append((servers[0], ranks[0], details.get("cached_tokens", 0)))
            if all(sum(s == server for s, _, _ in placed) >= EACH for server in ("0", "1")):
                break
        else:
            raise AssertionError(f"one API server answered nearly all: {placed}")
    assert len({rank for _, rank, _ in placed}) == 1, placed
    # The engine's side: every request after the first hit the prefix in its cache.
    assert all(cached >= PREFIX for _, _, cached in placed[1:]), placed
