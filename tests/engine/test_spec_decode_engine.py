"""Speculative decoding through the offline LLM with real weights: greedy output with
`speculative_config` equals transformers' (tiny checkpoints, float32) and the output
without it (the default model on copy-heavy prompts), token for token, however the
engine batches, preempts and hits the prefix cache; drafts are accepted on a prompt
that contains the text to be produced (the engine's counters), so the test fails if
speculation silently never happens."""

from __future__ import annotations

import pytest
from token_checks import greedy, hf_greedy

from dpserve import LLM, SamplingParams
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow  # model forwards: tens of seconds

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, ' \
       '"prompt_lookup_min": 1}'
MAX_TOKENS = 24
# Prompts that repeat (lookup proposes their continuation) and ones that do not.
PROMPTS = [[5, 6, 7, 8, 9] * 6, [7] * 5 + list(range(200, 230)), [11, 12, 13],
           list(range(100, 140)) + list(range(100, 110)), [300, 301]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_reference(request, tiny_llama, tiny_qwen2):
    path = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]
    return str(path), PROMPTS, hf_greedy(path, PROMPTS, MAX_TOKENS)


def _prompts(prompt_ids):
    return [{"prompt_token_ids": ids} for ids in prompt_ids]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _drafted(llm: LLM) -> int:
    return llm.get_stats().spec_decode_num_draft_tokens


def test_greedy_with_drafts_equals_transformers(model_and_reference):
    """Batched, with a request beside them that never gets drafts (logprobs), then
    again from the prefix cache."""
    path, prompt_ids, expected = model_and_reference
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    outs = llm.generate(_prompts(prompt_ids + prompt_ids[-1:]),
                        [greedy] * len(prompt_ids) + [with_logprobs], use_tqdm=False)
    assert _tokens(outs) == expected + expected[-1:]
    assert _drafted(llm) > 0
    again = llm.generate(_prompts(prompt_ids), greedy, use_tqdm=False)
    assert _tokens(again) == expected
    assert llm.get_stats().prefix_cache_hits > 0


def test_greedy_with_drafts_under_preemption_equals_transformers(model_and_reference):
    path, prompt_ids, expected = model_and_reference
    bs = 4
    blocks = lambda n: -(-n // bs)  # noqa: E731
    needs = [blocks(len(p) + len(e)) for p, e in zip(prompt_ids, expected)]
    capacity = max(max(needs) + 2, sum(blocks(len(p)) for p in prompt_ids) + 1)
    assert sum(needs) > capacity + 4
    llm = LLM(path, block_size=bs, num_kv_blocks=capacity, max_num_batched_tokens=256,
              max_num_seqs=8, speculative_config=SPEC)
    outs = llm.generate(_prompts(prompt_ids), SamplingParams(temperature=0.0,
                                                             max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert _tokens(outs) == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
    assert stats.num_free_blocks == capacity


CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''
COPY_PROMPTS = [f"Repeat this code exactly:\n\n{CODE}\nHere it is again:\n\n{CODE[:40]}",
                "The capital of France is"]


def test_copy_heavy_prompts_accept_drafts_and_keep_greedy_text():
    """The default model: output with speculation equals output without it, and a
    prompt holding the text to produce has drafts accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = LLM(max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(COPY_PROMPTS, params,
                                                                use_tqdm=False)]
    del plain
    llm = LLM(max_num_seqs=4, speculative_config=SPEC)
    outs = llm.generate(COPY_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0, stats
    assert stats.spec_decode_num_drafts > 0
    # The engine timed its decode-shaped steps for the drafts' planner.
    assert llm.engine.scheduler.spec.costs.steps > 0
    # Sampling beside them (drafts verified by speculative sampling): it runs to length.
    sampled = llm.generate(COPY_PROMPTS[:1], SamplingParams(temperature=0.8, max_tokens=24,
                                                            ignore_eos=True),
                           use_tqdm=False)
    assert len(sampled[0].outputs[0].token_ids) == 24
    assert llm.get_stats().spec_decode_num_drafts > stats.spec_decode_num_drafts


@pytest.mark.procs
def test_tensor_parallel_workers_compute_the_drafts_too(tmp_path):
    """TP=2: the peer worker gets each speculative row's drafts (its token window and
    logits rows match worker 0's): greedy tokens still equal transformers'."""
    path = make_tiny_model(tmp_path / "llama", "llama", hidden_size=96,
                           num_attention_heads=6, num_key_value_heads=6, intermediate_size=96)
    prompts = [[7] * 5 + list(range(200, 230)), [5, 6, 7, 8] * 6, [11, 12, 13]]
    with LLM(str(path), tensor_parallel_size=2, dtype="float32", block_size=4,
             speculative_config=SPEC) as llm:
        assert greedy(llm, prompts) == hf_greedy(path, prompts)
        assert llm.get_stats().spec_decode_num_draft_tokens > 0
