"""Sharded state (vLLM's `save_sharded_state`, `--load-format sharded_state`): `dpserve
save-sharded-state` has each of a TP=2 model's workers write its own files, and an
`LLM` at TP=2 with `load_format="sharded_state"` reads them (the directory holds no
Hugging Face weights) and gives the original's greedy tokens; the LLM API saves too
(a tied-embedding model, from DP=1); a TP size that does not match the files, or a
shard directory without the option, is a one-line error naming the option."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors import safe_open
from token_checks import greedy

from dpserve import LLM
from dpserve.checkpoint.sharded_state import shard_ranks
from dpserve.config import ConfigError, EngineArgs
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.procs]

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [11, 12, 13], list(range(100, 140))]
ENGINE = dict(dtype="float32", max_model_len=128, enforce_eager=True)
PART_BYTES = 64 << 10  # small: every worker's weights take several parts


def _names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _tensor_shapes(files) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for f in files:
        with safe_open(str(f), "pt") as shard:
            shapes.update({k: tuple(shard.get_slice(k).get_shape()) for k in shard.keys()})
    return shapes


def test_save_at_tp2_then_load_each_workers_shard(tiny_llama, tmp_path):
    out = tmp_path / "sharded"
    done = subprocess.run(
        [sys.executable, "-m", "dpserve.cli", "save-sharded-state", str(tiny_llama),
         "--output", str(out), "--tensor-parallel-size", "2", "--dtype", "float32",
         "--max-model-len", "128", "--max-file-size", str(PART_BYTES)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--load-format sharded_state --tensor-parallel-size 2" in done.stdout
    names = _names(out)
    assert shard_ranks(out) == {0, 1}
    for rank in (0, 1):
        parts = [n for n in names if n.startswith(f"model-rank-{rank}-part-")]
        assert len(parts) > 1 and f"model-rank-{rank}-part-0.safetensors" in parts, names
        assert all((out / n).stat().st_size <= PART_BYTES + (16 << 10) for n in parts)
    # The config and tokenizer files came along; no Hugging Face weights did.
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert "model.safetensors" not in names
    # Each worker holds its own slice: half of the merged q/k/v rows, the norms whole.
    rank0 = _tensor_shapes(out.glob("model-rank-0-part-*.safetensors"))
    rank1 = _tensor_shapes(out.glob("model-rank-1-part-*.safetensors"))
    assert rank0 == rank1
    with LLM(str(tiny_llama), tensor_parallel_size=1, **ENGINE) as whole:
        expected = greedy(whole, PROMPTS)
        full = _tensor_shapes(whole.save_sharded_state(str(tmp_path / "whole")))  # TP=1
    assert set(full) == set(rank0)
    qkv, o = "layers.0.attn.qkv_weight", "layers.0.attn.o_weight"
    assert rank0[qkv] == (full[qkv][0] // 2, full[qkv][1])  # its heads' rows
    assert rank0[o] == (full[o][0], full[o][1] // 2)  # their columns
    assert rank0["embed"][0] * 2 == full["embed"][0]  # its vocabulary rows
    assert rank0["layers.0.input_norm.weight"] == full["layers.0.input_norm.weight"]

    with LLM(str(out), tensor_parallel_size=2, load_format="sharded_state", **ENGINE) as llm:
        assert len(llm.engine.executor.worker_info()) == 2
        assert greedy(llm, PROMPTS) == expected


def test_llm_api_saves_a_tied_model_and_it_loads(tmp_path):
    path = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    out = tmp_path / "tied-sharded"
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as llm:
        expected = greedy(llm, PROMPTS)
        files = llm.save_sharded_state(str(out))  # one part each at the default size
    assert sorted(f.rsplit("/", 1)[1] for f in files) == [
        "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    with LLM(str(out), tensor_parallel_size=2, load_format="sharded_state", **ENGINE) as llm:
        assert greedy(llm, PROMPTS) == expected


def test_mismatches_are_one_line_errors_naming_the_option(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "sharded"
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as llm:
        llm.save_sharded_state(str(out))
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size 1 does not match the "
                                          r"sharded state in .*, saved at "
                                          r"tensor_parallel_size 2"):
        EngineArgs.from_kwargs(model=str(out), load_format="sharded_state").create_config()
    with pytest.raises(ConfigError, match="^load_format: .* holds sharded state"):
        EngineArgs.from_kwargs(model=str(out), tensor_parallel_size=2).create_config()
    with pytest.raises(ConfigError, match="^load_format sharded_state: no "):
        EngineArgs.from_kwargs(model=str(path), load_format="sharded_state").create_config()
    cli = subprocess.run([sys.executable, "-m", "dpserve.cli", "generate", str(out),
                          "--load-format", "sharded_state", "--prompt", "x"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines() == [
        f"dpserve: error: --tensor-parallel-size 1 does not match the sharded state in "
        f"{out}, saved at tensor_parallel_size 2 (--load-format sharded_state loads each "
        f"worker's own files)"]
