"""The coordinator's tenant desk: the one ledger every API server asks.

Scope: `TenantDesk`, a ROUTER bound at the tenant address (ipc, secured like
the coordinator's other sockets) over a `dpserve.tenancy.ledger.Ledger`. Each
API server's DEALER sends `TenantAdmit` (answered with a `TenantVerdict` at
once), `TenantStarted`, `TenantFinished` and, every second, `TenantSync`
(`dpserve.tenancy.messages`). Requests are keyed by (DEALER identity, request
id); a sync drops the entries of that identity it no longer lists, and
`expire` drops every entry of an identity not heard from for
`SESSION_TIMEOUT_S` (a dead or frozen API server; checked whenever a message
comes, which is when the figures are read), so a lost API server never
holds its tenants' limits.

A restarted coordinator starts with an empty ledger: limits are looser until
the requests in flight then have finished (documented in SECURITY.md).

Not here: the limits file (`dpserve.tenancy.limits`), the coordinator's loop
(`dpserve.launch.coordinator.proc`), the API server's side
(`dpserve.server.tenant_link`).
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from dpserve.security import secure
from dpserve.tenancy.ledger import Ledger
from dpserve.tenancy.limits import TenantLimits
from dpserve.tenancy.messages import (
    SESSION_TIMEOUT_S,
    RefusalInfo,
    TenantAdmit,
    TenantFinished,
    TenantMessage,
    TenantStarted,
    TenantSync,
    TenantVerdict,
)

logger = logging.getLogger("dpserve.launch.coordinator")


class TenantDesk:
    """The ROUTER and the ledger (module docstring); driven by the coordinator's loop."""

    def __init__(self, ctx: zmq.Context, address: str, limits: TenantLimits,
                 secret: str | None) -> None:
        self.ledger = Ledger(limits)
        self.socket = secure(ctx.socket(zmq.ROUTER), "server", secret)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._decoder = msgspec.msgpack.Decoder(TenantMessage)
        self._encoder = msgspec.msgpack.Encoder()
        self._heard: dict[bytes, float] = {}  # identity -> when last heard from

    def on_frames(self) -> None:
        """Every message waiting on the socket (non-blocking), after dropping what
        silent API servers held (`expire`)."""
        self.expire(time.monotonic())
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.error("tenant socket: dropping a message of %d frames", len(frames))
                continue
            try:
                message = self._decoder.decode(frames[1])
            except msgspec.DecodeError as e:
                logger.error("tenant socket: dropping an undecodable message: %s", e)
                continue
            self._on_message(frames[0], message, time.monotonic())

    def _on_message(self, identity: bytes, message: TenantMessage, now: float) -> None:
        self._heard[identity] = now
        if isinstance(message, TenantAdmit):
            key = (identity, message.request_id)
            refusal = None
            try:
                refusal = self.ledger.admit(key, message.tenant, message.prompt_tokens,
                                            message.max_tokens, now)
            except ValueError:  # a repeated admit of a live request: keep the first
                logger.warning("tenant ledger: request %r admitted twice", message.request_id)
            info = None if refusal is None else RefusalInfo(
                refusal.limit, refusal.value, refusal.remaining, refusal.cost,
                refusal.retry_after_s, refusal.reset_s)
            verdict = TenantVerdict(message.seq, info)
            self.socket.send_multipart([identity, self._encoder.encode(verdict)],
                                       zmq.NOBLOCK)
        elif isinstance(message, TenantStarted):
            self.ledger.started((identity, message.request_id))
        elif isinstance(message, TenantFinished):
            self.ledger.finished((identity, message.request_id), message.generated_tokens)
        elif isinstance(message, TenantSync):
            live = set(message.request_ids)
            self.ledger.drop(k for k in self.ledger.keys()
                             if k[0] == identity and k[1] not in live)

    def expire(self, now: float) -> None:
        """Drop the entries of API servers not heard from for SESSION_TIMEOUT_S."""
        gone = [i for i, heard in self._heard.items() if now - heard > SESSION_TIMEOUT_S]
        for identity in gone:
            del self._heard[identity]
            keys = [k for k in self.ledger.keys() if k[0] == identity]
            if keys:
                logger.warning("tenant ledger: an API server went silent; dropping its %d "
                               "request(s)", len(keys))
            self.ledger.drop(keys)
