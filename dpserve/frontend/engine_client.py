"""AsyncEngineClient: one front-end's asyncio connection to its engines.

Scope: the front-end ends of the engine sockets (it BINDS a ROUTER for
requests and a PULL for outputs at its client index's addresses), sending
ADD / ABORT / UTILITY, handing decoded `EngineCoreOutputs` to the caller
through `get_output()`, utility calls as futures keyed by call id, and
engine death, and placement over several engines (`EngineState` per engine):

* Only SERVING ranks get new work (`EngineState.status`, below). A request
  that pins `data_parallel_rank` goes to that engine (a rank this client does
  not have: ValueError; one that is not serving: EngineUnavailableError).
* Otherwise the `Router` (`dpserve.frontend.routing`, `load_balance`) picks
  among the placeable ranks, by the loads kept here: with a DP coordinator
  (`coordinator_address`, its front publish XPUB) a background task keeps the
  latest `[waiting, running]` per engine from its `CoordinatorUpdate`s, plus
  what this client sent each since (reset on each publish); without one (one
  engine, or the coordinator away), the requests in flight from here.
* Waves: each request carries the wave this client last heard of from the
  coordinator. In lockstep mode (`lockstep=True`), a request sent while the
  coordinator said "paused" is followed by `WakeEngines(wave, engine)` so the
  coordinator starts the wave on every other engine.

Cordon (an operator's, through the coordinator: `control_rank`, then
`EngineInfo.cordoned` in its updates): a cordoned rank gets no new work,
pinned or moved requests included, while what it holds goes on; its other
figures (`EngineState.info`) are what `GET /engines` shows.

Rank states (`RankStatus`: state, incarnation, reason) come from the
coordinator's updates (heartbeats: unhealthy / serving again; the launchers'
RankEvents: dead / restarting / serving), from the launcher directly
(`set_rank_status`: in-process or over an API server's pipe), and from direct
evidence (`mark_engine_dead`: ENGINE_CORE_DEAD, an unreachable socket). News
of an older incarnation is dropped, and "serving" for an incarnation this
client saw die is too; with no coordinator, a dead rank whose new process
registers is serving again.

Moving requests: the client keeps each request in flight (`_InFlight`: the
request as sent, its rank, every token received). When a rank stops serving,
each of its requests is re-sent to a serving rank with
`prior_output_token_ids` = the tokens so far (none yet: a retry), so the
engine recomputes its KV and goes on from there: the caller sees one
unbroken stream (greedy output equals an undisturbed run). Outputs from a
rank a request has left are dropped; an unhealthy rank (still alive) is
sent an ABORT for them first, so it holds nothing when it recovers. A
request pinned to the lost rank, moved `max_migrations` times already, or
with no serving rank left ends with an `EngineCoreOutput` whose `error` says
why. `fail_stop=True` (`--engine-failure-policy stop`): a rank that dies
kills the client instead.

Not here: tokenising, detokenising, stop strings (the output processor),
HTTP, process spawning and restarts (`dpserve.launch`).

Death of the client (`dead`): `mark_dead(reason)` (closing, the launcher
stopping, policy stop), or a process watched by `watch_processes` exiting:
every pending utility call fails at once with `EngineDeadError`, and
`get_output()` raises it once the outputs received before are drained.

It has the interface `AsyncLLM` expects of an engine client (as does
`InprocEngineClient`) and raises the shared `dpserve.frontend.errors.
EngineDeadError`. Create it inside a running event loop and use it from that
loop's thread (only `mark_dead`, `mark_engine_dead` and `set_rank_status`
may be called from elsewhere); `await
aclose()` (or `shutdown()`) when done.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dpserve.frontend.control import ControlView, ScaleRequests
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError
from dpserve.frontend.routing import Router
from dpserve.protocol import (
    ENGINE_CORE_DEAD,
    ControlChange,
    ControlState,
    CoordinatorUpdate,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    RankControl,
    RankState,
    RankStatus,
    RequestType,
    ScaleStatus,
    SchedulerStats,
    UtilityCall,
    WakeEngines,
    engine_identity,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

_DEAD = object()  # the output-queue item that stands for "the engines are dead"


class UtilityCallError(RuntimeError):
    """A utility call raised inside the engine; the message is the engine's."""


