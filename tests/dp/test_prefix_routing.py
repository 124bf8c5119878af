"""`--load-balance cache-aware` on a real `dpserve serve --data-parallel-size 2`.

Sessions, each a shared prefix plus a short turn, sent one at a time over HTTP
(token-id prompts, so prefixes are block-aligned), with each engine's KV cache
(`--num-kv-blocks`) able to hold only about half the prefixes. The sessions' order
rotates by one every turn, so a balancer blind to prefixes moves sessions between
ranks (and a rank that got them all would cycle through more prefixes than it
holds). With cache-aware routing every follow-up turn lands on the rank that holds
its prefix: the user sees `usage.prompt_tokens_details.cached_tokens` >= the
prefix on every follow-up, and /metrics' prefix-cache hits are higher than with
least-loaded. Counts only, no timing.
"""

from __future__ import annotations

import httpx
import pytest
from helpers import metric_sum, serve_all

pytestmark = pytest.mark.procs

SESSIONS, TURNS = 8, 4
PREFIX = 64  # tokens: 4 blocks of 16
BLOCKS_PER_ENGINE = 28  # 16 blocks hold half the prefixes; all would need 32
ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "128",
        "--num-kv-blocks", str(BLOCKS_PER_ENGINE))


def session_prompt(session: int, turn: int) -> list[int]:
    prefix = [(10 + 37 * session + 7 * i) % 300 + 20 for i in range(PREFIX)]
    return prefix + [5, 6 + turn, 7 + session, 8, 9, 10]


def run_sessions(url: str, model: str) -> tuple[dict[tuple[int, int], int], float]:
    """Every (session, turn) once, in turns; (session, turn) -> cached_tokens, and
    the prefix-cache hits /metrics counted meanwhile (both engines)."""
    before = metric_sum(url, "dpserve:prefix_cache_hits_total")
    cached: dict[tuple[int, int], int] = {}
    with httpx.Client(timeout=60) as client:
        for turn in range(TURNS):
            for k in range(SESSIONS):
                session = (k + turn) % SESSIONS  # rotated by one per turn
                resp = client.post(url + "/v1/completions", json={
                    "model": model, "prompt": session_prompt(session, turn), "max_tokens": 2,
                    "temperature": 0, "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                details = resp.json()["usage"].get("prompt_tokens_details") or {}
                cached[session, turn] = details.get("cached_tokens", 0)
    return cached, metric_sum(url, "dpserve:prefix_cache_hits_total") - before


@pytest.fixture(scope="module")
def outcomes(tiny_llama):
    policies = ("cache-aware", "least-loaded")
    model = str(tiny_llama)
    # Both servers at once (their start-ups overlap), then each one's sessions: the
    # counts depend on the routing alone.
    with serve_all(*([model, *ARGS, "--load-balance", policy] for policy in policies)) as (
            servers):
        return {policy: run_sessions(url, model)
                for policy, (_, url) in zip(policies, servers)}


def test_cache_aware_keeps_every_follow_up_on_its_prefix(outcomes):
    cached, hits = outcomes["cache-aware"]
    assert all(cached[s, 0] == 0 for s in range(SESSIONS))  # new prefixes
    misses = {k: v for k, v in cached.items() if k[1] > 0 and v < PREFIX}
    assert not misses, misses
    assert hits >= SESSIONS * (TURNS - 1) * PREFIX


def test_cache_aware_hits_more_than_least_loaded(outcomes):
    aware_cached, aware_hits = outcomes["cache-aware"]
    plain_cached, plain_hits = outcomes["least-loaded"]
    assert sum(plain_cached.values()) < sum(aware_cached.values()), (plain_cached,
                                                                       aware_cached)
    assert plain_hits < aware_hits, (plain_hits, aware_hits)
