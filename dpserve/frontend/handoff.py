"""The handoff: a first leg done on a prefill rank, its continuation to a decode rank.

Scope (the shell of prefill/decode disaggregation; the decisions are the
`RankTable`'s and the `InFlightBook`'s): `HandoffSender.hand_off(request_id)`,
run as a task by the engine client for each first leg its book saw finish
(`InFlightBook.take_pending`):

1. The continuation (the request with its first token as
   `prior_output_token_ids`, exactly a migration's) is placed by the table: a
   decode rank, by the router's policy (load, and with `cache-aware` what each
   rank holds itself or reaches through its host's KV tier); no decode rank
   serving: any serving rank (the prefill rank goes on colocated, from its own
   prefix cache). No rank at all: the request fails (its error says why).
2. Cross-host (the two ranks' hosts run different KV stores, by the store
   address each rank's heartbeats carry; two launchers on one machine count as
   two hosts): the decode host's store pulls the prompt's blocks from the
   prefill host's (`pull_prompt`, bounded by `PULL_TIMEOUT_S`); on any failure
   it goes on anyway: the decode rank recomputes what its host lacks (slower,
   never wrong).
3. The book moves the flight (`commit_handoff`: unless it was aborted or moved
   by an evacuation meanwhile) and it is sent like a migration (`MoveSender`).

The decode rank's scheduler loads the prompt's blocks from its host's tier (the
prefill rank's engine committed them before its first token left: `roles.
first_leg`) and computes only the tail.

Not here: roles and which requests qualify (`dpserve.frontend.roles`), the
pull itself (`dpserve.kv_tier.pull`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from dpserve.frontend.errors import EngineUnavailableError
from dpserve.frontend.migration import PENDING, Evacuation, InFlightBook, ended
from dpserve.frontend.moves import MoveSender
from dpserve.frontend.rank_table import EngineState, RankTable
from dpserve.frontend.routing import PrefixTracker, cache_root
from dpserve.kv_tier.pull import pull
from dpserve.protocol import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

PULL_TIMEOUT_S = 10.0  # the most a continuation waits for its blocks to cross hosts


class HandoffClient(Protocol):
    """What the sender uses of the engine client (`AsyncEngineClient`)."""

    table: RankTable
    book: InFlightBook
    client_index: int
    moves: MoveSender

    @property
    def current_wave(self) -> int: ...
    def put_output(self, outputs: EngineCoreOutputs) -> None: ...


class HandoffSender:
    """Sends the continuations of one engine client's first legs (module docstring)."""

    def __init__(self, client: HandoffClient, secret: str | None = None,
                 pull_timeout: float = PULL_TIMEOUT_S) -> None:
        self.client = client
        self.secret = secret  # the data-plane secret (CURVE to the stores' tcp endpoints)
        self.pull_timeout = pull_timeout

    async def hand_off(self, request_id: str) -> None:
        client = self.client
        book, table = client.book, client.table
        continuation = book.continuation(request_id, client.current_wave)
        if continuation is None:
            return  # aborted (a stop string in its first token) or moved meanwhile
        source = table.engines.get(book.flights[request_id].rank)
        target = self._place(request_id, continuation)
        if target is not None and source is not None and target is not source:
            block_size = table.router.tracker.block_size  # (same store: nothing to pull)
            pulled = await pull_prompt(source, target, continuation, block_size,
                                       self.secret, self.pull_timeout)
            book.pulled_blocks += pulled  # (not `+= await`: pulls run side by side)
            if not target.placeable:  # it stopped serving meanwhile: place it again
                target = self._place(request_id, continuation)
        move = target and book.commit_handoff(request_id, target, table, client.current_wave)
        if move:
            await client.moves.send(Evacuation(move.source, [], [move], [], logging.DEBUG),
                                    "a prefill rank (handoff)")

    def _place(self, request_id: str, continuation: EngineCoreRequest) -> EngineState | None:
        """The continuation's rank (`RankTable.choose`); None when no rank serves: the
        request then fails (its error says why)."""
        client = self.client
        flight = client.book.flights.get(request_id)
        if flight is None or flight.handoff != PENDING:
            return None  # ended or moved meanwhile (an abort, an evacuation)
        try:
            return client.table.choose(continuation)  # type: ignore[return-value]
        except EngineUnavailableError as e:
            client.book.pop(request_id)
            client.table.release(flight.rank)
            client.put_output(ended(flight.rank, request_id, f"request {request_id} failed: {e}"))
            return None


def prompt_hashes(request: EngineCoreRequest, block_size: int) -> list[bytes]:
    """The block hashes the decode rank looks up for `request` (prompt and prior tokens,
    the last token left out), as its prefix cache and the KV tier name them."""
    tokens: Sequence[int] = [*request.prompt_token_ids, *(request.prior_output_token_ids or [])]
    return PrefixTracker(block_size).hashes(tokens, cache_root(request))


async def pull_prompt(source: EngineState, target: EngineState, request: EngineCoreRequest,
                      block_size: int, secret: str | None, timeout: float) -> int:
    """Have the target's host store pull the request's blocks from the source's; how
    many it holds now (leading). 0 when both use one store (one host), when a store's
    address is not known yet (`EngineInfo.kv_store_address`, from heartbeats), or on
    any failure (`dpserve.kv_tier.pull` logs why): the decode rank then computes what
    its host lacks."""
    src, dst = source.info.kv_store_address, target.info.kv_store_address
    if not src or not dst or src == dst:
        return 0
    try:
        return await pull(dst, src, prompt_hashes(request, block_size), secret=secret,
                          timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a failed pull costs a recompute, never the request
        logger.warning("KV pull of %s from rank %d's host to rank %d's failed: %s",
                       request.request_id, source.rank, target.rank, e)
        return 0
