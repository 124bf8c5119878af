"""RankTable: what one front-end knows of its DP ranks, and where new work may go.

Scope (IO-free: no sockets, no tasks, no clock; the engine client's shell,
`dpserve.frontend.engine_client`, feeds it news and carries out what it returns):

* Per rank an `EngineState`: its status (`RankStatus`: state, incarnation,
  reason), its registration, its loads (the coordinator's `[waiting, running]`
  plus what this client sent since that publish; the requests in flight from
  here), its figures (`SchedulerStats`, `EngineInfo`: cordon and what
  `GET /engines` shows).
* Freshness: news of an older incarnation is dropped, and "serving" for an
  incarnation this client saw die (`mark_dead`: direct evidence) is too; with no
  coordinator, a dead rank whose new process registers is serving again.
* Each accepted change comes back as a `StatusChange`: whether the requests the
  rank holds must move (`evacuate`, with an ABORT to it first when it may still
  run), or whether the client must die instead (`fail_stop`).
* Placement: only SERVING, uncordoned ranks get new work (`placeable`); a
  pinned request (`data_parallel_rank`) goes to its rank or fails
  (ValueError for a rank this client does not have, EngineUnavailableError for
  one that is not serving or cordoned; its session, if any, moves there);
  otherwise the `Router` (`dpserve.frontend.routing`) picks: the request's
  session's rank when it is placeable and not hot, else by its policy.
* Resize (elastic scaling): the rank set is [0, size) as the coordinator says;
  removed ranks come back as changes to evacuate.
* Roles (`--data-parallel-roles`, `dpserve.frontend.roles`): the router
  picks among the placeable ranks of the role a request wants (a new request:
  prefill; one with tokens already, a continuation or a migration: decode), or
  among all placeable ranks when none of that role is (colocated fallback);
  `hands_off` says whether a request placed on a prefill rank runs there as a
  handoff's first leg (a decode rank serves, and the request qualifies).

Not here: moving the requests (`dpserve.frontend.migration` plans it), sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dpserve.frontend.errors import EngineUnavailableError
from dpserve.frontend.roles import BOTH, DECODE, PREFILL, Roles, can_hand_off
from dpserve.frontend.routing import Router
from dpserve.protocol import (
    CoordinatorUpdate,
    EngineCoreRequest,
    EngineInfo,
    RankState,
    RankStatus,
    SchedulerStats,
    engine_identity,
)


@dataclass
class EngineState:
    """What this front-end knows about one engine."""

    rank: int
    identity: bytes
    registered: bool = False  # its empty registration frame came
    num_requests: int = 0  # requests sent to it and not yet finished
    waiting: int = 0  # from the coordinator's last publish
    running: int = 0  # from the coordinator's last publish
    sent_since_publish: int = 0  # requests this client sent it since that publish
    waiting_tokens: int = 0  # prompt tokens waiting there, from the coordinator
    tokens_since_publish: int = 0  # prompt tokens this client sent it since that publish
    status: RankStatus = field(default_factory=RankStatus)  # as last heard (module doc)
    # Direct evidence (ENGINE_CORE_DEAD, an exit, an unreachable socket) that this
    # incarnation died: it outranks any news of the same incarnation still serving.
    dead_incarnation: int | None = None
    stats: SchedulerStats | None = None  # the last figures it sent
    info: EngineInfo = field(default_factory=EngineInfo)  # from the coordinator (/engines)

    @property
    def serving(self) -> bool:
        return self.status.state is RankState.SERVING

    @property
    def cordoned(self) -> bool:
        return self.info.cordoned

    @property
    def placeable(self) -> bool:
        """It may get new work: serving and not cordoned."""
        return self.serving and not self.info.cordoned

    def describe(self) -> str:
        """`rank 1 dead (exit code -9)`."""
        return (f"rank {self.rank} {self.status.state.value}"
                + (f" ({self.status.reason})" if self.status.reason else ""))


@dataclass(frozen=True)
class StatusChange:
    """A rank's accepted new status, and what it asks of the client."""

    rank: int
    status: RankStatus
    evacuate: bool = False  # move every request it holds to a serving rank
    abort_first: bool = False  # send it an ABORT for them first (it may still run)
    fail_stop: str | None = None  # --engine-failure-policy stop: the client dies (why)
    why: str = ""  # `rank 1 dead (exit code -9)`: the moved requests' reason


@dataclass(frozen=True)
class RankView:
    """A read-only snapshot of one rank, as the server shows it (`ClusterView.ranks`)."""

    rank: int
    state: RankState
    incarnation: int = 0
    reason: str = ""
    cordoned: bool = False
    in_flight: int = 0  # requests this API server has in flight there
    waiting: int = 0  # the coordinator's counts (every API server's)
    running: int = 0
    info: EngineInfo = field(default_factory=EngineInfo)
    stats: SchedulerStats | None = None  # the last figures it sent this API server
    role: str = BOTH  # prefill | decode | both (--data-parallel-roles)
    handoffs: int = 0  # handoffs in flight from or to it (this API server's)

    @property
    def serving(self) -> bool:
        return self.state is RankState.SERVING


