"""The offline API: `LLM(...).generate(prompts, params)`, shaped like vLLM's.

One engine (`data_parallel_size=1`, the default): the LLM drives an
in-process `EngineCore` directly; no threads, no processes.

Data parallel (`data_parallel_size=N`, N > 1): the LLM starts N engine
processes and the DP coordinator exactly as `dpserve serve` does
(`launch_engines`) and spreads its requests over them with the
server's load-balancing `AsyncEngineClient`, whose asyncio loop runs on a
thread the LLM owns (`SyncEngineClient`, a thin sync adapter). A request may
pin an engine with `data_parallel_rank`.

Both engines offer the LLM the same small sync surface (`_Engine`:
add_request / abort_requests / has_unfinished_requests / step), so request
building, the generate loop, output processing (detokenising, stop strings,
n > 1, logprobs: `OutputProcessor`) and clean-up are one code path.
Tokenising, chat templates, detokenising and stop strings happen here, in
the front-end, not in the engine.

Lifecycle (N > 1, or tensor_parallel_size > 1: the in-process engine's
workers): `shutdown()`, leaving a `with LLM(...) as llm:` block,
garbage collection and interpreter exit all stop every process
(terminate -> join -> kill); the engines and the coordinator also exit by
themselves when this process dies. When any of them dies, `generate()`
raises `EngineDeadError`, stops the others, and every later call raises it
again. Every wait is bounded and checks that the processes are alive.

Scripts that use N > 1 need the usual `if __name__ == "__main__":` guard:
the engine processes are spawned, and spawning re-imports the main module.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import itertools
import logging
import operator
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dpserve.config import ConfigError, EngineArgs, EngineConfig, ParallelConfig
from dpserve.frontend.output_processor import OutputProcessor
from dpserve.frontend.sync_client import SyncEngineClient
from dpserve.frontend.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from dpserve.generation_config import log_generation_defaults
from dpserve.launch.host import launch_engines
from dpserve.lora_request import LoRARequest
from dpserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from dpserve.protocol import EngineCoreOutput, EngineCoreRequest, PoolingParams, SchedulerStats
from dpserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

_SAVE_TIMEOUT_S = 3600.0  # save_sharded_state through an engine process: reads and writes
# A prompt is text, or {"prompt_token_ids": [...]} (optionally with "prompt").
PromptType = str | dict[str, Any]



class _Engine(Protocol):
    """What the LLM drives: `EngineCore` itself (N == 1) or `SyncEngineClient` (N > 1)."""

    def add_request(self, request: EngineCoreRequest) -> None: ...  # ValueError: can never run
    def abort_requests(self, request_ids: list[str]) -> Any: ...  # unknown ids are ignored
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[EngineCoreOutput]: ...  # the next outputs (may be empty)
    def reset_prefix_cache(self) -> bool: ...


class LLM:
    """Generate text offline with one engine, or N engine processes.

    `LLM()` serves the built-in default model; every engine option
    (see `EngineArgs`, or `dpserve generate --help`) is a keyword argument,
    and unknown ones fail with a message naming them.
    `data_parallel_size=N` (N > 1) runs N engine processes (module docstring);
    call `shutdown()` or use `with LLM(...) as llm:` to stop them early.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config: EngineConfig = EngineArgs.from_kwargs(model=model, **kwargs).create_config()
        _check_offline_parallel(self.config.parallel)
        self.data_parallel_size = self.config.parallel.data_parallel_size
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        self.eos_token_id, extra_eos_ids = eos_token_ids(
            self.tokenizer, dict(self.config.model.hf_config))
        self._processor = OutputProcessor(self.tokenizer, self.eos_token_id, extra_eos_ids)
        log_generation_defaults(self.config.model.generation_defaults)
        self._counter = itertools.count()
        # LoRA adapters loaded into the engines so far: name -> path (--lora-modules too).
        self._loras: dict[str, str] = dict(self.config.lora.modules if self.config.lora
                                           else ())
        self.engine: _Engine | None
        if self.data_parallel_size == 1:
            from dpserve.engine.core import EngineCore

            core = EngineCore(self.config)
            self.engine = core
            # Its tensor-parallel workers (if any) stop with the LLM.
            self._finalizer: weakref.finalize = weakref.finalize(self, core.shutdown)
        else:
            engines = launch_engines(self.config, num_clients=1)
            try:
                client = SyncEngineClient(engines, self.config)
            except BaseException:
                engines.close()
                raise
            self.engine = client
            self._finalizer = weakref.finalize(self, client.shutdown)
        # Also before multiprocessing's exit hook, which would join the engines forever.
        atexit.register(self._finalizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (vLLM's
        name; none with generation_config='vllm')."""
        return SamplingParams(**dict(self.config.model.generation_defaults))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 data_parallel_rank: int | Sequence[int | None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate completions for `prompts`, returned in the same order.

        `data_parallel_rank` pins the engine that runs each prompt: one rank
        for all, or one (or None) per prompt. Unpinned prompts go to the
        least-loaded engine. `lora_request`: the LoRA adapter of every prompt, or
        one (or None: the base model) per prompt (needs `enable_lora=True`); an
        adapter is loaded into the engines the first time its name is seen.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        ranks = self._ranks_list(data_parallel_rank, len(prompts))
        loras = self._lora_names(lora_request, len(prompts))
        ids: list[str] = []
        with self._cleanup_on_error(ids):
            for prompt, p, rank, lora in zip(prompts, params, ranks, loras):
                text, token_ids = self._tokenize(prompt)
                ids.append(self._add(text, token_ids, p, rank, lora))
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             data_parallel_rank: int | Sequence[int | None] | None = None,
             ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = self._params_list(sampling_params, len(conversations))
        ranks = self._ranks_list(data_parallel_rank, len(conversations))
        ids: list[str] = []
        with self._cleanup_on_error(ids):
            for conv, p, rank in zip(conversations, params, ranks):
                token_ids = apply_chat_template(self.tokenizer, list(conv),
                                                add_generation_prompt, chat_template)
                ids.append(self._add(self.tokenizer.decode(token_ids), token_ids, p, rank))
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              data_parallel_rank: int | Sequence[int | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): the model's final
        hidden state (after its final norm) pooled over the prompt as
        `pooling_params` says (default: the `pooler_config` option's, e.g. the last
        token's, normalised). The prompts run batched through the same engines as
        `generate`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        pooler = self.config.model.pooler
        pooling = (pooling_params if pooling_params is not None
                   else PoolingParams(pooler.pooling_type, pooler.normalize))
        ranks = self._ranks_list(data_parallel_rank, len(prompts))
        params = SamplingParams(max_tokens=1)  # nothing is sampled
        ids: list[str] = []
        with self._cleanup_on_error(ids):
            for prompt, rank in zip(prompts, ranks):
                text, token_ids = self._tokenize(prompt)
                ids.append(self._add(text, token_ids, params, rank, pooling=pooling))
        return [_embedding(out) for out in self._run(ids, use_tqdm)]

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes (in every engine); False if requests still hold blocks."""
        return self._live_engine().reset_prefix_cache()

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> list[str]:
        """vLLM's: every tensor-parallel worker writes its own shard of the weights to
        directory `path` (`model-rank-{rank}-part-{part}.safetensors`, a new part past
        `max_size` bytes), with the model's config and tokenizer files; serve it with
        `load_format="sharded_state"` at the same tensor_parallel_size. The files
        written (`dpserve.checkpoint.sharded_state`)."""
        engine = self._live_engine()
        target = str(Path(path).resolve())  # the engines' working directory may differ
        if isinstance(engine, SyncEngineClient):  # every DP rank holds the same shards
            return engine.call_utility("save_sharded_state", target, pattern, max_size,
                                       rank=0, timeout=_SAVE_TIMEOUT_S)
        return engine.call_utility(  # type: ignore[attr-defined]
            "save_sharded_state", target, pattern, max_size)

    def get_stats(self, data_parallel_rank: int = 0) -> SchedulerStats:
        """A scheduler snapshot of one engine (`data_parallel_rank`, default 0)."""
        self._check_rank(data_parallel_rank)
        engine = self._live_engine()
        if isinstance(engine, SyncEngineClient):
            return engine.get_stats(data_parallel_rank)
        return engine.get_stats()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Stop the engine processes (N > 1) or drop the engine (N == 1); idempotent.

        Later calls raise RuntimeError.
        """
        self._finalizer()
        atexit.unregister(self._finalizer)
        self.engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals -------------------------------------------------------

    def _live_engine(self) -> _Engine:
        if self.engine is None:
            raise RuntimeError("this LLM was shut down")
        return self.engine

    def _params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {n} prompts but {len(params)} sampling params")
        return params

    def _ranks_list(self, ranks: Any, n: int) -> list[int | None]:
        if ranks is None or isinstance(ranks, int):
            ranks = [ranks] * n
        ranks = list(ranks)
        if len(ranks) != n:
            raise ValueError(f"got {n} prompts but {len(ranks)} data_parallel_rank values")
        for rank in ranks:
            self._check_rank(rank)
        return ranks

    def _check_rank(self, rank: Any) -> None:
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.data_parallel_size):
            raise ValueError(f"data_parallel_rank {rank!r} is out of range: this LLM's "
                             f"engines are 0..{self.data_parallel_size - 1}")

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            try:  # plain ints (numpy ones too), for the engine and the wire
                ids = [operator.index(t) for t in prompt["prompt_token_ids"]]
            except TypeError:
                raise ValueError("prompt token ids must be integers") from None
            return prompt.get("prompt"), ids
        raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids'")

    def _lora_names(self, requests: Any, n: int) -> list[str | None]:
        """One adapter name (or None) per prompt; adapters not seen before are loaded
        into every engine (utility `add_lora`; ValueError when one refuses)."""
        if requests is None or isinstance(requests, LoRARequest):
            requests = [requests] * n
        requests = list(requests)
        if len(requests) != n:
            raise ValueError(f"got {n} prompts but {len(requests)} lora_request values")
        for r in requests:
            if r is not None and not isinstance(r, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {r!r}")
            if r is not None and self._loras.get(r.lora_name) != r.lora_path:
                self._load_lora(r)
        return [r.lora_name if r is not None else None for r in requests]

    def _load_lora(self, r: LoRARequest) -> None:
        if r.lora_name in self._loras:
            raise ValueError(f"LoRA adapter {r.lora_name!r} is loaded from "
                             f"{self._loras[r.lora_name]}, not {r.lora_path}")
        engine = self._live_engine()
        if isinstance(engine, SyncEngineClient):
            for rank in range(self.data_parallel_size):
                engine.call_utility("add_lora", r.lora_name, r.lora_path, rank=rank)
        else:
            engine.call_utility("add_lora", r.lora_name, r.lora_path)  # type: ignore[attr-defined]
        self._loras[r.lora_name] = r.lora_path

    def _add(self, text: str | None, token_ids: list[int], params: SamplingParams,
             data_parallel_rank: int | None = None, lora_name: str | None = None,
             pooling: PoolingParams | None = None) -> str:
        """Register one request with the output processor and send it to the engine."""
        engine = self._live_engine()
        request_id = str(next(self._counter))
        engine_requests = self._processor.add_request(
            request_id, text, token_ids, params, arrival_time=time.monotonic(),
            data_parallel_rank=data_parallel_rank, lora_name=lora_name, pooling=pooling)
        try:
            for req in engine_requests:
                engine.add_request(req)
        except BaseException:
            self._abort([request_id])
            raise
        return request_id

    def _abort(self, request_ids: list[str]) -> None:
        """Forget requests here and abort them in the engine (the engine stays usable)."""
        engine_ids = [e for rid in request_ids for e in self._processor.engine_request_ids(rid)]
        for rid in request_ids:
            self._processor.abort_request(rid)
        if engine_ids and self.engine is not None:
            self.engine.abort_requests(engine_ids)

    @contextlib.contextmanager
    def _cleanup_on_error(self, request_ids: list[str]):
        """A failure while adding a batch (bad prompt, Ctrl-C) aborts the ones added."""
        try:
            yield
        except BaseException:
            self._abort(request_ids)
            raise

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self._live_engine()
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(request_ids), use_tqdm)
        generated, start = 0, time.monotonic()
        try:
            while engine.has_unfinished_requests():
                # 1. Step (in-process) or wait for the engines' next outputs (N > 1).
                engine_outputs = engine.step()
                generated += sum(len(o.new_token_ids) for o in engine_outputs)
                # 2. Detokenise, stop strings, n > 1 fan-in; stop-string hits end in the engine.
                processed = self._processor.process_outputs(engine_outputs)
                if processed.reqs_to_abort:
                    engine.abort_requests(processed.reqs_to_abort)
                # 3. Collect finished requests.
                for out in processed.request_outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    bar.set_postfix_str(f"{generated / (time.monotonic() - start):.1f} tok/s",
                                        refresh=False)
        except BaseException:
            # Leave the engine clean for the next call (e.g. after Ctrl-C).
            self._abort([r for r in request_ids if r not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]


def _embedding(out: RequestOutput) -> EmbeddingRequestOutput:
    """A finished pooling request's output as vLLM's `EmbeddingRequestOutput`."""
    if out.pooled is None:
        reason = out.outputs[0].finish_reason if out.outputs else None
        raise RuntimeError(f"request {out.request_id} ended without an embedding "
                           f"(finish reason {reason})")
    vector = array.array("f", out.pooled)  # little-endian float32 (every supported host)
    if sys.byteorder != "little":
        vector.byteswap()
    return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(vector.tolist()),
                                  out.prompt_token_ids)


def _check_offline_parallel(parallel: ParallelConfig) -> None:
    """The offline LLM runs every engine on this host, as local processes, behind itself."""
    for ok, option, why in (
            (not parallel.has_remote_engines, "data_parallel_size_local",
             "every engine runs on this host"),
            (parallel.data_parallel_rank is None, "data_parallel_rank",
             "no external load balancing; pin ranks with generate(data_parallel_rank=...)"),
            (not parallel.data_parallel_hybrid_lb, "data_parallel_hybrid_lb",
             "no hybrid load balancing"),
            (parallel.data_parallel_backend == "mp", "data_parallel_backend",
             "engines run as local processes ('mp')")):
        if not ok:
            raise ConfigError(f"{option} is not supported by the offline LLM ({why}); "
                              f"use `dpserve serve` for multi-host launches")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
