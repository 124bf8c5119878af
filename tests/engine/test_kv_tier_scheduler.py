"""CPU state-machine tests of the engine's KV connector (the host tier):
the scheduler's lookups, loads and saves, and one worker's copies.

The store here is `FakeTierClient`, an in-memory FAKE of
`dpserve.kv_tier.client.KVTierClient` (its contract: leading READY hits,
read pins, WRITING reservations, commit / abort, a tier that is down), so that
the scheduler's logic is checked in milliseconds. The real store, with real
engines, is tests/engine/test_kv_tier_engine.py.
"""

from __future__ import annotations

import torch
from test_scheduler import BS, make_request, make_scheduler, runner_output

from dpserve.engine.kv_connector import HostTierConnector, TierLink
from dpserve.engine.request import RequestStatus
from dpserve.model.kv_copy import KVTierCopier
from dpserve.step import KVTransfer

SLOT_BYTES = 64


class FakeTierClient:
    """A FAKE host-tier client: the store's index in a dict, no arena behind it."""

    def __init__(self, num_slots: int = 16) -> None:
        self.arena_name: str | None = "fake-arena"
        self.arena_bytes = num_slots * SLOT_BYTES
        self.generation = 1
        self.ready: dict[bytes, int] = {}  # hash -> slot
        self.writing: dict[bytes, int] = {}
        self.pins: dict[int, int] = {}  # slot -> read pins
        self.free = list(range(num_slots))
        self.lookups: list[list[bytes]] = []  # every lookup's hashes, in order

    @property
    def down(self) -> bool:
        return self.arena_name is None

    def lookup(self, hashes: list[bytes]) -> list[int]:
        self.lookups.append(list(hashes))
        slots = []
        for h in hashes if not self.down else ():
            if h not in self.ready:
                break
            slots.append(self.ready[h])
            self.pins[self.ready[h]] = self.pins.get(self.ready[h], 0) + 1
        return slots

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self.pins[s] -= 1

    def reserve(self, hashes: list[bytes]) -> dict[bytes, int]:
        if self.down:
            return {}
        out = {}
        for h in hashes:
            if h not in self.ready and h not in self.writing and self.free:
                out[h] = self.writing[h] = self.free.pop(0)
        return out

    def commit(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.ready[h] = self.writing.pop(h)

    def abort(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.free.append(self.writing.pop(h))

    def close(self) -> None:
        pass

    def num_pins(self) -> int:
        return sum(self.pins.values())


def tiered(client: FakeTierClient, deferred_commit: bool = False, **kw):
    connector = HostTierConnector(client, block_size=BS, slot_bytes=SLOT_BYTES,
                                  shard_bytes=SLOT_BYTES, deferred_commit=deferred_commit)
    sched = make_scheduler(**kw)
    sched.tier = TierLink(connector, sched.kv_cache)  # as Scheduler(kv_connector=...)
    return sched


def run_step(sched, tokens=None):
    """schedule -> (a worker's copies) -> tier.step_done -> update, as EngineCore.step."""
    out = sched.schedule()
    sched.tier.step_done(out)
    return out, sched.update_from_output(out, runner_output(out, tokens))


def fill_store(client: FakeTierClient, prompt: list[int]) -> list[bytes]:
    """Compute `prompt` on a scheduler of its own (another rank) that saves into
    `client`'s store; returns the prompt's block hashes."""
    other = tiered(client)
    req = make_request("other", prompt, max_tokens=1)
    other.add_request(req)
    run_step(other)
    return req.block_hashes


PROMPT = [100 + i for i in range(14)]  # 3 full blocks of 4 and 2 tokens


def test_a_prefix_another_rank_saved_is_loaded_and_counts_as_computed():
    client = FakeTierClient()
    hashes = fill_store(client, PROMPT)
    assert len(client.ready) == 3 and client.num_pins() == 0
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT))
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens) == (12, 2)  # 3 blocks loaded, 2 tokens computed
    assert out.kv_transfer.loads == [(client.ready[h], b) for h, b in zip(hashes, s.block_ids)]
    assert out.kv_transfer.saves == []  # the store holds them already
    assert client.num_pins() == 3  # held while the step copies
    sched.tier.step_done(out)
    assert client.num_pins() == 0
    stats = sched.make_stats()
    assert (stats.kv_tier_hits, stats.kv_tier_queries) == (12, 12)
    assert stats.kv_tier_loaded_bytes == 3 * SLOT_BYTES
    assert sched.requests["r"].num_cached_tokens == 12


def test_the_last_token_is_always_computed():
    client = FakeTierClient()
    fill_store(client, PROMPT[:12])  # 3 full blocks, nothing after them
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT[:12]))
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(8, 4)]
    assert len(out.kv_transfer.loads) == 2
    assert client.lookups[-1] == sched.requests["r"].block_hashes[:2]


