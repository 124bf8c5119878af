"""A PEFT LoRA adapter's adapter_config.json, read and checked without torch.

Scope: what `dpserve.config` checks of `--lora-modules` before anything starts,
and what `dpserve.model.lora` reads before it opens the weights: the directory
holds adapter_config.json and adapter_model.safetensors, the adapter is plain
LoRA (no DoRA, no trained biases, no modules_to_save, no per-module rank or
alpha patterns, no fan_in_fan_out), its rank is within `--max-lora-rank`, and
its scaling (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora).

Also `--enable-lora`'s options checked and resolved (`check_lora_options`,
`lora_config`, called by `dpserve.config`).

Not here: the weights and how they map onto a model (`dpserve.model.lora`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpserve.engine_config import LoRAConfig
from dpserve.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of adapter_config.json dpserve uses."""

    path: str
    rank: int  # r
    scaling: float  # lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))
    target_modules: tuple[str, ...] | str  # names, or a regex PEFT full-matches
    base_model: str | None  # base_model_name_or_path, as written (informative only)


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """Read and check the adapter in directory `path`; ValueError (one line) when it
    is not a LoRA adapter dpserve can serve, or its rank exceeds `max_rank`."""
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{path} is not a LoRA adapter directory (no {CONFIG_FILE})")
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a LoRA adapter directory (no {WEIGHTS_FILE})")
    try:
        c = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}/{CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(c, dict):
        raise ValueError(f"{path}/{CONFIG_FILE} is not a JSON object")
    kind = c.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {kind!r} is not supported (only LORA)")
    if c.get("target_parameters"):  # PEFT's LoRA on fused parameters: MoE experts
        raise ValueError(f"{path}: target_parameters {c['target_parameters']!r}: LoRA on "
                         f"mixture-of-experts layers is not supported")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out"),
                      ("modules_to_save", "modules_to_save"), ("rank_pattern", "rank_pattern"),
                      ("alpha_pattern", "alpha_pattern"),
                      ("layers_to_transform", "layers_to_transform")):
        if c.get(key):
            raise ValueError(f"{path}: {what} adapters are not supported")
    if c.get("bias", "none") != "none":
        raise ValueError(f"{path}: adapters with trained biases (bias={c['bias']!r}) "
                         f"are not supported")
    rank, alpha = c.get("r"), c.get("lora_alpha", c.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{path}: LoRA rank {rank} exceeds max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if c.get("use_rslora") else rank)
    targets = c.get("target_modules")
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets) and targets:
        targets = tuple(targets)
    elif not isinstance(targets, str) or not targets:
        raise ValueError(f"{path}: target_modules must be a list of names or a regex, "
                         f"got {targets!r}")
    return AdapterConfig(path=str(path), rank=rank, scaling=float(scaling),
                         target_modules=targets,
                         base_model=c.get("base_model_name_or_path"))


def parse_lora_module(spec: str) -> tuple[str, str]:
    """`--lora-modules` entry "name=path" -> (name, path); ValueError naming it."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{spec!r} is not name=path")
    return name.strip(), path.strip()


def check_lora_options(args: Any) -> None:
    """ConfigError (naming the option) for LoRA options wrong whatever the model."""
    for ok, name, what in (
            (args.max_loras >= 1, "max_loras", "must be at least 1"),
            (args.max_lora_rank >= 1, "max_lora_rank", "must be at least 1"),
            (args.max_cpu_loras is None or args.max_cpu_loras >= args.max_loras,
             "max_cpu_loras", f"must be at least max_loras ({args.max_loras})"),
            (args.lora_modules is None or (isinstance(args.lora_modules, (list, tuple))
                                           and all(isinstance(m, str)
                                                   for m in args.lora_modules)),
             "lora_modules", "must be a list of name=path"),
            (not args.lora_modules or args.enable_lora, "lora_modules", "needs enable_lora")):
        if not ok:
            raise ConfigError(f"{name} {what}, got {getattr(args, name)!r}")


def lora_config(args: Any) -> LoRAConfig | None:
    """--enable-lora's options resolved (None: off); each --lora-modules adapter's
    config read and checked now (its weights are checked against the model when the
    engine loads it). ConfigError naming the option."""
    if not args.enable_lora:
        return None
    if args.quantization is not None:
        raise ConfigError(f"enable_lora cannot be used with quantization {args.quantization} "
                          f"(its smoothing rescales the linears' inputs)")
    modules: dict[str, str] = {}
    for spec in args.lora_modules or ():
        try:
            name, path = parse_lora_module(spec)
            read_adapter_config(path, args.max_lora_rank)
        except ValueError as e:
            raise ConfigError(f"lora_modules: {e}") from None
        if name in modules:
            raise ConfigError(f"lora_modules: the name {name!r} is given twice")
        modules[name] = path
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras or args.max_loras,
                      modules=tuple(modules.items()))
