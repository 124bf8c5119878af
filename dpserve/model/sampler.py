"""Token sampling for a batch of rows, all in batched tensor ops.

Order of operations (vLLM semantics):

1. logprobs, if any row asks, from the raw model logits (log_softmax);
2. penalties: repetition (prompt + output; divide positive logits, multiply
   negative ones), then frequency and presence (output tokens only); logit_bias;
3. min_tokens: EOS and stop ids get -inf while a row is still too short;
   structured output: tokens a row's grammar forbids get -inf;
4. greedy rows take the argmax; the others go through temperature, min-p,
   top-k, top-p and then inverse-CDF sampling with one uniform draw per row.

Seeded rows draw their uniform from their own `torch.Generator` (kept by the
runner across steps), so they produce the same tokens alone or in any batch;
unseeded rows share the sampler's engine generator. Every stage is skipped
when no row of the batch needs it, so an all-greedy batch is one argmax.

Top-k/top-p avoid a full vocabulary sort: they work on the `topk` candidates
(at least `_TOP_P_CANDIDATES`) and sort a full row only when its nucleus is
not inside them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dpserve.step import Logprobs, ScheduledRequest
from dpserve.structured.manager import apply_bitmask, grammar_bitmask

_TOP_P_CANDIDATES = 128


@dataclass
class PenaltyMetadata:
    """Per-row penalty settings and the tokens they count (rows padded with `vocab`)."""

    presence: torch.Tensor  # [S, 1] float32
    frequency: torch.Tensor  # [S, 1] float32
    repetition: torch.Tensor  # [S, 1] float32
    output_ids: torch.Tensor  # [S, max_output_len] int64, padded with vocab_size
    seen_ids: torch.Tensor  # [S, max_prompt_plus_output] int64, padded with vocab_size


@dataclass
class SamplingMetadata:
    """How to sample each row of a logits batch; built once per step."""

    greedy: torch.Tensor  # [S] bool
    all_greedy: bool
    any_greedy: bool
    temperature: torch.Tensor  # [S] float32 (1.0 for greedy rows)
    min_p: torch.Tensor | None  # [S] float32; None when no row uses min-p
    top_k: torch.Tensor | None  # [S] int64, vocab_size = off; None when no row uses it
    top_p: torch.Tensor | None  # [S] float32, 1.0 = off; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> generator of a seeded sampled row
    penalties: PenaltyMetadata | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) -> -inf
    max_num_logprobs: int | None  # N of the top-N; None when no row asks
    # (bitmask [R, ceil(V/32)] int32, rows [R]) of rows with a grammar; None if none
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, biases) of logit_bias entries; None when no row has one
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_requests(cls, requests: Sequence[ScheduledRequest],
                      generators: Mapping[str, torch.Generator], vocab_size: int,
                      device: torch.device) -> SamplingMetadata:
        """Read every row's SamplingParams; `generators` is keyed by request id."""
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]

        def opt(values: list, off: float | int, dtype: torch.dtype) -> torch.Tensor | None:
            used = any(values[i] != off for i in random_rows)
            return torch.tensor(values, dtype=dtype, device=device) if used else None

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=not random_rows, any_greedy=len(random_rows) < len(params),
            temperature=torch.tensor([1.0 if g else p.temperature
                                      for g, p in zip(greedy, params, strict=True)],
                                     dtype=torch.float32, device=device),
            min_p=opt(min_p, 0.0, torch.float32), top_k=opt(top_k, vocab_size, torch.int64),
            top_p=opt(top_p, 1.0, torch.float32),
            generators={i: generators[requests[i].req_id] for i in random_rows
                        if requests[i].req_id in generators},
            penalties=_penalty_metadata(requests, vocab_size, device),
            min_tokens_mask=_min_tokens_mask(requests, vocab_size, device),
            max_num_logprobs=max(asked) if asked else None,
            grammar=grammar_bitmask(requests, vocab_size),
            logit_bias=_logit_bias(params, vocab_size, device))


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    out = np.full((len(rows), max(1, max(len(r) for r in rows))), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out).to(device)


