"""Expert parallelism (EP) over the data-parallel ranks of a lockstep DP group.

Scope: which experts a rank holds, and the collectives of one MoE layer. With
`enable_expert_parallel` and DP size N, rank r holds experts
[r*E//N, (r+1)*E//N); attention, the router, shared experts and the KV cache
stay replicated (data parallel). Each forward first all-gathers every rank's
token count (once for all layers); each MoE layer then

1. all-gathers the hidden states and the routing (top-k ids and weights) of
   every rank, padded to the largest rank's token count;
2. computes its own experts' contributions for all of those tokens;
3. reduce-scatters the contributions (a sum over ranks), so each rank gets
   back the finished MoE output of its own tokens.

Every rank must therefore run every forward with the others: the lockstep
machinery (`dpserve.engine.dp`) steps all ranks together and a rank with
nothing to do runs a dummy batch, whose forward goes through the same
collectives. The group is the lockstep DP group (gloo; tensors on CUDA are
staged through host memory); `group_source` returns the current one, or None
before one is formed (only the CUDA start-up profile run forwards then: it
computes with the local experts alone). A failed collective (a peer died: at
once; froze: after the group's timeout) raises `ExpertParallelError`; the
engine then drops the step (`EngineCore.step`) and leaves the DP group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpserve.errors import ExpertParallelError

__all__ = ["ExpertParallel", "ExpertParallelError"]


class ExpertParallel:
    """One rank's view of expert parallelism (see the module docstring)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.group_source: Callable[[], Any] = lambda: None  # set by the engine process
        self._counts: list[int] | None = None  # token counts of every rank, this forward
        self.collectives = 0  # run so far (tests check every rank runs the same number)

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[first, end) of the experts this rank holds."""
        return (self.rank * num_experts // self.size,
                (self.rank + 1) * num_experts // self.size)

    def begin_forward(self, num_tokens: int) -> None:
        """All-gather the token count of every rank (once per forward)."""
        group = self.group_source()
        if group is None:
            self._counts = None
            return
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._all_gather(group, counts, torch.tensor([num_tokens], dtype=torch.int64))
        self._counts = [int(c.item()) for c in counts]

    @property
    def active(self) -> bool:
        """Whether this forward exchanges tokens (a group is formed)."""
        return self._counts is not None

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            local_experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
        """x [T, H], routing [T, k] -> the MoE output [T, H] of this rank's tokens,
        with `local_experts(x, ids, weights)` computing this rank's share."""
        group = self.group_source()
        counts = self._counts
        assert counts is not None and group is not None, "run() without begin_forward()"
        num_tokens, k = topk_ids.shape
        most = max(counts)
        routing = torch.cat([topk_ids.float(), topk_weights.float()], dim=1)  # [T, 2k]
        xs = self._gather_rows(group, x, most)  # [N, most, H]
        rs = self._gather_rows(group, routing, most)  # [N, most, 2k]
        x_all = torch.cat([xs[r, :n] for r, n in enumerate(counts)])
        r_all = torch.cat([rs[r, :n] for r, n in enumerate(counts)])
        ids_all = r_all[:, :k].long()
        y_all = local_experts(x_all, ids_all, r_all[:, k:].to(topk_weights.dtype))
        padded = y_all.new_zeros(self.size, most, y_all.shape[1], dtype=torch.float32)
        start = 0
        for r, n in enumerate(counts):
            padded[r, :n] = y_all[start:start + n]
            start += n
        own = torch.empty(most, y_all.shape[1], dtype=torch.float32)
        import torch.distributed as dist

        options = dist.ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp.SUM
        try:
            group.reduce_scatter([own], [list(padded.cpu().unbind(0))], options).wait()
        except RuntimeError as e:
            raise ExpertParallelError(f"reduce-scatter: {e}") from e
        self.collectives += 1
        return own[:num_tokens].to(device=x.device, dtype=x.dtype)

    def _gather_rows(self, group: Any, t: torch.Tensor, rows: int) -> torch.Tensor:
        """Every rank's `t` [n_r, C], zero-padded to `rows`: [N, rows, C] on t's device."""
        padded = t.new_zeros(rows, t.shape[1])
        padded[:t.shape[0]] = t
        outs = [torch.empty(rows, t.shape[1], dtype=t.dtype) for _ in range(self.size)]
        self._all_gather(group, outs, padded.cpu())
        return torch.stack(outs).to(t.device)

    def _all_gather(self, group: Any, outs: list[torch.Tensor], t: torch.Tensor) -> None:
        try:
            group.allgather([outs], [t]).wait()
        except RuntimeError as e:
            raise ExpertParallelError(f"all-gather: {e}") from e
        self.collectives += 1
