"""Paged KV-cache bookkeeping: which blocks each request holds, and the prefix cache.

Scope: block ids, reference counts, the free list and the hash -> block map of
cached prefixes. No tensors: the model runner owns the cache tensors and
indexes them by the block ids handed out here. Not thread-safe; the scheduler
is the only caller.

Not here: the block hash rule itself (`dpserve.block_hash`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dpserve.block_hash import BlockHash, hash_block, root_hash
from dpserve.engine.request import Request


class KVCacheBlock:
    """One block of `block_size` token slots in the model runner's cache tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # requests holding this block
        # Set while the block is in the prefix cache (held or free); None otherwise.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks: O(1) popleft, append, appendleft, remove.

    The head is taken first. Blocks carry their own links, so removing a free
    block that gets a prefix hit needs no search.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1


class BlockPool:
    """All blocks, the free queue (LRU) and the map of cached blocks.

    Free blocks are kept in LRU order: a freed cached block goes to the tail,
    new allocations take from the head. A cached block keeps its hash while it
    is free (a later request may still hit it) and is evicted (its hash
    dropped from the map) only when it is taken for reuse. A freed block with
    no hash holds nothing worth keeping, so it goes to the head instead.

    Invariant: `block.block_hash is not None` iff `cached[block.block_hash] is block`.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1, "the KV cache needs at least one block"
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}  # block_hash -> block

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / len(self.blocks)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, evicting their hashes."""
        assert num_blocks <= len(self.free_queue), "caller must check num_free_blocks"
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: one more holder for each block (taken off the free queue at 0)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One holder fewer for each block, in eviction order (first freed, first evicted)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash]) -> None:
        """Register full blocks under their hashes. A hash already cached (the same
        prefix computed twice at once) keeps its first block; the copy stays unhashed."""
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                assert block.block_hash == block_hash
            elif block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()


class _BlockTable:
    """The blocks one request holds, in sequence order."""

    __slots__ = ("blocks", "block_ids", "num_cached")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.block_ids: list[int] = []  # kept alongside: the hot path returns it every step
        self.num_cached = 0  # leading blocks already registered in the prefix cache

    def add(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.blocks.append(block)
            self.block_ids.append(block.block_id)


class KVCacheManager:
    """Hands out KV blocks to requests and finds cached prefixes.

    Contract (the scheduler never touches the pool directly):

    * `get_computed_blocks(request)` -> `(blocks, num_tokens)`: the longest
      cached prefix of the request's full blocks. At least the request's last
      token is always left to compute (its logits are needed), so a fully
      cached prompt loses its last block. `([], 0)` when caching is off. The
      blocks are not yet held: pass them straight to `allocate_slots`.
    * `allocate_slots(request, num_new_tokens, new_computed_blocks)` -> the
      request's whole block-id table, sized for `request.num_computed_tokens
      + len(new_computed_blocks) * block_size + num_new_tokens` tokens; or
      `None` when the free blocks do not suffice, and then nothing changed.
      Prefix-hit blocks may only be passed while the request holds no blocks.
      `num_lookahead_tokens` more slots hold a step's draft tokens (speculative
      decoding): their blocks are never registered, and a request whose drafts
      were rejected keeps them (their slots are written again later).
    * `free(request)`: the request gives back every block it holds (tail
      blocks become evictable first). Freeing a request with no blocks is a
      no-op.

    Blocks that become full with the tokens being allocated for are
    registered in the prefix cache at allocation time, before the step that
    computes them runs. A request admitted later in the same step may hit
    them, so the model runner must write a layer's KV for all scheduled
    tokens before any attention of that layer reads the cache.

    With `new_full_blocks` a list (a KV connector is on), each such block is
    also appended there as `(hash, block_id)`, for `take_new_full_blocks`.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        assert block_size >= 1
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, _BlockTable] = {}  # request_id -> its blocks
        self.prefix_cache_queries = 0  # tokens looked up (one count per lookup)
        self.prefix_cache_hits = 0  # tokens found
        # (hash, block_id) of blocks registered since the last take; None: not kept
        self.new_full_blocks: list[tuple[BlockHash, int]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to every full block of its known tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = (hashes[-1] if hashes
                      else root_hash(request.cache_salt, request.lora_cache_key))
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached block-aligned prefix of `request`, and its token count."""
        if not self.enable_prefix_caching or request.needs_every_position:
            return [], 0  # prompt logprobs (mean pooling) need every prompt position
        self.update_block_hashes(request)
        # Invariant: the last token is always recomputed, so at most
        # (num_tokens - 1) // block_size blocks can come from the cache.
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_tokens
        return blocks, num_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Grow the request's block table; None (and no change) if it cannot fit.
        `num_lookahead_tokens`: slots for draft tokens past the known ones (speculative
        decoding); the blocks they reach are never registered as full here."""
        table = self._tables.get(request.request_id)
        num_held = len(table.blocks) if table else 0
        assert not (num_held and new_computed_blocks), "prefix hits only as the first blocks"
        num_tokens = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                      + num_new_tokens)
        assert num_tokens <= request.num_tokens, "cannot compute tokens that are not known yet"
        num_needed = (-(-(num_tokens + num_lookahead_tokens) // self.block_size) - num_held
                      - len(new_computed_blocks))
        # Hit blocks that are free now stop being free once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None

        if table is None:
            table = self._tables[request.request_id] = _BlockTable()
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            table.add(new_computed_blocks)
            table.num_cached = len(new_computed_blocks)  # already in the cache
        if num_needed > 0:
            table.add(self.pool.get_new_blocks(num_needed))
        if self.enable_prefix_caching and num_tokens // self.block_size > table.num_cached:
            self._cache_new_full_blocks(request, table, num_tokens // self.block_size)
        return table.block_ids.copy()

    def _cache_new_full_blocks(self, request: Request, table: _BlockTable,
                               num_full: int) -> None:
        self.update_block_hashes(request)
        self.pool.cache_full_blocks(table.blocks[table.num_cached:num_full],
                                    request.block_hashes[table.num_cached:num_full])
        if self.new_full_blocks is not None:
            self.new_full_blocks.extend(zip(request.block_hashes[table.num_cached:num_full],
                                            table.block_ids[table.num_cached:num_full]))
        table.num_cached = num_full

    def take_new_full_blocks(self) -> list[tuple[BlockHash, int]]:
        """`(hash, block_id)` of the blocks that became full since the last call."""
        if self.new_full_blocks is None:
            return []
        taken, self.new_full_blocks = self.new_full_blocks, []
        return taken

    def free(self, request: Request) -> None:
        """Return all of the request's blocks; the tail of its sequence is evicted first."""
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            self.pool.free_blocks(reversed(table.blocks))

    def state_sizes(self) -> dict[str, int]:
        """Per-request state and block accounting, for leak checks: `tables` is 0 and
        `held` is 0 once every request has ended (each block free or cached-free)."""
        pool = self.pool
        return {"kv_tables": len(self._tables), "kv_blocks": pool.num_blocks,
                "kv_free": pool.num_free_blocks,
                "kv_held": sum(1 for b in pool.blocks if b.ref_cnt > 0),
                "kv_cached": len(pool.cached)}

    def get_block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return table.block_ids.copy() if table else []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights). Refused (False,
        nothing done) while any request holds blocks, whose KV stays in use."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True
