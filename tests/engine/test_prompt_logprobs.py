"""prompt_logprobs (vLLM's extra field): the logprob, rank and top-k of every prompt
token given the ones before it, checked against transformers' log-softmax on a tiny
random checkpoint, offline and over HTTP, with chunked prefill, a prefix-cache hit
that would skip positions, and n > 1."""

from __future__ import annotations

import httpx
import pytest
import torch
from helpers import serve

from dpserve import LLM, SamplingParams

PROMPT_IDS = list(range(3, 43))  # 40 tokens: several 16-token prefill chunks
K = 3


def hf_logprobs(path, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax [len(ids), V] at every position (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_hf(ref: torch.Tensor, ids: list[int], got: list, k: int) -> None:
    """`got` as vLLM shapes it: [None, {token_id: (logprob, rank)}, ...]."""
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        row, token, entry = ref[pos - 1], ids[pos], got[pos]
        logprob, rank = entry[token]
        assert logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert rank == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        assert set(entry) == {token, *top.indices.tolist()}
        for tid, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[tid][0] == pytest.approx(value, abs=1e-3)


def offline_entries(out) -> list:
    return [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()}
            for e in out.prompt_logprobs]


def test_offline_chunked_prefill_and_prefix_cache(tiny_llama) -> None:
    ref = hf_logprobs(tiny_llama, PROMPT_IDS)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
              block_size=16)
    prompt = {"prompt_token_ids": PROMPT_IDS}
    plain = SamplingParams(temperature=0, max_tokens=2)
    # Warm the prefix cache with the same prompt: a hit would skip 32 positions.
    first = llm.generate(prompt, plain, use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    again = llm.generate(prompt, plain, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # the cache does hold the prefix
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K, n=2)
    out = llm.generate(prompt, asked, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_against_hf(ref, PROMPT_IDS, offline_entries(out), K)
    assert [c.token_ids for c in out.outputs] == [first.outputs[0].token_ids] * 2
    # k = 0: the prompt token alone at each position.
    zero = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)[0]
    assert all(len(e) == 1 for e in zero.prompt_logprobs[1:])
    one = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def http_entries(entries: list) -> list:
    return [None if e is None else {int(t): (v["logprob"], v["rank"]) for t, v in e.items()}
            for e in entries]


@pytest.mark.procs
def test_server_completions_and_chat(tiny_llama) -> None:
    ref = hf_logprobs(tiny_llama, PROMPT_IDS)
    with serve(str(tiny_llama), "--dtype", "float32", "--max-num-batched-tokens", "16",
               "--max-num-seqs", "4", "--served-model-name", "tiny") as (_, url):
        body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": K}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        check_against_hf(ref, PROMPT_IDS, http_entries(choice["prompt_logprobs"]), K)
        entry = choice["prompt_logprobs"][1][str(PROMPT_IDS[1])]
        assert isinstance(entry["decoded_token"], str)
        # Without the field the response carries none.
        r = httpx.post(url + "/v1/completions", json={**body, "prompt_logprobs": None})
        assert r.json()["choices"][0].get("prompt_logprobs") is None
        # Chat: top-level prompt_logprobs over the rendered prompt.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}],
                "max_tokens": 2, "prompt_logprobs": 1}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        tok = httpx.post(url + "/tokenize", json={"model": "tiny",
                                                  "messages": chat["messages"]}).json()
        prompt_ids = tok["tokens"]
        got = http_entries(r.json()["prompt_logprobs"])
        check_against_hf(hf_logprobs(tiny_llama, prompt_ids), prompt_ids, got, 1)
        # Bad values and streaming get a 400 naming the field.
        for bad in ({**body, "prompt_logprobs": 99}, {**body, "stream": True},
                    {**chat, "stream": True}):
            path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
            r = httpx.post(url + path, json=bad)
            assert r.status_code == 400 and "prompt_logprobs" in r.text, r.text
