"""Pooling: a pooling (embedding) request's share of one step's final hidden states.

The model runner calls `pool_step` after the forward pass, on worker 0 only (under
tensor parallelism every worker holds the whole all-reduced hidden state; worker 0
answers for the group), and only in steps whose `SchedulerOutput.has_pooling` is set,
so a step without pooling requests costs nothing more. Each pooling request's rows
(`ScheduledRequest.pooling`) give:

* "mean": the float32 sum of the chunk's rows; the scheduler adds the chunks of a
  chunked prefill up (engine.pooling) and divides by the prompt length. Such a
  request gets no prefix-cache hit (`Request.needs_every_position`): every
  position is computed here.
* "last": the last prompt token's row, from the chunk that reaches it (a prefix-cache
  hit is fine: the last token is always computed).

The rows are final-normed (the model's `forward` ends with its norm), as
transformers' `last_hidden_state`. Pooling requests are never sampled: their
`sample` is False, so they add no row to the LM head or the sampler.

Not here: the sum over chunks, `dimensions` and `normalize` (engine.pooling).
"""

from __future__ import annotations

import numpy as np
import torch

from dpserve.step import SchedulerOutput


def pool_step(hidden: torch.Tensor, so: SchedulerOutput) -> dict[str, tuple[int, np.ndarray]]:
    """hidden [T, hidden] of the step (rows in `so.scheduled` order) -> req_id ->
    (first position of its chunk, [hidden] float32) for each pooling request with
    something to report (see the module docstring)."""
    ids: list[str] = []
    starts: list[int] = []
    rows: list[torch.Tensor] = []
    offset = 0
    for s in so.scheduled:
        if s.pooling == "mean":
            rows.append(hidden[offset:offset + s.num_new_tokens].float().sum(dim=0))
        elif s.pooling is not None and s.start + s.num_new_tokens == s.num_tokens:
            rows.append(hidden[offset + s.num_new_tokens - 1].float())
        else:
            offset += s.num_new_tokens
            continue
        ids.append(s.req_id)
        starts.append(s.start)
        offset += s.num_new_tokens
    if not rows:
        return {}
    pooled = torch.stack(rows).cpu().numpy()  # [P, hidden] float32, one copy to the host
    return {req_id: (start, pooled[i]) for i, (req_id, start) in enumerate(zip(ids, starts))}