def _penalty_metadata(requests: Sequence[ScheduledRequest], vocab_size: int,
                      device: torch.device) -> PenaltyMetadata | None:
    params = [r.sampling_params for r in requests]
    if not any(p.needs_penalties for p in params):
        return None

    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    outputs = [r.output_token_ids if p.needs_penalties else []
               for r, p in zip(requests, params, strict=True)]
    seen = [r.token_ids if p.repetition_penalty != 1.0 else []
            for r, p in zip(requests, params, strict=True)]
    return PenaltyMetadata(presence=col([p.presence_penalty for p in params]),
                           frequency=col([p.frequency_penalty for p in params]),
                           repetition=col([p.repetition_penalty for p in params]),
                           output_ids=_padded(outputs, vocab_size, device),
                           seen_ids=_padded(seen, vocab_size, device))


def _min_tokens_mask(requests: Sequence[ScheduledRequest], vocab_size: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of EOS / stop ids to mask in rows still short of min_tokens."""
    rows: list[int] = []
    ids: list[int] = []
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens >= p.min_tokens or r.grammar is not None:
            continue  # (a grammar decides when its stop token may come)
        stop = [t for t in p.stop_token_ids if t < vocab_size]
        if r.eos_token_id is not None and not p.ignore_eos:
            stop.append(r.eos_token_id)
        rows += [i] * len(stop)
        ids += stop
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device))


def _logit_bias(params: Sequence, vocab_size: int, device: torch.device,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(i, t, b) for i, p in enumerate(params) if p.logit_bias
               for t, b in p.logit_bias.items() if t < vocab_size]
    if not entries:
        return None
    rows, ids, biases = zip(*entries, strict=True)
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def make_generator(seed: int, device: torch.device, skip: int = 0) -> torch.Generator:
    """A seeded generator, advanced past `skip` uniform draws (one per token a seeded
    random row sampled before: a request that moved to this engine with its tokens
    goes on with the draws it would have made where it was)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for _ in range(skip):
        torch.rand(1, generator=gen, device=device)
    return gen


class Sampler:
    """logits [S, V] float32 + SamplingMetadata -> token ids [S], Logprobs | None."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = make_generator(seed, device)  # for unseeded rows

    def __call__(self, logits: torch.Tensor,
                 meta: SamplingMetadata) -> tuple[torch.Tensor, Logprobs | None]:
        # logits: [S, V] float32, owned by the sampler (modified in place).
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [S, V]
        self.adjust(logits, meta)
        if meta.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            greedy_tokens = logits.argmax(dim=-1) if meta.any_greedy else None
            tokens = inverse_cdf_sample(self.probs(logits, meta),
                                        self.uniforms(len(logits), meta, logits.device))
            if greedy_tokens is not None:
                tokens = torch.where(meta.greedy, greedy_tokens, tokens)
        if raw_logprobs is None:
            return tokens, None
        return tokens, gather_logprobs(raw_logprobs, tokens, meta.max_num_logprobs or 0)

    @staticmethod
    def adjust(logits: torch.Tensor, meta: SamplingMetadata) -> None:
        """In place: penalties, logit_bias, min_tokens, grammar (2. and 3. above)."""
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        if meta.logit_bias is not None:
            rows, ids, biases = meta.logit_bias
            logits.index_put_((rows, ids), biases.to(logits.dtype), accumulate=True)
        if meta.min_tokens_mask is not None:
            logits.index_put_(meta.min_tokens_mask,
                              torch.tensor(float("-inf"), device=logits.device))
        if meta.grammar is not None:
            apply_bitmask(logits, *meta.grammar)

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Random rows' distribution [S, V] after temperature, min-p, top-k, top-p (logits
        adjusted first; changed in place). Greedy rows' rows are meaningless."""
        logits.div_(meta.temperature[:, None])
        if meta.min_p is not None:
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
            floor = logits.amax(dim=-1) + torch.log(meta.min_p)
            logits.masked_fill_(logits < floor[:, None], float("-inf"))
        if meta.top_k is not None or meta.top_p is not None:
            threshold = top_k_top_p_threshold(logits, meta.top_k, meta.top_p)
            logits.masked_fill_(logits < threshold[:, None], float("-inf"))
        return torch.softmax(logits, dim=-1)  # [S, V]

    def uniforms(self, rows: int, meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """[S] uniforms in [0, 1): seeded rows from their own generator."""
        u = torch.rand(rows, generator=self.generator, device=device)
        for row, gen in meta.generators.items():
            u[row] = torch.rand(1, generator=gen, device=device)[0]
        return u


def apply_penalties(logits: torch.Tensor, p: PenaltyMetadata) -> None:
    """In place on logits [S, V]: repetition, then frequency and presence."""
    rows, vocab = logits.shape
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, p.seen_ids, True)
    seen = seen[:, :vocab]  # [S, V] token appears in prompt or output
    scaled = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
    logits.copy_(torch.where(seen, scaled, logits))
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, p.output_ids, torch.ones_like(p.output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]  # [S, V] occurrences in the output
    logits.sub_(counts * p.frequency)
    logits.sub_((counts > 0).to(logits.dtype) * p.presence)


def _nucleus_size(sorted_logits: torch.Tensor, log_norm: torch.Tensor,
                  top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_logits [R, C] descending, log_norm [R], top_p [R] ->
    (tokens to keep [R] int64, whether the nucleus lies within the C columns [R])."""
    cum = torch.exp(sorted_logits - log_norm[:, None]).cumsum(dim=-1)  # [R, C]
    below = (cum < top_p[:, None]).sum(dim=-1)  # tokens before the mass reaches top_p
    covered = below < sorted_logits.shape[1]
    return (below + 1).clamp(max=sorted_logits.shape[1]), covered


def top_k_top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None) -> torch.Tensor:
    """Smallest logit each row keeps [S] under top-k then top-p (-inf: keep all).

    Top-p keeps the fewest most likely tokens (after top-k) whose mass reaches
    p; tokens tied with the last kept one are kept too.
    """
    rows, vocab = logits.shape
    k = top_k if top_k is not None else torch.full((rows,), vocab, device=logits.device)
    has_k = k < vocab  # [S]
    has_p = top_p < 1.0 if top_p is not None else torch.zeros_like(has_k)  # [S]
    num_cand = int(k[has_k].max()) if bool(has_k.any()) else 1
    if top_p is not None:
        num_cand = max(num_cand, _TOP_P_CANDIDATES)
    num_cand = min(num_cand, vocab)
    cand, _ = logits.topk(num_cand, dim=-1)  # [S, C] descending
    col = torch.arange(num_cand, device=logits.device)[None, :]
    cand.masked_fill_(col >= k[:, None], float("-inf"))  # top-k applied
    keep = k.clamp(max=num_cand)  # [S] tokens kept
    rest = None
    if top_p is not None:
        # Normalise over what top-k left: the candidates if top-k is on, else the row.
        log_norm = torch.where(has_k, torch.logsumexp(cand, dim=-1),
                               torch.logsumexp(logits, dim=-1))
        size, covered = _nucleus_size(cand, log_norm, top_p)
        keep = torch.where(has_p, torch.minimum(keep, size), keep)
        missed = has_p & ~covered & ~has_k  # rare: a nucleus wider than the candidates
        if bool(missed.any()):
            rest = missed.nonzero().squeeze(1)
            full, _ = logits[rest].sort(dim=-1, descending=True)
            full_keep = _nucleus_size(full, log_norm[rest], top_p[rest])[0]
    threshold = cand.gather(1, (keep - 1)[:, None])[:, 0]
    threshold.masked_fill_(~(has_k | has_p), float("-inf"))
    if rest is not None:
        threshold[rest] = full.gather(1, (full_keep - 1)[:, None])[:, 0]
    return threshold


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of probs [S, V] with uniforms u [S] in [0, 1).

    Zero-probability tokens are never picked: the first cdf entry above the
    target is always a step of the cdf.
    """
    cdf = probs.cumsum(dim=-1)  # [S, V]
    target = u * cdf[:, -1] * (1.0 - 2.0 ** -20)  # strictly below the total
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int) -> Logprobs:
    """logprobs [S, V] (log_softmax of raw logits), sampled tokens [S] -> Logprobs.

    Column 0 is the sampled token, then the top `num_top` best first; rank 1 = best.
    """
    sampled = logprobs.gather(1, tokens[:, None])  # [S, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1  # [S]
    ids, values = tokens[:, None], sampled
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [S, N]
        ids = torch.cat((ids, top_ids), dim=1)
        values = torch.cat((values, top_values), dim=1)
    return Logprobs(token_ids=ids.cpu(), logprobs=values.float().cpu(), sampled_ranks=ranks.cpu())
