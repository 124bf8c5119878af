"""Where the engines run: the data-parallel layout options resolved and checked.

Which ranks this host runs (`size_local`, `start_rank`), their CPU threads and
cores (`threads_per_engine`, `cpu_groups`), whether and how far the engine count
may change at run time (`autoscale_config`, `elastic_scaling`, `can_scale`; at the
time of a change: `engines_fit`), the data-plane secret and the
exposure check (`data_plane_secret`), and the checks of the multi-host options
(`check_placement`), and whether the model splits over each rank's
tensor-parallel workers (`check_tensor_parallel`), and the prefill / decode
roles of the ranks (`data_parallel_roles`). `EngineArgs`
(dpserve.config) calls them with itself: they read the options that
`PlacementArgs` lists.

Not here: the other options, the model, the frozen result (`dpserve.config`,
`dpserve.engine_config`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from dpserve.engine_config import AutoscaleConfig, EngineConfig, ParallelConfig
from dpserve.errors import ConfigError
from dpserve.security import SECRET_ENV, check_exposure, check_secret, read_secret_file

logger = logging.getLogger(__name__)

DP_BACKENDS = ("mp", "ray")
PACK_STRATEGIES = ("strict", "fill", "span")


class PlacementArgs(Protocol):
    """The options this module reads (fields of `dpserve.config.EngineArgs`)."""

    data_parallel_size: int
    tensor_parallel_size: int
    data_parallel_size_local: int | None
    data_parallel_start_rank: int | None
    data_parallel_rank: int | None
    data_parallel_hybrid_lb: bool
    data_parallel_backend: str
    data_parallel_pack_strategy: str
    data_parallel_address: str
    data_parallel_rpc_port: int
    data_parallel_secret: str | None
    data_parallel_secret_file: str | None
    data_parallel_insecure: bool
    data_parallel_size_max: int | None
    enable_elastic_ep: bool | None
    data_parallel_autoscale: str | None
    autoscale_up_queue: float
    autoscale_up_ttft: float | None
    autoscale_up_window: float
    autoscale_down_load: float
    autoscale_down_window: float
    autoscale_cooldown: float
    threads_per_engine: int | None
    cpu_bind: str
    data_parallel_roles: str | None
    kv_offload_memory: str | int | None


def _need(args: PlacementArgs, ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"{name} {what}, got {getattr(args, name)!r}")


def check_placement(args: PlacementArgs) -> None:
    """The multi-host options: which ranks run here, and how hosts find each other."""
    size = args.data_parallel_size
    need = functools.partial(_need, args)
    rank = args.data_parallel_rank
    need(rank is None or 0 <= rank < size, "data_parallel_rank",
         f"must be in [0, data_parallel_size={size})")
    local, start = size_local(args), start_rank(args)
    need(1 <= local <= size, "data_parallel_size_local",
         f"must be in [1, data_parallel_size={size}]")
    need(0 <= start and start + local <= size, "data_parallel_start_rank",
         f"plus data_parallel_size_local ({local}) must fit in data_parallel_size={size}")
    if rank is not None:
        need(local == 1, "data_parallel_size_local",
             "must be 1 with data_parallel_rank (one engine per server)")
        need(start == rank, "data_parallel_start_rank",
             f"must equal data_parallel_rank ({rank})")
        need(not args.data_parallel_hybrid_lb, "data_parallel_hybrid_lb",
             "cannot be combined with data_parallel_rank")
    need(1 <= args.data_parallel_rpc_port <= 65535, "data_parallel_rpc_port",
         "must be in [1, 65535]")
    need(bool(args.data_parallel_address.strip()), "data_parallel_address",
         "must not be empty")
    need(args.data_parallel_backend in DP_BACKENDS, "data_parallel_backend",
         f"must be one of {', '.join(DP_BACKENDS)}")
    need(args.data_parallel_pack_strategy in PACK_STRATEGIES,
         "data_parallel_pack_strategy", f"must be one of {', '.join(PACK_STRATEGIES)}")
    if args.data_parallel_backend == "ray":
        need(local == size and start == 0 and not args.data_parallel_hybrid_lb
             and rank is None, "data_parallel_backend",
             "'ray' places every rank itself (no --data-parallel-size-local, "
             "--data-parallel-start-rank, --data-parallel-rank or hybrid LB)")
    data_plane_secret(args)
    data_parallel_roles(args)


def check_tensor_parallel(args: PlacementArgs, hf_config: Mapping[str, Any], device: str,
                          expert_parallel: bool) -> None:
    """Whether the model splits over `tensor_parallel_size` workers, and this host has
    room for every local rank's workers; a one-line ConfigError naming the option
    otherwise (before anything starts). A GGUF file is read through the config.json
    it converts to, so the same rules hold for it."""
    tp = args.tensor_parallel_size
    if tp == 1:
        return
    heads = int(hf_config.get("num_attention_heads") or 0)
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"tensor_parallel_size {tp} {what}")

    need(heads > 0 and heads % tp == 0,
         f"must divide the model's {heads} attention heads")
    need(kv_heads % tp == 0 or tp % kv_heads == 0,
         f"must divide the model's {kv_heads} KV heads, or be a multiple of them "
         f"(KV heads are then replicated)")
    if hf_config.get("model_type") == "olmoe":
        need(kv_heads % tp == 0, f"must divide OLMoE's {kv_heads} KV heads (its k norm "
             f"spans every KV head)")
    sizes = {"intermediate_size": hf_config.get("intermediate_size")}
    if not expert_parallel:  # experts split by their intermediate dimension
        sizes["moe_intermediate_size"] = hf_config.get("moe_intermediate_size")
    sizes["shared_expert_intermediate_size"] = hf_config.get(
        "shared_expert_intermediate_size")
    for key, value in sizes.items():
        if value:
            need(int(value) % tp == 0, f"must divide the model's {key} ({value})")
    local = size_local(args) * tp  # worker processes on this host
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        need(local <= count, f"x data_parallel_size_local {size_local(args)} needs {local} "
             f"CUDA devices on this host; {count} visible")
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    if local > cores:
        logger.warning("tensor_parallel_size %d x %d local rank(s) = %d workers on %d CPU "
                       "core(s): workers share cores (correct, but each step waits for the "
                       "slowest)", tp, size_local(args), local, cores)


def size_local(args: PlacementArgs) -> int:
    if args.data_parallel_size_local is not None:
        return args.data_parallel_size_local
    return 1 if args.data_parallel_rank is not None else args.data_parallel_size


def start_rank(args: PlacementArgs) -> int:
    if args.data_parallel_start_rank is not None:
        return args.data_parallel_start_rank
    return args.data_parallel_rank if args.data_parallel_rank is not None else 0


def threads_per_engine(args: PlacementArgs, device: str) -> int | None:
    """The user's choice; on CPU with several (local) engines, a fair share of the cores."""
    local = size_local(args)
    if args.threads_per_engine is not None or device != "cpu" or \
            args.data_parallel_size == 1:
        return args.threads_per_engine
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, cores // local)


