"""Draft-free speculative decoding, the scheduler's side: n-gram (prompt lookup)
proposals, and what a verified step leaves behind.

Scope: `--speculative-config '{"method": "ngram", ...}'` (`SpeculativeConfig`).
`SpecDecoder`: up to K drafts for a running request about to decode one token
(the tokens after the earliest earlier occurrence of its longest suffix n-gram,
vLLM's rule); their KV slots (`allocate`: a lookahead, never in the prefix
cache); how many drafts a step carries (`plan`: each request's acceptance rate,
`DraftState`, against the step's fitted cost, `StepCosts`); the rollback past
rejected drafts (`verified`). `can_speculate`: the requests that never get
drafts (structured output, logprobs, penalties, seeded sampling, pooling...).

Invariants: drafts are never in `Request.all_token_ids` (or in a block hash) and
`num_computed_tokens` never counts them; `Request.spec_token_ids` holds the
drafts of the step in flight only. The proposer reads only the request's own
tokens, so a request that moves to another engine carries nothing.

Not here: verification (`dpserve.model.spec_verify`), the config's parsing
(`dpserve.engine_config.SpeculativeConfig`).

Design: docs/design/speculative-decoding.md
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpserve.engine.kv_cache import KVCacheManager
from dpserve.engine.request import Request
from dpserve.engine_config import SpeculativeConfig
from dpserve.protocol import SchedulerStats
from dpserve.step import SchedulerOutput

# Only the last SEARCH_WINDOW tokens are searched: bounded work per step whatever the
# request's length (a copy source further back gets no proposals).
SEARCH_WINDOW = 8192
# Acceptance rates: a request's counts decay by DECAY per verified step, and a new
# request starts as if PRIOR_WEIGHT drafts had gone at the engine's rate.
DECAY = 0.8
PRIOR_WEIGHT = 2.0
# Step costs: observations decay by COST_DECAY each (about the last 100 decode
# steps count); the fit is used once COST_MIN_STEPS were seen over two sizes.
COST_DECAY = 0.99
COST_MIN_STEPS = 8


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


class DraftState:
    """What the proposer keeps on a request (`Request.draft_state`): its tokens as a
    growing numpy array, and how its drafts fared (decayed counts)."""

    __slots__ = ("array", "size", "accepted", "rejected", "verified")

    def __init__(self, tokens: list[int], prior: float) -> None:
        self.array = np.array(tokens, dtype=np.int64)
        self.size = len(tokens)
        # As if PRIOR_WEIGHT drafts had been accepted or rejected at the engine's rate.
        self.accepted = PRIOR_WEIGHT * prior
        self.rejected = PRIOR_WEIGHT * (1.0 - prior)
        self.verified = 0  # steps that verified its drafts

    @property
    def rate(self) -> float:
        """The chance that a draft is accepted once the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def settled(self, accepted: int, rejected: bool) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + rejected
        self.verified += 1

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


class StepCosts:
    """A decode-shaped step's time as F + c x rows: exponentially weighted least
    squares over the steps observed (`observe`), refitted on demand (`fit`)."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        d = COST_DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(F, c) in seconds, or None before COST_MIN_STEPS steps, while the steps
        (as weighted) are of one size, or when they do not show a positive cost per
        row and a non-negative fixed one."""
        if self.steps < COST_MIN_STEPS:
            return None
        spread = self.n * self.sxx - self.sx * self.sx  # n^2 x the rows' variance
        if spread <= 1e-9 * self.n * self.sxx:
            return None
        per_row = (self.n * self.sxy - self.sx * self.sy) / spread
        fixed = (self.sy - per_row * self.sx) / self.n
        if per_row <= 0 or fixed < 0:
            return None
        return fixed, per_row


def choose_drafts(offers: list[tuple[int, float, int]], rows: int,
                  costs: tuple[float, float] | None) -> dict[int, int]:
    """How many drafts each offer keeps: {offer index: count}.

    offers: (index, acceptance rate r, drafts proposed k); rows: the step's other
    rows (one per running request); costs: (F, c) or None (take every draft).
    Draft i of an offer is worth r^i tokens; drafts are taken, most valuable first,
    while the step's expected tokens over F + c x rows grows: a draft worth v
    joins a step of T tokens and N rows iff v > T c / (F + c N).
    """
    if costs is None:
        return {index: k for index, _, k in offers}
    fixed, per_row = costs
    values = sorted(((rate ** i, index) for index, rate, k in offers
                     for i in range(1, k + 1)), reverse=True)
    tokens, taken = float(rows), dict.fromkeys((index for index, _, _ in offers), 0)
    for value, index in values:
        if value * (fixed + per_row * rows) <= tokens * per_row:
            break
        tokens, rows = tokens + value, rows + 1
        taken[index] += 1
    return taken


