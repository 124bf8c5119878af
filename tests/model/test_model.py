"""The model executor against transformers on tiny random checkpoints.

A small `Driver` plays the scheduler: it hands the runner SchedulerOutputs
with shuffled (non-contiguous) block ids and block_size 4, so contexts span
several blocks. Every new token's logits must equal transformers' logits for
the full sequence at that position.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
import torch

from dpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from dpserve.engine.request import Request
from dpserve.model.layers import bucket_rows, can_prepack, linear, prepack, rope_spec_from_config
from dpserve.model.llama import LlamaForCausalLM
from dpserve.model.runner import ModelRunner
from dpserve.sampling_params import SamplingParams
from dpserve.step import SchedulerOutput
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow  # model forwards compared with transformers: tens of seconds

ATOL = 1e-4
BS = 4


def engine_config(path: Path, block_size: int = BS, num_kv_blocks: int | None = 96,
                  kv_cache_memory: int | None = None, max_model_len: int = 256,
                  max_num_seqs: int = 8) -> EngineConfig:
    hf = json.loads((path / "config.json").read_text())
    model = ModelConfig(model=str(path), path=str(path), tokenizer=str(path),
                        architecture=hf["architectures"][0], hf_config=MappingProxyType(hf),
                        dtype="float32", max_model_len=max_model_len, seed=0)
    cache = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                        gpu_memory_utilization=0.9, enable_prefix_caching=False,
                        num_kv_blocks=num_kv_blocks)
    sched = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len)
    return EngineConfig(model=model, cache=cache, scheduler=sched,
                        parallel=ParallelConfig(data_parallel_size=1, threads_per_engine=None),
                        device="cpu")


class Driver:
    """Feeds known token sequences to a runner, step by step, like a scheduler."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.blocks: dict[str, list[int]] = {}

    def step(self, work: list[tuple[Request, int]],
             decode_shaped: int | None = None) -> tuple[SchedulerOutput, torch.Tensor]:
        """Compute `n` more tokens of each (request, n) -> logits of every new token [T, V].
        decode_shaped: the first that many entries attend token by token, as a
        speculative row does (default: the one-token entries, put first)."""
        scheduled = []
        if decode_shaped is None:
            work = sorted(work, key=lambda w: w[1] != 1)  # decodes first
            decode_shaped = sum(n == 1 for _, n in work)
        for req, n in work:
            blocks = self.blocks.setdefault(req.request_id, [])
            while len(blocks) * BS < req.num_computed_tokens + n:
                blocks.append(self.free.pop())
            scheduled.append(req.for_step(req.num_computed_tokens, n, list(blocks),
                                          sample=req.num_computed_tokens + n == req.num_tokens))
        so = SchedulerOutput(scheduled=scheduled, num_decodes=decode_shaped,
                             total_num_tokens=sum(s.num_new_tokens for s in scheduled))
        with torch.inference_mode():
            inputs = self.runner.prepare_inputs(so)
            hidden = self.runner.model(inputs.input_ids, inputs.positions, inputs.attn_meta,
                                       self.runner.kv_caches)
            logits = self.runner.model.compute_logits(hidden)
        for req, n in work:
            req.num_computed_tokens += n
        return so, logits


_HF_MODELS: dict[str, object] = {}


def hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), V] for one sequence (models loaded once)."""
    from transformers import AutoModelForCausalLM

    if str(path) not in _HF_MODELS:
        _HF_MODELS[str(path)] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return _HF_MODELS[str(path)](torch.tensor([tokens])).logits[0].float()


def check_step(path: Path, so: SchedulerOutput, logits: torch.Tensor) -> None:
    row = 0
    for s in so.scheduled:
        ref = hf_logits(path, s.token_ids[:s.start + s.num_new_tokens])
        got = logits[row:row + s.num_new_tokens]
        torch.testing.assert_close(got, ref[s.start:], atol=ATOL, rtol=0)
        row += s.num_new_tokens


def make_requests(vocab: int, lengths: list[int], seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(vocab) for _ in range(n)],
                    SamplingParams(temperature=0.0)) for i, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_path(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture
def driver(model_path) -> Driver:
    runner = ModelRunner(engine_config(model_path))
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return Driver(runner)


def vocab(driver: Driver) -> int:
    return driver.runner.vocab_size


def test_single_prompt(driver, model_path):
    (req,) = make_requests(vocab(driver), [13])
    check_step(model_path, *driver.step([(req, 13)]))


def test_prompts_of_different_lengths(driver, model_path):
    reqs = make_requests(vocab(driver), [3, 9, 17, 1])
    check_step(model_path, *driver.step([(r, r.num_tokens) for r in reqs]))


def test_equal_length_prompts(driver, model_path):
    reqs = make_requests(vocab(driver), [8, 8, 8])  # the uniform (no padding) path
    check_step(model_path, *driver.step([(r, 8) for r in reqs]))


def test_chunked_prefill(driver, model_path):
    a, b = make_requests(vocab(driver), [23, 14])
    for chunks in ([(a, 7), (b, 5)], [(a, 9), (b, 9)], [(a, 7)]):
        check_step(model_path, *driver.step(chunks))


def test_decodes_after_prefill(driver, model_path):
    reqs = make_requests(vocab(driver), [15, 10, 21])
    check_step(model_path, *driver.step([(r, r.num_tokens - 6) for r in reqs]))
    for _ in range(6):
        check_step(model_path, *driver.step([(r, 1) for r in reqs]))


def test_one_row_decodes_run_in_one_call_and_match(driver, model_path):
    """One stream's decode steps run every layer in one C call (one_call.py) where the
    kernels are built and the model has no biases (Qwen2's QKV has)."""
    from dpserve.model import cpu_kernels

    (req,) = make_requests(vocab(driver), [14])
    check_step(model_path, *driver.step([(req, 8)]))
    for _ in range(6):
        check_step(model_path, *driver.step([(req, 1)]))
    model = driver.runner.model
    assert model.one_call_steps == (6 if cpu_kernels.available() and not model.dims.qkv_bias
                                    else 0)


def test_mixed_decode_and_prefill_step(driver, model_path):
    old, chunked, new1, new2 = make_requests(vocab(driver), [12, 30, 6, 9])
    driver.step([(old, 11), (chunked, 10)])
    # decode + continued chunk (context) + fresh prompts, all in one step
    so, logits = driver.step([(old, 1), (chunked, 20), (new1, 6), (new2, 9)])
    assert so.num_decodes == 1
    check_step(model_path, so, logits)


def test_execute_samples_hf_argmax(driver, model_path):
    reqs = make_requests(vocab(driver), [7, 12])
    scheduled = [r.for_step(0, r.num_tokens, list(range(i * 4, i * 4 + 4)), True)
                 for i, r in enumerate(reqs)]
    out = driver.runner.execute(SchedulerOutput(scheduled, 0, 19))
    assert out.req_ids == ["r0", "r1"]
    expect = [int(hf_logits(model_path, r.all_token_ids)[-1].argmax()) for r in reqs]
    assert out.sampled_token_ids == expect
    assert out.logprobs is None


def test_execute_dummy_touches_only_scratch(driver):
    runner = driver.runner
    (req,) = make_requests(vocab(driver), [9])
    driver.step([(req, 9)])
    before = [c[:, :runner.num_blocks].clone() for c in runner.kv_caches]
    runner.execute_dummy()
    for b, c in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(b, c[:, :runner.num_blocks])


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    path = make_tiny_model(tmp_path, "llama", rope_parameters={"rope_theta": 500.0, **rope})
    d = Driver(_runner(path))
    reqs = make_requests(d.runner.vocab_size, [40, 25])
    check_step(path, *d.step([(r, r.num_tokens - 1) for r in reqs]))
    check_step(path, *d.step([(r, 1) for r in reqs]))


def _runner(path: Path) -> ModelRunner:
    runner = ModelRunner(engine_config(path))
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def test_old_style_rope_keys_read_the_same():
    new = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}
    old = {"rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope_spec_from_config(new) == rope_spec_from_config(old)
    assert rope_spec_from_config({}).rope_type == "default"
    with pytest.raises(ValueError, match="longrope"):
        rope_spec_from_config({"rope_scaling": {"rope_type": "longrope"}})


def test_tied_embeddings_and_head_dim(tmp_path):
    path = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True, head_dim=32)
    d = Driver(_runner(path))
    model = d.runner.model
    # Tied: the head computes with the embedding matrix (itself, or a packed copy of
    # it on CPU): logits of any hidden state are hidden @ embed^T.
    assert model.lm_head is model.embed or model.packed
    hidden = torch.randn(3, model.embed.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.embed.float().T,
                               atol=1e-4, rtol=1e-4)
    reqs = make_requests(d.runner.vocab_size, [11, 5])
    check_step(path, *d.step([(r, r.num_tokens) for r in reqs]))


