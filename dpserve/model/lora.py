"""LoRA adapters on the model's linears: read, shard, keep in slots, apply per row.

Scope, on one worker (every tensor-parallel worker does the same with its shard):

* `lora_layout(model)`: which PEFT module names this model serves and where each
  lands: q / k / v into the merged QKV's row ranges, o, gate / up into the merged
  gate | up rows, down (Llama family, Qwen2, Qwen3's dense layers). Under tensor
  parallelism a worker holds what its base linear holds: column-parallel (q, k,
  v, gate, up) the rows of B for its output slice, row-parallel (o, down) the
  columns of A for its input slice, B whole: its delta is a partial sum, added
  before the linear's all-reduce like the base partial sums.
* `load_adapter(path, ...)`: a PEFT directory (adapter_config.json +
  adapter_model.safetensors) checked against the layout (ValueError, one line:
  rank over `--max-lora-rank`, a module the model lacks or cannot adapt, e.g.
  MoE experts, a shape that does not match) -> this worker's `Adapter` pieces,
  the scaling folded into B.
* `LoRASlots`: `max_loras` slots of stacked weights per adapted linear,
  A [slots, n * r_max, in] and B [slots, out, n * r_max] (n: the sub-linears
  merged into it, 3 for QKV, 2 for gate | up; zero-padded to `--max-lora-rank`),
  and the step's row groups. `LoRAHook.add` is what LlamaAttention / LlamaMLP
  call after a linear: for each slot in the step, the rows using it get
  out[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T, one pair of matmuls per active
  adapter (grouped by slot, like `moe.fused_experts` groups rows by expert),
  torch only; nothing at all when no row of the step has an adapter.
* `WorkerLoRA`: what the `ModelRunner` holds: the host copies (lora id -> this
  worker's `Adapter`) and the slots, filled as each step's `LoRAPlan` says.

Not here: which adapters are registered, resident or pinned (the engine's
`dpserve.engine.lora_manager`); the adapter config's checks (`dpserve.checkpoint.lora_config`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dpserve.checkpoint.lora_config import WEIGHTS_FILE, read_adapter_config

# PEFT module name (last part) -> (dpserve linear, sub-linear index in it)
_MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
            "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
            "down_proj": ("down", 0)}
LINEARS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}  # linear -> sub-linears merged in it
_MLP = re.compile(r"^(model\.layers\.\d+\.mlp)\.")
_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")


class Place(NamedTuple):
    """Where one PEFT module's LoRA goes on this worker.

    in_full / out_full: the whole (unsharded) linear's sizes the adapter must match;
    a_cols: the slice (first, count) of A's columns held here (row-parallel), None:
    all; b_rows: the slice of B's rows held here (column-parallel), None: all;
    dest: the first output row of this sub-linear in the merged linear here."""

    layer: int
    linear: str
    sub: int
    in_full: int
    out_full: int
    a_cols: tuple[int, int] | None
    b_rows: tuple[int, int] | None
    dest: int


def lora_layout(model: Any) -> dict[str, Place | str]:
    """PEFT module name (e.g. "model.layers.0.self_attn.q_proj") -> its `Place`, or
    the reason it cannot be adapted (a str: MoE blocks)."""
    d = model.dims
    hd = d.head_dim
    layout: dict[str, Place | str] = {}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        attn = layer.attn
        q_rows, kv_rows = attn.heads * hd, attn.kv_heads * hd
        for name, sub, first, rows, full, dest in (
                ("q_proj", 0, attn.first_head * hd, q_rows, d.heads * hd, 0),
                ("k_proj", 1, attn.first_kv_head * hd, kv_rows, d.kv_heads * hd, q_rows),
                ("v_proj", 2, attn.first_kv_head * hd, kv_rows, d.kv_heads * hd,
                 q_rows + kv_rows)):
            layout[pre + "self_attn." + name] = Place(i, "qkv", sub, d.hidden, full, None,
                                                      (first, rows), dest)
        layout[pre + "self_attn.o_proj"] = Place(i, "o", 0, d.heads * hd, d.hidden,
                                                 (attn.first_head * hd, q_rows), None, 0)
        mlp = layer.mlp
        if not hasattr(mlp, "lora"):  # not a SwiGLU MLP (llama.LlamaMLP) but MoE
            layout[pre + "mlp"] = "a mixture-of-experts block"  # whatever is inside it
            continue
        inter = mlp.inter
        for name, sub in (("gate_proj", 0), ("up_proj", 1)):
            layout[pre + "mlp." + name] = Place(i, "gate_up", sub, d.hidden, d.intermediate,
                                                None, (mlp.first, inter), sub * inter)
        layout[pre + "mlp.down_proj"] = Place(i, "down", 0, d.intermediate, d.hidden,
                                              (mlp.first, inter), None, 0)
    return layout


@dataclass
class Adapter:
    """One adapter's weights for this worker: (place, A [r, in here], B [out here, r]
    with the scaling folded in), in the model's dtype, on the host."""

    rank: int
    pieces: list[tuple[Place, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for _, a, b in self.pieces)


def load_adapter(path: str, layout: dict[str, Place | str], max_rank: int,
                 dtype: torch.dtype) -> Adapter:
    """Read and check the PEFT adapter in `path` against `layout` (see the module
    docstring); ValueError (one line) naming the problem."""
    from safetensors import safe_open

    config = read_adapter_config(path, max_rank)
    if isinstance(config.target_modules, tuple):  # names PEFT matches as suffixes
        for target in config.target_modules:
            if target.rsplit(".", 1)[-1] not in _MODULES:
                raise ValueError(f"{path}: target module {target!r} is not in the model "
                                 f"(LoRA serves {', '.join(_MODULES)} of its decoder layers)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _NAME.match(key)
                if m is None:
                    raise ValueError(f"{path}: tensor {key!r} is not a LoRA A or B weight "
                                     f"this model can serve")
                pairs.setdefault(m.group(1), {})[m.group(2)] = f.get_tensor(key)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own error type, OSError, ...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}/{WEIGHTS_FILE} cannot be read: {first}") from None
    if not pairs:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    adapter = Adapter(rank=config.rank)
    for module in sorted(pairs):
        place = layout.get(module)
        if place is None and (block := _MLP.match(module)):
            place = layout.get(block.group(1))  # inside an MoE block: why not
        if place is None:
            raise ValueError(f"{path}: target module {module!r} is not in the model (LoRA "
                             f"serves {', '.join(_MODULES)} of its decoder layers)")
        if isinstance(place, str):
            raise ValueError(f"{path}: target module {module!r} is in {place}: LoRA on "
                             f"mixture-of-experts layers is not supported")
        ab = pairs[module]
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: target module {module!r} lacks lora_"
                             f"{'B' if 'A' in ab else 'A'}")
        adapter.pieces.append(_shard(path, module, place, ab["A"], ab["B"], config.scaling,
                                     max_rank, dtype))
    return adapter