@dataclass
class EngineState:
    """What this front-end knows about one engine."""

    rank: int
    identity: bytes
    registered: asyncio.Event = field(default_factory=asyncio.Event)  # its empty frame came
    num_requests: int = 0  # requests sent to it and not yet finished
    waiting: int = 0  # from the coordinator's last publish
    running: int = 0  # from the coordinator's last publish
    sent_since_publish: int = 0  # requests this client sent it since that publish
    waiting_tokens: int = 0  # prompt tokens waiting there, from the coordinator
    tokens_since_publish: int = 0  # prompt tokens this client sent it since that publish
    status: RankStatus = field(default_factory=RankStatus)  # as last heard (module doc)
    # Direct evidence (ENGINE_CORE_DEAD, an exit, an unreachable socket) that this
    # incarnation died: it outranks any news of the same incarnation still serving.
    dead_incarnation: int | None = None
    stats: SchedulerStats | None = None  # the last figures it sent
    info: EngineInfo = field(default_factory=EngineInfo)  # from the coordinator (/engines)

    @property
    def serving(self) -> bool:
        return self.status.state is RankState.SERVING

    @property
    def cordoned(self) -> bool:
        return self.info.cordoned

    @property
    def placeable(self) -> bool:
        """It may get new work: serving and not cordoned."""
        return self.serving and not self.info.cordoned


@dataclass
class _InFlight:
    """A request this client sent and that has not finished: enough to move it."""

    request: EngineCoreRequest  # as first sent
    rank: int  # the engine that runs it now
    generated: list[int] = field(default_factory=list)  # every token received so far
    moves: int = 0  # times it was re-sent to another rank