class RankTable:
    """The ranks of one front-end (module docstring). `balanced`: a DP coordinator
    publishes loads; `elastic`: the rank set follows its rank list; `fail_stop`:
    a rank lost kills the client instead of moving its requests."""

    def __init__(self, ranks: Sequence[int], router: Router, *, balanced: bool = False,
                 elastic: bool = False, fail_stop: bool = False) -> None:
        self.engines = {r: EngineState(r, engine_identity(r)) for r in ranks}
        self.router = router
        self.balanced = balanced
        self.elastic = elastic and balanced
        self.fail_stop = fail_stop
        self.early: set[int] = set()  # elastic: ranks that registered before we heard of them
        self.roles: Roles | None = None  # --data-parallel-roles (None: every rank both)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.engines)

    def view(self, engine: EngineState) -> RankView:
        return RankView(engine.rank, engine.status.state, engine.status.incarnation,
                        engine.status.reason, engine.cordoned, engine.num_requests,
                        engine.waiting, engine.running, engine.info, engine.stats,
                        self.role_of(engine.rank))

    def role_of(self, rank: int) -> str:
        return self.roles.role_of(rank) if self.roles is not None else BOTH

    # ---- news ---------------------------------------------------------------------

    def apply_status(self, rank: int, status: RankStatus) -> StatusChange | None:
        """News of a rank (the coordinator's, or its launcher's); None: dropped or no change."""
        engine = self.engines.get(rank)
        if engine is None or status.incarnation < engine.status.incarnation:
            return None
        if engine.dead_incarnation is not None:
            if status.incarnation <= engine.dead_incarnation:
                return None  # we saw this process die; only its successor can serve
            engine.dead_incarnation = None
        return self._change(engine, status)

    def mark_dead(self, rank: int, reason: str) -> StatusChange | None:
        """Direct evidence that a rank's current process is gone."""
        engine = self.engines.get(rank)
        if engine is None or engine.dead_incarnation == engine.status.incarnation:
            return None
        engine.dead_incarnation = engine.status.incarnation
        return self._change(engine, RankStatus(RankState.DEAD, engine.status.incarnation,
                                               reason))

    def _change(self, engine: EngineState, status: RankStatus) -> StatusChange | None:
        was_serving = engine.serving
        if status == engine.status:
            return None
        # A new process (e.g. restarted by a remote host before anyone saw the old
        # one die): what the old one held is gone with it.
        replaced = status.incarnation > engine.status.incarnation and was_serving
        engine.status = status
        lost = status.state in (RankState.DEAD, RankState.RESTARTING)
        if replaced or lost:
            self.router.forget(engine.rank)  # its prefix cache is gone
        why = engine.describe()
        if replaced and engine.serving:
            return StatusChange(engine.rank, status, evacuate=True, abort_first=True, why=why)
        if was_serving and not engine.serving and status.state is not RankState.DRAINING:
            # (draining: it finishes what it holds; only new work goes elsewhere)
            if self.fail_stop and lost:
                return StatusChange(engine.rank, status, why=why, fail_stop=(
                    f"rank {engine.rank} {status.state.value}: {status.reason}"))
            return StatusChange(engine.rank, status, evacuate=True, why=why,
                                abort_first=status.state is not RankState.DEAD)
        return StatusChange(engine.rank, status)

    def register(self, rank: int) -> StatusChange | None:
        """A rank's registration frame; the change it makes. Without a coordinator to
        say so, a new process of a dead rank is serving. An unknown rank (elastic:
        scaling up) is kept until the coordinator's rank list names it."""
        engine = self.engines.get(rank)
        if engine is None:
            if self.elastic:
                self.early.add(rank)
            return None
        engine.registered = True
        if engine.dead_incarnation is not None and not self.balanced:
            return self.apply_status(rank, RankStatus(RankState.SERVING,
                                                      engine.dead_incarnation + 1))
        return None

    def apply_update(self, update: CoordinatorUpdate) -> list[StatusChange]:
        """A coordinator publish: the rank set (elastic), states, figures and loads, and
        the prompt blocks other API servers placed (for the router's record)."""
        changes: list[StatusChange] = []
        if self.elastic and update.ranks is not None and len(update.ranks) != len(self.engines):
            changes += self.resize(len(update.ranks))
        for rank, status in enumerate(update.ranks or []):
            change = self.apply_status(rank, status)
            if change is not None:
                changes.append(change)
        if update.prefixes is not None:  # API servers' placements (the router skips ours)
            self.router.learn(update.prefixes, [e for e in self.engines.values() if e.serving])
        for rank, info in enumerate(update.engines or []):
            if rank in self.engines:
                self.engines[rank].info = info
        if update.counts is not None:
            tokens = update.waiting_tokens or [0] * len(update.counts)
            for rank, (waiting, running) in enumerate(update.counts):
                engine = self.engines.get(rank)
                if engine is not None:
                    engine.waiting, engine.running = waiting, running
                    engine.waiting_tokens = tokens[rank] if rank < len(tokens) else 0
                    engine.sent_since_publish = engine.tokens_since_publish = 0
        return changes

    def resize(self, size: int) -> list[StatusChange]:
        """The rank set is [0, size) now: new ranks start STARTING (registered if their
        frame came early); removed ones come back as changes to evacuate (with ABORT)."""
        changes = []
        for rank in [r for r in self.engines if r >= size]:
            engine = self.engines.pop(rank)
            self.router.forget(rank)
            engine.status = RankStatus(RankState.DEAD, engine.status.incarnation,
                                       f"removed: scaled down to {size} engines")
            changes.append(StatusChange(rank, engine.status, evacuate=True, abort_first=True,
                                        why=engine.describe()))
        for rank in range(size):
            if rank not in self.engines:
                self.engines[rank] = EngineState(rank, engine_identity(rank),
                                                 registered=rank in self.early,
                                                 status=RankStatus(RankState.STARTING))
        self.early -= set(self.engines)
        return changes

    # ---- placement --------------------------------------------------------------------

    def placeable(self, exclude: int | None = None) -> list[EngineState]:
        """The ranks that may get new work (but `exclude`); EngineUnavailableError
        when there are none."""
        live = [e for e in self.engines.values() if e.placeable and e.rank != exclude]
        if not live:
            raise EngineUnavailableError("no engine is serving: " + self.describe())
        return live

    def describe(self) -> str:
        """`rank 0 serving, rank 1 dead (exit code -9)`."""
        return ", ".join(f"rank {e.rank} {e.status.state.value}"
                         + (" cordoned" if e.cordoned else "")
                         + (f" ({e.status.reason})" if e.status.reason else "")
                         for e in self.engines.values())

    def store_address_of(self, rank: int) -> str | None:
        """The tcp:// address of `rank`'s host's KV store, as its heartbeats say (None:
        a rank not heard from, on one host, or without a tier)."""
        engine = self.engines.get(rank)
        if engine is None:
            return None
        return engine.info.kv_store_address or None

    def choose(self, request: EngineCoreRequest, exclude: int | None = None) -> EngineState:
        """The pinned rank if any, else the router's choice among the placeable ranks."""
        if request.data_parallel_rank is None:
            return self.router.choose(self._of_role(self.placeable(exclude), request),
                                      request, balanced=self.balanced)  # type: ignore
        engine = self.engines.get(request.data_parallel_rank)
        if engine is None:
            raise ValueError(f"data_parallel_rank {request.data_parallel_rank} is out of "
                             f"range: this server's engines are {self.ranks}")
        if not engine.serving:
            raise EngineUnavailableError(
                f"data_parallel_rank {engine.rank} is {engine.status.state.value}"
                + (f" ({engine.status.reason})" if engine.status.reason else ""))
        if engine.cordoned:
            raise EngineUnavailableError(f"data_parallel_rank {engine.rank} is cordoned "
                                         f"(an operator took it out of placement)")
        self.router.record(engine, request=request)
        return engine

    def _of_role(self, live: list[EngineState], request: EngineCoreRequest
                 ) -> list[EngineState]:
        """The ranks of `live` of the role `request` wants; all of them when none is."""
        if self.roles is None:
            return live
        wanted = DECODE if request.prior_output_token_ids else PREFILL
        return [e for e in live if self.role_of(e.rank) == wanted] or live

    def hands_off(self, request: EngineCoreRequest, engine: EngineState,
                  max_model_len: int | None) -> bool:
        """Whether `request`, placed on `engine`, runs there as a handoff's first leg."""
        return (self.roles is not None and self.role_of(engine.rank) == PREFILL
                and can_hand_off(request, max_model_len)
                and any(e.placeable and self.role_of(e.rank) == DECODE
                        for e in self.engines.values()))

    def assign(self, engine: EngineState, prompt_tokens: int = 0) -> None:
        """A request goes to `engine`: count it in its loads."""
        engine.num_requests += 1
        engine.sent_since_publish += 1
        engine.tokens_since_publish += prompt_tokens

    def release(self, rank: int) -> None:
        """A request left `rank` (finished, moved or failed); a removed rank: nothing."""
        engine = self.engines.get(rank)
        if engine is not None:
            engine.num_requests -= 1
