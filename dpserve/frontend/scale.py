"""ScaleRequests: a front-end's requests to change the engine count, until answered.

Scope: the front-end client's side of run-time scaling: each scale request
sent to the DP coordinator waits for its final answer (DONE, FAILED or
REJECTED) in the coordinator's updates; `AsyncEngineClient.request_scale`
holds one.

Not here: the HTTP route (`dpserve.server.ops.scale`), the coordinator's rules
and carrying the change out (`dpserve.launch`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from dpserve.protocol import ScalePhase, ScaleRequest, ScaleStatus


class ScaleRequests:
    """A front-end's scale requests to the coordinator, each waiting for its final
    answer (DONE, FAILED or REJECTED) in the coordinator's updates."""

    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future] = {}  # scale_id -> its final ScaleStatus

    async def ask(self, send: Callable[[ScaleRequest], Awaitable[Any]], scale_id: str,
                  num_engines: int, timeout: float) -> ScaleStatus:
        """Send ScaleRequest(scale_id, num_engines) with `send`; its final status.
        TimeoutError after `timeout` s."""
        future = self._futures[scale_id] = asyncio.get_running_loop().create_future()
        try:
            await send(ScaleRequest(scale_id, num_engines))
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the change to {num_engines} engines did not finish within "
                               f"{timeout:.0f} s") from None
        finally:
            self._futures.pop(scale_id, None)

    def on_status(self, scale: ScaleStatus | None) -> None:
        """A coordinator update's scale news: a final one answers its request."""
        if scale is not None and scale.phase is not ScalePhase.PENDING:
            future = self._futures.get(scale.scale_id)
            if future is not None and not future.done():
                future.set_result(scale)