def test_local_hits_first_then_the_tier_for_the_blocks_after_them():
    client = FakeTierClient()
    hashes = fill_store(client, PROMPT)
    sched = tiered(client)
    sched.add_request(make_request("a", PROMPT[:5], max_tokens=1))  # block 0 cached here
    run_step(sched)  # (its block 0 came from the tier: 4 tokens)
    sched.add_request(make_request("b", PROMPT))
    out = sched.schedule()
    assert client.lookups[-1] == hashes[1:3]  # not the local hit
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens) == (12, 2)
    assert [b for _, b in out.kv_transfer.loads] == s.block_ids[1:3]
    stats = sched.make_stats()
    assert (stats.prefix_cache_hits, stats.kv_tier_hits) == (4, 4 + 8)


def test_blocks_a_step_makes_full_are_saved_after_it_and_committed():
    client = FakeTierClient()
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT[:9], max_tokens=8))
    out = sched.schedule()
    req = sched.requests["r"]
    (s,) = out.scheduled
    assert out.kv_transfer.saves == [(s.block_ids[0], client.writing[req.block_hashes[0]]),
                                     (s.block_ids[1], client.writing[req.block_hashes[1]])]
    sched.tier.step_done(out)  # uniproc: worker 0 copied them
    assert set(client.ready) == set(req.block_hashes) and not client.writing
    sched.update_from_output(out, runner_output(out))
    # Decode: tokens 9, 10, 11 fill block 2 (an output block) in the step computing 11.
    saved = []
    for _ in range(3):
        out, _ = run_step(sched)
        saved.append(out.kv_transfer)
    assert saved[:2] == [None, None]
    assert saved[2].saves == [(s.block_ids[2], client.ready[req.block_hashes[2]])]
    assert sched.make_stats().kv_tier_saved_bytes == 3 * SLOT_BYTES


def test_tensor_parallel_saves_commit_after_the_next_step_or_the_barrier():
    client = FakeTierClient()
    sched = tiered(client, deferred_commit=True)
    sched.add_request(make_request("r", PROMPT[:9], max_tokens=8))
    run_step(sched)
    assert len(client.writing) == 2 and not client.ready  # the peers may still copy
    assert sched.tier.connector.has_pending_commits()
    out, _ = run_step(sched)  # its collectives: the peers are past the last step's copies
    assert out.kv_transfer is None and len(client.ready) == 2
    sched.add_request(make_request("s", PROMPT[:5], max_tokens=1))  # makes block 0... again
    sched.add_request(make_request("t", [7] * 5, max_tokens=1))
    run_step(sched)
    assert len(client.writing) == 1 and sched.tier.connector.has_pending_commits()
    sched.tier.connector.commit_pending()  # the engine's barrier once idle
    assert not client.writing and len(client.ready) == 3


def test_loaded_blocks_are_not_saved_again():
    client = FakeTierClient()
    fill_store(client, PROMPT[:9])  # blocks 0, 1
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT))
    out = sched.schedule()
    req = sched.requests["r"]
    assert len(out.kv_transfer.loads) == 2
    assert out.kv_transfer.saves == [(out.scheduled[0].block_ids[2],
                                      client.writing[req.block_hashes[2]])]
    assert client.lookups[-1] == req.block_hashes[:3]  # asked for 3, held 2


def test_a_request_that_does_not_fit_lets_its_hits_go():
    client = FakeTierClient()
    fill_store(client, PROMPT)
    sched = tiered(client, num_blocks=6)
    sched.add_request(make_request("big", [5] * 20, max_tokens=1))  # holds 5 of 6 blocks
    out, _ = run_step(sched)
    assert shape_of(out) == [("big", 0, 20)]
    sched.add_request(make_request("r", PROMPT))
    sched.add_request(make_request("big2", [5] * 21, max_tokens=1))
    out = sched.schedule()  # "big" finished: "r" fits now
    assert shape_of(out) == [("r", 12, 2)]
    sched.tier.step_done(out)
    sched.update_from_output(out, runner_output(out))
    # "big2" needs 6 blocks and "r" holds 4: looked up, not admitted, hits let go.
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["r"]
    assert sched.requests["big2"].status == RequestStatus.WAITING
    assert client.num_pins() == 0 and out.kv_transfer is None


def shape_of(out):
    return [(s.req_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_a_tier_that_is_down_is_a_miss_and_nothing_is_copied():
    client = FakeTierClient()
    fill_store(client, PROMPT)
    client.arena_name = None  # the store died: the client reads as down
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT))
    out = sched.schedule()
    assert shape_of(out) == [("r", 0, 14)] and out.kv_transfer is None
    stats = sched.make_stats()
    assert (stats.kv_tier_hits, stats.kv_tier_queries) == (0, 12)


