"""An engine client that runs a real `EngineCore` in a background thread.

It has the async interface of the socket client (`AsyncEngineClient`):
`add_request`, `abort_requests`, `call_utility`, `get_output`, `dead`,
`shutdown`, and implements the same `ClusterView` (`dpserve.frontend.cluster`)
with one engine's answers: rank 0 serving, no DP coordinator, nothing ever
moved, no run-time scaling; pause / sleep need an engine process (ValueError:
a 400). So `AsyncLLM` and the server run on either; front-end and HTTP tests
use it to serve without extra processes.

Threads: the engine thread owns the `EngineCore` (nothing else touches it
once the thread runs). The asyncio loop that first calls an async method
owns the client side; the two meet in a thread-safe input queue (loop ->
engine) and `loop.call_soon_threadsafe` (engine -> loop). If a step raises,
the client is dead: pending utility calls and `get_output` raise
`EngineDeadError`, and so does every later call.

Not here: several engines (data parallel), sockets, processes, pause / sleep.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Any

import msgspec

from dpserve.config import EngineConfig
from dpserve.engine.core import EngineCore
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError
from dpserve.frontend.migration import HandoffCounts, MovedCounts
from dpserve.frontend.rank_table import RankView
from dpserve.protocol import (
    ControlState,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LoRAChange,
    RankState,
    ScaleStatus,
)

logger = logging.getLogger(__name__)

_SHUTDOWN = object()  # input-queue sentinel
_DEAD = object()  # output-queue sentinel
# What an engine process answers itself, not its EngineCore: one engine has no DP state.
_PROCESS_UTILITIES = {"get_dp_state": lambda: None}


class InprocEngineClient:
    """`EngineCore` on a background thread, behind the async engine-client API."""

    def __init__(self, config: EngineConfig, engine_index: int = 0,
                 core: EngineCore | None = None) -> None:
        self.engine_index = engine_index
        self.core = core if core is not None else EngineCore(config)
        # The engine's own limit (the config's, capped by the KV-cache size).
        self.max_model_len: int = self.core.scheduler.max_model_len
        self.num_kv_blocks: int = self.core.num_kv_blocks
        self.dead = False
        self.current_wave = 0  # no DP waves
        self.autoscale_decisions: list[int] | None = None
        self._loras = dict(config.lora.modules) if config.lora else None
        self._death: EngineDeadError | None = None
        self._closed = False
        self._inputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue[Any] | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}  # call_id -> pending utility call
        self._call_ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name=f"EngineCore_{engine_index}",
                                        daemon=True)
        self._thread.start()

    # ---- the async API (loop side) -------------------------------------------

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._ready()
        self._inputs.put(("add", request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead and not self._closed:
            self._inputs.put(("abort", list(request_ids)))

    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0, result_type: Any = None) -> Any:
        """Run utility `method` of the core's table (`EngineCore.call_utility`) between
        two steps, as in an engine process; returns its result.
        `engine`: None or 0 (the one engine); TimeoutError after `timeout` s."""
        loop = self._ready()
        if engine not in (None, 0):
            raise ValueError(f"no engine of rank {engine} (engines: [0])")
        if method in _PROCESS_UTILITIES:
            return _PROCESS_UTILITIES[method]()
        if method not in self.core.utilities:
            raise ValueError(f"the engine has no utility method {method!r}")
        call_id = next(self._call_ids)
        future = loop.create_future()
        self._calls[call_id] = future
        self._inputs.put(("utility", call_id, method, args))
        try:
            result = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine 0 did not answer {method}() within "
                               f"{timeout:.0f} s") from None
        finally:
            self._calls.pop(call_id, None)
        if result_type is None or (isinstance(result_type, type)
                                   and isinstance(result, result_type)):
            return result
        return msgspec.convert(result, result_type)

    async def call_utility_all(self, method: str, *args: Any, timeout: float = 30.0,
                               result_type: Any = None) -> dict[int, Any]:
        return {0: await self.call_utility(method, *args, timeout=timeout,
                                           result_type=result_type)}

    async def get_output(self) -> EngineCoreOutputs:
        """The next message from the engine; raises EngineDeadError once it died."""
        self._bind()
        assert self._outputs is not None
        item = await self._outputs.get()
        if item is _DEAD:
            self._outputs.put_nowait(_DEAD)  # every later call fails too
            assert self._death is not None
            raise self._death
        return item

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (idempotent; callable from any thread)."""
        if not self._closed:
            self._closed = True
            self._inputs.put((_SHUTDOWN,))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s", timeout)

    # ---- ClusterView: one engine's answers ------------------------------------------

    @property
    def cluster(self) -> InprocEngineClient:
        return self  # it is its own ClusterView

    @property
    def dead_reason(self) -> str | None:
        return str(self._death) if self._death is not None else None

    @property
    def data_parallel_size(self) -> int:
        return 1

    @property
    def has_coordinator(self) -> bool:
        return False

    @property
    def elastic(self) -> bool:
        return False

    @property
    def control(self) -> ControlState:
        return ControlState()  # never paused nor asleep: pause / sleep need a process

    @property
    def moved(self) -> MovedCounts:
        return MovedCounts()  # one engine: nowhere to move a request

    @property
    def handoffs(self) -> HandoffCounts:
        return HandoffCounts()  # one engine: no roles

    def take_handoff_latencies(self) -> list[float]:
        return []

    def ranks(self) -> list[RankView]:
        return [RankView(0, RankState.SERVING)]

    def queued(self) -> list[tuple[int, int]]:
        return []  # no queue figures: admission never answers 429

    def session_rank(self, key: str) -> int | None:
        return None  # one engine: no placement to remember

    def request_state_sizes(self) -> dict[str, int]:
        return {}  # the engine's own sizes come from its `request_state_sizes` utility

    async def change_control(self, op: str, arg: str | int | None = None,
                             timeout: float = 600.0) -> ControlState:
        raise ValueError(f"{op} needs an engine process (dpserve serve); the in-process "
                         f"engine has no pause / sleep")

    async def request_scale(self, num_engines: int, timeout: float) -> ScaleStatus:
        raise EngineUnavailableError("this server cannot change its engine count")

    @property
    def loras(self) -> dict[str, str] | None:
        return self._loras  # LoRA registry: the one engine holds what it lists

    async def change_lora(self, change: LoRAChange) -> None:
        assert self._loras is not None
        if change.op == "add":
            self._loras[change.name] = change.path
        else:
            self._loras.pop(change.name, None)

    async def control_rank(self, rank: int, action: str) -> None:
        raise ValueError("per-rank controls go through the DP coordinator, and this "
                         "server has none (--data-parallel-size 1)")

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._outputs = loop, asyncio.Queue()
        elif self._loop is not loop:
            raise RuntimeError("InprocEngineClient is bound to another event loop")
        return loop

    def _ready(self) -> asyncio.AbstractEventLoop:
        loop = self._bind()
        if self.dead:
            assert self._death is not None
            raise self._death
        if self._closed:
            raise EngineDeadError("the engine client was shut down")
        return loop

    # ---- the engine thread ---------------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                # 1. Take every queued input; block only when there is nothing to run.
                early = self._take_inputs(block=not core.has_unfinished_requests())
                if early is None:
                    return  # shutdown
                # 2. Step: schedule -> execute -> update.
                outputs = early + (core.step() if core.has_unfinished_requests() else [])
                # 3. Hand new tokens and a stats snapshot to the loop.
                self._to_loop(self._outputs_put, EngineCoreOutputs(
                    engine_index=self.engine_index, outputs=outputs,
                    scheduler_stats=core.get_stats(), timestamp=time.monotonic()))
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine %d died", self.engine_index)
            self._death = EngineDeadError(f"engine {self.engine_index} died: {e!r}")
            self.dead = True
            self._to_loop(self._fail_all)

    def _take_inputs(self, block: bool) -> list[EngineCoreOutput] | None:
        """Apply queued inputs; returns outputs they made (None: shut down)."""
        outputs: list[EngineCoreOutput] = []
        item = self._inputs.get() if block else self._get_nowait()
        while item is not None:
            kind = item[0]
            if kind is _SHUTDOWN:
                return None
            if kind == "add":
                outputs.extend(self._add(item[1]))
            elif kind == "abort":
                outputs.extend(self.core.abort_requests(item[1]) or [])
            elif kind == "utility":
                self._call(*item[1:])
            item = self._get_nowait()
        return outputs

    def _get_nowait(self) -> Any:
        try:
            return self._inputs.get_nowait()
        except queue.Empty:
            return None

    def _add(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        try:
            self.core.add_request(request)
            return []
        except ValueError as e:
            # Front-ends validate first; if one did not, fail the request, not the engine.
            logger.warning("engine %d rejected request %s: %s", self.engine_index,
                           request.request_id, e)
            return [EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)]

    def _call(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            result, error = self.core.call_utility(method, *args), None
        except Exception as e:  # noqa: BLE001 - reported to the caller
            result, error = None, e
        self._to_loop(self._resolve, call_id, result, error)

    def _to_loop(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed meanwhile: nobody is listening

    # ---- loop-side callbacks (run on the loop thread) --------------------------

    def _outputs_put(self, outputs: EngineCoreOutputs) -> None:
        assert self._outputs is not None
        self._outputs.put_nowait(outputs)

    def _resolve(self, call_id: int, result: Any, error: BaseException | None) -> None:
        future = self._calls.get(call_id)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _fail_all(self) -> None:
        assert self._death is not None
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self._death)
        if self._outputs is not None:
            self._outputs.put_nowait(_DEAD)
