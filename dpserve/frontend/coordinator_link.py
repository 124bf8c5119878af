"""A front-end's link to the DP coordinator: what it last said, and what we send it.

Scope: `CoordinatorNews`, the coordinator's latest word as one front-end
keeps it (the request wave and whether the engines run, pause / sleep state
and the seq each rank reached, every rank's state, autoscale decisions, the
answers to our scale requests, the LoRA adapter registry); it exists without
a coordinator too (the engines' own control state, this front-end's registry).
`CoordinatorLink`, the XSUB socket to the coordinator's front publish
address: decoded updates in (`updates()`), and out `WakeEngines` (lockstep),
pause / sleep changes, an operator's per-rank controls, scale requests and LoRA
registry changes. The rank table's share of an update (rank set, states, loads,
figures) is `RankTable.apply_update`'s.

Not here: the engine sockets and what a rank's news asks of the client
(`dpserve.frontend.engine_client`), the coordinator itself (`dpserve.launch`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dpserve.frontend.control import ControlView
from dpserve.frontend.scale import ScaleRequests
from dpserve.protocol import CoordinatorUpdate, RankStatus, ScaleStatus
from dpserve.security import secure

logger = logging.getLogger(__name__)


@dataclass
class CoordinatorNews:
    """The coordinator's latest word, as one front-end keeps it (one event loop)."""

    wave: int = 0  # the current request wave
    running: bool = False  # the engines run a wave (or we woke them ourselves)
    controls: ControlView = field(default_factory=ControlView)  # pause / sleep as heard
    all_ranks: list[RankStatus] = field(default_factory=list)  # every rank's state
    autoscale_decisions: list[int] | None = None  # [up, down] the autoscaler made
    info_updates: int = 0  # updates with per-rank figures, so far
    scales: ScaleRequests = field(default_factory=ScaleRequests)  # ours, until answered
    # The LoRA adapter registry, name -> path (None: LoRA off): the coordinator's, else
    # this front-end's own (dpserve.frontend.lora).
    loras: dict[str, str] | None = None

    def note(self, update: CoordinatorUpdate) -> None:
        """Keep this update's wave, control, scale and rank-list news."""
        self.wave, self.running = update.wave, update.running
        if update.autoscale_decisions is not None:
            self.autoscale_decisions = update.autoscale_decisions
        self.scales.on_status(update.scale)
        if update.ranks is not None:
            self.all_ranks = list(update.ranks)
        if update.control is not None:
            self.controls.update(update.control, update.control_done)
        if update.engines is not None:
            self.info_updates += 1
        if update.loras is not None:
            self.loras = dict(update.loras)


class CoordinatorLink:
    """The XSUB socket to the DP coordinator's front publish address."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, secret: str | None) -> None:
        self._socket = secure(ctx.socket(zmq.XSUB), "client", secret)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._encoder = msgspec.msgpack.Encoder()

    async def send(self, message: Any) -> None:
        """One message to the coordinator (WakeEngines, ControlChange, RankControl, ...)."""
        await self._socket.send(self._encoder.encode(message))

    async def request_scale(self, news: CoordinatorNews, scale_id: str, num_engines: int,
                            timeout: float) -> ScaleStatus:
        """Ask for `num_engines` engines; the final answer (from `news`). TimeoutError."""
        return await news.scales.ask(self.send, scale_id, num_engines, timeout)

    async def updates(self) -> AsyncIterator[CoordinatorUpdate]:
        """Subscribe, then every decodable update (undecodable ones are logged, dropped)."""
        await self._socket.send(b"\x01")  # XSUB: subscribe to everything
        decoder = msgspec.msgpack.Decoder(CoordinatorUpdate)
        while True:
            body = await self._socket.recv()
            try:
                update = decoder.decode(body)
            except msgspec.DecodeError as e:
                logger.error("undecodable message from the DP coordinator dropped: %s", e)
                continue
            yield update
