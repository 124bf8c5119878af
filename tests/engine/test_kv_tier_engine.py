"""The host KV tier end to end: real engine cores (tiny random Llama, float32) and
a real store process (`dpserve::KVStore`, started as the launcher starts it); last,
a served DP=2 host (`dpserve serve --kv-offload-memory`).

Loads replace recompute exactly: every check compares greedy tokens with an
engine without a tier, and asserts from the engine's side (its SchedulerStats)
that blocks did come from the tier. Two engine cores in this process share one
store as two DP ranks of a host do (each its own client, named by its rank).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers import serve

from dpserve.config import EngineArgs
from dpserve.engine.core import EngineCore
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.kv_store import KVStore
from dpserve.protocol import EngineCoreRequest
from dpserve.sampling_params import SamplingParams

pytestmark = pytest.mark.procs

MAX_TOKENS = 12
ARENA_BYTES = 4 << 20  # 2048 slots of the tiny model's 2 KiB blocks (block size 4)
BS = 4
STEP_LIMIT_S = 120.0  # a generate() that takes longer has hung

PREFIX = [(7 * i + 3) % 300 + 20 for i in range(40)]  # 10 blocks shared by every prompt
PROMPTS = {"a": PREFIX + [11, 12, 13], "b": PREFIX + [21, 22, 23, 24, 25, 26],
           "c": PREFIX[:23] + [31, 32]}
# Three prompts with nothing in common, 10 blocks each (the preemption check).
APART = {f"p{k}": [(13 * i + 50 * k) % 300 + 20 for i in range(40)] for k in range(3)}


@pytest.fixture
def store() -> Iterator[KVStore]:
    kv_store = KVStore(ARENA_BYTES, AddressAllocator())
    kv_store.start()
    try:
        yield kv_store
    finally:
        kv_store.close()


def make_core(model, store: KVStore | None, rank: int = 0, **kw) -> EngineCore:
    """An engine core of DP rank `rank`, with the tier of `store` (None: without)."""
    kw = {"dtype": "float32", "block_size": BS, "num_kv_blocks": 64,
          "max_num_batched_tokens": 64, "max_num_seqs": 4, **kw}
    config = EngineArgs(model=str(model), **kw).create_config()
    if store is not None:  # as the host's launcher sets it before spawning its engines
        config = dataclasses.replace(config, cache=dataclasses.replace(
            config.cache, kv_offload_bytes=ARENA_BYTES, kv_tier_address=store.address))
    return EngineCore(config, dp_rank=rank)


def generate(core: EngineCore, prompts: dict[str, list[int]],
             max_tokens: int = MAX_TOKENS) -> dict[str, list[int]]:
    """Greedy token ids of each prompt, all added at once, stepped to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, list(ids), params))
    tokens: dict[str, list[int]] = {req_id: [] for req_id in prompts}
    deadline = time.monotonic() + STEP_LIMIT_S
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "generate did not finish"
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def expected(tiny_llama) -> dict[str, list[int]]:
    """Every prompt's tokens from an engine without a tier, one prompt at a time."""
    core = make_core(tiny_llama, None)
    try:
        return {req_id: generate(core, {req_id: ids})[req_id]
                for req_id, ids in {**PROMPTS, **APART}.items()}
    finally:
        core.shutdown()


def test_a_prefix_computed_by_one_rank_is_continued_by_another(tiny_llama, store, expected):
    rank0 = make_core(tiny_llama, store, rank=0)
    rank1 = make_core(tiny_llama, store, rank=1)
    try:
        assert generate(rank0, {"a": PROMPTS["a"]}) == {"a": expected["a"]}
        saved = rank0.get_stats()
        assert saved.kv_tier_hits == 0 and saved.kv_tier_saved_bytes > 0
        got = generate(rank1, {"b": PROMPTS["b"], "c": PROMPTS["c"]})
        assert got == {"b": expected["b"], "c": expected["c"]}
        stats = rank1.get_stats()
        assert stats.kv_tier_hits >= len(PREFIX)  # "b"'s 10 prefix blocks (and "c"'s 5)
        assert stats.kv_tier_loaded_bytes > 0 and stats.kv_tier_load_seconds > 0
        assert stats.kv_tier_queries >= stats.kv_tier_hits
        assert stats.kv_tier_num_blocks >= stats.kv_tier_used_blocks > len(PREFIX) // BS
    finally:
        rank0.shutdown()
        rank1.shutdown()


def test_a_request_migrated_to_another_rank_resumes_from_the_tier(tiny_llama, store,
                                                                  expected):
    """Migration: the new rank gets the prompt and the tokens
    generated so far; their blocks, prompt and outputs, come from the tier."""
    rank0 = make_core(tiny_llama, store, rank=0)
    rank1 = make_core(tiny_llama, store, rank=1)
    try:
        assert generate(rank0, {"a": PROMPTS["a"]}) == {"a": expected["a"]}
        done = expected["a"][:8]  # the dead rank had streamed these
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        rank1.add_request(EngineCoreRequest("a", PROMPTS["a"], params,
                                            prior_output_token_ids=done))
        rest: list[int] = []
        deadline = time.monotonic() + STEP_LIMIT_S
        while rank1.has_unfinished_requests():
            assert time.monotonic() < deadline, "the migrated request did not finish"
            rest += [t for out in rank1.step() for t in out.new_token_ids]
        assert rest == expected["a"][8:]
        # 43 prompt + 8 output tokens: 12 full blocks before the last token.
        assert rank1.get_stats().kv_tier_hits == 48
    finally:
        rank0.shutdown()
        rank1.shutdown()


