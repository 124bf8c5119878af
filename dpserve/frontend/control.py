"""Pause / sleep from a front-end: send a change to every rank, wait until reached.

Scope: `change_control(client, op, arg)` for the operator routes
(`dpserve.server.ops.control`). With a DP coordinator the change goes to it (it
fans out to every engine, on every host, and keeps the state for late API
servers and restarted engines); the call returns once every serving rank
reports the new state reached (pause "wait": once their requests finished).
Without one (DP 1) it is a `control` utility call on each engine this
client has, answered once reached; the engine tells every API server.

Also the front-end client's side of operator state (`ControlView`: the
pause / sleep state as last heard, the seq each rank reached), kept in the
client's `CoordinatorNews` (`dpserve.frontend.coordinator_link`).

Not here: the rules of the state (`dpserve.control`), the engine's side
(`dpserve.engine.control`), run-time scaling (`dpserve.frontend.scale`), HTTP.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Protocol

from dpserve.control import check_change
from dpserve.frontend.errors import EngineDeadError
from dpserve.protocol import ControlChange, ControlState, RankState, RankStatus


class ControlView:
    """A front-end's news of the pause / sleep state (the coordinator's, or the
    engines' without one): `state`, `done` (the seq each rank reached), `tokens`
    (a change's token -> its seq, the last 256), `changed` (set, then replaced by
    a new event, on every news). One event loop's thread."""

    def __init__(self) -> None:
        self.state = ControlState()
        self.done: list[int] = []
        self.tokens: dict[int, int] = {}
        self.changed = asyncio.Event()

    def update(self, state: ControlState, done: list[int] | None = None) -> None:
        if state.seq >= self.state.seq or state.token not in self.tokens:
            self.state = state  # (a restarted coordinator counts from 1 again)
        self.tokens[state.token] = state.seq
        if len(self.tokens) > 256:
            self.tokens.pop(next(iter(self.tokens)))
        if done is not None:
            self.done = done
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class ControlTarget(Protocol):
    """What `change_control` needs of the engines (`EngineClientCluster` has it)."""

    dead: bool
    dead_reason: str | None

    @property
    def has_coordinator(self) -> bool: ...
    @property
    def controls(self) -> ControlView: ...
    def rank_statuses(self) -> list[RankStatus]: ...
    async def send_control(self, change: ControlChange) -> None: ...
    async def call_utility_all(self, method: str, *args: Any, timeout: float = 30.0,
                               result_type: Any = None) -> dict[int, Any]: ...


async def change_control(client: ControlTarget, op: str, arg: str | int | None = None,
                         timeout: float = 600.0) -> ControlState:
    """Apply one change on every rank; the state reached. ValueError for a bad
    change, TimeoutError when not reached in `timeout` s, EngineDeadError."""
    change = ControlChange(op, arg, secrets.randbits(62) + 1)
    check_change(change)
    if not client.has_coordinator:
        results = await client.call_utility_all("control", op, arg, change.token,
                                                timeout=timeout, result_type=ControlState)
        return max(results.values(), key=lambda s: s.seq)
    await client.send_control(change)
    deadline = time.monotonic() + timeout
    while True:
        if client.dead:
            raise EngineDeadError(client.dead_reason)
        seq = client.controls.tokens.get(change.token)
        if seq is not None and _reached(client, seq):
            return client.controls.state
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{op} was not reached on every rank within {timeout:g} s")
        event = client.controls.changed
        try:  # wake on news, and at least every second to look at the client
            await asyncio.wait_for(event.wait(), min(left, 1.0))
        except asyncio.TimeoutError:
            pass


def _reached(client: ControlTarget, seq: int) -> bool:
    """Every serving (or draining) rank has reached control state `seq` or a later one."""
    ranks = client.rank_statuses()
    done = client.controls.done
    return all(rank < len(done) and done[rank] >= seq for rank, status in enumerate(ranks)
               if status.state in (RankState.SERVING, RankState.DRAINING))
