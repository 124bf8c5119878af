"""The prefix cache's block hash: `hash_block`, `root_hash`, `BlockHash`.

A block's hash is the sha256 digest (32 bytes) of its parent's digest followed by
its token ids as little-endian int64; a request's first block has the root of its
salt and LoRA adapter as parent (`root_hash`). The engine's KV cache names cached
blocks by these hashes, and the front-end's router computes the same ones to know
which rank holds a prompt's prefix: both import this one rule.

Invariants: a block's hash covers its parent's, so equal hashes mean equal token
prefixes from the start of the request; the digest is the same in every process
(no PYTHONHASHSEED), which equal hashes across engines and API servers rely on.
Not builtin hash(): that one is easy to invert, so a crafted prompt could forge
another tenant's prefix hash and read its cached KV (cf. vLLM GHSA-rm76-4mrf-v9r8).

Not here: which blocks are cached (`dpserve.engine.kv_cache`), where a prefix was
sent (`dpserve.frontend.prefix_record`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes  # a sha256 digest (32 bytes)

# Parent digest of an unsalted request's first block.
_ROOT_HASH: BlockHash = hashlib.sha256(b"dpserve prefix cache root").digest()
_BIG_ENDIAN = sys.byteorder == "big"


def root_hash(cache_salt: str | None, lora_key: str | None = None) -> BlockHash:
    """The parent digest of a request's first block: the unsalted root, or one derived
    from its salt (vLLM's cache_salt) and its LoRA adapter's key (the adapter's name
    and weights digest, `engine.lora_manager.adapter_cache_key`). Every later block covers
    its parent, so two requests share cached blocks only when their salts and
    adapters are equal; a salted or adapted root is the sha256 of a different prefix
    than the plain one's, so neither can equal the other."""
    if lora_key is not None:
        salt = b"\1" + cache_salt.encode() if cache_salt is not None else b"\0"
        return hashlib.sha256(b"dpserve prefix cache lora\0" + lora_key.encode() + b"\0"
                              + salt).digest()
    if cache_salt is None:
        return _ROOT_HASH
    return hashlib.sha256(b"dpserve prefix cache salt\0" + cache_salt.encode()).digest()


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: sha256(parent digest + token ids as int64 LE).

    Invariant: a block's hash covers its parent's hash, so equal hashes mean
    equal token prefixes (from the start of the request), not just equal blocks.
    The parent digest has a fixed length (32 bytes), so the split between parent
    and tokens is unambiguous.
    """
    tokens = array("q", token_ids)
    if _BIG_ENDIAN:
        tokens.byteswap()
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    h.update(tokens)
    return h.digest()
