"""Engine choice: which serving rank gets a request (`--load-balance`).

Scope: the placement policy of one front-end (`Router.choose(live, request,
balanced)`), over the engines `AsyncEngineClient` says may take new work
(serving, not cordoned, not excluded). Pinned requests (`data_parallel_rank`),
rank states and moving requests are the client's.

A rank's load (`Router.load`): with a DP coordinator (`balanced`), its
`4*waiting + running` from the coordinator's last publish, where what this
client sent it since that publish counts as waiting (so bursts spread);
without one, the requests this client has in flight there.

Policies (`LOAD_BALANCE_POLICIES`):

* `least-loaded` (default): the lowest load; with a coordinator, scanning from
  this client's own index (ties go to the first) so several API servers start
  on different ranks; without one, ties go to the lowest rank.
* `round-robin`: live ranks in turn from this client's own index, blind to load
  (a baseline for benchmarks, and what simple balancers do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dpserve.protocol import EngineCoreRequest

LOAD_BALANCE_POLICIES = ("least-loaded", "round-robin")


class RankLoad(Protocol):
    """What the router reads of an engine (`engine_client.EngineState` has it)."""

    rank: int
    num_requests: int  # requests this client has in flight there
    waiting: int  # from the coordinator's last publish
    running: int
    sent_since_publish: int  # requests this client sent it since that publish


class Router:
    """One front-end's engine choice (module docstring). `policy` is one of
    LOAD_BALANCE_POLICIES."""

    def __init__(self, policy: str = "least-loaded", *, client_index: int = 0) -> None:
        if policy not in LOAD_BALANCE_POLICIES:
            raise ValueError(f"load_balance must be one of {', '.join(LOAD_BALANCE_POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.client_index = client_index
        self._turn = client_index  # round-robin position

    @staticmethod
    def load(engine: RankLoad, balanced: bool) -> int:
        """The rank's load (module docstring)."""
        if balanced:
            return 4 * (engine.waiting + engine.sent_since_publish) + engine.running
        return engine.num_requests

    def choose(self, live: Sequence[RankLoad], request: EngineCoreRequest, *,
               balanced: bool) -> RankLoad:
        """The rank among `live` (non-empty) that gets `request`."""
        if self.policy == "round-robin":
            self._turn += 1
            return live[(self._turn - 1) % len(live)]
        return self._least_loaded(live, balanced)

    def _least_loaded(self, live: Sequence[RankLoad], balanced: bool) -> RankLoad:
        if not balanced:
            return min(live, key=lambda e: (e.num_requests, e.rank))
        start = self.client_index % len(live)
        best, best_load = live[start], None
        for engine in [*live[start:], *live[:start]]:
            load = self.load(engine, balanced)
            if best_load is None or load < best_load:
                best, best_load = engine, load
        return best
