"""End to end through the offline LLM: greedy output equals Hugging Face
`transformers` token for token, however the engine batches, chunks, caches
and preempts."""

from __future__ import annotations

import pytest
import torch
from helpers import nonblank_stop_string

from dpserve import LLM, SamplingParams
from dpserve.config import ConfigError

pytestmark = pytest.mark.slow  # model forwards compared with transformers: tens of seconds

MAX_TOKENS = 24
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Data parallel serving runs several replicas of one model. " * 3,
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 " * 4,
]


def hf_greedy(path, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=model.config.eos_token_id)
        outs.append(y[0, len(ids):].tolist())
    return outs


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_reference(request, tiny_llama, tiny_qwen2):
    path = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]
    from dpserve.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(str(path))
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    return str(path), prompt_ids, hf_greedy(path, prompt_ids)


def _token_prompts(prompt_ids):
    return [{"prompt_token_ids": ids} for ids in prompt_ids]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_and_one_by_one_equal_hf(model_and_reference):
    path, prompt_ids, expected = model_and_reference
    llm = LLM(path, block_size=4)
    assert _tokens(llm.generate(_token_prompts(prompt_ids), greedy(), use_tqdm=False)) == expected
    llm.reset_prefix_cache()
    for ids, exp in zip(prompt_ids, expected):
        out = llm.generate(_token_prompts([ids]), greedy(), use_tqdm=False)
        assert _tokens(out) == [exp]


def test_small_chunked_prefill_equals_hf(model_and_reference):
    path, prompt_ids, expected = model_and_reference
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=False)
    assert _tokens(llm.generate(_token_prompts(prompt_ids), greedy(), use_tqdm=False)) == expected


def test_prefix_cache_hits_equal_hf(model_and_reference):
    path, prompt_ids, expected = model_and_reference
    llm = LLM(path, block_size=4)
    first = llm.generate(_token_prompts(prompt_ids), greedy(), use_tqdm=False)
    second = llm.generate(_token_prompts(prompt_ids), greedy(), use_tqdm=False)
    assert _tokens(first) == _tokens(second) == expected
    long_ones = [o for o, ids in zip(second, prompt_ids) if len(ids) > 8]
    assert long_ones and all(o.num_cached_tokens > 0 for o in long_ones)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0


def test_preemption_equals_hf(model_and_reference):
    path, prompt_ids, expected = model_and_reference
    bs = 4
    blocks = lambda n: -(-n // bs)  # noqa: E731
    prompt_blocks = sum(blocks(len(p)) for p in prompt_ids)
    needs = [blocks(len(p) + len(e)) for p, e in zip(prompt_ids, expected)]
    # Every prompt fits at once and each request fits alone, but not all of them
    # with their outputs: the scheduler has to preempt and recompute.
    capacity = max(max(needs) + 1, prompt_blocks + 1)
    assert sum(needs) > capacity + 4
    llm = LLM(path, block_size=bs, num_kv_blocks=capacity, max_num_batched_tokens=256,
              max_num_seqs=8)
    outs = llm.generate(_token_prompts(prompt_ids), greedy(), use_tqdm=False)
    assert _tokens(outs) == expected
    assert llm.get_stats().num_preemptions > 0
    assert llm.get_stats().num_free_blocks == capacity


def test_text_prompts_stop_strings_and_n(tiny_llama):
    llm = LLM(str(tiny_llama))
    full = llm.generate(["Hello world"], greedy(ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    assert len(full.outputs[0].token_ids) == MAX_TOKENS
    assert full.outputs[0].finish_reason == "length"
    # A stop string taken from the middle of the greedy text ends it there.
    stop = nonblank_stop_string(text, 3)
    cut = llm.generate(["Hello world"], greedy(ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    # n seeded samples: n distinct completions, reproducible.
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    b = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_seeded_sampling_same_alone_or_in_batch(tiny_llama):
    llm = LLM(str(tiny_llama))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3
    batch = llm.generate(["Hello", "Once upon a time", "1 2 3", "def add"],
                         [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs_returned(tiny_llama):
    llm = LLM(str(tiny_llama))
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())


def test_bad_requests_fail_clearly(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 64}], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)
    # The engine still works afterwards.
    assert llm.generate(["Hello"], greedy(), use_tqdm=False)[0].finished
    with pytest.raises(ConfigError, match="unknown option 'bogus'"):
        LLM(str(tiny_llama), bogus=1)
