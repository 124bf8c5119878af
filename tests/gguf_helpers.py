"""Writing tiny GGUF files the way llama.cpp's converter does, for the GGUF loader's
tests (test_gguf, test_gguf_moe)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def gguf_writer(hf_dir: Path, out: Path, arch: str) -> tuple[Any, dict]:
    """A `gguf.GGUFWriter` for `out` holding what llama.cpp's converter writes of the
    tiny HF checkpoint `hf_dir` besides its tensors and any MoE fields: the dense
    hyperparameters and the GPT-2 style tokenizer. Returns (writer, config.json);
    the caller adds the rest, then `finish_gguf`."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    return w, cfg


def finish_gguf(writer: Any) -> None:
    """Write the header, the key-value data and the tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
