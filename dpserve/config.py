"""Configuration: one flat set of user options, resolved once into frozen parts.

`EngineArgs` is what users write (keyword arguments of `LLM`, command-line
flags; each field's `help` becomes `--help`). `EngineArgs.create_config()`
validates every option, resolves the model (local directory, GGUF file, the
built-in default or the Hugging Face hub) and returns a frozen
`EngineConfig`. Nothing mutates a config after that: values found at run time
(the number of KV blocks) travel as explicit results.

The frozen types live in `dpserve.engine_config` (handed on from here), the
data-parallel layout's resolution and checks in `dpserve.placement`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dpserve.checkpoint.lora_config import check_lora_options, lora_config
from dpserve.checkpoint.sharded_state import LOAD_FORMATS, check_load_format
from dpserve.engine_config import (
    SCHEDULING_HELP,
    SCHEDULING_POLICIES,
    SPECULATIVE_HELP,
    AutoscaleConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    RequestLimitsConfig,
    SchedulerConfig,
    SpeculativeConfig,
    replace,
    resolve_device,
    resolve_dtype,
)
from dpserve.errors import ConfigError
from dpserve.generation_config import load_generation_defaults
from dpserve.placement import (
    DP_BACKENDS,
    PACK_STRATEGIES,
    autoscale_config,
    check_placement,
    check_tensor_parallel,
    cpu_groups,
    data_parallel_roles,
    data_plane_secret,
    elastic_scaling,
    num_experts,
    size_local,
    start_rank,
    threads_per_engine,
)
from dpserve.profiling import ProfileArgs
from dpserve.sampling_params import DEFAULT_MAX_LOGIT_BIAS, DEFAULT_MAX_STOP_TOKEN_IDS
from dpserve.tracing.options import TracingArgs

__all__ = ["AutoscaleConfig", "CacheConfig", "ConfigError", "EngineArgs", "EngineConfig",
           "ModelConfig", "ParallelConfig", "PoolerConfig", "RequestLimitsConfig",
           "SchedulerConfig",
           "parse_memory_size", "replace"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_DEFAULT_CPU_KV_BYTES = 2 << 30
_FAILURE_POLICIES = ("restart", "isolate", "stop")
_LIMITS = "request limits"  # the `dpserve serve` argument group of these options


def _check_quantization(quantization: str, device: str, dtype: str, arch: str) -> None:
    """int8 runs fbgemm CPU kernels on float32 dense Llama-family models only."""
    from dpserve.checkpoint.registry import supports_int8

    if device != "cpu":
        raise ConfigError(f"quantization {quantization} runs on CPU only (device is {device})")
    if dtype != "float32":
        raise ConfigError(f"quantization {quantization} needs dtype float32, got {dtype}")
    if not supports_int8(arch):
        raise ConfigError(f"quantization {quantization} is not supported for {arch} "
                          "(dense Llama, Mistral and Qwen2 models only)")


def _opt(default: Any, help: str, repr: bool = True, **kw: Any) -> Any:
    return field(default=default, repr=repr, metadata={"help": help, **kw})


# The tracing and profiling options are declared with their packages (`TracingArgs`,
# checked on construction; `ProfileArgs`) and are EngineArgs' first fields.
@dataclass
class EngineArgs(ProfileArgs, TracingArgs):
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
    load_format: str = _opt("auto", "sharded_state: each tensor-parallel worker reads its own "
                            "files (dpserve save-sharded-state).", choices=LOAD_FORMATS)
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
    kv_offload_memory: str | int | None = _opt(None, "Shared memory (e.g. 8GiB) for this host's "
                                               "KV tier: every local DP rank saves full KV "
                                               "blocks there and loads prefix hits from it "
                                               "(LRU; needs prefix caching). Default: off.")
    max_num_batched_tokens: int | None = _opt(None, "Token budget of one engine step "
                                              "(default 512 on CPU, 2048 on GPU or with "
                                              "lockstep engines; at least max_num_seqs).")
    max_num_seqs: int = _opt(256, "Most requests running at once.")
    scheduling_policy: str = _opt("priority", SCHEDULING_HELP, choices=SCHEDULING_POLICIES)
    pooler_config: str | dict | None = _opt(
        None, 'How embeddings pool the final hidden states (/v1/embeddings, LLM.embed), as '
        'JSON: {"pooling_type": "LAST" | "MEAN", "normalize": true | false}. Default: '
        'LAST (the last prompt token), normalised.')
    speculative_config: str | dict | None = _opt(None, SPECULATIVE_HELP)
    enable_lora: bool = _opt(False, "Serve LoRA adapters: loaded at start (--lora-modules) "
                             "or at run time; a request names one (rows of one step may "
                             "use different adapters).")
    max_loras: int = _opt(4, "LoRA: adapters resident on the device at once (the most one "
                          "step can use).")
    max_lora_rank: int = _opt(16, "LoRA: the highest adapter rank served (the device slots "
                              "are sized for it).")
    max_cpu_loras: int | None = _opt(None, "LoRA: adapters kept in host memory, at least "
                                     "max_loras (default: max_loras).")
    lora_modules: list[str] | None = _opt(None, "LoRA adapters loaded at start, as name=path "
                                          "(several: --lora-modules a=/path/a b=/path/b); "
                                          "needs --enable-lora.", nargs="+")
    data_parallel_size: int = _opt(1, "Number of engine replicas.", aliases=("-dp",))
    tensor_parallel_size: int = _opt(1, "Workers that share each DP rank's model (tensor "
                                     "parallel): heads, MLP and vocabulary are split "
                                     "between them; the rank's engine core is worker 0 "
                                     "and starts the others.", aliases=("-tp",))
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
                                                   "it the DP group is formed again. "
                                                   "Also bounds each tensor-parallel "
                                                   "collective of a rank's workers; past "
                                                   "it the rank fails (and restarts).")
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
    data_parallel_roles: str | None = _opt(None, "prefill:P,decode:D (P + D = the DP size, "
                                           "needs --kv-offload-memory): prompts on ranks "
                                           "0..P-1, decoding on the rest. Default: off.")
    data_parallel_backend: str = _opt("mp", "Run engines as local processes (mp) or Ray "
                                      "actors (ray; pip install dpserve[ray]).",
                                      choices=DP_BACKENDS, aliases=("-dpb",))
    data_parallel_pack_strategy: str = _opt("strict", "Ray: how ranks are placed on nodes.",
                                            choices=PACK_STRATEGIES)
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
                                        "peer that reaches it can act as a DP rank); "
                                        "under Ray off loopback, hand the secret to "
                                        "actors without RAY_AUTH_MODE=token.")
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
                                              "MAX, else what the host or Ray cluster holds "
                                              "when the change comes).")
    enable_elastic_ep: bool | None = _opt(None, "Let the engine count change at run time "
                                          "(default: with --enable-admin-api, a size max, "
                                          "the autoscaler, or several engines).")
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
            if f.type in ("bool", bool, "bool | None"):
                target.add_argument(*flags, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=help_text)
                continue
            kind = {"int": int, "float": float, "int | None": int,
                    "float | None": float}.get(str(f.type), str)
            nargs = {"nargs": f.metadata["nargs"]} if "nargs" in f.metadata else {}
            target.add_argument(*flags, type=kind, default=f.default, help=help_text,
                                choices=f.metadata.get("choices"), **nargs)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    def check_options(self) -> None:
        """Raise ConfigError for an option that is wrong whatever the model and the
        machine (`create_config` checks them too; this is the fast, early check)."""
        _check_plain_options(self)
        self.checked_profile_dir()

    def create_config(self) -> EngineConfig:
        """Validate every option, resolve the model, and freeze the result."""
        self.check_options()
        device = resolve_device(self.device)
        model = self._model_config(device)
        kv_bytes = (parse_memory_size(self.kv_cache_memory, "kv_cache_memory")
                    if self.kv_cache_memory is not None else
                    (_DEFAULT_CPU_KV_BYTES if device == "cpu" else None))
        cache = CacheConfig(
            block_size=self.block_size, kv_cache_memory=kv_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching, num_kv_blocks=self.num_kv_blocks,
            kv_offload_bytes=_kv_offload_bytes(self))
        parallel = _parallel_config(self, device, model.hf_config, model.architecture)
        check_tensor_parallel(self, model.hf_config, device, parallel.enable_expert_parallel)
        check_load_format(model.path, self.load_format, self.tensor_parallel_size,
                          parallel.enable_expert_parallel)
        scheduler = SchedulerConfig.resolve(
            self.max_num_batched_tokens, self.max_num_seqs, model.max_model_len,
            self.scheduling_policy, small=device == "cpu" and not parallel.data_parallel_lockstep,
            speculative=SpeculativeConfig.parse(self.speculative_config))
        limits = RequestLimitsConfig(
            max_stop_token_ids=self.max_stop_token_ids, max_logit_bias=self.max_logit_bias,
            structured_outputs_compile_timeout=float(self.structured_outputs_compile_timeout))
        return EngineConfig(model=model, cache=cache, scheduler=scheduler,
                            parallel=parallel, device=device,
                            shutdown_timeout=float(self.shutdown_timeout), limits=limits,
                            lora=lora_config(self), tracing=self.tracing_config(),
                            profile_dir=self.checked_profile_dir())

    def _model_config(self, device: str) -> ModelConfig:
        """Resolve the model (directory, GGUF file, default, hub) and check it."""
        dtype = resolve_dtype(self.dtype, device, self.quantization)
        from dpserve.checkpoint.loader import resolve_model

        path = resolve_model(self.model, revision=self.revision)
        hf_config = json.loads((Path(path) / "config.json").read_text())
        archs = hf_config.get("architectures") or []
        from dpserve.checkpoint.registry import supported_architectures

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
            quantization=self.quantization, pooler=PoolerConfig.parse(self.pooler_config),
            load_format=self.load_format)
        if self.quantization is not None:
            _check_quantization(self.quantization, device, dtype, arch)
        return model


# ---- resolutions and checks over the options (as `dpserve.placement`'s) -------------


def _parallel_config(args: EngineArgs, device: str, hf_config: Mapping[str, Any],
                     arch: str) -> ParallelConfig:
    """The data-parallel options resolved (`dpserve.placement`) for this model."""
    autoscale = autoscale_config(args)
    elastic, most = elastic_scaling(args, autoscale)
    return ParallelConfig(
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        threads_per_engine=threads_per_engine(args, device),
        cpu_groups=cpu_groups(args, device),
        data_parallel_lockstep=(args.data_parallel_lockstep or _is_moe(hf_config))
        and (elastic or args.data_parallel_size > 1),
        data_parallel_sync_interval=args.data_parallel_sync_interval,
        data_parallel_collective_timeout=args.data_parallel_collective_timeout,
        enable_expert_parallel=_expert_parallel(args, hf_config, arch, most or 0),
        data_parallel_size_local=size_local(args),
        data_parallel_start_rank=start_rank(args),
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        data_parallel_rank=args.data_parallel_rank,
        data_parallel_hybrid_lb=args.data_parallel_hybrid_lb,
        data_parallel_roles=data_parallel_roles(args),
        data_parallel_backend=args.data_parallel_backend,
        data_parallel_pack_strategy=args.data_parallel_pack_strategy,
        data_parallel_secret=data_plane_secret(args),
        data_parallel_insecure=args.data_parallel_insecure,
        ray_address=args.ray_address,
        engine_heartbeat_timeout=args.engine_heartbeat_timeout,
        engine_stall_timeout=args.engine_stall_timeout,
        engine_failure_policy=args.engine_failure_policy,
        max_engine_restarts=args.max_engine_restarts,
        max_request_migrations=args.max_request_migrations,
        engine_output_backlog=parse_memory_size(args.engine_output_backlog,
                                                "engine_output_backlog"),
        engine_output_stall_timeout=args.engine_output_stall_timeout,
        enable_elastic_ep=elastic, data_parallel_size_max=most, autoscale=autoscale)


def _check_plain_options(args: EngineArgs) -> None:
    """ConfigError for an option that is wrong whatever the model and the machine,
    naming it and the value given."""

    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"{name} {what}, got {getattr(args, name)!r}")

    need(args.dtype in _DTYPES, "dtype", f"must be one of {', '.join(_DTYPES)}")
    need(args.device in _DEVICES, "device", f"must be one of {', '.join(_DEVICES)}")
    need(args.quantization in (None, "int8"), "quantization", "must be int8 (or unset)")
    need(args.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
         "must be a power of two in [1, 128]")
    need(0.0 < args.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
         "must be in (0, 1]")
    need(args.num_kv_blocks is None or args.num_kv_blocks >= 1, "num_kv_blocks",
         "must be at least 1")
    need(args.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
    PoolerConfig.parse(args.pooler_config)
    SpeculativeConfig.parse(args.speculative_config)
    need(args.max_num_batched_tokens is None or args.max_num_batched_tokens
         >= args.max_num_seqs, "max_num_batched_tokens", "must be at least max_num_seqs")
    need(args.max_model_len is None or args.max_model_len >= 1, "max_model_len",
         "must be at least 1")
    need(args.data_parallel_size >= 1, "data_parallel_size", "must be at least 1")
    need(args.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
    need(args.threads_per_engine is None or args.threads_per_engine >= 1,
         "threads_per_engine", "must be at least 1")
    need(args.cpu_bind.strip() != "" and (args.data_parallel_backend != "ray" or
                                          args.cpu_bind.strip() in ("auto", "none")),
         "cpu_bind", "must be 'auto', 'none' or core lists (with Ray: 'auto' or 'none'; "
         "Ray places the engines)")
    need(args.data_parallel_sync_interval >= 1, "data_parallel_sync_interval",
         "must be at least 1")
    need(args.data_parallel_collective_timeout > 0, "data_parallel_collective_timeout",
         "must be positive")
    need(args.engine_heartbeat_timeout > 0, "engine_heartbeat_timeout", "must be positive")
    need(args.engine_stall_timeout > 0, "engine_stall_timeout", "must be positive")
    need(args.engine_failure_policy in _FAILURE_POLICIES, "engine_failure_policy",
         f"must be one of {', '.join(_FAILURE_POLICIES)}")
    need(args.max_engine_restarts >= 0, "max_engine_restarts", "must be at least 0")
    need(args.max_request_migrations >= 0, "max_request_migrations", "must be at least 0")
    parse_memory_size(args.engine_output_backlog, "engine_output_backlog")
    need(2 <= args.engine_output_stall_timeout < float("inf"), "engine_output_stall_timeout",
         "must be a number of seconds >= 2")
    need(0 <= args.shutdown_timeout < float("inf"), "shutdown_timeout",
         "must be a number of seconds >= 0")
    need(args.max_stop_token_ids >= 0, "max_stop_token_ids", "must be at least 0")
    need(args.max_logit_bias >= 0, "max_logit_bias", "must be at least 0")
    need(0 < args.structured_outputs_compile_timeout < float("inf"),
         "structured_outputs_compile_timeout", "must be a positive number of seconds")
    check_lora_options(args)
    check_placement(args)
    if args.kv_cache_memory is not None:
        parse_memory_size(args.kv_cache_memory, "kv_cache_memory")
    _kv_offload_bytes(args)


def _expert_parallel(args: EngineArgs, hf_config: Mapping[str, Any], arch: str, most: int
                     ) -> bool:
    """--enable-expert-parallel, checked against the model and the DP layout."""
    if not args.enable_expert_parallel:
        return False
    experts = num_experts(hf_config)
    if not experts:
        raise ConfigError(f"enable_expert_parallel needs a mixture-of-experts model; "
                          f"{arch} has no experts")
    # Experts are spread over every worker: DP ranks x TP workers (as vLLM).
    _need_workers(args.data_parallel_size, args.tensor_parallel_size, "data_parallel_size",
                  experts)
    if args.engine_failure_policy == "isolate":
        raise ConfigError("engine_failure_policy 'isolate' cannot serve on without a "
                          "rank's experts under enable_expert_parallel; use restart or "
                          "stop")
    # Elastic EP: a change of the DP size re-shards the experts (up to one per rank).
    if most:
        _need_workers(most, args.tensor_parallel_size, "data_parallel_size_max", experts)
    return True


def _need_workers(dp: int, tp: int, name: str, experts: int) -> None:
    """Expert parallelism: `name` (a DP size) x `tp` (tensor_parallel_size) workers, each
    holding at least one of the model's `experts`."""
    if dp * tp > experts:
        raise ConfigError(f"{name} x tensor_parallel_size must not exceed the model's "
                          f"{experts} experts with enable_expert_parallel, got {dp} x "
                          f"{tp} = {dp * tp}")


def _kv_offload_bytes(args: EngineArgs) -> int | None:
    """--kv-offload-memory in bytes (None: off), checked against the options it needs."""
    if args.kv_offload_memory in (None, 0, "0"):
        return None
    size = parse_memory_size(args.kv_offload_memory, "kv_offload_memory")
    if not args.enable_prefix_caching:
        raise ConfigError("kv_offload_memory needs prefix caching (its blocks are found by "
                          "their prefix hashes): drop --no-enable-prefix-caching or "
                          "--kv-offload-memory")
    if args.data_parallel_backend == "ray":
        raise ConfigError("kv_offload_memory: not with the Ray backend yet "
                          "(--data-parallel-backend ray)")
    return size


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


def _is_moe(hf_config: Mapping[str, Any]) -> bool:
    """Mixture-of-experts models (their expert-parallel ranks must step together)."""
    return num_experts(hf_config) > 0


def _model_context_length(hf_config: Mapping[str, Any]) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        if hf_config.get(key):
            return int(hf_config[key])
    return 2048