def cpu_groups(args: PlacementArgs, device: str) -> tuple[tuple[int, ...], ...] | None:
    """--cpu-bind resolved: the cores of each local engine, or None (unbound).

    'auto' binds CPU engines run as local processes, more than one here, whose
    threads share out the cores: dpserve's own share (no --threads-per-engine),
    or threads that add up to every core. Engines with fewer threads stay
    unbound: a second server on the same host would otherwise be bound to the
    same first cores as this one."""
    spec, local = args.cpu_bind.strip(), size_local(args)
    if spec == "none" or device != "cpu":
        return None
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if spec == "auto":
        threads = threads_per_engine(args, device) or 0
        shared_out = args.threads_per_engine is None or threads * local == len(allowed)
        if (args.data_parallel_backend != "mp" or local == 1 or not allowed
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


def autoscale_config(args: PlacementArgs) -> AutoscaleConfig | None:
    """--data-parallel-autoscale MIN:MAX and its targets, validated."""
    spec = args.data_parallel_autoscale
    if spec is None:
        return None
    lo, _, hi = spec.partition(":")
    if not (lo.strip().isdigit() and hi.strip().isdigit()):
        raise ConfigError(f"data_parallel_autoscale must be MIN:MAX (two whole numbers, "
                          f"e.g. 1:4), got {spec!r}")
    low, high = int(lo), int(hi)
    if not 1 <= low <= args.data_parallel_size <= high:
        raise ConfigError(f"data_parallel_autoscale {spec} must satisfy 1 <= MIN <= "
                          f"data_parallel_size ({args.data_parallel_size}) <= MAX")
    need = functools.partial(_need, args)
    for name in ("autoscale_up_queue", "autoscale_up_window", "autoscale_down_window"):
        need(getattr(args, name) > 0, name, "must be positive")
    for name in ("autoscale_down_load", "autoscale_cooldown"):
        need(getattr(args, name) >= 0, name, "must not be negative")
    need(args.autoscale_up_ttft is None or args.autoscale_up_ttft > 0,
         "autoscale_up_ttft", "must be positive")
    need(args.autoscale_down_load < args.autoscale_up_queue, "autoscale_down_load",
         f"must be below autoscale_up_queue ({args.autoscale_up_queue}) (hysteresis)")
    return AutoscaleConfig(low, high, args.autoscale_up_queue, args.autoscale_up_window,
                           args.autoscale_down_load, args.autoscale_down_window,
                           args.autoscale_cooldown, args.autoscale_up_ttft)


def can_scale(args: PlacementArgs) -> bool:
    """The layout lets the engine count change at run time: one host's engines (mp, no
    headless hosts, no external / hybrid load balancing), or Ray."""
    fixed_hosts = (size_local(args) < args.data_parallel_size
                   or args.data_parallel_rank is not None or args.data_parallel_hybrid_lb)
    return args.data_parallel_backend == "ray" or not fixed_hosts


def elastic_scaling(args: PlacementArgs,
                    autoscale: AutoscaleConfig | None) -> tuple[bool, int | None]:
    """(whether the engine count may change at run time, the declared ceiling or None).

    On with --enable-elastic-ep (which `dpserve serve --enable-admin-api` turns on where
    the layout allows it: the scale route is served), a ceiling above
    --data-parallel-size, --data-parallel-autoscale, or several engines (the coordinator
    runs anyway); off with --no-enable-elastic-ep. The ceiling is
    --data-parallel-size-max, else the autoscale MAX; None: what the placement holds
    when a change comes (`engines_fit`, or Ray's view of its cluster then)."""
    size, declared = args.data_parallel_size, args.data_parallel_size_max
    if declared is not None:
        _need(args, declared >= size, "data_parallel_size_max",
              f"must be at least data_parallel_size ({size})")
        if autoscale is not None:
            _need(args, declared >= autoscale.max_size, "data_parallel_size_max",
                  f"must be at least the autoscale MAX ({autoscale.max_size})")
    elif autoscale is not None:
        declared = autoscale.max_size
    asked = autoscale is not None or (declared or size) > size
    if (asked or args.enable_elastic_ep) and not can_scale(args):
        name = "data_parallel_size_max" if asked else "enable_elastic_ep"
        raise ConfigError(f"{name}: scaling at run time (it, --enable-elastic-ep or "
                          f"--data-parallel-autoscale) needs one host's engines (mp) or "
                          f"Ray, not headless hosts or external/hybrid load balancing")
    if args.enable_elastic_ep is False and asked:
        raise ConfigError("enable_elastic_ep: --no-enable-elastic-ep cannot be combined "
                          "with --data-parallel-size-max above --data-parallel-size or "
                          "--data-parallel-autoscale")
    elastic = args.enable_elastic_ep is not False and can_scale(args) and (
        bool(args.enable_elastic_ep) or asked or size > 1)
    return elastic, declared


def num_experts(hf_config: Mapping[str, Any]) -> int:
    """The routed experts of a mixture-of-experts model (0: a dense model)."""
    return max(int(hf_config.get(k) or 0)
               for k in ("num_local_experts", "num_experts", "n_routed_experts"))


def experts_fit(config: EngineConfig, engines: int) -> str | None:
    """Expert parallelism: whether `engines` ranks each hold at least one expert per
    tensor-parallel worker; None, or what is missing."""
    if not config.parallel.enable_expert_parallel:
        return None
    tp, experts = config.parallel.tensor_parallel_size, num_experts(config.model.hf_config)
    if engines * tp <= experts:
        return None
    return (f"{engines} engines x tensor_parallel_size {tp} = {engines * tp} expert-parallel "
            f"workers, but the model has {experts} experts (one at least each)")


def engines_fit(parallel: ParallelConfig, device: str, engines: int) -> str | None:
    """Whether this host (mp backend) holds `engines` engines: None, or what is missing.

    CUDA: tensor_parallel_size visible devices per engine (`worker_device`). CPU: the
    cores per engine that placement gives it: --threads-per-engine (dpserve's share
    of the cores when several engines start) and at least one per tensor-parallel
    worker; an engine without a thread count needs one core."""
    tp = parallel.tensor_parallel_size
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if engines * tp > count:
            return (f"{engines} engines x tensor_parallel_size {tp} need {engines * tp} "
                    f"CUDA devices; this host has {count} visible")
        return None
    threads = parallel.threads_per_engine
    per = max(threads or 1, tp)
    cores = len(_allowed_cores()) or os.cpu_count() or 1
    if engines * per <= cores:
        return None
    why = (f"{per} each: --threads-per-engine {threads}" if threads and threads >= tp else
           f"{per} each: one per tensor-parallel worker" if tp > 1 else "one each")
    return (f"{engines} engines need {engines * per} CPU cores ({why}); this host has "
            f"{cores}")


def data_parallel_roles(args: PlacementArgs) -> tuple[int, int] | None:
    """--data-parallel-roles `prefill:P,decode:D` -> (P, D): ranks [0, P) prefill, the
    other D decode (None: every rank does both). One-line ConfigErrors: a bad spec,
    sizes that do not add up to data_parallel_size, no --kv-offload-memory (the
    prompt's KV reaches the decode rank through the host tier), external or hybrid
    load balancing (one API server must see both roles)."""
    spec = args.data_parallel_roles
    if spec is None:
        return None
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        role, _, count = part.strip().partition(":")
        if role not in ("prefill", "decode") or role in sizes or not count.strip().isdigit():
            raise ConfigError(f"data_parallel_roles must be prefill:P,decode:D (e.g. "
                              f"prefill:1,decode:1), got {spec!r}")
        sizes[role] = int(count)
    prefill, decode = sizes.get("prefill", 0), sizes.get("decode", 0)
    need = functools.partial(_need, args)
    need(prefill >= 1 and decode >= 1, "data_parallel_roles",
         "needs at least one prefill and one decode rank")
    need(prefill + decode == args.data_parallel_size, "data_parallel_roles",
         f"must add up to data_parallel_size ({args.data_parallel_size}): "
         f"{prefill} + {decode} = {prefill + decode}")
    if args.kv_offload_memory in (None, 0, "0"):
        raise ConfigError("data_parallel_roles needs --kv-offload-memory (the prompt's KV "
                          "reaches the decode rank through the host's KV tier)")
    need(args.data_parallel_rank is None and not args.data_parallel_hybrid_lb,
         "data_parallel_roles", "cannot be combined with --data-parallel-rank or "
         "--data-parallel-hybrid-lb (an API server must front both roles)")
    return prefill, decode


def data_plane_secret(args: PlacementArgs) -> str | None:
    """The secret (option, file or $DPSERVE_DP_SECRET), checked; a tcp:// data plane
    on a non-loopback address without one is refused (`--data-parallel-insecure`
    aside; the launcher warns about a plain one: `security.warn_plain_tcp`)."""
    if args.data_parallel_secret is not None and args.data_parallel_secret_file:
        raise ConfigError("data_parallel_secret_file cannot be combined with "
                          "--data-parallel-secret (give the secret once)")
    if args.data_parallel_secret_file:
        secret: str | None = read_secret_file(args.data_parallel_secret_file)
    else:
        secret = args.data_parallel_secret or os.environ.get(SECRET_ENV) or None
        if secret is not None:
            check_secret(secret)
    size, local = args.data_parallel_size, size_local(args)
    tcp = (local < size or args.data_parallel_backend == "ray"
           or args.data_parallel_rank is not None or args.data_parallel_hybrid_lb)
    if tcp:
        check_exposure(args.data_parallel_address, secret, args.data_parallel_insecure)
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


def _allowed_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _format_cores(cores: list[int]) -> str:
    """The allowed cores for a message: all of them, or their count and bounds."""
    if len(cores) < 8:
        return ",".join(map(str, cores))
    return f"{len(cores)} cores from {cores[0]} to {cores[-1]}"