def test_chunked_prefill_loads_and_saves_across_chunks(tiny_llama, store, expected):
    first = make_core(tiny_llama, store, rank=0, max_num_batched_tokens=8)
    second = make_core(tiny_llama, store, rank=1, max_num_batched_tokens=8)
    try:
        assert generate(first, {"c": PROMPTS["c"]}) == {"c": expected["c"]}  # 4 chunks
        assert generate(second, {"a": PROMPTS["a"]}) == {"a": expected["a"]}
        assert second.get_stats().kv_tier_hits == 20  # "c"'s 5 full prompt blocks
        assert second.get_stats().kv_tier_saved_bytes > 0  # the rest, chunk by chunk
    finally:
        first.shutdown()
        second.shutdown()


def test_preempted_requests_come_back_from_the_tier(tiny_llama, store, expected):
    # 20 blocks: three requests of 13 blocks each cannot all stay; a preempted
    # one's blocks are soon reused, so only the tier still holds them.
    core = make_core(tiny_llama, store, num_kv_blocks=20, max_num_seqs=3)
    try:
        assert generate(core, APART) == {k: expected[k] for k in APART}
        stats = core.get_stats()
        assert stats.num_preemptions > 0 and stats.kv_tier_hits > 0
    finally:
        core.shutdown()


def test_store_killed_while_a_load_is_in_flight(tiny_llama, store, expected):
    rank0 = make_core(tiny_llama, store, rank=0)
    rank1 = make_core(tiny_llama, store, rank=1)
    try:
        generate(rank0, {"a": PROMPTS["a"]})
        copier = rank1.runner.kv_copier
        real_load = copier.load
        loads_seen: list[int] = []

        def load_with_store_killed(transfer, kv_caches):  # the fault, injected mid-load
            if not loads_seen:
                os.kill(store.proc.pid, signal.SIGKILL)
                store.proc.join(10)
                store.restart()  # as the launcher does: the dead arena unlinked, a new one
            loads_seen.append(len(transfer.loads))
            real_load(transfer, kv_caches)

        copier.load = load_with_store_killed
        got = generate(rank1, {"b": PROMPTS["b"]})
        assert got == {"b": expected["b"]}
        assert loads_seen and loads_seen[0] == len(PREFIX) // BS  # the load did happen
        assert rank1.get_stats().kv_tier_hits == len(PREFIX)
        # The tier was down for a while: still nothing hangs and nothing is lost.
        assert generate(rank0, {"c": PROMPTS["c"]}) == {"c": expected["c"]}
        # The restarted store serves again: after the client's back-off, a hello has
        # every worker map its new arena, and blocks go there and come back.
        client = rank1.scheduler.tier.connector.client
        deadline = time.monotonic() + 30
        while client.generation != store.generation:
            assert time.monotonic() < deadline, "the engine never came back to the store"
            assert generate(rank1, {"c": PROMPTS["c"]}) == {"c": expected["c"]}
        hits = rank1.get_stats().kv_tier_hits
        for _ in range(2):  # computed and saved, then loaded
            assert rank1.reset_prefix_cache()
            assert generate(rank1, {"a": PROMPTS["a"]}) == {"a": expected["a"]}
        assert rank1.get_stats().kv_tier_hits == hits + len(PREFIX)
    finally:
        rank0.shutdown()
        rank1.shutdown()


def test_tensor_parallel_workers_save_and_load_their_shards(tiny_llama, store):
    plain = make_core(tiny_llama, None, tensor_parallel_size=2)
    try:
        want = generate(plain, {"b": PROMPTS["b"]})
    finally:
        plain.shutdown()
    core = make_core(tiny_llama, store, tensor_parallel_size=2)
    try:
        assert generate(core, {"b": PROMPTS["b"]}) == want
        assert core.reset_prefix_cache()  # the local copy gone: only the tier has it
        assert generate(core, {"b2": PROMPTS["b"]}) == {"b2": want["b"]}
        stats = core.get_stats()
        assert stats.kv_tier_hits == len(PREFIX) + 4  # every full block but the last token's
        # a slot: both workers' shards of a block, 2 layers x K, V x 4 x 2 heads x 16 x 4 B
        assert stats.kv_tier_loaded_bytes == stats.kv_tier_hits // BS * 2048
    finally:
        core.shutdown()


def complete(url: str, model: str, prompt: list[int], rank: int) -> dict:
    resp = httpx.post(url + "/v1/completions", timeout=120,
                      headers={"X-data-parallel-rank": str(rank)},
                      json={"model": model, "prompt": prompt, "temperature": 0,
                            "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_served_ranks_load_what_the_other_computed(tiny_llama):
    """A served host at DP=2: a prompt computed on rank 0 is loaded by rank 1, which
    never saw it (its usage counts the loaded tokens as cached), token for token."""
    model = str(tiny_llama)
    with serve(model, "--data-parallel-size", "2", "--kv-offload-memory", "16MiB",
               "--dtype", "float32", "--block-size", str(BS)) as (_, url):
        first = complete(url, model, PROMPTS["b"], rank=0)
        second = complete(url, model, PROMPTS["b"], rank=1)
    assert (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX) + 4
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