def test_mistral_loads_and_matches(tmp_path):
    path = make_tiny_model(tmp_path, "mistral")
    d = Driver(_runner(path))
    reqs = make_requests(d.runner.vocab_size, [10, 6])
    check_step(path, *d.step([(r, r.num_tokens) for r in reqs]))


def test_load_weights_rejects_bad_names(model_path):
    from safetensors.torch import load_file

    hf = json.loads((model_path / "config.json").read_text())
    weights = load_file(str(model_path / "model.safetensors"))
    model = LlamaForCausalLM(hf, torch.float32, "cpu")
    model.load_weights(weights.items())  # complete: fine
    with pytest.raises(ValueError, match="unexpected weight 'model.extra'"):
        model.load_weights([*weights.items(), ("model.extra", torch.zeros(1))])
    partial = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="missing weights.*layers.1.mlp.up_proj"):
        model.load_weights(partial.items())


def test_num_blocks_from_memory_budget(model_path):
    cfg = engine_config(model_path, num_kv_blocks=None, kv_cache_memory=1 << 20)
    runner = ModelRunner(cfg)
    per_block = runner.block_bytes()  # 2 layers * 2 * 4 tokens * 2 heads * 16 dims * 4 B
    assert per_block == 2 * 2 * BS * 2 * 16 * 4
    # capped at max_num_seqs * max_model_len / block_size
    assert runner.determine_num_blocks() == min((1 << 20) // per_block, 8 * 256 // BS)
    small = ModelRunner(engine_config(model_path, num_kv_blocks=None, kv_cache_memory=4096))
    with pytest.raises(ValueError, match="kv_cache_memory"):
        small.determine_num_blocks()


def test_token_positions_and_slots():
    from dpserve.model.attention import build_attention_metadata, token_positions

    q, ctx = np.array([1, 3, 2]), np.array([5, 0, 6])
    assert token_positions(q, ctx).tolist() == [5, 0, 1, 2, 6, 7]
    table = np.array([[7, 2], [4, 0], [9, 3]])
    meta = build_attention_metadata(q, ctx, table, 1, 4, torch.float32, torch.device("cpu"))
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18, 3 * 4 + 2, 3 * 4 + 3]


def test_many_decode_chunks_and_prefill_groups(driver, model_path, monkeypatch):
    import dpserve.model.attention as attention

    monkeypatch.setattr(attention, "CPU_DECODE_ROWS", 2)  # 5 decodes -> 3 chunks
    monkeypatch.setattr(attention, "MAX_MASK_ELEMS", 300)  # prefills: groups [12, 5], [10]
    reqs = make_requests(vocab(driver), [9, 14, 6, 11, 7, 12, 5, 10])
    driver.step([(r, r.num_tokens - 3) for r in reqs[:5]])
    so, logits = driver.step([(r, 1) for r in reqs[:5]] + [(r, r.num_tokens) for r in reqs[5:]])
    assert len(so.scheduled) == 8 and so.num_decodes == 5
    meta = driver.runner.prepare_inputs(so).attn_meta
    assert len(meta.decode_chunks) == 3
    assert [g.num_seqs for g in meta.prefill_groups] == [2, 1]
    assert [g.uniform for g in meta.prefill_groups] == [False, True]
    check_step(model_path, so, logits)


