"""GGUF -> Hugging Face conversion: dequantisation, names, config, tokenizer, Q/K order.

Oracles: gguf-py's own (numpy) dequantisation, transformers' GGUF loader (which
undoes llama.cpp's Q/K permutation itself), and tiny random HF checkpoints
written out as GGUF files here and converted back.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_helpers import finish_gguf, gguf_writer
from safetensors.torch import load_file

from dpserve.checkpoint import gguf as dg
from dpserve.checkpoint.loader import default_gguf_path, resolve_model
from dpserve.config import ConfigError
from dpserve.testing.tiny_model import make_tiny_model

Q = gguf.GGMLQuantizationType
QUANTISED = [Q.Q8_0, Q.Q4_0, Q.Q4_1]


# ---------------------------------------------------------------- synthetic tensors


def _write_and_read(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> gguf.GGUFReader:
    """Write float32 arrays as GGUF tensors of the given types; return a reader of the file."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (values, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, gguf.quants.quantize(values, qtype))
        else:  # BF16 and block types arrive as raw bytes [rows, bytes per row]
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def _ours(reader: gguf.GGUFReader, t) -> torch.Tensor:
    raw = reader.data[t.data_offset:t.data_offset + t.n_bytes]
    return dg.dequantize(raw, t.tensor_type, [int(n) for n in reversed(t.shape)])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, *QUANTISED], ids=lambda q: q.name)
def test_dequantize_matches_gguf_py(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    values = {"a.weight": rng.normal(size=(4, 64)).astype(np.float32),
              "b.weight": rng.normal(scale=0.02, size=(2, 3, 96)).astype(np.float32)}
    reader = _write_and_read(tmp_path / "t.gguf", {k: (v, qtype) for k, v in values.items()})
    for t in reader.tensors:
        ours = _ours(reader, t)
        reference = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert t.tensor_type == qtype and ours.dtype == torch.float32
        assert tuple(ours.shape) == values[t.name].shape == tuple(reference.shape)
        diff = (ours - reference).abs().max().item()
        print(f"{qtype.name} {t.name}: max abs diff vs gguf-py {diff:.3g}")
        assert diff == 0.0
        if qtype == Q.F32:
            assert torch.equal(ours, torch.from_numpy(values[t.name]))
        else:  # quantisation error stays within what each type allows
            tol = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.02, Q.Q4_0: 0.3, Q.Q4_1: 0.3}[qtype]
            scale = np.abs(values[t.name]).max()
            assert (ours - torch.from_numpy(values[t.name])).abs().max() <= tol * scale


def _block(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate([p.view(np.uint8).reshape(-1) for p in parts])


def test_hand_built_blocks_exact():
    """Block layouts checked against values worked out by hand (nibble order included)."""
    i = np.arange(16, dtype=np.uint8)
    nibbles = (i | ((15 - i) << 4)).astype(np.uint8)  # low nibble i, high nibble 15 - i
    q = np.concatenate([i, 15 - i]).astype(np.float32)  # elements 0..15 then 16..31
    d, m = np.float16(0.5), np.float16(-1.25)
    q4_0 = dg.dequantize(_block(np.array([d]), nibbles), dg.Q4_0, [32])
    q4_1 = dg.dequantize(_block(np.array([d]), np.array([m]), nibbles), dg.Q4_1, [32])
    int8 = np.arange(-16, 16, dtype=np.int8)
    q8_0 = dg.dequantize(_block(np.array([d]), int8), dg.Q8_0, [1, 32])
    assert torch.equal(q4_0, torch.from_numpy((q - 8) * 0.5))
    assert torch.equal(q4_1, torch.from_numpy(q * 0.5 - 1.25))
    assert torch.equal(q8_0, torch.from_numpy(int8.astype(np.float32) * 0.5).reshape(1, 32))
    bf16 = np.array([0x3F80, 0xC040], dtype=np.uint16)  # 1.0, -3.0
    assert dg.dequantize(bf16.view(np.uint8), dg.BF16, [2]).tolist() == [1.0, -3.0]
    with pytest.raises(ValueError, match="needs 36 bytes"):
        dg.dequantize(np.zeros(35, np.uint8), dg.Q4_0, [64])


def test_other_types_fall_back_to_gguf_py_or_fail_clearly():
    values = np.random.default_rng(0).normal(size=(2, 32)).astype(np.float32)
    q5 = gguf.quants.quantize(values, Q.Q5_0)
    ours = dg.dequantize(q5, Q.Q5_0, [2, 32])
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(q5, Q.Q5_0)))
    with pytest.raises(ConfigError, match="Q8_K is not supported"):  # gguf-py cannot either
        dg.dequantize(np.zeros(292, np.uint8), Q.Q8_K, [256])


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    theta, head_dim, factor = 500000.0, 64, 32.0
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    smooth = ((8192 * inv / (2 * np.pi) - 1.0) / 3.0).clamp(0, 1)
    freqs = (1.0 / ((1 - smooth) / factor + smooth)).float()
    assert dg.llama3_rope_scaling(freqs, theta, head_dim) == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert dg.llama3_rope_scaling(freqs.flip(0), theta, head_dim) is None


