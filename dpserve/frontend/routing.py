"""Engine choice: which serving rank gets a request (`--load-balance`).

Scope: the placement policy of one front-end (`Router.choose(live, request,
balanced)`) among the ranks the `RankTable` says may take new work (serving,
not cordoned, not excluded): a rank's load (the coordinator's `4*waiting +
running`, or this client's requests in flight; waiting requests less urgent
than the request left out), the policies (`least-loaded`, `round-robin`,
`cache-aware`, the default), tenants spread over equally busy ranks
(`TenantTurns`), the host tier's and LoRA adapters' preferences, sessions
(`SessionTable`, `rendezvous_rank`), and what other API servers placed
(`learn`, `outbox`).

Invariants: the router only picks among `live` and remembers what it sent
where; its prefix record is a hint (a wrong one costs a cache miss, never a
wrong answer); a pinned request wins over its session; a session never reaches
an engine (`sendable`).

Not here: pinned requests and rank states (`dpserve.frontend.rank_table`),
moving requests (`dpserve.frontend.migration`), the block-hash record itself
(`dpserve.frontend.prefix_record`).

Design: docs/design/routing.md
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from dpserve.block_hash import BlockHash
from dpserve.frontend.prefix_record import (
    DEFAULT_CAPACITY_BLOCKS,
    PrefixOutbox,
    PrefixTracker,
    cache_root,
    kv_capacity_blocks,
)
from dpserve.protocol import EngineCoreRequest, EngineInfo, PrefixFacts, SchedulerStats, Session

LOAD_BALANCE_POLICIES = ("least-loaded", "round-robin", "cache-aware")
DEFAULT_LOAD_BALANCE = "cache-aware"  # `--load-balance` unless given

DEFAULT_MAX_LORAS = 4  # device slots assumed for a rank that has not reported its adapters
# Adapter tiers of a rank (higher: warmer): resident, on the host, a free slot, none.
RESIDENT, CACHED, FREE_SLOT, COLD = 3, 2, 1, 0
MAX_SESSIONS = 65536  # session keys one router remembers (`SessionTable`, LRU)
# Ranks within this much load of the least loaded take a named tenant's requests in
# turn (2 waiting requests: the placement stays within that of least-loaded's).
TENANT_SPREAD_SLACK = 8
MAX_TENANT_TURNS = 4096  # tenants whose turn one router remembers (`TenantTurns`, LRU)
ANONYMOUS_TENANT = "default"  # requests without a key or tenant header (not spread)


class RankLoad(Protocol):
    """What the router reads of an engine (`rank_table.EngineState` has it)."""

    rank: int
    num_requests: int  # requests this client has in flight there
    waiting: int  # from the coordinator's last publish
    running: int
    sent_since_publish: int  # requests this client sent it since that publish
    stats: SchedulerStats | None  # its last figures (KV capacity)
    info: EngineInfo  # the coordinator's figures (LoRA adapters, from heartbeats)


@dataclass(frozen=True)
class LoadView:
    """How loads are read for one request: from the coordinator's counts (`balanced`)
    or this client's, counting only waiting requests of `priority` or more urgent."""

    balanced: bool
    priority: int = 0


def less_urgent_waiting(stats: SchedulerStats | None, priority: int) -> int:
    """Requests waiting at a rank with a priority after `priority` (its last figures)."""
    if stats is None or not stats.waiting_by_priority:
        return 0
    return sum(n for p, n in stats.waiting_by_priority if p > priority)


@dataclass(frozen=True)
class CacheAwareOptions:
    """Thresholds of `cache-aware` (SGLang's router has the same three, in requests)."""

    cache_threshold: float = 0.3  # matched prefix tokens / prompt tokens to prefer a rank
    # A rank is hot when its load exceeds the least loaded's by more than balance_abs
    # (32: about 8 waiting requests; at 8, two waiting requests made a rank hot and
    # a prefix-heavy load lost its affinity: 1.29x -> 1.75x of least-loaded) ...
    balance_abs: int = 32
    balance_rel: float = 1.5  # ... and is more than this many times the least loaded's
    # With a host tier: the owner keeps a session while its load exceeds that of the
    # least-loaded rank reaching the prefix through the tier by at most this (one
    # waiting request): moving costs a block copy from host memory, not a prefill.
    tier_balance_abs: int = 4
    # A new prefix (no match) goes to the smallest record among the ranks within this
    # much load of the least loaded (two waiting requests): caches fill evenly at light
    # load, and a uniform load without shared prefixes is placed as by least-loaded.
    new_prefix_slack: int = 8


