"""Mixture-of-experts models (and dense Qwen3) against transformers, in one process.

Tiny random Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and Qwen3 checkpoints are
built with transformers; dpserve's greedy tokens must equal transformers'
`generate`, for prompts alone and batched with chunked prefill (a 16-token
step budget under 40-token prompts), and for prompts that hit the prefix
cache. The fused MoE layer equals a per-token loop, and expert shards add up
to the whole layer. Config: MoE models switch lockstep on by themselves;
--enable-expert-parallel is refused where it cannot work.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from token_checks import greedy, hf_greedy

from dpserve import LLM
from dpserve.config import ConfigError, EngineArgs
from dpserve.model.moe import fused_experts, reference_moe, route
from dpserve.testing.tiny_model import MOE_ARCHS, make_tiny_model

pytestmark = pytest.mark.slow  # one model per architecture, compared with transformers

SHARED = list(range(40, 80))  # a 40-token prefix shared by the prefix-cache prompts
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [11, 12, 13], list(range(100, 140)),
           [7] * 5 + list(range(200, 230)), [300, 301]]
PREFIX_PROMPTS = [SHARED + [9, 10], SHARED + [20, 21, 22]]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch)
            for arch in ("qwen3", *MOE_ARCHS)}


@pytest.mark.parametrize("arch", ["qwen3", *MOE_ARCHS])
def test_greedy_tokens_equal_transformers(tiny_models, arch):
    path = tiny_models[arch]
    expected = hf_greedy(path, PROMPTS + PREFIX_PROMPTS)
    assert len({tuple(e) for e in expected}) > 1, "degenerate model: every output equal"
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8)
    assert [greedy(llm, [p])[0] for p in PROMPTS[:3]] == expected[:3]  # alone
    assert greedy(llm, PROMPTS) == expected[:len(PROMPTS)]  # batched, chunked prefill
    assert greedy(llm, PREFIX_PROMPTS[:1]) == expected[-2:-1]
    hits = llm.get_stats().prefix_cache_hits
    assert greedy(llm, PREFIX_PROMPTS[1:]) == expected[-1:]  # its prefix is cached
    assert llm.get_stats().prefix_cache_hits >= hits + 32  # two whole 16-token blocks


def test_sharded_checkpoint_loads(tiny_models, tmp_path):
    """A checkpoint split over several safetensors files (with an index) loads the same."""
    from transformers import AutoModelForCausalLM

    src = tiny_models["qwen2_moe"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, tmp_path / f.name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    llm = LLM(str(tmp_path), max_model_len=256)
    assert greedy(llm, PROMPTS[:2]) == hf_greedy(src, PROMPTS[:2])


def _random_moe(tokens: int = 37, hidden: int = 16, inter: int = 8, experts: int = 8,
                top_k: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:5, 3] += 20  # several tokens pick the same experts, some experts get none
    logits[:, 6:] -= 50  # experts 6 and 7: nobody's choice
    ids, weights = route(logits, top_k, True, torch.float32)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(experts, hidden, inter, generator=g)
    return x, ids, weights, w13, w2


def test_fused_experts_equal_a_per_token_loop():
    x, ids, weights, w13, w2 = _random_moe()
    torch.testing.assert_close(fused_experts(x, ids, weights, w13, w2),
                               reference_moe(x, ids, weights, w13, w2), rtol=1e-4, atol=1e-4)


def test_expert_shards_add_up_to_the_layer():
    """What expert parallelism relies on: each rank's share, summed, is the layer."""
    x, ids, weights, w13, w2 = _random_moe()
    whole = fused_experts(x, ids, weights, w13, w2)
    parts = [fused_experts(x, ids, weights, w13[lo:hi], w2[lo:hi], lo)
             for lo, hi in ((0, 3), (3, 6), (6, 8))]
    assert not parts[2].any()  # a shard whose experts nobody chose adds nothing
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    ids, plain = route(logits, 2, False, torch.float32)
    _, renorm = route(logits, 2, True, torch.float32)
    assert ids.tolist() == [[2, 1]]
    assert plain.sum() < 1 and renorm.sum().item() == pytest.approx(1.0)


def test_moe_switches_lockstep_on_by_itself(tiny_models, tiny_llama):
    moe = str(tiny_models["mixtral"])
    assert EngineArgs(model=moe, data_parallel_size=2).create_config() \
        .parallel.data_parallel_lockstep
    assert not EngineArgs(model=str(tiny_llama), data_parallel_size=2).create_config() \
        .parallel.data_parallel_lockstep
    ep = EngineArgs(model=moe, data_parallel_size=2, enable_expert_parallel=True)
    assert ep.create_config().parallel.enable_expert_parallel


@pytest.mark.parametrize("model, kwargs, message", [
    ("llama", dict(data_parallel_size=2), "needs a mixture-of-experts model"),
    ("mixtral", dict(data_parallel_size=9),
     "data_parallel_size x tensor_parallel_size must not exceed .* 8 experts"),
    ("mixtral", dict(data_parallel_size=2, data_parallel_size_max=9),
     "data_parallel_size_max x tensor_parallel_size must not exceed"),
    # Experts are spread over every worker (DP ranks x TP workers).
    ("mixtral", dict(data_parallel_size=3, tensor_parallel_size=4),
     r"data_parallel_size x tensor_parallel_size must not exceed .*got 3 x 4 = 12"),
    ("mixtral", dict(data_parallel_size=2, data_parallel_size_max=4, tensor_parallel_size=4),
     r"data_parallel_size_max x tensor_parallel_size .*got 4 x 4 = 16"),
    ("mixtral", dict(data_parallel_size=2, engine_failure_policy="isolate"), "isolate"),
])
def test_expert_parallel_is_refused_where_it_cannot_work(tiny_models, tiny_llama, model,
                                                          kwargs, message):
    path = tiny_llama if model == "llama" else tiny_models[model]
    with pytest.raises(ConfigError, match=message) as info:
        EngineArgs(model=str(path), enable_expert_parallel=True, **kwargs).create_config()
    assert "\n" not in str(info.value)
