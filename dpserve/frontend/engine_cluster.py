"""EngineClientCluster: the `ClusterView` of a socket engine client (`AsyncEngineClient.cluster`).

Scope: what the HTTP server may know of and do to the engines behind one
`AsyncEngineClient`, read from its parts: rank views from its `RankTable`,
moved counts from its `InFlightBook`, wave / control / autoscale news from its
`CoordinatorNews`; pause / sleep (`dpserve.frontend.control.change_control`),
per-rank controls and scale requests through its coordinator link; utility
calls through the client itself.

Not here: the request path and the sockets (`dpserve.frontend.engine_client`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from dpserve.frontend.cluster import DEFAULT_CONTROL_TIMEOUT_S
from dpserve.frontend.control import ControlView, change_control
from dpserve.frontend.coordinator_link import CoordinatorLink, CoordinatorNews
from dpserve.frontend.errors import EngineUnavailableError
from dpserve.frontend.migration import HandoffCounts, InFlightBook, MovedCounts
from dpserve.frontend.rank_table import RankTable, RankView
from dpserve.protocol import (
    ControlChange,
    ControlState,
    LoRAChange,
    RankControl,
    RankStatus,
    ScaleStatus,
)

LORA_CHANGE_TIMEOUT_S = 10.0  # the coordinator's update comes within this
_POLL_S = 0.01


class ClientParts(Protocol):
    """What the view reads and calls of the socket client (`AsyncEngineClient`)."""

    table: RankTable
    book: InFlightBook
    news: CoordinatorNews
    dead: bool
    dead_reason: str | None

    @property
    def has_coordinator(self) -> bool: ...
    def check_alive(self) -> None: ...
    def coordinator(self) -> CoordinatorLink: ...
    def new_id(self) -> str: ...
    def request_state_sizes(self) -> dict[str, int]: ...
    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0, result_type: Any = None) -> Any: ...
    async def call_utility_all(self, method: str, *args: Any, timeout: float = 30.0,
                               result_type: Any = None) -> dict[int, Any]: ...


class EngineClientCluster:
    """`ClusterView` over one `AsyncEngineClient` (module docstring)."""

    def __init__(self, client: ClientParts) -> None:
        self._client = client

    @property
    def dead(self) -> bool:
        return self._client.dead

    @property
    def dead_reason(self) -> str | None:
        return self._client.dead_reason

    @property
    def current_wave(self) -> int:
        return self._client.news.wave

    @property
    def autoscale_decisions(self) -> list[int] | None:
        return self._client.news.autoscale_decisions

    @property
    def data_parallel_size(self) -> int:
        return len(self._client.table.engines)

    @property
    def has_coordinator(self) -> bool:
        return self._client.has_coordinator

    @property
    def elastic(self) -> bool:
        return self._client.table.elastic

    @property
    def control(self) -> ControlState:
        return self._client.news.controls.state

    @property
    def moved(self) -> MovedCounts:
        return self._client.book.moved

    @property
    def handoffs(self) -> HandoffCounts:
        return self._client.book.handoffs

    def take_handoff_latencies(self) -> list[float]:
        latencies = self._client.book.latencies
        taken = list(latencies)
        latencies.clear()
        return taken

    def ranks(self) -> list[RankView]:
        table, book = self._client.table, self._client.book
        return [dataclasses.replace(table.view(table.engines[r]), handoffs=book.handoffs_at(r))
                for r in table.ranks]

    def queued(self) -> list[tuple[int, int]]:
        """(requests, prompt tokens) waiting at each serving rank, for admission control:
        the coordinator's figures plus what this client sent since; without a
        coordinator, its own requests in flight there (running ones too) and the
        prompt tokens of those with no token yet."""
        table, book = self._client.table, self._client.book
        serving = [e for e in table.engines.values() if e.serving]
        if table.balanced:
            return [(e.waiting + e.sent_since_publish, e.waiting_tokens + e.tokens_since_publish)
                    for e in serving]
        return [(len(flights), sum(len(f.request.prompt_token_ids) for f in flights
                                   if not f.generated))
                for flights in (book.at(e.rank) for e in serving)]

    def session_rank(self, key: str) -> int | None:
        return self._client.table.router.session_rank(key)

    def request_state_sizes(self) -> dict[str, int]:
        return self._client.request_state_sizes()

    async def change_control(self, op: str, arg: str | int | None = None,
                             timeout: float = DEFAULT_CONTROL_TIMEOUT_S) -> ControlState:
        """Pause / sleep on every rank (`dpserve.frontend.control.change_control`)."""
        return await change_control(self, op, arg, timeout=timeout)

    async def send_control(self, change: ControlChange) -> None:
        """Send a pause / sleep change to the coordinator (dpserve.frontend.control)."""
        self._client.check_alive()
        await self._client.coordinator().send(change)

    async def control_rank(self, rank: int, action: str) -> None:
        """Send an operator's "cordon" / "uncordon" / "restart" of `rank` to the DP
        coordinator (every front-end learns the outcome from its updates). ValueError
        without a coordinator or for a rank this client does not have."""
        if not self.has_coordinator:
            raise ValueError("per-rank controls go through the DP coordinator, and this "
                             "server has none (--data-parallel-size 1)")
        ranks = self._client.table.ranks
        if rank not in ranks:
            raise ValueError(f"rank must be one of this server's ranks {ranks}, got {rank}")
        await self._client.coordinator().send(RankControl(rank, action))

    async def request_scale(self, num_engines: int, timeout: float) -> ScaleStatus:
        """Ask the coordinator to change the engine count; its final answer (DONE,
        FAILED or REJECTED). TimeoutError after `timeout` s."""
        client = self._client
        client.check_alive()
        if not self.elastic:
            raise EngineUnavailableError("this server cannot change its engine count")
        return await client.coordinator().request_scale(
            client.news, client.new_id(), num_engines, timeout)

    @property
    def loras(self) -> dict[str, str] | None:
        """The LoRA adapter registry, name -> path, as last heard (None: LoRA off)."""
        return self._client.news.loras

    async def change_lora(self, change: LoRAChange, timeout: float = LORA_CHANGE_TIMEOUT_S
                          ) -> None:
        """Record a LoRA registry change: through the coordinator (every front-end hears
        it; returns once this one has), else in this client's own copy. TimeoutError."""
        client = self._client
        client.check_alive()
        news = client.news
        if not self.has_coordinator:
            assert news.loras is not None
            if change.op == "add":
                news.loras[change.name] = change.path
            else:
                news.loras.pop(change.name, None)
            return
        await client.coordinator().send(change)
        deadline = asyncio.get_running_loop().time() + timeout
        while (news.loras or {}).get(change.name) != (change.path if change.op == "add"
                                                      else None):
            client.check_alive()
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the DP coordinator did not confirm the LoRA {change.op} "
                                   f"of {change.name!r} within {timeout:g} s")
            await asyncio.sleep(_POLL_S)

    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0, result_type: Any = None) -> Any:
        return await self._client.call_utility(method, *args, engine=engine, timeout=timeout,
                                               result_type=result_type)

    async def call_utility_all(self, method: str, *args: Any, timeout: float = 30.0,
                               result_type: Any = None) -> dict[int, Any]:
        return await self._client.call_utility_all(method, *args, timeout=timeout,
                                                   result_type=result_type)

    # what `change_control` reads besides (dpserve.frontend.control.ControlTarget)

    @property
    def controls(self) -> ControlView:
        return self._client.news.controls

    def rank_statuses(self) -> list[RankStatus]:
        """Every rank's state: the coordinator's list, else this client's table."""
        client = self._client
        return client.news.all_ranks or [e.status for e in client.table.engines.values()]
