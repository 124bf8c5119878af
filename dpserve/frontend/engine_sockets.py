"""The engine-facing sockets of one front-end, and its utility calls in flight.

Scope: `EngineSockets`, the ROUTER this front-end BINDS for requests (engines
connect and register with an empty frame; a restarted engine takes over its
identity) and the PULL it binds for outputs, as plain sends and async
iterators of what comes in (`registrations()`, `outputs()`); `wait_for(...)`
waits (bounded) until a rank has registered. `UtilityCalls`, the utility calls
this front-end has in flight, as futures keyed by call id.

Not here: what a registration or an output means for the ranks and the
requests (`dpserve.frontend.engine_client`, its `RankTable` and `InFlightBook`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dpserve.frontend.errors import EngineDeadError
from dpserve.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    RequestType,
    UtilityCall,
    UtilityOutput,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

Addresses = str | Sequence[str]


class UtilityCallError(RuntimeError):
    """A utility call raised inside the engine; the message is the engine's."""


class EngineSockets:
    """The ROUTER (requests out) and PULL (outputs in) of one front-end."""

    def __init__(self, ctx: zmq.asyncio.Context, input_address: Addresses,
                 output_address: Addresses, secret: str | None) -> None:
        self.input = secure(ctx.socket(zmq.ROUTER), "server", secret)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: error, not a drop
        self.input.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine takes its identity
        self.input.setsockopt(zmq.LINGER, 0)
        self.output = secure(ctx.socket(zmq.PULL), "server", secret)
        self.output.setsockopt(zmq.LINGER, 0)
        try:
            for sock, addresses in ((self.input, input_address),
                                    (self.output, output_address)):
                for address in [addresses] if isinstance(addresses, str) else addresses:
                    sock.bind(address)
        except zmq.ZMQError:  # an address taken: nothing half-bound stays open
            self.input.close(linger=0)
            self.output.close(linger=0)
            raise
        self._encoder = msgspec.msgpack.Encoder()
        self._registered = asyncio.Event()  # set, then replaced, on every registration

    async def send(self, identity: bytes, request_type: RequestType, body: Any,
                   flags: int = 0) -> None:
        """One message to an engine; zmq.ZMQError (EHOSTUNREACH) when it is gone."""
        await self.input.send_multipart([identity, request_type.value,
                                         self._encoder.encode(body)], flags=flags)

    async def wait_for(self, registered: Callable[[], bool], dead: asyncio.Event,
                       timeout: float) -> None:
        """Until `registered()` (re-checked on each registration), `dead` is set, or
        `timeout` s pass; the caller looks at which."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not registered() and not dead.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            waits = [asyncio.ensure_future(self._registered.wait()),
                     asyncio.ensure_future(dead.wait())]
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def registrations(self) -> AsyncIterator[tuple[int, bool]]:
        """(rank, a registration frame) for each message on the ROUTER; waiters of
        `wait_for` look again after each registration is handled."""
        while True:
            identity, *frames = await self.input.recv_multipart()
            yield int.from_bytes(identity, "little"), frames == [b""]
            if frames == [b""]:
                registered, self._registered = self._registered, asyncio.Event()
                registered.set()

    async def outputs(self) -> AsyncIterator[EngineCoreOutputs | int]:
        """Decoded outputs, or the rank of an engine that sent ENGINE_CORE_DEAD
        (undecodable messages are logged and dropped)."""
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        while True:
            frames = await self.output.recv_multipart()
            if frames[0] == ENGINE_CORE_DEAD:
                if len(frames) > 1:
                    yield int.from_bytes(frames[1], "little")
                else:
                    logger.error("ENGINE_CORE_DEAD without a rank: %r", frames[1:])
                continue
            try:
                outputs = decoder.decode(frames[0])
            except msgspec.DecodeError as e:
                logger.error("undecodable message from an engine dropped: %s", e)
                continue
            yield outputs


class UtilityCalls:
    """Utility calls in flight: call id -> the future of its `UtilityOutput`."""

    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future[UtilityOutput]] = {}
        self.ids = itertools.count()

    def __len__(self) -> int:
        return len(self._futures)

    async def call(self, send: Callable[[UtilityCall], Awaitable[None]], rank: int,
                   method: str, args: tuple[Any, ...], timeout: float,
                   result_type: Any = None) -> Any:
        """Send `UtilityCall(method, args)` with `send`; its result (converted to
        `result_type`). UtilityCallError with the engine's message when it failed
        there, TimeoutError after `timeout` s, EngineDeadError from `fail_all`."""
        call_id = next(self.ids)
        future = self._futures[call_id] = asyncio.get_running_loop().create_future()
        try:
            await send(UtilityCall(call_id, method, list(args)))
            out = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {rank} did not answer {method}() within "
                               f"{timeout:.0f} s") from None
        finally:
            self._futures.pop(call_id, None)
        if out.failure_message is not None:
            raise UtilityCallError(out.failure_message)
        return out.result if result_type is None else msgspec.convert(out.result, result_type)

    def resolve(self, out: UtilityOutput | None) -> None:
        future = self._futures.get(out.call_id) if out is not None else None
        if future is not None and not future.done():
            future.set_result(out)

    def fail_all(self, reason: str) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
