"""Qwen3 (dense) and the mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Scope: what these architectures add to the Llama family (`llama.py`), read
from config.json as transformers' modeling code defines it:
* q/k RMSNorm: per head over head_dim (Qwen3, Qwen3-MoE), or over the whole
  q / k projection before the heads are split (OLMoE, which may also clamp
  q/k/v at `clip_qkv`);
* sparse MoE MLPs (`moe.FusedMoE`): softmax then top-k routing, renormalised
  for Mixtral and where `norm_topk_prob` says so; Qwen2-MoE's shared expert
  behind a sigmoid gate; Qwen2/3-MoE's dense layers (`mlp_only_layers`,
  `decoder_sparse_step`).
Checkpoints name experts one by one (`...experts.N.w1` / `gate_proj` ...); the
loader stacks them into the per-expert tensors, skipping experts that other
ranks hold under expert parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from dpserve.model.attention import AttentionMetadata, paged_attention
from dpserve.model.expert_parallel import ExpertParallel
from dpserve.model.layers import RMSNorm, apply_rotary, linear
from dpserve.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    ModelDims,
    Target,
    copy_weight,
    mlp_targets,
)
from dpserve.model.moe import FusedMoE, MoESpec
from dpserve.model.tensor_parallel import TensorParallel

# model_type -> (q/k norm: "" | "head" | "full", MoE block prefix in weight names,
#                expert weight names (gate, up, down))
_ARCH: dict[str, tuple[str, str, tuple[str, str, str]]] = {
    "qwen3": ("head", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("", "block_sparse_moe.", ("w1", "w3", "w2")),
    "qwen2_moe": ("", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("head", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("full", "mlp.", ("gate_proj", "up_proj", "down_proj")),
}


def moe_spec(c: Mapping[str, Any]) -> MoESpec | None:
    """The routing of a config's MoE layers; None for a dense model."""
    kind = c.get("model_type")
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)  # both spellings
    if not experts:
        return None
    return MoESpec(
        num_experts=experts, top_k=int(c["num_experts_per_tok"]),
        intermediate=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
        renormalize=kind == "mixtral" or bool(c.get("norm_topk_prob", False)),
        float32_weights=kind == "mixtral",
        shared_intermediate=int(c.get("shared_expert_intermediate_size") or 0)
        if kind == "qwen2_moe" else 0)


def is_moe_layer(c: Mapping[str, Any], index: int) -> bool:
    """Whether decoder layer `index` has a sparse MoE block (else a dense MLP)."""
    if c.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
        return True
    step = int(c.get("decoder_sparse_step") or 1)
    return index not in (c.get("mlp_only_layers") or []) and (index + 1) % step == 0


