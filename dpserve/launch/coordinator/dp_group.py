"""Lockstep DP group generations, as the coordinator decides them.

Scope (inside the coordinator process, no sockets here): `DPGroup`, which
ranks form the engines' DP group, generation by generation; sent as
REGROUP_DP `SETTLE_GROUP_S` after the set of serving, heard ranks changes, and
`REFORM_DELAY_S` after an engine reports a failed collective of the current
generation with no such change yet (a change that comes during that wait, the
launcher's news of the death, cuts it to `SETTLE_GROUP_S`).

Not here: the store the group rendezvous at (`dpserve.engine.dp_store`, hosted
by `dpserve.launch.coordinator.proc`), the engines' side (`dpserve.engine.dp`).
"""

from __future__ import annotations

from dpserve.protocol import RankState, RankStatus, RegroupDP

# After a failed collective with no membership change yet, wait this long for the
# launcher's news (a dead rank) before forming the group again with the same ranks.
REFORM_DELAY_S = 1.0
SETTLE_GROUP_S = 0.25  # membership news within this long forms one generation


class DPGroup:
    """Lockstep: which ranks form the engines' DP group, generation by generation.

    Members are the ranks that serve (or drain) and have been heard (a heartbeat:
    loaded and in their busy loop): a dead, restarting or unhealthy rank is left
    out until it serves again. Invariant: generations only move
    forward, one per REGROUP_DP; a failure report of an older generation is
    dropped (that group is already gone).
    """

    def __init__(self) -> None:
        self.generation = 0  # 0: none formed yet
        self.members: list[int] = []
        self._due: float | None = None  # when to form the next generation

    @staticmethod
    def wanted(status: list[RankStatus], heard: list[bool]) -> list[int]:
        return [rank for rank, s in enumerate(status)
                if heard[rank] and s.state in (RankState.SERVING, RankState.DRAINING)]

    def on_failed(self, generation: int, now: float) -> None:
        """A member's collective of `generation` failed: form the group again soon."""
        if generation == self.generation and self.generation > 0:
            if self._due is None:
                self._due = now + REFORM_DELAY_S

    def next(self, status: list[RankStatus], heard: list[bool],
             now: float) -> RegroupDP | None:
        """The generation to announce now, if one is due."""
        members = self.wanted(status, heard)
        if members != self.members:  # the news a failure waits for: settle, not more
            settle = now + SETTLE_GROUP_S
            self._due = settle if self._due is None else min(self._due, settle)
        if self._due is None or now < self._due:
            return None
        self._due = None
        self.generation += 1
        self.members = members
        return RegroupDP(self.generation, members, len(status))

    @property
    def due(self) -> float | None:
        """When the next generation is to be formed (None: none is due)."""
        return self._due

    @property
    def leader(self) -> int:
        """The rank that speaks for the group (reports wave completion)."""
        return self.members[0] if self.members else 0
