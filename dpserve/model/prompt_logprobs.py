"""Prompt logprobs: the log-softmax of the logits at every prompt position.

A request with `sampling_params.prompt_logprobs = k` gets, for each prompt token
after the first, the logprob and rank of that token given the tokens before it,
plus the top k tokens there (vLLM's `prompt_logprobs`). The model runner calls
`compute_prompt_logprobs` after the forward pass with the hidden states of the
whole step; each chunk of a chunked prefill contributes the positions it
computed. Such a request gets no prefix-cache hit (kv_cache.get_computed_blocks),
so every prompt position is computed here once.
"""

from __future__ import annotations

from typing import Any

import torch

from dpserve.protocol import TokenLogprobs
from dpserve.step import SchedulerOutput

_ROWS_PER_SLICE = 256  # logits rows at a time ([rows, vocab] float32 each)


def compute_prompt_logprobs(model: Any, hidden: torch.Tensor, so: SchedulerOutput,
                            ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """hidden [T, hidden] of the step (rows in `so.scheduled` order) -> req_id ->
    (first prompt position of the chunk, entries for the prompt tokens after it)."""
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    offset = 0
    for s in so.scheduled:
        # Position p predicts prompt token p + 1: positions start .. num_prompt - 2.
        end = min(s.start + s.num_new_tokens, s.num_prompt_tokens - 1)
        if s.needs_prompt_logprobs and end > s.start:
            k = s.sampling_params.prompt_logprobs or 0
            rows = hidden[offset:offset + end - s.start]
            targets = torch.tensor(s.tokens(s.start + 1, end + 1),
                                   dtype=torch.int64, device=hidden.device)
            out[s.req_id] = (s.start, _token_logprobs(model, rows, targets, k))
        offset += s.num_new_tokens
    return out


def _token_logprobs(model: Any, rows: torch.Tensor, targets: torch.Tensor,
                    k: int) -> list[TokenLogprobs]:
    """rows [P, hidden], targets [P] -> one TokenLogprobs per row (target + top k)."""
    entries: list[TokenLogprobs] = []
    for i in range(0, rows.shape[0], _ROWS_PER_SLICE):
        logprobs = torch.log_softmax(model.compute_logits(rows[i:i + _ROWS_PER_SLICE]), -1)
        target = targets[i:i + _ROWS_PER_SLICE, None]  # [S, 1]
        chosen = logprobs.gather(1, target)  # [S, 1]
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in ranks]
        top_values: list[list[float]] = [[] for _ in ranks]
        if k > 0:
            values, ids = logprobs.topk(k, dim=-1)
            top_ids, top_values = ids.tolist(), values.float().tolist()
        for t, lp, rank, tids, tvals in zip(target[:, 0].tolist(), chosen[:, 0].tolist(),
                                             ranks, top_ids, top_values, strict=True):
            entries.append(TokenLogprobs(t, lp, rank, list(zip(tids, tvals, strict=True))))
    return entries
