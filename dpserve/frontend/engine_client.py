"""AsyncEngineClient: one front-end's asyncio connection to its engines (the shell).

Scope: the front-end ends of the engine sockets (it BINDS a ROUTER for requests
and a PULL for outputs at its client index's addresses), sending ADD / ABORT /
UTILITY, handing decoded `EngineCoreOutputs` to the caller through
`get_output()`, utility calls as futures keyed by call id, engine death, and the
DP coordinator's publishes (its front XPUB). It decides nothing itself: its
IO-free parts do (`RankTable`: rank states, placement through the `Router`;
`InFlightBook`: requests in flight, evacuation plans), and it carries out what
they return (`MoveSender`: rank changes and moves; `HandoffSender`: prefill /
decode continuations). It implements `ClusterView` through `cluster`.

Invariants: direct evidence of a death outranks older news of a rank; a request
that moves is aborted at its old rank first (no duplicates); once dead, every
pending utility call fails with `EngineDeadError`, and `get_output()` raises it
after the outputs received before. Use it from the loop it was created in; only
`mark_dead`, `mark_engine_dead` and `set_rank_status` may be called from other
threads. `from_config` builds it from an `EngineConfig`.

Not here: tokenising, detokenising, stop strings (the output processor), HTTP,
process spawning and restarts (`dpserve.launch`).

Design: docs/design/engine-client.md
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dpserve.config import EngineConfig
from dpserve.frontend.coordinator_link import CoordinatorLink, CoordinatorNews
from dpserve.frontend.engine_cluster import EngineClientCluster
from dpserve.frontend.engine_sockets import EngineSockets, UtilityCallError, UtilityCalls
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError
from dpserve.frontend.handoff import HandoffSender
from dpserve.frontend.lora import LoRAReplay
from dpserve.frontend.migration import InFlightBook, ended
from dpserve.frontend.moves import MoveSender
from dpserve.frontend.rank_table import EngineState, RankTable
from dpserve.frontend.roles import first_leg, roles_of
from dpserve.frontend.route_trace import RouteTrace
from dpserve.frontend.routing import DEFAULT_LOAD_BALANCE, Router, sendable
from dpserve.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    RankStatus,
    RequestType,
    WakeEngines,
    engine_identity,
)

__all__ = ["AsyncEngineClient", "EngineState", "UtilityCallError", "from_config"]

logger = logging.getLogger(__name__)

_DEAD = object()  # the output-queue item that stands for "the engines are dead"


def _on_loop(method: Callable[..., None]) -> Callable[..., None]:
    """A client method callable from any thread: it runs on the client's loop (from
    another thread, soon; a closed loop has nobody to tell)."""

    @functools.wraps(method)
    def on_loop(self: AsyncEngineClient, *args: Any) -> None:
        if threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(on_loop, self, *args)
            return
        method(self, *args)

    return on_loop


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
                 fail_stop: bool = False, elastic: bool = False, block_size: int = 16,
                 loras: dict[str, str] | None = None, kv_tier: bool = False,
                 share_prefixes: bool = False) -> None:
        # ValueError for a bad policy; block_size, kv_tier: the engines' KV block, host tier
        router = Router(load_balance, client_index=client_index, block_size=block_size,
                        kv_tier=kv_tier)
        self._loop = asyncio.get_running_loop()  # raises outside an event loop
        self._loop_thread = threading.get_ident()
        self.client_index = client_index
        self.max_model_len = max_model_len  # the engines' limit (READY), for AsyncLLM
        self.register_timeout = register_timeout
        balanced = coordinator_address is not None  # place by the coordinator's loads
        self.table = RankTable(engine_ranks, router, balanced=balanced, elastic=elastic,
                               fail_stop=fail_stop)
        self.book = InFlightBook(max_migrations)
        self.handoffs = HandoffSender(self, secret)
        self.moves = MoveSender(self, self._spawn)  # carries out rank news: moves, death
        self.dead = False
        self.dead_reason: str | None = None
        self._dead_event = asyncio.Event()
        self.closed = False
        self._outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._calls = UtilityCalls()
        self._watch_stop = threading.Event()
        self.cluster = EngineClientCluster(self)  # what the HTTP server sees (ClusterView)
        self._ctx = zmq.asyncio.Context()
        self._sockets = EngineSockets(self._ctx, input_address, output_address, secret)
        self._tasks = [self._loop.create_task(self._read_registrations()),
                       self._loop.create_task(self._read_outputs())]
        self.lockstep = lockstep and balanced
        # wave, pause / sleep, rank list, scale answers; `loras`: the LoRA registry at
        # start (--lora-modules; None: LoRA off)
        self.news = CoordinatorNews(loras=dict(loras) if loras is not None else None)
        self.lora_replay = LoRAReplay()
        self._coordinator: CoordinatorLink | None = None
        if coordinator_address is not None:
            self._coordinator = CoordinatorLink(self._ctx, coordinator_address, secret,
                                                router if share_prefixes else None)
            self._tasks.append(self._loop.create_task(self._read_coordinator()))

    # ---- what the table and the book know --------------------------------------

    @property
    def engines(self) -> dict[int, EngineState]:
        """rank -> what this client knows of it (the `RankTable`'s)."""
        return self.table.engines

    @property
    def engine_ranks(self) -> list[int]:
        """The ranks of every engine this client sends to."""
        return self.table.ranks

    @property
    def router(self) -> Router:
        return self.table.router

    @property
    def has_coordinator(self) -> bool:
        """A DP coordinator feeds this client (loads, rank states, per-rank figures)."""
        return self._coordinator is not None

    @property
    def current_wave(self) -> int:
        return self.news.wave

    @property
    def engines_running(self) -> bool:
        return self.news.running

    def describe_ranks(self) -> str:
        """`rank 0 serving, rank 1 dead (exit code -9)`."""
        return self.table.describe()

    def engine_of(self, request_id: str) -> int | None:
        """The rank of the engine running a request in flight (None: not in flight)."""
        return self.book.rank_of(request_id)

    def request_state_sizes(self) -> dict[str, int]:
        """Entries of the per-request structures (0 once every request has ended)."""
        return {"client_inflight": len(self.book.flights), "client_calls": len(self._calls),
                "client_outputs_queued": self._outputs.qsize(),
                "client_rank_requests": sum(e.num_requests for e in self.engines.values())}

    # ---- requests ------------------------------------------------------------

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to an engine (`engine_of(request_id)` says which).

        The request's `client_index` is set to this client's, so that its
        outputs come back here, its `current_wave` to the wave it last heard of, and
        its session (which placed it) is not sent (`routing.sendable`).
        """
        self.check_alive()
        if request.request_id in self.book.flights:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        route = RouteTrace(self.table, request) if request.trace_headers is not None else None
        sent = sendable(request, self.client_index, self.current_wave)
        with route or contextlib.nullcontext():  # a `route` span until sent (route_trace.py)
            for _ in range(len(self.engines)):  # each retry follows a rank's death
                engine = route.choose() if route else self.table.choose(request)
                try:
                    return await self._add_at(engine, route.carried_by(sent) if route else sent)
                except EngineUnavailableError:  # a rank found gone is marked dead: try
                    if engine.serving or self.dead:  # another, unless that is not why
                        raise
            raise EngineUnavailableError("no engine is serving: " + self.table.describe())

    async def _add_at(self, engine: EngineState, request: EngineCoreRequest) -> None:
        """Send `request` (as sent) to `engine`, the rank chosen for it."""
        await self.lora_replay.ensure(self, engine.rank, engine.status.incarnation,
                                      request.lora_name)  # N = 1: a restarted rank
        sent = self.book.add(request, engine.rank, first_leg(request) if self.table.hands_off(
            request, engine, self.max_model_len) else None)  # a handoff's first leg
        self.table.assign(engine, len(request.prompt_token_ids))
        try:
            await self.send(engine, RequestType.ADD, sent)
        except BaseException:
            self._forget(request.request_id)
            raise
        await self.wake_if_paused(request, engine)

    async def wake_if_paused(self, request: EngineCoreRequest, engine: EngineState) -> None:
        if self.lockstep and not self.news.running:
            # Paused: our engine starts itself, the coordinator the others; assume running.
            self.news.running = True
            await self.coordinator().send(WakeEngines(request.current_wave, engine.rank))

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests at the engines that own them; unknown ids are ignored.

        Each aborted request still gets its final output (finish reason ABORT).
        """
        if self.dead:
            return
        by_rank, cancelled = self.book.abort_plan(request_ids, self.table)
        for rid, rank in cancelled:  # mid-handoff: no engine holds them
            self.put_output(ended(rank, rid))
        for rank, ids in by_rank.items():
            engine = self.engines.get(rank)  # None: removed (its requests are moving)
            with contextlib.suppress(EngineUnavailableError):  # gone: nothing to abort there
                if engine is not None:
                    await self.send(engine, RequestType.ABORT, ids)

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

    def put_output(self, outputs: EngineCoreOutputs) -> None:
        self._outputs.put_nowait(outputs)

    def _forget(self, request_id: str) -> None:
        flight = self.book.pop(request_id)
        if flight is not None:
            self.table.release(flight.rank)

    async def abort_now(self, rank: int, request_ids: list[str]) -> None:
        """ABORT at `rank` without waiting for it (it may be gone, or back)."""
        with contextlib.suppress(zmq.ZMQError):
            await self._sockets.send(engine_identity(rank), RequestType.ABORT, request_ids,
                                     flags=zmq.NOBLOCK)

    async def send(self, engine: EngineState, request_type: RequestType, body: Any) -> None:
        await self._sockets.wait_for(lambda: engine.registered, self._dead_event,
                                     self.register_timeout)
        self.check_alive()
        if not engine.registered:
            raise TimeoutError(f"engine {engine.rank} did not register with front-end "
                               f"{self.client_index} within {self.register_timeout:.0f} s")
        try:
            await self._sockets.send(engine.identity, request_type, body)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the engine is gone
            reason = f"unreachable: {e}"
            self.mark_engine_dead(engine.rank, reason)
            raise EngineUnavailableError(f"engine {engine.rank} is {reason}") from e

    # ---- utility calls -------------------------------------------------------------

    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0, result_type: Any = None) -> Any:
        """Run utility `method` in an engine (`EngineCore.call_utility`); its result.

        engine: the rank (default: the lowest live one). result_type: convert
        the msgpack result to this type (e.g. SchedulerStats). Raises
        UtilityCallError with the engine's message when the call failed there,
        EngineDeadError when the engine dies, TimeoutError after `timeout` s.
        """
        self.check_alive()
        if engine is not None and engine not in self.engines:
            raise ValueError(f"no engine of rank {engine} (engines: {sorted(self.engines)})")
        target = self.engines[engine] if engine is not None else self.table.placeable()[0]
        return await self._calls.call(
            lambda call: self.send(target, RequestType.UTILITY, call), target.rank, method,
            args, timeout, result_type)

    async def call_utility_all(self, method: str, *args: Any, timeout: float = 30.0,
                               result_type: Any = None) -> dict[int, Any]:
        """`call_utility` on every live engine at once: rank -> its result."""
        live = [e.rank for e in self.table.placeable()]
        results = await asyncio.gather(*(
            self.call_utility(method, *args, engine=rank, timeout=timeout,
                              result_type=result_type) for rank in live))
        return dict(zip(live, results))

    def coordinator(self) -> CoordinatorLink:
        """The link to the DP coordinator (callers check `has_coordinator` first)."""
        assert self._coordinator is not None
        return self._coordinator

    def new_id(self) -> str:
        """An id unique to this client among every API server's (scale requests)."""
        return f"api{self.client_index}-{next(self._calls.ids)}-{id(self):x}"

    # ---- rank news, and carrying out what the table and the book decide -----------------

    @_on_loop
    def set_rank_status(self, rank: int, status: RankStatus) -> None:
        """News of a rank (the coordinator's, or its launcher's); callable from any thread.
        A rank that stops serving has its requests moved (`RankTable.apply_status`)."""
        self.moves.apply(self.table.apply_status(rank, status))

    @_on_loop
    def mark_engine_dead(self, rank: int, reason: str) -> None:
        """Direct evidence that a rank's current process is gone; callable from any thread."""
        self.moves.apply(self.table.mark_dead(rank, reason))

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    # ---- the socket readers ------------------------------------------------------------

    async def _read_registrations(self) -> None:
        """The ROUTER only ever receives each engine's empty registration frame."""
        async for rank, registration in self._sockets.registrations():
            if rank not in self.engines and not (self.table.elastic and registration):
                logger.warning("message from unexpected engine rank %d ignored", rank)
            elif registration:  # an unknown rank: scaling up (elastic), kept for later
                logger.debug("engine %d registered with front-end %d", rank,
                             self.client_index)
                self.moves.apply(self.table.register(rank))

    async def _read_outputs(self) -> None:
        async for outputs in self._sockets.outputs():
            if isinstance(outputs, EngineCoreOutputs):
                self._dispatch(outputs)
            elif outputs in self.engines:  # ENGINE_CORE_DEAD from that rank
                self.mark_engine_dead(outputs, "fatal error (ENGINE_CORE_DEAD); see its log")
            else:
                logger.error("ENGINE_CORE_DEAD from an unknown engine: %r", outputs)

    async def _read_coordinator(self) -> None:
        """Keep the coordinator's news; apply its rank states, loads and figures."""
        async for update in self.coordinator().updates():
            self.news.note(update)
            for change in self.table.apply_update(update):
                self.moves.apply(change)
            self.lora_replay.reconcile(self)  # ranks that missed an adapter

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        engine = self.engines.get(outputs.engine_index)
        if engine is not None and outputs.scheduler_stats is not None:
            engine.stats = outputs.scheduler_stats
        if outputs.control is not None:  # no coordinator: the engine's own state
            self.news.controls.update(outputs.control)
        self._calls.resolve(outputs.utility_output)
        kept = []
        for out in outputs.outputs:
            passed, finished = self.book.accept(outputs.engine_index, out)
            if finished:
                self._forget(out.request_id)
            if passed is not None:
                kept.append(passed)
        if kept:
            self._outputs.put_nowait(msgspec.structs.replace(outputs, outputs=kept))
        for request_id in self.book.take_pending():  # first legs done: continue elsewhere
            self._spawn(self.handoffs.hand_off(request_id))

    # ---- death and closing ---------------------------------------------------------------

    @_on_loop
    def mark_dead(self, reason: str) -> None:
        """Declare the engines dead (callable from any thread; idempotent)."""
        if self.dead:
            return
        if not self.closed:
            logger.error("engine client %d: engines dead: %s", self.client_index, reason)
        self.dead, self.dead_reason = True, reason
        self._calls.fail_all(reason)
        self._outputs.put_nowait(_DEAD)
        self._dead_event.set()

    def watch_processes(self, procs: Sequence[BaseProcess]) -> None:
        """Mark the client dead when any of these (local, spawned here) processes exits."""
        threading.Thread(target=_watch, args=(procs, self._watch_stop, self.mark_dead),
                         name="engine-process-watcher", daemon=True).start()

    def check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead_reason)

    async def aclose(self) -> None:
        """Stop the socket tasks, then close; pending calls fail (idempotent)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.shutdown()

    def shutdown(self) -> None:
        """Close without awaiting the tasks (prefer `aclose` inside the loop)."""
        if self.closed:
            return
        self.closed = True
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


def _watch(procs: Sequence[BaseProcess], stop: threading.Event,
           mark_dead: Callable[[str], None]) -> None:
    """Until `stop`: when one of `procs` exits, reap it and `mark_dead(why)`."""
    by_sentinel = {p.sentinel: p for p in procs}
    while not stop.is_set():
        exited = connection.wait(list(by_sentinel), timeout=0.5)
        if exited:
            p = by_sentinel[exited[0]]  # type: ignore[index]
            p.join(timeout=1.0)  # reap: its exit code becomes known
            mark_dead(f"process {p.name} (pid {p.pid}) exited with code {p.exitcode}")
            return


def from_config(config: EngineConfig, input_address: str | Sequence[str],
                      output_address: str | Sequence[str], *, engine_ranks: Sequence[int],
                      client_index: int = 0, max_model_len: int | None = None,
                      coordinator_address: str | None = None,
                      load_balance: str = DEFAULT_LOAD_BALANCE, share_prefixes: bool = False,
                      ) -> AsyncEngineClient:
    """The engine client of one front-end, its policies taken from `config` (lockstep,
    secret, migrations, failure policy, elastic, KV block size and host tier, LoRA,
    prefill / decode roles); the
    one place both the API server and the offline LLM build it. `share_prefixes`: one of
    several API servers (docs/design/engine-client.md). Call inside the loop it will use."""
    parallel = config.parallel
    client = AsyncEngineClient(input_address, output_address, engine_ranks=engine_ranks,
                             client_index=client_index, max_model_len=max_model_len,
                             coordinator_address=coordinator_address,
                             load_balance=load_balance,
                             lockstep=parallel.data_parallel_lockstep,
                             secret=parallel.data_parallel_secret,
                             max_migrations=parallel.max_request_migrations,
                             fail_stop=parallel.engine_failure_policy == "stop",
                             elastic=parallel.elastic, block_size=config.cache.block_size,
                             loras=dict(config.lora.modules) if config.lora else None,
                             kv_tier=bool(config.cache.kv_offload_bytes),
                             share_prefixes=share_prefixes)
    client.table.roles = roles_of(parallel.data_parallel_roles)  # --data-parallel-roles
    return client