def test_decode_shaped_rows_of_several_tokens_attend_token_by_token(driver, model_path,
                                                                     monkeypatch):
    """A speculative row (its last known token and the drafts after it) is decode-shaped:
    each of its tokens is a decode row of its own that sees the keys up to itself
    (the CPU kernel where it runs), beside one-token decodes and a prefill."""
    import dpserve.model.attention as attention

    monkeypatch.setattr(attention, "CPU_DECODE_ROWS", 3)  # chunks split the rows' tokens
    reqs = make_requests(vocab(driver), [9, 14, 6, 11])
    driver.step([(r, r.num_tokens - 5) for r in reqs[:3]])
    so, logits = driver.step([(reqs[0], 1), (reqs[1], 5), (reqs[2], 4), (reqs[3], 11)],
                             decode_shaped=3)
    meta = driver.runner.prepare_inputs(so).attn_meta
    assert meta.num_decode_tokens == 10 and len(meta.decode_chunks) == 4
    assert [g.num_seqs for g in meta.prefill_groups] == [1]
    check_step(model_path, so, logits)


def test_profile_run_works_on_cpu(driver, model_path, monkeypatch):
    """The CUDA sizing forward, exercised here on CPU: a full-size batch through the
    model into finite logits, on scratch caches (the real KV cache stays untouched)."""
    runner = driver.runner
    sched = runner.config.scheduler
    seen: list[torch.Tensor] = []
    forward, compute_logits = runner.model.forward, runner.model.compute_logits

    def spy_forward(input_ids, *args):  # records what the sizing forward ran
        seen.append(input_ids)
        return forward(input_ids, *args)

    def spy_logits(hidden):
        logits = compute_logits(hidden)
        seen.append(logits)
        return logits

    monkeypatch.setattr(runner.model, "forward", spy_forward)
    monkeypatch.setattr(runner.model, "compute_logits", spy_logits)
    runner.kv.profile_run(runner.model)
    input_ids, logits = seen
    assert input_ids.shape == (sched.max_num_batched_tokens,)
    assert logits.shape == (min(sched.max_num_batched_tokens, sched.max_num_seqs),
                            runner.vocab_size)
    assert torch.isfinite(logits).all()
    assert all(not cache.any() for cache in runner.kv_caches)
    monkeypatch.undo()
    # The runner still computes what transformers does.
    reqs = make_requests(vocab(driver), [7, 5])
    check_step(model_path, *driver.step([(r, r.num_tokens) for r in reqs]))


def test_bucket_rows_bounds_the_shapes():
    sizes = [bucket_rows(n) for n in range(1, 4097)]
    assert all(b >= n for n, b in zip(range(1, 4097), sizes))
    assert sizes[:8] == list(range(1, 9))  # small decode batches run as they are
    assert all(b - n < max(8, n / 8) for n, b in zip(range(1, 4097), sizes))
    assert len(set(sizes)) == 63


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_linear_equals_plain_linear(dtype):
    torch.manual_seed(0)
    weight = torch.randn(48, 32, dtype=dtype)
    bias = torch.randn(48, dtype=dtype)
    packed = can_prepack(dtype, "cpu")  # float32 and bfloat16 both pack
    w = prepack(weight) if packed else weight
    for rows in (1, 7, 9, 13, 65, 100, 513):
        x = torch.randn(rows, 32, dtype=dtype)
        out = linear(x, w, bias, packed)
        assert out.shape == (rows, 48)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias),
                                   rtol=tol, atol=tol)