class AdapterTracker:
    """Per rank, the adapters this router sent there lately (an LRU of the rank's
    device slots), and each rank's tier for an adapter (the design page)."""

    def __init__(self) -> None:
        self._sent: dict[int, OrderedDict[str, None]] = {}

    def tier(self, engine: RankLoad, name: str) -> int:
        report = engine.info.lora
        if name in self._sent.get(engine.rank, ()) or (report and name in report.resident):
            return RESIDENT
        if report is not None and name in report.cached:
            return CACHED
        slots = report.max_loras if report is not None else DEFAULT_MAX_LORAS
        used = len(set(report.resident if report is not None else ())
                   | set(self._sent.get(engine.rank, ())))
        return FREE_SLOT if used < slots else COLD

    def record(self, engine: RankLoad, name: str) -> None:
        sent = self._sent.setdefault(engine.rank, OrderedDict())
        sent[name] = None
        sent.move_to_end(name)
        report = engine.info.lora
        while len(sent) > (report.max_loras if report is not None else DEFAULT_MAX_LORAS):
            sent.popitem(last=False)

    def forget(self, rank: int) -> None:
        self._sent.pop(rank, None)


def session_digest(key: str) -> bytes:
    """A session key as the router keeps and hashes it (16 bytes, whatever its length)."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"dpserve-session").digest()


def rendezvous_rank(key: str, ranks: Sequence[int]) -> int:
    """The rank of `ranks` (non-empty) whose hash with the session key is highest: the
    same in every process (no per-process salt), and removing a rank moves only the
    keys that were on it."""
    digest = session_digest(key)
    return max(ranks, key=lambda r: hashlib.blake2b(
        digest + r.to_bytes(4, "little"), digest_size=8).digest())


class SessionTable:
    """Session key -> the rank its last request went to: an LRU of `capacity` keys (as
    digests: bounded memory whatever the keys' length). Pure bookkeeping."""

    def __init__(self, capacity: int = MAX_SESSIONS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ranks: OrderedDict[bytes, int] = OrderedDict()

    def get(self, key: str) -> int | None:
        return self._ranks.get(session_digest(key))

    def record(self, key: str, rank: int) -> None:
        """The session's request went to `rank` (most recently used); the least recently
        used key beyond `capacity` is forgotten."""
        digest = session_digest(key)
        self._ranks[digest] = rank
        self._ranks.move_to_end(digest)
        if len(self._ranks) > self.capacity:
            self._ranks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ranks)


class TenantTurns:
    """Tenant -> how many of its requests this router placed by turn: an LRU of
    `capacity` tenants. Pure bookkeeping."""

    def __init__(self, capacity: int = MAX_TENANT_TURNS) -> None:
        self.capacity = capacity
        self._turns: OrderedDict[str, int] = OrderedDict()

    def next(self, tenant: str, start: int) -> int:
        """The tenant's next turn (its first: `start`)."""
        turn = self._turns.pop(tenant, start)
        self._turns[tenant] = turn + 1
        if len(self._turns) > self.capacity:
            self._turns.popitem(last=False)
        return turn


def sendable(request: EngineCoreRequest, client_index: int, wave: int) -> EngineCoreRequest:
    """The request as an engine gets it: this client's index and request wave, and no
    session (front-end only)."""
    if (request.client_index, request.current_wave, request.session) == (client_index, wave,
                                                                         None):
        return request
    return msgspec.structs.replace(request, client_index=client_index, current_wave=wave,
                                   session=None)


class Router:
    """One front-end's engine choice (the design page). `policy` is one of
    LOAD_BALANCE_POLICIES; `block_size` is the engines' KV block size; `kv_tier`: the
    hosts run a KV host tier (`--kv-offload-memory`)."""

    def __init__(self, policy: str = "least-loaded", *, client_index: int = 0,
                 block_size: int = 16, options: CacheAwareOptions = CacheAwareOptions(),
                 default_capacity: int = DEFAULT_CAPACITY_BLOCKS, kv_tier: bool = False
                 ) -> None:
        if policy not in LOAD_BALANCE_POLICIES:
            raise ValueError(f"load_balance must be one of {', '.join(LOAD_BALANCE_POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.client_index = client_index
        self.options = options
        self.default_capacity = default_capacity
        self.tracker = PrefixTracker(block_size)
        # The host tiers: host -> the blocks its ranks were sent (None: no tier).
        self.tier: PrefixTracker | None = PrefixTracker(block_size) if kv_tier else None
        self._tier_capacity: dict[str, int] = {}  # host -> its store's blocks, as reported
        self._turn = client_index  # round-robin position
        self.cache_routed = 0  # cache-aware: requests placed by their prefix
        self.load_routed = 0  # cache-aware: requests placed by load (no match, or hot)
        self.tier_routed = 0  # cache-aware + tier: placed where the host tier holds the prefix
        self.adapters = AdapterTracker()
        self.adapter_warm = 0  # cache-aware: LoRA requests placed where it was warm
        self.sessions = SessionTable()
        self.session_routed = 0  # requests placed on their session's rank
        self.session_moved = 0  # requests whose session's rank could not take them
        self.tenant_turns = TenantTurns()
        # Several API servers (cache-aware): what this router placed, for the others.
        self.outbox: PrefixOutbox | None = None
        self.learnt = 0  # blocks recorded from other API servers' placements

    @staticmethod
    def load(engine: RankLoad, view: LoadView) -> int:
        """The rank's load in the units the thresholds use (the design page)."""
        later = less_urgent_waiting(engine.stats, view.priority)
        if view.balanced:
            waiting = max(engine.waiting - later, 0)
            return 4 * (waiting + engine.sent_since_publish) + engine.running
        return max(engine.num_requests - later, 0)

    def choose(self, live: Sequence[RankLoad], request: EngineCoreRequest, *,
               balanced: bool) -> RankLoad:
        """The rank among `live` (non-empty) that gets `request`: its session's rank when
        that may take it, else the policy's choice (the design page)."""
        view = LoadView(balanced, request.priority)
        session = request.session
        if session is not None:
            stuck = self._session_rank(live, session, view)
            if stuck is not None:
                self.session_routed += 1
                self.record(stuck, request=request)
                return stuck
        chosen = self._by_policy(live, request, view)
        if session is not None:
            self.sessions.record(session.key, chosen.rank)
        return chosen

    def session_rank(self, key: str) -> int | None:
        """The rank this router last sent session `key` to (None: not known here)."""
        return self.sessions.get(key)

    def _session_rank(self, live: Sequence[RankLoad], session: Session, view: LoadView
                      ) -> RankLoad | None:
        """The session's rank (the design page) if it is in `live` and not hot."""
        rank = session.rank if session.rank is not None else self.sessions.get(session.key)
        if rank is None:
            rank = rendezvous_rank(session.key, [e.rank for e in live])
        engine = next((e for e in live if e.rank == rank), None)
        floor = self.load(self._least_loaded(live, view), view)
        if engine is not None and not self._hot(self.load(engine, view), floor):
            return engine
        self.session_moved += 1
        return None

    def _by_policy(self, live: Sequence[RankLoad], request: EngineCoreRequest,
                   view: LoadView) -> RankLoad:
        if self.policy == "round-robin":
            self._turn += 1
            return live[(self._turn - 1) % len(live)]
        least = self._least_loaded(live, view)
        if self.policy == "least-loaded":
            return self._spread(live, least, view, request.tenant)
        chain = self.tracker.hashes(request.prompt_token_ids, cache_root(request))
        candidates = live
        if request.lora_name is not None:
            candidates = self._warmest(live, request.lora_name, least, view)
        chosen = self._cache_aware(candidates, chain, len(request.prompt_token_ids), least,
                                   view, request.tenant)
        self.record(chosen, chain)
        if request.lora_name is not None:
            self.adapter_warm += self.adapters.tier(chosen, request.lora_name) >= CACHED
            self.adapters.record(chosen, request.lora_name)
        return chosen

    def record(self, engine: RankLoad, chain: Sequence[BlockHash] | None = None,
               request: EngineCoreRequest | None = None) -> None:
        """The rank gets `request` (e.g. a pinned one): its session (if any) moves there;
        cache-aware: so does its prompt (`chain`, or `request`'s); other policies keep
        no prompt record."""
        if request is not None and request.session is not None:
            self.sessions.record(request.session.key, engine.rank)
        if self.policy != "cache-aware":
            return
        if chain is None:
            chain = self.tracker.hashes(request.prompt_token_ids if request else [],
                                        cache_root(request) if request else None)
        if request is not None and request.lora_name is not None:
            self.adapters.record(engine, request.lora_name)
        self._remember(engine, chain)
        if self.outbox is not None:
            self.outbox.note(engine.rank, chain)

    def learn(self, facts: PrefixFacts, engines: Sequence[RankLoad]) -> None:
        """Another API server placed these blocks (`PrefixFacts`, relayed by the
        coordinator): record them as this router's own placements (cache-aware only;
        this router's own facts and ranks not in `engines` are skipped)."""
        if self.policy != "cache-aware" or facts.client_index == self.client_index:
            return
        by_rank = {engine.rank: engine for engine in engines}
        for rank, chain in zip(facts.ranks, facts.blocks):
            engine = by_rank.get(rank)
            if engine is not None:
                self._remember(engine, chain)
                self.learnt += len(chain)

    def _remember(self, engine: RankLoad, chain: Sequence[BlockHash]) -> None:
        """The rank (and its host's tier) now holds `chain`."""
        capacity = kv_capacity_blocks(engine.stats) or self.default_capacity
        self.tracker.record(engine.rank, chain, capacity)
        if self.tier is not None:  # the rank saves the prompt's full blocks to its host's tier
            host = host_of(engine)
            if engine.stats is not None and engine.stats.kv_tier_num_blocks > 0:
                self._tier_capacity[host] = engine.stats.kv_tier_num_blocks
            self.tier.record(host, chain, self._tier_capacity.get(host, self.default_capacity))

    def forget(self, rank: int) -> None:
        """The rank's prefix cache is gone (dead, restarted or removed)."""
        self.tracker.forget(rank)
        self.adapters.forget(rank)

    def _least_loaded(self, live: Sequence[RankLoad], view: LoadView) -> RankLoad:
        if not view.balanced:
            return min(live, key=lambda e: (self.load(e, view), e.rank))
        start = self.client_index % len(live)
        best, best_load = live[start], None
        for engine in [*live[start:], *live[:start]]:
            load = self.load(engine, view)
            if best_load is None or load < best_load:
                best, best_load = engine, load
        return best

    def _spread(self, live: Sequence[RankLoad], least: RankLoad, view: LoadView,
                tenant: str | None) -> RankLoad:
        """`least`, or for a named tenant its next turn among the ranks nearly as idle
        (the design page)."""
        if tenant is None or tenant == ANONYMOUS_TENANT or len(live) < 2:
            return least
        floor = self.load(least, view)
        near = sorted((e for e in live if self.load(e, view) <= floor + TENANT_SPREAD_SLACK),
                      key=lambda e: e.rank)
        return near[self.tenant_turns.next(tenant, self.client_index) % len(near)]

    def _warmest(self, live: Sequence[RankLoad], name: str, least: RankLoad,
                 view: LoadView) -> list[RankLoad]:
        """The ranks, not hot, where adapter `name` is warmest (the design page)."""
        floor = self.load(least, view)
        cool = [e for e in live if not self._hot(self.load(e, view), floor)]
        tiers = {e.rank: self.adapters.tier(e, name) for e in cool}
        best = max(tiers.values())
        return [e for e in cool if tiers[e.rank] == best]

    def _hot(self, load: int, floor: int) -> bool:
        opts = self.options
        return load - floor > opts.balance_abs and load > floor * opts.balance_rel

    def _cache_aware(self, live: Sequence[RankLoad], chain: Sequence[BlockHash],
                     num_tokens: int, least: RankLoad, view: LoadView,
                     tenant: str | None = None) -> RankLoad:
        """The rank with the longest remembered prefix (ties: the least loaded) if it
        covers `cache_threshold` of the prompt and is not hot; else the rule for new
        prefixes or hot ranks (the design page)."""
        floor = self.load(least, view)
        loads = {engine.rank: self.load(engine, view) for engine in live}
        matched = {engine.rank: self.tracker.matched_blocks(engine.rank, chain)
                   for engine in live}
        best = min(live, key=lambda e: (-matched[e.rank], loads[e.rank], self._scan(e)))
        if self.tier is not None:
            chosen = self._tier_aware(live, chain, num_tokens, matched, loads, best, floor)
            if chosen is not None:
                return chosen
        tokens = matched[best.rank] * self.tracker.block_size
        if tokens and tokens >= self.options.cache_threshold * num_tokens:
            if not self._hot(loads[best.rank], floor):
                self.cache_routed += 1
                return best
            self.load_routed += 1
            return least
        self.load_routed += 1
        cool = [e for e in live if not self._hot(loads[e.rank], floor)]
        if tenant is not None and tenant != ANONYMOUS_TENANT and least in cool:
            return self._spread(cool, least, view, tenant)  # a named tenant's, in turn
        # (a prompt under one block leaves no block anywhere: by load alone)
        near = [e for e in cool if loads[e.rank] <= floor + self.options.new_prefix_slack]
        return min(near or cool, key=lambda e: (self.tracker.size(e.rank) if chain else 0,
                                                loads[e.rank], self._scan(e)))

    def _tier_aware(self, live: Sequence[RankLoad], chain: Sequence[BlockHash],
                    num_tokens: int, matched: dict[int, int], loads: dict[int, int],
                    owner: RankLoad, floor: int) -> RankLoad | None:
        """With a host tier: the owner, or the least-loaded rank that reaches the prefix
        through its host's tier; None when no rank that is not hot reaches it (the
        design page)."""
        assert self.tier is not None
        bs, threshold = self.tracker.block_size, self.options.cache_threshold * num_tokens

        def covers(blocks: int) -> bool:
            return blocks > 0 and blocks * bs >= threshold

        reach = {e.rank: matched[e.rank] + self.tier.matched_blocks(host_of(e), chain,
                                                                    matched[e.rank])
                 for e in live}
        reaching = [e for e in live if covers(reach[e.rank])
                    and not self._hot(loads[e.rank], floor)]
        if not reaching:
            return None
        cheapest = min(reaching, key=lambda e: (loads[e.rank], -matched[e.rank],
                                                -reach[e.rank], self._scan(e)))
        if (covers(matched[owner.rank]) and not self._hot(loads[owner.rank], floor)
                and loads[owner.rank] - loads[cheapest.rank] <= self.options.tier_balance_abs):
            self.cache_routed += 1
            return owner
        if covers(matched[cheapest.rank]):
            self.cache_routed += 1
        else:
            self.tier_routed += 1
        return cheapest

    def _scan(self, engine: RankLoad) -> int:
        """Tie-break: ranks from this client's own index on, then the lower ones."""
        return (engine.rank - self.client_index) % (1 << 30)


def host_of(engine: RankLoad) -> str:
    """Which host tier a rank shares: its host as its heartbeats name it; a rank not
    heard from yet (or with no coordinator: one rank per front-end) shares with none."""
    return engine.info.host or f"\x00rank {engine.rank}"
