"""Small building blocks of Llama-family models: RMSNorm, rotary embedding, SwiGLU.

Scope: pure functions and tiny modules with no knowledge of batching or the KV
cache. Rotary tables are precomputed once for every position the model can
see (`max_position_embeddings`) and indexed per step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpserve.cpu_features import cpu_flags
from dpserve.model import cpu_kernels
from dpserve.model.quant import Int8Weight, linear_int8


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 (as Hugging Face does)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x [T, H] -> a new [T, H]. `fused`: one pass of dpserve's CPU kernel
        (`cpu_kernels.add_rms_norm`; the caller checked it is available)."""
        if fused:
            return cpu_kernels.add_rms_norm(x.contiguous(), None, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor,
                    fused: bool = False) -> torch.Tensor:
        """residual += delta (in place), then the norm of residual (a new tensor);
        `fused`: both in one pass (residual contiguous, as a layer's running sum is)."""
        if fused:
            return cpu_kernels.add_rms_norm(residual, delta.contiguous(), self.weight,
                                            self.eps)
        residual.add_(delta)
        return self.forward(residual)


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether oneDNN pre-packed linears (float32, bfloat16) are available here."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same matrix in oneDNN's blocked layout (opaque).

    On CPU this beats MKL's F.linear at every batch size we run (measured on
    SmolLM2's shapes, 2 threads: 1.8x at 1 token, 2.2x at 16, 1.5x at 64, 1.2x
    for a 2048-token prefill); bfloat16 packed beats bfloat16 unpacked too (all of
    SmolLM2's linears at 1 row: 16.3 vs 22.8 ms, at 16 rows: 18.0 vs 30.7 ms, on a CPU
    with AVX512-BF16). The packed tensor is only valid for `linear`.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


FLOAT32_PACKING_ENV = "DPSERVE_CPU_FLOAT32_GEMM"  # "0": never; "1": even with AMX


def float32_packing_pays(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a bfloat16 model on this CPU packs its projections for oneDNN in float32:
    steps past the streaming kernel's rows (`cpu_kernels.kernel_rows`: prefill, large
    batches) then run in float32. Without AMX, oneDNN's bfloat16 GEMM runs at about
    half its float32 rate (AVX512-BF16's dot product retires fewer products per cycle
    than two float32 FMAs: 166 against 261 GFLOP/s on two Xeon cores), and with no
    native bfloat16 at all it converts every weight; all of SmolLM2's projections at
    64 rows 117 -> 92 ms, at 512 rows 842 -> 534. The results do not change in kind:
    bfloat16 inputs are exact in float32, sums are float32 either way, and the output
    is rounded to bfloat16 once."""
    choice = os.environ.get(FLOAT32_PACKING_ENV, "")
    if (choice == "0" or dtype != torch.bfloat16
            or not can_prepack(torch.float32, device)):
        return False
    return choice == "1" or "amx_bf16" not in cpu_flags()


def bucket_rows(rows: int) -> int:
    """The row count a CPU oneDNN linear runs with: `rows` rounded up to a few sizes.

    oneDNN keeps compiled kernels (and their buffers) per input shape, in two caches
    of 1,024 entries each, about 0.5 MB an entry for SmolLM2's shapes: with a new
    token count at nearly every step, an engine grew by 500 MB in half an hour
    (bench/soak.py). Rounding leaves 63 shapes up to 4,096 rows: exact up to 8,
    steps of 8 up to 64, then eight steps per doubling, so padding stays under 1/8
    of the rows (small batches, bound by reading the weights, barely notice it).
    """
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: bool, plain: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out]; `packed` says whether `weight` came from `prepack`.

    `plain`: the same matrix unpacked, kept where dpserve's kernel is built
    (`cpu_kernels`): steps of up to `cpu_kernels.kernel_rows(plain.dtype)` rows run it
    (x may be float32 against a bfloat16 `plain`: int8 mode's LM head).

    On CPU, oneDNN linears (packed float32, and bfloat16/float16) run on
    `bucket_rows(T)` rows (zero padding, dropped after). A `quant.Int8Weight`
    (`--quantization int8`) runs the int8 kernel; its bias is inside it. A packed
    weight in another dtype than `x` (a bfloat16 model's float32 packing,
    `float32_packing_pays`; int8 mode's bfloat16 LM head) runs in the weight's dtype
    and returns `x`'s.
    """
    if plain is not None and x.shape[0] <= cpu_kernels.kernel_rows(plain.dtype):
        out = cpu_kernels.gemv(x, plain)
        return out if bias is None else out.add_(bias)
    if isinstance(weight, Int8Weight):
        return linear_int8(x, weight)
    if packed and weight.dtype != x.dtype:
        bias = None if bias is None else bias.to(weight.dtype)
        return linear(x.to(weight.dtype), weight, bias, packed).to(x.dtype)
    if packed or (x.is_cpu and x.dtype != torch.float32):  # oneDNN (bf16 goes there too)
        rows = x.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = (torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "") if packed
               else F.linear(x, weight, bias))
        return out[:rows] if padded != rows else out
    return F.linear(x, weight, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up for gate_up = [gate | up] along the last dim.

    gate_up: [T, 2 * I] -> [T, I] (the result is a fresh contiguous tensor).
    """
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate)
    return out.mul_(up)


@dataclass(frozen=True)
class RopeSpec:
    """RoPE settings read from config.json (either spelling of the keys)."""

    rope_type: str  # default | linear | llama3 | yarn | dynamic
    theta: float
    params: Mapping[str, Any] = field(default_factory=dict)


_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_spec_from_config(hf_config: Mapping[str, Any]) -> RopeSpec:
    """Read RoPE settings from `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (older configs); unknown types raise ValueError."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    else:
        params = hf_config.get("rope_scaling") or {}
        theta = hf_config.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"RoPE scaling type {rope_type!r} is not supported; "
                         f"supported: {', '.join(_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    return RopeSpec(rope_type=rope_type, theta=float(theta), params=extra)


def _inv_freq(spec: RopeSpec, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale for `spec`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (spec.theta ** exponents)
    p = spec.params
    if spec.rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if spec.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, p), 1.0
    if spec.rope_type == "yarn":
        return _yarn_inv_freq(spec, head_dim, max_positions)
    # default, and dynamic NTK: positions never pass max_position_embeddings
    # (max_model_len is capped there), where dynamic scaling is the identity.
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(spec: RopeSpec, head_dim: int,
                   max_positions: int) -> tuple[torch.Tensor, float]:
    p, base, dim = spec.params, spec.theta, head_dim
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) with precomputed cos/sin tables.

    Tables: cos, sin [max_positions, head_dim // 2] in the model dtype.
    """

    def __init__(self, head_dim: int, max_positions: int, spec: RopeSpec,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scale = _inv_freq(spec, head_dim, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype=dtype, device=device),
                             persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]: each [T, 1, head_dim // 2] (once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, 1, head_dim // 2]; returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out
