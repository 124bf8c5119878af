"""The frozen engine configuration: `EngineConfig` and its parts.

`EngineArgs.create_config()` (dpserve.config) builds one from the user's options;
nothing changes it afterwards (values found at run time, such as the number of
KV blocks, travel as explicit results). Every layer above reads these types;
`dpserve.config` hands them on, so `from dpserve.config import EngineConfig`
reads as before.

Not here: the options and their checks (`dpserve.config`, `dpserve.placement`), but
`PoolerConfig.parse` / `SpeculativeConfig.parse` (one option's JSON each) and what
`--device auto` and `--dtype auto` resolve to (`resolve_device`, `resolve_dtype`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from dpserve.errors import ConfigError
from dpserve.protocol import POOLING_TYPES
from dpserve.sampling_params import DEFAULT_MAX_LOGIT_BIAS, DEFAULT_MAX_STOP_TOKEN_IDS
from dpserve.tracing import TracingConfig


@dataclass(frozen=True)
class PoolerConfig:
    """How pooling (embedding) requests pool by default: `--pooler-config`, vLLM's
    option and JSON shape (`{"pooling_type": "LAST" | "MEAN", "normalize": bool}`);
    /v1/embeddings and `LLM.embed` make each request's `PoolingParams` from it."""

    pooling_type: str = "last"  # one of protocol.POOLING_TYPES
    normalize: bool = True

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> PoolerConfig:
        """The option's JSON text (or a dict; None: the defaults); ConfigError naming
        the option and the key at fault."""
        if value is None:
            return cls()
        given: Any = value
        if isinstance(value, str):
            try:
                given = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"pooler_config must be a JSON object: {e}") from None
        if not isinstance(given, Mapping):
            raise ConfigError(f"pooler_config must be a JSON object, got {value!r}")
        unknown = sorted(set(given) - {"pooling_type", "normalize"})
        if unknown:
            raise ConfigError(f"pooler_config: unknown key(s) {', '.join(unknown)} (known: "
                              f"pooling_type, normalize)")
        kind = given.get("pooling_type", "LAST")
        if not isinstance(kind, str) or kind.lower() not in POOLING_TYPES:
            raise ConfigError(f"pooler_config: pooling_type must be LAST or MEAN, got {kind!r}")
        normalize = given.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ConfigError(f"pooler_config: normalize must be true or false, got "
                              f"{normalize!r}")
        return cls(kind.lower(), normalize)


