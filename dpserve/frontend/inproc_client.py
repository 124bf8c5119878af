"""An engine client that runs a real `EngineCore` in a background thread.

It has the async interface of the socket client (`AsyncEngineClient`):
`add_request`, `abort_requests`, `call_utility`, `get_output`, `dead`,
`shutdown`, so `AsyncLLM` and the server run on either. It is how the server
runs without extra processes, and what front-end tests use.

Threads: the engine thread owns the `EngineCore` (nothing else touches it
once the thread runs). The asyncio loop that first calls an async method
owns the client side; the two meet in a thread-safe input queue (loop ->
engine) and `loop.call_soon_threadsafe` (engine -> loop). If a step raises,
the client is dead: pending utility calls and `get_output` raise
`EngineDeadError`, and so does every later call.

Not here: several engines (data parallel), sockets, processes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Any

from dpserve.config import EngineConfig
from dpserve.engine.core import UTILITY_METHODS, EngineCore
from dpserve.frontend.errors import EngineDeadError
from dpserve.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

logger = logging.getLogger(__name__)

_SHUTDOWN = object()  # input-queue sentinel
_DEAD = object()  # output-queue sentinel


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

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run `EngineCore.<method>(*args)` between two steps (a method of
        `UTILITY_METHODS`, as in an engine process); returns its result."""
        loop = self._ready()
        if method not in UTILITY_METHODS:
            raise ValueError(f"the engine has no utility method {method!r}")
        call_id = next(self._call_ids)
        future = loop.create_future()
        self._calls[call_id] = future
        self._inputs.put(("utility", call_id, method, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

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
            result, error = getattr(self.core, method)(*args), None
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
