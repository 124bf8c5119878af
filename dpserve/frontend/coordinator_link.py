"""A front-end's link to the DP coordinator: what it last said, and what we send it.

Scope: `CoordinatorNews`, the coordinator's latest word as one front-end
keeps it (the request wave and whether the engines run, pause / sleep state
and the seq each rank reached, every rank's state, autoscale decisions, the
answers to our scale requests, the LoRA adapter registry); it exists without
a coordinator too (the engines' own control state, this front-end's registry).
`CoordinatorLink`, the XSUB socket to the coordinator's front publish
address: decoded updates in (`updates()`), and out `WakeEngines` (lockstep),
pause / sleep changes, an operator's per-rank controls, scale requests and LoRA
registry changes; with several API servers and `cache-aware`, `_send_facts`
sends this router's placements (`PrefixFacts`, at most every
`SHARE_INTERVAL_S`, never waiting: dropped when the socket is full). The rank
table's share of an update (rank set, states, loads, figures) is
`RankTable.apply_update`'s.

Not here: the engine sockets and what a rank's news asks of the client
(`dpserve.frontend.engine_client`), the coordinator itself (`dpserve.launch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dpserve.frontend.control import ControlView
from dpserve.frontend.prefix_record import SHARE_INTERVAL_S, PrefixOutbox
from dpserve.frontend.routing import Router
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
    """The XSUB socket to the DP coordinator's front publish address. `sharing`: this
    API server's router, one of several (cache-aware): while `updates()` runs, what
    it places goes to the coordinator (its `outbox`, set here; `_send_facts`)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, secret: str | None,
                 sharing: Router | None = None) -> None:
        self._socket = secure(ctx.socket(zmq.XSUB), "client", secret)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._pending = asyncio.Event()  # the outbox got facts
        self._sharing = sharing if sharing is not None and sharing.policy == "cache-aware" \
            else None
        if self._sharing is not None:
            self._sharing.outbox = PrefixOutbox(on_pending=self._pending.set)

    async def send(self, message: Any) -> None:
        """One message to the coordinator (WakeEngines, ControlChange, RankControl, ...)."""
        await self._socket.send(self._encoder.encode(message))

    def send_nowait(self, message: Any) -> bool:
        """One message if the socket takes it at once (False: dropped, the queue to the
        coordinator is full)."""
        sent = self._socket.send(self._encoder.encode(message), zmq.NOBLOCK)
        if not sent.done():  # behind another send: it goes when that one has gone
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())
            return True
        error = sent.exception()
        if isinstance(error, zmq.Again):
            return False
        if error is not None:
            raise error
        return True

    async def request_scale(self, news: CoordinatorNews, scale_id: str, num_engines: int,
                            timeout: float) -> ScaleStatus:
        """Ask for `num_engines` engines; the final answer (from `news`). TimeoutError."""
        return await news.scales.ask(self.send, scale_id, num_engines, timeout)

    async def updates(self) -> AsyncIterator[CoordinatorUpdate]:
        """Subscribe, then every decodable update (undecodable ones are logged, dropped)."""
        await self._socket.send(b"\x01")  # XSUB: subscribe to everything
        decoder = msgspec.msgpack.Decoder(CoordinatorUpdate)
        sharing = self._sharing
        sender = None if sharing is None or sharing.outbox is None else asyncio.create_task(
            _send_facts(self, sharing.outbox, sharing.client_index, self._pending))
        try:
            while True:
                body = await self._socket.recv()
                try:
                    update = decoder.decode(body)
                except msgspec.DecodeError as e:
                    logger.error("undecodable message from the DP coordinator dropped: %s", e)
                    continue
                yield update
        finally:
            if sender is not None:
                sender.cancel()


async def _send_facts(link: CoordinatorLink, outbox: PrefixOutbox, client_index: int,
                      pending: asyncio.Event) -> None:
    """Until cancelled: when `pending` is set (the outbox got facts), send them all as
    one `PrefixFacts`, then wait `SHARE_INTERVAL_S` (what comes meanwhile goes in the
    next one). A send the socket cannot take at once is dropped (counted)."""
    dropped = 0
    while True:
        await pending.wait()
        pending.clear()
        facts = outbox.take(client_index)
        try:
            sent = facts is None or link.send_nowait(facts)
        except zmq.ZMQError as e:  # the socket is closing (shutdown): nothing more to share
            logger.debug("front-end %d: prefix sharing stops: %s", client_index, e)
            return
        if not sent:
            dropped += 1
            if dropped in (1, 10, 100) or dropped % 1000 == 0:
                logger.warning("front-end %d: %d prefix-sharing message(s) dropped (the "
                               "DP coordinator is not keeping up)", client_index, dropped)
        await asyncio.sleep(SHARE_INTERVAL_S)
