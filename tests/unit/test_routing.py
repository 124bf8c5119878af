"""The engine-choice policies of `dpserve.frontend.routing`, as pure logic: the
Router over named fake engine states (only the load figures it reads), the
PrefixTracker's hash chain against the engine's own prefix cache, and its LRU."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fakes import BS, FakeEngineState, engines, prompt, request

from dpserve import SamplingParams
from dpserve.engine.kv_cache import KVCacheManager
from dpserve.engine.request import Request
from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.frontend.routing import (
    CacheAwareOptions,
    PrefixTracker,
    Router,
    kv_capacity_blocks,
)
from dpserve.launch.addresses import AddressAllocator
from dpserve.protocol import (
    EngineCoreRequest,
    EngineInfo,
    LoRAReport,
    RankState,
    RankStatus,
    SchedulerStats,
)


def test_the_hash_chain_is_the_engines():
    tokens = list(range(100, 123))  # 23 tokens: (23 - 1) // 4 = 5 blocks can hit
    manager = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=True)
    req = Request("x", tokens, SamplingParams())
    manager.update_block_hashes(req)
    chain = PrefixTracker(BS).hashes(tokens)
    assert len(chain) == 5
    assert chain == req.block_hashes[:5]
    assert PrefixTracker(BS).hashes([]) == [] and PrefixTracker(BS).hashes([1] * 4) == []


def test_tracker_matches_leading_blocks_and_forgets_the_oldest():
    tracker = PrefixTracker(BS)
    a, b = tracker.hashes(prompt(1, 0)), tracker.hashes(prompt(2, 0))
    tracker.record(0, a, capacity=10)
    assert tracker.matched_blocks(0, a) == 6 and tracker.matched_blocks(1, a) == 0
    other_start = tracker.hashes([5] * BS + prompt(1, 0))  # same blocks, shifted: no match
    assert tracker.matched_blocks(0, other_start) == 0
    tracker.record(0, b, capacity=10)  # 12 blocks > 10: a's two oldest go
    assert tracker.size(0) == 10
    assert tracker.matched_blocks(0, b) == 6
    assert tracker.matched_blocks(0, a) == 0  # its first block is gone: no prefix left
    tracker.forget(0)
    assert tracker.size(0) == 0 and tracker.matched_blocks(0, b) == 0


def test_capacity_from_the_engines_figures():
    stats = SchedulerStats(0, 0, kv_cache_usage=0.75, prefix_cache_queries=0,
                           prefix_cache_hits=0, num_preemptions=0, num_free_blocks=25)
    assert kv_capacity_blocks(stats) == 100
    assert kv_capacity_blocks(None) is None
    full = SchedulerStats(0, 0, 1.0, 0, 0, 0, num_free_blocks=0)
    assert kv_capacity_blocks(full) is None


def test_sessions_stick_to_the_rank_that_holds_their_prefix():
    router = Router("cache-aware", block_size=BS)
    live = engines()
    first = {s: router.choose(live, request(prompt(s, 0)), balanced=True).rank
             for s in range(4)}
    assert sorted(first.values()) == [0, 0, 1, 1]  # new prefixes spread (loads tie)
    live[0].running = live[1].running = 3
    live[first[0]].running += 4  # busier, but within balance_abs (32)
    for turn in range(1, 4):
        for s in range(4):
            assert router.choose(live, request(prompt(s, turn)), balanced=True).rank \
                == first[s], (s, turn)
    assert router.cache_routed == 12 and router.load_routed == 4
    # The least-loaded policy ignores prefixes: everything to the least loaded rank.
    plain = Router("least-loaded", block_size=BS)
    assert {plain.choose(live, request(prompt(s, 1)), balanced=True).rank
            for s in range(4)} == {1 - first[0]}


def test_a_hot_rank_yields_to_load_and_the_prefix_spreads():
    router = Router("cache-aware", block_size=BS,
                    options=CacheAwareOptions(balance_abs=8, balance_rel=1.5))
    live = engines()
    home = router.choose(live, request(prompt(1, 0)), balanced=True)
    away = live[1 - home.rank]
    home.waiting, away.running = 3, 4  # 12 vs 4: +8, not more than 8: still home
    assert router.choose(live, request(prompt(1, 1)), balanced=True) is home
    home.waiting = 4  # 16 vs 4: +12 > 8 and > 1.5 x 4: hot
    assert router.choose(live, request(prompt(1, 2)), balanced=True) is away
    home.waiting = 0  # cool again: both hold the prefix now, the less loaded wins
    assert router.choose(live, request(prompt(1, 3)), balanced=True) is home
    away.running = 0
    home.running = 2
    assert router.choose(live, request(prompt(1, 4)), balanced=True) is away


def test_relative_threshold_alone_does_not_make_a_rank_hot():
    router = Router("cache-aware", block_size=BS,
                    options=CacheAwareOptions(balance_abs=8, balance_rel=1.5))
    live = engines()
    home = router.choose(live, request(prompt(1, 0)), balanced=False)
    home.num_requests, live[1 - home.rank].num_requests = 30, 20  # +10 but 1.5x not passed
    assert router.choose(live, request(prompt(1, 1)), balanced=False) is home


def test_short_matches_and_forgotten_ranks_go_by_load():
    router = Router("cache-aware", block_size=BS, options=CacheAwareOptions(cache_threshold=0.5))
    live = engines()
    home = router.choose(live, request(prompt(1, 0, prefix_blocks=2)), balanced=True)
    away = live[1 - home.rank]
    home.running = 1  # loaded a little: a prefix that is too short does not pull
    long_turn = prompt(1, 0, prefix_blocks=2) + list(range(40))  # 8 of 52 tokens matched
    assert router.choose(live, request(long_turn), balanced=True) is away
    router.forget(away.rank)
    router.forget(home.rank)
    assert router.tracker.size(home.rank) == router.tracker.size(away.rank) == 0
    away.running = 2
    assert router.choose(live, request(prompt(1, 1, prefix_blocks=2)), balanced=True) is home


def test_pinned_requests_are_recorded_and_the_lru_is_sized_from_stats():
    router = Router("cache-aware", block_size=BS)
    live = engines()
    live[1].stats = SchedulerStats(0, 0, 0.5, 0, 0, 0, num_free_blocks=4)  # 8 blocks
    router.record(live[1], request=request(prompt(1, 0)))  # as a pinned request does
    assert router.choose(live, request(prompt(1, 1)), balanced=True) is live[1]
    router.record(live[1], request=request(prompt(2, 0)))  # 6 + 6 > 8: session 1 fades
    assert router.tracker.size(1) == 8
    live[1].running = 1
    assert router.choose(live, request(prompt(1, 2)), balanced=True) is live[0]


def test_least_loaded_and_round_robin_are_unchanged():
    live = engines(3)
    live[0].waiting, live[1].running, live[2].running = 1, 2, 2  # 4, 2, 2
    assert Router("least-loaded", client_index=2).choose(live, request([1]), balanced=True) \
        is live[2]  # a tie: the scan starts at the client's own index
    live[0].num_requests, live[1].num_requests, live[2].num_requests = 1, 0, 0
    assert Router("least-loaded", client_index=2).choose(live, request([1]),
                                                         balanced=False) is live[1]
    rr = Router("round-robin", client_index=1)
    assert [rr.choose(live, request([1]), balanced=True).rank for _ in range(4)] == [1, 2, 0, 1]


def test_least_loaded_spreads_each_named_tenant_over_equally_busy_ranks():
    """Ties (and near ties) under least-loaded go to each named tenant's next rank in
    its own turn: both tenants' requests alternate over both ranks, whatever the other
    sends in between; a rank past the slack is not taken, and anonymous requests keep
    the plain tie-break (the first rank from this client's index)."""
    router = Router("least-loaded")
    live = engines(3, waiting=2)
    live[2].waiting = 5  # 12 load units above the others: past TENANT_SPREAD_SLACK

    def choose(tenant: str | None) -> int:
        req = msgspec.structs.replace(request([1, 2, 3]), tenant=tenant)
        return router.choose(live, req, balanced=True).rank

    picks = [(choose("steady"), choose("burst"), choose("burst")) for _ in range(4)]
    steady = [p[0] for p in picks]
    burst = [rank for p in picks for rank in p[1:]]
    assert steady == [0, 1, 0, 1] and burst == [0, 1] * 4, picks
    assert {choose(None), choose("default")} == {0}


def test_cache_aware_takes_a_named_tenants_new_prefixes_in_turn():
    """The default balancer keeps least-loaded's tenant spread for new prefixes (each
    tenant's requests alternate over equally busy ranks, whatever the records' sizes),
    and a known prefix still goes where it is."""
    router = Router("cache-aware", block_size=BS)
    live = engines(2)
    router.record(live[0], router.tracker.hashes(prompt(9, 0)))  # rank 0's record: larger

    def choose(tenant: str | None, session: int) -> int:
        req = msgspec.structs.replace(request(prompt(session, 0)), tenant=tenant)
        return router.choose(live, req, balanced=True).rank

    assert [choose("steady", s) for s in range(1, 5)] == [0, 1, 0, 1]
    assert choose("steady", 9) == 0  # its prefix is there
    assert choose(None, 5) == 1  # anonymous: the smaller record


def test_cache_aware_places_a_prompt_under_one_block_by_load_alone():
    """No block to spread: the record sizes do not count, the loads do (as least-loaded)."""
    router = Router("cache-aware", block_size=BS)
    live = engines(2)
    router.record(live[1], router.tracker.hashes(prompt(9, 0)))  # rank 0: the smaller record
    live[0].waiting = 1
    assert router.choose(live, request([1, 2, 3]), balanced=True).rank == 1
    assert router.choose(live, request(prompt(3, 0)), balanced=True).rank == 0  # a new prefix


def test_a_new_prefix_goes_to_the_smaller_record_only_among_nearly_idle_ranks():
    router = Router("cache-aware", block_size=BS)
    live = engines(2)
    router.record(live[0], router.tracker.hashes(prompt(9, 0)))  # rank 1: the smaller record
    live[1].running = 8  # two waiting requests' worth busier: still near
    assert router.choose(live, request(prompt(1, 0)), balanced=True).rank == 1
    live[1].running = 9  # past the slack (8) over rank 0's 0: by load
    router.forget(1)
    assert router.choose(live, request(prompt(2, 0)), balanced=True).rank == 0


def test_an_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="least-loaded, round-robin, cache-aware"):
        Router("random")


