"""ModelRunner: turns a SchedulerOutput into one forward pass plus sampling.

It owns the model, the paged KV cache (`KVCacheMemory` in `kv_memory.py`: one
tensor per layer, plus one scratch block for dummy runs), the sampler, the
worker's LoRA adapters (`WorkerLoRA` in `lora.py`) and the per-request
generators of seeded requests (created on first sight, dropped when the
scheduler reports the request finished).

One step:
1. build inputs on the host with numpy (token ids, positions, slot mapping,
   block tables) and the AttentionMetadata, once for all layers;
2. forward over the flattened tokens of every scheduled request;
3. LM head only on the last token of requests that sample this step (a pooling
   request's rows are pooled instead: `model/pooler.py`), and on every position of
   a speculative request's drafts and the token before them;
4. sample (drafts: verified, `model/spec_verify.py`) and return Python lists.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpserve.checkpoint.registry import get_model_class
from dpserve.cpu_features import auto_cpu_dtype
from dpserve.engine_config import EngineConfig, SchedulerConfig
from dpserve.model import cpu_kernels
from dpserve.model.attention import AttentionMetadata, build_attention_metadata, token_positions
from dpserve.model.expert_parallel import ExpertParallel
from dpserve.model.kv_copy import KVTierCopier
from dpserve.model.kv_memory import KVCacheMemory
from dpserve.model.lora import WorkerLoRA
from dpserve.model.pooler import pool_step
from dpserve.model.prompt_logprobs import compute_prompt_logprobs
from dpserve.model.sampler import Sampler, SamplingMetadata, make_generator
from dpserve.model.spec_verify import split_rows, verify
from dpserve.model.tensor_parallel import TensorParallel
from dpserve.profiling import Profiler
from dpserve.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Device tensors of one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_meta: AttentionMetadata
    # [N] int64 token index of each logits row: one per `sampled` request, then
    # k + 1 per `spec` request (model.spec_verify.split_rows)
    logits_index: torch.Tensor
    sampled: list[ScheduledRequest]  # [S] the requests that sample one row, in output order
    spec: list[ScheduledRequest] = dataclasses.field(default_factory=list)  # with drafts


class ModelRunner:
    """Executes scheduled steps on one device; see the module docstring.

    `tp`: this worker's place in its rank's tensor-parallel group (None: the whole
    model here). Every worker of a rank runs every step; only worker 0 samples
    (`execute` returns the others an empty output).
    """

    def __init__(self, config: EngineConfig, dp_rank: int = 0,
                 tp: TensorParallel | None = None) -> None:
        if config.parallel.threads_per_engine:
            torch.set_num_threads(config.parallel.threads_per_engine)
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.model.dtype)
        self.block_size = config.cache.block_size
        self.tp = tp if tp is not None else TensorParallel(0, 1)
        # Expert parallel: this worker holds its share of the experts (EP index
        # dp_rank * tp + tp_rank of dp_size * tp); the engine process hands worker
        # 0 the lockstep DP group (`ExpertParallel.group_source`), its TP peers none.
        size = config.parallel.data_parallel_size * self.tp.size
        elastic = config.parallel.elastic  # the size may change later
        self.expert_parallel = (ExpertParallel(dp_rank * self.tp.size + self.tp.rank, size,
                                               self.tp)
                                if config.parallel.enable_expert_parallel
                                and (size > 1 or elastic) else None)
        # LoRA (--enable-lora): adapters on the host (lora id -> this worker's shard),
        # and the device slots the step's adapters run from (model.lora).
        lora = config.lora
        self.lora = (WorkerLoRA(lora.max_loras, lora.max_lora_rank, self.dtype, self.device)
                     if lora is not None else None)
        self.model = self._load_model()
        self.sleep_level = 0  # 1: KV cache freed; 2: weights too (see set_sleep_level)
        self.vocab_size = self.model.dims.vocab
        self.kv_heads = self.model.kv_heads_here  # this worker's share of the KV heads
        self.kv_elems_per_token = self.kv_heads * self.model.dims.head_dim
        self.sampler = Sampler(config.model.seed, self.device)
        self.generators: dict[str, torch.Generator] = {}  # request id -> its seeded generator
        dims = self.model.dims
        self.kv = KVCacheMemory(config.cache, config.scheduler, dims.layers, self.kv_heads,
                                dims.head_dim, self.dtype, self.device)
        # The host tier's loads and saves of this worker's shard (a step's kv_transfer).
        self.kv_copier = KVTierCopier(
            self.tp.rank, (self.model.dims.layers, 2, self.block_size, self.kv_heads,
                           self.model.dims.head_dim), self.dtype, self.device)
        # Torch profiler sessions on an operator's call (--profile-dir, /start_profile).
        self.profiler = Profiler(config.profile_dir, dp_rank, self.tp.rank, self.device)

    def _read_model(self, device: torch.device) -> Any:
        """The model on `device` with this worker's weights, as the checkpoint has them:
        from the HF files (sliced for this worker), or its own sharded-state files."""
        from dpserve.checkpoint.loader import iter_weights
        from dpserve.checkpoint.sharded_state import load_shard

        extra: dict[str, Any] = ({"ep": self.expert_parallel}
                                 if self.expert_parallel is not None else {})
        if self.tp.size > 1:
            extra["tp"] = self.tp
        model = get_model_class(self.config.model.architecture)(
            self.config.model.hf_config, self.dtype, device, **extra)
        if self.config.model.load_format == "sharded_state":
            load_shard(model, Path(self.config.model.path), self.tp.rank)
        else:
            model.load_weights(iter_weights(Path(self.config.model.path)))
        return model

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> list[str]:
        """Write this worker's weights, as loaded (before quantising or packing: read
        again, on the host), to `path` (`dpserve.checkpoint.sharded_state`); the files."""
        from dpserve.checkpoint.sharded_state import save_shard

        if self.expert_parallel is not None:
            raise ValueError("save_sharded_state does not cover expert parallelism (a "
                             "worker's experts depend on the DP size)")
        model = self._read_model(torch.device("cpu"))
        return save_shard(model, Path(path), self.tp.rank, pattern, max_size)

    def _load_model(self) -> Any:
        """Build the model and read its weights from the checkpoint."""
        model = self._read_model(self.device)
        if self.lora is not None:  # empty slots, their hooks on the layers' linears
            self.lora.attach(model)
        # This worker's share of the checkpoint, as loaded (before any packing).
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("model %s loaded: %s on %s%s", self.config.model.architecture,
                    str(self.dtype).removeprefix("torch."), self.device,
                    f", tensor-parallel worker {self.tp.rank} of {self.tp.size}"
                    if self.tp.size > 1 else "")
        if self.config.model.quantization == "int8":
            # The LM head runs in bfloat16 where the CPU has it natively, as
            # `--dtype auto` would pick (DPSERVE_CPU_BF16=0: float32).
            head = torch.bfloat16 if auto_cpu_dtype() == "bfloat16" else torch.float32
            count = model.quantize_weights(head_dtype=head)
            logger.info("int8 quantization: %d linear weights quantised, LM head in %s", count,
                        str(head).removeprefix("torch."))
        if (model.packed or model.prepack_weights()) and not self.config.model.enforce_eager:
            sched = self.config.scheduler
            start = time.monotonic()
            runs = model.warm_up_linears(sched.max_num_batched_tokens, _max_logits_rows(sched))
            _release_memory(self.device)  # the large warm-up buffers, kept free by glibc
            logger.info("linear weights pre-packed for oneDNN; kernels for %d (shape, rows) "
                        "pairs compiled in %.1f s", runs, time.monotonic() - start)
        if getattr(model, "plain_bytes", None) and model.plain_bytes():
            logger.info("steps of up to %d rows run dpserve's kernel on unpacked weights "
                        "(cpu_kernels): +%.0f MiB", cpu_kernels.kernel_rows(self.dtype),
                        model.plain_bytes() / 2**20)
        if getattr(model, "float32_packed_bytes", None) and model.float32_packed_bytes():
            logger.info("larger steps run the bfloat16 projections packed in float32 (faster "
                        "without AMX): %.0f MiB", model.float32_packed_bytes() / 2**20)
        if hasattr(model, "expert_info"):
            info = model.expert_info()
            logger.info("experts %d..%d of %d held here: %.1f MiB", info["experts"][0],
                        info["experts"][1] - 1, info["num_experts"],
                        info["expert_bytes"] / 2**20)
        return model

    def reshard_experts(self, rank: int, size: int) -> None:
        """Elastic expert parallelism: hold the experts of DP rank `rank` of `size`
        (this TP worker's share of them) from now on, read from the checkpoint (only
        the tensors of the new share). Every TP worker of the rank re-shards."""
        from dpserve.checkpoint.loader import iter_weights

        ep = self.expert_parallel
        assert ep is not None, "re-sharding experts without expert parallelism"
        start = time.monotonic()
        before = self.model.expert_info()["experts"]
        ep.set_dp(rank, size)
        names = self.model.resize_experts()
        self.model.load_experts(iter_weights(Path(self.config.model.path), progress=False,
                                             only=names))
        _release_memory(self.device)  # the old share's buffers
        info = self.model.expert_info()
        logger.info("DP size %d: experts %d..%d of %d held here (were %d..%d): %.1f MiB, "
                    "re-sharded in %.2f s", size, info["experts"][0], info["experts"][1] - 1,
                    info["num_experts"], before[0], before[1] - 1,
                    info["expert_bytes"] / 2**20, time.monotonic() - start)

    # ---- sleep (free device memory while idle) ----------------------------

    def start_profile(self) -> bool:
        """Open a profiler session on this worker (False: one runs already)."""
        return self.profiler.start()

    def stop_profile(self) -> str | None:
        """Close it and write its trace: the file's path (None: none ran)."""
        return self.profiler.stop()

    def set_sleep_level(self, level: int) -> None:
        """0: awake; 1: the KV cache freed (its contents are lost); 2: the weights
        too: on CUDA moved to host memory, on CPU dropped and read again from the
        checkpoint on wake (pre-packed CPU weights cannot be copied out). Going
        back to a lower level restores what it needs (the KV cache zeroed)."""
        if level >= 1 and self.kv.caches:
            self.kv.free()
        if level >= 2 and self.sleep_level < 2:
            if self.device.type == "cuda":
                self.model.to("cpu")
            else:
                self.model = None
        if level < 2 and self.sleep_level >= 2:
            if self.device.type == "cuda":
                self.model.to(self.device)
            else:
                self.model = self._load_model()
        self.sleep_level = level
        _release_memory(self.device)
        if level == 0 and not self.kv.caches:
            self.kv.allocate(self.kv.num_blocks)

    # ---- KV cache --------------------------------------------------------

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """[layers] this worker's KV cache tensors (`KVCacheMemory`)."""
        return self.kv.caches

    @property
    def num_blocks(self) -> int:
        """Usable KV blocks; block `num_blocks` is the scratch block."""
        return self.kv.num_blocks

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers."""
        return self.kv.block_bytes()

    def determine_num_blocks(self) -> int:
        """KV blocks the budget holds (`KVCacheMemory.determine_num_blocks`)."""
        return self.kv.determine_num_blocks(self.model)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` zeroed blocks per layer, plus one scratch block."""
        self.kv.allocate(num_blocks)

    # ---- steps -----------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; one sampled token per request with sample=True."""
        self.forget_requests(scheduler_output.finished_req_ids)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if scheduler_output.lora is not None:  # the step's adapters into their slots
            assert self.lora is not None
            plan = scheduler_output.lora
            self.lora.apply_plan(self.model, plan.loads, plan.host_drops)
        inputs = self.prepare_inputs(scheduler_output)
        kv = scheduler_output.kv_transfer
        if kv is not None and kv.loads:  # before any attention reads the blocks
            self.kv_copier.load(kv, self.kv_caches)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_meta,
                            self.kv_caches)  # [T, hidden]
        if kv is not None and kv.saves:  # every layer's KV of the step is written
            self.kv_copier.save(kv, self.kv_caches)
        prompt_logprobs = (compute_prompt_logprobs(self.model, hidden, scheduler_output)
                           if any(s.needs_prompt_logprobs
                                  for s in scheduler_output.scheduled) else {})
        # Pooling requests' rows (worker 0 answers for the group; never sampled).
        pooled = (pool_step(hidden, scheduler_output)
                  if scheduler_output.has_pooling and self.tp.rank == 0 else {})
        if not inputs.sampled and not inputs.spec:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                     prompt_logprobs=prompt_logprobs, pooled=pooled)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_index))
        if self.tp.rank != 0:  # worker 0 samples for the group
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        out = self._sample(logits, inputs)
        out.prompt_logprobs, out.pooled = prompt_logprobs, pooled
        return out

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> ModelRunnerOutput:
        """One token for each one-row request; speculative requests' drafts verified
        (model.spec_verify): their accepted run in `spec_token_ids`."""
        num_plain, tokens, logprobs = len(inputs.sampled), [], None
        if inputs.sampled:
            for req in inputs.sampled:
                seed = req.sampling_params.seed
                if seed is not None and req.req_id not in self.generators:
                    self.generators[req.req_id] = make_generator(  # moved: draws go on
                        seed, self.device, skip=req.num_output_tokens)
            meta = SamplingMetadata.from_requests(inputs.sampled, self.generators,
                                                  self.vocab_size, self.device)
            sampled, logprobs = self.sampler(logits[:num_plain], meta)
            tokens = sampled.tolist()
        runs = (verify(self.sampler, logits[num_plain:], inputs.spec, self.vocab_size,
                       self.device) if inputs.spec else [])
        return ModelRunnerOutput(
            req_ids=[r.req_id for r in (*inputs.sampled, *inputs.spec)],
            sampled_token_ids=tokens + [run[0] for run in runs], logprobs=logprobs,
            spec_token_ids={r.req_id: run for r, run in zip(inputs.spec, runs, strict=True)})

    def kv_tier_attach(self, name: str, size: int, generation: int) -> str | None:
        """Map the host tier's arena (`KVTierCopier.attach`). Returns the error (one
        line) instead of raising: a peer worker that raised would take the rank down."""
        try:
            self.kv_copier.attach(name, size, generation)
        except (OSError, RuntimeError, ValueError) as e:
            return str(e)
        return None

    def kv_tier_barrier(self) -> None:
        """Nothing: a worker answers an rpc only after every step sent before it, so
        the answer says its host-tier saves are copied (the engine then commits)."""

    def forget_requests(self, req_ids: list[str]) -> None:
        """Drop what the runner keeps for finished requests (their seeded generators)."""
        for req_id in req_ids:
            self.generators.pop(req_id, None)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Host-side input building for one step (also the test seam for logits)."""
        sched = so.scheduled
        num_reqs, bs = len(sched), self.block_size
        query_lens = np.fromiter((s.num_new_tokens for s in sched), np.int64, num_reqs)
        context_lens = np.fromiter((s.start for s in sched), np.int64, num_reqs)
        token_ids = list(itertools.chain.from_iterable(
            s.tokens(s.start, s.start + s.num_new_tokens) for s in sched))
        # Block table: only the blocks this step's tokens reach; padding is masked.
        needed = -(-(context_lens + query_lens) // bs)  # [R]
        table = np.zeros((num_reqs, int(needed.max())), dtype=np.int64)
        for i, s in enumerate(sched):
            table[i, :needed[i]] = s.block_ids[:needed[i]]
        ends = np.cumsum(query_lens) - 1  # [R] last token of each request
        sample_rows = [i for i, s in enumerate(sched) if s.sample]
        logits_index, sampled, spec = split_rows([sched[i] for i in sample_rows],
                                                 ends[sample_rows])
        meta = build_attention_metadata(query_lens, context_lens, table, so.num_decodes, bs,
                                        self.dtype, self.device, self.kv_elems_per_token)
        positions = token_positions(query_lens, context_lens)
        if self.lora is not None:  # each token's adapter slot (-1: none)
            slots = np.fromiter((s.lora_slot for s in sched), np.int64, num_reqs)
            self.lora.begin_step(np.repeat(slots, query_lens) if (slots >= 0).any() else None)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64).to(self.device),
            positions=torch.from_numpy(positions).to(self.device), attn_meta=meta,
            logits_index=torch.from_numpy(logits_index).to(self.device), sampled=sampled,
            spec=spec)

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """A 1-token forward that only touches the scratch block (DP lockstep)."""
        one = np.ones(1, dtype=np.int64)
        meta = build_attention_metadata(one, np.zeros(1, dtype=np.int64),
                                        np.full((1, 1), self.num_blocks, dtype=np.int64), 1,
                                        self.block_size, self.dtype, self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.lora is not None:
            self.lora.begin_step(None)
        self.model(zero, zero, meta, self.kv_caches)

    # ---- LoRA adapters (EngineCore drives them: engine.lora_manager) -------

    def load_lora(self, lora_id: int, path: str) -> str | None:
        """Keep adapter `path` on the host as `lora_id` (`WorkerLoRA.load`); the error."""
        assert self.lora is not None
        return self.lora.load(self.model, lora_id, path)

    def drop_lora(self, lora_id: int) -> None:
        """Forget adapter `lora_id`'s host copy (`WorkerLoRA.drop`)."""
        if self.lora is not None:
            self.lora.drop(lora_id)

    def clear_lora_slots(self) -> None:
        """Empty every slot (wake-up: the engine forgot which adapter each held)."""
        if self.lora is not None:
            self.lora.clear_slots()


def _max_logits_rows(sched: SchedulerConfig) -> int:
    """The most logits rows one step can ask for: one per running request, plus one
    per draft token with speculative decoding (within the step's token budget)."""
    spec = sched.speculative
    if spec is None:
        return sched.max_num_seqs
    return min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + spec.num_speculative_tokens))


def _release_memory(device: torch.device) -> None:
    """Give freed tensor memory back to the system (CUDA cache; glibc's heap on CPU)."""
    import ctypes
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass
