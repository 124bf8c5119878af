"""Sharded state: each tensor-parallel worker's own weights, saved and loaded as they are.

vLLM's `save_sharded_state` / `--load-format sharded_state`: worker t of a rank
writes the tensors it holds (its slice of every split weight, the replicated ones
whole), keyed by the model's own parameter names, to
`model-rank-{rank}-part-{part}.safetensors` (the pattern may be changed), a new
part once a file would pass `max_size` bytes. Loading at the same
tensor_parallel_size then reads only the worker's own files, straight into its
parameters: no reading of the whole checkpoint, no slicing, no name mapping.

Scope: `save_shard` / `load_shard` (one worker, any `nn.Module`), the check of a
directory against the options (`check_load_format`: a one-line ConfigError naming
--load-format or --tensor-parallel-size), and `copy_model_files` (config, tokenizer,
generation config, chat template: the directory then serves as a model).

What is saved is the model as the checkpoint loads it, before the steps that
follow loading (int8 quantisation, oneDNN pre-packing: they run again after a
sharded load). A tensor that shares its storage with an earlier one (a tied LM
head) is saved once. Expert parallelism is not covered (a worker's experts
depend on the DP size): refused.

Not here: calling it on every worker (`ModelRunner.save_sharded_state`, the
engine utility `EngineCore.save_sharded_state`, `LLM.save_sharded_state`, `dpserve
save-sharded-state`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from dpserve.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"  # vLLM's
DEFAULT_MAX_SIZE = 5 << 30  # bytes per file at most (vLLM's default)
LOAD_FORMATS = ("auto", "sharded_state")
# Files of a model directory that are weights (not copied next to the shards).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")


def _files(path: Path, rank: int, pattern: str) -> list[Path]:
    """Worker `rank`'s files in `path`, in part order."""
    regex = re.compile(re.escape(pattern).replace(r"\{rank\}", str(rank))
                       .replace(r"\{part\}", r"(\d+)") + "$")
    found = [(int(m.group(1)), f) for f in path.iterdir() if (m := regex.match(f.name))]
    return [f for _, f in sorted(found)]


def shard_ranks(path: Path, pattern: str = DEFAULT_PATTERN) -> set[int]:
    """The worker ranks that have files in `path`."""
    regex = re.compile(re.escape(pattern).replace(r"\{rank\}", r"(\d+)")
                       .replace(r"\{part\}", r"\d+") + "$")
    return {int(m.group(1)) for f in Path(path).iterdir() if (m := regex.match(f.name))}


def check_load_format(path: str | Path, load_format: str, tensor_parallel_size: int,
                      expert_parallel: bool) -> None:
    """A ConfigError naming the option when `path`'s shards do not fit the options:
    sharded_state needs files for exactly workers 0..tensor_parallel_size-1; a
    directory of shards only needs --load-format sharded_state."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got "
                          f"{load_format!r}")
    ranks = shard_ranks(Path(path))
    if load_format == "auto":
        if ranks and not _plain_weights(Path(path)):
            raise ConfigError(f"load_format: {path} holds sharded state (one set of files "
                              f"per tensor-parallel worker); load it with --load-format "
                              f"sharded_state")
        return
    if expert_parallel:
        raise ConfigError("load_format sharded_state cannot be combined with "
                          "--enable-expert-parallel (a worker's experts depend on the DP size)")
    if not ranks:
        raise ConfigError(f"load_format sharded_state: no {DEFAULT_PATTERN} files in {path}")
    if ranks != set(range(tensor_parallel_size)):
        raise ConfigError(f"tensor_parallel_size {tensor_parallel_size} does not match the "
                          f"sharded state in {path}, saved at tensor_parallel_size "
                          f"{max(ranks) + 1} (--load-format sharded_state loads each "
                          f"worker's own files)")


def _plain_weights(path: Path) -> bool:
    ranks = re.compile(re.escape(DEFAULT_PATTERN).replace(r"\{rank\}", r"\d+")
                       .replace(r"\{part\}", r"\d+") + "$")
    return any(not ranks.match(f.name) for f in path.glob("*.safetensors"))


def save_shard(model: nn.Module, path: Path, rank: int, pattern: str | None = None,
               max_size: int | None = None) -> list[str]:
    """Write `model`'s tensors (this worker's) to `path`; the files written. Earlier
    files of this rank there are removed first."""
    from safetensors.torch import save_file

    pattern, max_size = pattern or DEFAULT_PATTERN, max_size or DEFAULT_MAX_SIZE
    if "{rank}" not in pattern or "{part}" not in pattern:
        raise ValueError(f"pattern must name {{rank}} and {{part}}, got {pattern!r}")
    path.mkdir(parents=True, exist_ok=True)
    for old in _files(path, rank, pattern):
        old.unlink()
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in _unique_tensors(model).items():
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and size + nbytes > max_size:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += nbytes
    written = []
    for part, tensors in enumerate(parts):
        target = path / pattern.format(rank=rank, part=part)
        save_file(tensors, str(target), metadata={"format": "pt"})
        written.append(str(target))
    return written


def _unique_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict on the host, each storage once (a tied weight under its first
    name), each tensor its own (safetensors refuses views of a larger storage)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensor = tensor.detach().cpu()
        whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        out[name] = tensor.contiguous() if whole else tensor.clone()
    return out


def load_shard(model: nn.Module, path: Path, rank: int, pattern: str | None = None) -> None:
    """Copy worker `rank`'s saved tensors into `model`; ValueError when a tensor is
    unknown to the model, has another shape, or one of the model's is missing."""
    from safetensors.torch import load_file

    files = _files(path, rank, pattern or DEFAULT_PATTERN)
    if not files:
        raise ValueError(f"no sharded state of worker {rank} in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(f"{files[0]}: tensor {unknown[0]!r} is not one of "
                         f"{type(model).__name__}'s")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{name!r}: saved shape {tuple(tensor.shape)}, the model's "
                             f"{tuple(own[name].shape)}")
    loaded = {own[n].untyped_storage().data_ptr() for n in state}
    missing = [n for n in own if n not in state
               and own[n].untyped_storage().data_ptr() not in loaded]
    if missing:
        raise ValueError(f"sharded state in {path} lacks {missing[0]!r} "
                         f"({len(missing)} tensor(s) missing)")
    model.load_state_dict(state, strict=False)


def copy_model_files(source: Path, target: Path) -> list[str]:
    """Copy `source`'s files that are not weights (config, tokenizer, generation
    config, chat template) into `target`; the names copied."""
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(Path(source).iterdir()):
        if not f.is_file() or f.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if (target / f.name).resolve() != f.resolve():
            shutil.copy2(f, target / f.name)
        copied.append(f.name)
    return copied