# --speculative-config methods (vLLM's names); dpserve proposes without a draft model.
SPECULATIVE_METHODS = ("ngram",)
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "disable_by_batch_size")
MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_HELP = (
    'Draft-free speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": '
    'K, "prompt_lookup_max": N, "prompt_lookup_min": M}: a decoding request proposes the K '
    'tokens that followed an earlier occurrence of its last M..N tokens, checked in one '
    'forward (greedy output unchanged). Default: off.')


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft-free speculative decoding: `--speculative-config`, vLLM's option and JSON
    shape (`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
    "prompt_lookup_min": M}`). Each decoding request proposes up to K tokens that
    followed an earlier occurrence of its last n tokens (M <= n <= N; engine.spec_decode),
    verified in one forward (model.spec_verify). vLLM's defaults: M and N 5 when both are
    unset, else the one given for both. `disable_by_batch_size` (vLLM's key): no drafts
    in a step while more requests than that run; unset, each step still keeps only
    the drafts worth their rows (engine.spec_decode.choose_drafts)."""

    method: str
    num_speculative_tokens: int  # K: draft tokens per request and step, at most
    prompt_lookup_max: int  # N: the longest suffix n-gram looked up
    prompt_lookup_min: int  # M: the shortest
    disable_by_batch_size: int | None = None  # no drafts while more requests run

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """The option's JSON text (or a dict; None: off); ConfigError naming the option."""
        if value is None:
            return None
        given: Any = value
        if isinstance(value, str):
            try:
                given = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(given, Mapping):
            raise ConfigError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(given) - set(_SPEC_KEYS))
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(_SPEC_KEYS)})")
        method = given.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config: method must be one of "
                              f"{', '.join(SPECULATIVE_METHODS)} (draft-free), got {method!r}")
        k = given.get("num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config: num_speculative_tokens must be an integer "
                              f"in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
        if low is None or high is None:  # vLLM's defaults: 5, or the one given for both
            low = high = 5 if low is None and high is None else (high if low is None else low)
        if not (_is_int(low) and _is_int(high) and 1 <= low <= high):
            raise ConfigError(f"speculative_config: need 1 <= prompt_lookup_min <= "
                              f"prompt_lookup_max (integers), got {low!r} and {high!r}")
        batch = given.get("disable_by_batch_size")
        if batch is not None and (not _is_int(batch) or batch < 1):
            raise ConfigError(f"speculative_config: disable_by_batch_size must be a positive "
                              f"integer, got {batch!r}")
        return cls(method, k, high, low, batch)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None  # as the user gave it (None: the built-in default)
    path: str  # local Hugging Face directory holding config.json + weights
    tokenizer: str  # local directory (or hub name) for the tokenizer
    architecture: str  # e.g. "LlamaForCausalLM"
    hf_config: Mapping[str, Any]  # config.json, read-only
    dtype: str  # resolved torch dtype name: "float32" | "bfloat16" | "float16"
    max_model_len: int  # prompt + output tokens per request
    seed: int
    enforce_eager: bool = False  # no start-up kernel compilation (EngineArgs.enforce_eager)
    # (SamplingParams field, value) from generation_config.json (dpserve/generation_config.py)
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    quantization: str | None = None  # "int8": dynamic int8 linears (dpserve.model.quant)
    pooler: PoolerConfig = PoolerConfig()  # how embeddings pool (--pooler-config)
    load_format: str = "auto"  # "sharded_state": files per TP worker (checkpoint.sharded_state)

    def __reduce__(self):
        # MappingProxyType does not pickle; send a plain copy (spawned engines
        # get their config through pickle) and re-wrap it on arrival.
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["hf_config"] = dict(self.hf_config)
        return (_rebuild_model_config, (state,))

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf_config.get("eos_token_id")
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _rebuild_model_config(state: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**state, "hf_config": MappingProxyType(state["hf_config"])})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    kv_cache_memory: int | None  # bytes for the KV cache on CPU
    gpu_memory_utilization: float  # fraction of device memory on CUDA
    enable_prefix_caching: bool
    num_kv_blocks: int | None  # fixed block count, overriding the memory budget
    kv_offload_bytes: int | None = None  # the host's KV tier (--kv-offload-memory); None: off
    # The host's KV store (ipc://), set by the launcher that started it before it spawns
    # its engines (dpserve.launch.kv_store); None: no tier.
    kv_tier_address: str | None = None
    # ... and its tcp:// endpoint for other hosts' pulls (a server over several hosts;
    # None on one host): the engine's heartbeats carry it to the front-ends.
    kv_tier_remote_address: str | None = None


