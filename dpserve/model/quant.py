"""Opt-in int8 linears for CPU (`--quantization int8`): dynamic quantization.

Scope: weights are quantised once, after loading, to int8 with one symmetric
scale per output channel; activations are quantised to uint8 on the fly, per
tensor, inside the kernel (fbgemm's `quantized::linear_dynamic`, which uses
VNNI/AVX512 where the CPU has it and AVX2 otherwise), and results come back in
float32. Chosen by measurement (bench/int8_kernels.py) over oneDNN's
`qlinear_pointwise` (needs the activation quantised in Python first, slower at
decode sizes) and `torch._weight_int8pack_mm` (weight-only, far slower here).

fbgemm keeps no per-row-count kernel cache (unlike oneDNN, see
`layers.bucket_rows`), so int8 linears run on the exact rows: no padding.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from dpserve.cpu_features import cpu_flags

QUANTIZATIONS = ("int8",)


@functools.cache
def reduce_range() -> bool:
    """Whether activations use 7 bits instead of 8: without AVX512-VNNI, fbgemm
    multiplies u8 x s8 pairs into saturating int16 sums (vpmaddubsw), which 7-bit
    activations keep in range (PyTorch's x86 default does the same)."""
    return "avx512_vnni" not in cpu_flags()


class Int8Weight:
    """A linear's int8 weight (and float bias) packed for fbgemm; opaque.

    `shape` is the float weight's [out, in]. The bias lives inside: `linear`
    ignores its own bias argument for these weights.
    """

    __slots__ = ("packed", "shape")

    def __init__(self, packed: Any, shape: tuple[int, int]) -> None:
        self.packed = packed
        self.shape = torch.Size(shape)


def can_quantize(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether int8 dynamic linears run here (CPU, float32, an x86 fbgemm build)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and "x86" in torch.backends.quantized.supported_engines)


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
    """weight [out, in] float -> int8 with per-output-channel symmetric scales, packed.

    scale[o] = max|weight[o, :]| / 127 (a zero row gets a tiny scale, stays zero).
    """
    w = weight.detach().float().contiguous()
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).double()
    with warnings.catch_warnings():  # "quantized tensor creation ... deprecated" (2.13)
        warnings.simplefilter("ignore", UserWarning)
        qw = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long),
                                        0, torch.qint8)
    torch.backends.quantized.engine = "x86"  # fbgemm for linears
    b = bias.detach().float().contiguous() if bias is not None else None
    return Int8Weight(torch.ops.quantized.linear_prepack(qw, b), (w.shape[0], w.shape[1]))


def linear_int8(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [T, in] float32 -> [T, out] float32 (bias included)."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), weight.packed, reduce_range())
