"""A pooling request's result, put together from its steps (IO-free, numpy only).

A pooling (embedding) request (`EngineCoreRequest.pooling`) runs its prompt like any
prefill, chunked to the step budget, and never decodes. The model runner reports each
step's share (`ModelRunnerOutput.pooled`, model/pooler.py): a chunk's sum of final
hidden states for "mean", the last prompt token's for "last". `PoolingState` adds the
chunks up; the step that computes the last prompt token finishes the request
(`Scheduler.update_from_output`) with `PoolingState.result`:

    mean over the prompt (or the last token's) -> first `dimensions` values
    -> unit L2 norm (`normalize`) -> little-endian float32 bytes

Invariant: a "mean" request computes every position of its prompt, from position 0
(no prefix-cache or host-tier hit: `Request.needs_every_position`); a preempted one
starts again at 0, and a chunk that starts at 0 starts the sum again.

Not here: the rows themselves (model/pooler.py), the HTTP API (server/embeddings_*).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpserve.protocol import PoolingParams


class PoolingState:
    """The running sum (or the last row) of one pooling request."""

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.vector: np.ndarray | None = None  # [hidden] float32
        self.end = 0  # positions covered so far ("mean": 0 .. end - 1)

    def add(self, start: int, end: int, part: np.ndarray) -> None:
        """The step's share: its chunk covered positions start .. end - 1."""
        if self.params.pooling_type == "mean":
            if start == 0:  # the first chunk, or a preempted request computing again
                self.vector = part.astype(np.float32, copy=True)
            else:
                assert self.vector is not None and start == self.end, (
                    f"mean pooling missed positions {self.end}..{start - 1}")
                self.vector += part
        else:
            self.vector = part.astype(np.float32, copy=True)
        self.end = end

    def result(self, num_prompt_tokens: int) -> bytes:
        """The finished vector as little-endian float32 bytes (module docstring)."""
        assert self.vector is not None and self.end == num_prompt_tokens, (
            f"pooling finished at {self.end} of {num_prompt_tokens} positions")
        vector = self.vector
        if self.params.pooling_type == "mean":
            vector = vector / np.float32(num_prompt_tokens)
        if self.params.dimensions is not None:
            vector = vector[:self.params.dimensions]
        if self.params.normalize:
            norm = float(np.linalg.norm(vector.astype(np.float64)))
            vector = vector / np.float32(max(norm, 1e-12))  # as torch's F.normalize
        return vector.astype("<f4").tobytes()


@dataclass
class PoolingCounts:
    """The scheduler's pooling figures (`SchedulerStats.num_pooled_requests`, ...)."""

    held: int = 0  # pooling requests in the engine now (the runner pools only then)
    requests: int = 0  # pooling requests finished, cumulative
    steps: int = 0  # steps that finished at least one, cumulative

    def count_finished(self, num_finished: int) -> None:
        """A step finished `num_finished` pooling requests (0: nothing to count)."""
        if num_finished:
            self.requests += num_finished
            self.steps += 1
