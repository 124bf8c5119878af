"""One worker's copies between its paged KV cache and the host tier's shared arena.

Scope: `KVTierCopier`, held by each `ModelRunner`: map the store's arena (the
engine has every worker attach a new generation before any step names it;
the two newest stay mapped, so a load from a store that just died or
restarted still reads its old segment), copy the step's loads into KV
blocks before the forward and its saves out of KV blocks after it, each on this
worker's shard of a slot (offset `tp_rank * shard_bytes`). Layout of a shard
(`dpserve.step.KVTransfer`): layer-major, K then V, each
`[block_size, kv_heads_here, head_dim]` of `kv_caches[layer][0|1][block_id]`.

On CUDA a load gathers the slots on the host, then copies them to the device in
one transfer; a save copies to the host in one transfer, then scatters.

Not here: which blocks move and when (`dpserve.engine.kv_connector`), the store
and the segment itself (`dpserve.kv_tier`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dpserve.step import KVTransfer

Attach = Callable[[str, int], torch.Tensor]  # (segment name, bytes) -> uint8 view


class KVTierCopier:
    """Loads and saves of one worker (see the module docstring).

    `load_seconds`: time spent in loads, cumulative (the engine reports worker 0's).
    """

    def __init__(self, tp_rank: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, attach: Attach | None = None) -> None:
        self.tp_rank = tp_rank
        self.block_shape = block_shape  # (layers, 2, block_size, kv_heads_here, head_dim)
        self.dtype = dtype
        self.device = device
        self.shard_bytes = (torch.empty(0, dtype=dtype).element_size()
                            * int(torch.Size(block_shape).numel()))
        self._attach = attach
        self._arenas: dict[tuple[str, int], torch.Tensor] = {}  # (name, gen) -> uint8 map
        self.load_seconds = 0.0

    def attach(self, name: str, size: int, generation: int) -> None:
        """Map the store's arena of `generation`; the mapping before it stays too."""
        key = (name, generation)
        if key not in self._arenas:
            self._arenas[key] = self._attach_arena(name, size)
        for old in list(self._arenas)[:-2]:
            del self._arenas[old]

    def load(self, t: KVTransfer, kv_caches: list[torch.Tensor]) -> None:
        """Copy slots into blocks: `t.loads` is [(slot, block_id)]."""
        start = time.perf_counter()
        shards = self._shards(t)
        slots = torch.tensor([s for s, _ in t.loads], dtype=torch.int64)
        blocks = torch.tensor([b for _, b in t.loads], dtype=torch.int64, device=self.device)
        n = len(t.loads)
        data = shards[slots].view(self.dtype).view(n, *self.block_shape)  # [n, L, 2, bs, h, d]
        data = data.to(self.device)
        for layer, cache in enumerate(kv_caches):  # cache: [2, num_blocks + 1, bs, h, d]
            cache[:, blocks] = data[:, layer].transpose(0, 1)
        self.load_seconds += time.perf_counter() - start

    def save(self, t: KVTransfer, kv_caches: list[torch.Tensor]) -> None:
        """Copy blocks into slots: `t.saves` is [(block_id, slot)]."""
        shards = self._shards(t)
        blocks = torch.tensor([b for b, _ in t.saves], dtype=torch.int64, device=self.device)
        slots = torch.tensor([s for _, s in t.saves], dtype=torch.int64)
        data = torch.stack([cache[:, blocks] for cache in kv_caches])  # [L, 2, n, bs, h, d]
        data = data.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()  # [n, L, 2, bs, h, d]
        shards[slots] = data.view(torch.uint8).view(len(t.saves), self.shard_bytes)

    def _shards(self, t: KVTransfer) -> torch.Tensor:
        """This worker's shard of every slot: a uint8 view [num_slots, shard_bytes]."""
        if t.shard_bytes != self.shard_bytes:
            raise ValueError(f"the host tier's shards are {t.shard_bytes} bytes, this "
                             f"worker's KV blocks {self.shard_bytes}")
        if (t.arena, t.generation) not in self._arenas:
            self.attach(t.arena, t.arena_bytes, t.generation)
        arena = self._arenas[(t.arena, t.generation)]
        num_slots = t.arena_bytes // t.slot_bytes
        offset = self.tp_rank * t.shard_bytes
        slots = arena[:num_slots * t.slot_bytes].view(num_slots, t.slot_bytes)
        return slots[:, offset:offset + t.shard_bytes]

    def _attach_arena(self, name: str, size: int) -> torch.Tensor:
        if self._attach is not None:
            return self._attach(name, size)
        from dpserve.kv_tier.arena import attach_arena

        return attach_arena(name, size)
