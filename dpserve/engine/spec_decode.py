"""Draft-free speculative decoding, the scheduler's side: n-gram (prompt lookup)
proposals, and what a verified step leaves behind.

Scope: `--speculative-config '{"method": "ngram", ...}'` (`SpeculativeConfig`). Each
step, a running request about to decode one token may get up to K draft tokens:
the tokens that followed the earliest earlier occurrence of its longest suffix
n-gram (prompt_lookup_min <= n <= prompt_lookup_max), vLLM's rule. The scheduler
then computes 1 + k tokens for it (KV slots for the drafts: `allocate_slots`'s
lookahead, never registered in the prefix cache), the runner samples at every one
of those positions and keeps the drafts its own sampling agrees with
(`dpserve.model.spec_verify`), and `SpecDecoder.verified` rolls
`num_computed_tokens` back past the rejected ones: their KV slots are written again
when the request gets that far.

Invariant: drafts are never in `Request.all_token_ids` (or in a block hash) and
`num_computed_tokens` never counts them; `Request.spec_token_ids` holds the drafts
of the step in flight only.

The proposer reads nothing but the request's own tokens (prompt + outputs, kept
in a numpy copy on the request, `Request.draft_state`, made from them when
missing): a request that moves to another engine (its rank died, or a prefill
rank handed it to a decode rank) gets proposals there at once, with nothing to
carry.

Requests that never get drafts (`can_speculate`): structured output, logprobs,
penalties, seeded random sampling (its draws would differ), below min_tokens,
pooling, prompt logprobs not yet sent. Their rows batch beside speculative ones.

Not here: verification (`dpserve.model.spec_verify`), the config's parsing
(`dpserve.engine_config.SpeculativeConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpserve.engine.kv_cache import KVCacheManager
from dpserve.engine.request import Request
from dpserve.engine_config import SpeculativeConfig
from dpserve.protocol import SchedulerStats

# Only the last SEARCH_WINDOW tokens are searched: bounded work per step whatever the
# request's length (a copy source further back gets no proposals).
SEARCH_WINDOW = 8192


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` tokens that followed the earliest occurrence, in the last SEARCH_WINDOW
    tokens, of the longest suffix n-gram of `tokens` (min_n <= n <= max_n; matches
    longer than max_n count as max_n). Empty when none is at least min_n long.

    tokens: [L] int64. Vectorised: O(L) compares for the last token, then
    O(candidates x max_n) for the rest of the n-gram, a few numpy calls in all.
    """
    size = len(tokens)
    if size <= min_n or k <= 0:
        return tokens[:0]
    first = max(0, size - SEARCH_WINDOW)
    # Candidates: positions e < size - 1 where an earlier n-gram ends (its last token
    # equals ours); grow each match backwards while it still matches.
    ends = np.flatnonzero(tokens[first:size - 1] == tokens[size - 1]) + first
    if not len(ends):
        return tokens[:0]
    span = np.arange(min(max_n, size - 1))  # [n] offsets back from a match's end
    back = ends[:, None] - span[None, :]  # [C, n] positions of each candidate's n-gram
    same = (tokens[np.maximum(back, 0)] == tokens[size - 1 - span][None, :]) & (back >= first)
    length = np.cumprod(same, axis=1).sum(axis=1)  # [C] matched suffix length, <= max_n
    best = int(np.argmax(length))  # the longest; the earliest of those (ends ascend)
    if length[best] < min_n:
        return tokens[:0]
    end = int(ends[best]) + 1
    return tokens[end:end + k]


class _Tokens:
    """A request's tokens as a growing numpy array (the proposer's copy)."""

    __slots__ = ("array", "size")

    def __init__(self, tokens: list[int]) -> None:
        self.array = np.array(tokens, dtype=np.int64)
        self.size = len(tokens)

    def sync(self, tokens: list[int]) -> np.ndarray:
        """Append what `tokens` gained since the last call; the tokens as an array."""
        new = len(tokens) - self.size
        if new > 0:
            if self.size + new > len(self.array):
                grown = np.empty(max(2 * len(self.array), self.size + new), dtype=np.int64)
                grown[:self.size] = self.array[:self.size]
                self.array = grown
            self.array[self.size:self.size + new] = tokens[self.size:]
            self.size += new
        return self.array[:self.size]


def can_speculate(request: Request) -> bool:
    """Whether the request may get drafts (see the module docstring)."""
    params = request.sampling_params
    return (request.grammar is None and request.pooling is None and params.logprobs is None
            and not params.needs_penalties and (params.seed is None or params.greedy)
            and request.num_output_tokens >= params.min_tokens
            and request.prompt_logprobs is None)


@dataclass
class SpecDecodeCounters:
    """Cumulative per engine (SchedulerStats; vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # speculative rows verified (requests x steps)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of them accepted

    def fill(self, stats: SchedulerStats) -> None:
        stats.spec_decode_num_drafts = self.num_drafts
        stats.spec_decode_num_draft_tokens = self.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = self.num_accepted_tokens


class SpecDecoder:
    """What the scheduler holds with speculation on: proposes, then settles each row."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.counters = SpecDecodeCounters()

    def active(self, batch: int) -> bool:
        """Whether a step of `batch` running requests proposes drafts at all
        (`disable_by_batch_size`)."""
        limit = self.config.disable_by_batch_size
        return limit is None or batch <= limit

    def propose(self, request: Request, budget: int) -> int:
        """Draft tokens for a running request about to compute its last known token,
        at most `budget`; sets `request.spec_token_ids` and returns their count."""
        request.spec_token_ids = []
        params = request.sampling_params
        # No drafts past the request's end: each step appends at most k + 1 tokens.
        most = min(self.config.num_speculative_tokens, budget,
                   self.max_model_len - request.num_tokens - 1)
        if params.max_tokens is not None:
            most = min(most, params.max_tokens - request.num_output_tokens - 1)
        if most <= 0 or not can_speculate(request):
            return 0
        state = request.draft_state
        if state is None:
            state = request.draft_state = _Tokens(request.all_token_ids)
        drafts = propose_ngram(state.sync(request.all_token_ids), self.config.prompt_lookup_min,
                               self.config.prompt_lookup_max, most)
        request.spec_token_ids = drafts.tolist()
        return len(drafts)

    def allocate(self, kv_cache: KVCacheManager, request: Request,
                 budget: int) -> tuple[list[int] | None, int]:
        """Blocks for a running request's last known token and the drafts proposed for
        it (at most `budget`), or without drafts when those do not fit: (its block
        table or None, the number of drafts), as `KVCacheManager.allocate_slots`."""
        drafts = self.propose(request, budget)
        if drafts:
            block_ids = kv_cache.allocate_slots(request, 1, num_lookahead_tokens=drafts)
            if block_ids is not None:
                return block_ids, drafts
            request.spec_token_ids = []
        return kv_cache.allocate_slots(request, 1), 0

    def verified(self, request: Request, num_produced: int, num_appended: int) -> None:
        """A speculative row came back: `num_produced` tokens (its accepted drafts and
        one more), `num_appended` of them kept (fewer when one ended the request). Only
        the accepted drafts' KV stays valid: the computed count goes back to them."""
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += len(request.spec_token_ids)
        counters.num_accepted_tokens += num_produced - 1
        request.num_computed_tokens += num_appended - 1
        request.spec_token_ids = []
