"""Pooling (embedding) requests in the engine: the scheduler as a CPU state machine
(hand-made hidden states through the real `model.pooler.pool_step`), then the offline
`LLM.embed` against transformers' `AutoModel` (the last hidden state, after the final
norm) on a tiny random checkpoint, and tensor parallelism (TP=2 equals TP=1).

A pooling request is chunked like any prefill, is never sampled, finishes (stop) in
the step that computes its last prompt token and carries its vector; "mean" computes
every position (no prefix-cache hit) and starts its sum again after a preemption;
"last" may hit the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpserve import LLM, PoolingParams, SamplingParams
from dpserve.config import CacheConfig, ConfigError, EngineArgs, PoolerConfig, SchedulerConfig
from dpserve.engine.request import FinishReason, Request
from dpserve.engine.scheduler import Scheduler
from dpserve.model.pooler import pool_step
from dpserve.protocol import EngineCoreRequest
from dpserve.step import ModelRunnerOutput, SchedulerOutput

BS = 4


def make_scheduler(num_blocks: int = 32, budget: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=BS, kv_cache_memory=None, gpu_memory_utilization=0.9,
                    enable_prefix_caching=True, num_kv_blocks=num_blocks),
        num_blocks)


def pooling_request(req_id: str, prompt: list[int], kind: str, **kw) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=1),
                   pooling=PoolingParams(kind, **kw))


def fake_hidden(out: SchedulerOutput) -> torch.Tensor:
    """[T, 2] final hidden states of the step: row [position, 1] for every token."""
    rows = [[float(p), 1.0] for s in out.scheduled
            for p in range(s.start, s.start + s.num_new_tokens)]
    return torch.tensor(rows)


def run_step(sched: Scheduler, abort: str | None = None):
    """schedule -> (the runner's pooling over fake rows; token 7 for sampled rows)
    -> update; `abort` is aborted between schedule and update."""
    out = sched.schedule()
    assert not any(s.sample and s.pooling for s in out.scheduled)
    sampled = [s.req_id for s in out.scheduled if s.sample]
    pooled = pool_step(fake_hidden(out), out) if out.has_pooling else {}
    if abort is not None:
        sched.finish_requests(abort)
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled, [7] * len(sampled),
                                                                pooled=pooled))


def vector(pooled: bytes) -> np.ndarray:
    return np.frombuffer(pooled, dtype="<f4")


def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def test_chunked_mean_pooling_never_samples_and_finishes_with_its_vector():
    sched = make_scheduler(budget=8)
    sched.add_request(pooling_request("emb", list(range(100, 120)), "mean"))  # 20 tokens
    sched.add_request(Request("gen", [5, 6, 7], SamplingParams(max_tokens=8)))
    finished = []
    for _ in range(3):  # 8 + 8 + 4 tokens; the generation request rides along
        out, deltas = run_step(sched)
        assert out.has_pooling
        finished += [d for d in deltas if d.request_id == "emb"]
    assert [d.new_token_ids for d in finished] == [[]]
    done = finished[0]
    assert done.finish_reason == FinishReason.STOP and done.phase_times is not None
    np.testing.assert_allclose(vector(done.pooled), unit([9.5, 1.0]), rtol=1e-6)
    assert "emb" not in sched.requests and sched.requests["gen"].num_output_tokens > 0
    stats = sched.make_stats()
    assert (stats.num_pooled_requests, stats.num_pooling_steps) == (1, 1)
    out, _ = run_step(sched)
    assert not out.has_pooling  # nothing to pool: the runner skips the pooler


def test_requests_of_one_step_finish_together_and_dimensions_cut_before_normalising():
    sched = make_scheduler(budget=64)
    sched.add_request(pooling_request("a", [1, 2, 3], "last"))
    sched.add_request(pooling_request("b", [1, 2, 3, 4, 5], "mean", dimensions=1))
    sched.add_request(pooling_request("c", [9, 9], "last", normalize=False))
    _, deltas = run_step(sched)
    got = {d.request_id: vector(d.pooled) for d in deltas}
    np.testing.assert_allclose(got["a"], unit([2.0, 1.0]), rtol=1e-6)
    np.testing.assert_allclose(got["b"], [1.0])  # mean [2, 1], first value, normalised
    np.testing.assert_allclose(got["c"], [1.0, 1.0])
    stats = sched.make_stats()
    assert (stats.num_pooled_requests, stats.num_pooling_steps) == (3, 1)


def test_last_pooling_hits_the_prefix_cache_mean_pooling_computes_every_position():
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks
    sched = make_scheduler(budget=64)
    sched.add_request(Request("warm", prompt, SamplingParams(max_tokens=1)))
    run_step(sched)
    sched.add_request(pooling_request("last", prompt, "last"))
    out, deltas = run_step(sched)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(16, 2)]
    assert deltas[0].num_cached_tokens == 16
    np.testing.assert_allclose(vector(deltas[0].pooled), unit([17.0, 1.0]), rtol=1e-6)
    sched.add_request(pooling_request("mean", prompt, "mean"))
    out, deltas = run_step(sched)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 18)]
    np.testing.assert_allclose(vector(deltas[0].pooled), unit([8.5, 1.0]), rtol=1e-6)


def test_a_preempted_mean_request_starts_its_sum_again():
    sched = make_scheduler(budget=8)
    sched.add_request(pooling_request("emb", list(range(100, 120)), "mean"))
    run_step(sched)  # positions 0..7 summed
    sched.preempt_all()  # (a failed expert-parallel step): it recomputes from 0
    deltas = [d for _ in range(3) for d in run_step(sched)[1]]
    assert len(deltas) == 1
    np.testing.assert_allclose(vector(deltas[0].pooled), unit([9.5, 1.0]), rtol=1e-6)


def test_an_aborted_pooling_request_leaves_nothing():
    sched = make_scheduler(budget=8)
    sched.add_request(pooling_request("emb", list(range(100, 120)), "mean"))
    run_step(sched)
    _, deltas = run_step(sched, abort="emb")  # its row of this step is stale
    assert deltas == [] and sched.pooling.held == 0 and not sched.requests
    out, _ = run_step(sched)
    assert not out.has_pooling and out.is_empty


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling_type must be one of last, mean"):
        PoolingParams("cls")
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)


def test_pooler_config_option():
    assert PoolerConfig.parse(None) == PoolerConfig("last", True)
    assert PoolerConfig.parse('{"pooling_type": "MEAN", "normalize": false}') == \
        PoolerConfig("mean", False)
    for value, message in [
            ('{"pooling_type": "CLS"}', "pooler_config: pooling_type must be LAST or MEAN, "
                                        "got 'CLS'"),
            ('{"softmax": true}', "pooler_config: unknown key"),
            ("MEAN", "pooler_config must be a JSON object"),
            ('{"normalize": 1}', "normalize must be true or false")]:
        with pytest.raises(ConfigError, match=message):
            PoolerConfig.parse(value)
        with pytest.raises(ConfigError, match=message):  # before anything starts
            EngineArgs(pooler_config=value).check_options()


# ---- offline LLM.embed against transformers ---------------------------------------

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [11, 12, 13], list(range(100, 140)), [300]]
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=8, block_size=16)


def hf_hidden(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last_hidden_state (after the final norm) of each prompt, float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]


def expected(hidden: torch.Tensor, kind: str, dims: int | None = None) -> np.ndarray:
    v = hidden.mean(dim=0) if kind == "mean" else hidden[-1]
    return unit(v[:dims].numpy())


def embed(llm: LLM, prompts, **params) -> list[np.ndarray]:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(**params),
                     use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [np.array(o.outputs.embedding) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_hidden(tiny_llama, PROMPTS)


def test_llm_embed_equals_transformers(tiny_llama, reference):
    llm = LLM(str(tiny_llama), **ENGINE)
    for kind in ("last", "mean"):
        for got, hidden in zip(embed(llm, PROMPTS, pooling_type=kind), reference):
            np.testing.assert_allclose(got, expected(hidden, kind), atol=1e-4)
    cut = embed(llm, PROMPTS, pooling_type="mean", dimensions=8)
    for got, hidden in zip(cut, reference):
        assert got.shape == (8,)
        np.testing.assert_allclose(got, expected(hidden, "mean", 8), atol=1e-4)
    # Again, now from the prefix cache (the 40-token prompt's first 32): the same vectors.
    hits = llm.get_stats().prefix_cache_hits
    again = embed(llm, PROMPTS, pooling_type="last")
    assert llm.get_stats().prefix_cache_hits >= hits + 32
    for got, hidden in zip(again, reference):
        np.testing.assert_allclose(got, expected(hidden, "last"), atol=1e-4)
    text = llm.embed("hello there", use_tqdm=False)[0]
    ids = llm.get_tokenizer().encode("hello there")
    assert text.prompt_token_ids == ids
    np.testing.assert_allclose(text.outputs.embedding, embed(llm, [ids])[0], atol=1e-6)
    stats = llm.get_stats()
    assert stats.num_pooled_requests == 4 * 4 + 2 and stats.num_generated_tokens == 0


def test_engine_refuses_pooling_requests_that_cannot_run(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE)
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="dimensions 65 exceeds the model's hidden size"):
        llm.engine.add_request(EngineCoreRequest("x", [1, 2], params,
                                                 pooling=PoolingParams(dimensions=65)))
    # A pooling request needs no room for a completion: max_model_len tokens run. The
    # pooler_config option is what embed() pools with by default.
    short = LLM(str(tiny_llama), max_model_len=32, pooler_config={"pooling_type": "MEAN"},
                **ENGINE)
    prompt = list(range(1, 33))
    default = short.embed({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs.embedding
    assert len(default) == 64
    np.testing.assert_allclose(default, embed(short, [prompt], pooling_type="mean")[0])
    assert not np.allclose(default, embed(short, [prompt], pooling_type="last")[0])


@pytest.mark.procs  # TP=2 spawns a worker process
def test_tensor_parallel_embeddings_equal_tp1(tiny_llama, reference):
    tp1 = LLM(str(tiny_llama), **ENGINE)
    want = {kind: embed(tp1, PROMPTS, pooling_type=kind) for kind in ("last", "mean")}
    with LLM(str(tiny_llama), tensor_parallel_size=2, **ENGINE) as llm:
        assert len(llm.engine.executor.worker_info()) == 2
        for kind in ("last", "mean"):
            got = embed(llm, PROMPTS, pooling_type=kind)
            for tp2, tp1_vector, hidden in zip(got, want[kind], reference):
                np.testing.assert_allclose(tp2, tp1_vector, atol=1e-5)
                np.testing.assert_allclose(tp2, expected(hidden, kind), atol=1e-4)
