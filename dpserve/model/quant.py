"""Opt-in int8 linears for CPU (`--quantization int8`): dynamic quantization.

Scope: weights are quantised once, after loading, to int8 with one symmetric
scale per output channel; activations are quantised on the fly inside the
kernel, and results come back in float32. Two kernels, chosen per machine:

* `vnni` (CPUs with AVX512-VNNI, dpserve's kernels built: `cpu_kernels`): dpserve's
  `int8_gemm.c`, activations quantised per row (a scale and zero point per token).
* `fbgemm` (otherwise, or DPSERVE_CPU_KERNELS=0): `quantized::linear_dynamic`,
  activations quantised per tensor (a scale and zero point per call; 7 bits
  without VNNI, see `reduce_range`).

Both measured by bench/int8_kernels.py against oneDNN's `qlinear_pointwise`
(needs the activation quantised in Python first, slower at decode sizes) and
`torch._weight_int8pack_mm` (weight-only, far slower here).

Neither keeps a per-row-count kernel cache (unlike oneDNN, see
`layers.bucket_rows`), so int8 linears run on the exact rows: no padding.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from dpserve.cpu_features import cpu_flags
from dpserve.model import cpu_kernels

QUANTIZATIONS = ("int8",)


@functools.cache
def reduce_range() -> bool:
    """Whether activations use 7 bits instead of 8: without AVX512-VNNI, fbgemm
    multiplies u8 x s8 pairs into saturating int16 sums (vpmaddubsw), which 7-bit
    activations keep in range (PyTorch's x86 default does the same)."""
    return "avx512_vnni" not in cpu_flags()


class Int8Weight:
    """A linear's int8 weight (and float bias), packed for its kernel; opaque.

    `shape` is the float weight's [out, in]; `kernel` is "vnni" or "fbgemm". The
    bias lives inside: `linear` ignores its own bias argument for these weights.
    """

    __slots__ = ("packed", "shape", "wsum", "scales", "bias")

    def __init__(self, packed: Any, shape: tuple[int, int], wsum: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        self.packed = packed
        self.shape = torch.Size(shape)
        self.wsum = wsum  # vnni: each output channel's weight sum (the zero-point term)
        self.scales = scales  # vnni: per output channel, zero padded like wsum
        self.bias = bias  # vnni (fbgemm's is inside `packed`)

    @property
    def kernel(self) -> str:
        return "vnni" if self.wsum is not None else "fbgemm"


def per_row_activations() -> bool:
    """Whether int8 linears quantise activations per row (the `vnni` kernel), which
    keeps an outlier channel of one token from flattening every other token's."""
    return cpu_kernels.int8_available()


def can_quantize(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether int8 dynamic linears run here (CPU, float32, an x86 fbgemm build)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and "x86" in torch.backends.quantized.supported_engines)


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
    """weight [out, in] float -> int8 with per-output-channel symmetric scales, packed
    for the machine's kernel (module docstring).

    scale[o] = max|weight[o, :]| / 127 (a zero row gets a tiny scale, stays zero).
    """
    w = weight.detach().float().contiguous()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    b = bias.detach().float().contiguous() if bias is not None else None
    shape = (w.shape[0], w.shape[1])
    if per_row_activations():
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        packed, wsum = cpu_kernels.int8_pack(q)
        scales = torch.zeros(wsum.numel(), dtype=torch.float32)
        scales[:w.shape[0]] = scale
        return Int8Weight(packed, shape, wsum=wsum, scales=scales, bias=b)
    with warnings.catch_warnings():  # "quantized tensor creation ... deprecated" (2.13)
        warnings.simplefilter("ignore", UserWarning)
        qw = torch.quantize_per_channel(w, scale.double(),
                                        torch.zeros(w.shape[0], dtype=torch.long), 0,
                                        torch.qint8)
    torch.backends.quantized.engine = "x86"  # fbgemm for linears
    return Int8Weight(torch.ops.quantized.linear_prepack(qw, b), shape)


def linear_int8(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [T, in] float32 -> [T, out] float32 (bias included)."""
    if weight.wsum is not None:
        return cpu_kernels.int8_linear(x, weight.packed, weight.wsum, weight.scales,
                                       weight.bias, weight.shape[0])
    return torch.ops.quantized.linear_dynamic(x.contiguous(), weight.packed, reduce_range())