def test_the_client_records_pinned_requests_and_forgets_a_lost_rank():
    """AsyncEngineClient's side (real sockets, no engines: placement only)."""

    async def run() -> None:
        alloc = AddressAllocator()
        addrs = alloc.engine_addresses(num_clients=1)
        client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], engine_ranks=(0, 1),
                                   load_balance="cache-aware", block_size=BS)
        try:
            tracker = client.router.tracker
            pinned = EngineCoreRequest("p", prompt(1, 0), SamplingParams(),
                                       data_parallel_rank=1)
            assert client.table.choose(pinned).rank == 1 and tracker.size(1) == 6
            assert client.table.choose(request(prompt(1, 1))).rank == 1  # its prefix
            assert client.table.choose(request(prompt(2, 0))).rank == 0  # a new one
            client.set_rank_status(1, RankStatus(RankState.UNHEALTHY, 0, "test"))
            assert tracker.size(1) == 6  # alive: its cache may still be there
            client.mark_engine_dead(1, "test")
            assert tracker.size(1) == 0 and tracker.size(0) == 6
        finally:
            await client.aclose()
            alloc.cleanup()

    asyncio.run(run())


def test_new_prefixes_tie_break_from_the_clients_own_index():
    live = engines(3)
    firsts = [Router("cache-aware", client_index=i, block_size=BS).choose(
        live, request(prompt(1, 0)), balanced=True).rank for i in range(4)]
    assert firsts == [0, 1, 2, 0]


