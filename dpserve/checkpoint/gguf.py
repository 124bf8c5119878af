"""GGUF files -> Hugging Face-layout directories (config.json, safetensors, tokenizer).

The model code only ever reads Hugging Face directories, so a GGUF file is
converted once: its metadata becomes config.json, every tensor is dequantised
to float32 under its Hugging Face name, and the tokenizer with its chat
template is rebuilt from the metadata by transformers' GGUF tokenizer
conversion.

Scope: decoder models of the `llama` (Llama, Mistral, SmolLM: llama.cpp
writes them all as `llama`; with `llama.expert_count` it is Mixtral) and
`qwen2` families, and the mixture-of-experts architectures `qwen2moe` (with
its gated shared expert), `qwen3moe` and `olmoe`. Expert stacks
(`ffn_{gate,up,down}_exps`, [E, ...]) are split into Hugging Face's one
tensor per expert; old Mixtral files with one tensor per expert
(`ffn_gate.N`) are read too. Dequantisation is our own,
vectorised over blocks (numpy), for F32, F16, BF16, Q8_0, Q4_0 and Q4_1; other
types go through `gguf.quants.dequantize` when that knows them. Not done here:
keeping weights quantised, multi-modal GGUFs, split (multi-file) GGUFs.

Layout facts used below (ggml): a tensor's dims are listed fastest first
(ne0 = columns), the reverse of torch; quantised rows are runs of 32-element
blocks; llama.cpp stores the rows of Q and K of `llama` models permuted for
its rotary layout, undone here by `unpermute_qk`.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from dpserve.errors import ConfigError

logger = logging.getLogger(__name__)

# GGML type ids (gguf.GGMLQuantizationType) of the types dequantised here.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
# type id -> (elements per block, bytes per block)
_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18),
           Q4_1: (32, 20)}

# general.architecture -> (HF architecture, HF model_type, Q/K rows permuted by llama.cpp)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),  # llama.cpp writes Mistral models as llama
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "olmoe": ("OlmoeForCausalLM", "olmoe", False),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral", True)  # `llama` with experts
# MoE model_type -> (routing renormalised when the file has no expert_weights_norm,
#                    block prefix, expert weight names for gate, up, down)
_MOE: dict[str, tuple[bool, str, tuple[str, str, str]]] = {
    "mixtral": (True, "block_sparse_moe.", ("w1", "w3", "w2")),
    "qwen2_moe": (False, "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": (True, "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": (False, "mlp.", ("gate_proj", "up_proj", "down_proj")),
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_PARTS = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2,  # old Mixtral: blk.N.ffn_gate.E
                 "ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_SHARD_BYTES = 2 << 30  # float32 bytes per output safetensors file


# ---------------------------------------------------------------- dequantisation


def dequantize(raw: np.ndarray | torch.Tensor, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Raw GGUF tensor bytes -> float32 tensor of `shape` (torch order: last dim = ne0).

    `raw` is the tensor's bytes (numpy or CPU torch, any shape; read-only is fine).
    Runs in numpy, single-threaded: torch's thread pool slows these small ops
    down many times over when other processes share the cores.
    """
    qtype = int(qtype)
    data = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    numel = math.prod(shape)
    if qtype not in _BLOCKS:
        return _dequantize_fallback(data, qtype, shape)
    block, block_bytes = _BLOCKS[qtype]
    if numel % block or data.size != numel // block * block_bytes:
        raise ValueError(f"{_type_name(qtype)} tensor of shape {list(shape)} needs "
                         f"{numel // block * block_bytes} bytes, got {data.size}")
    if qtype == F32:
        out = data.view(np.float32).copy()
    elif qtype == F16:
        out = data.view(np.float16).astype(np.float32)
    elif qtype == BF16:  # bfloat16 = the high half of a float32
        out = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        blocks = data.reshape(-1, block_bytes)  # [n_blocks, block_bytes]
        out = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1}[qtype](blocks)  # [n_blocks, 32]
    return torch.from_numpy(out).reshape(tuple(shape))


