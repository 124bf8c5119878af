"""One worker's paged KV cache: how many blocks fit, and the tensors that hold them.

Scope: `KVCacheMemory`, held by the `ModelRunner`. Its layout is one tensor per
layer, [2, num_blocks + 1, block_size, kv_heads here, head_dim] (keys, values;
`attention.py`); the extra last block is a scratch block that dummy runs write.

How many blocks: `--num-kv-blocks` when given. Else the budget's worth, capped
at what `max_num_seqs` requests of `max_model_len` tokens need. The budget on
CPU is `--kv-cache-memory` (2 GiB by default); on CUDA, `gpu_memory_utilization`
of the device less the peak of a forward of the largest step (weights and
activations, `profile_run`) and the memory of other users.

Invariant: the budget holds one request of `max_model_len` tokens, else a
ValueError names the option to raise.

Not here: which blocks a request holds (`dpserve.engine.kv_cache`), the host
tier's copies (`dpserve.model.kv_copy`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from dpserve.engine_config import CacheConfig, SchedulerConfig
from dpserve.model.attention import build_attention_metadata, token_positions

logger = logging.getLogger(__name__)


class KVCacheMemory:
    """The KV cache of one worker (module docstring)."""

    def __init__(self, cache: CacheConfig, sched: SchedulerConfig, layers: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cache, self.sched = cache, sched
        self.block_size = cache.block_size
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.caches: list[torch.Tensor] = []  # [layers] of the shape above
        self.num_blocks = 0  # usable blocks; block `num_blocks` is the scratch block

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * elem

    def determine_num_blocks(self, model: Any) -> int:
        """KV blocks the budget holds, capped at what max_num_seqs full requests need.

        Raises ValueError when the budget cannot hold one max_model_len request.
        """
        cache, sched = self.cache, self.sched
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device.type == "cuda":
            budget, option = self._cuda_budget(model), "gpu_memory_utilization"
        else:
            budget, option = cache.kv_cache_memory or (2 << 30), "kv_cache_memory"
        per_seq = -(-sched.max_model_len // self.block_size)
        num_blocks = max(budget, 0) // self.block_bytes()
        if num_blocks < per_seq:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB, set by {option}) holds "
                f"{num_blocks} blocks of {self.block_size} tokens, but one request of "
                f"max_model_len={sched.max_model_len} needs {per_seq}; raise {option} "
                f"or lower max_model_len")
        return min(num_blocks, sched.max_num_seqs * per_seq)

    def _cuda_budget(self, model: Any) -> int:
        """Bytes left for the KV cache after weights, a max-size forward and other users."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run(model)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)  # weights + activations
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        return int(total * self.cache.gpu_memory_utilization) - peak - non_torch

    @torch.inference_mode()
    def profile_run(self, model: Any) -> None:
        """A forward of max_num_batched_tokens tokens + logits of max_num_seqs rows, its
        KV in one block of its own (the cache itself is left alone)."""
        sched, bs = self.sched, self.block_size
        tokens, seq_len = sched.max_num_batched_tokens, sched.max_model_len
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        query_lens = np.array(lens, dtype=np.int64)
        caches = [torch.zeros(2, 1, bs, self.kv_heads, self.head_dim, dtype=self.dtype,
                              device=self.device) for _ in range(self.layers)]
        table = np.zeros((len(lens), -(-seq_len // bs)), dtype=np.int64)
        meta = build_attention_metadata(query_lens, np.zeros_like(query_lens), table, 0,
                                        bs, self.dtype, self.device)
        meta.slot_mapping.remainder_(bs)  # everything in the one block
        positions = torch.from_numpy(token_positions(query_lens, np.zeros_like(query_lens)))
        hidden = model(torch.zeros(tokens, dtype=torch.int64, device=self.device),
                       positions.to(self.device), meta, caches)
        rows = torch.arange(min(tokens, sched.max_num_seqs), device=self.device)
        logits = model.compute_logits(hidden[rows])
        logits.softmax(dim=-1)

    def allocate(self, num_blocks: int) -> None:
        """`num_blocks` zeroed blocks per layer, plus one scratch block."""
        self.num_blocks = num_blocks
        self.caches = [
            torch.zeros(2, num_blocks + 1, self.block_size, self.kv_heads, self.head_dim,
                        dtype=self.dtype, device=self.device)
            for _ in range(self.layers)]
        logger.info("KV cache: %d blocks x %d tokens, %.1f MiB", num_blocks, self.block_size,
                    (num_blocks + 1) * self.block_bytes() / 2**20)

    def free(self) -> None:
        """Drop the tensors (sleep: their contents are lost); `num_blocks` is kept."""
        self.caches = []