def _shard(path: str, module: str, place: Place, a: torch.Tensor, b: torch.Tensor,
           scaling: float, max_rank: int, dtype: torch.dtype
           ) -> tuple[Place, torch.Tensor, torch.Tensor]:
    """Check one module's A [r, in] and B [out, r] against the base linear, and keep
    this worker's slice (scaling folded into B)."""
    r = a.shape[0] if a.dim() == 2 else -1
    if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != place.in_full
            or b.shape != (place.out_full, r)):
        raise ValueError(f"{path}: {module} has lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)}, which do not match the base model's linear "
                         f"({place.out_full} x {place.in_full})")
    if r > max_rank:
        raise ValueError(f"{path}: {module} has LoRA rank {r}, over max_lora_rank {max_rank}")
    if place.a_cols is not None:
        a = a.narrow(1, *place.a_cols)
    if place.b_rows is not None:
        b = b.narrow(0, *place.b_rows)
    return (place, a.to(dtype).contiguous(),
            (b.to(torch.float32) * scaling).to(dtype).contiguous())


class LoRASlots:
    """The resident adapters' stacked weights on this worker, and the step's rows.

    `a[(layer, linear)]`: [slots, n * max_rank, in here]; `b[(layer, linear)]`:
    [slots, out here, n * max_rank]; sub-linear j of a merged linear uses A rows
    and B columns [j * max_rank, j * max_rank + r). `groups`: this step's
    (slot, rows) pairs, rows a slice or an index tensor into the step's tokens;
    None when no row of the step has an adapter."""

    def __init__(self, model: Any, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_rank = max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.groups: list[tuple[int, slice | torch.Tensor]] | None = None
        self.device = device
        for place in lora_layout(model).values():
            if isinstance(place, str) or (place.layer, place.linear) in self.a:
                continue
            key, width = (place.layer, place.linear), LINEARS[place.linear] * max_rank
            in_here = place.in_full if place.a_cols is None else place.a_cols[1]
            out_here = _linear_out(model.layers[place.layer], place.linear)
            self.a[key] = torch.zeros(max_loras, width, in_here, dtype=dtype, device=device)
            self.b[key] = torch.zeros(max_loras, out_here, width, dtype=dtype, device=device)
        for i, layer in enumerate(model.layers):  # the hooks the linears call
            layer.attn.lora = LoRAHook(self, i)
            if hasattr(layer.mlp, "lora"):
                layer.mlp.lora = LoRAHook(self, i)

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` into `slot` (what was there is overwritten)."""
        for a in self.a.values():
            a[slot].zero_()
        for b in self.b.values():
            b[slot].zero_()
        for place, a, b in adapter.pieces:
            key, col = (place.layer, place.linear), place.sub * self.max_rank
            rr = a.shape[0]
            self.a[key][slot, col:col + rr].copy_(a)
            self.b[key][slot, place.dest:place.dest + b.shape[0], col:col + rr].copy_(b)

    def begin_step(self, token_slots: np.ndarray | None) -> None:
        """The step's slot per token ([T], -1: no adapter) -> `groups`."""
        if token_slots is None or not (token_slots >= 0).any():
            self.groups = None
            return
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in np.unique(token_slots[token_slots >= 0]):
            rows = np.flatnonzero(token_slots == slot)
            if rows[-1] - rows[0] + 1 == len(rows):  # one run of tokens: a view
                groups.append((int(slot), slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                groups.append((int(slot), torch.from_numpy(rows).to(self.device)))
        self.groups = groups


def _linear_out(layer: Any, linear: str) -> int:
    """Output rows of `linear` on this worker (its base weight may be pre-packed)."""
    attn, mlp = layer.attn, layer.mlp
    if linear == "qkv":
        return (attn.heads + 2 * attn.kv_heads) * attn.head_dim
    if linear == "gate_up":
        return 2 * mlp.inter
    return attn.hidden if linear == "o" else mlp.hidden


class LoRAHook:
    """What one decoder layer's linears call: `add(linear, x, out)` adds the LoRA
    delta of this step's adapters to `out` in place (a no-op when none)."""

    def __init__(self, slots: LoRASlots, layer: int) -> None:
        self.slots, self.layer = slots, layer

    def add(self, linear: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """x [T, in here], out [T, out here] (the base linear's output)."""
        groups = self.slots.groups
        if groups is None:
            return
        key = (self.layer, linear)
        a_all, b_all = self.slots.a[key], self.slots.b[key]
        for slot, rows in groups:
            a, b = a_all[slot], b_all[slot]  # [n*R, in], [out, n*R]
            if isinstance(rows, slice):
                out[rows] += (x[rows] @ a.T) @ b.T
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)


class WorkerLoRA:
    """One worker's adapters: host copies (lora id -> this worker's shard) and the
    device slots a step's adapters run from (`slots`: set by `attach`)."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, device
        self.adapters: dict[int, Adapter] = {}
        self.slots: LoRASlots | None = None

    def attach(self, model: Any) -> None:
        """Empty slots, their hooks on `model`'s linears (a model read again gets new ones)."""
        self.slots = LoRASlots(model, self.max_loras, self.max_rank, self.dtype, self.device)

    def load(self, model: Any, lora_id: int, path: str) -> str | None:
        """Read and check adapter `path`, keep this worker's shard on the host as
        `lora_id`. Returns the error (one line) instead of raising: a peer worker that
        raised would take the rank down."""
        try:
            self.adapters[lora_id] = load_adapter(path, lora_layout(model), self.max_rank,
                                                  self.dtype)
        except ValueError as e:
            return str(e)
        return None

    def drop(self, lora_id: int) -> None:
        """Forget adapter `lora_id`'s host copy. Its slot, if any, is left as is: the
        engine points no row at a removed adapter, and a slot still in use keeps its
        copy when only the host's is evicted."""
        self.adapters.pop(lora_id, None)

    def clear_slots(self) -> None:
        """Empty every slot (wake-up: the engine forgot which adapter each held)."""
        if self.slots is not None:
            for t in (*self.slots.a.values(), *self.slots.b.values()):
                t.zero_()

    def apply_plan(self, model: Any, loads: Sequence[tuple[int, int, str]],
                   host_drops: Sequence[int]) -> None:
        """A step's `LoRAPlan`: put its adapters into their slots (from the host copy,
        or read from their path again when it was evicted), then drop evicted host
        copies."""
        assert self.slots is not None
        for slot, lora_id, path in loads:
            adapter = self.adapters.get(lora_id)
            if adapter is None:  # checked when it was added; the files must still be there
                adapter = self.adapters[lora_id] = load_adapter(
                    path, lora_layout(model), self.max_rank, self.dtype)
            self.slots.load(slot, adapter)
        for lora_id in host_drops:
            self.adapters.pop(lora_id, None)

    def begin_step(self, token_slots: np.ndarray | None) -> None:
        """The step's slot per token ([T], -1: no adapter; None: no row has one)."""
        assert self.slots is not None
        self.slots.begin_step(token_slots)
