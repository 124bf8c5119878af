"""ClusterView: what the HTTP server may know of and do to the engines behind `AsyncLLM`.

Scope: the one typed surface `dpserve.server` uses of the engine side
(`AsyncLLM.cluster`): the ranks and their states, the data-parallel size,
pause / sleep and its state, scale requests, moved-request and handoff counts, utility
calls (one rank, or every live one), per-rank operator controls, where a
session last went, the LoRA adapter registry (`dpserve.frontend.lora`), the
queues admission control reads, and death. Both engine clients provide it as
`client.cluster`: the socket client's is `EngineClientCluster`
(`dpserve.frontend.engine_cluster`, over its rank table, in-flight book and
coordinator link); the in-process one (`dpserve.testing.inproc_client.
InprocEngineClient`: one engine, rank 0 serving, no coordinator) is its own.

Not here: sending requests and reading outputs (`AsyncLLM`'s `EngineClient`).
"""

from __future__ import annotations

from typing import Any, Protocol

from dpserve.frontend.migration import HandoffCounts, MovedCounts
from dpserve.frontend.rank_table import RankView
from dpserve.protocol import ControlState, LoRAChange, ScaleStatus

DEFAULT_CONTROL_TIMEOUT_S = 600.0


class ClusterView(Protocol):
    """The engines as one front-end sees them (module docstring)."""

    dead: bool  # the engines are gone: every request fails
    dead_reason: str | None
    current_wave: int  # the DP request wave, as last heard (0 without a coordinator)
    autoscale_decisions: list[int] | None  # [up, down] the autoscaler made (None: none)

    @property
    def data_parallel_size(self) -> int:
        """The number of DP engines now (it changes when the server scales)."""

    @property
    def has_coordinator(self) -> bool:
        """A DP coordinator feeds this client (per-rank controls, shared figures)."""

    @property
    def elastic(self) -> bool:
        """The engine count may change at run time (`request_scale`)."""

    @property
    def control(self) -> ControlState:
        """The pause / sleep state as last heard."""

    @property
    def moved(self) -> MovedCounts:
        """Requests this front-end re-sent or migrated, and the tokens recomputed."""

    @property
    def handoffs(self) -> HandoffCounts:
        """Prefill -> decode handoffs of this front-end (`--data-parallel-roles`)."""

    def take_handoff_latencies(self) -> list[float]:
        """Seconds from each handoff's first token to its decode rank's first output,
        since the last call (the /metrics histogram takes them)."""

    def ranks(self) -> list[RankView]:
        """Every rank this front-end sends to, in rank order."""

    def queued(self) -> list[tuple[int, int]]:
        """(requests, prompt tokens) waiting at each serving rank, for admission
        control (without a coordinator: what this front-end has in flight there)."""

    def session_rank(self, key: str) -> int | None:
        """The rank this front-end last sent session `key` to (None: not known here;
        `dpserve.frontend.routing`)."""

    def request_state_sizes(self) -> dict[str, int]:
        """Entries of the client's per-request structures (leak checks)."""

    async def change_control(self, op: str, arg: str | int | None = None,
                             timeout: float = DEFAULT_CONTROL_TIMEOUT_S) -> ControlState:
        """Pause / resume / sleep / wake_up / reset_prefix_cache on every rank; the
        state reached. ValueError (bad change, not supported), TimeoutError."""

    async def request_scale(self, num_engines: int, timeout: float) -> ScaleStatus:
        """Change the engine count; the final answer. EngineUnavailableError when
        this server cannot, TimeoutError after `timeout` s."""

    async def control_rank(self, rank: int, action: str) -> None:
        """An operator's "cordon" / "uncordon" / "restart" of `rank`; ValueError
        without a coordinator or for a rank this server does not have."""

    @property
    def loras(self) -> dict[str, str] | None:
        """The LoRA adapter registry, name -> path (None: LoRA off)."""

    async def change_lora(self, change: LoRAChange) -> None:
        """Record a registry change on every front-end (`dpserve.frontend.lora`)."""

    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0, result_type: Any = None) -> Any:
        """Utility `method` (`EngineCore.call_utility`) in rank `engine` (None: any live one)."""

    async def call_utility_all(self, method: str, *args: Any, timeout: float = 30.0,
                               result_type: Any = None) -> dict[int, Any]:
        """`call_utility` on every live rank at once: rank -> its result."""
