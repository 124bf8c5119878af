"""Expert parallelism (EP) over every worker of a lockstep DP group: the DP
ranks, and under tensor parallelism each rank's TP workers.

Scope: which experts a worker holds (EP index r = d*T + t of N = D*T holds
experts [r*E//N, (r+1)*E//N), whole; attention, router, shared experts and KV
cache stay replicated), and the collectives of one MoE layer: worker 0 of each
rank all-gathers the hidden states and routing over the DP group and broadcasts
them to its TP peers, every worker computes its own experts for all of them,
the rank sums over TP, worker 0 reduce-scatters over DP. `group_source` gives
the current DP group (None before one is formed); without one nothing is
gathered.

Invariants: every worker runs every forward with the others (lockstep steps
all ranks together; an idle rank runs a dummy batch through the same
collectives); a failed DP collective raises `ExpertParallelError` on every
worker of the rank at the same point, the forward's end (`end_forward`), so
they drop the same step and stay in step; a failed TP collective raises
`TensorParallelError` (the rank goes down as a group).

Not here: forming the groups (the engine process and the TP executor), and the
elastic re-shard's reading of weights (`ModelRunner.reshard_experts`).

Design: docs/design/expert-parallel.md
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpserve.errors import ExpertParallelError
from dpserve.model.tensor_parallel import TensorParallel

__all__ = ["ExpertParallel", "ExpertParallelError"]


class ExpertParallel:
    """One worker's view of expert parallelism (see the module docstring).

    `rank`, `size`: the EP index (dp_rank * tp.size + tp.rank) and EP size
    (dp_size * tp.size); `tp`: the worker's place in its rank's TP group
    (None: no tensor parallelism). `collectives` counts the DP-group
    collectives (worker 0 only runs them; the TP ones count in `tp`).
    """

    def __init__(self, rank: int, size: int, tp: TensorParallel | None = None) -> None:
        self.tp = tp if tp is not None else TensorParallel(0, 1)
        if size % self.tp.size or rank % self.tp.size != self.tp.rank:
            raise ValueError(f"expert-parallel index {rank} of {size} is not a worker of "
                             f"tensor_parallel_size {self.tp.size}")
        self.rank, self.size = rank, size
        self.group_source: Callable[[], Any] = lambda: None  # set by the engine process
        self._counts: list[int] | None = None  # token counts of every rank, this forward
        self._failure: ExpertParallelError | None = None  # held till end_forward (TP)
        self._device: torch.device | str = "cpu"  # the model's, for the TP tensors
        self.collectives = 0  # run so far (tests check every rank runs the same number)

    @property
    def dp_size(self) -> int:
        """DP ranks the experts are spread over (each with tp.size workers)."""
        return self.size // self.tp.size

    def set_dp(self, dp_rank: int, dp_size: int) -> None:
        """Elastic EP: this worker's EP index and size for a DP size of `dp_size`."""
        self.rank, self.size = dp_rank * self.tp.size + self.tp.rank, dp_size * self.tp.size

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[first, end) of the experts this worker holds."""
        return (self.rank * num_experts // self.size,
                (self.rank + 1) * num_experts // self.size)

    def begin_forward(self, num_tokens: int, device: torch.device | str = "cpu") -> None:
        """All-gather the token count of every rank (once per forward); under TP,
        worker 0 then broadcasts them to its peers (tensors on `device`, the
        model's: the TP group's)."""
        self._failure, self._device = None, device
        group = self.group_source() if self.tp.rank == 0 else None
        counts = None
        if group is not None:
            gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.dp_size)]
            try:
                self._all_gather(group, gathered, torch.tensor([num_tokens],
                                                               dtype=torch.int64))
                counts = [int(c.item()) for c in gathered]
            except ExpertParallelError as e:
                self._hold(e)
        if self.tp.size > 1:
            counts = self._share_counts(counts, device)
        self._counts = counts

    def _share_counts(self, counts: list[int] | None,
                      device: torch.device | str) -> list[int] | None:
        """Worker 0's counts to its TP peers: header [1 + D] = (0: no group, 1: the
        counts follow, 2: the DP exchange failed), then the counts."""
        header = torch.zeros(1 + self.dp_size, dtype=torch.int64, device=device)
        if counts is not None:
            header[0] = 1
            header[1:] = torch.tensor(counts, dtype=torch.int64)
        elif self._failure is not None:
            header[0] = 2
        values = self.tp.broadcast(header).tolist()
        if values[0] == 2 and self.tp.rank != 0:
            self._failure = ExpertParallelError("worker 0's DP exchange failed")
        return values[1:] if values[0] == 1 else None

    def end_forward(self) -> None:
        """Raise the DP failure held back through the forward (TP), on every worker
        of the rank alike: after an exchange, worker 0 tells its peers whether it
        failed (one more small broadcast), so none of them goes on to the step's
        later collectives (the LM head's) alone."""
        if self.tp.size > 1 and self._counts is not None:
            flag = torch.tensor([int(self._failure is not None)], device=self._device)
            if self.tp.broadcast(flag).item() and self._failure is None:
                self._failure = ExpertParallelError("worker 0's DP exchange failed")
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _hold(self, e: ExpertParallelError) -> None:
        """A DP collective failed: raise at once without TP peers, else at the
        forward's end (the peers wait on this worker's TP collectives)."""
        if self.tp.size == 1:
            raise e
        self._failure = self._failure or e

    @property
    def active(self) -> bool:
        """Whether this forward exchanges tokens (worker 0 has a DP group)."""
        return self._counts is not None

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            local_experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
        """x [T, H], routing [T, k] -> the MoE output [T, H] of this rank's tokens on
        worker 0, zeros on its TP peers (the caller's TP all-reduce finishes it);
        `local_experts(x, ids, weights)` computes this worker's share."""
        counts = self._counts
        assert counts is not None, "run() without begin_forward()"
        k = topk_ids.shape[1]
        routing = torch.cat([topk_ids.float(), topk_weights.float()], dim=1)  # [T, 2k]
        lead, gathered = self.tp.rank == 0, None
        if lead and self._failure is None:  # 1. every rank's tokens and routing
            try:
                gathered = self._gather_tokens(x, routing, counts)
            except ExpertParallelError as e:
                self._hold(e)
        # A peer receives them; worker 0 after a DP failure sends zeros (zero weights).
        x_all, r_all = gathered or (x.new_zeros(sum(counts), x.shape[1]),
                                    routing.new_zeros(sum(counts), 2 * k))
        self.tp.broadcast(x_all)
        self.tp.broadcast(r_all)
        # 2. this worker's experts for all of them; 3. summed over the rank's workers
        y_all = local_experts(x_all, r_all[:, :k].long(), r_all[:, k:].to(topk_weights.dtype))
        y_all = self.tp.all_reduce(y_all.float())  # [sum(counts), H]
        if not lead or self._failure is not None:
            return torch.zeros_like(x)
        try:
            own = self._reduce_scatter(y_all, counts)
        except ExpertParallelError as e:
            self._hold(e)
            return torch.zeros_like(x)
        return own[:x.shape[0]].to(device=x.device, dtype=x.dtype)

    def _group(self) -> Any:
        group = self.group_source()
        if group is None:
            raise ExpertParallelError("the DP group went away within a forward")
        return group

    def _gather_tokens(self, x: torch.Tensor, routing: torch.Tensor,
                       counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's x [n_r, H] and routing [n_r, 2k], concatenated in rank order."""
        group, most = self._group(), max(counts)
        xs = self._gather_rows(group, x, most)  # [D, most, H]
        rs = self._gather_rows(group, routing, most)  # [D, most, 2k]
        return (torch.cat([xs[r, :n] for r, n in enumerate(counts)]),
                torch.cat([rs[r, :n] for r, n in enumerate(counts)]))

    def _reduce_scatter(self, y_all: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Sum y_all [sum(counts), H] over the ranks; this rank's rows [max(counts), H]."""
        import torch.distributed as dist

        group, most = self._group(), max(counts)
        padded = y_all.new_zeros(self.dp_size, most, y_all.shape[1], dtype=torch.float32)
        start = 0
        for r, n in enumerate(counts):
            padded[r, :n] = y_all[start:start + n]
            start += n
        own = torch.empty(most, y_all.shape[1], dtype=torch.float32)
        options = dist.ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp.SUM
        try:
            group.reduce_scatter([own], [list(padded.cpu().unbind(0))], options).wait()
        except RuntimeError as e:
            raise ExpertParallelError(f"reduce-scatter: {e}") from e
        self.collectives += 1
        return own

    def _gather_rows(self, group: Any, t: torch.Tensor, rows: int) -> torch.Tensor:
        """Every rank's `t` [n_r, C], zero-padded to `rows`: [D, rows, C] on t's device."""
        padded = t.new_zeros(rows, t.shape[1])
        padded[:t.shape[0]] = t
        outs = [torch.empty(rows, t.shape[1], dtype=t.dtype) for _ in range(self.dp_size)]
        self._all_gather(group, outs, padded.cpu())
        return torch.stack(outs).to(t.device)

    def _all_gather(self, group: Any, outs: list[torch.Tensor], t: torch.Tensor) -> None:
        try:
            group.allgather([outs], [t]).wait()
        except RuntimeError as e:
            raise ExpertParallelError(f"all-gather: {e}") from e
        self.collectives += 1
