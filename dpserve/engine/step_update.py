"""The update slot of a step: what the model runner returned, applied to its requests.

Scope: `StepUpdater`, held by the `Scheduler` (`update_from_output` calls it).
For each sampled row: append its tokens (one, or a speculative row's accepted
run) and check each for a stop; settle the drafts (engine/spec_decode.py); note
the first token's time; hash the blocks that became full; take the top
logprobs; then one `EngineCoreOutput` per request. A pooling request whose
prompt is now computed finishes with its vector (engine/pooling.py). It keeps
the counts heartbeats carry: tokens generated, the recent time to first token.

Invariants: rows are matched to requests by id, so a row of a request finished
or aborted since `schedule()` is skipped. A request that finishes is freed at
once (the caller's `free`), before the next row is applied.

Stop checks, in order: a grammar that took its stop token; below `min_tokens`
only the length limits; EOS (unless `ignore_eos`); a stop token id; then
`max_tokens` and `max_model_len`.

Not here: freeing blocks and leaving the queues (the scheduler), sampling (the
model runner), stop strings (the front-end, which aborts).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dpserve.engine.kv_cache import KVCacheManager
from dpserve.engine.pooling import PoolingCounts
from dpserve.engine.request import Request, RequestStatus
from dpserve.engine.spec_decode import SpecDecoder
from dpserve.protocol import EngineCoreOutput, TokenLogprobs
from dpserve.step import Logprobs, ModelRunnerOutput

TTFT_WINDOW_S = 10.0


class RecentMean:
    """The mean of the values added in the last `window_s` seconds (0.0 when none)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._values: deque[tuple[float, float]] = deque()  # (time, value), oldest first

    def add(self, now: float, value: float) -> None:
        self._values.append((now, value))
        self._drop_old(now)

    def mean(self, now: float) -> float:
        self._drop_old(now)
        return sum(v for _, v in self._values) / len(self._values) if self._values else 0.0

    def _drop_old(self, now: float) -> None:
        while self._values and self._values[0][0] < now - self.window_s:
            self._values.popleft()


class StepUpdater:
    """Applies runner outputs to requests (module docstring)."""

    def __init__(self, max_model_len: int, kv_cache: KVCacheManager,
                 spec: SpecDecoder | None, pooling: PoolingCounts) -> None:
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache  # hashes the blocks a row makes full
        self.spec = spec
        self.pooling = pooling
        # Time to first token inside this engine (arrival -> first sampled token), over
        # the last TTFT_WINDOW_S: heartbeats carry it to the autoscaler and /engines.
        self.recent_ttft = RecentMean(TTFT_WINDOW_S)
        self.num_generated_tokens = 0  # output tokens sampled, cumulative (/engines tokens/s)

    def apply(self, requests: dict[str, Request], runner_output: ModelRunnerOutput,
              free: Callable[[Request], None]) -> tuple[list[EngineCoreOutput], bool]:
        """One delta per request that got a token or finished; True if any finished
        (each already handed to `free`)."""
        logprob_rows = _logprob_rows(runner_output.logprobs)
        for req_id, (start, entries) in runner_output.prompt_logprobs.items():
            request = requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.add_prompt_logprobs(start, entries)
        outputs = []
        any_finished = False
        for row, (req_id, token) in enumerate(zip(runner_output.req_ids,
                                                  runner_output.sampled_token_ids,
                                                  strict=True)):
            request = requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted since schedule(): its row is stale
            produced = runner_output.spec_token_ids.get(req_id) or [token]
            tokens, finished = _append(request, produced, self.max_model_len)
            self.num_generated_tokens += len(tokens)
            if request.spec_token_ids and self.spec is not None:
                self.spec.verified(request, len(produced), len(tokens))
            if request.first_token_at is None:
                request.first_token_at = now = time.monotonic()
                self.recent_ttft.add(now, now - request.engine_arrival)
            self.kv_cache.update_block_hashes(request)
            new_logprobs = None
            num_logprobs = request.sampling_params.logprobs
            if num_logprobs is not None and logprob_rows is not None:
                new_logprobs = [_token_logprobs(logprob_rows, row, num_logprobs)]
            outputs.append(EngineCoreOutput(
                req_id, tokens, finish_reason=request.finish_reason,
                stop_reason=request.stop_reason, new_logprobs=new_logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                prompt_logprobs=request.take_prompt_logprobs(),
                phase_times=request.phase_times(time.monotonic()) if finished else None))
            if finished:
                free(request)
                any_finished = True
        if runner_output.pooled:
            any_finished |= self._apply_pooled(requests, runner_output.pooled, outputs, free)
        return outputs, any_finished

    def _apply_pooled(self, requests: dict[str, Request], pooled: dict[str, tuple[int, Any]],
                      outputs: list[EngineCoreOutput], free: Callable[[Request], None]) -> bool:
        """Each running pooling request's share of the step (requests finished or aborted
        since schedule() are skipped); those whose prompt is now computed finish (stop)
        with their vector. True if any finished."""
        done = [r for req_id, (start, part) in pooled.items()
                if (r := requests.get(req_id)) is not None
                and r.status == RequestStatus.RUNNING and r.add_pooled(start, part)]
        for request in done:
            outputs.append(request.pooled_output(time.monotonic()))
            free(request)
        self.pooling.count_finished(len(done))
        return bool(done)


def _append(request: Request, tokens: list[int], max_model_len: int) -> tuple[list[int], bool]:
    """Append a row's tokens (one, or a speculative row's accepted run), each checked
    for a stop: the tokens kept (up to the one that ended the request, the rest
    discarded) and whether it finished."""
    for i, token in enumerate(tokens):
        request.append_output_token(token)
        if request.grammar is not None:
            request.grammar.accept(token)
        if _check_stop(request, token, max_model_len):
            return tokens[:i + 1], True
    return tokens, False


def _check_stop(request: Request, token: int, max_model_len: int) -> bool:
    """Set a finished status if `token` ends the request; True if it did."""
    params = request.sampling_params
    num_out = request.num_output_tokens
    # 0. A grammar that took its stop token is complete.
    if request.grammar is not None and request.grammar.terminated:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    # 1. Below min_tokens only the length limits below can stop a request.
    if num_out >= params.min_tokens:
        # 2. EOS, 3. stop token ids.
        if token == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
    # 4. Length limits.
    max_tokens = max_model_len if params.max_tokens is None else params.max_tokens
    if num_out >= max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def _logprob_rows(logprobs: Logprobs | None) -> tuple[list, list, list] | None:
    """The runner's tensors as Python lists, converted once per step."""
    if logprobs is None:
        return None
    return (logprobs.token_ids.tolist(), logprobs.logprobs.tolist(),
            logprobs.sampled_ranks.tolist())


def _token_logprobs(rows: tuple[list, list, list], row: int, n: int) -> TokenLogprobs:
    token_ids, logprobs = rows[0][row], rows[1][row]
    return TokenLogprobs(token_id=token_ids[0], logprob=logprobs[0], rank=rows[2][row],
                         top=list(zip(token_ids[1:n + 1], logprobs[1:n + 1], strict=True)))
