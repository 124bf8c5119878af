"""Llama-family decoder (Llama, Mistral without sliding window, Qwen2, SmolLM2).

The model works on a step's flattened tokens (all requests, no padding) and a
paged KV cache (see `attention.py`). q/k/v and gate/up projections are fused
into one matrix each when the Hugging Face weights are loaded, so a layer runs
four matmuls. `forward` returns final-normed hidden states for every token;
`compute_logits` runs the LM head only on the rows that are sampled.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from dpserve.model import cpu_kernels
from dpserve.model.attention import AttentionMetadata, paged_attention
from dpserve.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    bucket_rows,
    can_prepack,
    float32_packing_pays,
    linear,
    prepack,
    rope_spec_from_config,
    silu_and_mul,
)
from dpserve.model.one_call import run_layers
from dpserve.model.quant import can_quantize, per_row_activations, quantize_weight
from dpserve.model.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from dpserve.model.lora import LoRAHook

logger = logging.getLogger(__name__)


def _param(*shape: int, dtype: torch.dtype, device: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Target(NamedTuple):
    """Where a checkpoint tensor goes: rows [start, start + rows) of `param`; under
    tensor parallelism `src` = (dim, first, length) is the slice of the checkpoint
    tensor this worker holds (None: all of it). `param` None: the model has no
    such parameter."""

    param: torch.Tensor | None
    start: int
    rows: int
    src: tuple[int, int, int] | None = None


def _one(tp: TensorParallel | None) -> TensorParallel:
    """A worker's TP place; a model without tensor parallelism is worker 0 of 1."""
    return tp if tp is not None else TensorParallel(0, 1)


@dataclass(frozen=True)
class ModelDims:
    """Sizes and options read from config.json (the runner sizes the KV cache from them)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    eps: float
    max_positions: int
    qkv_bias: bool  # Qwen2, or attention_bias
    o_bias: bool
    mlp_bias: bool
    tied: bool  # lm_head shares the embedding matrix

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> ModelDims:
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        heads = int(c["num_attention_heads"])
        is_qwen2 = c.get("model_type") in ("qwen2", "qwen2_moe")
        dims = cls(hidden=int(c["hidden_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
                   intermediate=int(c["intermediate_size"]), layers=int(c["num_hidden_layers"]),
                   vocab=int(c["vocab_size"]), eps=float(c.get("rms_norm_eps", 1e-6)),
                   max_positions=int(c.get("max_position_embeddings", 2048)),
                   qkv_bias=(bool(c.get("qkv_bias", True)) if is_qwen2
                             else bool(c.get("attention_bias", False))),
                   o_bias=not is_qwen2 and bool(c.get("attention_bias", False)),
                   mlp_bias=bool(c.get("mlp_bias", False)),
                   tied=bool(c.get("tie_word_embeddings", False)))
        window = c.get("sliding_window")
        if (isinstance(window, int) and c.get("use_sliding_window", True)
                and window < dims.max_positions):
            logger.warning("sliding_window=%d is ignored: attention is full over the context, "
                           "which differs from the model past %d tokens", window, window)
        return dims


class LlamaAttention(nn.Module):
    """Self-attention over this worker's heads (`tensor_parallel`: all of them
    without TP); O's partial sums are all-reduced over the TP group."""

    def __init__(self, d: ModelDims, dtype: torch.dtype, device: Any,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = _one(tp)
        (self.first_head, self.heads), (self.first_kv_head, self.kv_heads) = \
            self.tp.head_ranges(d.heads, d.kv_heads)
        self.head_dim, self.hidden = d.head_dim, d.hidden
        qkv_out = (self.heads + 2 * self.kv_heads) * d.head_dim
        self.qkv_weight = _param(qkv_out, d.hidden, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_out, dtype=dtype, device=device) if d.qkv_bias else None
        self.o_weight = _param(d.hidden, self.heads * d.head_dim, dtype=dtype, device=device)
        # A row-parallel bias is added once: worker 0 holds it.
        self.o_bias_elsewhere = d.o_bias and self.tp.rank != 0
        self.o_bias = (_param(d.hidden, dtype=dtype, device=device)
                       if d.o_bias and not self.o_bias_elsewhere else None)
        self.packed = False  # weights in oneDNN layout (see prepack_weights)
        self.plain: dict[str, torch.Tensor] = {}  # unpacked copies for cpu_kernels
        self.lora: LoRAHook | None = None  # set when LoRA is enabled (model.lora)

    PACKABLE = ("qkv_weight", "o_weight")  # what prepack_weights may pack

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, head_dim // 2]
        num_tokens = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.packed,
                     self.plain.get("qkv_weight"))  # [T, (H + 2KV) * d]
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        if meta.fused_ops:  # RoPE, and k and v written to the cache, in one pass
            qk = cpu_kernels.rotary_kv(qkv, self.heads, self.kv_heads, cos, sin,
                                       meta.slot_mapping, kv_cache)
        else:
            qk = apply_rotary(qkv[:, :qk_width].view(num_tokens, -1, self.head_dim), cos, sin)
        q, k = qk[:, :self.heads], qk[:, self.heads:]  # [T, H, d], [T, KV, d]
        v = qkv[:, qk_width:].view(num_tokens, self.kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv_cache, meta, kv_written=meta.fused_ops)
        return self.output(attn)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """O over attn [T, H * d] -> [T, hidden], summed over the TP group (a LoRA
        delta is a partial sum too: added before the all-reduce)."""
        out = linear(attn, self.o_weight, self.o_bias, self.packed, self.plain.get("o_weight"))
        if self.lora is not None:
            self.lora.add("o", attn, out)
        return self.tp.all_reduce(out)

    def weight_targets(self, d: ModelDims) -> dict[str, Target | None]:
        """HF names (after `self_attn.`) -> where they go: this worker's heads of q, k
        and v into the merged QKV rows, the matching columns of O."""
        hd = d.head_dim
        q_rows, kv_rows = self.heads * hd, self.kv_heads * hd
        parts: dict[str, Target | None] = {
            "o_proj.weight": Target(self.o_weight, 0, d.hidden,
                                    (1, self.first_head * hd, q_rows)),
            "o_proj.bias": None if self.o_bias_elsewhere else Target(self.o_bias, 0, d.hidden)}
        sources = {"q": self.first_head * hd, "k": self.first_kv_head * hd,
                   "v": self.first_kv_head * hd}
        for kind in ("weight", "bias"):  # fused row ranges: q | k | v
            fused = self.qkv_weight if kind == "weight" else self.qkv_bias
            for name, start, n in zip("qkv", (0, q_rows, q_rows + kv_rows),
                                      (q_rows, kv_rows, kv_rows), strict=True):
                parts[f"{name}_proj.{kind}"] = Target(fused, start, n, (0, sources[name], n))
        return parts


