"""AsyncLLM: the asyncio front-end that the HTTP server drives.

It tokenises prompts (and applies chat templates; the server does it on one
tokenizer thread, `in_tokenizer_thread`, so a huge prompt does not stall the
event loop and every other client's stream), validates requests before
they reach an engine, registers them with the `OutputProcessor` (DELTA
outputs: each update carries only the new text, with possible stop-string
starts held back) and sends the engine requests through an engine client
(the socket client, or `dpserve.testing`'s in-process one). One background task reads the
engine's outputs, runs the output processor, aborts stop-string hits in the
engine and feeds one asyncio queue per request.

Lifecycle rules, enforced here:

* A request whose consumer stops iterating (client disconnect, cancellation,
  `aclose()`) is aborted in the engine. The bookkeeping in that path is
  synchronous, so it also works inside a cancelled scope.
* When the engine dies, every request in flight fails at once with
  `EngineDeadError`, and so does every later `generate()`.

The server knows the engines only through `AsyncLLM.cluster`, a `ClusterView`
(`dpserve.frontend.cluster`): ranks, pause / sleep, scaling, utility calls.

Not here: load balancing over several engines (the engine client; a request
may pin an engine with `data_parallel_rank`), HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from dpserve.config import EngineConfig
from dpserve.frontend.cluster import ClusterView
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError, RequestError
from dpserve.frontend.output_processor import OutputKind, OutputProcessor
from dpserve.frontend.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from dpserve.outputs import RequestOutput
from dpserve.prompt import PromptError, check_prompt
from dpserve.protocol import (
    NO_TAGS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    PoolingParams,
    RequestTags,
    SchedulerStats,
    Session,
)
from dpserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ABORTED = object()  # queue sentinel: abort() ended the request
# One thread, as vLLM's: a Hugging Face tokenizer is not safe to mutate from two
# threads at once, and one is enough to keep the event loop free.
TOKENIZER_THREADS = 1
_T = TypeVar("_T")


class EngineClient(Protocol):
    """What AsyncLLM needs from an engine client (in-process or over sockets): the
    request path, and the `ClusterView` it hands the server (`cluster`)."""

    dead: bool
    max_model_len: int | None  # the engines' limit (READY, KV-capped); None: unknown

    @property
    def cluster(self) -> ClusterView: ...
    def request_state_sizes(self) -> dict[str, int]: ...

    async def add_request(self, request: EngineCoreRequest) -> None: ...
    async def abort_requests(self, request_ids: list[str]) -> None: ...
    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0, result_type: Any = None) -> Any: ...
    async def get_output(self) -> EngineCoreOutputs: ...
    def shutdown(self) -> None: ...


@dataclass
class FinishedRequestStats:
    """One finished completion (n > 1 requests report one per completion)."""

    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # seconds from arrival to finish


@dataclass
class IterationStats:
    """What one engine message did to the requests it touched."""

    num_prompt_tokens: int = 0  # prompts that got their first token in this message
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, one per request
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # [queued, prefill, decode] seconds of each completion its engine finished
    phase_times: list[list[float]] = field(default_factory=list)
    phase_tenants: list[str | None] = field(default_factory=list)  # beside phase_times
    # (tenant, prompt tokens, generated tokens) of each request finished
    tenant_tokens: list[tuple[str | None, int, int]] = field(default_factory=list)


class StatsListener(Protocol):
    """Gets every engine message's stats (the Prometheus metrics implement it)."""

    def record(self, engine_index: int | None, scheduler_stats: SchedulerStats | None,
               iteration: IterationStats | None) -> None: ...
    # engine_index None: not from an engine message (a request aborted in the front-end)


@dataclass
class _Tracked:
    """Front-end state of one request in flight."""

    queue: asyncio.Queue[Any]  # RequestOutput | BaseException | _ABORTED
    num_prompt_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float = 0.0
    num_generated: int = 0
    tenant: str | None = None  # RequestTags.tenant (per-tenant metrics)


