"""Tensor parallelism (TP) inside one DP rank: which slice of each weight a
worker holds, and the collectives of one forward.

Scope: the arithmetic of sharding and the three collectives a sharded Llama
needs; no processes (the engine's executor starts the workers and forms the
group, `dpserve.engine.executor`). With `--tensor-parallel-size N`, worker t
of a rank holds:

* attention: query heads [t*H/N, (t+1)*H/N); KV heads [t*KV/N, (t+1)*KV/N),
  or, with fewer KV heads than workers (N a multiple of KV), the one KV head
  t*KV//N, replicated on N/KV workers, as vLLM does; merged QKV holds the
  q | k | v rows of those heads; O holds the matching columns;
* MLP: gate and up rows [t*I/N, (t+1)*I/N) (merged gate | up), down the
  matching columns; MoE experts the same slice of every expert's
  intermediate dimension (or, with expert parallelism, whole experts);
* embedding and LM head: vocabulary rows [t*V', (t+1)*V') with V' = ceil(V/N)
  (the last shard padded with zero rows);
* norms, rotary tables and the router: whole (replicated).

A forward then runs one all-reduce after the embedding lookup (each worker
fills the rows of its own vocabulary slice), one after each row-parallel
linear (O, down: partial sums), and one all-gather of the LM head's logits.
Every worker of a rank runs every forward with the same inputs, so the
collectives always match. A bias of a row-parallel linear is held by worker
0 only: the all-reduce adds it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpserve.errors import TensorParallelError

__all__ = ["TensorParallel", "TensorParallelError", "shard_counts"]


def shard_counts(heads: int, kv_heads: int, size: int) -> tuple[int, int]:
    """(query heads, KV heads) each of `size` workers holds; ValueError when the
    heads cannot be split (the message names tensor_parallel_size)."""
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's "
                         f"{heads} attention heads")
    if kv_heads % size == 0:
        return heads // size, kv_heads // size
    if size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {kv_heads} "
                         f"KV heads, or be a multiple of them")
    return heads // size, 1


@dataclass
class TensorParallel:
    """One worker's place in its rank's TP group (see the module docstring).

    `group`: the formed process group (gloo on CPU, NCCL on CUDA), None until
    the executor forms it; a model of size 1 never needs one.
    """

    rank: int
    size: int
    group: Any = None
    collectives: int = 0  # run so far (tests check the workers ran the same number)

    # ---- sharding ---------------------------------------------------------

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(first, count) of this worker's equal share of `n` (e.g. rows)."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} must divide the model's "
                             f"{what} ({n})")
        count = n // self.size
        return self.rank * count, count

    def head_ranges(self, heads: int, kv_heads: int) -> tuple[tuple[int, int],
                                                               tuple[int, int]]:
        """((first query head, count), (first KV head, count)) held here."""
        local_q, local_kv = shard_counts(heads, kv_heads, self.size)
        if kv_heads >= self.size:
            first_kv = self.rank * local_kv
        else:  # replicated: workers of one group of query heads share a KV head
            first_kv = self.rank * kv_heads // self.size
        return (self.rank * local_q, local_q), (first_kv, local_kv)

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """(first row, rows held, padded shard rows) of the vocabulary."""
        per = -(-vocab // self.size)
        first = min(self.rank * per, vocab)
        return first, min(per, vocab - first), per

    # ---- collectives ------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place; returns it."""
        if self.size == 1:
            return t
        self._run("all-reduce", lambda g: g.allreduce([t]))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, C] from each worker -> [rows, size * C], worker order along dim 1."""
        if self.size == 1:
            return t
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all-gather", lambda g: g.allgather([outs], [t]))
        return torch.cat(outs, dim=1)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Worker `src`'s `t` into every worker's `t` (same shape), in place."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        self._run("broadcast", lambda g: g.broadcast([t], options))
        return t

    def _run(self, what: str, op: Any) -> None:
        if self.group is None:
            raise TensorParallelError(f"{what} before the tensor-parallel group is formed")
        try:
            op(self.group).wait()
        except RuntimeError as e:  # a peer died (at once) or froze (the group's timeout)
            raise TensorParallelError(f"tensor-parallel {what} failed: {e}") from e
        self.collectives += 1