@dataclass
class SpecDecodeCounters:
    """Cumulative per engine (SchedulerStats; vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # speculative rows verified (requests x steps)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of them accepted
    num_rejections: int = 0  # speculative rows with a rejected draft

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
        self.costs = StepCosts()
        self._planned: dict[str, np.ndarray] = {}  # this step's drafts per request id

    def plan(self, running: list[Request]) -> None:
        """Propose drafts for this step's running requests about to compute their last
        known token, and keep those worth their rows (`choose_drafts`); `allocate`
        hands them out. Nothing when `disable_by_batch_size` is below the batch."""
        self._planned.clear()
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        offers, proposals = [], []
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            drafts = self._propose(request)
            if len(drafts):
                offers.append((len(proposals), request.draft_state.rate, len(drafts)))
                proposals.append((request.request_id, drafts, request.draft_state))
        if not offers:
            return
        kept = choose_drafts(offers, len(running), self.costs.fit())
        for index, (request_id, drafts, state) in enumerate(proposals):
            if not state.verified:  # a probe: one draft starts its own rate
                kept[index] = max(kept[index], 1)
            if kept[index]:
                self._planned[request_id] = drafts[:kept[index]]

    def _propose(self, request: Request) -> np.ndarray:
        """Up to K draft tokens for a running request about to compute its last known
        token (none past its end, none for one `can_speculate` turns away)."""
        params = request.sampling_params
        # No drafts past the request's end: each step appends at most k + 1 tokens.
        most = min(self.config.num_speculative_tokens,
                   self.max_model_len - request.num_tokens - 1)
        if params.max_tokens is not None:
            most = min(most, params.max_tokens - request.num_output_tokens - 1)
        if most <= 0 or not can_speculate(request):
            return np.empty(0, dtype=np.int64)
        state = request.draft_state
        if state is None:
            state = request.draft_state = DraftState(request.all_token_ids, self.rate)
        return propose_ngram(state.sync(request.all_token_ids), self.config.prompt_lookup_min,
                             self.config.prompt_lookup_max, most)

    @property
    def rate(self) -> float:
        """The engine's acceptance rate so far (a new request's starting estimate)."""
        accepted, rejected = self.counters.num_accepted_tokens, self.counters.num_rejections
        return (accepted + 1) / (accepted + rejected + 2)

    def allocate(self, kv_cache: KVCacheManager, request: Request,
                 budget: int) -> tuple[list[int] | None, int]:
        """Blocks for a running request's last known token and the drafts planned for
        it (at most `budget`), or without drafts when those do not fit: (its block
        table or None, the number of drafts), as `KVCacheManager.allocate_slots`.
        Sets `request.spec_token_ids`."""
        drafts = self._planned.pop(request.request_id, None)
        request.spec_token_ids = drafts[:max(budget, 0)].tolist() if drafts is not None else []
        if request.spec_token_ids:
            block_ids = kv_cache.allocate_slots(request, 1,
                                                num_lookahead_tokens=len(request.spec_token_ids))
            if block_ids is not None:
                return block_ids, len(request.spec_token_ids)
            request.spec_token_ids = []
        return kv_cache.allocate_slots(request, 1), 0

    def observe_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """A step's forward took `seconds` (EngineCore.step): what a row costs is
        learnt from the decode-shaped steps."""
        so = scheduler_output
        if so.scheduled and so.num_decodes == len(so.scheduled):
            self.costs.observe(so.total_num_tokens, seconds)

    def verified(self, request: Request, num_produced: int, num_appended: int) -> None:
        """A speculative row came back: `num_produced` tokens (its accepted drafts and
        one more), `num_appended` of them kept (fewer when one ended the request). Only
        the accepted drafts' KV stays valid: the computed count goes back to them."""
        counters = self.counters
        proposed, accepted = len(request.spec_token_ids), num_produced - 1
        counters.num_drafts += 1
        counters.num_draft_tokens += proposed
        counters.num_accepted_tokens += accepted
        counters.num_rejections += accepted < proposed
        if request.draft_state is not None:
            request.draft_state.settled(accepted, accepted < proposed)
        request.num_computed_tokens += num_appended - 1
        request.spec_token_ids = []