class QKNormAttention(LlamaAttention):
    """Llama attention with RMSNorm on q and k ("head": per head; "full": over the
    whole projection) and OLMoE's optional clamp of q, k and v.

    Under tensor parallelism a "full" norm holds its weight's slice for this
    worker's heads, and the mean square over the whole projection is the
    all-reduced sum of every worker's squares (`_full_norm`); a per-head norm is
    whole on every worker."""

    def __init__(self, d: ModelDims, qk_norm: str, clip_qkv: float | None,
                 dtype: torch.dtype, device: Any, tp: TensorParallel | None = None) -> None:
        super().__init__(d, dtype, device, tp)
        self.per_head = qk_norm == "head"
        q_width, k_width = ((d.head_dim, d.head_dim) if self.per_head
                            else (self.heads * d.head_dim, self.kv_heads * d.head_dim))
        self.q_norm = RMSNorm(q_width, d.eps, dtype, device)
        self.k_norm = RMSNorm(k_width, d.eps, dtype, device)
        # The whole projections' widths (a "full" norm's mean is over them).
        self.full_widths = (d.heads * d.head_dim, d.kv_heads * d.head_dim)
        if not self.per_head and self.tp.size > 1 and d.kv_heads < self.tp.size:
            raise ValueError(f"tensor_parallel_size {self.tp.size} must not exceed the "
                             f"model's {d.kv_heads} KV heads: its k norm spans every KV "
                             f"head, which would be replicated")
        self.clip = clip_qkv

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, hd = x.shape[0], self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.packed,
                     self.plain.get("qkv_weight"))  # [T, (H + 2KV) * d]
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
        q_end, k_end = self.heads * hd, (self.heads + self.kv_heads) * hd
        q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
        if self.per_head:
            q = self.q_norm(q.reshape(num_tokens, self.heads, hd))
            k = self.k_norm(k.reshape(num_tokens, self.kv_heads, hd))
        elif self.tp.size > 1:
            q = self._full_norm(q, self.q_norm, self.full_widths[0])
            k = self._full_norm(k, self.k_norm, self.full_widths[1])
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = apply_rotary(q.reshape(num_tokens, self.heads, hd), cos, sin)
        k = apply_rotary(k.reshape(num_tokens, self.kv_heads, hd), cos, sin)
        v = v.reshape(num_tokens, self.kv_heads, hd)
        attn = paged_attention(q, k, v, kv_cache, meta)  # [T, H * d]
        return self.output(attn)

    def _full_norm(self, x: torch.Tensor, norm: RMSNorm, width: int) -> torch.Tensor:
        """RMSNorm of x [T, this worker's slice] over the whole projection's `width`:
        the squares summed here, all-reduced, then scaled by this slice's weight."""
        x32 = x.float()
        mean_square = self.tp.all_reduce(x32.square().sum(dim=-1, keepdim=True)) / width
        normed = x32 * torch.rsqrt(mean_square + norm.eps)
        return norm.weight * normed.to(x.dtype)

    def weight_targets(self, d: ModelDims) -> dict[str, Target | None]:
        parts = super().weight_targets(d)
        hd = d.head_dim
        for name, norm, first in (("q", self.q_norm, self.first_head),
                                  ("k", self.k_norm, self.first_kv_head)):
            width = norm.weight.shape[0]
            parts[f"{name}_norm.weight"] = (Target(norm.weight, 0, width) if self.per_head
                                            else Target(norm.weight, 0, width,
                                                        (0, first * hd, width)))
        return parts


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (see the module docstring).

    `ep`: this worker's expert parallelism (None: every expert is held here); `tp`:
    this worker's place in its rank's tensor-parallel group.
    """

    def __init__(self, hf_config: Mapping[str, Any], dtype: torch.dtype,
                 device: torch.device | str, ep: ExpertParallel | None = None,
                 tp: TensorParallel | None = None) -> None:
        kind = hf_config.get("model_type")
        if kind not in _ARCH:
            raise ValueError(f"model_type {kind!r} is not one of {', '.join(_ARCH)}")
        self.qk_norm, self.moe_prefix, self.expert_names = _ARCH[kind]
        self.moe = moe_spec(hf_config)
        self.ep = ep
        super().__init__(hf_config, dtype, device, tp)

    def _make_layer(self, index: int, hf_config: Mapping[str, Any], dtype: torch.dtype,
                    device: Any) -> nn.Module:
        layer = LlamaDecoderLayer(self.dims, dtype, device, self.tp)
        if self.qk_norm:
            layer.attn = QKNormAttention(self.dims, self.qk_norm, hf_config.get("clip_qkv"),
                                         dtype, device, self.tp)
        if self.moe is not None and is_moe_layer(hf_config, index):
            layer.mlp = FusedMoE(self.dims, self.moe, dtype, device, self.ep, self.tp)
        return layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        if self.ep is None:
            return super().forward(input_ids, positions, attn_meta, kv_caches)
        self.ep.begin_forward(input_ids.shape[0], input_ids.device)  # every rank's counts
        hidden = super().forward(input_ids, positions, attn_meta, kv_caches)
        self.ep.end_forward()  # a DP failure held back for the TP peers' sake
        return hidden

    def resize_experts(self) -> set[str]:
        """Elastic expert parallelism: every MoE block makes room for the experts of the
        EP's current (rank, size); returns the checkpoint names to `load_experts`."""
        names = set()
        for index, layer in enumerate(self.layers):
            if isinstance(layer.mlp, FusedMoE):
                layer.mlp.resize_experts()
                names.update(self._expert_targets(index, layer))
        return names

    def load_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy in this rank's experts (after `resize_experts`); ValueError on a shape
        mismatch or an expert left unset."""
        targets = {}
        for index, layer in enumerate(self.layers):
            if isinstance(layer.mlp, FusedMoE):
                targets.update(self._expert_targets(index, layer))
        seen = set()
        for name, tensor in weights:
            if name not in targets:
                continue
            copy_weight(name, tensor, targets[name])
            seen.add(name)
        if missing := sorted(set(targets) - seen):
            raise ValueError(f"missing expert weights ({len(missing)}): "
                             + ", ".join(missing[:5]))

    def _expert_targets(self, index: int, layer: nn.Module
                        ) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Checkpoint name -> (parameter, first row, rows) of the experts held here."""
        pre = f"model.layers.{index}.{self.moe_prefix}experts."
        return {f"model.layers.{index}.{k}": v
                for k, v in self._mlp_targets(index, layer).items()
                if v is not None and f"model.layers.{index}.{k}".startswith(pre)}

    def expert_info(self) -> dict[str, Any]:
        """The routed experts held here: their range and parameter bytes (all layers)."""
        blocks = [m for m in self.layers.modules() if isinstance(m, FusedMoE)]
        first, end = blocks[0].expert_range if blocks else (0, 0)
        return dict(num_experts=self.moe.num_experts if self.moe else 0,
                    experts=[first, end], expert_bytes=sum(b.expert_bytes() for b in blocks),
                    expert_parallel=self.ep is not None and self.ep.size > 1)

    def _mlp_targets(self, index: int, layer: nn.Module) -> dict[str, Target | None]:
        parts: dict[str, Target | None] = {}
        mlp = layer.mlp
        if isinstance(mlp, LlamaMLP):
            parts.update(mlp_targets("mlp.", mlp, self.dims.hidden))
            return parts
        assert isinstance(mlp, FusedMoE) and self.moe is not None
        pre, (gate, up, down) = self.moe_prefix, self.expert_names
        hidden = self.dims.hidden
        parts[f"{pre}gate.weight"] = Target(mlp.router, 0, self.moe.num_experts)
        first, end = mlp.expert_range
        # This worker's slice of every expert's intermediate dimension (all of it
        # without tensor parallelism).
        i0, inter = mlp.inter_first, mlp.inter
        for e in range(self.moe.num_experts):
            names = [f"{pre}experts.{e}.{n}.weight" for n in (gate, up, down)]
            if not first <= e < end:
                parts.update(dict.fromkeys(names))  # another rank's expert
                continue
            local = e - first
            parts[names[0]] = Target(mlp.w13[local], 0, inter, (0, i0, inter))
            parts[names[1]] = Target(mlp.w13[local], inter, inter, (0, i0, inter))
            parts[names[2]] = Target(mlp.w2[local], 0, hidden, (1, i0, inter))
        if mlp.shared is not None:
            parts.update(mlp_targets(f"{pre}shared_expert.", mlp.shared, hidden))
            parts[f"{pre}shared_expert_gate.weight"] = Target(mlp.shared_gate, 0, 1)
        return parts
