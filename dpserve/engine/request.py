"""The engine's view of one request: its tokens, progress and status.

A `Request` lives inside `EngineCore` from `add_request` until it finishes.
The scheduler moves it between the waiting and running queues and advances
`num_computed_tokens`; the KV-cache manager owns its blocks (keyed by
`request_id`); `update_from_output` appends sampled tokens and decides stops.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from dpserve.engine.pooling import PoolingState
from dpserve.protocol import EngineCoreOutput, FinishReason, PoolingParams, TokenLogprobs
from dpserve.sampling_params import SamplingParams
from dpserve.step import ScheduledRequest

if TYPE_CHECKING:
    from dpserve.tracing.engine_trace import RequestTrace

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One generation request.

    Invariant: `all_token_ids == prompt_token_ids + output_token_ids`, and
    `0 <= num_computed_tokens <= num_tokens`. A request needs a sampled
    token exactly when a step brings `num_computed_tokens` to `num_tokens`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        prior_output_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        lora_id: int = 0,
        lora_cache_key: str | None = None,
        pooling: PoolingParams | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.engine_arrival = time.monotonic()  # this engine's clock (arrival_time may not be)
        # Scheduling (--scheduling-policy priority, engine.waiting_queue): lower runs first;
        # requests of one priority are shared out between tenants (None: one tenant).
        self.priority = priority
        self.tenant = tenant
        self.first_token_at: float | None = None  # when this engine sampled its first token
        self.scheduled_at: float | None = None  # when this engine first scheduled it

        # A migrated request arrives with the tokens another engine already
        # generated: they count as outputs (max_tokens, min_tokens, penalties),
        # and their KV is computed here like the prompt's.
        self.output_token_ids: list[int] = list(prior_output_token_ids or [])
        self.all_token_ids: list[int] = [*prompt_token_ids, *self.output_token_ids]
        self.num_computed_tokens = 0
        # Prompt tokens whose KV came from the prefix cache (first schedule only).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Hashes of this request's full blocks, filled by the KV-cache manager; the first
        # block's parent is the root of its salt (block_hash.root_hash; None: unsalted).
        self.cache_salt = cache_salt
        # The LoRA adapter (engine id, 0: none) and its prefix-cache key, folded into
        # the root too: two adapters never share cached blocks.
        self.lora_id = lora_id
        self.lora_cache_key = lora_cache_key
        self.block_hashes: list[bytes] = []  # sha256 digests (block_hash.hash_block)
        self._init_features(sampling_params, pooling)

    def _init_features(self, sampling_params: SamplingParams,
                       pooling: PoolingParams | None) -> None:
        """The state of optional features: structured output, prompt logprobs, pooling,
        tracing, speculative decoding."""
        # structured.manager.RequestGrammar when the output is constrained, else None.
        self.grammar: Any = None
        # Prompt logprobs (sampling_params.prompt_logprobs): entry i is for prompt token
        # i + 1, filled chunk by chunk, sent once with the first output token.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        # A pooling (embedding) request: its pooled result so far (engine.pooling); it
        # finishes when its prompt is computed, sampling nothing. None: generation.
        self.pooling = PoolingState(pooling) if pooling is not None else None
        # Its spans' record when it is traced (dpserve.tracing.engine_trace), else None.
        self.trace: RequestTrace | None = None
        # Speculative decoding (engine.spec_decode): the drafts of the step in flight (in
        # no count), and the proposer's copy of the tokens (made from them when missing).
        self.spec_token_ids: list[int] = []
        self.draft_state: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True until the prompt logprobs are sent: while it is, the prompt is computed
        in full (no prefix-cache hit), so that every position has logits."""
        return self.prompt_logprobs is not None

    @property
    def needs_every_position(self) -> bool:
        """True while every prompt position must be computed here (no prefix-cache or
        host-tier hit): for prompt logprobs not yet sent, and for mean pooling."""
        return self.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.params.pooling_type == "mean")

    def add_pooled(self, start: int, part: Any) -> bool:
        """A step's share of this running pooling request (a chunk from `start` to
        `num_computed_tokens`: engine.pooling); True when the step computed its last
        prompt token: it is then finished (stop), `pooled_output` its last output."""
        assert self.pooling is not None
        self.pooling.add(start, self.num_computed_tokens, part)
        if self.num_computed_tokens < self.num_tokens:
            return False
        self.status = RequestStatus.FINISHED_STOPPED
        return True

    def pooled_output(self, now: float) -> EngineCoreOutput:
        """The output that finishes a pooling request: no tokens, its vector."""
        assert self.pooling is not None
        return EngineCoreOutput(self.request_id, [], finish_reason=self.finish_reason,
                                num_cached_tokens=max(self.num_cached_tokens, 0),
                                phase_times=self.phase_times(now),
                                pooled=self.pooling.result(self.num_tokens))

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprobs]) -> None:
        """Entries for prompt tokens start+1, start+2, ... (one computed chunk). A chunk
        computed again after a preemption replaces what it covers."""
        if self.prompt_logprobs is not None and start <= len(self.prompt_logprobs):
            self.prompt_logprobs[start:] = entries

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """The prompt logprobs, once (None when not asked for or already taken)."""
        entries, self.prompt_logprobs = self.prompt_logprobs, None
        return entries

    def phase_times(self, now: float) -> list[float]:
        """[queued, prefill, decode] seconds in this engine, for a request finishing now."""
        scheduled = self.engine_arrival if self.scheduled_at is None else self.scheduled_at
        first = now if self.first_token_at is None else self.first_token_at
        return [scheduled - self.engine_arrival, first - scheduled, now - first]

    def for_step(self, start: int, num_new_tokens: int, block_ids: list[int],
                 sample: bool) -> ScheduledRequest:
        """The plain record of this request's share of a step, for the model runner
        (it refers to `all_token_ids`: no copy of the tokens). The step's drafts
        (`spec_token_ids`) come after the known tokens, on top of `num_new_tokens`."""
        if self.trace is not None:
            self.trace.scheduled(start, num_new_tokens, len(self.prompt_token_ids))
        return ScheduledRequest(
            self.request_id, self.all_token_ids, len(self.prompt_token_ids), start,
            num_new_tokens + len(self.spec_token_ids), block_ids, sample,
            self.sampling_params, self.eos_token_id, self.grammar,
            self.prompt_logprobs is not None, lora_id=self.lora_id,
            pooling=self.pooling.params.pooling_type if self.pooling is not None else None,
            spec_token_ids=self.spec_token_ids)

    def preempt(self) -> None:
        """Its KV is gone (the scheduler freed it): it waits to recompute from the
        start (prompt + outputs so far, possibly from the prefix cache)."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.num_preemptions += 1
        if self.trace is not None:
            self.trace.preempted()

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
