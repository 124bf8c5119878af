"""Mixture-of-experts GGUF files: Mixtral (`llama` with experts), Qwen2-MoE (shared
expert), Qwen3-MoE and OLMoE.

Tiny random checkpoints are built with transformers, written out as GGUF the
way llama.cpp's converter writes them (experts stacked into
`ffn_{gate,up,down}_exps`, the router as `ffn_gate_inp`, Qwen2-MoE's shared
expert as `*_shexp` with a vector gate, Mixtral's Q/K rows permuted, F32 and
F16 tensors), converted back by dpserve and served: greedy tokens must equal
transformers' on the original checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import finish_gguf, gguf_writer
from safetensors.torch import load_file

from dpserve import LLM, SamplingParams
from dpserve.checkpoint import gguf as dg
from dpserve.config import ConfigError
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow  # one model per architecture, compared with transformers

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "olmoe": "olmoe"}
_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
           "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [11, 12, 13], list(range(100, 140))]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of `llama` models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def gguf_tensors(hf_dir: Path, cfg: dict) -> dict[str, np.ndarray]:
    """llama.cpp's tensors for an HF MoE checkpoint: experts stacked, names mapped."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        a, (stem, suffix) = t.numpy(), name.rsplit(".", 1)
        if cfg["model_type"] == "mixtral" and stem.endswith(("q_proj", "k_proj")):
            a = _permute(a, cfg["num_attention_heads" if "q_proj" in stem
                             else "num_key_value_heads"])
        if stem in _NAMES:
            out[f"{_NAMES[stem]}.{suffix}"] = a
            continue
        _, _, layer, rest = stem.split(".", 3)  # model.layers.N.rest
        if ".experts." in rest:
            _, e, part = rest.rsplit(".", 2)
            experts.setdefault(f"blk.{layer}.{_EXPERT[part]}.{suffix}", {})[int(e)] = a
            continue
        if rest == "mlp.shared_expert_gate":
            a = a.reshape(-1)  # llama.cpp: a vector of n_embd
        out[f"blk.{layer}.{_NAMES[rest]}.{suffix}"] = a
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])  # [E, rows, cols]
    return out


def write_moe_gguf(hf_dir: Path, out: Path, f16_experts: bool = False) -> Path:
    """A llama.cpp-style GGUF of a tiny HF MoE checkpoint (F32; F16 expert stacks if
    asked)."""
    kind = json.loads((hf_dir / "config.json").read_text())["model_type"]
    w, cfg = gguf_writer(hf_dir, out, GGUF_ARCH[kind])
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    for name, a in gguf_tensors(hf_dir, cfg).items():
        if f16_experts and "_exps." in name:
            a = a.astype(np.float16)
        w.add_tensor(name, np.ascontiguousarray(a))
    finish_gguf(w)
    return out


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int = 10,
              f16_experts: bool = False) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if f16_experts:  # what an F16 file holds: experts rounded to float16
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".experts." in name:
                    p.copy_(p.half().float())
    eos = model.config.eos_token_id
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False)[0, len(prompt):].tolist()
        out.append(ids[:ids.index(eos) + 1] if eos in ids else ids)
    return out


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_moe_gguf_serves_like_transformers(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "cache"))
    hf_dir = make_tiny_model(tmp_path / "hf", arch)
    f16 = arch in ("mixtral", "qwen2_moe")  # F16 expert stacks for two of them
    gguf_file = write_moe_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", f16_experts=f16)
    expected = hf_greedy(hf_dir, PROMPTS, f16_experts=f16)
    assert len({tuple(e) for e in expected}) > 1, "degenerate model: every output equal"
    llm = LLM(str(gguf_file), max_model_len=256)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        info = llm.engine.call_utility("expert_info")  # one engine, in this process
        assert info["num_experts"] == 8 and info["experts"] == [0, 8]
    finally:
        llm.shutdown()
    converted = next((tmp_path / "cache").glob(f"tiny-{arch}-*"))
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == arch and config["num_experts_per_tok"] == 2
    before = load_file(hf_dir / "model.safetensors")
    after = load_file(converted / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name in before:  # F32 tensors come back bit for bit
        if not (f16 and ".experts." in name):
            assert torch.equal(before[name], after[name]), name


def test_moe_tensor_names():
    assert dg.hf_tensor_name("blk.2.ffn_gate_exps.weight", "mixtral") == \
        "model.layers.2.block_sparse_moe.experts.{e}.w1.weight"
    assert dg.hf_tensor_name("blk.2.ffn_down.5.weight", "mixtral") == \
        "model.layers.2.block_sparse_moe.experts.5.w2.weight"  # old per-expert Mixtral files
    assert dg.hf_tensor_name("blk.0.ffn_up_exps.weight", "qwen3_moe") == \
        "model.layers.0.mlp.experts.{e}.up_proj.weight"
    assert dg.hf_tensor_name("blk.1.ffn_gate_inp.weight", "olmoe") == \
        "model.layers.1.mlp.gate.weight"
    assert dg.hf_tensor_name("blk.1.ffn_gate_inp_shexp.weight", "qwen2_moe") == \
        "model.layers.1.mlp.shared_expert_gate.weight"
    with pytest.raises(ConfigError, match="ffn_gate_exps"):
        dg.hf_tensor_name("blk.0.ffn_gate_exps.weight")  # a dense llama has no experts