def test_a_store_restarted_between_lookup_and_reserve_gets_no_saves():
    client = FakeTierClient()
    fill_store(client, PROMPT[:5])  # block 0
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT))
    real_reserve = client.reserve

    def reserve_after_restart(hashes):  # a FAKE restart between the two calls
        client.generation, client.arena_name = 2, "fake-arena-2"
        return real_reserve(hashes)

    client.reserve = reserve_after_restart
    out = sched.schedule()
    assert len(out.kv_transfer.loads) == 1 and out.kv_transfer.generation == 1
    assert out.kv_transfer.saves == [] and not client.writing  # aborted


def test_a_failed_step_releases_its_pins_and_aborts_its_saves():
    client = FakeTierClient()
    fill_store(client, PROMPT[:5])
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT))
    out = sched.schedule()
    assert client.num_pins() == 1 and len(client.writing) == 2
    sched.tier.step_failed(out)
    assert client.num_pins() == 0 and not client.writing and len(client.ready) == 1


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    client = FakeTierClient()
    fill_store(client, PROMPT)
    sched = tiered(client)
    sched.add_request(make_request("r", PROMPT, prompt_logprobs=1))
    out = sched.schedule()
    assert shape_of(out) == [("r", 0, 14)]
    assert len(client.lookups) == 1  # fill_store's only


def test_without_a_tier_nothing_is_looked_up_or_kept():
    sched = make_scheduler()
    sched.add_request(make_request("r", PROMPT))
    out = sched.schedule()
    assert out.kv_transfer is None and sched.kv_cache.new_full_blocks is None
    assert sched.kv_cache.take_new_full_blocks() == []
    assert sched.make_stats().kv_tier_queries == 0


def test_copies_round_trip_each_worker_on_its_own_shard():
    """Two TP workers' copiers over one arena: a save then a load puts the same
    bytes back, and neither worker's shard overlaps the other's."""
    layers, heads, dim = 2, 1, 3
    shape = (layers, 2, BS, heads, dim)
    shard = 2 * layers * BS * heads * dim * 4
    arena = torch.zeros(4 * 2 * shard, dtype=torch.uint8)  # 4 slots of 2 shards
    copiers = [KVTierCopier(rank, shape, torch.float32, torch.device("cpu"),
                            attach=lambda name, size: arena) for rank in (0, 1)]
    caches = [[torch.randn(2, 6, BS, heads, dim) for _ in range(layers)] for _ in (0, 1)]
    t = KVTransfer("a", arena.numel(), 1, 2 * shard, shard, saves=[(1, 3), (4, 0)])
    for copier, cache in zip(copiers, caches):
        copier.save(t, cache)
    back = [[torch.zeros_like(c) for c in cache] for cache in caches]
    t = KVTransfer("a", arena.numel(), 1, 2 * shard, shard, loads=[(3, 2), (0, 5)])
    for copier, cache in zip(copiers, back):
        copier.load(t, cache)
    for cache, loaded in zip(caches, back):
        for layer in range(layers):
            assert torch.equal(loaded[layer][:, 2], cache[layer][:, 1])
            assert torch.equal(loaded[layer][:, 5], cache[layer][:, 4])
    slot3 = arena[3 * 2 * shard:4 * 2 * shard]
    assert torch.equal(slot3[:shard].view(torch.float32).view(shape)[0, 0],
                       caches[0][0][0, 1])  # worker 0: layer 0's K of block 1
    assert torch.equal(slot3[shard:].view(torch.float32).view(shape)[1, 1],
                       caches[1][1][1, 1])  # worker 1: layer 1's V of block 1


def test_every_worker_maps_a_new_arena_before_a_step_names_it():
    client = FakeTierClient()
    fill_store(client, PROMPT)
    other = [50 + i for i in range(14)]
    fill_store(client, other)
    attached: list[tuple[str, int, int]] = []
    answer = {"ok": False}

    def attach(name: str, size: int, generation: int) -> bool:  # the workers' rpc
        attached.append((name, size, generation))
        return answer["ok"]

    sched = tiered(client)
    sched.tier.connector._attach = attach
    sched.add_request(make_request("r", PROMPT, max_tokens=1))
    out, _ = run_step(sched)  # a worker could not map it: a miss, its pins let go
    assert shape_of(out) == [("r", 0, 14)] and out.kv_transfer is None
    assert client.num_pins() == 0 and attached == [("fake-arena", client.arena_bytes, 1)]
    client.generation, client.arena_name, answer["ok"] = 2, "fake-arena-2", True
    sched.add_request(make_request("s", other))
    out = sched.schedule()
    assert out.kv_transfer.generation == 2 and len(out.kv_transfer.loads) == 3
    assert attached[-1] == ("fake-arena-2", client.arena_bytes, 2) and len(attached) == 2
