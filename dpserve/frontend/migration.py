"""The requests one front-end has in flight, and the plan to move them off a rank.

Scope (IO-free: the engine client's shell sends what the plan says):

* `InFlightBook` keeps each request this client sent until it finishes
  (`InFlight`: the request as sent, its rank, every token received), drops
  outputs from a rank a request has left (`accept`), and counts the moves.
* `plan_evacuation`: when a rank stops serving, each of its requests goes to a
  serving rank (chosen by the `RankTable`) with `prior_output_token_ids` = the
  tokens so far (none yet: a retry), so that engine recomputes its KV and goes
  on from there and the caller sees one unbroken stream. A request pinned to
  the lost rank, moved `max_migrations` times already, or with no serving rank
  left fails instead (its `Failure` says why). The plan (`Evacuation`) lists
  the ids to ABORT at the rank first (when it may still run: no duplicates when
  it recovers), the moves and the failures; the book and the table already
  account for them when it returns.
* Handoffs (prefill/decode disaggregation, `dpserve.frontend.handoff`): a flight
  whose first leg (max_tokens 1) runs at a prefill rank is `PREFILL`; the output
  that finishes that leg by length is passed on unfinished and the flight turns
  `PENDING` (`take_pending`: the shell sends its continuation); `commit_handoff`
  moves it to the decode rank as a migration does (the tokens so far as
  `prior_output_token_ids`), `SENT` until that rank's first output comes (the
  handoff latency). An evacuation turns any of them into an ordinary flight (a
  first leg is re-sent whole: it runs colocated); an abort of a `PENDING` flight
  ends it here (`abort_plan`: no engine holds it).

Not here: sending (`dpserve.frontend.engine_client`), rank states
(`dpserve.frontend.rank_table`).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import msgspec

from dpserve.frontend.errors import EngineUnavailableError
from dpserve.frontend.rank_table import EngineState, RankTable
from dpserve.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

# A flight's handoff phase (module docstring); None: an ordinary flight.
PREFILL, PENDING, SENT = "prefill", "pending", "sent"
MAX_LATENCIES = 4096  # handoff latencies kept until the metrics take them


@dataclass
class InFlight:
    """A request this client sent and that has not finished: enough to move it."""

    request: EngineCoreRequest  # as first sent
    rank: int  # the engine that runs it now
    generated: list[int] = field(default_factory=list)  # every token received so far
    moves: int = 0  # times it was re-sent to another rank
    handoff: str | None = None  # PREFILL | PENDING | SENT (module docstring); None: none
    handoff_from: int | None = None  # the prefill rank, from PENDING until the handoff ends
    handoff_at: float = 0.0  # when the first leg's token came (monotonic s)
    handed_off: bool = False  # it continued on a decode rank (whose cache hits it hides)


@dataclass(frozen=True)
class Move:
    """Send `request` (with the prior tokens) to rank `target`."""

    request_id: str
    request: EngineCoreRequest
    source: int
    target: int
    num_tokens: int  # tokens it had generated (0: a retry)


@dataclass(frozen=True)
class Failure:
    """End request `request_id` (last at `rank`) with this error."""

    request_id: str
    rank: int
    error: str


@dataclass(frozen=True)
class Evacuation:
    """What to do about the requests of a rank that stopped serving."""

    rank: int
    abort: list[str]  # ids to ABORT at the rank first ([]: it is dead, or held none)
    moves: list[Move]
    failures: list[Failure]
    log_level: int = logging.INFO  # of each move's line (a handoff's: DEBUG)


@dataclass(frozen=True)
class MovedCounts:
    """Totals of requests moved by this client (the /metrics counters)."""

    retries: int = 0  # re-sent before their first token
    migrations: int = 0  # moved mid-stream
    recomputed_tokens: int = 0  # prompt + generated tokens prefilled again by moves


@dataclass(frozen=True)
class HandoffCounts:
    """Prefill -> decode handoffs of this client (the /metrics figures)."""

    handoffs: int = 0  # continuations sent to another rank
    colocated: int = 0  # first legs that went on where they were (no other rank serving)
    in_flight: int = 0  # first token in, the continuation's first output not yet
    pulled_blocks: int = 0  # blocks pulled into a decode rank's host store (cross-host)


def ended(rank: int, request_id: str, error: str | None = None) -> EngineCoreOutputs:
    """The message that ends a request no engine will end (finish reason ABORT; with
    `error`: it failed)."""
    return EngineCoreOutputs(engine_index=rank, outputs=[EngineCoreOutput(
        request_id, [], finish_reason=FinishReason.ABORT, error=error)])


class InFlightBook:
    """Requests in flight from one front-end (module docstring)."""

    def __init__(self, max_migrations: int = 3) -> None:
        self.flights: dict[str, InFlight] = {}  # request_id -> its story, until finished
        self.max_migrations = max_migrations
        self.num_retries = 0
        self.num_migrations = 0
        self.recomputed_tokens = 0
        self.num_handoffs = 0
        self.num_colocated = 0
        self.pulled_blocks = 0
        self.pending: list[str] = []  # first legs done since `take_pending`
        self.latencies: collections.deque[float] = collections.deque(maxlen=MAX_LATENCIES)

    @property
    def moved(self) -> MovedCounts:
        return MovedCounts(self.num_retries, self.num_migrations, self.recomputed_tokens)

    @property
    def handoffs(self) -> HandoffCounts:
        in_flight = sum(f.handoff in (PENDING, SENT) for f in self.flights.values())
        return HandoffCounts(self.num_handoffs, self.num_colocated, in_flight,
                             self.pulled_blocks)

    def handoffs_at(self, rank: int) -> int:
        """Handoffs in flight from or to `rank`."""
        return sum(f.handoff in (PENDING, SENT) and rank in (f.rank, f.handoff_from)
                   for f in self.flights.values())

    def add(self, request: EngineCoreRequest, rank: int, first_leg: EngineCoreRequest |
            None = None) -> EngineCoreRequest:
        """Keep `request` (as first sent) at `rank`; `first_leg`: what goes to the rank
        instead (a handoff's first leg). Returns what to send."""
        if request.request_id in self.flights:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.flights[request.request_id] = InFlight(
            request, rank, handoff=PREFILL if first_leg is not None else None)
        return first_leg if first_leg is not None else request

    def pop(self, request_id: str) -> InFlight | None:
        return self.flights.pop(request_id, None)

    def rank_of(self, request_id: str) -> int | None:
        flight = self.flights.get(request_id)
        return flight.rank if flight is not None else None

    def at(self, rank: int) -> list[InFlight]:
        return [f for f in self.flights.values() if f.rank == rank]

    def accept(self, engine_index: int, out: EngineCoreOutput
               ) -> tuple[EngineCoreOutput | None, bool]:
        """An output from `engine_index`: (what to pass on, None: drop it; the request
        finished here). Outputs from a rank the request has left are dropped (it goes
        on elsewhere); a handoff's first leg that ends by length goes on unfinished."""
        flight = self.flights.get(out.request_id)
        if flight is None:
            return out, False
        if flight.rank != engine_index or flight.handoff == PENDING:
            return None, False
        flight.generated.extend(out.new_token_ids)
        if flight.handed_off and out.num_cached_tokens:  # usage as colocated: the prefill
            out = msgspec.structs.replace(out, num_cached_tokens=0)  # rank's hits count
        if flight.handoff == SENT:  # the decode rank's first output: the handoff is done
            self.latencies.append(time.monotonic() - flight.handoff_at)
            flight.handoff = flight.handoff_from = None
        elif flight.handoff == PREFILL and out.finished:
            flight.handoff = None
            if out.finish_reason is FinishReason.LENGTH and out.error is None:
                flight.handoff, flight.handoff_at = PENDING, time.monotonic()
                flight.handoff_from = flight.rank
                self.pending.append(out.request_id)
                return msgspec.structs.replace(out, finish_reason=None, stop_reason=None,
                                               phase_times=None), False
        return out, out.finished

    def take_pending(self) -> list[str]:
        """The first legs done since the last call (their continuations are due)."""
        pending, self.pending = self.pending, []
        return pending

    def continuation(self, request_id: str, wave: int) -> EngineCoreRequest | None:
        """What a `PENDING` flight's decode rank gets: the request with the tokens so
        far (None: the flight ended or moved meanwhile)."""
        flight = self.flights.get(request_id)
        if flight is None or flight.handoff != PENDING:
            return None
        return msgspec.structs.replace(flight.request, current_wave=wave,
                                       prior_output_token_ids=list(flight.generated))

    def commit_handoff(self, request_id: str, target: EngineState, table: RankTable,
                       wave: int) -> Move | None:
        """Move a `PENDING` flight to `target` (None: it ended or moved meanwhile); the
        same rank (no other serving) goes on colocated, counted apart."""
        moved = self.continuation(request_id, wave)
        if moved is None:
            return None
        flight = self.flights[request_id]
        source = flight.rank
        table.release(source)
        table.assign(target)
        flight.rank, flight.handoff, flight.handed_off = target.rank, SENT, True
        if target.rank == source:
            self.num_colocated += 1
        else:
            self.num_handoffs += 1
        return Move(request_id, moved, source, target.rank, len(flight.generated))

    def abort_plan(self, request_ids: list[str] | tuple[str, ...], table: RankTable
                   ) -> tuple[dict[int, list[str]], list[tuple[str, int]]]:
        """The ids to ABORT at each rank, and the (id, rank) of those mid-handoff that no
        engine holds: forgotten here (their ABORT output is the caller's to make)."""
        by_rank: dict[int, list[str]] = {}
        cancelled: list[tuple[str, int]] = []
        for rid in request_ids:
            flight = self.flights.get(rid)
            if flight is not None and flight.handoff == PENDING:
                del self.flights[rid]
                table.release(flight.rank)
                cancelled.append((rid, flight.rank))
            elif flight is not None:
                by_rank.setdefault(flight.rank, []).append(rid)
        return by_rank, cancelled

    def plan_evacuation(self, rank: int, why: str, abort: bool, table: RankTable,
                        wave: int) -> Evacuation:
        """Move every request at `rank` (no longer serving) elsewhere, or fail it; `why`
        names the rank's state; `abort`: ABORT them at `rank` first; `wave`: the
        current request wave."""
        ids = [rid for rid, f in self.flights.items() if f.rank == rank]
        moves: list[Move] = []
        failures: list[Failure] = []
        for rid in ids:
            flight = self.flights[rid]
            table.release(rank)
            moved = msgspec.structs.replace(
                flight.request, current_wave=wave,
                prior_output_token_ids=list(flight.generated) or None)
            try:
                target = self._target(flight, moved, why, table)
            except EngineUnavailableError as e:
                del self.flights[rid]
                failures.append(Failure(rid, rank, f"request {rid} failed: {e}"))
                continue
            flight.moves += 1
            flight.rank = target.rank
            flight.handoff = flight.handoff_from = None  # it runs to the end there
            table.assign(target)
            self._count(moved, len(flight.generated))
            moves.append(Move(rid, moved, rank, target.rank, len(flight.generated)))
        return Evacuation(rank, ids if abort else [], moves, failures)

    def _target(self, flight: InFlight, moved: EngineCoreRequest, why: str,
                table: RankTable) -> EngineState:
        if flight.request.data_parallel_rank is not None:
            raise EngineUnavailableError(f"its pinned {why}")
        if flight.moves >= self.max_migrations:
            raise EngineUnavailableError(f"{why}, and it was moved {flight.moves} times "
                                         f"already (--max-request-migrations)")
        return table.choose(moved, exclude=flight.rank)

    def _count(self, moved: EngineCoreRequest, num_tokens: int) -> None:
        if num_tokens:
            self.num_migrations += 1
        else:
            self.num_retries += 1
        self.recomputed_tokens += len(moved.prompt_token_ids) + num_tokens