def lora_request(name: str | None, tokens: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest("r", tokens or [1, 2, 3], SamplingParams(), lora_name=name)


def with_lora(engine: FakeEngineState, resident=(), cached=(), max_loras=2
              ) -> FakeEngineState:
    engine.info = EngineInfo(lora=LoRAReport(resident=list(resident), cached=list(cached),
                                             max_loras=max_loras))
    return engine


def test_adapter_aware_prefers_resident_then_cached_then_a_free_slot():
    live = engines(3, waiting=0, running=2)
    with_lora(live[0], resident=["p", "q"])  # full, without x
    with_lora(live[1], cached=["x"], resident=["p", "q"])  # x one slot load away
    with_lora(live[2], resident=["y"])  # a free slot
    assert Router("cache-aware").choose(live, lora_request("x"), balanced=True).rank == 1
    with_lora(live[2], resident=["x"])
    assert Router("cache-aware").choose(live, lora_request("x"), balanced=True).rank == 2
    # No rank holds z: the one with a free slot, not one that must evict.
    with_lora(live[2], resident=["y"])
    assert Router("cache-aware").choose(live, lora_request("z"), balanced=True).rank == 2


def test_adapter_aware_hot_rank_yields_and_count_only_ignores_adapters():
    live = engines(2)
    with_lora(live[1], resident=["x"])
    live[0].running, live[1].running, live[1].waiting = 0, 4, 20  # rank 1 is hot
    assert Router("cache-aware").choose(live, lora_request("x"), balanced=True).rank == 0
    live[1].waiting = 0  # 4 running against 0: not hot, warm wins
    assert Router("cache-aware").choose(live, lora_request("x"), balanced=True).rank == 1
    assert Router("least-loaded").choose(live, lora_request("x"), balanced=True).rank == 0


def test_adapter_aware_follows_its_own_sends_between_heartbeats():
    """No reports yet: a burst of one adapter stays on the rank its first request got,
    and a second adapter goes to the other rank (a record per rank, per adapter)."""
    router = Router("cache-aware", block_size=BS)
    live = engines(2)
    first = router.choose(live, lora_request("x"), balanced=False)
    first.num_requests += 1
    other = router.choose(live, lora_request("y"), balanced=False)
    other.num_requests += 1
    assert other.rank != first.rank
    for _ in range(3):
        chosen = router.choose(live, lora_request("x"), balanced=False)
        chosen.num_requests += 1
        assert chosen.rank == first.rank
    assert router.adapter_warm == 3
    router.forget(first.rank)
    assert router.adapters.tier(first, "x") == 1  # FREE_SLOT: nothing known there now


def test_prefix_record_is_keyed_by_adapter():
    router = Router("cache-aware", block_size=BS)
    live = engines(2)
    tokens = prompt(1, 0)
    a = router.choose(live, lora_request(None, tokens), balanced=False)
    assert router.tracker.matched_blocks(a.rank, router.tracker.hashes(tokens)) == 6
    chain_x = router.tracker.hashes(tokens, "\x00lora:x")
    assert router.tracker.matched_blocks(a.rank, chain_x) == 0


# ---- the KV host tier (--kv-offload-memory) -------------------------------------------


def on_hosts(*hosts: str) -> list[FakeEngineState]:
    """One fake rank per entry, on that host ("" = not heard from yet)."""
    return [FakeEngineState(r, info=EngineInfo(host=h)) for r, h in enumerate(hosts)]


def test_a_busier_owner_yields_to_a_rank_on_its_host_that_reaches_the_prefix_by_the_tier():
    live = on_hosts("a", "a")
    plain, tiered = Router("cache-aware", block_size=BS), Router("cache-aware", block_size=BS,
                                                                  kv_tier=True)
    for router in (plain, tiered):
        assert router.choose(live, request(prompt(1, 0)), balanced=True) is live[0]
    live[0].running, live[1].running = 6, 1  # +5: more than tier_balance_abs (4), not hot
    assert plain.choose(live, request(prompt(1, 1)), balanced=True) is live[0]  # recompute
    assert tiered.choose(live, request(prompt(1, 1)), balanced=True) is live[1]  # a load
    assert tiered.tier_routed == 1
    # Rank 1 holds it itself now: from here on it is an owner like rank 0.
    assert tiered.tracker.matched_blocks(1, tiered.tracker.hashes(prompt(1, 2))) == 6
    live[1].running = 3  # +3: within tier_balance_abs, the owner (longest, least loaded)
    assert tiered.choose(live, request(prompt(1, 2)), balanced=True) is live[1]
    live[1].running = 6
    live[0].running = 2  # +4 the other way: the least loaded owner
    assert tiered.choose(live, request(prompt(1, 3)), balanced=True) is live[0]
    assert (tiered.load_routed, tiered.tier_routed, tiered.cache_routed) == (1, 1, 2)


def test_own_blocks_beat_tier_blocks_beat_nothing():
    live = on_hosts("a", "a", "b")
    router = Router("cache-aware", block_size=BS, kv_tier=True)
    router.record(live[0], request=request(prompt(1, 0)))  # rank 0 (host a) holds session 1
    router.record(live[1], request=request(prompt(1, 0, prefix_blocks=2)))  # 2 of its 6
    live[0].running = 20  # owner busy (not hot: 20 - 0 <= 32)
    live[1].running = live[2].running = 1
    # Rank 1 holds 2 blocks itself, the other 4 are in host a's tier; rank 2 (host b)
    # reaches nothing: with equal loads the rank that reaches the prefix wins.
    assert router.choose(live, request(prompt(1, 1)), balanced=True) is live[1]
    live[1].running = 2  # busier than rank 2, but rank 2 would recompute: still rank 1
    assert router.choose(live, request(prompt(1, 2)), balanced=True) is live[1]
    # Among equally loaded ranks reaching it, the one holding more of it itself.
    router2 = Router("cache-aware", block_size=BS, kv_tier=True)
    live3 = on_hosts("a", "a", "a")
    router2.record(live3[0], request=request(prompt(2, 0)))
    router2.record(live3[1], request=request(prompt(2, 0, prefix_blocks=3)))
    live3[0].running, live3[1].running, live3[2].running = 20, 1, 1
    assert router2.choose(live3, request(prompt(2, 1)), balanced=True) is live3[1]


def test_ranks_on_other_hosts_do_not_share_the_tier():
    live = on_hosts("a", "b")
    router = Router("cache-aware", block_size=BS, kv_tier=True)
    assert router.choose(live, request(prompt(1, 0)), balanced=True) is live[0]
    live[0].running, live[1].running = 10, 0  # +10: not hot, and rank 1 would recompute
    assert router.choose(live, request(prompt(1, 1)), balanced=True) is live[0]
    live[0].waiting = 10  # 50 vs 0: hot; no rank reaches it cheaply: least loaded, by load
    assert router.choose(live, request(prompt(1, 2)), balanced=True) is live[1]
    assert router.tier_routed == 0 and router.load_routed == 2  # the new prefix, the hot one
    # Not heard from yet (no host in its heartbeat): a rank shares with no one.
    unknown = on_hosts("", "")
    fresh = Router("cache-aware", block_size=BS, kv_tier=True)
    assert fresh.choose(unknown, request(prompt(1, 0)), balanced=True) is unknown[0]
    unknown[0].running = 10
    assert fresh.choose(unknown, request(prompt(1, 1)), balanced=True) is unknown[0]


def test_the_tier_record_is_sized_by_the_store_and_outlives_a_rank():
    live = on_hosts("a", "a")
    router = Router("cache-aware", block_size=BS, kv_tier=True)
    live[0].stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, num_free_blocks=100,
                                   kv_tier_num_blocks=8, kv_tier_used_blocks=3)
    router.choose(live, request(prompt(1, 0)), balanced=True)
    router.choose(live, request(prompt(2, 0)), balanced=True)  # the other rank (a new one)
    assert router.tier is not None and router.tier.size("a") == 8  # the store's 8 blocks
    chain1, chain2 = (router.tracker.hashes(prompt(s, 1)) for s in (1, 2))
    assert router.tier.matched_blocks("a", chain2) == 6
    assert router.tier.matched_blocks("a", chain1) == 0  # its first blocks were evicted
    router.forget(1)  # rank 1 died: its own cache is gone, the host's store is not
    assert router.tracker.size(1) == 0 and router.tier.matched_blocks("a", chain2) == 6
    live[0].running = 6  # rank 0 busier: rank 1's successor loads session 2 from the tier
    assert router.choose(live, request(prompt(2, 1)), balanced=True) is live[1]
    assert router.tier_routed == 1
    # Without a tier the router keeps no host record at all.
    assert Router("cache-aware", block_size=BS).tier is None
