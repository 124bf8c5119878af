"""A decode step's decoder layers in one C call (`cpu_kernels.decode_layers`).

Scope: `run_layers`, which decides whether a step may skip the per-layer Python
(`LlamaDecoderLayer.forward` and what it calls: a dozen kernel calls per layer,
about 4 ms of a 15.7 ms one-row bfloat16 step of the default model) and then runs every layer
in one call. It may when the step is decode rows only, few enough for
dpserve's streaming kernel (`cpu_kernels.kernel_rows`), attended by the CPU decode
kernel in one chunk; and when every layer is a plain Llama layer that offers its
plain matrices (`LlamaDecoderLayer.one_call_tensors`: no bias, LoRA or tensor
parallelism). The kernels and their order are the Python path's, so the results
are its results, but for silu (`decode_layers.c` computes it with its own exp, to
about 2e-7 relative).

Not here: the embeddings, the final norm and the logits (the model's), what the
kernels do (`cpu_kernels`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpserve.model import cpu_kernels
from dpserve.model.attention import AttentionMetadata


def run_layers(model: Any, meta: AttentionMetadata, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, kv_caches: Sequence[torch.Tensor]) -> bool:
    """Every decoder layer of `model` over this step, in place on `hidden` (the
    embeddings in, the sum after the last layer out), in one call; False, with
    nothing done, where the step or the model is outside what that call runs."""
    rows = hidden.shape[0]
    if not (meta.decode_kernel and not meta.prefill_groups and len(meta.decode_chunks) == 1
            and meta.num_decode_tokens == rows <= cpu_kernels.kernel_rows(hidden.dtype)):
        return False
    d = model.dims
    if (d.intermediate % 16 or not hidden.is_contiguous()
            or not cpu_kernels.supports_attention(d.heads, d.kv_heads, d.head_dim)):
        return False
    table = _table(model.layers, kv_caches, hidden.dtype, d.eps)
    if table is None:
        return False
    chunk = meta.decode_chunks[0]
    cpu_kernels.decode_layers(table, hidden, cos, sin, meta.slot_mapping,
                              chunk.block_index.view(rows, -1), chunk.seq_lens,
                              kv_caches[0].shape, d.heads, d.intermediate, d.eps)
    return True


def _table(layers: Sequence[Any], kv_caches: Sequence[torch.Tensor], dtype: torch.dtype,
           eps: float) -> torch.Tensor | None:
    """[layers, 7] addresses for `cpu_kernels.decode_layers`, built each step (weights
    and caches may be replaced: sleep, reload); None where a layer cannot go."""
    addresses: list[int] = []
    shape = kv_caches[0].shape
    for layer, cache in zip(layers, kv_caches, strict=True):
        tensors = getattr(layer, "one_call_tensors", lambda: None)()
        if tensors is None or layer.input_norm.eps != eps or layer.post_attn_norm.eps != eps:
            return None
        for t in (*tensors, cache):
            if t.dtype != dtype or not t.is_contiguous():
                return None
        if cache.shape != shape:
            return None
        addresses += [t.data_ptr() for t in tensors]
        addresses.append(cache.data_ptr())
    return torch.tensor(addresses, dtype=torch.int64).view(len(layers), -1)
