"""/v1/embeddings with the official `openai` client against one real server:
`dpserve serve --data-parallel-size 2 --pooler-config '{"pooling_type": "MEAN"}'`
(tiny random model).

The vectors equal transformers' (`AutoModel`'s last hidden state, after the final
norm, mean-pooled, normalised) for several inputs at once, which the engines
batched (their pooling counters: fewer steps than inputs); base64 decodes to the
same floats (the client's default asks for it); `dimensions`; token-id inputs; the
errors in OpenAI's shape; and embeddings beside streaming greedy completions on the
same engine leave those completions' tokens as they were.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from helpers import (
    metric_sum,
    offline_greedy_texts,
    running_on,
    serve,
    stream_completion,
    wait_until,
)

pytestmark = [pytest.mark.procs]

MAX_INPUTS = 16
MAX_MODEL_LEN = 512
TEXTS = [f"Embedding input number {i}: " + "word " * (3 * i) for i in range(12)]


@pytest.fixture(scope="module")
def server(tiny_llama):
    model = str(tiny_llama)
    with serve(model, "--data-parallel-size", "2", "--threads-per-engine", "1",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "512",
               "--pooler-config", json.dumps({"pooling_type": "MEAN"}),
               "--max-embedding-inputs", str(MAX_INPUTS), timeout=180) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield url, client, model


def token_ids(url: str, text: str) -> list[int]:
    """The server's own tokenisation of `text` (/tokenize)."""
    resp = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def hf_mean(model: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """transformers' last_hidden_state, mean over the prompt, normalised (float32)."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            v = hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0).numpy()
            out.append(v / np.linalg.norm(v))
    return out


def pooling_counts(url: str) -> tuple[float, float]:
    """(pooling requests, steps that finished some) over every engine, cumulative."""
    return (metric_sum(url, "dpserve:pooling_requests_total"),
            metric_sum(url, "dpserve:pooling_steps_total"))


def test_batched_inputs_equal_transformers(server) -> None:
    url, client, model = server
    prompts = [token_ids(url, t) for t in TEXTS]
    before = pooling_counts(url)
    r = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    requests, steps = (a - b for a, b in zip(pooling_counts(url), before))
    assert r.object == "list" and r.model == client.models.list().data[0].id
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for got, want in zip(r.data, hf_mean(model, prompts)):
        assert got.object == "embedding" and len(got.embedding) == 64
        np.testing.assert_allclose(got.embedding, want, atol=1e-4)
    tokens = sum(len(p) for p in prompts)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (tokens, tokens)
    # From the engines' side: every input ran as a pooling request, batched (some
    # finished in a step together with another).
    assert requests == len(TEXTS)
    assert steps < len(TEXTS), f"{len(TEXTS)} inputs took {steps} engine steps"
    wait_until(lambda: not leftovers(url), 30, "no per-request state left")


def leftovers(url: str) -> dict[str, dict[str, int]]:
    """Per-request structures not empty, in the API server and each engine (KV blocks
    may stay cached)."""
    state = httpx.get(url + "/debug/request_state", timeout=15).json()
    left = {"api_server": {k: v for k, v in state["api_server"].items() if v}}
    for rank, sizes in state["engines"].items():
        left[rank] = {k: v for k, v in sizes.items()
                      if v and k not in ("kv_blocks", "kv_free", "kv_cached")}
        if sizes["kv_free"] != sizes["kv_blocks"]:
            left[rank]["kv_not_free"] = sizes["kv_blocks"] - sizes["kv_free"]
    return {where: sizes for where, sizes in left.items() if sizes}


def test_base64_and_the_clients_default_decode_to_the_floats(server) -> None:
    _, client, model = server
    floats = client.embeddings.create(model=model, input=TEXTS[:3], encoding_format="float")
    b64 = client.embeddings.create(model=model, input=TEXTS[:3], encoding_format="base64")
    default = client.embeddings.create(model=model, input=TEXTS[:3])  # base64 on the wire
    # Three requests: each may share its steps with other inputs, on either rank, and
    # a GEMM's last bits depend on the batch: equal to float32 rounding, not bitwise.
    for f, b, d in zip(floats.data, b64.data, default.data, strict=True):
        assert isinstance(b.embedding, str)
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        assert decoded.shape == (len(f.embedding),)
        np.testing.assert_allclose(decoded, f.embedding, rtol=0, atol=1e-5)
        np.testing.assert_allclose(d.embedding, f.embedding, rtol=0, atol=1e-5)


def test_dimensions_and_token_id_inputs(server) -> None:
    url, client, model = server
    full = np.array(client.embeddings.create(model=model, input=TEXTS[5],
                                             encoding_format="float").data[0].embedding)
    cut = client.embeddings.create(model=model, input=TEXTS[5], dimensions=16,
                                   encoding_format="float").data[0].embedding
    assert len(cut) == 16
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    ids = [token_ids(url, t) for t in TEXTS[5:7]]
    one = client.embeddings.create(model=model, input=ids[0], encoding_format="float")
    two = client.embeddings.create(model=model, input=ids, encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, full, atol=1e-5)
    np.testing.assert_allclose(two.data[0].embedding, full, atol=1e-5)
    texts = client.embeddings.create(model=model, input=TEXTS[5:7], encoding_format="float")
    np.testing.assert_allclose(two.data[1].embedding, texts.data[1].embedding, atol=1e-5)
    assert two.usage.prompt_tokens == len(ids[0]) + len(ids[1])


@pytest.mark.parametrize("body, status, param, says", [
    ({"input": ""}, 400, "input", "must not be empty"),
    ({"input": []}, 400, "input", "must not be empty"),
    ({"input": ["a", ""]}, 400, "input", "input[1] must not be empty"),
    ({"input": [[1, 2], []]}, 400, "input", "input[1] must not be empty"),
    ({"input": 5}, 400, "input", ""),
    ({"input": "hi", "dimensions": 65}, 400, "dimensions", "hidden size (64)"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions", "at least 1"),
    ({"input": "hi", "encoding_format": "hex"}, 400, "encoding_format", ""),
    ({"input": [[1, 2], [10 ** 6]]}, 400, "input", "input[1]: prompt token id 1000000"),
    ({"input": [7] * (MAX_MODEL_LEN + 1)}, 400, "input", "(--max-model-len)"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, 400, "input", "(--max-embedding-inputs)"),
    ({"input": "hi", "model": "nope"}, 404, "model", "does not exist"),
])
def test_errors_in_openais_shape(server, body, status, param, says) -> None:
    url, _, model = server
    resp = httpx.post(url + "/v1/embeddings", json={"model": model, **body}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_sees_a_bad_request(server) -> None:
    _, client, model = server
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=model, input="hi", dimensions=65)
    assert raised.value.status_code == 400
    assert len(client.embeddings.create(model=model, input="hi").data[0].embedding) == 64


def test_embeddings_beside_streaming_generation_keep_its_greedy_tokens(server) -> None:
    url, client, model = server
    prompts = [f"Once upon a time {i}" for i in range(3)]
    max_tokens = 300
    want = offline_greedy_texts(model, prompts, max_tokens, ignore_eos=True)

    async def run() -> tuple[list[str], int, int]:
        chunks = [0] * len(prompts)
        async with httpx.AsyncClient(timeout=120) as http:
            streams = [asyncio.create_task(stream_completion(
                http, url, model, p, chunks, i, rank=0, max_tokens=max_tokens))
                for i, p in enumerate(prompts)]
            deadline = time.monotonic() + 60
            while (running := await asyncio.to_thread(running_on, url, 0)) < len(prompts):
                assert time.monotonic() < deadline and not any(t.done() for t in streams), (
                    f"premise did not hold: rank 0 never ran the {len(prompts)} streams "
                    f"together (running {running})")
            r = await asyncio.to_thread(
                client.embeddings.create, model=model, input=TEXTS[:6],
                encoding_format="float", extra_headers={"X-data-parallel-rank": "0"})
            after = await asyncio.to_thread(running_on, url, 0)
            assert len(r.data) == 6
            return await asyncio.gather(*streams), running, after

    texts, before, after = asyncio.run(run())
    # The premise, from rank 0's engine: the streams ran there before the embedding
    # request and were still running after it finished, so its pooling requests ran
    # in steps beside their decodes.
    print(f"premise: rank 0 ran {before} streams before, {after} after the embeddings")
    assert after > 0, "premise did not hold: the streams had finished before the embeddings"
    assert texts == want


def test_a_client_that_leaves_aborts_its_inputs_in_the_engine(server) -> None:
    url, _, model = server
    aborted = 'dpserve:request_success_total{finished_reason="abort"'
    before = (metric_sum(url, "dpserve:pooling_requests_total"), abort_count(url, aborted))
    # 16 inputs of 500 tokens on rank 0: 8000 tokens, over many 512-token steps.
    body = {"model": model, "input": [[7 + i] * 500 for i in range(MAX_INPUTS)]}

    async def leave_mid_way() -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            call = asyncio.create_task(http.post(url + "/v1/embeddings", json=body,
                                                 headers={"X-data-parallel-rank": "0"}))
            deadline = time.monotonic() + 60
            while not (running := await asyncio.to_thread(running_on, url, 0)):
                assert time.monotonic() < deadline and not call.done(), (
                    "premise did not hold: rank 0 never ran the inputs")
            call.cancel()  # hang up
            return running

    held = asyncio.run(leave_mid_way())
    print(f"premise: rank 0 ran {held} of the inputs when the client left")
    wait_until(lambda: abort_count(url, aborted) > before[1], 30, "the inputs to be aborted")
    wait_until(lambda: not leftovers(url), 30, "no per-request state left")
    finished = metric_sum(url, "dpserve:pooling_requests_total") - before[0]
    assert finished < MAX_INPUTS, "every input ran to the end: the hang-up aborted none"


def abort_count(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))
