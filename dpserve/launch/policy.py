"""The failure policy, once: what to do when a supervised process ends badly.

Scope: `FailureAction` (restart / isolate / stop), `RestartBudget` (at most
`--max-engine-restarts` restarts of one key within `RESTART_WINDOW_S`), and
`decide()`, which every supervisor calls: the launcher's `Supervisor` (engines,
the DP coordinator), a `--headless` host's engines, and the M > 1 API servers.
IO-free and pure but for the clock, which a test may pass in.

    --engine-failure-policy   can isolate (an engine)     cannot (coordinator, API server)
    stop                      STOP                        STOP
    isolate                   ISOLATE                     RESTART (while the budget lasts)
    restart                   RESTART (while the budget   RESTART (while the budget lasts)
                              lasts), then ISOLATE        then STOP

Not here: carrying the action out (`dpserve.launch.supervisor`,
`dpserve.launch.headless`, `dpserve.launch.api_server_watch`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Literal

RESTART_WINDOW_S = 600.0

FailurePolicy = Literal["restart", "isolate", "stop"]  # --engine-failure-policy


class FailureAction(enum.Enum):
    RESTART = "restart"  # start a new process in its place
    ISOLATE = "isolate"  # it stays down; the others serve on
    STOP = "stop"  # stop the whole server (exit 1)


@dataclasses.dataclass(frozen=True)
class Decision:
    action: FailureAction
    budget_spent: bool = False  # the restart budget, not the policy, ruled out a restart


class RestartBudget:
    """At most `max_restarts` restarts per key (a rank, an API server's index) within
    `window_s`; `clock` is `time.monotonic` unless a test passes its own."""

    def __init__(self, max_restarts: int, window_s: float = RESTART_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: dict[int, collections.deque[float]] = collections.defaultdict(
            collections.deque)  # key -> when it was restarted, within the window

    def left(self, key: int) -> bool:
        """Whether `key` may be restarted once more now."""
        return self.used(key) < self.max_restarts

    def used(self, key: int) -> int:
        """Restarts of `key` within the window."""
        now, times = self._clock(), self._times[key]
        while times and now - times[0] > self.window_s:
            times.popleft()
        return len(times)

    def take(self, key: int) -> bool:
        """Count one restart of `key` if the budget has one; whether it had."""
        if not self.left(key):
            return False
        self._times[key].append(self._clock())
        return True

    def forget(self, key: int) -> None:
        """A fresh record for `key` (a rank added again by scaling up)."""
        self._times.pop(key, None)


def decide(policy: str, budget: RestartBudget | None, key: int, *,
           can_isolate: bool) -> Decision:
    """What to do about `key`'s process that ended badly, under `policy` (see the
    module docstring's table). A RESTART takes one restart of `key` from `budget`
    (None: no limit). `can_isolate`: the others can serve on without it."""
    if policy == "stop":
        return Decision(FailureAction.STOP)
    if policy == "isolate" and can_isolate:
        return Decision(FailureAction.ISOLATE)
    if budget is None or budget.take(key):
        return Decision(FailureAction.RESTART)
    spent = FailureAction.ISOLATE if can_isolate else FailureAction.STOP
    return Decision(spent, budget_spent=True)
