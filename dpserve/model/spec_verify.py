"""Verification of draft tokens (speculative decoding), in the step that computes them.

Scope: a speculative request (`ScheduledRequest.spec_token_ids`, k drafts) has
logits at each of its k + 1 positions: the last known token's and every draft's.
Row i's logits go through the sampler's own processing (logit_bias, then
temperature, min-p, top-k, top-p: `Sampler.adjust` / `Sampler.probs`) and decide
draft i:

* greedy (temperature 0): accepted iff it is the argmax; the first row whose
  argmax differs gives its argmax instead, and when every draft is accepted the
  last row's argmax comes too (the bonus token). Token for token the output of
  decoding one token per step.
* sampling: the proposal is a point mass on draft d, so d is accepted with
  probability p(d) (speculative sampling's min(1, p/q) with q(d) = 1); on
  rejection the token is drawn from p with d removed, renormalised (the residual
  max(0, p - q)); after k acceptances the bonus token is drawn from the last row's
  p. Each emitted token is distributed exactly as sampling without speculation.

A row therefore yields 1 .. k + 1 tokens: `verify` returns them per request.
Requests that need more of the sampler (penalties, min_tokens, grammars,
logprobs, seeded generators) never get drafts (engine.spec_decode.can_speculate).

Not here: proposing drafts and settling the scheduler's state
(`dpserve.engine.spec_decode`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dpserve.model.sampler import Sampler, SamplingMetadata, inverse_cdf_sample
from dpserve.step import ScheduledRequest


def split_rows(sampled: Sequence[ScheduledRequest], ends: np.ndarray,
               ) -> tuple[np.ndarray, list[ScheduledRequest], list[ScheduledRequest]]:
    """The step's logits rows: (token index of each row [N], requests with one row,
    speculative requests), the one-row requests' rows first. `ends`: [len(sampled)]
    the token index of each sampled request's last scheduled token."""
    if not any(s.spec_token_ids for s in sampled):
        return ends, list(sampled), []
    plain = [i for i, s in enumerate(sampled) if not s.spec_token_ids]
    spec = [i for i, s in enumerate(sampled) if s.spec_token_ids]
    index = [ends[plain]]
    for i in spec:
        k = len(sampled[i].spec_token_ids)
        index.append(np.arange(ends[i] - k, ends[i] + 1))
    return (np.concatenate(index).astype(np.int64), [sampled[i] for i in plain],
            [sampled[i] for i in spec])


def accept_point_mass(probs: torch.Tensor, drafts: torch.Tensor,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one row each against a point-mass proposal.

    probs: [R, V] the target distribution of each row; drafts: [R] int64, the
    draft token (-1: none, a bonus row); uniforms: [R, 2] in [0, 1).
    Returns (accepted [R] bool, token [R] int64): the draft where accepted, else a
    draw from probs without the draft, renormalised (a bonus row: from probs).
    """
    has = drafts >= 0
    d = drafts.clamp(min=0)[:, None]  # [R, 1]
    p_at = probs.gather(1, d)  # [R, 1]
    p_d = p_at[:, 0] * has  # [R] (0 for a bonus row)
    residual = probs.scatter(1, d, torch.where(has[:, None], torch.zeros_like(p_at), p_at))
    total, rest = probs.sum(dim=-1), residual.sum(dim=-1)
    # Accept with probability p(d) (of the row's mass); nothing left to draw from
    # (p(d) = 1 up to rounding) accepts too.
    accepted = has & ((uniforms[:, 0] * total < p_d) | (rest <= 0))
    drawn = inverse_cdf_sample(residual, uniforms[:, 1])
    return accepted, torch.where(accepted, drafts, drawn)


def verify(sampler: Sampler, logits: torch.Tensor, requests: Sequence[ScheduledRequest],
           vocab_size: int, device: torch.device) -> list[list[int]]:
    """logits: [sum(k_r + 1), V] float32, request r's k_r + 1 rows in position order
    (changed in place) -> each request's tokens: its accepted drafts, then one more."""
    rows = [r for r in requests for _ in range(len(r.spec_token_ids) + 1)]
    meta = SamplingMetadata.from_requests(rows, {}, vocab_size, device)
    drafts = torch.tensor([t for r in requests for t in (*r.spec_token_ids, -1)],
                          dtype=torch.int64, device=device)  # [R]
    sampler.adjust(logits, meta)
    tokens = logits.argmax(dim=-1)  # [R] greedy rows' tokens
    accepted = tokens == drafts
    if not meta.all_greedy:
        probs = sampler.probs(logits, meta)
        uniforms = sampler.uniforms(2 * len(rows), meta, device).view(-1, 2)
        sampled_ok, sampled = accept_point_mass(probs, drafts, uniforms)
        accepted = torch.where(meta.greedy, accepted, sampled_ok)
        tokens = torch.where(meta.greedy, tokens, sampled)
    return _accepted_runs(requests, accepted.tolist(), tokens.tolist())


def _accepted_runs(requests: Sequence[ScheduledRequest], accepted: list[bool],
                   tokens: list[int]) -> list[list[int]]:
    """Per request: its rows' tokens up to and including the first not accepted."""
    out, row = [], 0
    for r in requests:
        k = len(r.spec_token_ids)
        n = 0
        while n < k and accepted[row + n]:
            n += 1
        out.append(tokens[row:row + n + 1])
        row += k + 1
    return out