class AsyncLLM:
    """Generate over an engine client, one async stream of deltas per request.

    `max_model_len` is the engine's limit: the client's (`client.max_model_len`,
    e.g. from the engine's READY message, capped by its KV cache) when it has
    one, else the config's. `chat_template` (`--chat-template`'s text) replaces
    the tokenizer's.
    """

    def __init__(self, config: EngineConfig, client: EngineClient,
                 tokenizer: Any | None = None, chat_template: str | None = None) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(
            config.model.tokenizer)
        if chat_template:
            self.tokenizer.chat_template = chat_template
        self.eos_token_id, extra_eos_ids = eos_token_ids(
            self.tokenizer, dict(config.model.hf_config))
        self.vocab_size = int(config.model.hf_config["vocab_size"])
        self.max_model_len = int(client.max_model_len or config.model.max_model_len)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_id, extra_eos_ids)
        self.scheduler_stats: dict[int, SchedulerStats] = {}  # engine index -> latest
        self._requests: dict[str, _Tracked] = {}
        self._listeners: list[StatsListener] = []
        self._output_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._dead_error: EngineDeadError | None = None
        # Set by the server on SIGTERM: it takes no new work (HTTP 503) while
        # the requests in flight finish; generate() itself does not check it.
        self.draining = False
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="dpserve-tokenizer")

    @property
    def cluster(self) -> ClusterView:
        """The engines as the server may see and steer them (module docstring)."""
        return self.client.cluster

    # ---- prompts ----------------------------------------------------------

    async def in_tokenizer_thread(self, fn: Callable[..., _T], *args: Any, **kwargs: Any
                                  ) -> _T:
        """`fn(*args, **kwargs)` (tokenising, a chat template) on the tokenizer thread,
        so the event loop serves other clients meanwhile; same result, same errors."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool,
                                          functools.partial(fn, *args, **kwargs))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`tools` (OpenAI `tools` entries) go to templates that render them."""
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt,
                                   tools=tools)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 data_parallel_rank: int | None = None, pooling: bool = False) -> None:
        """Raise RequestError if the engine could never run this request (`pooling`: a
        pooling request, which needs no room for a completion)."""
        ranks = [r.rank for r in self.client.cluster.ranks()]
        if data_parallel_rank is not None and data_parallel_rank not in ranks:
            raise RequestError(f"data_parallel_rank {data_parallel_rank} is out of range: "
                               f"this server's engines are {ranks}",
                               param="data_parallel_rank")
        try:
            check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size,
                         max_tokens=0 if pooling else params.max_tokens)
        except PromptError as e:
            raise RequestError(str(e), param=e.param, code=e.code) from None
        if params.seed is not None and not -(2**63) <= params.seed <= 2**63 - params.n:
            raise RequestError("seed must fit in a signed 64-bit integer", param="seed")

    # ---- generation -------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, prompt_text: str | None = None,
                       data_parallel_rank: int | None = None,
                       cache_salt: str | None = None, lora_name: str | None = None,
                       session: Session | None = None,
                       pooling: PoolingParams | None = None, tags: RequestTags = NO_TAGS,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA RequestOutputs for one request until it finishes.

        `data_parallel_rank` pins the engine that runs it; `session` (the conversation
        it continues) places it with its earlier turns unless that rank cannot take it
        (`dpserve.frontend.routing`); `lora_name` names the LoRA
        adapter it runs with (None: the base model); `tags`: its priority, tenant and trace
        context (every engine request carries them). `pooling`: a pooling (embedding)
        request: one final output, its vector in `RequestOutput.pooled`. Raises RequestError
        (before anything is sent) for a request that can never run,
        EngineDeadError if the engine dies.
        """
        self._check_alive()
        self.validate(prompt_token_ids, params, data_parallel_rank, pooling is not None)
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._start_output_task()
        arrival = time.monotonic()
        engine_requests = self.processor.add_request(
            request_id, prompt_text, list(prompt_token_ids), params, kind=OutputKind.DELTA,
            arrival_time=arrival, data_parallel_rank=data_parallel_rank,
            cache_salt=cache_salt, lora_name=lora_name, session=session, pooling=pooling,
            tags=tags)
        tracked = _Tracked(asyncio.Queue(), len(prompt_token_ids), arrival, tenant=tags.tenant)
        self._requests[request_id] = tracked
        finished = False
        try:
            for request in engine_requests:
                await self.client.add_request(request)
            while not finished:
                item = await tracked.queue.get()
                if item is _ABORTED:
                    finished = True  # abort() already cleaned up
                    return
                if isinstance(item, BaseException):
                    finished = True  # nothing to abort: the engine is gone
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort_nowait(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream, if any, just ends without a final output)."""
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str) -> None:
        """Forget a request here and abort it in the engine; safe when cancelled."""
        engine_ids = self.processor.engine_request_ids(request_id)
        self.processor.abort_request(request_id)
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            tracked.queue.put_nowait(_ABORTED)  # ends the stream if someone else reads it
        if tracked is not None and not self.is_dead:
            self._notify(None, None, IterationStats(finished=[FinishedRequestStats(
                "abort", tracked.num_prompt_tokens, tracked.num_generated,
                time.monotonic() - tracked.arrival)]))
        if engine_ids and not self.is_dead:
            self._spawn(self.client.abort_requests(engine_ids))

    async def abort_all(self) -> int:
        """Abort every request in flight in the engines (end of a drain).

        Unlike `abort()`, each stream still ends normally: its final output
        comes from the engine with finish reason "abort". Returns how many
        requests were in flight.
        """
        engine_ids = [eid for rid in self._requests
                      for eid in self.processor.engine_request_ids(rid)]
        if engine_ids and not self.is_dead:
            await self.client.abort_requests(engine_ids)
        return len(self._requests)

    # ---- engine outputs -----------------------------------------------------

    def _start_output_task(self) -> None:
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(
                self._output_loop(), name="dpserve-output-loop")

    async def _output_loop(self) -> None:
        try:
            while True:
                # 1. Wait for the engine's next message.
                outputs = await self.client.get_output()
                # 2. Detokenise, check stop strings, feed each request's queue.
                to_abort = self._process(outputs)
                # 3. Stop-string hits end in the front-end: end them in the engine too.
                if to_abort:
                    await self.client.abort_requests(to_abort)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:  # noqa: BLE001 - a broken loop is as bad as a dead engine
            logger.exception("the output loop failed")
            self._fail_all(EngineDeadError(f"the front-end output loop failed: {e!r}"))

    def _process(self, outputs: EngineCoreOutputs) -> list[str]:
        failed = [o for o in outputs.outputs if o.error is not None]
        if failed:  # requests no rank could take over (the engine client says why)
            self._fail_requests(failed)
            outputs = msgspec.structs.replace(
                outputs, outputs=[o for o in outputs.outputs if o.error is None])
        phased = [o for o in outputs.outputs if o.phase_times is not None]
        tenants = [self._tenant_of(o.request_id) for o in phased]  # before they finish
        processed = self.processor.process_outputs(outputs.outputs)
        now = time.monotonic()
        iteration = IterationStats(phase_times=[o.phase_times for o in phased
                                                if o.phase_times is not None],
                                   phase_tenants=tenants)
        for out in processed.request_outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            self._account(tracked, out, now, iteration)
            if out.finished:
                del self._requests[out.request_id]
            tracked.queue.put_nowait(out)
        if outputs.scheduler_stats is not None:
            self.scheduler_stats[outputs.engine_index] = outputs.scheduler_stats
        self._notify(outputs.engine_index, outputs.scheduler_stats, iteration)
        return processed.reqs_to_abort

    def _tenant_of(self, engine_request_id: str) -> str | None:
        tracked = self._requests.get(self.processor.parent_of(engine_request_id) or "")
        return tracked.tenant if tracked is not None else None

    @staticmethod
    def _account(tracked: _Tracked, out: RequestOutput, now: float,
                 iteration: IterationStats) -> None:
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if tracked.first_token is None:
                tracked.first_token = now
                iteration.num_prompt_tokens += tracked.num_prompt_tokens
                iteration.time_to_first_tokens.append(now - tracked.arrival)
            else:
                iteration.inter_token_latencies.append(now - tracked.last_token)
            tracked.last_token = now
            tracked.num_generated += new_tokens
            iteration.num_generation_tokens += new_tokens
        if out.finished:  # n > 1: tokens are the request's, over all completions
            iteration.tenant_tokens.append((tracked.tenant, tracked.num_prompt_tokens,
                                            tracked.num_generated))
            for c in out.outputs:
                iteration.finished.append(FinishedRequestStats(
                    c.finish_reason or "abort", tracked.num_prompt_tokens,
                    tracked.num_generated, now - tracked.arrival))

    def _fail_requests(self, failed: list[EngineCoreOutput]) -> None:
        """End each failed request's stream with EngineUnavailableError; abort its
        other completions (n > 1) in their engines."""
        for out in failed:
            request_id = self.processor.parent_of(out.request_id)
            if request_id is None:
                continue
            siblings = [e for e in self.processor.engine_request_ids(request_id)
                        if e != out.request_id]
            self.processor.abort_request(request_id)
            tracked = self._requests.pop(request_id, None)
            if tracked is not None:
                tracked.queue.put_nowait(EngineUnavailableError(out.error or "failed"))
            if siblings:
                self._spawn(self.client.abort_requests(siblings))

    def _fail_all(self, error: EngineDeadError) -> None:
        """The engine is gone: fail every request in flight now."""
        self._dead_error = error
        for request_id, tracked in list(self._requests.items()):
            self.processor.abort_request(request_id)
            tracked.queue.put_nowait(error)
        self._requests.clear()

    # ---- stats, state, shutdown ----------------------------------------------

    def request_state_sizes(self) -> dict[str, int]:
        """Entries of every per-request structure of the front-end: this object, the
        output processor and the engine client (leak checks: all 0 once idle)."""
        return {"tracked": len(self._requests), "background_tasks": len(self._background),
                **self.processor.state_sizes(), **self.client.request_state_sizes()}

    def add_stats_listener(self, listener: StatsListener) -> None:
        self._listeners.append(listener)

    def _notify(self, engine_index: int | None, stats: SchedulerStats | None,
                iteration: IterationStats | None) -> None:
        for listener in self._listeners:
            try:
                listener.record(engine_index, stats, iteration)
            except Exception:  # noqa: BLE001 - metrics never break serving
                logger.exception("stats listener failed")

    async def get_stats(self) -> SchedulerStats:
        """A fresh scheduler snapshot from the engine (a utility call)."""
        self._check_alive()
        result = await self.client.call_utility("get_stats")
        return result if isinstance(result, SchedulerStats) else msgspec.convert(
            result, SchedulerStats)

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None or bool(self.client.dead)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self.client.dead:
            raise EngineDeadError()

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no running loop (interpreter shutdown): nothing to abort into
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def shutdown(self) -> None:
        """Stop reading outputs and shut the engine client down (from any thread)."""
        task = self._output_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.client.shutdown()