def _half(cols: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 little-endian float16 -> [n, 1] float32."""
    return np.ascontiguousarray(cols).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] float32 values 0..15: low nibbles are elements 0..15."""
    out = np.empty((qs.shape[0], 32), np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, then 32 int8 q; value = q * d
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8) * _half(blocks[:, :2])


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, then 16 bytes of nibbles; value = (q - 8) * d
    out = _nibbles(blocks[:, 2:])
    out -= 8.0
    out *= _half(blocks[:, :2])
    return out


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, f16 minimum m, then 16 bytes of nibbles; value = q * d + m
    out = _nibbles(blocks[:, 4:])
    out *= _half(blocks[:, :2])
    out += _half(blocks[:, 2:4])
    return out


def _dequantize_fallback(data: np.ndarray, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Types we do not dequantise ourselves: ask gguf-py, or say clearly that we cannot."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        gtype = GGMLQuantizationType(qtype)
        block, block_bytes = GGML_QUANT_SIZES[gtype]
        rows = data.reshape(-1, shape[-1] // block * block_bytes)
        values = gguf_dequantize(rows, gtype)
    except (ImportError, NotImplementedError, ValueError, KeyError) as e:
        raise ConfigError(f"GGUF tensor type {_type_name(qtype)} is not supported "
                          f"(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1): {e}") from None
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(tuple(shape))


def _type_name(qtype: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return f"type {qtype}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Q or K weight/bias (rows = n_head * head_dim).

    llama.cpp stores, per head, rows [pair j, half i] where Hugging Face has
    [half i, pair j]; swapping the two axes back restores HF's order.
    """
    head_dim = w.shape[0] // n_head
    rows = w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])  # [head, pair, half, ...]
    return rows.transpose(1, 2).reshape(w.shape).contiguous()


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """GGUF tensor name -> Hugging Face name ("blk.3.attn_q.weight" -> "model.layers.3...").

    An expert stack (`ffn_gate_exps`) gives a name with `{e}` where the expert's
    number goes; `model_type` picks the MoE names (Mixtral's `block_sparse_moe.`).
    """
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    moe = _MOE.get(model_type)
    if len(parts) >= 3 and parts[0] == "blk" and moe is not None:
        layer, what = parts[1], parts[2]
        _, prefix, names = moe
        if what == "ffn_gate_inp" and len(parts) == 3:
            return f"model.layers.{layer}.{prefix}gate.{suffix}"
        expert = "{e}" if what.endswith("_exps") and len(parts) == 3 else (
            parts[3] if len(parts) == 4 and parts[3].isdigit() else None)
        if what in _EXPERT_PARTS and expert is not None:
            return (f"model.layers.{layer}.{prefix}experts.{expert}."
                    f"{names[_EXPERT_PARTS[what]]}.{suffix}")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent here")


# ---------------------------------------------------------------- metadata -> config


class GGUFMetadata:
    """Typed access to a GGUFReader's key/value fields."""

    def __init__(self, reader: Any):
        self.reader = reader
        self.arch = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> int:
        """An integer `<arch>.<key>` that the config cannot do without."""
        value = self.arch_get(key)
        if value is None:
            raise ConfigError(f"GGUF file lacks the metadata key {self.arch}.{key}")
        return int(value)

    def token(self, token_id: int) -> str:
        field = self.reader.fields["tokenizer.ggml.tokens"]
        return bytes(field.parts[field.data[token_id]]).decode("utf-8", errors="replace")


def _f32(value: float) -> float:
    """A float32 read from GGUF as its shortest decimal (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def build_config(meta: GGUFMetadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json contents for a GGUF file; `tensors` maps GGUF name -> reader tensor."""
    hf_arch, model_type, _ = architecture(meta)
    if "token_embd.weight" not in tensors:
        raise ConfigError("GGUF file has no token_embd.weight tensor")
    hidden = meta.require("embedding_length")
    heads = meta.require("attention.head_count")
    kv_heads = meta.arch_get("attention.head_count_kv", heads)
    kv_heads = max(kv_heads) if isinstance(kv_heads, list) else int(kv_heads)
    rope_theta = _f32(meta.arch_get("rope.freq_base", 10000.0))
    vocab = int(tensors["token_embd.weight"].shape[-1])  # ne1 of [hidden, vocab]
    config: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_get("feed_forward_length")
                                 or meta.require("expert_feed_forward_length")),
        "num_hidden_layers": meta.require("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": int(meta.arch_get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(meta.arch_get("context_length", 2048)),
        "vocab_size": vocab, "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors, "mlp_bias": False,
        "torch_dtype": "float32", "dtype": "float32",
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    rope_scaling = _rope_scaling(meta, tensors, rope_theta, config["head_dim"])
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta,
                                 **(rope_scaling or {})}
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if model_type in ("qwen2", "qwen2_moe", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None)
    if model_type in _MOE:
        config.update(_moe_config(meta, model_type, config["intermediate_size"]))
    return config


def architecture(meta: GGUFMetadata) -> tuple[str, str, bool]:
    """(HF architecture, HF model_type, Q/K permuted) of a GGUF file; ConfigError."""
    if meta.arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {meta.arch!r} is not supported; supported: "
                          + ", ".join(sorted(ARCHITECTURES)))
    if meta.arch == "llama" and int(meta.arch_get("expert_count") or 0) > 0:
        return _MIXTRAL
    return ARCHITECTURES[meta.arch]


def _moe_config(meta: GGUFMetadata, model_type: str, intermediate: int) -> dict[str, Any]:
    """The MoE keys of config.json, as transformers' config classes name them."""
    experts = meta.require("expert_count")
    norm = meta.arch_get("expert_weights_norm")
    out: dict[str, Any] = {"num_experts_per_tok": meta.require("expert_used_count"),
                           "norm_topk_prob": _MOE[model_type][0] if norm is None else bool(norm)}
    if model_type == "mixtral":
        return {**out, "num_local_experts": experts, "sliding_window": None}
    out.update(num_experts=experts, moe_intermediate_size=int(
        meta.arch_get("expert_feed_forward_length") or intermediate))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        out.update(decoder_sparse_step=1, mlp_only_layers=[])
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = meta.require(
            "expert_shared_feed_forward_length")
    if model_type == "olmoe":
        clamp = meta.arch_get("attention.clamp_kqv")
        out["clip_qkv"] = _f32(clamp) if clamp else None
    return out


def _rope_scaling(meta: GGUFMetadata, tensors: dict[str, Any], theta: float,
                  head_dim: int) -> dict[str, Any] | None:
    """HF rope_scaling from GGUF's rope.scaling.* keys or a Llama 3 rope_freqs tensor."""
    kind = meta.arch_get("rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": kind,
                                   "factor": _f32(meta.arch_get("rope.scaling.factor", 1.0))}
        original = meta.arch_get("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none"):
        logger.warning("GGUF rope scaling type %r is not converted; ignored", kind)
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        freqs = dequantize(np.asarray(t.data).view(np.uint8), t.tensor_type, [int(t.n_elements)])
        return llama3_rope_scaling(freqs, theta, head_dim)
    return None


def llama3_rope_scaling(freqs: torch.Tensor, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover Llama 3 rope_scaling from llama.cpp's per-dimension divisors (rope_freqs).

    The divisors come from (factor, low_freq_factor, high_freq_factor, original
    context); we try Llama 3's usual low/high/original values with
    factor = max divisor, and keep the result only if it reproduces `freqs`.
    """
    factor = float(freqs.max())
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    for low, high, original in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 131072)):
        smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
        divisor = 1.0 / ((1 - smooth) / factor + smooth)
        if divisor.shape == freqs.shape and torch.allclose(divisor, freqs.double(), atol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    logger.warning("GGUF rope_freqs tensor does not match Llama 3 rope scaling; ignored "
                   "(positions beyond the original context may be off)")
    return None


# ---------------------------------------------------------------- conversion


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face directory for `gguf_path` into `out_dir` (created if needed).

    Writes config.json, model.safetensors (float32; sharded with an index past
    2 GiB) and the tokenizer files with the chat template.
    """
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        reader = GGUFReader(gguf_path, "r")
    except (ValueError, OSError) as e:
        raise ConfigError(f"model: cannot read GGUF file {gguf_path}: {e}") from None
    meta = GGUFMetadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = build_config(meta, tensors)
    _write_weights(_hf_tensors(reader, config, architecture(meta)[2]), out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(gguf_path, meta, out_dir, config["max_position_embeddings"])


def _hf_tensors(reader: Any, config: dict[str, Any],
                permuted_qk: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every GGUF tensor, Q/K rows restored, expert
    stacks split one tensor per expert."""
    for t in tqdm(reader.tensors, desc="Dequantising", unit="tensor"):
        if t.name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        name = hf_tensor_name(t.name, config["model_type"])
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists ne0 first
        raw = reader.data[t.data_offset:t.data_offset + t.n_bytes]
        w = dequantize(raw, t.tensor_type, shape)
        if "{e}" in name:
            for e, expert in enumerate(w.unbind(0)):
                yield name.format(e=e), expert.clone()
            continue
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp stores this [1, H] gate as a vector
        if permuted_qk and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif permuted_qk and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        yield name, w


def _write_weights(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path) -> None:
    """Save tensors as model.safetensors, or as shards + index once past _SHARD_BYTES."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        save_file(pending, str(out_dir / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending, size = {}, 0

    for name, w in tensors:
        if pending and size + w.numel() * 4 > _SHARD_BYTES:
            flush()
        pending[name] = w
        size += w.numel() * 4
    flush()
    if len(shards) == 1:
        (out_dir / "shard-00000.tmp").rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / f"shard-{i:05d}.tmp").rename(out_dir / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# Architectures whose GGUF files transformers refuses to read (its tokenizer conversion
# included), though their tokenizer is an ordinary one: read as this stand-in instead.
_TOKENIZER_STAND_IN = {"olmoe": "llama"}


def _tokenizer_only_gguf(meta: GGUFMetadata, out: Path) -> Path:
    """A GGUF file with the tokenizer.* metadata of `meta` and no tensors, under the
    stand-in architecture (`_TOKENIZER_STAND_IN`); the tokenizer does not depend on it."""
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(out), _TOKENIZER_STAND_IN[meta.arch])
    for key, field in meta.reader.fields.items():
        if key.startswith("tokenizer."):
            sub = GGUFValueType(field.types[1]) if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), GGUFValueType(field.types[0]), sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_tokenizer(gguf_path: Path, meta: GGUFMetadata, out_dir: Path,
                     max_len: int) -> None:
    """Rebuild the tokenizer from GGUF metadata (transformers' converter) and save it."""
    from transformers import AutoTokenizer

    try:
        if meta.arch in _TOKENIZER_STAND_IN:
            with tempfile.TemporaryDirectory(prefix="dpserve-gguf-tok-") as tmp:
                only = _tokenizer_only_gguf(meta, Path(tmp) / "tokenizer.gguf")
                tokenizer = AutoTokenizer.from_pretrained(only.parent, gguf_file=only.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:  # the converter raises many types for unknown vocabularies
        raise ConfigError(f"model: cannot build a tokenizer from {gguf_path.name}: {e}") from e
    template = meta.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and getattr(tokenizer, attr) is None:
            setattr(tokenizer, attr, meta.token(int(token_id)))
    tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(out_dir)
