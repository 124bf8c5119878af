"""An API server's link to the tenant ledger the DP coordinator holds.

Scope: `LedgerLink`, a DEALER (fresh random identity per process: its session)
to the coordinator's tenant ROUTER, secured like the other data-plane sockets.
`admit` sends `TenantAdmit` and waits for its `TenantVerdict` at most
`ADMIT_TIMEOUT_S`; `started` / `finished` are sent without waiting; a task sends
`TenantSync` (the ids this API server has admitted or is admitting) every
`SYNC_INTERVAL_S`, so the coordinator forgets what a lost message or a lost API
server left behind (`dpserve.tenancy.messages`).

When the coordinator does not answer in time (dead, restarting, frozen), the
request is refused with a 503 (`Retry-After: 1`, code `tenant_ledger_unavailable`):
limits are not skipped while their keeper is away (fail closed; SECURITY.md).

Not here: the ledger (`dpserve.tenancy.ledger`), the coordinator's side
(`dpserve.launch.coordinator.tenants`), the 429 (`dpserve.server.tenants`).
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec
import zmq
import zmq.asyncio

from dpserve.security import secure
from dpserve.server.errors import APIError
from dpserve.tenancy.ledger import Refusal
from dpserve.tenancy.messages import (
    SYNC_INTERVAL_S,
    TenantAdmit,
    TenantFinished,
    TenantStarted,
    TenantSync,
    TenantVerdict,
)

logger = logging.getLogger(__name__)

ADMIT_TIMEOUT_S = 3.0  # the longest a request waits for the coordinator's verdict


class LedgerLink:
    """The DEALER to the coordinator's tenant ledger (module docstring); used from one
    event loop (the API server's)."""

    def __init__(self, address: str, secret: str | None) -> None:
        self._ctx = zmq.asyncio.Context()
        self._socket = secure(self._ctx.socket(zmq.DEALER), "client", secret)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IDENTITY, os.urandom(16))
        self._socket.connect(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._pending: dict[int, tuple[str, asyncio.Future[TenantVerdict]]] = {}
        self._live: set[str] = set()  # admitted, not finished
        self._tasks: list[asyncio.Task[None]] = []

    async def admit(self, request_id: str, tenant: str, prompt_tokens: int,
                    max_tokens: int) -> Refusal | None:
        self._start_tasks()
        self._seq += 1
        seq = self._seq
        future: asyncio.Future[TenantVerdict] = asyncio.get_running_loop().create_future()
        self._pending[seq] = (request_id, future)
        try:
            self._send(TenantAdmit(seq, request_id, tenant, prompt_tokens, max_tokens))
            verdict = await asyncio.wait_for(future, ADMIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("the tenant ledger (DP coordinator) did not answer in %.0f s",
                           ADMIT_TIMEOUT_S)
            raise APIError(503, f"The tenant ledger (the DP coordinator, which holds the "
                           f"--tenant-limits usage) did not answer in {ADMIT_TIMEOUT_S:g} s; "
                           f"retry later.", type="server_error",
                           code="tenant_ledger_unavailable",
                           headers={"Retry-After": "1"}) from None
        finally:
            self._pending.pop(seq, None)
        if verdict.refusal is None:
            self._live.add(request_id)
            return None
        r = verdict.refusal
        return Refusal(r.limit, r.value, r.remaining, r.cost, r.retry_after_s, r.reset_s)

    def started(self, request_id: str) -> None:
        if request_id in self._live:
            self._send(TenantStarted(request_id))

    def finished(self, request_id: str, generated_tokens: int) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self._send(TenantFinished(request_id, generated_tokens))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._ctx.destroy(linger=0)

    # ---- inside --------------------------------------------------------------------

    def _send(self, message: object) -> None:
        """Send without waiting; a full queue (the coordinator away) drops it: the next
        sync or the coordinator's session expiry makes up for it."""
        # (zmq.asyncio answers a non-blocking send with a future that is already done)
        sent = self._socket.send(self._encoder.encode(message), zmq.NOBLOCK)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception() is None or logger.debug(
            "tenant ledger: %s dropped: %s", type(message).__name__, f.exception()))

    def _start_tasks(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._read(), name="dpserve-tenant-read"),
                           asyncio.create_task(self._sync(), name="dpserve-tenant-sync")]

    async def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(TenantVerdict)
        while True:
            body = await self._socket.recv()
            try:
                verdict = decoder.decode(body)
            except msgspec.DecodeError as e:
                logger.error("tenant ledger: undecodable verdict dropped: %s", e)
                continue
            _, future = self._pending.get(verdict.seq, (None, None))
            if future is not None and not future.done():
                future.set_result(verdict)

    async def _sync(self) -> None:
        while True:
            ids = [*self._live, *(rid for rid, _ in self._pending.values())]
            self._send(TenantSync(ids))
            await asyncio.sleep(SYNC_INTERVAL_S)


