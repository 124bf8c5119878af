"""`TierLayout`: what one slot of the KV host tier holds, and how its shards lie.

Scope: a slot is one KV block of the model: every layer, K and V, every TP
shard. The store's first client fixes the layout; a client whose `key` differs
(another model, dtype, block size, layer count, KV heads, head dim or TP size)
is refused, so a slot always means the same bytes to every rank.

Within a slot, TP worker `r`'s shard starts at `r * shard_bytes`; inside a shard
the layout is layer-major, K then V, each `[block_size, kv_heads_per_worker,
head_dim]` (the engine's copy code owns that order: `dpserve.model.runner`).

Not here: the arena that holds the slots (`dpserve.kv_tier.arena`).
"""

from __future__ import annotations

import msgspec


class TierLayout(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: str  # model, dtype, block size, layers, KV heads, head dim, TP size (one string)
    shard_bytes: int  # one TP worker's part of a slot
    num_shards: int  # TP workers per rank

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: every shard of one KV block."""
        return self.shard_bytes * self.num_shards

    @classmethod
    def for_model(cls, *, model: str, dtype: str, element_bytes: int, block_size: int,
                  num_layers: int, kv_heads_per_worker: int, head_dim: int,
                  tp_size: int) -> TierLayout:
        """The layout of a model's KV block: each shard holds K and V of every layer,
        `[block_size, kv_heads_per_worker, head_dim]` elements of `element_bytes`."""
        shard = 2 * num_layers * block_size * kv_heads_per_worker * head_dim * element_bytes
        key = (f"model={model} dtype={dtype} block_size={block_size} layers={num_layers} "
               f"kv_heads_per_worker={kv_heads_per_worker} head_dim={head_dim} tp={tp_size}")
        return cls(key=key, shard_bytes=shard, num_shards=tp_size)

    def check(self) -> None:
        """ValueError unless the sizes are positive."""
        if self.shard_bytes <= 0 or self.num_shards <= 0:
            raise ValueError(f"a tier layout needs positive sizes, got {self}")
