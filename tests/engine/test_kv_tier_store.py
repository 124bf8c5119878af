"""The KV host tier's index (`dpserve.kv_tier.store.TierStore`): pure logic, no process.

LRU eviction, pins never evicted, WRITING invisible to lookups, the slot budget,
reservations that come back short when everything is pinned, a client's hello
dropping what it held, a layout mismatch refused; and a Hypothesis state machine
that checks the invariants after every op of several clients. Also the launcher's
check that /dev/shm can hold the budget (before any process starts).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dpserve.config import ConfigError
from dpserve.kv_tier.arena import NAME_PREFIX, SHM_DIR, shm_free_bytes
from dpserve.kv_tier.layout import TierLayout
from dpserve.kv_tier.store import LayoutError, SlotState, TierStore, UnknownClient
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.kv_store import KVStore

LAYOUT = TierLayout.for_model(model="tiny", dtype="float32", element_bytes=4, block_size=4,
                              num_layers=2, kv_heads_per_worker=2, head_dim=8, tp_size=1)


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def store_of(slots: int, *clients: str) -> TierStore:
    store = TierStore(slots * LAYOUT.slot_bytes + LAYOUT.slot_bytes // 2, generation=3)
    for client in clients or ("a",):
        assert store.hello(client, LAYOUT) == slots
    return store


def put(store: TierStore, client: str, *ids: int) -> dict[bytes, int]:
    granted = store.reserve(client, [h(i) for i in ids])
    store.commit(client, list(granted))
    return granted


def test_layout_sizes_a_slot_by_every_shard() -> None:
    layout = TierLayout.for_model(model="m", dtype="bfloat16", element_bytes=2, block_size=16,
                                  num_layers=30, kv_heads_per_worker=1, head_dim=64, tp_size=3)
    assert layout.shard_bytes == 2 * 30 * 16 * 1 * 64 * 2
    assert layout.slot_bytes == 3 * layout.shard_bytes
    assert "tp=3" in layout.key and "block_size=16" in layout.key


def test_lookup_returns_the_leading_ready_blocks_and_pins_them() -> None:
    store = store_of(8)
    slots = put(store, "a", 1, 2, 3, 5)
    assert store.lookup("a", [h(1), h(2), h(3), h(4), h(5)]) == [slots[h(i)] for i in (1, 2, 3)]
    stats = store.stats()
    assert (stats.pinned, stats.ready, stats.queries, stats.hits) == (3, 4, 4, 3)
    store.release("a", [slots[h(i)] for i in (1, 2, 3)])
    assert store.stats().pinned == 0
    store.check()


def test_a_block_being_written_is_a_miss_until_committed() -> None:
    store = store_of(4, "a", "b")
    granted = store.reserve("a", [h(1), h(2)])
    assert len(granted) == 2
    assert store.lookup("b", [h(1)]) == []  # WRITING: invisible
    assert store.reserve("b", [h(1), h(2), h(3)]).keys() == {h(3)}  # held: not offered again
    store.commit("b", [h(1)])  # not b's reservation: ignored
    assert store.lookup("b", [h(1)]) == []
    store.commit("a", [h(1)])
    assert store.lookup("b", [h(1), h(2)]) == [granted[h(1)]]
    store.abort("a", [h(2)])
    assert store.stats().writing == 1  # b's h(3)
    store.check()


def test_eviction_takes_the_least_recently_used_unpinned_block() -> None:
    store = store_of(3)
    slots = put(store, "a", 1, 2, 3)
    store.release("a", store.lookup("a", [h(1)]))  # 1 is now the most recently used
    granted = store.reserve("a", [h(4)])
    assert granted == {h(4): slots[h(2)]}  # 2 was the least recently used
    store.commit("a", [h(4)])
    assert store.lookup("a", [h(2)]) == []
    assert store.stats().evictions == 1
    store.check()


def test_pinned_and_writing_slots_are_never_evicted_so_reserve_comes_back_short() -> None:
    store = store_of(3, "a", "b")
    slots = put(store, "a", 1, 2)
    pinned = store.lookup("b", [h(1), h(2)])
    assert store.reserve("a", [h(3)]) == {h(3): ({0, 1, 2} - set(slots.values())).pop()}
    assert store.reserve("a", [h(4), h(5)]) == {}  # 1, 2 pinned; 3 WRITING
    store.release("b", pinned[:1])  # 1 unpinned: the only candidate
    assert store.reserve("a", [h(4), h(5)]) == {h(4): slots[h(1)]}
    assert store.lookup("b", [h(2)]) == [slots[h(2)]]  # still held
    store.check()


def test_the_budget_is_never_exceeded() -> None:
    store = store_of(5)
    seen: set[int] = set()
    for i in range(0, 100, 3):
        seen.update(put(store, "a", i, i + 1, i + 2).values())
        assert store.stats().ready <= 5
    assert seen == set(range(5))
    assert store.stats().evictions == 34 * 3 - 5
    store.check()


def test_a_hello_drops_the_clients_pins_and_reservations() -> None:
    store = store_of(2, "a", "b")
    put(store, "a", 1)
    store.lookup("b", [h(1)])
    store.reserve("b", [h(2)])
    assert store.reserve("a", [h(3)]) == {}  # 1 pinned by b, the other slot b's WRITING
    assert store.hello("b", LAYOUT) == 2  # b again: a restarted rank, a reconnect
    assert store.stats().pinned == 0 and store.stats().writing == 0
    assert store.reserve("a", [h(3)]) != {}
    store.check()


def test_a_client_that_is_gone_leaves_nothing_behind() -> None:
    store = store_of(2, "a", "b")
    put(store, "a", 1)
    store.lookup("b", [h(1)])
    store.reserve("b", [h(2)])
    assert store.drop_client("b") == (1, 1)
    assert store.clients() == ["a"]
    with pytest.raises(UnknownClient):
        store.lookup("b", [h(1)])
    assert store.reserve("a", [h(2), h(3)]).keys() == {h(2), h(3)}
    store.check()


def test_a_release_of_a_slot_the_client_never_pinned_is_ignored() -> None:
    store = store_of(2, "a", "b")
    slot = put(store, "a", 1)[h(1)]
    store.lookup("a", [h(1)])
    store.release("b", [slot, slot])
    assert store.stats().pinned == 1
    store.check()


def test_another_layout_is_refused_naming_both() -> None:
    store = store_of(4)
    other = TierLayout.for_model(model="tiny", dtype="bfloat16", element_bytes=2, block_size=4,
                                 num_layers=2, kv_heads_per_worker=2, head_dim=8, tp_size=1)
    with pytest.raises(LayoutError) as e:
        store.hello("b", other)
    assert LAYOUT.key in str(e.value) and other.key in str(e.value)
    assert store.clients() == ["a"]


def test_an_arena_smaller_than_one_block_is_refused() -> None:
    store = TierStore(LAYOUT.slot_bytes - 1)
    with pytest.raises(LayoutError, match="kv-offload-memory"):
        store.hello("a", LAYOUT)
    assert store.layout is None  # the next client may fix the layout


def test_a_budget_past_dev_shm_is_refused_before_a_store_starts() -> None:
    allocator = AddressAllocator()
    try:
        with pytest.raises(ConfigError, match="kv_offload_memory: .* do not fit in /dev/shm"):
            KVStore((shm_free_bytes() or 0) + (1 << 30), allocator)
    finally:
        allocator.cleanup()


def test_a_store_start_unlinks_the_arenas_of_dpserves_that_are_gone() -> None:
    """A dpserve SIGKILLed whole (launcher and store) leaves its arena: the next
    store's launcher removes it (its pid runs no process), not a live one's."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = Path(SHM_DIR, f"{NAME_PREFIX}{pid_max + 1}-0-feedc0de")
    live = Path(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-99-feedc0de")
    allocator = AddressAllocator()
    try:
        for path in (dead, live):
            path.touch(mode=0o600)
        KVStore(1 << 20, allocator)  # not started: the sweep comes first
        assert not dead.exists() and live.exists()
    finally:
        dead.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
        allocator.cleanup()


class TierMachine(RuleBasedStateMachine):
    """Several clients doing every op in any order: the invariants always hold, and
    what a lookup returns is READY and holds the hash asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.store = store_of(6, "a", "b", "c")
        self.pinned: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    clients = st.sampled_from(["a", "b", "c"])
    ids = st.lists(st.integers(0, 12), min_size=1, max_size=5)

    @rule(client=clients, ids=ids)
    def lookup(self, client: str, ids: list[int]) -> None:
        slots = self.store.lookup(client, [h(i) for i in ids])
        for i, slot in zip(ids, slots, strict=False):
            assert self.store._state[slot] is SlotState.READY
            assert self.store._hash[slot] == h(i)
        self.pinned[client] += slots

    @rule(client=clients, data=st.data())
    def release(self, client: str, data: st.DataObject) -> None:
        held = self.pinned[client]
        if held:
            slot = data.draw(st.sampled_from(held))
            held.remove(slot)
            self.store.release(client, [slot])

    @rule(client=clients, ids=ids, commit=st.booleans())
    def write(self, client: str, ids: list[int], commit: bool) -> None:
        granted = self.store.reserve(client, [h(i) for i in ids])
        for slot in granted.values():
            assert all(slot not in held for held in self.pinned.values())
        (self.store.commit if commit else self.store.abort)(client, list(granted))

    @rule(client=clients, ids=ids)
    def reserve_only(self, client: str, ids: list[int]) -> None:
        self.store.reserve(client, [h(i) for i in ids])

    @rule(client=clients)
    def hello_again(self, client: str) -> None:
        self.store.hello(client, LAYOUT)
        self.pinned[client] = []

    @invariant()
    def holds(self) -> None:
        self.store.check()
        assert self.store.stats().pinned <= 6


TierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                         deadline=None)
test_tier_state_machine = TierMachine.TestCase
