"""Pause / sleep from a front-end: send a change to every rank, wait until reached.

Scope: `change_control(client, op, arg)` for the operator routes
(`dpserve.server.control`). With a DP coordinator the change goes to it (it
fans out to every engine, on every host, and keeps the state for late API
servers and restarted engines); the call returns once every serving rank
reports the new state reached (pause "wait": once their requests finished).
Without one (DP 1) it is a `control` utility call on each engine this
client has, answered once reached; the engine tells every API server.

Not here: the rules of the state (`dpserve.control`), the engine's side
(`dpserve.engine.control`), HTTP.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from dpserve.control import check_change
from dpserve.frontend.errors import EngineDeadError
from dpserve.protocol import ControlChange, ControlState, RankState


async def change_control(client: Any, op: str, arg: str | int | None = None,
                         timeout: float = 600.0) -> ControlState:
    """Apply one change on every rank; the state reached. ValueError for a bad
    change, TimeoutError when not reached in `timeout` s, EngineDeadError."""
    change = ControlChange(op, arg, secrets.randbits(62) + 1)
    check_change(change)
    if not getattr(client, "has_coordinator", False):
        results = await client.call_utility_all("control", op, arg, change.token,
                                                timeout=timeout, result_type=ControlState)
        return max(results.values(), key=lambda s: s.seq)
    await client.send_control(change)
    deadline = time.monotonic() + timeout
    while True:
        if client.dead:
            raise EngineDeadError(client.dead_reason)
        seq = client.control_tokens.get(change.token)
        if seq is not None and _reached(client, seq):
            return client.control
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{op} was not reached on every rank within {timeout:g} s")
        event = client.control_changed
        try:  # wake on news, and at least every second to look at the client
            await asyncio.wait_for(event.wait(), min(left, 1.0))
        except asyncio.TimeoutError:
            pass


def _reached(client: Any, seq: int) -> bool:
    """Every serving (or draining) rank has reached control state `seq` or a later one."""
    ranks = client.all_ranks or [e.status for e in client.engines.values()]
    done = client.control_done
    return all(rank < len(done) and done[rank] >= seq for rank, status in enumerate(ranks)
               if status.state in (RankState.SERVING, RankState.DRAINING))
