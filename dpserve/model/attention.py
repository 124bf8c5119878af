"""Paged attention in plain torch, and the per-step metadata it runs on.

KV-cache layout (one tensor per layer):

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
              index 0 = keys, 1 = values

The token at position `p` of a request lives in block `block_ids[p // block_size]`
at offset `p % block_size`, i.e. at flat slot `block_id * block_size + offset`
of `kv_cache[i].view(num_blocks * block_size, num_kv_heads * head_dim)`.
Caches are zero-initialised: padded (masked) gathers must read finite values,
since 0 * nan would poison a softmax-weighted sum.

A step's tokens are flattened, decodes first (one token each), then prefills
(several tokens each, possibly after cached context from the prefix cache or
earlier chunks). `AttentionMetadata` is built once per step (all index and
mask tensors); each layer then writes its new K/V and attends:

* decodes: rows are processed in chunks. On CPU, where dpserve's kernels are
  built (`cpu_kernels.decode_attention`), each chunk attends straight from the
  cache through its block table. Elsewhere, per chunk one `index_select` gathers
  the rows' blocks, and one SDPA call with GQA folded into the query length
  (`[rows, kv_heads, group, head_dim]`) and a padding mask does the rest.
* prefills: one padded-batch SDPA call per group of rows (groups bound the
  padding). Without cached context the fresh K/V are used directly (and
  equal-length rows need no padding at all); with context, K/V are gathered
  from the cache after this step's write.

What it does not do: sliding windows, ALiBi, cross-attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dpserve.model import cpu_kernels

# Decode rows attended per SDPA call on CPU: small enough that a chunk's
# gathered K/V stay in cache between the gather and the attention.
CPU_DECODE_ROWS = 16
# Bounds on what one SDPA call may pad/gather: gathered K elements of a
# decode chunk, and query x key elements of a prefill group's mask.
MAX_GATHER_ELEMS = 1 << 27
MAX_MASK_ELEMS = 1 << 24


@dataclass
class DecodeChunk:
    """Decode rows (tokens) [start, end) of the step, attended by one SDPA call or
    the CPU kernel."""

    start: int
    end: int
    block_index: torch.Tensor  # [(end - start) * num_blocks] int64 block ids, row-major
    seq_lens: torch.Tensor  # [end - start] int64 tokens each row attends to
    # [end - start, 1, 1, num_blocks * block_size] additive (0 / -inf); None when the
    # CPU kernel is meant to run (it reads seq_lens; SDPA then builds the mask itself)
    mask: torch.Tensor | None


@dataclass
class PrefillGroup:
    """Consecutive prefill rows attended as one padded batch by one SDPA call.

    The group's tokens are the step's tokens [token_start, token_end); row p
    owns query_lens[p] of them, at positions context_lens[p] + i.
    """

    token_start: int
    token_end: int
    num_seqs: int  # P
    max_query_len: int  # Q
    # True: every row has Q tokens and no context -> plain causal SDPA, no padding.
    uniform: bool
    query_index: torch.Tensor | None  # [P * Q] int64 group-token index per padded slot
    output_index: torch.Tensor | None  # [token_end - token_start] int64 padded slot per token
    # [P * num_kv_blocks] int64 block ids to gather K/V from; None: no row has
    # context, attend over the fresh K/V (key length Q).
    kv_block_index: torch.Tensor | None
    mask: torch.Tensor | None  # [P, 1, Q, key_len] additive (0 / -inf); None when uniform


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64 flat cache slot of each new token
    # D: the first D tokens attend as decodes (one row each: one-token requests, and
    # every token of a speculative request's verified run)
    num_decode_tokens: int
    decode_chunks: list[DecodeChunk]
    # decodes run cpu_kernels.decode_attention (CPU, float32/bfloat16, kernels built)
    decode_kernel: bool
    prefill_groups: list[PrefillGroup]
    # the step may run dpserve's fused CPU ops (add + RMSNorm, RoPE + cache write)
    fused_ops: bool = False


def build_attention_metadata(query_lens: np.ndarray, context_lens: np.ndarray,
                             block_table: np.ndarray, num_decodes: int, block_size: int,
                             dtype: torch.dtype, device: torch.device,
                             kv_elems_per_token: int = 1) -> AttentionMetadata:
    """Build a step's metadata from per-request numbers (numpy, on the host).

    query_lens: [R] new tokens per request; the first `num_decodes` requests are
    decode-shaped: one token, or one and its draft tokens (speculative decoding),
    attended token by token as decodes (token i of such a request sees the first
    context + i + 1 keys, its own drafts' KV written to the cache before attention);
    the rest are prefill rows. context_lens: [R] tokens already in the cache;
    block_table: [R, max_blocks] int64 block ids, padded with any valid id (padding
    is always masked); kv_elems_per_token: kv_heads * head_dim, to bound what one
    chunk gathers.
    """
    slot_mapping = _slot_mapping(query_lens, context_lens, block_table, block_size)
    fused_ops = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
        and cpu_kernels.available()
    decode_kernel = bool(num_decodes) and fused_ops
    decode_q = query_lens[:num_decodes]
    num_decode_tokens = int(decode_q.sum())
    # One decode row per token: its key count and its request's block table row.
    token_lens = token_positions(decode_q, context_lens[:num_decodes]) + 1  # [D]
    token_table = (block_table[:num_decodes] if num_decode_tokens == num_decodes
                   else block_table[np.repeat(np.arange(num_decodes), decode_q)])
    decode_chunks = []
    if num_decodes:
        max_rows = CPU_DECODE_ROWS if device.type == "cpu" else 1 << 30
        widest = int(token_lens.max()) * kv_elems_per_token
        rows = max(1, min(max_rows, MAX_GATHER_ELEMS // widest))
        decode_chunks = [_decode_chunk(s, min(s + rows, num_decode_tokens), token_lens,
                                       token_table, block_size, dtype, device,
                                       with_mask=not decode_kernel)
                         for s in range(0, num_decode_tokens, rows)]
    groups = [_prefill_group(rows, query_lens, context_lens, block_table, block_size, dtype,
                             device)
              for rows in _prefill_row_groups(query_lens, context_lens, num_decodes)]
    return AttentionMetadata(slot_mapping=_to(slot_mapping, device),
                             num_decode_tokens=num_decode_tokens, decode_chunks=decode_chunks,
                             decode_kernel=decode_kernel, prefill_groups=groups,
                             fused_ops=fused_ops)


def _prefill_row_groups(query_lens: np.ndarray, context_lens: np.ndarray,
                        num_decodes: int) -> list[range]:
    """Split prefill rows into consecutive groups whose padded mask stays small."""
    groups: list[range] = []
    first, max_q, max_k = num_decodes, 0, 0
    for row in range(num_decodes, len(query_lens)):
        q, k = int(query_lens[row]), int(query_lens[row] + context_lens[row])
        new_q, new_k = max(max_q, q), max(max_k, k)
        if row > first and (row + 1 - first) * new_q * new_k > MAX_MASK_ELEMS:
            groups.append(range(first, row))
            first, new_q, new_k = row, q, k
        max_q, max_k = new_q, new_k
    if first < len(query_lens):
        groups.append(range(first, len(query_lens)))
    return groups


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def _additive(allowed: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed), float("-inf"))
    return mask.to(device)


def token_positions(query_lens: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    """[T] absolute position of every new token of the step (vectorised)."""
    starts = np.cumsum(query_lens) - query_lens  # [R] first token index of each request
    offsets = np.arange(int(query_lens.sum())) - np.repeat(starts, query_lens)
    return np.repeat(context_lens, query_lens) + offsets


def _slot_mapping(query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray,
                  block_size: int) -> np.ndarray:
    positions = token_positions(query_lens, context_lens)  # [T]
    rows = np.repeat(np.arange(len(query_lens)), query_lens)  # [T] request of each token
    return block_table[rows, positions // block_size] * block_size + positions % block_size


def _decode_chunk(start: int, end: int, seq_lens: np.ndarray, block_table: np.ndarray,
                  block_size: int, dtype: torch.dtype, device: torch.device,
                  with_mask: bool = True) -> DecodeChunk:
    lens = seq_lens[start:end]  # [c]
    num_blocks = -(-int(lens.max()) // block_size)
    mask = None
    if with_mask:
        allowed = np.arange(num_blocks * block_size)[None, :] < lens[:, None]  # [c, L]
        mask = _additive(allowed[:, None, None, :], dtype, device)
    return DecodeChunk(start=start, end=end,
                       block_index=_to(block_table[start:end, :num_blocks].reshape(-1), device),
                       seq_lens=_to(lens, device), mask=mask)


def _prefill_group(rows: range, query_lens: np.ndarray, context_lens: np.ndarray,
                   block_table: np.ndarray, block_size: int, dtype: torch.dtype,
                   device: torch.device) -> PrefillGroup:
    q_lens, ctx = query_lens[rows.start:rows.stop], context_lens[rows.start:rows.stop]
    token_start = int(query_lens[:rows.start].sum())
    token_end = token_start + int(q_lens.sum())
    num_seqs, max_q = len(q_lens), int(q_lens.max())
    has_context = bool(ctx.any())
    if not has_context and bool((q_lens == max_q).all()):
        return PrefillGroup(token_start=token_start, token_end=token_end, num_seqs=num_seqs,
                            max_query_len=max_q, uniform=True, query_index=None,
                            output_index=None, kv_block_index=None, mask=None)
    # Padded slot (p, i) <-> group token starts[p] + i, for i < q_lens[p].
    starts = np.cumsum(q_lens) - q_lens
    i = np.arange(max_q)[None, :]  # [1, Q]
    real = i < q_lens[:, None]  # [P, Q]
    query_index = np.where(real, starts[:, None] + i, 0)  # [P, Q]
    output_index = (np.arange(num_seqs)[:, None] * max_q + i)[real]  # [group tokens]
    kv_block_index = None
    if has_context:
        num_blocks = -(-int((ctx + q_lens).max()) // block_size)
        kv_block_index = _to(block_table[rows.start:rows.stop, :num_blocks].reshape(-1),
                             device)
        key_len = num_blocks * block_size
    else:
        key_len = max_q
    # Query i of row p sits at position ctx + i and sees keys 0..ctx + i.
    # Padded queries see a non-empty (finite) set too, so no row is all -inf.
    j = np.arange(key_len)[None, None, :]
    allowed = j <= (ctx[:, None] + i)[:, :, None]  # [P, Q, K]
    return PrefillGroup(token_start=token_start, token_end=token_end, num_seqs=num_seqs,
                        max_query_len=max_q, uniform=False,
                        query_index=_to(query_index.reshape(-1), device),
                        output_index=_to(output_index, device), kv_block_index=kv_block_index,
                        mask=_additive(allowed[:, None], dtype, device))


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values k, v [T, kv_heads, head_dim] at their slots [T]."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads * head_dim)
    flat[0].index_copy_(0, slot_mapping, k.reshape(-1, kv_heads * head_dim))
    flat[1].index_copy_(0, slot_mapping, v.reshape(-1, kv_heads * head_dim))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, kv_written: bool = False) -> torch.Tensor:
    """One layer's attention over the step's tokens.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (this step's, after RoPE);
    kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]. Returns [T, heads * head_dim].
    `kv_written`: k and v are in the cache already (`cpu_kernels.rotary_kv`).
    """
    if not kv_written:
        write_kv(kv_cache, k, v, meta.slot_mapping)
    num_tokens, heads, head_dim = q.shape
    out = torch.empty(num_tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    kernel = meta.decode_kernel and cpu_kernels.supports_attention(heads, kv_cache.shape[3],
                                                                   head_dim)
    for chunk in meta.decode_chunks:
        rows = q[chunk.start:chunk.end]
        if kernel:
            if rows.stride(2) != 1 or rows.stride(1) != head_dim:  # heads must be packed
                rows = rows.contiguous()
            cpu_kernels.decode_attention(rows, kv_cache, chunk.block_index.view(len(rows), -1),
                                         chunk.seq_lens, out[chunk.start:chunk.end])
        else:
            out[chunk.start:chunk.end] = _decode_attention(rows, kv_cache, chunk)
    for g in meta.prefill_groups:
        s, e = g.token_start, g.token_end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], kv_cache, g)
    return out


def _gather_blocks(cache: torch.Tensor, block_index: torch.Tensor,
                   rows: int) -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, head_dim] -> [rows, kv_heads, L, head_dim] view."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    gathered = cache.view(num_blocks, -1).index_select(0, block_index)
    return gathered.view(rows, -1, kv_heads, head_dim).transpose(1, 2)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                      chunk: DecodeChunk) -> torch.Tensor:
    """q [c, heads, head_dim] -> [c, heads * head_dim]."""
    rows, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    k = _gather_blocks(kv_cache[0], chunk.block_index, rows)  # [c, kv_heads, L, d]
    v = _gather_blocks(kv_cache[1], chunk.block_index, rows)
    # Fold the query heads sharing a KV head into the query length: [c, kv_heads, group, d].
    qg = q.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    mask = chunk.mask
    if mask is None:  # metadata built for the CPU kernel, but this shape is past its limits
        keys = torch.arange(k.shape[2], device=q.device)
        mask = torch.zeros(rows, 1, 1, k.shape[2], dtype=q.dtype, device=q.device)
        mask.masked_fill_((keys[None, :] >= chunk.seq_lens[:, None])[:, None, None, :],
                          float("-inf"))
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(rows, heads * head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, p: PrefillGroup) -> torch.Tensor:
    """q [Tp, heads, d], k/v [Tp, kv_heads, d] (fresh) -> [Tp, heads * d]."""
    num_tokens, heads, head_dim = q.shape
    rows, max_q = p.num_seqs, p.max_query_len
    if p.uniform:
        qb = q.view(rows, max_q, heads, head_dim).transpose(1, 2)
        kb = k.view(rows, max_q, -1, head_dim).transpose(1, 2)
        vb = v.view(rows, max_q, -1, head_dim).transpose(1, 2)
        out = _sdpa_gqa(qb, kb, vb, mask=None)  # [P, heads, Q, d]
        return out.transpose(1, 2).reshape(num_tokens, heads * head_dim)
    assert p.query_index is not None and p.output_index is not None
    qb = q.index_select(0, p.query_index).view(rows, max_q, heads, head_dim).transpose(1, 2)
    if p.kv_block_index is None:
        kb = k.index_select(0, p.query_index).view(rows, max_q, -1, head_dim).transpose(1, 2)
        vb = v.index_select(0, p.query_index).view(rows, max_q, -1, head_dim).transpose(1, 2)
    else:
        kb = _gather_blocks(kv_cache[0], p.kv_block_index, rows)
        vb = _gather_blocks(kv_cache[1], p.kv_block_index, rows)
    out = _sdpa_gqa(qb, kb, vb, mask=p.mask)  # [P, heads, Q, d]
    out = out.transpose(1, 2).reshape(rows * max_q, heads * head_dim)
    return out.index_select(0, p.output_index)


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with k/v heads shared by groups of query heads.

    q [B, heads, Q, d]; k, v [B, kv_heads, K, d]; mask [B, 1, Q, K] or None (causal).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])