class AsyncEngineClient:
    """Send requests to engines and receive their outputs, over asyncio ZMQ.

    input_address / output_address: this front-end's pair (ZmqAddresses.
    inputs[client_index] / outputs[client_index]; a list binds each, e.g.
    ipc for local engines and tcp for remote ones); `engine_ranks`: the
    engines that will connect. `register_timeout`: how long a send waits for
    an engine's registration frame before giving up. `coordinator_address`:
    the DP coordinator's front publish address (None: no coordinator).
    """

    def __init__(self, input_address: str | Sequence[str],
                 output_address: str | Sequence[str], *,
                 engine_ranks: Sequence[int] = (0,), client_index: int = 0,
                 register_timeout: float = 60.0, max_model_len: int | None = None,
                 coordinator_address: str | None = None,
                 load_balance: str = "least-loaded", lockstep: bool = False,
                 secret: str | None = None, max_migrations: int = 3,
                 fail_stop: bool = False, elastic: bool = False, block_size: int = 16) -> None:
        # ValueError for a bad policy; block_size: the engines' KV block (cache-aware)
        self.router = Router(load_balance, client_index=client_index, block_size=block_size)
        self._loop = asyncio.get_running_loop()  # raises outside an event loop
        self._loop_thread = threading.get_ident()
        self.client_index = client_index
        self.max_model_len = max_model_len  # the engines' limit (READY), for AsyncLLM
        self.register_timeout = register_timeout
        self.engines = {r: EngineState(r, engine_identity(r)) for r in engine_ranks}
        self.dead = False
        self.dead_reason: str | None = None
        self._dead_event = asyncio.Event()
        self._closed = False
        self._inflight: dict[str, _InFlight] = {}  # request_id -> its story, until finished
        self.max_migrations = max_migrations
        self.fail_stop = fail_stop  # --engine-failure-policy stop: any rank lost kills us
        self.num_retries = 0  # requests re-sent before their first token
        self.num_migrations = 0  # requests moved mid-stream
        self.recomputed_tokens = 0  # prompt + generated tokens prefilled again by moves
        self._outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._calls: dict[int, asyncio.Future] = {}  # call_id -> its UtilityOutput
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._watch_stop = threading.Event()

        self._ctx = zmq.asyncio.Context()
        self._input = secure(self._ctx.socket(zmq.ROUTER), "server", secret)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: error, not a drop
        self._input.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine takes its identity
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = secure(self._ctx.socket(zmq.PULL), "server", secret)
        self._output.setsockopt(zmq.LINGER, 0)
        for sock, addresses in ((self._input, input_address), (self._output, output_address)):
            for address in [addresses] if isinstance(addresses, str) else addresses:
                sock.bind(address)
        self._tasks = [self._loop.create_task(self._read_registrations()),
                       self._loop.create_task(self._read_outputs())]
        self.balanced = coordinator_address is not None  # place by the coordinator's loads
        self.lockstep = lockstep and coordinator_address is not None
        self.current_wave = 0  # the request wave, from the coordinator
        self.info_updates = 0  # coordinator updates with per-rank figures, so far
        self.engines_running = False  # the coordinator's last word (or our own wake-up)
        self.controls = ControlView()  # pause / sleep as last heard (dpserve.control)
        self.all_ranks: list[RankStatus] = []  # every rank's state, from the coordinator
        self._coordinator: zmq.asyncio.Socket | None = None
        # Elastic (the engine count changes at run time): the coordinator's rank list
        # is the engine set; ranks that registered before we heard of them.
        self.elastic = elastic and coordinator_address is not None
        self._early: set[int] = set()
        self._scales = ScaleRequests()
        self.autoscale_decisions: list[int] | None = None  # [up, down], from the coordinator
        if coordinator_address is not None:
            self._coordinator = secure(self._ctx.socket(zmq.XSUB), "client", secret)
            self._coordinator.setsockopt(zmq.LINGER, 0)
            self._coordinator.connect(coordinator_address)
            self._tasks.append(self._loop.create_task(self._read_coordinator()))

    @property
    def engine_ranks(self) -> list[int]:
        """The ranks of every engine this client sends to."""
        return sorted(self.engines)

    @property
    def data_parallel_size(self) -> int:
        """The number of DP engines now (it changes when the server scales)."""
        return len(self.engines)

    # ---- requests ------------------------------------------------------------

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to an engine (`engine_of(request_id)` says which).

        The request's `client_index` is set to this client's, so that its
        outputs come back here, and its `current_wave` to the wave it last heard of.
        """
        self._check_alive()
        if (request.client_index, request.current_wave) != (self.client_index,
                                                            self.current_wave):
            request = msgspec.structs.replace(request, client_index=self.client_index,
                                              current_wave=self.current_wave)
        if request.request_id in self._inflight:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        engine = self._choose_engine(request)
        self._inflight[request.request_id] = _InFlight(request, engine.rank)
        engine.num_requests += 1
        engine.sent_since_publish += 1
        engine.tokens_since_publish += len(request.prompt_token_ids)
        try:
            await self._send(engine, RequestType.ADD, request)
        except BaseException:
            self._forget(request.request_id)
            raise
        await self._wake_if_paused(request, engine)

    async def _wake_if_paused(self, request: EngineCoreRequest, engine: EngineState) -> None:
        if self.lockstep and not self.engines_running:
            # The engines are paused: our engine starts by itself, the
            # coordinator starts the others. Until it says otherwise, assume running.
            self.engines_running = True
            await self._coordinator.send(self._encoder.encode(
                WakeEngines(request.current_wave, engine.rank)))

    async def send_control(self, change: ControlChange) -> None:
        """Send a pause / sleep change to the coordinator (see dpserve.frontend.control)."""
        self._check_alive()
        await self._coordinator.send(self._encoder.encode(change))

    @property
    def control(self) -> ControlState:
        """The pause / sleep state as last heard."""
        return self.controls.state

    def queued(self, engine: EngineState) -> tuple[int, int]:
        """(requests, prompt tokens) at `engine` for admission control: waiting ones,
        from the coordinator's figures plus what this client sent since; without a
        coordinator, its own requests in flight there (running ones too) and the
        prompt tokens of those with no token yet."""
        if self.balanced:
            return (engine.waiting + engine.sent_since_publish,
                    engine.waiting_tokens + engine.tokens_since_publish)
        flights = [f for f in self._inflight.values() if f.rank == engine.rank]
        return (len(flights), sum(len(f.request.prompt_token_ids) for f in flights
                                  if not f.generated))

    def engine_of(self, request_id: str) -> int | None:
        """The rank of the engine running a request in flight (None: not in flight)."""
        flight = self._inflight.get(request_id)
        return flight.rank if flight is not None else None

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests at the engines that own them; unknown ids are ignored.

        Each aborted request still gets its final output (finish reason ABORT).
        """
        if self.dead:
            return
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.engine_of(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            engine = self.engines.get(rank)  # None: removed (its requests are moving)
            with contextlib.suppress(EngineUnavailableError):  # gone: nothing to abort there
                if engine is not None:
                    await self._send(engine, RequestType.ABORT, ids)

    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0, result_type: Any = None) -> Any:
        """Run `EngineCore.<method>(*args)` in an engine and return its result.

        engine: the rank (default: the lowest live one). result_type: convert
        the msgpack result to this type (e.g. SchedulerStats). Raises
        UtilityCallError with the engine's message when the call failed there,
        EngineDeadError when the engine dies, TimeoutError after `timeout` s.
        """
        self._check_alive()
        if engine is not None and engine not in self.engines:
            raise ValueError(f"no engine of rank {engine} (engines: {sorted(self.engines)})")
        target = self.engines[engine] if engine is not None else self._live_engines()[0]
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        try:
            await self._send(target, RequestType.UTILITY, UtilityCall(call_id, method,
                                                                      list(args)))
            out = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {target.rank} did not answer {method}() within "
                               f"{timeout:.0f} s") from None
        finally:
            self._calls.pop(call_id, None)
        if out.failure_message is not None:
            raise UtilityCallError(out.failure_message)
        return out.result if result_type is None else msgspec.convert(out.result, result_type)

    def request_state_sizes(self) -> dict[str, int]:
        """Entries of the per-request structures (0 once every request has ended)."""
        return {"client_inflight": len(self._inflight), "client_calls": len(self._calls),
                "client_outputs_queued": self._outputs.qsize(),
                "client_rank_requests": sum(e.num_requests for e in self.engines.values())}

    async def call_utility_all(self, method: str, *args: Any, timeout: float = 30.0,
                               result_type: Any = None) -> dict[int, Any]:
        """`call_utility` on every live engine at once: rank -> its result."""
        live = [e.rank for e in self._live_engines()]
        results = await asyncio.gather(*(
            self.call_utility(method, *args, engine=rank, timeout=timeout,
                              result_type=result_type) for rank in live))
        return dict(zip(live, results))

    async def get_output(self) -> EngineCoreOutputs:
        """The next outputs message from any engine (one engine, one front-end).

        Raises EngineDeadError once the client is dead and earlier outputs are drained.
        """
        if self.dead and self._outputs.empty():
            raise EngineDeadError(self.dead_reason)
        item = await self._outputs.get()
        if item is _DEAD:
            self._outputs.put_nowait(_DEAD)  # for the next caller too
            raise EngineDeadError(self.dead_reason)
        return item

    # ---- death ------------------------------------------------------------------

    def mark_dead(self, reason: str) -> None:
        """Declare the engines dead (callable from any thread; idempotent)."""
        if threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to tell
                self._loop.call_soon_threadsafe(self.mark_dead, reason)
            return
        if self.dead:
            return
        if not self._closed:
            logger.error("engine client %d: engines dead: %s", self.client_index, reason)
        self.dead, self.dead_reason = True, reason
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._outputs.put_nowait(_DEAD)
        self._dead_event.set()

    def watch_processes(self, procs: Sequence[BaseProcess]) -> None:
        """Mark the client dead when any of these (local, spawned here) processes exits."""
        from dpserve.launch.process import wait_for_any_exit

        def watch() -> None:
            while not self._watch_stop.is_set():
                exited = wait_for_any_exit(procs, timeout=0.5)
                if exited:
                    p = exited[0]
                    self.mark_dead(f"process {p.name} (pid {p.pid}) exited with "
                                   f"code {p.exitcode}")
                    return

        threading.Thread(target=watch, name="engine-process-watcher", daemon=True).start()

    async def aclose(self) -> None:
        """Stop the socket tasks, then close; pending calls fail (idempotent)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.shutdown()

    def shutdown(self) -> None:
        """Close without awaiting the tasks (prefer `aclose` inside the loop)."""
        if self._closed:
            return
        self._closed = True
        self._watch_stop.set()
        for task in self._tasks:
            task.cancel()
        if not self.dead:
            self.mark_dead("the engine client was closed")
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ---- scaling at run time (dpserve.launch.scaler) ------------------------------------

    async def request_scale(self, num_engines: int, timeout: float) -> ScaleStatus:
        """Ask the coordinator to change the engine count; its final answer (DONE,
        FAILED or REJECTED). TimeoutError after `timeout` s."""
        self._check_alive()
        if not self.elastic:
            raise EngineUnavailableError("this server cannot change its engine count")
        scale_id = f"api{self.client_index}-{next(self._call_ids)}-{id(self):x}"
        return await self._scales.ask(
            lambda msg: self._coordinator.send(self._encoder.encode(msg)), scale_id,
            num_engines, timeout)

    def _on_scale_news(self, update: CoordinatorUpdate) -> None:
        """A coordinator update: the engine set's size, and answers to our scale requests."""
        if update.autoscale_decisions is not None:
            self.autoscale_decisions = update.autoscale_decisions
        self._scales.on_status(update.scale)
        if self.elastic and update.ranks is not None and len(update.ranks) != len(self.engines):
            self._resize(len(update.ranks))

    def _resize(self, size: int) -> None:
        """The engine set is ranks [0, size) now: new ranks start as the coordinator says
        (STARTING); removed ones get nothing more, and what they still hold moves."""
        for rank in [r for r in self.engines if r >= size]:
            engine = self.engines.pop(rank)
            self.router.forget(rank)
            logger.info("front-end %d: rank %d removed (scaled down to %d engines)",
                        self.client_index, rank, size)
            engine.status = RankStatus(RankState.DEAD, engine.status.incarnation,
                                       f"removed: scaled down to {size} engines")
            self._spawn(self._evacuate(engine, abort=True))
        for rank in range(size):
            if rank not in self.engines:
                engine = self.engines[rank] = EngineState(rank, engine_identity(rank),
                                                          status=RankStatus(RankState.STARTING))
                if rank in self._early:
                    engine.registered.set()
                logger.info("front-end %d: rank %d added (scaled up to %d engines)",
                            self.client_index, rank, size)
        self._early -= set(self.engines)

    # ---- internals ----------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead_reason)

    def _live_engines(self, exclude: int | None = None) -> list[EngineState]:
        """The serving engines (but `exclude`); EngineUnavailableError when there are none."""
        live = [e for e in self.engines.values() if e.placeable and e.rank != exclude]
        if not live:
            raise EngineUnavailableError("no engine is serving: " + self.describe_ranks())
        return live

    def describe_ranks(self) -> str:
        """`rank 0 serving, rank 1 dead (exit code -9)`."""
        return ", ".join(f"rank {e.rank} {e.status.state.value}"
                         + (" cordoned" if e.cordoned else "")
                         + (f" ({e.status.reason})" if e.status.reason else "")
                         for e in self.engines.values())

    def _choose_engine(self, request: EngineCoreRequest,
                       exclude: int | None = None) -> EngineState:
        """The pinned rank if any, else the router's choice among the placeable ranks."""
        if request.data_parallel_rank is not None:
            engine = self.engines.get(request.data_parallel_rank)
            if engine is None:
                raise ValueError(f"data_parallel_rank {request.data_parallel_rank} is out of "
                                 f"range: this server's engines are {self.engine_ranks}")
            if not engine.serving:
                raise EngineUnavailableError(
                    f"data_parallel_rank {engine.rank} is {engine.status.state.value}"
                    + (f" ({engine.status.reason})" if engine.status.reason else ""))
            if engine.cordoned:
                raise EngineUnavailableError(f"data_parallel_rank {engine.rank} is cordoned "
                                             f"(an operator took it out of placement)")
            self.router.record(engine, request=request)
            return engine
        return self.router.choose(self._live_engines(exclude), request, balanced=self.balanced)

    def _forget(self, request_id: str) -> None:
        flight = self._inflight.pop(request_id, None)
        if flight is not None and flight.rank in self.engines:
            self.engines[flight.rank].num_requests -= 1

    async def _send(self, engine: EngineState, request_type: RequestType, body: Any) -> None:
        await self._wait_registered(engine)
        try:
            await self._input.send_multipart(
                [engine.identity, request_type.value, self._encoder.encode(body)])
        except zmq.ZMQError as e:  # EHOSTUNREACH: the engine is gone
            reason = f"unreachable: {e}"
            self.mark_engine_dead(engine.rank, reason)
            raise EngineUnavailableError(f"engine {engine.rank} is {reason}") from e

    # ---- operators ---------------------------------------------------------------------

    @property
    def has_coordinator(self) -> bool:
        """A DP coordinator feeds this client (loads, rank states, per-rank figures)."""
        return self._coordinator is not None

    async def control_rank(self, rank: int, action: str) -> None:
        """Send an operator's "cordon" / "uncordon" / "restart" of `rank` to the DP
        coordinator (every front-end learns the outcome from its updates). ValueError
        without a coordinator or for a rank this client does not have."""
        if self._coordinator is None:
            raise ValueError("per-rank controls go through the DP coordinator, and this "
                             "server has none (--data-parallel-size 1)")
        if rank not in self.engines:
            raise ValueError(f"rank must be one of this server's ranks {self.engine_ranks}, "
                             f"got {rank}")
        await self._coordinator.send(self._encoder.encode(RankControl(rank, action)))

    # ---- rank states and moving requests ----------------------------------------------

    def set_rank_status(self, rank: int, status: RankStatus) -> None:
        """News of a rank (the coordinator's, or its launcher's); callable from any thread.

        Old incarnations' news is dropped; so is "serving" for an incarnation this
        client saw die. A rank that stops serving has its requests moved.
        """
        if threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.set_rank_status, rank, status)
            return
        engine = self.engines.get(rank)
        if engine is None or status.incarnation < engine.status.incarnation:
            return
        if engine.dead_incarnation is not None:
            if status.incarnation <= engine.dead_incarnation:
                return  # we saw this process die; only its successor can serve
            engine.dead_incarnation = None
        self._change_status(engine, status)

    def mark_engine_dead(self, rank: int, reason: str) -> None:
        """Direct evidence that a rank's current process is gone; callable from any thread."""
        if threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.mark_engine_dead, rank, reason)
            return
        engine = self.engines.get(rank)
        if engine is None or engine.dead_incarnation == engine.status.incarnation:
            return
        engine.dead_incarnation = engine.status.incarnation
        self._change_status(engine, RankStatus(RankState.DEAD, engine.status.incarnation,
                                               reason))

    def _change_status(self, engine: EngineState, status: RankStatus) -> None:
        was_serving = engine.serving
        if status == engine.status:
            return
        # A new process (e.g. restarted by a remote host before anyone saw the old
        # one die): what the old one held is gone with it.
        replaced = status.incarnation > engine.status.incarnation and was_serving
        engine.status = status
        if replaced or status.state in (RankState.DEAD, RankState.RESTARTING):
            self.router.forget(engine.rank)  # its prefix cache is gone
        if not self._closed:
            logger.log(logging.INFO if status.state is RankState.SERVING else logging.WARNING,
                       "front-end %d: rank %d %s (incarnation %d)%s", self.client_index,
                       engine.rank, status.state.value, status.incarnation,
                       f": {status.reason}" if status.reason else "")
        if replaced and engine.serving:
            self._spawn(self._evacuate(engine))
        if was_serving and status.state is RankState.DRAINING:
            return  # it finishes what it holds; only new work goes elsewhere
        if was_serving and not engine.serving:
            if self.fail_stop and status.state in (RankState.DEAD, RankState.RESTARTING):
                self.mark_dead(f"rank {engine.rank} {status.state.value}: {status.reason}")
                return
            self._spawn(self._evacuate(engine))

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    async def _evacuate(self, engine: EngineState, abort: bool | None = None) -> None:
        """Move every request of `engine` (no longer serving) to a serving rank;
        `abort` (default: unless it is dead) sends it an ABORT for them first."""
        ids = [rid for rid, f in self._inflight.items() if f.rank == engine.rank]
        if not ids:
            return
        if abort if abort is not None else engine.status.state is not RankState.DEAD:
            # It may come back (or still runs): no duplicates
            with contextlib.suppress(zmq.ZMQError):
                await self._input.send_multipart(
                    [engine.identity, RequestType.ABORT.value, self._encoder.encode(ids)],
                    flags=zmq.NOBLOCK)
        for rid in ids:
            flight = self._inflight.get(rid)
            if flight is not None and flight.rank == engine.rank:
                await self._move(rid, flight, f"rank {engine.rank} {engine.status.state.value}"
                                 + (f" ({engine.status.reason})" if engine.status.reason
                                    else ""))

    async def _move(self, request_id: str, flight: _InFlight, why: str) -> None:
        """Re-send a request to another serving rank with the tokens it already has, so
        its stream goes on; past `max_migrations`, pinned, or with no rank serving, it
        ends with an error output instead."""
        source = self.engines.get(flight.rank)  # None: removed by a scale-down
        if source is not None:
            source.num_requests -= 1
        moved = msgspec.structs.replace(
            flight.request, current_wave=self.current_wave,
            prior_output_token_ids=list(flight.generated) or None)
        try:
            if flight.request.data_parallel_rank is not None:
                raise EngineUnavailableError(f"its pinned {why}")
            if flight.moves >= self.max_migrations:
                raise EngineUnavailableError(f"{why}, and it was moved {flight.moves} times "
                                             f"already (--max-request-migrations)")
            target = self._choose_engine(moved, exclude=flight.rank)
        except EngineUnavailableError as e:
            self._inflight.pop(request_id, None)
            self._outputs.put_nowait(EngineCoreOutputs(engine_index=flight.rank, outputs=[
                EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT,
                                 error=f"request {request_id} failed: {e}")]))
            return
        flight.moves += 1
        flight.rank = target.rank
        target.num_requests += 1
        target.sent_since_publish += 1
        if flight.generated:
            self.num_migrations += 1
        else:
            self.num_retries += 1
        self.recomputed_tokens += len(moved.prompt_token_ids) + len(flight.generated)
        logger.info("front-end %d: %s %s from %s to rank %d (%d tokens so far)",
                    self.client_index, "migrating" if flight.generated else "re-sending",
                    request_id, why, target.rank, len(flight.generated))
        try:
            await self._send(target, RequestType.ADD, moved)
            await self._wake_if_paused(moved, target)
        except EngineUnavailableError:
            pass  # the target died in turn: its own evacuation moves the request on

    async def _wait_registered(self, engine: EngineState) -> None:
        if engine.registered.is_set():
            return
        waits = [asyncio.ensure_future(engine.registered.wait()),
                 asyncio.ensure_future(self._dead_event.wait())]
        try:
            await asyncio.wait(waits, timeout=self.register_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self._check_alive()
        if not engine.registered.is_set():
            raise TimeoutError(f"engine {engine.rank} did not register with front-end "
                               f"{self.client_index} within {self.register_timeout:.0f} s")

    async def _read_registrations(self) -> None:
        """The ROUTER only ever receives each engine's empty registration frame."""
        while True:
            identity, *frames = await self._input.recv_multipart()
            rank = int.from_bytes(identity, "little")
            engine = self.engines.get(rank)
            if engine is None and self.elastic and frames == [b""]:
                self._early.add(rank)  # a new rank (scaling up) we have not heard of yet
            elif engine is None:
                logger.warning("message from unexpected engine rank %d ignored", rank)
            elif frames == [b""]:
                logger.debug("engine %d registered with front-end %d", rank,
                             self.client_index)
                engine.registered.set()
                if engine.dead_incarnation is not None and not self.balanced:
                    # No coordinator to say so: a new process of a dead rank is serving.
                    self.set_rank_status(rank, RankStatus(
                        RankState.SERVING, engine.dead_incarnation + 1))

    async def _read_outputs(self) -> None:
        while True:
            frames = await self._output.recv_multipart()
            if frames[0] == ENGINE_CORE_DEAD:
                if len(frames) > 1 and int.from_bytes(frames[1], "little") in self.engines:
                    self.mark_engine_dead(int.from_bytes(frames[1], "little"),
                                          "fatal error (ENGINE_CORE_DEAD); see its log")
                else:
                    logger.error("ENGINE_CORE_DEAD from an unknown engine: %r", frames[1:])
                continue
            try:
                outputs = self._decoder.decode(frames[0])
            except msgspec.DecodeError as e:
                logger.error("undecodable message from an engine dropped: %s", e)
                continue
            self._dispatch(outputs)

    async def _read_coordinator(self) -> None:
        """Keep the engines' load figures from the coordinator's publishes."""
        await self._coordinator.send(b"\x01")  # XSUB: subscribe to everything
        decoder = msgspec.msgpack.Decoder(CoordinatorUpdate)
        while True:
            body = await self._coordinator.recv()
            try:
                update = decoder.decode(body)
            except msgspec.DecodeError as e:
                logger.error("undecodable message from the DP coordinator dropped: %s", e)
                continue
            self.current_wave, self.engines_running = update.wave, update.running
            self._on_scale_news(update)
            for rank, status in enumerate(update.ranks or []):
                self.set_rank_status(rank, status)
            if update.ranks is not None:
                self.all_ranks = list(update.ranks)
            if update.control is not None:
                self.controls.update(update.control, update.control_done)
            for rank, info in enumerate(update.engines or []):
                if rank in self.engines:
                    self.engines[rank].info = info
            if update.engines is not None:
                self.info_updates += 1
            if update.counts is None:
                continue  # wave news only
            tokens = update.waiting_tokens or [0] * len(update.counts)
            for rank, (waiting, running) in enumerate(update.counts):
                engine = self.engines.get(rank)
                if engine is not None:
                    engine.waiting, engine.running = waiting, running
                    engine.waiting_tokens = tokens[rank] if rank < len(tokens) else 0
                    engine.sent_since_publish = engine.tokens_since_publish = 0

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        engine = self.engines.get(outputs.engine_index)
        if engine is not None and outputs.scheduler_stats is not None:
            engine.stats = outputs.scheduler_stats
        if outputs.control is not None:  # no coordinator: the engine's own state
            self.controls.update(outputs.control)
        call = outputs.utility_output
        if call is not None:
            future = self._calls.get(call.call_id)
            if future is not None and not future.done():
                future.set_result(call)
        kept = []
        for out in outputs.outputs:
            flight = self._inflight.get(out.request_id)
            if flight is not None and flight.rank != outputs.engine_index:
                continue  # from a rank this request has left: it goes on elsewhere
            if flight is not None:
                flight.generated.extend(out.new_token_ids)
                if out.finished:
                    self._forget(out.request_id)
            kept.append(out)
        if kept:
            if len(kept) != len(outputs.outputs):
                outputs = msgspec.structs.replace(outputs, outputs=kept)
            self._outputs.put_nowait(outputs)
