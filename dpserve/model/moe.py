"""The fused mixture-of-experts layer: router, grouped expert matmuls, shared expert.

Scope: one MoE MLP block on a step's flattened tokens, device-agnostic torch.
Expert weights are stacked per expert: w13 [E_local, 2I, H] (gate | up) and
w2 [E_local, H, I]; E_local is every expert, or this worker's share under
expert parallelism (`dpserve.model.expert_parallel`); I is each expert's
intermediate size, or this worker's slice of it under tensor parallelism
without expert parallelism.

`fused_experts` sorts the (token, expert) assignments by expert once, then runs
one gate/up and one down matmul per active expert over its rows (a loop over
experts, never over tokens), scales by the routing weights and sums each
token's rows back with one index_add_ (experts in ascending order, as
transformers adds them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpserve.model.expert_parallel import ExpertParallel
from dpserve.model.layers import linear, silu_and_mul
from dpserve.model.llama import LlamaMLP, ModelDims
from dpserve.model.tensor_parallel import TensorParallel


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """How an architecture routes (read from config.json by the model)."""

    num_experts: int
    top_k: int
    intermediate: int  # per expert
    renormalize: bool  # divide the top-k probabilities by their sum
    float32_weights: bool  # Mixtral keeps routing weights in float32; others cast them
    shared_intermediate: int = 0  # Qwen2-MoE: a shared expert behind a sigmoid gate


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (top-k expert ids [T, k] int64, weights [T, k]).

    Softmax in float32 over all experts, then top-k (optionally renormalised).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(weight_dtype)


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Sum over each token's experts in [first_expert, first_expert + E_local) of
    weight * down(silu(gate(x)) * up(x)); other experts contribute nothing.

    x [T, H], topk_ids / topk_weights [T, k], w13 [E_local, 2I, H], w2 [E_local, H, I]
    -> [T, H] in x's dtype.
    """
    num_local, k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1)  # [T * k], token-major
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    edges = torch.arange(first_expert, first_expert + num_local + 1, device=flat.device)
    bounds = torch.searchsorted(flat[order], edges).tolist()  # [E_local + 1]: one sync
    out = torch.zeros_like(x)
    if bounds[-1] == bounds[0]:
        return out
    chosen = order[bounds[0]:bounds[-1]]  # this range's assignments, by expert
    tokens = chosen // k
    xs = x.index_select(0, tokens)  # [R, H]
    rows = torch.empty_like(xs)
    for e in range(num_local):
        lo, hi = bounds[e] - bounds[0], bounds[e + 1] - bounds[0]
        if hi > lo:
            h = silu_and_mul(linear(xs[lo:hi], w13[e], None, False))
            rows[lo:hi] = linear(h, w2[e], None, False)
    scaled = rows * topk_weights.reshape(-1)[chosen, None]  # promotes to float32 for Mixtral
    return out.index_add_(0, tokens, scaled.to(x.dtype))


def _param(*shape: int, dtype: torch.dtype, device: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class FusedMoE(nn.Module):
    """A sparse MoE block: router (replicated), this rank's experts, optional
    shared expert with its sigmoid gate (replicated).

    Under tensor parallelism (`tp`) every worker holds its slice of each expert's
    intermediate dimension (and of the shared expert's): the experts' and the
    shared expert's partial sums are added, then all-reduced once. With expert
    parallelism too (`ep`, spanning every worker of every rank) a worker holds
    whole experts instead: its routed share comes from `ExpertParallel.run` (the
    finished rows on worker 0, zeros on its peers) or, without a DP exchange,
    from its own experts, and the same closing all-reduce completes it."""

    def __init__(self, d: ModelDims, spec: MoESpec, dtype: torch.dtype, device: Any,
                 ep: ExpertParallel | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.spec, self.ep, self.dtype = spec, ep, dtype
        self.tp = tp if tp is not None else TensorParallel(0, 1)
        if ep is not None and (ep.tp.rank, ep.tp.size) != (self.tp.rank, self.tp.size):
            raise ValueError("the expert parallelism and the model are built for different "
                             "tensor-parallel workers")
        self.first, end = ep.expert_range(spec.num_experts) if ep else (0, spec.num_experts)
        # Expert parallel: whole experts (the EP index spans the TP workers).
        self.inter_first, self.inter = ((0, spec.intermediate) if ep is not None else
                                        self.tp.split(spec.intermediate,
                                                      "expert intermediate size"))
        self.w13 = _param(end - self.first, 2 * self.inter, d.hidden, dtype=dtype,
                          device=device)
        self.w2 = _param(end - self.first, d.hidden, self.inter, dtype=dtype,
                         device=device)
        self.router = _param(spec.num_experts, d.hidden, dtype=dtype, device=device)
        self.shared: LlamaMLP | None = None
        self.shared_gate: nn.Parameter | None = None
        if spec.shared_intermediate:
            shared_dims = dataclasses.replace(d, intermediate=spec.shared_intermediate,
                                              mlp_bias=False)
            self.shared = LlamaMLP(shared_dims, dtype, device, self.tp, reduce=False)
            self.shared_gate = _param(1, d.hidden, dtype=dtype, device=device)

    def resize_experts(self) -> None:
        """Elastic expert parallelism: fresh (unset) weights for the experts of the
        EP's current (rank, size); the caller loads them."""
        assert self.ep is not None
        self.first, end = self.ep.expert_range(self.spec.num_experts)
        for name in ("w13", "w2"):
            old = getattr(self, name)
            setattr(self, name, _param(end - self.first, *old.shape[1:], dtype=old.dtype,
                                       device=old.device))

    @property
    def expert_range(self) -> tuple[int, int]:
        return self.first, self.first + self.w13.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (a fresh tensor)."""
        spec = self.spec
        logits = linear(x, self.router, None, False)  # [T, E] in the model dtype
        ids, weights = route(logits, spec.top_k, spec.renormalize,
                             torch.float32 if spec.float32_weights else self.dtype)
        if self.ep is not None and self.ep.active:
            out = self.ep.run(x, ids, weights, self._local_experts)
        else:
            out = self._local_experts(x, ids, weights)
        if self.shared is not None:
            assert self.shared_gate is not None
            gate = torch.sigmoid(linear(x, self.shared_gate, None, False))  # [T, 1]
            out = out + gate * self.shared(x)
        return self.tp.all_reduce(out)

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, ids, weights, self.w13, self.w2, self.first)

    def expert_bytes(self) -> int:
        """Bytes of the routed experts' weights held here."""
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2))


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A per-token loop (tests only): the definition `fused_experts` must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = F.linear(x[t:t + 1], w13[e]).chunk(2, dim=-1)
            out[t] += (F.linear(F.silu(gate) * up, w2[e]) * topk_weights[t, j]).to(x.dtype)[0]
    return out
