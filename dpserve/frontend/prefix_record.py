"""The prefix record of `cache-aware` routing, and what API servers share of it.

Scope (pure bookkeeping: no I/O, one thread):

* `PrefixTracker`: per rank (or per host, for its KV tier: any hashable key), an
  approximate record of the prefix-cache blocks the prompts sent there left: the
  engine's block hash chain (`dpserve.block_hash.hash_block`) over each
  prompt's full blocks, rooted as the engine roots it (`cache_root`: salt and
  LoRA adapter); an LRU bounded by the rank's KV capacity in blocks
  (`kv_capacity_blocks`, from its `SchedulerStats`), so it forgets roughly what
  the engine has evicted.
* `PrefixOutbox`: with several API servers (`--api-server-count N`, a DP
  coordinator), what this API server's router placed since its last send, as
  (rank, block hash) facts, newest last, at most `MAX_SHARED_BLOCKS` (the oldest
  pending ones are dropped beyond that: under pressure facts are lost, never
  waited for). `take` empties it into one `PrefixFacts`; the front-end sends
  that to the coordinator at most every `SHARE_INTERVAL_S` without waiting
  (`dpserve.frontend.coordinator_link.CoordinatorLink`), the coordinator relays
  it to every API server (`dpserve.launch.coordinator.prefix_relay`), and each
  other router records the facts as if it had placed them itself
  (`Router.learn`). So affinity does not weaken with N: a prefix placed through
  one API server is known to all within about one interval.

Why the routers' placements and not the engines' cache events: the facts then
exist only where they are used (cache-aware routers with several API servers),
they cost one message per interval per API server, not one per block stored or
evicted on every engine, and a router's record stays one kind of hint (the
engines' evictions are approximated by the same capacity-bounded LRU on every
API server). What a record misses (generated tokens, a prefix-cache reset,
evictions under pressure) costs a cache miss, nothing else.

Not here: the policies that read the record (`dpserve.frontend.routing`), the
sockets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from dpserve.block_hash import BlockHash, hash_block, root_hash
from dpserve.protocol import MAX_PREFIX_FACTS, EngineCoreRequest, PrefixFacts, SchedulerStats

# KV capacity assumed for a rank that has not reported its figures yet (blocks).
DEFAULT_CAPACITY_BLOCKS = 1 << 16
# Facts in one PrefixFacts (the coordinator relays nothing larger).
MAX_SHARED_BLOCKS = MAX_PREFIX_FACTS
SHARE_INTERVAL_S = 0.05  # an API server sends its facts at most this often


def kv_capacity_blocks(stats: SchedulerStats | None) -> int | None:
    """A rank's KV cache size in blocks from its figures (usage = 1 - free / total);
    None when unknown (no figures yet, or every block held: no free one to scale by)."""
    if stats is None or stats.num_free_blocks <= 0 or stats.kv_cache_usage >= 1.0:
        return None
    return round(stats.num_free_blocks / (1.0 - stats.kv_cache_usage))


def cache_root(request: EngineCoreRequest) -> str | None:
    """What roots a request's block chain in the record: its salt and, as the engine's
    cache does, its adapter (two adapters never share blocks)."""
    if request.lora_name is None:
        return request.cache_salt
    return f"{request.cache_salt or ''}\x00lora:{request.lora_name}"


class PrefixTracker:
    """Per rank (or per host, for its tier: any hashable key), the block hashes of the
    prompts sent there: an LRU per key, bounded by `capacity` blocks at each record.
    Pure bookkeeping (no I/O, one thread)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._blocks: dict[Hashable, OrderedDict[BlockHash, None]] = {}

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
               ) -> list[BlockHash]:
        """The hash chain of the prompt's blocks that an engine can serve from its cache:
        (n - 1) // block_size full blocks (the last token is always computed), rooted
        at the request's salt as the engine roots it (block_hash.root_hash)."""
        bs = self.block_size
        chain: list[BlockHash] = []
        for i in range((len(token_ids) - 1) // bs if token_ids else 0):
            parent = chain[-1] if chain else root_hash(cache_salt)
            chain.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs]))
        return chain

    def matched_blocks(self, rank: Hashable, chain: Sequence[BlockHash], start: int = 0
                       ) -> int:
        """How many blocks of `chain` from `start` on the rank is thought to hold."""
        blocks = self._blocks.get(rank)
        if not blocks:
            return 0
        n = 0
        for h in chain[start:]:
            if h not in blocks:
                break
            n += 1
        return n

    def record(self, rank: Hashable, chain: Sequence[BlockHash], capacity: int) -> None:
        """The rank now holds `chain` (most recently used); the oldest blocks beyond
        `capacity` are forgotten."""
        blocks = self._blocks.setdefault(rank, OrderedDict())
        for h in chain:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > max(capacity, 0):
            blocks.popitem(last=False)

    def forget(self, rank: Hashable) -> None:
        """The rank's cache is gone (its process died or was replaced)."""
        self._blocks.pop(rank, None)

    def size(self, rank: Hashable) -> int:
        return len(self._blocks.get(rank, ()))


class PrefixOutbox:
    """The (rank, block hash) facts this router placed since the last `take` (module
    docstring): an LRU of at most `capacity` facts (the oldest dropped beyond it,
    counted in `dropped`). `on_pending` is called when it stops being empty."""

    def __init__(self, capacity: int = MAX_SHARED_BLOCKS,
                 on_pending: Callable[[], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.on_pending = on_pending
        self.dropped = 0  # facts dropped unsent (over capacity)
        self.sent = 0  # facts taken to be sent
        self._facts: OrderedDict[tuple[int, BlockHash], None] = OrderedDict()

    def note(self, rank: int, chain: Sequence[BlockHash]) -> None:
        """The router placed `chain` on `rank` (a repeat only refreshes it)."""
        if not chain:
            return
        was_empty = not self._facts
        for h in chain:
            self._facts[rank, h] = None
            self._facts.move_to_end((rank, h))
        while len(self._facts) > self.capacity:
            self._facts.popitem(last=False)
            self.dropped += 1
        if was_empty and self.on_pending is not None:
            self.on_pending()

    def take(self, client_index: int) -> PrefixFacts | None:
        """Everything pending as one message (runs of one rank, in order), emptied;
        None when nothing is pending."""
        if not self._facts:
            return None
        ranks: list[int] = []
        blocks: list[list[bytes]] = []
        for rank, h in self._facts:
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
                blocks.append([])
            blocks[-1].append(h)
        self.sent += len(self._facts)
        self._facts.clear()
        return PrefixFacts(client_index, ranks, blocks)

    def __len__(self) -> int:
        return len(self._facts)
