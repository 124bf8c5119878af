"""One engine step's boundary types: what the scheduler hands the model runner,
and what comes back.

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler

They sit below both (ARCHITECTURE.md, "Layers"): the model runner reads a plain
record of each scheduled request, never the engine's live `Request`.
(`EngineCoreOutput`, what a step sends to the front-end, crosses process
boundaries, so it lives in dpserve.protocol.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the launcher imports the engine's modules without torch
    import numpy as np
    import torch


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step, as the model runner and the sampler read it.

    The step computes the tokens at positions `start .. start + num_new_tokens - 1`
    (`tokens(start, start + num_new_tokens)`). On the engine's own runner
    `token_ids` is the request's own list (prompt, then outputs), not a copy: the
    runner reads it during the step, and the scheduler appends the sampled token
    only after the step. A tensor-parallel peer gets a trimmed copy instead
    (`dpserve.engine.executor`): only the step's window of tokens, `token_ids[0]`
    being the token at position `token_offset`; the output properties below need
    the whole list (worker 0, which samples, has it).
    """

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (the request's list, read-only here)
    num_prompt_tokens: int
    start: int  # tokens already in the KV cache before this step
    num_new_tokens: int  # tokens computed this step (> 0)
    block_ids: list[int]  # the request's whole block table after allocation
    sample: bool  # True when this step reaches the end of the known tokens
    sampling_params: SamplingParams
    eos_token_id: int | None
    grammar: Any = None  # structured.manager.RequestGrammar of a constrained output
    needs_prompt_logprobs: bool = False  # every prompt position computed gets logprobs
    token_offset: int = 0  # the position of token_ids[0] (> 0 only in a trimmed copy)
    lora_id: int = 0  # the engine's id of the request's LoRA adapter (0: none)
    lora_slot: int = -1  # the device slot holding that adapter this step (-1: none)
    # A pooling request ("last" | "mean", protocol.PoolingParams.pooling_type): its rows
    # are pooled (model.pooler), never sampled (`sample` is False). None: generation.
    pooling: str | None = None
    # Speculative decoding (engine.spec_decode): draft tokens the step computes after the
    # known ones, at positions num_tokens .. num_tokens + len - 1 (included in
    # num_new_tokens); the step samples at each of their positions and at the last
    # known token's (model.spec_verify). Empty: no speculation.
    spec_token_ids: list[int] = field(default_factory=list)

    def tokens(self, first: int, end: int) -> list[int]:
        """The tokens at positions first .. end - 1 (those known, then the drafts)."""
        known = self.token_ids[first - self.token_offset:end - self.token_offset]
        over = end - self.num_tokens
        if over > 0 and self.spec_token_ids:
            return known + self.spec_token_ids[:over]
        return known

    @property
    def num_tokens(self) -> int:
        return self.token_offset + len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the outputs so far (penalties read them)."""
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class LoRAPlan:
    """What every worker does to its LoRA state before a step runs (engine.lora_manager)."""

    loads: list[tuple[int, int, str]] = field(default_factory=list)  # (slot, lora id, path)
    host_drops: list[int] = field(default_factory=list)  # lora ids whose host copy goes


@dataclass
class KVTransfer:
    """A step's copies between the KV cache and the host tier's shared arena
    (`dpserve.kv_tier`), done by every worker on its own shard.

    A slot holds one KV block over all layers and all TP shards: worker t's shard
    is the `shard_bytes` at offset `t * shard_bytes`, laid out layer-major, K then
    V, each `[block_size, kv_heads_here, head_dim]` of the runner's cache.
    """

    arena: str  # the shared-memory segment's name (workers attach by name)
    arena_bytes: int  # its size
    generation: int  # the store's incarnation: a new one means a new segment
    slot_bytes: int  # bytes of one slot (= num_shards * shard_bytes)
    shard_bytes: int  # one worker's share of a slot
    loads: list[tuple[int, int]] = field(default_factory=list)  # (slot, block_id): before
    saves: list[tuple[int, int]] = field(default_factory=list)  # (block_id, slot): after


@dataclass
class SchedulerOutput:
    """What one step runs. Decode-shaped entries come first: one token, or one and
    its draft tokens (`spec_token_ids`, speculative decoding)."""

    scheduled: list[ScheduledRequest]
    num_decodes: int  # the first `num_decodes` entries are decode-shaped
    total_num_tokens: int  # sum of num_new_tokens
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # freed since the last step
    lora: LoRAPlan | None = None  # adapters to put into slots first (None: nothing to do)
    kv_transfer: KVTransfer | None = None  # host-tier loads / saves (None: nothing to copy)
    has_pooling: bool = False  # the engine holds pooling requests: the runner pools rows

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class Logprobs:
    """Logprobs of the sampled token and of the top-N, for sampled rows.

    Column 0 is the sampled token; columns 1..N are the top-N tokens.
    """

    token_ids: torch.Tensor  # [num_sampled, N + 1] int64
    logprobs: torch.Tensor  # [num_sampled, N + 1] float32
    sampled_ranks: torch.Tensor  # [num_sampled] int64, 1 = most likely


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step, one row per ScheduledRequest with sample=True
    (rows without drafts first, in their order, then the speculative ones: logprobs
    rows are the first rows' only)."""

    req_ids: list[str]  # [num_sampled]
    sampled_token_ids: list[int]  # [num_sampled]
    logprobs: Logprobs | None = None  # rows for every sampled request (None if none asked)
    # req_id -> (first prompt position, its TokenLogprobs in position order), for
    # requests asking for prompt logprobs whose step computed prompt positions.
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    # req_id -> (first position of the step's chunk, [hidden] float32) for pooling
    # requests: "mean": the sum of the chunk's final hidden states; "last": the last
    # prompt token's, only from the chunk that reaches it (model.pooler).
    pooled: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    # req_id -> every token a speculative row produced (its accepted drafts, then the
    # token sampled after them); `sampled_token_ids` holds the first of them.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