# A step's token budget. On CPU a GEMM reaches its peak by ~16-64 rows, so a larger
# budget buys no throughput, while a burst of prompts prefilled in one step holds
# every first token (and every running decode) for that whole step: on the default
# model, 16 prompts of 128 tokens, TTFT p50 1.64 s at 2048 and 0.70 s at 512, with
# output tok/s equal or higher (256 lost 15% of it): BENCHMARKS.md.
DEFAULT_CPU_BUDGET = 512
DEFAULT_BUDGET = 2048  # GPU engines, and lockstep engines anywhere
# --scheduling-policy (vLLM's flag and values; dpserve.engine.waiting_queue).
SCHEDULING_POLICIES = ("priority", "fcfs")
SCHEDULING_HELP = (
    "How each engine orders its waiting requests: 'priority' runs requests with a lower "
    "`priority` field first (preempting less urgent running ones when blocks or slots "
    "run out), shares each priority between tenants (deficit round robin over prompt + "
    "max_tokens), then arrival; with every priority 0 and one tenant that is FCFS. "
    "'fcfs': arrival order only, and a request with a non-zero priority gets 400.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int  # token budget of one step
    max_num_seqs: int  # requests running at once
    max_model_len: int
    policy: str = "priority"  # --scheduling-policy: one of SCHEDULING_POLICIES
    speculative: SpeculativeConfig | None = None  # --speculative-config; None: off

    @classmethod
    def resolve(cls, max_num_batched_tokens: int | None, max_num_seqs: int,
                max_model_len: int, policy: str, small: bool,
                speculative: SpeculativeConfig | None = None) -> SchedulerConfig:
        """The options with the step's token budget resolved: `small` is a CPU engine
        that steps alone (lockstep engines pay a collective every step, every MoE
        layer's under expert parallelism: fewer, larger steps there; a 2 -> 3 -> 1
        rescale under streams took 41 s at 512, 25 s at 2048)."""
        budget = max_num_batched_tokens or max(
            DEFAULT_CPU_BUDGET if small else DEFAULT_BUDGET, max_num_seqs)
        return cls(budget, max_num_seqs, max_model_len, policy, speculative)

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of "
                              f"{', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class AutoscaleConfig:
    """`--data-parallel-autoscale MIN:MAX` and its targets (launch/coordinator/autoscale.py)."""

    min_size: int
    max_size: int
    up_queue: float = 2.0  # mean waiting requests per serving rank above this ...
    up_window_s: float = 10.0  # ... for this long: add a rank
    down_load: float = 0.5  # mean waiting + running per serving rank below this ...
    down_window_s: float = 60.0  # ... for this long: remove a rank
    cooldown_s: float = 30.0  # no decision this long after a change ends
    up_ttft_s: float | None = None  # or a serving rank's recent mean TTFT above this (s)


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int  # engine replicas, on every host together
    threads_per_engine: int | None  # torch CPU threads (None: torch's default)
    # Workers per DP rank sharing its model (dpserve.model.tensor_parallel); worker 0
    # is the rank's engine core, which starts the others (dpserve.engine.executor).
    tensor_parallel_size: int = 1
    # CPU cores of each local engine (this host's i-th engine: cpu_groups[i]); None: unbound.
    cpu_groups: tuple[tuple[int, ...], ...] | None = None
    # Engines step together in request waves (dummy batches, periodic all-reduce):
    # forced by the user, or needed by the model (expert-parallel MoE).
    data_parallel_lockstep: bool = False
    data_parallel_sync_interval: int = 32  # lockstep: steps between "any work left?" all-reduces
    data_parallel_collective_timeout: float = 10.0  # lockstep: s for one join or all-reduce
    enable_expert_parallel: bool = False  # MoE: each DP rank holds 1/N of the experts
    # Where the engines run (see DESIGN "Launch modes"). This host runs ranks
    # [start_rank, start_rank + size_local); the others run on other hosts.
    data_parallel_size_local: int = 1
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"  # the head's address: handshake, coordinator
    data_parallel_rpc_port: int = 29550  # the head's handshake / rendezvous port
    data_parallel_rank: int | None = None  # external LB: this server fronts this rank only
    data_parallel_hybrid_lb: bool = False  # API servers balance over this host's engines
    # --data-parallel-roles: (prefill, decode) rank counts at start; ranks [0, P) prefill,
    # the rest decode (dpserve.frontend.handoff). None: every rank does both.
    data_parallel_roles: tuple[int, int] | None = None
    data_parallel_backend: str = "mp"  # "mp": local processes; "ray": Ray actors
    data_parallel_pack_strategy: str = "strict"  # Ray: how ranks are packed onto nodes
    data_parallel_secret: str | None = field(default=None, repr=False)  # data-plane key
    data_parallel_insecure: bool = False  # the operator accepts an exposed data plane
    ray_address: str | None = None  # Ray: join this cluster (None: start a local one)
    # Faults (see README "Failures and draining"):
    engine_heartbeat_timeout: float = 3.0  # s without a heartbeat: the rank is unhealthy
    engine_stall_timeout: float = 30.0  # s with work but no finished step: unhealthy
    engine_failure_policy: str = "restart"  # restart | isolate | stop
    max_engine_restarts: int = 5  # per rank per RESTART_WINDOW_S; then it stays out
    max_request_migrations: int = 3  # moves of one request to another rank
    # An engine drops an API server that leaves its outputs unread (engine/output_sender.py):
    engine_output_backlog: int = 64 << 20  # bytes queued for one API server, at most
    engine_output_stall_timeout: float = 5.0  # s the oldest of them may wait
    # Scaling at run time (README "Scaling at run time"; resolved by
    # `dpserve.placement.elastic_scaling`): whether the engine count may change (one
    # host's mp engines, or Ray), and the ceiling the operator declared (the option,
    # else the autoscale MAX); None: what the placement holds, checked when a change
    # comes (`dpserve.placement.engines_fit`, Ray's placement).
    enable_elastic_ep: bool = False
    data_parallel_size_max: int | None = None
    autoscale: AutoscaleConfig | None = None  # --data-parallel-autoscale

    @property
    def elastic(self) -> bool:
        """The engine count may change at run time (`enable_elastic_ep`)."""
        return self.enable_elastic_ep

    @property
    def local_ranks(self) -> list[int]:
        """The DP ranks whose engines this host runs."""
        start = self.data_parallel_start_rank
        return list(range(start, start + self.data_parallel_size_local))

    @property
    def has_remote_engines(self) -> bool:
        return self.data_parallel_size_local < self.data_parallel_size

    @property
    def tcp_data_plane(self) -> bool:
        """Some data-plane sockets are tcp:// on data_parallel_address (other hosts, Ray)."""
        return self.has_remote_engines or self.local_lb or self.data_parallel_backend == "ray"

    @property
    def local_lb(self) -> bool:
        """Each host's API servers front that host's engines only (external or hybrid LB)."""
        return self.data_parallel_rank is not None or self.data_parallel_hybrid_lb


@dataclass(frozen=True)
class RequestLimitsConfig:
    """The request limits the engine enforces too (the offline `LLM` included); the API
    server's own limits are `dpserve.server.limits.RequestLimits`."""

    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS  # SamplingParams.stop_token_ids
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS  # SamplingParams.logit_bias entries
    structured_outputs_compile_timeout: float = 10.0  # seconds to compile one grammar


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora and its options (dpserve.engine.lora_manager)."""

    max_loras: int = 4  # adapters resident in device slots at once (one step's most)
    max_lora_rank: int = 16  # slots are sized for this rank
    max_cpu_loras: int = 4  # adapters kept in host memory (>= max_loras)
    modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str  # "cpu" | "cuda"
    # SIGTERM: requests in flight get this long to finish (server and engines), then abort.
    shutdown_timeout: float = 30.0
    limits: RequestLimitsConfig = RequestLimitsConfig()
    lora: LoRAConfig | None = None  # None: LoRA adapters off (no --enable-lora)
    tracing: TracingConfig | None = None  # None: no traces (dpserve.tracing)
    profile_dir: str | None = None  # torch profiler traces (dpserve.profiling); None: off


def replace(config: Any, **changes: Any) -> Any:
    """A copy of a frozen config with some fields changed (the original stays)."""
    return dataclasses.replace(config, **changes)


def resolve_device(device: str) -> str:
    """--device: `auto` -> cuda when torch sees a device (cpu for a CPU-only torch wheel,
    without importing torch); `cuda` without one is a ConfigError."""
    if device == "cpu" or (device == "auto" and _cpu_only_torch()):
        return "cpu"  # without importing torch (seconds): a launcher may never need it
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA device")
    return device


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only wheel (its version ends "+cpu", read
    from the package metadata): such a build never sees a CUDA device."""
    from importlib import metadata

    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False


def resolve_dtype(dtype: str, device: str, quantization: str | None) -> str:
    """`auto` -> bfloat16 on CUDA; on CPU bfloat16 where the CPU has native support
    (cpu_features.auto_cpu_dtype), float32 elsewhere and for int8 quantization."""
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    if quantization is not None:
        return "float32"
    from dpserve.cpu_features import auto_cpu_dtype

    return auto_cpu_dtype()
