"""Configuration: one flat set of user options, resolved once into frozen parts.

`EngineArgs` is what users write (keyword arguments of `LLM`, command-line
flags; each field's `help` becomes `--help`). `EngineArgs.create_config()`
validates every option, resolves the model (local directory, GGUF file, the
built-in default or the Hugging Face hub) and returns a frozen
`EngineConfig`. Nothing mutates a config after that: values found at run time
(the number of KV blocks) travel as explicit results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dpserve.errors import ConfigError
from dpserve.generation_config import load_generation_defaults
from dpserve.sampling_params import DEFAULT_MAX_LOGIT_BIAS, DEFAULT_MAX_STOP_TOKEN_IDS
from dpserve.security import SECRET_ENV, check_exposure, check_secret, read_secret_file

__all__ = ["ConfigError", "EngineArgs", "EngineConfig"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_DEFAULT_CPU_KV_BYTES = 2 << 30
# A step's token budget. On CPU a GEMM reaches its peak by ~16-64 rows, so a larger
# budget buys no throughput, while a burst of prompts prefilled in one step holds
# every first token (and every running decode) for that whole step: on the default
# model, 16 prompts of 128 tokens, TTFT p50 1.64 s at 2048 and 0.70 s at 512, with
# output tok/s equal or higher (256 lost 15% of it): BENCHMARKS.md.
_DEFAULT_CPU_BUDGET = 512
_DEFAULT_BUDGET = 2048  # GPU engines, and lockstep engines anywhere
_DP_BACKENDS = ("mp", "ray")
_PACK_STRATEGIES = ("strict", "fill", "span")
_FAILURE_POLICIES = ("restart", "isolate", "stop")
_LIMITS = "request limits"  # the `dpserve serve` argument group of these options


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


def _check_quantization(quantization: str, device: str, dtype: str, arch: str) -> None:
    """int8 runs fbgemm CPU kernels on float32 dense Llama-family models only."""
    from dpserve.model.registry import get_model_class

    if device != "cpu":
        raise ConfigError(f"quantization {quantization} runs on CPU only (device is {device})")
    if dtype != "float32":
        raise ConfigError(f"quantization {quantization} needs dtype float32, got {dtype}")
    from dpserve.model.llama import LlamaForCausalLM

    if get_model_class(arch) is not LlamaForCausalLM:
        raise ConfigError(f"quantization {quantization} is not supported for {arch} "
                          "(dense Llama, Mistral and Qwen2 models only)")


def _rebuild_model_config(state: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**state, "hf_config": MappingProxyType(state["hf_config"])})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    kv_cache_memory: int | None  # bytes for the KV cache on CPU
    gpu_memory_utilization: float  # fraction of device memory on CUDA
    enable_prefix_caching: bool
    num_kv_blocks: int | None  # fixed block count, overriding the memory budget


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int  # token budget of one step
    max_num_seqs: int  # requests running at once
    max_model_len: int


@dataclass(frozen=True)
class AutoscaleConfig:
    """`--data-parallel-autoscale MIN:MAX` and its targets (`dpserve.launch.autoscale`)."""

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
    data_parallel_backend: str = "mp"  # "mp": local processes; "ray": Ray actors
    data_parallel_pack_strategy: str = "strict"  # Ray: how ranks are packed onto nodes
    data_parallel_secret: str | None = field(default=None, repr=False)  # data-plane key
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
    # Scaling at run time (README "Scaling at run time"): the most engines a change may
    # reach (resolved: the option, else the autoscale MAX, else data_parallel_size).
    data_parallel_size_max: int = 1
    autoscale: AutoscaleConfig | None = None  # --data-parallel-autoscale

    @property
    def elastic(self) -> bool:
        """The engine count may change at run time (one host's mp engines, or Ray)."""
        return self.data_parallel_size_max > 1 and (
            self.data_parallel_backend == "ray"
            or (not self.has_remote_engines and not self.local_lb))

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
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str  # "cpu" | "cuda"
    # SIGTERM: requests in flight get this long to finish (server and engines), then abort.
    shutdown_timeout: float = 30.0
    limits: RequestLimitsConfig = RequestLimitsConfig()


def _opt(default: Any, help: str, repr: bool = True, **kw: Any) -> Any:
    return field(default=default, repr=repr, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Every engine option, flat, as users pass them."""

    model: str | None = _opt(None, "Model: a Hugging Face directory, a .gguf file or a hub "
                             "name. Default: the built-in SmolLM2-135M-Instruct.")
    tokenizer: str | None = _opt(None, "Tokenizer directory or hub name (default: the model's).")
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit) of the model.")
    dtype: str = _opt("auto", "Weight and activation dtype; auto = bfloat16 on CUDA and on "
                      "CPUs with native bfloat16 (AVX512-BF16, AMX), else float32 "
                      "(also with --quantization).", choices=_DTYPES)
    device: str = _opt("auto", "Device to run on; auto = CUDA when available.", choices=_DEVICES)
    quantization: str | None = _opt(None, "int8: layer weights in int8 (per-channel scales), "
                                    "activations quantised on the fly (CPU, float32, "
                                    "dense models). Default: none.", choices=("int8",))
    seed: int = _opt(0, "Seed for sampling of requests that give no seed.")
    enforce_eager: bool = _opt(False, "Skip compiling every linear kernel at start-up (CPU): "
                               "a faster start, but kernels compile on first use while "
                               "serving and memory reaches its plateau later. Also set by "
                               "the environment variable DPSERVE_ENFORCE_EAGER=1.")
    generation_config: str = _opt("auto", "Default sampling parameters: 'auto' takes "
                                  "temperature, top_p, top_k, min_p, repetition_penalty "
                                  "and max_new_tokens from the model's "
                                  "generation_config.json (or a directory's given "
                                  "instead) for requests that do not set them; 'vllm' "
                                  "ignores it.")
    max_model_len: int | None = _opt(None, "Most tokens (prompt + output) per request "
                                     "(default: the model's context length).")
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    kv_cache_memory: str | int | None = _opt(None, "KV-cache size on CPU, in bytes or with a "
                                             "unit (e.g. 2GiB, 512MiB). Default 2GiB.")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of GPU memory for weights, "
                                         "activations and KV cache.")
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of shared prompt prefixes.")
    num_kv_blocks: int | None = _opt(None, "Fixed number of KV blocks (overrides the memory "
                                     "budget; for tests and tuning).")
    max_num_batched_tokens: int | None = _opt(None, "Token budget of one engine step "
                                              "(default 512 on CPU, 2048 on GPU or with "
                                              "lockstep engines; at least max_num_seqs).")
    max_num_seqs: int = _opt(256, "Most requests running at once.")
    data_parallel_size: int = _opt(1, "Number of engine replicas.", aliases=("-dp",))
    threads_per_engine: int | None = _opt(None, "torch CPU threads per engine (default: "
                                          "torch's choice; with data parallel on CPU, "
                                          "the cores shared out between the engines).")
    cpu_bind: str = _opt("auto", "Cores of the CPU engines: 'auto' (several engines on this "
                         "host that share out its cores: each bound to its own share), "
                         "'none', or one core list per local engine, e.g. '0-3|4-7'.")
    data_parallel_lockstep: bool = _opt(False, "Step all engines together in request waves "
                                        "(dummy batches on idle engines, a periodic "
                                        "all-reduce), as expert-parallel MoE models need; "
                                        "on by itself for such models.")
    data_parallel_sync_interval: int = _opt(32, "In lockstep mode, engines all-reduce "
                                            "'any unfinished work' every this many steps.")
    data_parallel_collective_timeout: float = _opt(10.0, "In lockstep mode, seconds one "
                                                   "collective (all-reduce, group join) "
                                                   "may wait for the other ranks; past "
                                                   "it the DP group is formed again.")
    enable_expert_parallel: bool = _opt(False, "Mixture-of-experts models: each of the "
                                        "--data-parallel-size ranks holds its share of "
                                        "the experts (attention stays data parallel); "
                                        "tokens meet their experts through collectives "
                                        "over the lockstep DP group.")
    data_parallel_size_local: int | None = _opt(None, "Engines on this host (default: all "
                                                "of them; 1 with --data-parallel-rank).",
                                                aliases=("-dpl",))
    data_parallel_start_rank: int | None = _opt(None, "DP rank of this host's first engine "
                                                "(default 0; R with --data-parallel-rank).",
                                                aliases=("-dpr",))
    data_parallel_address: str = _opt("127.0.0.1", "Address of the head host (rank 0): "
                                      "remote engines and hosts connect to it, and its "
                                      "data-plane sockets bind to it only.", aliases=("-dpa",))
    data_parallel_rpc_port: int = _opt(29550, "Head's port for engine handshakes and the "
                                       "coordinator rendezvous (external/hybrid LB).",
                                       aliases=("-dpp",))
    data_parallel_rank: int | None = _opt(None, "External load balancing: this server runs "
                                          "and fronts DP rank R only.", aliases=("-dpn",))
    data_parallel_hybrid_lb: bool = _opt(False, "Hybrid load balancing: each host's API "
                                         "servers balance over that host's engines only.",
                                         aliases=("-dph",))
    data_parallel_backend: str = _opt("mp", "Run engines as local processes (mp) or Ray "
                                      "actors (ray; pip install dpserve[ray]).",
                                      choices=_DP_BACKENDS, aliases=("-dpb",))
    data_parallel_pack_strategy: str = _opt("strict", "Ray: how ranks are placed on nodes.",
                                            choices=_PACK_STRATEGIES)
    data_parallel_secret: str | None = _opt(None, "Shared secret of the data plane, at "
                                            "least 32 characters, the same on every host "
                                            "(CURVE keys derived from it): processes "
                                            "without it cannot join. Prefer "
                                            "--data-parallel-secret-file (command lines "
                                            "are public); default $DPSERVE_DP_SECRET.",
                                            repr=False)
    data_parallel_secret_file: str | None = _opt(None, "File holding the data-plane "
                                                 "secret (mode 600: refused if group or "
                                                 "others may read it).")
    data_parallel_insecure: bool = _opt(False, "Allow a tcp:// data plane on a "
                                        "non-loopback --data-parallel-address without a "
                                        "secret (a trusted private network only: any "
                                        "peer that reaches it can act as a DP rank).")
    ray_address: str | None = _opt(None, "Ray: join this cluster (default: start a local "
                                   "one).")
    engine_heartbeat_timeout: float = _opt(3.0, "Seconds without a heartbeat after which a "
                                           "DP rank is unhealthy (a frozen or stopped "
                                           "process): it gets no new work, its requests move.")
    engine_stall_timeout: float = _opt(30.0, "Seconds a DP rank may hold work without "
                                       "finishing a step (a hung forward) before it is "
                                       "unhealthy.")
    engine_failure_policy: str = _opt("restart", "When an engine dies: restart it, isolate "
                                      "it (serve on without it), or stop the whole server.",
                                      choices=_FAILURE_POLICIES)
    max_engine_restarts: int = _opt(5, "Restarts of one rank within 10 minutes; past it the "
                                    "rank stays out.")
    max_request_migrations: int = _opt(3, "How often one request may move to another rank "
                                       "when its rank fails.")
    engine_output_backlog: str | int = _opt("64MiB", "Outputs an engine holds for one API "
                                            "server that does not read them (bytes, or "
                                            "with a unit); past it that API server is "
                                            "dropped: its requests there are aborted.")
    engine_output_stall_timeout: float = _opt(5.0, "Seconds an engine's oldest unread "
                                              "output for one API server may wait before "
                                              "that API server is dropped (its requests "
                                              "there aborted; the others stream on); at "
                                              "least 2.")
    data_parallel_size_max: int | None = _opt(None, "Most engines a change at run time "
                                              "(POST /scale_elastic_ep, dpserve scale, the "
                                              "autoscaler) may reach (default: the autoscale "
                                              "MAX, else --data-parallel-size).")
    data_parallel_autoscale: str | None = _opt(None, "MIN:MAX: add or remove engines with "
                                               "the load, between MIN and MAX engines.")
    autoscale_up_queue: float = _opt(2.0, "Autoscale: add an engine when the mean number "
                                     "of waiting requests per serving engine stays above "
                                     "this for --autoscale-up-window s.")
    autoscale_up_ttft: float | None = _opt(None, "Autoscale: also add an engine when a "
                                           "serving engine's mean time to first token over "
                                           "the last 10 s stays above this many seconds "
                                           "for --autoscale-up-window s (default: off).")
    autoscale_up_window: float = _opt(10.0, "Autoscale: seconds the queue (or TTFT) must "
                                      "stay high.")
    autoscale_down_load: float = _opt(0.5, "Autoscale: remove an engine when the mean "
                                      "waiting + running requests per serving engine stay "
                                      "below this for --autoscale-down-window s.")
    autoscale_down_window: float = _opt(60.0, "Autoscale: seconds the load must stay low.")
    autoscale_cooldown: float = _opt(30.0, "Autoscale: seconds after a change before the "
                                     "next decision.")
    shutdown_timeout: float = _opt(30.0, "On SIGTERM (or Ctrl-C), seconds that requests in "
                                   "flight get to finish before they are aborted; new "
                                   "requests get 503 meanwhile.")
    # Request limits (the "request limits" group of `dpserve serve`).
    max_stop_token_ids: int = _opt(DEFAULT_MAX_STOP_TOKEN_IDS, "Most stop_token_ids of one "
                                   "request (each is checked for every token it "
                                   "generates).", group=_LIMITS)
    max_logit_bias: int = _opt(DEFAULT_MAX_LOGIT_BIAS, "Most logit_bias entries of one request.",
                               group=_LIMITS)
    structured_outputs_compile_timeout: float = _opt(
        10.0, "Seconds one structured-output grammar (JSON schema, regex, grammar, tool "
        "schema) may take to compile; past it the request fails (400 from the API server, "
        "an error from the engine).", group=_LIMITS)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown option {unknown[0]!r}; known options: "
                              + ", ".join(sorted(names)))
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     groups: Mapping[str, argparse.ArgumentParser] | None = None) -> None:
        """Every option as a flag on `parser`, or on `groups[name]` for the options of
        group `name` (e.g. "request limits")."""
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            flags = (flag, *f.metadata.get("aliases", ()))  # vLLM's short flags (-dp, ...)
            help_text = f.metadata.get("help", "")
            if f.name == "model":
                continue  # positional, added by the CLI
            target = (groups or {}).get(f.metadata.get("group", ""), parser)
            if f.type in ("bool", bool):
                target.add_argument(*flags, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=help_text)
                continue
            kind = {"int": int, "float": float, "int | None": int,
                    "float | None": float}.get(str(f.type), str)
            target.add_argument(*flags, type=kind, default=f.default, help=help_text,
                                choices=f.metadata.get("choices"))

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    def check_options(self) -> None:
        """Raise ConfigError for an option that is wrong whatever the model and the
        machine (`create_config` checks them too; this is the fast, early check)."""
        self._validate_plain_options()

    def create_config(self) -> EngineConfig:
        """Validate every option, resolve the model, and freeze the result."""
        self.check_options()
        device = _resolve_device(self.device)
        dtype = _resolve_dtype(self.dtype, device, self.quantization)
        from dpserve.model.loader import resolve_model

        path = resolve_model(self.model, revision=self.revision)
        hf_config = json.loads((Path(path) / "config.json").read_text())
        archs = hf_config.get("architectures") or []
        from dpserve.model.registry import supported_architectures

        arch = next((a for a in archs if a in supported_architectures()), None)
        if arch is None:
            raise ConfigError(f"model: architecture {archs or '(none)'} is not supported; "
                              f"supported: {', '.join(supported_architectures())}")
        model_len = _model_context_length(hf_config)
        max_model_len = self.max_model_len or model_len
        if max_model_len > model_len:
            raise ConfigError(f"max_model_len ({max_model_len}) exceeds the model's context "
                              f"length ({model_len})")
        model = ModelConfig(
            model=self.model, path=str(path), tokenizer=self.tokenizer or str(path),
            architecture=arch, hf_config=MappingProxyType(hf_config), dtype=dtype,
            max_model_len=max_model_len, seed=self.seed,
            enforce_eager=self.enforce_eager or os.environ.get("DPSERVE_ENFORCE_EAGER") == "1",
            generation_defaults=load_generation_defaults(self.generation_config, str(path)),
            quantization=self.quantization)
        if self.quantization is not None:
            _check_quantization(self.quantization, device, dtype, arch)
        kv_bytes = (parse_memory_size(self.kv_cache_memory, "kv_cache_memory")
                    if self.kv_cache_memory is not None else
                    (_DEFAULT_CPU_KV_BYTES if device == "cpu" else None))
        cache = CacheConfig(
            block_size=self.block_size, kv_cache_memory=kv_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching, num_kv_blocks=self.num_kv_blocks)
        autoscale = self._autoscale()
        lockstep = ((self.data_parallel_lockstep or _is_moe(hf_config))
                    and self._size_max(autoscale) > 1)
        # Lockstep engines pay a collective every step (every MoE layer's, under
        # expert parallelism): fewer, larger steps there (a 2 -> 3 -> 1 rescale
        # under streams took 41 s at 512, 25 s at 2048).
        small = device == "cpu" and not lockstep
        budget = self.max_num_batched_tokens or max(
            _DEFAULT_CPU_BUDGET if small else _DEFAULT_BUDGET, self.max_num_seqs)
        scheduler = SchedulerConfig(max_num_batched_tokens=budget,
                                    max_num_seqs=self.max_num_seqs, max_model_len=max_model_len)
        parallel = ParallelConfig(
            data_parallel_size=self.data_parallel_size,
            threads_per_engine=self._threads_per_engine(device),
            cpu_groups=self._cpu_groups(device),
            data_parallel_lockstep=lockstep,
            data_parallel_sync_interval=self.data_parallel_sync_interval,
            data_parallel_collective_timeout=self.data_parallel_collective_timeout,
            enable_expert_parallel=self._expert_parallel(hf_config, arch, autoscale),
            data_parallel_size_local=self._size_local(),
            data_parallel_start_rank=self._start_rank(),
            data_parallel_address=self.data_parallel_address,
            data_parallel_rpc_port=self.data_parallel_rpc_port,
            data_parallel_rank=self.data_parallel_rank,
            data_parallel_hybrid_lb=self.data_parallel_hybrid_lb,
            data_parallel_backend=self.data_parallel_backend,
            data_parallel_pack_strategy=self.data_parallel_pack_strategy,
            data_parallel_secret=self._data_plane_secret(),
            ray_address=self.ray_address,
            engine_heartbeat_timeout=self.engine_heartbeat_timeout,
            engine_stall_timeout=self.engine_stall_timeout,
            engine_failure_policy=self.engine_failure_policy,
            max_engine_restarts=self.max_engine_restarts,
            max_request_migrations=self.max_request_migrations,
            engine_output_backlog=parse_memory_size(self.engine_output_backlog,
                                                    "engine_output_backlog"),
            engine_output_stall_timeout=self.engine_output_stall_timeout,
            data_parallel_size_max=self._size_max(autoscale), autoscale=autoscale)
        limits = RequestLimitsConfig(
            max_stop_token_ids=self.max_stop_token_ids, max_logit_bias=self.max_logit_bias,
            structured_outputs_compile_timeout=float(self.structured_outputs_compile_timeout))
        return EngineConfig(model=model, cache=cache, scheduler=scheduler,
                            parallel=parallel, device=device,
                            shutdown_timeout=float(self.shutdown_timeout), limits=limits)

    def _expert_parallel(self, hf_config: Mapping[str, Any], arch: str,
                         autoscale: AutoscaleConfig | None) -> bool:
        """--enable-expert-parallel, checked against the model and the DP layout."""
        if not self.enable_expert_parallel:
            return False
        experts = _num_experts(hf_config)
        if not experts:
            raise ConfigError(f"enable_expert_parallel needs a mixture-of-experts model; "
                              f"{arch} has no experts")
        self._need(self.data_parallel_size <= experts, "data_parallel_size",
                   f"must not exceed the model's {experts} experts with "
                   f"enable_expert_parallel")
        if self.engine_failure_policy == "isolate":
            raise ConfigError("engine_failure_policy 'isolate' cannot serve on without a "
                              "rank's experts under enable_expert_parallel; use restart or "
                              "stop")
        # Elastic EP: a change of the DP size re-shards the experts (up to one per rank).
        self._need(self._size_max(autoscale) <= experts, "data_parallel_size_max",
                   f"must not exceed the model's {experts} experts with "
                   f"enable_expert_parallel")
        return True

    def _threads_per_engine(self, device: str) -> int | None:
        """The user's choice; on CPU with several (local) engines, a fair share of the cores."""
        local = self._size_local()
        if self.threads_per_engine is not None or device != "cpu" or \
                self.data_parallel_size == 1:
            return self.threads_per_engine
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        return max(1, cores // local)

    def _cpu_groups(self, device: str) -> tuple[tuple[int, ...], ...] | None:
        """--cpu-bind resolved: the cores of each local engine, or None (unbound).

        'auto' binds CPU engines run as local processes, more than one here, whose
        threads share out the cores: dpserve's own share (no --threads-per-engine),
        or threads that add up to every core. Engines with fewer threads stay
        unbound: a second server on the same host would otherwise be bound to the
        same first cores as this one."""
        spec, local = self.cpu_bind.strip(), self._size_local()
        if spec == "none" or device != "cpu":
            return None
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if spec == "auto":
            threads = self._threads_per_engine(device) or 0
            shared_out = self.threads_per_engine is None or threads * local == len(allowed)
            if (self.data_parallel_backend != "mp" or local == 1 or not allowed
                    or threads * local > len(allowed) or not shared_out):
                return None
            return tuple(tuple(allowed[i * threads:(i + 1) * threads]) for i in range(local))
        groups = tuple(_parse_cores(group) for group in spec.split("|"))
        if len(groups) != local:
            raise ConfigError(f"cpu_bind {spec!r} names {len(groups)} core list(s); this host "
                              f"runs {local} engine(s) (data_parallel_size_local)")
        outside = sorted(set().union(*groups) - set(allowed)) if allowed else []
        if outside:
            raise ConfigError(f"cpu_bind {spec!r}: core(s) {outside} are not available to "
                              f"this process (allowed: {_format_cores(allowed)})")
        return groups

    def _autoscale(self) -> AutoscaleConfig | None:
        """--data-parallel-autoscale MIN:MAX and its targets, validated."""
        spec = self.data_parallel_autoscale
        if spec is None:
            return None
        lo, _, hi = spec.partition(":")
        if not (lo.strip().isdigit() and hi.strip().isdigit()):
            raise ConfigError(f"data_parallel_autoscale must be MIN:MAX (two whole numbers, "
                              f"e.g. 1:4), got {spec!r}")
        low, high = int(lo), int(hi)
        if not 1 <= low <= self.data_parallel_size <= high:
            raise ConfigError(f"data_parallel_autoscale {spec} must satisfy 1 <= MIN <= "
                              f"data_parallel_size ({self.data_parallel_size}) <= MAX")
        for name in ("autoscale_up_queue", "autoscale_up_window", "autoscale_down_window"):
            self._need(getattr(self, name) > 0, name, "must be positive")
        for name in ("autoscale_down_load", "autoscale_cooldown"):
            self._need(getattr(self, name) >= 0, name, "must not be negative")
        self._need(self.autoscale_up_ttft is None or self.autoscale_up_ttft > 0,
                   "autoscale_up_ttft", "must be positive")
        self._need(self.autoscale_down_load < self.autoscale_up_queue, "autoscale_down_load",
                   f"must be below autoscale_up_queue ({self.autoscale_up_queue}) "
                   f"(hysteresis)")
        return AutoscaleConfig(low, high, self.autoscale_up_queue, self.autoscale_up_window,
                               self.autoscale_down_load, self.autoscale_down_window,
                               self.autoscale_cooldown, self.autoscale_up_ttft)

    def _size_max(self, autoscale: AutoscaleConfig | None) -> int:
        """The most engines a change at run time may reach (validated)."""
        size = self.data_parallel_size
        scaling = autoscale is not None or (self.data_parallel_size_max or size) > size
        fixed_hosts = (self._size_local() < size or self.data_parallel_rank is not None
                       or self.data_parallel_hybrid_lb)
        if scaling and fixed_hosts and self.data_parallel_backend != "ray":
            raise ConfigError("data_parallel_size_max: scaling at run time (it, or "
                              "--data-parallel-autoscale) needs one host's engines (mp) or "
                              "Ray, not headless hosts or external/hybrid load balancing")
        if self.data_parallel_size_max is None:
            return autoscale.max_size if autoscale is not None else size
        self._need(self.data_parallel_size_max >= size, "data_parallel_size_max",
                   f"must be at least data_parallel_size ({size})")
        if autoscale is not None:
            self._need(self.data_parallel_size_max >= autoscale.max_size,
                       "data_parallel_size_max",
                       f"must be at least the autoscale MAX ({autoscale.max_size})")
        return self.data_parallel_size_max

    def _size_local(self) -> int:
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return 1 if self.data_parallel_rank is not None else self.data_parallel_size

    def _start_rank(self) -> int:
        if self.data_parallel_start_rank is not None:
            return self.data_parallel_start_rank
        return self.data_parallel_rank if self.data_parallel_rank is not None else 0

    def _need(self, ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"{name} {what}, got {getattr(self, name)!r}")

    def _validate_plain_options(self) -> None:
        need = self._need

        need(self.dtype in _DTYPES, "dtype", f"must be one of {', '.join(_DTYPES)}")
        need(self.device in _DEVICES, "device", f"must be one of {', '.join(_DEVICES)}")
        need(self.quantization in (None, "int8"), "quantization", "must be int8 (or unset)")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
             "must be a power of two in [1, 128]")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
             "must be in (0, 1]")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
             "must be at least 1")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens
             >= self.max_num_seqs, "max_num_batched_tokens", "must be at least max_num_seqs")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
             "must be at least 1")
        need(self.data_parallel_size >= 1, "data_parallel_size", "must be at least 1")
        need(self.threads_per_engine is None or self.threads_per_engine >= 1,
             "threads_per_engine", "must be at least 1")
        need(self.cpu_bind.strip() != "" and (self.data_parallel_backend != "ray" or
                                              self.cpu_bind.strip() in ("auto", "none")),
             "cpu_bind", "must be 'auto', 'none' or core lists (with Ray: 'auto' or 'none'; "
             "Ray places the engines)")
        need(self.data_parallel_sync_interval >= 1, "data_parallel_sync_interval",
             "must be at least 1")
        need(self.data_parallel_collective_timeout > 0, "data_parallel_collective_timeout",
             "must be positive")
        need(self.engine_heartbeat_timeout > 0, "engine_heartbeat_timeout", "must be positive")
        need(self.engine_stall_timeout > 0, "engine_stall_timeout", "must be positive")
        need(self.engine_failure_policy in _FAILURE_POLICIES, "engine_failure_policy",
             f"must be one of {', '.join(_FAILURE_POLICIES)}")
        need(self.max_engine_restarts >= 0, "max_engine_restarts", "must be at least 0")
        need(self.max_request_migrations >= 0, "max_request_migrations", "must be at least 0")
        parse_memory_size(self.engine_output_backlog, "engine_output_backlog")
        need(2 <= self.engine_output_stall_timeout < float("inf"), "engine_output_stall_timeout",
             "must be a number of seconds >= 2")
        need(0 <= self.shutdown_timeout < float("inf"), "shutdown_timeout",
             "must be a number of seconds >= 0")
        need(self.max_stop_token_ids >= 0, "max_stop_token_ids", "must be at least 0")
        need(self.max_logit_bias >= 0, "max_logit_bias", "must be at least 0")
        need(0 < self.structured_outputs_compile_timeout < float("inf"),
             "structured_outputs_compile_timeout", "must be a positive number of seconds")
        self._validate_placement()
        if self.kv_cache_memory is not None:
            parse_memory_size(self.kv_cache_memory, "kv_cache_memory")


    def _validate_placement(self) -> None:
        """The multi-host options: which ranks run here, and how hosts find each other."""
        size = self.data_parallel_size
        need = self._need
        rank = self.data_parallel_rank
        need(rank is None or 0 <= rank < size, "data_parallel_rank",
             f"must be in [0, data_parallel_size={size})")
        local, start = self._size_local(), self._start_rank()
        need(1 <= local <= size, "data_parallel_size_local",
             f"must be in [1, data_parallel_size={size}]")
        need(0 <= start and start + local <= size, "data_parallel_start_rank",
             f"plus data_parallel_size_local ({local}) must fit in data_parallel_size={size}")
        if rank is not None:
            need(local == 1, "data_parallel_size_local",
                 "must be 1 with data_parallel_rank (one engine per server)")
            need(start == rank, "data_parallel_start_rank",
                 f"must equal data_parallel_rank ({rank})")
            need(not self.data_parallel_hybrid_lb, "data_parallel_hybrid_lb",
                 "cannot be combined with data_parallel_rank")
        need(1 <= self.data_parallel_rpc_port <= 65535, "data_parallel_rpc_port",
             "must be in [1, 65535]")
        need(bool(self.data_parallel_address.strip()), "data_parallel_address",
             "must not be empty")
        need(self.data_parallel_backend in _DP_BACKENDS, "data_parallel_backend",
             f"must be one of {', '.join(_DP_BACKENDS)}")
        need(self.data_parallel_pack_strategy in _PACK_STRATEGIES,
             "data_parallel_pack_strategy", f"must be one of {', '.join(_PACK_STRATEGIES)}")
        if self.data_parallel_backend == "ray":
            need(local == size and start == 0 and not self.data_parallel_hybrid_lb
                 and rank is None, "data_parallel_backend",
                 "'ray' places every rank itself (no --data-parallel-size-local, "
                 "--data-parallel-start-rank, --data-parallel-rank or hybrid LB)")
        self._data_plane_secret()

    def _data_plane_secret(self) -> str | None:
        """The secret (option, file or $DPSERVE_DP_SECRET), checked; a tcp:// data plane
        on a non-loopback address without one is refused (`--data-parallel-insecure`
        aside; the launcher warns about a plain one: `security.warn_plain_tcp`)."""
        if self.data_parallel_secret is not None and self.data_parallel_secret_file:
            raise ConfigError("data_parallel_secret_file cannot be combined with "
                              "--data-parallel-secret (give the secret once)")
        if self.data_parallel_secret_file:
            secret: str | None = read_secret_file(self.data_parallel_secret_file)
        else:
            secret = self.data_parallel_secret or os.environ.get(SECRET_ENV) or None
            if secret is not None:
                check_secret(secret)
        size, local = self.data_parallel_size, self._size_local()
        tcp = (local < size or self.data_parallel_backend == "ray"
               or self.data_parallel_rank is not None or self.data_parallel_hybrid_lb)
        if tcp:
            check_exposure(self.data_parallel_address, secret, self.data_parallel_insecure)
        return secret


