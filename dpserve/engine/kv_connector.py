"""The KV connector: the engine's side of an external KV store (the host tier).

Scope: the contract the scheduler asks (`KVConnector`: how many of a request's
next blocks the store holds, loads into blocks the scheduler allocated, offers
of newly full computed blocks, then the step's copies as one `KVTransfer`), its
implementation over the host tier's client (`HostTierConnector`), and the part
the scheduler holds to drive it (`TierLink`: every call a no-op without a tier). Blocks
are named by the prefix cache's hashes (`block_hash.hash_block`: the SHA-256
chain with the cache salt and LoRA key), so a block means the same thing on
every rank that shares the store.

One step, as the scheduler and `EngineCore.step()` drive it:

    n = connector.lookup(req_id, hashes)    # admission: after the local prefix hits
    connector.load(req_id, block_ids)       # the n blocks allocated for those hits
    connector.cancel(req_id)                # (or: not admitted after all)
    connector.offer([(hash, block_id)])     # blocks this step makes full
    transfer = connector.build_transfer()   # -> SchedulerOutput.kv_transfer
    runner.execute(...)                     # loads before the forward, saves after
    connector.step_done(transfer)           # release read pins; commit the saves

Not here: the copies themselves (`dpserve.model.kv_copy`), the store, its arena
and the client (`dpserve.kv_tier`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dpserve.engine.kv_cache import KVCacheManager
from dpserve.engine.request import Request
from dpserve.protocol import SchedulerStats
from dpserve.step import KVTransfer, SchedulerOutput

logger = logging.getLogger(__name__)


STORE_STATS_INTERVAL_S = 1.0


@dataclass
class KVTierCounters:
    """Cumulative counts of one engine's tier traffic (SchedulerStats' kv_tier_*)."""

    queries: int = 0  # tokens asked of the tier (full blocks past the local hits)
    hits: int = 0  # tokens loaded from it
    loaded_bytes: int = 0  # whole slots (every TP shard)
    saved_bytes: int = 0


class KVConnector(Protocol):
    """What the scheduler asks of an external KV store.

    Contract:

    * `lookup(request_id, hashes)` -> how many of the LEADING `hashes` the store
      holds; those are held for the request (not evicted) until `load` or
      `cancel`. The caller leaves the request's last token out (it must be
      computed) and asks at most once per request per step.
    * `load(request_id, block_ids)`: the blocks allocated for those hits, in
      order (exactly as many); they are filled at the start of this step, before
      the forward, so `num_computed_tokens` may cover them at once.
    * `cancel(request_id)`: the request was not admitted; its hits are let go.
    * `offer(blocks)`: `(hash, block_id)` of blocks this step makes full; the
      store keeps those it does not hold yet (copied after the forward).
    * `build_transfer()` -> this step's copies, or None when there are none.
    * `step_done(transfer, executed)` once the step's execute returned (its
      loads are done; `executed`: a forward ran), `step_failed(transfer)` when it
      raised: the store's read pins go; saves are committed once every worker
      copied them (`has_pending_commits` / `commit_pending`).
    * `store_blocks(now)` -> (the store's slots, those holding a block), asked of
      the store at most once a second (the engine's stats, every output).
    """

    counters: KVTierCounters

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> int: ...
    def load(self, request_id: str, block_ids: Sequence[int]) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def offer(self, blocks: Sequence[tuple[bytes, int]]) -> None: ...
    def build_transfer(self) -> KVTransfer | None: ...
    def step_done(self, transfer: KVTransfer | None, executed: bool = True) -> None: ...
    def step_failed(self, transfer: KVTransfer | None) -> None: ...
    def has_pending_commits(self) -> bool: ...
    def commit_pending(self) -> None: ...
    def close(self) -> None: ...
    def store_blocks(self, now: float) -> tuple[int, int]: ...


class TierLink:
    """The scheduler's side of its KV connector (`connector` None: no tier, and every
    call does nothing). Invariant, as for local prefix hits: a request's last token
    is always computed, never loaded."""

    def __init__(self, connector: KVConnector | None, kv_cache: KVCacheManager) -> None:
        self.connector = connector
        self.block_size = kv_cache.block_size
        if connector is not None:
            kv_cache.new_full_blocks = []  # each step's, offered to the store

    def lookup(self, request: Request, num_hit_blocks: int) -> int:
        """Tokens of the request's next full blocks (past its `num_hit_blocks` local
        hits) that the store holds, held there for it (0: no tier, or none)."""
        if self.connector is None or request.needs_every_position:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[num_hit_blocks:max_blocks]
        if not hashes:
            return 0
        return self.connector.lookup(request.request_id, hashes) * self.block_size

    def admitted(self, request: Request, block_ids: list[int] | None, first: int,
                 num_loaded: int) -> None:
        """After a hit of `num_loaded` tokens: their blocks (from `first` in the
        request's table) are loaded before this step's forward; or, not admitted
        (`block_ids` None), the hits are let go."""
        if not num_loaded or self.connector is None:
            return
        if block_ids is None:
            self.connector.cancel(request.request_id)
            return
        self.connector.load(request.request_id,
                            block_ids[first:first + num_loaded // self.block_size])

    def step_transfer(self, kv_cache: KVCacheManager) -> KVTransfer | None:
        """Offer the blocks this step makes full; the step's copies (None: none)."""
        if self.connector is None:
            return None
        self.connector.offer(kv_cache.take_new_full_blocks())
        return self.connector.build_transfer()

    def step_done(self, scheduler_output: SchedulerOutput) -> None:
        """The step's execute returned: the read pins go, saves are committed (see
        `HostTierConnector`)."""
        if self.connector is not None:
            self.connector.step_done(scheduler_output.kv_transfer,
                                     executed=not scheduler_output.is_empty)

    def step_failed(self, scheduler_output: SchedulerOutput) -> None:
        """The step's execute raised: pins released, its reservations dropped."""
        if self.connector is not None:
            self.connector.step_failed(scheduler_output.kv_transfer)

    def fill(self, stats: SchedulerStats) -> None:
        """The tier's counters into the scheduler's stats (SchedulerStats.kv_tier_*)."""
        if self.connector is not None:
            tier = self.connector.counters
            stats.kv_tier_queries, stats.kv_tier_hits = tier.queries, tier.hits
            stats.kv_tier_loaded_bytes = tier.loaded_bytes
            stats.kv_tier_saved_bytes = tier.saved_bytes


@dataclass
class _Arena:
    name: str
    size: int
    generation: int


class HostTierConnector:
    """`KVConnector` over a `dpserve.kv_tier.client.KVTierClient` (one per engine
    core; its calls are bounded, and a store that is down reads as a miss).

    `deferred_commit` (tensor parallel): worker 0's execute returning does not
    mean its peers copied their shards of the saves, so a step's saves are
    committed after the NEXT step's execute returned (whose collectives the
    peers join only after their copies), or by `commit_pending` once the
    engine has had every worker answer an rpc (`ModelRunner.kv_tier_barrier`).

    `attach(name, size, generation)` -> True once every worker mapped that arena
    (None: the workers map it at their first copy). It runs before any slot of a
    new generation goes into a step, so a store that dies after a lookup leaves
    every worker a mapping to finish the step's loads from.
    """

    def __init__(self, client: Any, *, block_size: int, slot_bytes: int, shard_bytes: int,
                 deferred_commit: bool,
                 attach: Callable[[str, int, int], bool] | None = None) -> None:
        self.client = client
        self._attach = attach
        self._attached: _Arena | None = None
        self._refused: _Arena | None = None  # an arena the workers could not map
        self.block_size = block_size
        self.slot_bytes = slot_bytes
        self.shard_bytes = shard_bytes
        self.deferred_commit = deferred_commit
        self.counters = KVTierCounters()
        self._held: dict[str, tuple[list[int], list[bytes]]] = {}  # req -> (slots, hashes)
        self._loads: list[tuple[int, int]] = []  # this step's (slot, block_id)
        self._load_hashes: set[bytes] = set()
        self._load_arena: _Arena | None = None  # the arena of this step's loads
        self._offers: dict[bytes, int] = {}  # hash -> block_id, this step
        self._in_step: tuple[list[int], list[bytes]] | None = None  # (pins, save hashes)
        self._uncommitted: list[bytes] = []  # saves copied by worker 0, not yet by all
        self._store_blocks, self._store_blocks_at = (0, 0), float("-inf")

    # ---- schedule ------------------------------------------------------------

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> int:
        assert request_id not in self._held, f"{request_id} looked up twice in a step"
        if not hashes:
            return 0
        self.counters.queries += len(hashes) * self.block_size
        slots = self.client.lookup(list(hashes))
        if not slots:
            return 0
        arena = self._arena()
        if arena is None or (self._load_arena is not None and arena != self._load_arena):
            self.client.release(slots)  # the store restarted within this step: a miss
            return 0
        self._load_arena = arena
        self._held[request_id] = (list(slots), list(hashes[:len(slots)]))
        return len(slots)

    def load(self, request_id: str, block_ids: Sequence[int]) -> None:
        slots, hashes = self._held.pop(request_id)
        assert len(block_ids) == len(slots), (request_id, len(block_ids), len(slots))
        self._loads.extend(zip(slots, block_ids, strict=True))
        self._load_hashes.update(hashes)
        self.counters.hits += len(slots) * self.block_size

    def cancel(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.client.release(held[0])

    def offer(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        for block_hash, block_id in blocks:
            if block_hash not in self._load_hashes:  # loaded ones the store holds
                self._offers.setdefault(block_hash, block_id)

    def build_transfer(self) -> KVTransfer | None:
        assert not self._held, f"looked up, neither loaded nor cancelled: {list(self._held)}"
        loads, offers = self._loads, self._offers
        self._loads, self._load_hashes, self._offers = [], set(), {}
        arena, self._load_arena = self._load_arena, None
        saves: list[tuple[int, int]] = []
        reserved: list[bytes] = []
        if offers:
            slots = self.client.reserve(list(offers))
            now = self._arena() if slots else None
            if slots and (now is None or (arena is not None and now != arena)):
                self.client.abort(list(slots))  # the store restarted since the lookups
            elif slots:
                arena = now
                reserved = list(slots)
                saves = [(offers[h], slot) for h, slot in slots.items()]
        if not loads and not saves:
            return None
        assert arena is not None
        self._in_step = ([slot for slot, _ in loads], reserved)
        return KVTransfer(arena.name, arena.size, arena.generation, self.slot_bytes,
                          self.shard_bytes, loads=loads, saves=saves)

    # ---- after the step -------------------------------------------------------

    def step_done(self, transfer: KVTransfer | None, executed: bool = True) -> None:
        pins, saved = self._take_step(transfer)
        if pins:
            self.client.release(pins)
        if executed and self.deferred_commit:
            self.commit_pending()  # the previous steps': this execute's collectives passed
        if transfer is None:
            return
        self.counters.loaded_bytes += len(transfer.loads) * self.slot_bytes
        self.counters.saved_bytes += len(transfer.saves) * self.slot_bytes
        if self.deferred_commit:
            self._uncommitted = saved
        else:
            self._commit(saved)

    def step_failed(self, transfer: KVTransfer | None) -> None:
        pins, saved = self._take_step(transfer)
        if pins:
            self.client.release(pins)
        unfinished = self._uncommitted + saved
        self._uncommitted = []
        if unfinished:
            self.client.abort(unfinished)

    def has_pending_commits(self) -> bool:
        return bool(self._uncommitted)

    def commit_pending(self) -> None:
        pending, self._uncommitted = self._uncommitted, []
        self._commit(pending)

    def close(self) -> None:
        self.client.close()

    def store_blocks(self, now: float) -> tuple[int, int]:
        """(slots, slots holding a block) of the store, asked at most once per
        `STORE_STATS_INTERVAL_S` (the engine reports stats with every output);
        (0, 0) while the tier is down."""
        if now - self._store_blocks_at >= STORE_STATS_INTERVAL_S:
            self._store_blocks_at = now
            stats = self.client.stats()
            self._store_blocks = (stats.get("num_slots", 0), stats.get("ready", 0))
        return self._store_blocks

    def _take_step(self, transfer: KVTransfer | None) -> tuple[list[int], list[bytes]]:
        if transfer is None:
            return [], []
        assert self._in_step is not None, "step_done without build_transfer"
        step, self._in_step = self._in_step, None
        return step

    def _commit(self, hashes: list[bytes]) -> None:
        if hashes:
            self.client.commit(hashes)

    def _arena(self) -> _Arena | None:
        """The client's arena now, mapped by every worker (None: the tier is down, or
        its arena could not be mapped)."""
        name = self.client.arena_name
        if name is None:
            return None
        arena = _Arena(name, self.client.arena_bytes, self.client.generation)
        if arena == self._attached or self._attach is None:
            return arena
        if arena == self._refused or not self._attach(name, arena.size, arena.generation):
            if arena != self._refused:
                logger.warning("KV host tier: the workers cannot map arena %s (generation "
                               "%d); the tier is unused until the store restarts", name,
                               arena.generation)
            self._refused = arena
            return None
        self._attached = arena
        return arena


def make_host_tier(config: Any, executor: Any, dp_rank: int) -> HostTierConnector | None:
    """The engine core's connector to its host's KV tier, or None when there is no
    tier (`--kv-offload-memory` unset, or no store address). `executor`: the rank's
    workers (worker 0's `ModelRunner` gives the model's KV shape). The client is
    named by the rank: a restarted rank's hello drops what its predecessor held."""
    cache = config.cache
    if not cache.kv_offload_bytes or cache.kv_tier_address is None:
        return None
    from dpserve.kv_tier.client import KVTierClient
    from dpserve.kv_tier.layout import TierLayout

    runner, model = executor.driver, config.model
    tp = config.parallel.tensor_parallel_size
    name = model.path + (f" quantization={model.quantization}" if model.quantization else "")
    layout = TierLayout.for_model(
        model=name, dtype=str(runner.dtype).removeprefix("torch."),
        element_bytes=runner.dtype.itemsize,
        block_size=cache.block_size, num_layers=runner.model.dims.layers,
        kv_heads_per_worker=runner.kv_heads, head_dim=runner.model.dims.head_dim, tp_size=tp)
    assert layout.shard_bytes == runner.block_bytes() == runner.kv_copier.shard_bytes
    client = KVTierClient(cache.kv_tier_address, layout,
                          secret=config.parallel.data_parallel_secret, name=f"rank{dp_rank}")
    logger.info("KV host tier at %s: slots of %d bytes (%d shard(s))", cache.kv_tier_address,
                layout.slot_bytes, tp)
    return HostTierConnector(client, block_size=cache.block_size, slot_bytes=layout.slot_bytes,
                             shard_bytes=layout.shard_bytes, deferred_commit=tp > 1,
                             attach=functools.partial(_attach_everywhere, executor))


def _attach_everywhere(executor: Any, name: str, size: int, generation: int) -> bool:
    """Every worker of the rank maps the arena; False (logged) if one could not."""
    errors = [e for e in executor.collective_rpc("kv_tier_attach", name, size, generation)
              if e is not None]
    for error in errors:
        logger.warning("KV host tier: %s", error)
    return not errors
