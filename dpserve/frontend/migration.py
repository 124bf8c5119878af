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

Not here: sending (`dpserve.frontend.engine_client`), rank states
(`dpserve.frontend.rank_table`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from dpserve.frontend.errors import EngineUnavailableError
from dpserve.frontend.rank_table import EngineState, RankTable
from dpserve.protocol import EngineCoreOutput, EngineCoreRequest


@dataclass
class InFlight:
    """A request this client sent and that has not finished: enough to move it."""

    request: EngineCoreRequest  # as first sent
    rank: int  # the engine that runs it now
    generated: list[int] = field(default_factory=list)  # every token received so far
    moves: int = 0  # times it was re-sent to another rank


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


@dataclass(frozen=True)
class MovedCounts:
    """Totals of requests moved by this client (the /metrics counters)."""

    retries: int = 0  # re-sent before their first token
    migrations: int = 0  # moved mid-stream
    recomputed_tokens: int = 0  # prompt + generated tokens prefilled again by moves


class InFlightBook:
    """Requests in flight from one front-end (module docstring)."""

    def __init__(self, max_migrations: int = 3) -> None:
        self.flights: dict[str, InFlight] = {}  # request_id -> its story, until finished
        self.max_migrations = max_migrations
        self.num_retries = 0
        self.num_migrations = 0
        self.recomputed_tokens = 0

    @property
    def moved(self) -> MovedCounts:
        return MovedCounts(self.num_retries, self.num_migrations, self.recomputed_tokens)

    def add(self, request: EngineCoreRequest, rank: int) -> None:
        if request.request_id in self.flights:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.flights[request.request_id] = InFlight(request, rank)

    def pop(self, request_id: str) -> InFlight | None:
        return self.flights.pop(request_id, None)

    def rank_of(self, request_id: str) -> int | None:
        flight = self.flights.get(request_id)
        return flight.rank if flight is not None else None

    def at(self, rank: int) -> list[InFlight]:
        return [f for f in self.flights.values() if f.rank == rank]

    def accept(self, engine_index: int, out: EngineCoreOutput) -> tuple[bool, bool]:
        """An output from `engine_index`: (keep it, the request finished here). Outputs
        from a rank the request has left are dropped (it goes on elsewhere)."""
        flight = self.flights.get(out.request_id)
        if flight is None:
            return True, False
        if flight.rank != engine_index:
            return False, False
        flight.generated.extend(out.new_token_ids)
        return True, out.finished

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
