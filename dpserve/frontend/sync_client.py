"""SyncEngineClient: the offline LLM's sync adapter over `AsyncEngineClient` (N > 1).

It presents the small sync surface the LLM drives (`add_request`,
`abort_requests`, `has_unfinished_requests`, `step`, a few utilities), as an
in-process `EngineCore` does, over N engine processes started by
`dpserve.launch.host.launch_engines`; the async client lives on an asyncio
loop on a daemon thread this adapter owns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, NoReturn

from dpserve.config import EngineConfig
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError
from dpserve.prompt import check_prompt
from dpserve.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats

if TYPE_CHECKING:
    from dpserve.frontend.engine_client import AsyncEngineClient
    from dpserve.launch.host import EngineLaunch

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # longest wait for engine outputs before checking the processes are alive
_CALL_TIMEOUT_S = 60.0  # a send or utility call through the client's loop
_CLOSE_TIMEOUT_S = 5.0  # closing the client and its loop thread
_SEND_BATCH = 64  # requests handed to the client's loop per round trip


class SyncEngineClient:
    """A sync adapter over `AsyncEngineClient`, shaped like `EngineCore` for the LLM.

    It owns `engines` (stopped by `shutdown()`) and an asyncio loop on a
    daemon thread, where the client lives; one task there moves every engine
    message to a thread-safe queue that `step()` reads. Requests are checked
    here as `EngineCore.add_request` would (an engine process answers a bad
    request with a bare abort), then placed by the client: a pinned
    `data_parallel_rank`, else the least-loaded engine by the coordinator's
    counts. Not thread-safe: one caller thread at a time (as `EngineCore`).

    Death: an engine or the coordinator exiting, or ENGINE_CORE_DEAD, makes
    `step()` (and every later call) raise `EngineDeadError`, after stopping
    everything. Every wait is bounded (`_POLL_S`, `_CALL_TIMEOUT_S`).
    """

    def __init__(self, engines: EngineLaunch, config: EngineConfig) -> None:
        self.engines = engines
        self.ranks = list(engines.ranks)
        self.max_model_len = engines.max_model_len  # the engines' limit (KV-capped)
        self._parallel = config.parallel
        self._config = config
        self._config_max_len = config.model.max_model_len
        self._vocab_size = int(config.model.hf_config["vocab_size"])
        self._in_flight: set[str] = set()  # engine request ids added and not finished
        self._unsent: list[EngineCoreRequest] = []  # added, not yet handed to the client
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | EngineDeadError] = (
            queue.SimpleQueue())
        self._death: EngineDeadError | None = None  # set once: dead or shut down
        self.client: AsyncEngineClient | None = None
        self._pump: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="dpserve-llm-client", daemon=True)
        self._thread.start()
        try:
            self.client = self._call(self._open())
        except BaseException:
            self.shutdown()
            raise

    # ---- EngineCore's request surface ---------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for an engine; ValueError (nothing queued) if it can never run.

        Requests go out in batches of `_SEND_BATCH` (one loop round trip each),
        and at the latest on the next `step()`.
        """
        self._check_alive()
        _check_prompt(request.request_id, request.prompt_token_ids, self._config_max_len,
                      self.max_model_len, self._vocab_size)
        self._unsent.append(request)
        self._in_flight.add(request.request_id)
        if len(self._unsent) >= _SEND_BATCH:
            self._send_unsent()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in their engines; they stop counting as unfinished at once."""
        aborted = set(request_ids)
        self._in_flight -= aborted
        self._unsent = [r for r in self._unsent if r.request_id not in aborted]
        if self._death is None and request_ids:
            with contextlib.suppress(EngineDeadError):  # dead engines have nothing to abort
                self._call(self._client().abort_requests(list(request_ids)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of every engine message that came in; [] after `_POLL_S` without one."""
        self._check_alive()
        self._send_unsent()
        try:
            items = [self._outputs.get(timeout=_POLL_S)]
        except queue.Empty:
            self._check_processes()
            return []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self._outputs.get_nowait())
        outputs: list[EngineCoreOutput] = []
        for item in items:
            if isinstance(item, EngineDeadError):
                if not outputs:
                    self._die(str(item))
                self._outputs.put(item)  # first hand over what came before the death
                break
            outputs.extend(item.outputs)
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:  # no rank could take a request over
            self._in_flight.discard(failed.request_id)
            raise EngineUnavailableError(failed.error)
        for out in outputs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        return outputs

    def _send_unsent(self) -> None:
        if self._unsent:
            batch, self._unsent = self._unsent, []
            self._call(self._add_all(batch))

    async def _add_all(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:  # placed one by one: a burst spreads over the engines
            await self._client().add_request(request)

    # ---- utility calls ---------------------------------------------------------------

    def get_stats(self, rank: int = 0) -> SchedulerStats:
        self._check_alive()
        return self._call(self._client().call_utility("get_stats", engine=rank,
                                                      result_type=SchedulerStats))

    def call_utility(self, method: str, *args: Any, rank: int = 0,
                     timeout: float = 30.0) -> Any:
        """Utility `method` (`EngineCore.call_utility`) in engine `rank` (e.g.
        "expert_info"), answered within `timeout` s."""
        self._check_alive()
        return self._call(self._client().call_utility(method, *args, engine=rank,
                                                      timeout=timeout),
                          max(_CALL_TIMEOUT_S, timeout + 5.0))

    def reset_prefix_cache(self) -> bool:
        self._check_alive()
        return all([self._call(self._client().call_utility("reset_prefix_cache", engine=r))
                    for r in self.ranks])

    # ---- death and shutdown -------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the client, stop its loop thread and every process (idempotent)."""
        if self._death is None:
            self._death = EngineDeadError("the LLM's engines were shut down")
        try:
            self._close_loop()
        finally:
            self.engines.close()

    def _check_alive(self) -> None:
        if self._death is not None:
            raise self._death

    def _check_processes(self) -> None:
        """Between waits: the client and its loop thread are alive (engine processes
        are the supervisor's: it restarts them, or kills the client under policy stop)."""
        if self.client is not None and self.client.dead:
            self._die(self.client.dead_reason or "the engine client is dead")
        if not self._thread.is_alive() or (self._pump is not None and self._pump.done()):
            self._die("the engine client's loop thread stopped")

    def _die(self, reason: str) -> NoReturn:
        """Stop everything, then raise (and keep raising) EngineDeadError(reason)."""
        if self._death is None:
            logger.error("data-parallel engines dead: %s; stopping every process", reason)
            self._death = EngineDeadError(reason)
            self.shutdown()
        raise self._death

    # ---- the loop thread --------------------------------------------------------------------

    def _client(self) -> AsyncEngineClient:
        assert self.client is not None
        return self.client

    def _call(self, coro: Any, timeout: float = _CALL_TIMEOUT_S) -> Any:
        """Run a coroutine on the client's loop and wait (bounded) for its result."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except EngineDeadError as e:  # e.g. an engine died while requests were being added
            self._die(str(e))
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._check_processes()
            raise TimeoutError(f"the engine client did not answer within {timeout:.0f} s "
                               f"(engines alive)") from None

    async def _open(self) -> AsyncEngineClient:
        from dpserve.frontend.engine_client import from_config

        client = from_config(self._config, self.engines.input_binds(0),
                             self.engines.output_binds(0), engine_ranks=self.ranks,
                             max_model_len=self.max_model_len,
                             coordinator_address=self.engines.coordinator_address)
        self.engines.supervise(self._config, on_status=client.set_rank_status,
                               on_fatal=client.mark_dead)
        self._pump = asyncio.get_running_loop().create_task(self._pump_outputs(client))
        return client

    async def _pump_outputs(self, client: AsyncEngineClient) -> None:
        """Loop thread: every engine message (then the death, if any) to `_outputs`."""
        while True:
            try:
                self._outputs.put(await client.get_output())
            except EngineDeadError as e:
                self._outputs.put(e)
                return

    async def _aclose(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self.client is not None:
            await self.client.aclose()

    def _close_loop(self) -> None:
        loop = self._loop
        if loop.is_closed():
            return
        if threading.get_ident() == self._thread.ident:  # e.g. collected on the loop thread
            if self.client is not None:
                self.client.shutdown()
            loop.stop()
            return
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._aclose(), loop).result(_CLOSE_TIMEOUT_S)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(_CLOSE_TIMEOUT_S)
        if not loop.is_running():
            loop.close()


def _check_prompt(request_id: str, ids: list[int], config_max_len: int, engine_max_len: int,
                  vocab_size: int) -> None:
    """Raise ValueError as `EngineCore.add_request` / `Scheduler.add_request` would."""
    check_prompt(ids, config_max_len, vocab_size)
    if len(ids) > engine_max_len:
        raise ValueError(f"request {request_id!r}: prompt of {len(ids)} tokens exceeds the "
                         f"KV cache size ({engine_max_len} tokens)")