def test_tensor_names():
    assert dg.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert dg.hf_tensor_name("output.weight") == "lm_head.weight"
    assert dg.hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert dg.hf_tensor_name("blk.0.ffn_norm.weight") == \
        "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ConfigError, match="blk.0.ffn_gate_exps.weight"):
        dg.hf_tensor_name("blk.0.ffn_gate_exps.weight")


# ---------------------------------------------------------------- tiny HF -> GGUF -> HF

_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _TO_GGUF:
        return f"{_TO_GGUF[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_TO_GGUF[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_gguf_from_hf(hf_dir: Path, out: Path, arch: str) -> Path:
    """A llama.cpp-style F32 GGUF of a tiny HF checkpoint (permuted Q/K for llama)."""
    w, cfg = gguf_writer(hf_dir, out, arch)
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())
                        .get("chat_template") or (hf_dir / "chat_template.jinja").read_text())
    for name, t in load_file(hf_dir / "model.safetensors").items():
        a = t.numpy()
        if arch == "llama" and ".q_proj." in name:
            a = _llama_cpp_permute(a, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            a = _llama_cpp_permute(a, cfg["num_key_value_heads"])
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    finish_gguf(w)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_round_trip(tmp_path, arch):
    """HF -> GGUF (as llama.cpp writes it) -> dpserve conversion gives back the same model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = make_tiny_model(tmp_path / "hf", arch)
    gguf_file = write_gguf_from_hf(hf_dir, tmp_path / "tiny.gguf", arch)
    dg.gguf_to_hf(gguf_file, tmp_path / "out")
    before, after = load_file(hf_dir / "model.safetensors"), load_file(
        tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [f"{'Llama' if arch == 'llama' else 'Qwen2'}ForCausalLM"]
    assert config["attention_bias"] is (arch == "qwen2")
    assert config["tie_word_embeddings"] is False
    ids = torch.tensor([[1, 5, 9, 33, 100, 7]])
    models = [AutoModelForCausalLM.from_pretrained(d).eval() for d in (hf_dir, tmp_path / "out")]
    with torch.no_grad():
        logits = [m(ids).logits for m in models]
    assert torch.equal(logits[0], logits[1])
    toks = [AutoTokenizer.from_pretrained(d) for d in (hf_dir, tmp_path / "out")]
    text = "Hello world, the quick brown fox! 123"
    assert toks[0](text).input_ids == toks[1](text).input_ids
    assert toks[1].eos_token == "<|im_end|>"
    assert "<|im_start|>user\nhi<|im_end|>" in toks[1].apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)


def test_large_models_are_sharded(tmp_path, monkeypatch):
    from dpserve.checkpoint.loader import iter_weights

    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    gguf_file = write_gguf_from_hf(hf_dir, tmp_path / "tiny.gguf", "llama")
    monkeypatch.setattr(dg, "_SHARD_BYTES", 100_000)
    dg.gguf_to_hf(gguf_file, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
    assert not list((tmp_path / "out").glob("*.tmp"))
    before = load_file(hf_dir / "model.safetensors")
    after = dict(iter_weights(tmp_path / "out", progress=False))
    assert sorted(after) == sorted(before) == sorted(index["weight_map"])
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_unsupported_architecture_is_a_config_error(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'bert' is not supported"):
        dg.gguf_to_hf(tmp_path / "x.gguf", tmp_path / "out")


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The default model converted through resolve_model(None) into a fresh cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DPSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return resolve_model(None)


@pytest.fixture(scope="module")
def ours(converted) -> dict[str, torch.Tensor]:
    return load_file(converted / "model.safetensors")


@pytest.fixture(scope="module")
def reference(default_hf_model) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading of the default file (gguf-py dequantisation)."""
    return {name: t for name, t in default_hf_model.state_dict().items()
            if name != "lm_head.weight"}  # tied to the embedding


@pytest.mark.slow  # the default model, converted
def test_default_model_matches_transformers(ours, reference):
    assert len(ours) == 272 and "lm_head.weight" not in ours  # tied: 30 layers * 9 + 2
    worst = 0.0
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        worst = max(worst, (tensor - reference[name]).abs().max().item())
    print(f"default model: max abs diff vs transformers' GGUF loader over {len(ours)} "
          f"tensors: {worst:.3g}")
    assert worst < 1e-5


@pytest.mark.slow  # the default model, converted
def test_qk_unpermuted_like_transformers(ours, reference):
    for layer in (0, 29):
        for proj, heads in (("q_proj", 9), ("k_proj", 3)):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(ours[name], reference[name]), name
            stored = torch.from_numpy(_llama_cpp_permute(ours[name].numpy(), heads))
            assert not torch.equal(stored, ours[name])  # the file's order really differs
            assert torch.equal(dg.unpermute_qk(stored, heads), ours[name])


@pytest.mark.slow  # the default model, converted
def test_default_model_config(converted):
    config = json.loads((converted / "config.json").read_text())
    expected = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, vocab_size=49152, bos_token_id=1,
                    eos_token_id=2, tie_word_embeddings=True, torch_dtype="float32")
    assert {k: config[k] for k in expected} == expected
    assert (converted / "dpserve-conversion.json").is_file()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _gguf_bpe(reader: gguf.GGUFReader, pieces: list[str]) -> list[int]:
    """Token ids of pre-split `pieces`, by byte-level BPE over the GGUF file's own
    tokenizer.ggml.tokens and .merges: an oracle that shares no code with the
    conversion (transformers' GGUF tokenizer converter)."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    alphabet = _bytes_to_unicode()
    out: list[int] = []
    for piece in pieces:
        word = [alphabet[b] for b in piece.encode()]
        while len(word) > 1:
            pairs = [(ranks.get(p, len(ranks)), i) for i, p in enumerate(zip(word, word[1:]))]
            rank, i = min(pairs)
            if rank == len(ranks):
                break
            word[i: i + 2] = [word[i] + word[i + 1]]
        out += [ids[w] for w in word]
    return out


@pytest.mark.slow  # the default model, converted
def test_default_model_tokenizer(converted):
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(default_gguf_path()))
    tok = AutoTokenizer.from_pretrained(converted)
    # Texts with a known pre-tokenisation (words with their leading space, punctuation,
    # non-ASCII bytes; no digits: this vocabulary splits them one by one).
    for pieces in (["Hello", " world", "!"],
                   ["Data", " parallel", " serving", " scales", " out", "."],
                   [" Zürich", ",", " naïve", " café"],
                   ["def", " tokenizer", "(", "text", "):"]):
        text = "".join(pieces)
        expected = _gguf_bpe(reader, pieces)
        assert tok.encode(text, add_special_tokens=False) == expected, text
        assert tok.decode(expected) == text
    # Special tokens: the ids the file names.
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos = int(reader.fields["tokenizer.ggml.bos_token_id"].contents())
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, eos)
    assert (tok.bos_token, tok.eos_token) == (tokens[bos], tokens[eos]) == (
        "<|im_start|>", "<|im_end|>")
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False) == [
        bos, *_gguf_bpe(reader, ["user", "\n", "hi"]), eos]
    assert tok.vocab_size == len(tokens)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