class LlamaMLP(nn.Module):
    """SwiGLU over this worker's slice of the intermediate dimension; down's partial
    sums are all-reduced over the TP group unless `reduce` is off (a caller that
    adds them to other partial sums and reduces once: the MoE block's shared expert)."""

    def __init__(self, d: ModelDims, dtype: torch.dtype, device: Any,
                 tp: TensorParallel | None = None, reduce: bool = True) -> None:
        super().__init__()
        self.tp, self.reduce = _one(tp), reduce
        self.first, inter = self.tp.split(d.intermediate, "intermediate size")
        self.inter, self.hidden = inter, d.hidden  # this worker's intermediate slice
        self.gate_up_weight = _param(2 * inter, d.hidden, dtype=dtype, device=device)
        self.gate_up_bias = (_param(2 * inter, dtype=dtype, device=device)
                             if d.mlp_bias else None)
        self.down_weight = _param(d.hidden, inter, dtype=dtype, device=device)
        self.down_bias_elsewhere = d.mlp_bias and self.tp.rank != 0  # worker 0 holds it
        self.down_bias = (_param(d.hidden, dtype=dtype, device=device)
                          if d.mlp_bias and not self.down_bias_elsewhere else None)
        self.packed = False  # weights in oneDNN layout (see prepack_weights)
        self.plain: dict[str, torch.Tensor] = {}  # unpacked copies for cpu_kernels
        self.lora: LoRAHook | None = None  # set when LoRA is enabled (model.lora)

    PACKABLE = ("gate_up_weight", "down_weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.packed,
                         self.plain.get("gate_up_weight"))  # [T, 2I]
        if self.lora is not None:
            self.lora.add("gate_up", x, gate_up)
        act = silu_and_mul(gate_up)  # [T, I]
        out = linear(act, self.down_weight, self.down_bias, self.packed,
                     self.plain.get("down_weight"))  # [T, hidden]
        if self.lora is not None:
            self.lora.add("down", act, out)
        return self.tp.all_reduce(out) if self.reduce else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: ModelDims, dtype: torch.dtype, device: Any,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(d.hidden, d.eps, dtype, device)
        self.attn = LlamaAttention(d, dtype, device, tp)
        self.post_attn_norm = RMSNorm(d.hidden, d.eps, dtype, device)
        self.mlp = LlamaMLP(d, dtype, device, tp)

    def one_call_tensors(self) -> tuple[torch.Tensor, ...] | None:
        """Input norm, QKV, O, post-attention norm, gate/up and down weights, the plain
        matrices, for `one_call.run_layers`; None where this layer runs more than they
        say (a subclass, a bias, LoRA, tensor parallel) or kept no plain copies."""
        attn, mlp = self.attn, self.mlp
        if (type(self) is not LlamaDecoderLayer or type(attn) is not LlamaAttention
                or type(mlp) is not LlamaMLP or attn.lora is not None or mlp.lora is not None
                or attn.tp.size != 1 or attn.qkv_bias is not None or attn.o_bias is not None
                or mlp.gate_up_bias is not None or mlp.down_bias is not None):
            return None
        plain = (attn.plain.get("qkv_weight"), attn.plain.get("o_weight"),
                 mlp.plain.get("gate_up_weight"), mlp.plain.get("down_weight"))
        if any(t is None for t in plain):
            return None
        qkv, o, gate_up, down = plain
        return self.input_norm.weight, qkv, o, self.post_attn_norm.weight, gate_up, down

    def forward(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # residual: [T, hidden], updated in place and returned.
        fused = meta.fused_ops
        attn = self.attn(self.input_norm(residual, fused), cos, sin, kv_cache, meta)
        residual.add_(self.mlp(self.post_attn_norm.add_forward(residual, attn, fused)))
        return residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    kv_caches: one tensor per layer, [2, num_blocks, block_size, kv_heads_here, head_dim].
    `tp`: this worker's place in its rank's tensor-parallel group (None: the whole
    model here); `dims` are always the whole model's.
    """

    def __init__(self, hf_config: Mapping[str, Any], dtype: torch.dtype,
                 device: torch.device | str, tp: TensorParallel | None = None) -> None:
        super().__init__()
        d = self.dims = ModelDims.from_config(hf_config)
        self.dtype = dtype
        self.tp = _one(tp)
        self.kv_heads_here = self.tp.head_ranges(d.heads, d.kv_heads)[1][1]
        # This worker's vocabulary rows; the last shard's padding rows stay zero.
        self.vocab_first, self.vocab_rows, shard = self.tp.vocab_range(d.vocab)
        self.embed = nn.Parameter(torch.zeros(shard, d.hidden, dtype=dtype, device=device),
                                  requires_grad=False)
        self.layers = nn.ModuleList(self._make_layer(i, hf_config, dtype, device)
                                    for i in range(d.layers))
        self.norm = RMSNorm(d.hidden, d.eps, dtype, device)
        self.lm_head = self.embed if d.tied else nn.Parameter(
            torch.zeros(shard, d.hidden, dtype=dtype, device=device), requires_grad=False)
        self.rotary = RotaryEmbedding(d.head_dim, d.max_positions,
                                      rope_spec_from_config(hf_config), dtype, device)
        self.packed = False
        self.lm_head_plain: torch.Tensor | None = None  # for cpu_kernels (tied heads)
        self.one_call_steps = 0  # steps whose layers ran in one call (one_call.py)

    def _make_layer(self, index: int, hf_config: Mapping[str, Any], dtype: torch.dtype,
                    device: Any) -> nn.Module:
        """Decoder layer `index` (subclasses build other kinds)."""
        return LlamaDecoderLayer(self.dims, dtype, device, self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden]."""
        cos, sin = self.rotary.tables(positions)  # once per step, shared by all layers
        hidden = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor
        if run_layers(self, attn_meta, hidden, cos, sin, kv_caches):  # few decode rows
            self.one_call_steps += 1
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden = layer(hidden, cos, sin, kv_cache, attn_meta)
        return self.norm(hidden, attn_meta.fused_ops)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]. Under TP each worker looks up the ids of its
        vocabulary slice (zero rows for the others) and the sum is all-reduced."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_first
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed)
        hidden.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] float32 (under TP: every worker's
        vocabulary slice, all-gathered; every worker gets them all)."""
        logits = linear(hidden, self.lm_head, None, self.packed, self.lm_head_plain)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[:, :self.dims.vocab]
        return logits.float()

    def prepack_weights(self) -> bool:
        """After loading: move every projection to oneDNN's layout where that is
        faster (CPU float32 and bfloat16). A tied LM head gets its own packed copy,
        since the embedding lookup needs the plain matrix. Returns whether it packed."""
        if self.packed or not can_prepack(self.dtype, self.embed.device):
            return False
        # Decode steps of a few rows stream the plain matrices (cpu_kernels), larger
        # steps run the packed ones: both are kept where the kernel is built.
        keep_plain = cpu_kernels.available()
        # A bfloat16 model's steps past the kernel's rows may run faster in float32
        # (`float32_packing_pays`); only with the kernel there for the smaller ones.
        packed_dtype = (torch.float32 if keep_plain and self._float32_packing_fits()
                        else self.dtype)
        # Packed tensors are opaque (not strided), so they replace the
        # parameters as plain attributes.
        for module in self.layers.modules():  # every module naming PACKABLE weights
            for name in getattr(module, "PACKABLE", ()):
                plain = getattr(module, name).data.contiguous()
                packed = prepack(plain.to(packed_dtype))
                delattr(module, name)
                setattr(module, name, packed)
                if keep_plain:
                    module.plain[name] = plain
            if getattr(module, "PACKABLE", ()):
                module.packed = True
        head = prepack(self.lm_head.data)
        if keep_plain:  # tied: the embedding matrix, kept anyway
            self.lm_head_plain = self.embed.data if self.dims.tied else self.lm_head.data
        del self.lm_head  # the parameter name only: a tied `embed` stays
        self.lm_head = head
        self.packed = True
        return True

    def _float32_packing_fits(self) -> bool:
        """Whether to pack the layer projections in float32 (`float32_packing_pays`):
        where that pays, and where the packed copies take at most a quarter of the
        memory now free (4 bytes a weight, beside the plain bfloat16 matrices the kernel
        reads; the LM head stays in the model's dtype: its steps are a row a sequence)."""
        if not float32_packing_pays(self.dtype, self.embed.device):
            return False
        need = 4 * sum(getattr(m, name).numel() for m in self.layers.modules()
                       for name in getattr(m, "PACKABLE", ()))
        free = psutil.virtual_memory().available
        if need > free // 4:
            logger.info("projections packed in bfloat16, not float32: float32 needs %.0f MiB, "
                        "over a quarter of the %.0f MiB free", need / 2**20, free / 2**20)
            return False
        return True

    def float32_packed_bytes(self) -> int:
        """Bytes of a bfloat16 model's projections packed in float32 (0: none)."""
        if self.dtype == torch.float32:
            return 0
        return sum(getattr(m, name).numel() * 4 for m in self.layers.modules()
                   for name in getattr(m, "PACKABLE", ())
                   if getattr(getattr(m, name), "dtype", None) == torch.float32)

    def plain_bytes(self) -> int:
        """Bytes of the unpacked copies kept for cpu_kernels (the tied head's is free)."""
        head = self.lm_head_plain
        own_head = head is not None and head.data_ptr() != self.embed.data_ptr()
        return (sum(t.numel() * t.element_size() for m in self.layers.modules()
                    for t in getattr(m, "plain", {}).values())
                + (head.numel() * head.element_size() if own_head else 0))

    def quantize_weights(self, lm_head: bool = False,
                         head_dtype: torch.dtype = torch.float32) -> int:
        """After loading, instead of `prepack_weights`: layer projections (merged QKV,
        O, merged gate/up, and down where activations are quantised per row) to int8
        (`quant.quantize_weight`, bias inside); the LM head (unless `lm_head`)
        pre-packed in `head_dtype` (bfloat16 where the CPU has it natively: about
        twice float32's speed, perplexity unchanged; bench/quality.py). Experts of MoE
        layers (no PACKABLE) stay float. Returns how many matrices it quantised.

        Down stays pre-packed float32 under fbgemm's kernel (`quant.per_row_activations`
        false): its input (silu(gate) * up) has outlier channels that one activation
        range per step flattens (SmolLM2-135M perplexity 20.2 -> 31.6, 34.5 even
        after `smooth_into_up`). With per-row ranges and `smooth_into_up`: 20.20,
        float32's 20.18, and more tokens/s than with down in float32 (about +7%
        offline, +15-20% served at 16 streams: BENCHMARKS.md)."""
        if self.packed or not can_quantize(self.dtype, self.embed.device):
            raise ValueError("quantization int8 needs float32 weights on CPU")
        keep_float = () if per_row_activations() else ("down_weight",)
        for layer in self.layers:
            if isinstance(layer, LlamaDecoderLayer):
                smooth_into_norm(layer.input_norm, layer.attn.qkv_weight)
                smooth_into_norm(layer.post_attn_norm, layer.mlp.gate_up_weight)
                if not keep_float:
                    smooth_into_up(layer.mlp)
        count = 0
        for module in self.layers.modules():
            for name in getattr(module, "PACKABLE", ()):
                bias_name = name.removesuffix("_weight") + "_bias"
                bias = getattr(module, bias_name, None)
                if name in keep_float:
                    new = prepack(getattr(module, name).data)
                else:
                    new = quantize_weight(getattr(module, name).data, bias)
                    count += 1
                    if bias is not None:  # now inside the int8 weight
                        delattr(module, bias_name)
                        setattr(module, bias_name, None)
                delattr(module, name)
                setattr(module, name, new)
            if getattr(module, "PACKABLE", ()):
                module.packed = True  # weights no longer plain matrices
        head = (quantize_weight(self.lm_head.data) if lm_head
                else prepack(self.lm_head.data.to(head_dtype)))
        if not lm_head and cpu_kernels.available():  # small steps: dpserve's kernel
            self.lm_head_plain = self.lm_head.data.to(head_dtype).contiguous()
        del self.lm_head
        self.lm_head = head
        self.packed = True
        return count + int(lm_head)

    @torch.inference_mode()
    def warm_up_linears(self, max_rows: int, max_head_rows: int) -> int:
        """Run every distinct packed linear once at each bucketed row count it can see
        (`layers.bucket_rows`; the LM head only up to `max_head_rows`, the sampled
        rows), so oneDNN compiles and caches now every kernel serving will use: the
        engine's memory reaches its plateau at start-up (SmolLM2, 2,048-token steps:
        251 pairs, +140 MB once glibc's free heap is trimmed, under 2 s), and no step
        waits for a compile. Row counts dpserve's kernel takes (`cpu_kernels.kernel_rows`,
        where the plain matrix is kept) never reach oneDNN and are skipped. Returns how
        many (weight shape, rows) pairs ran."""
        if not self.packed:
            return 0
        shapes: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        for module in self.layers.modules():
            for name in getattr(module, "PACKABLE", ()):
                weight = getattr(module, name)
                if not isinstance(weight, torch.Tensor):  # int8: no per-shape kernels
                    continue
                shapes.setdefault(tuple(weight.shape), (weight, module.plain.get(name)))
        runs = 0
        for (weight, plain), limit in [*((w, max_rows) for w in shapes.values()),
                                       ((self.lm_head, self.lm_head_plain), max_head_rows)]:
            floor = 0 if plain is None else cpu_kernels.kernel_rows(plain.dtype)
            for rows in sorted({bucket_rows(n) for n in range(floor + 1, limit + 1)}):
                linear(torch.zeros(rows, weight.shape[1], dtype=weight.dtype), weight, None,
                       True)
                runs += 1
        return runs

    # ---- weights ---------------------------------------------------------

    def _weight_targets(self) -> dict[str, Target | None]:
        """HF name -> where it goes (`Target`); None: a known weight held elsewhere."""
        d = self.dims
        vocab = Target(self.embed, 0, self.vocab_rows, (0, self.vocab_first, self.vocab_rows))
        targets: dict[str, Target | None] = {
            "model.embed_tokens.weight": vocab,
            "model.norm.weight": Target(self.norm.weight, 0, d.hidden),
        }
        if not d.tied:
            targets["lm_head.weight"] = vocab._replace(param=self.lm_head)
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            parts: dict[str, Target | None] = {
                "input_layernorm.weight": Target(layer.input_norm.weight, 0, d.hidden),
                "post_attention_layernorm.weight": Target(layer.post_attn_norm.weight, 0,
                                                          d.hidden),
            }
            parts.update({"self_attn." + k: v
                          for k, v in layer.attn.weight_targets(d).items()})
            parts.update(self._mlp_targets(i, layer))
            targets.update({pre + k: v for k, v in parts.items()
                            if v is None or v[0] is not None})
        return targets

    def _mlp_targets(self, index: int, layer: nn.Module) -> dict[str, Target | None]:
        """Layer `index`'s MLP weights (names after `model.layers.N.`); subclasses
        add theirs. A target of None: a known weight this model does not hold."""
        return mlp_targets("mlp.", layer.mlp, self.dims.hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up.

        Raises ValueError on a name the model does not have, a shape mismatch,
        or a parameter left unset.
        """
        targets = self._weight_targets()
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight"
                                                         and self.dims.tied):
                continue
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            target = targets[name]
            if target is None:  # known, held by another rank (expert parallel)
                seen.add(name)
                continue
            copy_weight(name, tensor, target)
            seen.add(name)
        missing = sorted(set(targets) - seen, key=_natural_key)
        if missing:
            raise ValueError(f"missing weights ({len(missing)}): {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))


def copy_weight(name: str, tensor: torch.Tensor,
                target: tuple[torch.Tensor, int, int] | Target) -> None:
    """Copy checkpoint tensor `name` (its `src` slice, for a `Target` with one) into
    its place, rows [start, start + rows) of the parameter (`_weight_targets`);
    ValueError on a shape mismatch."""
    param, start, rows, *rest = target
    if rest and rest[0] is not None:
        dim, first, length = rest[0]
        if tensor.dim() <= dim or tensor.shape[dim] < first + length:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, too small "
                             f"for this tensor-parallel worker's slice [{first}, "
                             f"{first + length}) of dimension {dim}")
        tensor = tensor.narrow(dim, first, length)
    dest = param.data[start:start + rows]
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def smooth_into_up(mlp: LlamaMLP, alpha: float = 0.5) -> None:
    """SmoothQuant for down, without calibration data: divide up's output channel j
    (row j of up, and its bias) by s_j and multiply down's column j by it. Exact in
    float, since down's input silu(gate) * up is linear in up. Channel j's activation
    range is taken as |gate_j| * |up_j| (the rows' norms; the RMSNorm before them
    keeps the input's norm fixed), so s_j = (|gate_j| |up_j|)^alpha /
    max_i |down_ij|^(1 - alpha), scaled to mean 1. Run after `smooth_into_norm`."""
    gate_up, down = mlp.gate_up_weight.data, mlp.down_weight.data
    inter = down.shape[1]
    gate, up = gate_up[:inter], gate_up[inter:]
    s = ((gate.norm(dim=1) * up.norm(dim=1)).clamp(min=1e-8) ** alpha
         / down.abs().amax(dim=0).clamp(min=1e-8) ** (1 - alpha))
    s /= s.mean()
    up.div_(s[:, None])
    if mlp.gate_up_bias is not None:
        mlp.gate_up_bias.data[inter:].div_(s)
    down.mul_(s[None, :])


def smooth_into_norm(norm: RMSNorm, weight: torch.Tensor, alpha: float = 0.5) -> None:
    """SmoothQuant without calibration data, before int8: divide input channel j of
    the RMSNorm's output by s_j and multiply weight column j by it (exact in float).
    The norm's weight stands in for the activation's channel range (outlier
    channels come from it), so s_j = |g_j|^alpha / max_i |W_ij|^(1 - alpha), scaled
    to mean 1. SmolLM2-135M perplexity with int8: 21.3 -> 20.3 (float32 20.2)."""
    g = norm.weight.data
    s = (g.abs().clamp(min=1e-5) ** alpha
         / weight.data.abs().amax(dim=0).clamp(min=1e-5) ** (1 - alpha))
    s /= s.mean()
    g.div_(s)
    weight.data.mul_(s[None, :])


def mlp_targets(prefix: str, mlp: LlamaMLP, hidden: int) -> dict[str, Target | None]:
    """HF names (after `prefix`) of a SwiGLU MLP -> rows of its fused gate | up matrix
    (this worker's slice of the intermediate dimension) and down's matching columns."""
    inter, first = mlp.down_weight.shape[1], mlp.first
    parts: dict[str, Target | None] = {
        "down_proj.weight": Target(mlp.down_weight, 0, hidden, (1, first, inter)),
        "down_proj.bias": None if mlp.down_bias_elsewhere else Target(mlp.down_bias, 0,
                                                                      hidden)}
    for kind in ("weight", "bias"):
        gu = mlp.gate_up_weight if kind == "weight" else mlp.gate_up_bias
        parts[f"gate_proj.{kind}"] = Target(gu, 0, inter, (0, first, inter))
        parts[f"up_proj.{kind}"] = Target(gu, inter, inter, (0, first, inter))
    return {prefix + k: v for k, v in parts.items()}


def _natural_key(name: str) -> list[Any]:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]
