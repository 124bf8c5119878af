"""Carrying out moves: rank news turned into requests sent elsewhere (a shell).

Scope: `MoveSender`, held by the engine client. The decisions are its
`RankTable`'s (what a rank's news means) and its `InFlightBook`'s (which
request goes where, with which prior tokens); this part carries them out:

* `apply(change)`: a rank's `StatusChange` is logged, then the client dies
  (`--engine-failure-policy stop`) or the rank's requests are evacuated;
* `evacuate(change)`: the book plans the moves at once (news that came with the
  change is in the table), the old rank is told to abort what moves (it may
  come back, or still run: no duplicates), the requests that cannot move end
  with their error, then the moves go out;
* `send(plan, why)`: each move as an ADD to its target, unless it finished or
  moved on meanwhile (a traced one gets a `migrate` span). The handoff's
  continuations go out the same way (`dpserve.frontend.handoff`).

Not here: the plans (`dpserve.frontend.migration`), the sockets and the thread
hops (`dpserve.frontend.engine_client`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from dpserve.frontend.errors import EngineUnavailableError
from dpserve.frontend.migration import Evacuation, InFlightBook, ended
from dpserve.frontend.rank_table import EngineState, RankTable, StatusChange
from dpserve.frontend.route_trace import migrate_span
from dpserve.protocol import EngineCoreOutputs, EngineCoreRequest, RankState, RequestType

logger = logging.getLogger(__name__)


class MoveClient(Protocol):
    """What the sender uses of the engine client (`AsyncEngineClient`)."""

    table: RankTable
    book: InFlightBook
    client_index: int
    closed: bool

    @property
    def current_wave(self) -> int: ...
    def put_output(self, outputs: EngineCoreOutputs) -> None: ...
    def mark_dead(self, reason: str) -> None: ...
    async def send(self, engine: EngineState, request_type: RequestType, body: Any) -> None: ...
    async def abort_now(self, rank: int, request_ids: list[str]) -> None: ...
    async def wake_if_paused(self, request: EngineCoreRequest, engine: EngineState) -> None: ...


class MoveSender:
    """Carries out one engine client's rank changes and moves (module docstring);
    `spawn` runs a coroutine as one of the client's tasks."""

    def __init__(self, client: MoveClient,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.client = client
        self.spawn = spawn

    def apply(self, change: StatusChange | None) -> None:
        """Carry out a rank's change: log it, die (policy stop) or move its requests."""
        if change is None:
            return
        client, status = self.client, change.status
        if not client.closed:
            logger.log(logging.INFO if status.state is RankState.SERVING else logging.WARNING,
                       "front-end %d: rank %d %s (incarnation %d)%s", client.client_index,
                       change.rank, status.state.value, status.incarnation,
                       f": {status.reason}" if status.reason else "")
        if change.fail_stop is not None:
            client.mark_dead(change.fail_stop)
        elif change.evacuate:
            self.spawn(self.evacuate(change))

    async def evacuate(self, change: StatusChange) -> None:
        """Plan the moves off a rank that stopped serving (at once, when the task runs:
        news that came with the change is in the table), then send them."""
        client = self.client
        plan = client.book.plan_evacuation(change.rank, change.why, change.abort_first,
                                           client.table, client.current_wave)
        if plan.abort:  # it may come back (or still runs): no duplicates
            await client.abort_now(plan.rank, plan.abort)
        for failure in plan.failures:
            client.put_output(ended(failure.rank, failure.request_id, failure.error))
        await self.send(plan, change.why)

    async def send(self, plan: Evacuation, why: str) -> None:
        client = self.client
        for move in plan.moves:
            if move.request.trace_headers is not None:
                move = migrate_span(move, why)  # a span (frontend/route_trace.py)
            flight = client.book.flights.get(move.request_id)
            target = client.table.engines.get(move.target)
            if flight is None or flight.rank != move.target or target is None:
                continue  # finished, or moved on again meanwhile
            logger.log(plan.log_level, "front-end %d: %s %s from %s to rank %d (%d tokens "
                       "so far)", client.client_index, "migrating" if move.num_tokens else
                       "re-sending", move.request_id, why, move.target, move.num_tokens)
            try:
                await client.send(target, RequestType.ADD, move.request)
                await client.wake_if_paused(move.request, target)
            except EngineUnavailableError:
                pass  # the target died in turn: its own evacuation moves the request on