def _parse_cores(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8); ConfigError naming cpu_bind when malformed."""
    cores: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise ConfigError(f"cpu_bind: {text!r} is not a core list ('auto', 'none', or "
                              f"lists such as '0-3|4-7', one per local engine)")
        cores.extend(range(int(lo), int(hi if dash else lo) + 1))
    return tuple(sorted(set(cores)))


def _format_cores(cores: list[int]) -> str:
    """The allowed cores for a message: all of them, or their count and bounds."""
    if len(cores) < 8:
        return ",".join(map(str, cores))
    return f"{len(cores)} cores from {cores[0]} to {cores[-1]}"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_memory_size(value: str | int, option: str) -> int:
    """'2GiB' / '512MiB' / '1e9' / 123 -> bytes; raises ConfigError naming `option`."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{option}: cannot read {value!r} as a size (e.g. 2GiB, 512MiB)")
        try:
            size = int(float(m.group(1)) * _UNITS[unit])
        except ValueError:
            raise ConfigError(f"{option}: cannot read {value!r} as a size") from None
    if size <= 0:
        raise ConfigError(f"{option} must be positive, got {value!r}")
    return size


def _resolve_device(device: str) -> str:
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


def _resolve_dtype(dtype: str, device: str, quantization: str | None) -> str:
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


def _is_moe(hf_config: Mapping[str, Any]) -> bool:
    """Mixture-of-experts models (their expert-parallel ranks must step together)."""
    return _num_experts(hf_config) > 0


def _num_experts(hf_config: Mapping[str, Any]) -> int:
    return max(int(hf_config.get(k) or 0)
               for k in ("num_local_experts", "num_experts", "n_routed_experts"))


def _model_context_length(hf_config: Mapping[str, Any]) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        if hf_config.get(key):
            return int(hf_config[key])
    return 2048


def replace(config: Any, **changes: Any) -> Any:
    """A copy of a frozen config with some fields changed (the original stays)."""
    return dataclasses.replace(config, **changes)
