"""Front-end request state: engine deltas in, user-facing RequestOutputs out.

For every request the front-end keeps its prompt, an incremental
detokenizer per completion and the logprobs so far. A request with n > 1 is
n engine requests ("children") sharing one parent; the parent's output
lists the children's completions by index. Stop strings end a completion
here, and the caller must abort it in the engine (`reqs_to_abort`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from dpserve.frontend.detokenizer import IncrementalDetokenizer
from dpserve.outputs import CompletionOutput, Logprob, RequestOutput
from dpserve.protocol import (
    NO_TAGS,
    EngineCoreOutput,
    EngineCoreRequest,
    PoolingParams,
    RequestTags,
    Session,
    TokenLogprobs,
)
from dpserve.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    FINAL_ONLY = 0  # one RequestOutput when the request finishes (offline)
    DELTA = 1  # every update carries only what is new (streaming)
    CUMULATIVE = 2  # every update carries everything so far


@dataclass
class _Completion:
    index: int
    engine_request_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    completions: list[_Completion]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooled: bytes | None = None  # a pooling request's result (float32 LE)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # engine request ids stopped by a stop string


class OutputProcessor:
    """`eos_token_id` ends every request (unless ignore_eos); `extra_eos_ids`
    (models with several end tokens) are added to each request's stop ids."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None = None,
                 extra_eos_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.extra_eos_ids = list(extra_eos_ids or [])
        self._states: dict[str, _RequestState] = {}
        self._by_engine_id: dict[str, tuple[_RequestState, _Completion]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, kind: OutputKind = OutputKind.FINAL_ONLY,
                    arrival_time: float = 0.0, data_parallel_rank: int | None = None,
                    cache_salt: str | None = None, lora_name: str | None = None,
                    session: Session | None = None,
                    pooling: PoolingParams | None = None,
                    tags: RequestTags = NO_TAGS) -> list[EngineCoreRequest]:
        """Register a request; returns the engine requests to send (n of them),
        pinned to engine `data_parallel_rank` when given, placed by `session` else.
        `pooling`: a pooling (embedding) request, whose output carries
        `RequestOutput.pooled`."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        engine_params = params
        if self.extra_eos_ids and not params.ignore_eos:
            engine_params = _with(params, stop_token_ids=list(params.stop_token_ids)
                                  + self.extra_eos_ids)
        completions, engine_requests = [], []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            child_params = engine_params
            if params.n > 1:
                # Each child samples on its own; a seeded parent stays reproducible.
                seed = None if params.seed is None else params.seed + i
                child_params = _with(engine_params, n=1, seed=seed)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            completions.append(_Completion(i, child_id, detok,
                                           logprobs=[] if params.logprobs is not None else None))
            engine_requests.append(EngineCoreRequest(
                child_id, prompt_token_ids, child_params, self.eos_token_id, arrival_time,
                data_parallel_rank=data_parallel_rank, cache_salt=cache_salt,
                lora_name=lora_name, session=session, pooling=pooling,
                priority=tags.priority, tenant=tags.tenant, trace_headers=tags.trace_headers))
        state = _RequestState(request_id, prompt, prompt_token_ids, params, kind, completions)
        self._states[request_id] = state
        for c in completions:
            self._by_engine_id[c.engine_request_id] = (state, c)
        return engine_requests

    def engine_request_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        return [c.engine_request_id for c in state.completions] if state else []

    def parent_of(self, engine_request_id: str) -> str | None:
        """The user request an engine request belongs to (None: unknown or done)."""
        entry = self._by_engine_id.get(engine_request_id)
        return entry[0].request_id if entry is not None else None

    def state_sizes(self) -> dict[str, int]:
        """Entries of the per-request maps (0 once every request has ended)."""
        return {"processor_states": len(self._states),
                "processor_by_engine_id": len(self._by_engine_id)}

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def abort_request(self, request_id: str) -> None:
        """Forget a request the caller gave up on (the caller aborts it in the engine)."""
        state = self._states.pop(request_id, None)
        for c in state.completions if state else []:
            self._by_engine_id.pop(c.engine_request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self._by_engine_id.get(out.request_id)
            if entry is None:
                continue  # aborted by the caller, or stopped by a stop string earlier
            state, comp = entry
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                # Every child (n > 1) and a migrated request's new engine send the same.
                state.prompt_logprobs = [None, *map(self._convert_logprobs,
                                                    out.prompt_logprobs)]
            if out.pooled is not None:
                state.pooled = out.pooled
            if self._update_completion(comp, out):
                to_abort.append(comp.engine_request_id)
            if comp.finish_reason is not None:
                del self._by_engine_id[comp.engine_request_id]
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            finished = state.finished
            if finished:
                del self._states[state.request_id]
            if finished or state.kind is not OutputKind.FINAL_ONLY:
                results.append(self._make_output(state, finished))
        return ProcessedOutputs(results, to_abort)

    def _update_completion(self, comp: _Completion, out: EngineCoreOutput) -> bool:
        """Apply one engine delta; True if a stop string ended the completion."""
        comp.token_ids.extend(out.new_token_ids)
        if comp.logprobs is not None and out.new_logprobs:
            for lp in out.new_logprobs:
                comp.logprobs.append(self._convert_logprobs(lp))
                comp.cumulative_logprob += lp.logprob
        stop_str = comp.detokenizer.update(out.new_token_ids)
        if stop_str is not None:  # tokens after the one that made it are not output
            del comp.token_ids[len(comp.token_ids) - len(out.new_token_ids)
                               + comp.detokenizer.num_stop_tokens:]
            comp.finish_reason, comp.stop_reason = "stop", stop_str
            return not out.finished
        if out.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = str(out.finish_reason), out.stop_reason
        return False

    def _convert_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        ids = [lp.token_id] + [t for t, _ in lp.top]
        texts = self.tokenizer.convert_ids_to_tokens(ids)
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, texts[0])}
        for rank, ((tid, logprob), text) in enumerate(zip(lp.top, texts[1:]), start=1):
            entry.setdefault(tid, Logprob(logprob, rank, text))
        return entry

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        delta = state.kind is OutputKind.DELTA
        outs = []
        for c in state.completions:
            done = c.finish_reason is not None
            if delta:
                text = c.detokenizer.delta_text(done)
                start, c.num_sent_tokens = c.num_sent_tokens, len(c.token_ids)
                token_ids = c.token_ids[start:]
                logprobs = c.logprobs[start:] if c.logprobs is not None else None
            else:
                text, token_ids, logprobs = c.detokenizer.output_text, c.token_ids, c.logprobs
            outs.append(CompletionOutput(
                index=c.index, text=text, token_ids=list(token_ids),
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs,
                             finished, state.num_cached_tokens, state.prompt_logprobs,
                             pooled=state.pooled)


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)
