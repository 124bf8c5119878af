"""The OpenAI-compatible server, end to end over real HTTP.

uvicorn serves `build_app(AsyncLLM(InprocEngineClient))` on 127.0.0.1 (a free
port, a thread of its own) over the tiny random Llama; the official `openai`
client (sync and async) and raw httpx talk to it. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
import openai
import pytest
from helpers import serve_app

from dpserve.config import EngineArgs
from dpserve.frontend.async_llm import AsyncLLM
from dpserve.server.app import build_app
from dpserve.testing.inproc_client import InprocEngineClient

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
NUM_KV_BLOCKS = 512
BODY_LIMIT = 64 * 1024
PROMPTS = [f"{w} number {i}" for i, w in enumerate(
    ["Hello", "The quick brown fox", "Data parallel serving", "Once upon a time",
     "def add(x, y):", "1 2 3 4", "Hello world, how are you", "The lazy dog"] * 4)]


@dataclass
class Served:
    url: str
    llm: AsyncLLM
    client: InprocEngineClient
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        """Run a coroutine on the server's loop (where the AsyncLLM lives)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self):
        return self.call(self.llm.get_stats())


@contextlib.contextmanager
def serve(model_path, **app_kw):
    config = EngineArgs(model=str(model_path), num_kv_blocks=NUM_KV_BLOCKS).create_config()
    client = InprocEngineClient(config)
    llm = AsyncLLM(config, client)
    app = build_app(llm, MODEL, max_request_body_bytes=BODY_LIMIT, **app_kw)
    with serve_app(app, stop_first=llm.shutdown) as (url, loop):
        yield Served(url, llm, client, loop)


@pytest.fixture(scope="module")
def srv(tiny_llama):
    with serve(tiny_llama) as served:
        yield served


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client


def wait_idle(srv: Served, timeout: float = 30.0) -> None:
    """Until the engine runs nothing and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.stats()
        if stats.num_running == stats.num_waiting == 0 and (
                stats.num_free_blocks == srv.client.num_kv_blocks):
            return
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.05)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# ---- happy paths (official client) -----------------------------------------------


def test_completion_and_chat_usage(srv, oai):
    tok = srv.llm.tokenizer
    out = oai.completions.create(model=MODEL, prompt="Hello world", max_tokens=7, **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.prompt_tokens == len(tok.encode("Hello world"))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                       **GREEDY)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.prompt_tokens == len(srv.llm.apply_chat_template(messages))
    assert chat.usage.completion_tokens == 5


def test_streaming_equals_non_streaming(oai):
    full = oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, **GREEDY)
    chunks = list(oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=12,
                                         stream=True, stream_options={"include_usage": True},
                                         **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])

    msgs = [{"role": "user", "content": "Hello"}]
    full = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, **GREEDY)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                              stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_n_and_seed(oai):
    full = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=16, **GREEDY)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"greedy text too short to cut: {text!r}"
    cut = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=16, stop=[stop],
                                 **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    streamed = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=16, stop=stop,
                                      stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text

    kw = dict(model=MODEL, prompt="The", max_tokens=8, n=3, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice samples on its own
    assert a.usage.completion_tokens == 24


def test_logprobs_shape(oai):
    out = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=3,
                                 **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # The sampled token, then the best 3 (distinct ids may decode to the same text).
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(
            max(top.values()))  # greedy: the sampled token is the best one

    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        logprobs=True, top_logprobs=1, stream=True, **GREEDY))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_32_concurrent_greedy_streams_match_offline(srv, tiny_llama):
    from dpserve import LLM, SamplingParams

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_streams() -> list[str]:
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none",
                                      max_retries=0, timeout=60) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in PROMPTS)), 60)

    texts = asyncio.run(all_streams())
    offline = LLM(str(tiny_llama), num_kv_blocks=NUM_KV_BLOCKS).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert texts == [o.outputs[0].text for o in offline]
    wait_idle(srv)


# ---- bad input (raw HTTP) ---------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def _c(**kw: Any) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def _ch(**kw: Any) -> dict:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **kw}


BAD = [  # (id, path, body (dict, or raw bytes), status, param)
    ("invalid-json", C, b'{"prompt": "hi", ', 400, None),
    ("not-an-object", C, b"[1, 2]", 400, None),
    ("empty-body", CH, b"", 400, None),
    ("max-tokens-string", C, _c(max_tokens="5"), 400, "max_tokens"),
    ("temperature-string", CH, _ch(temperature="hot"), 400, "temperature"),
    ("prompt-number", C, _c(prompt=5), 400, "prompt"),
    ("messages-string", CH, _ch(messages="hi"), 400, "messages"),
    ("bad-role", CH, _ch(messages=[{"role": "robot", "content": "x"}]), 400, "messages"),
    ("image-part", CH, _ch(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages"),
    ("missing-prompt", C, {"model": MODEL}, 400, "prompt"),
    ("missing-messages", CH, {"model": MODEL}, 400, "messages"),
    ("empty-prompt", C, _c(prompt=""), 400, "prompt"),
    ("empty-token-list", C, _c(prompt=[]), 400, "prompt"),
    ("empty-messages", CH, _ch(messages=[]), 400, "messages"),
    ("unknown-model", C, _c(model="gpt-9"), 404, "model"),
    ("max-tokens-0", C, _c(max_tokens=0), 400, "max_tokens"),
    ("max-completion-tokens-0", CH, _ch(max_completion_tokens=0), 400,
     "max_completion_tokens"),
    ("over-context", C, _c(max_tokens=5000), 400, "max_tokens"),
    ("chat-over-context", CH, _ch(max_tokens=5000), 400, "max_tokens"),
    ("prompt-over-context", C, _c(prompt=[5] * 1100), 400, "prompt"),
    ("temperature-high", C, _c(temperature=2.5), 400, "temperature"),
    ("temperature-negative", CH, _ch(temperature=-0.1), 400, "temperature"),
    ("top-p-0", C, _c(top_p=0), 400, "top_p"),
    ("top-p-high", CH, _ch(top_p=1.5), 400, "top_p"),
    ("top-k", C, _c(top_k=-2), 400, "top_k"),
    ("seed-overflow", C, _c(seed=2**70), 400, "seed"),
    ("n-0", C, _c(n=0), 400, "n"),
    ("n-17", CH, _ch(n=17), 400, "n"),
    ("presence-penalty", C, _c(presence_penalty=3), 400, "presence_penalty"),
    ("min-tokens", C, _c(min_tokens=9), 400, "min_tokens"),
    ("logprobs-21", C, _c(logprobs=21), 400, "logprobs"),
    ("logprobs-negative", C, _c(logprobs=-1), 400, "logprobs"),
    ("top-logprobs-21", CH, _ch(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-alone", CH, _ch(top_logprobs=2), 400, "top_logprobs"),
    ("five-stops", C, _c(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("long-stop", CH, _ch(stop="x" * 300), 400, "stop"),
    ("token-outside-vocab", C, _c(prompt=[1, 2, 99999]), 400, "prompt"),
    ("negative-token", C, _c(prompt=[[1, -1]]), 400, "prompt"),
    ("tools", CH, _ch(tools=[{"type": "function", "function": {"nam": "f"}}]), 400, "tools"),
    ("tool-choice", CH, _ch(tool_choice="auto"), 400, "tool_choice"),
    ("functions", CH, _ch(functions=[{"name": "f"}]), 400, "functions"),
    ("format-type", CH, _ch(response_format={"type": "yaml"}), 400, "response_format"),
    ("json-schema", CH, _ch(response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format"),
    ("logit-bias", C, _c(logit_bias={"five": 10}), 400, "logit_bias"),
    ("logit-bias-range", C, _c(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit-bias-vocab", C, _c(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("suffix", C, _c(suffix="end"), 400, "suffix"),
    ("best-of", C, _c(best_of=3), 400, "best_of"),
    ("echo", C, _c(echo=True, logprobs=1), 400, "echo"),
    ("stream-options-alone", C, _c(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("too-large", C, _c(prompt="x" * (BODY_LIMIT + 10)), 413, None),
]


def _send(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


def _check_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if status == 400 and param in {"tools", "tool_choice", "functions", "response_format",
                                   "logit_bias", "suffix", "best_of", "echo"}:
        assert param in error["message"]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_input(http, path, body, status, param):
    _check_error(_send(http, path, body), status, param)
    # Streaming requests fail the same way, with a status, before any stream starts.
    if isinstance(body, dict) and status == 400 and param != "stream_options":
        _check_error(_send(http, path, {**body, "stream": True}), status, param)


def test_bad_input_never_disturbs_requests_in_flight(srv, http, oai):
    body = _c(prompt="Hello", max_tokens=300, ignore_eos=True, temperature=0, stream=True,
              stream_options={"include_usage": True})
    with http.stream("POST", C, json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"]
        for _, path, bad, status, param in BAD:
            _check_error(_send(http, path, bad), status, param)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 300
    # Greedy, so the answer is fixed (sampled, three tokens may decode to nothing).
    after = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert after.usage.completion_tokens == 3 and after.choices[0].text.strip()
    for path, method in [("/nope", "GET"), (C, "GET")]:
        r = http.request(method, path)
        assert r.status_code in (404, 405) and set(r.json()["error"]) >= {"message", "type"}
    wait_idle(srv)


# ---- auth, health, metrics, models, version -------------------------------------


def test_api_key(tiny_llama, monkeypatch):
    monkeypatch.setenv("DPSERVE_API_KEY", "sekrit")
    with serve(tiny_llama) as served, httpx.Client(base_url=served.url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = http.post(C, json=_c(), headers=headers)
            _check_error(r, 401, None)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        ok = openai.OpenAI(base_url=served.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                     **GREEDY).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=served.url + "/v1", api_key="bad", max_retries=0
                          ).models.list()


def test_health_models_version_metrics(srv, http, oai):
    assert http.get("/health").status_code == 200
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/version").json()["version"]
    oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = http.get("/metrics").text
    for name in ("dpserve:request_success_total", "dpserve:prompt_tokens_total",
                 "dpserve:generation_tokens_total", "dpserve:time_to_first_token_seconds",
                 "dpserve:inter_token_latency_seconds", "dpserve:e2e_request_latency_seconds",
                 "dpserve:num_requests_running", "dpserve:num_requests_waiting",
                 "dpserve:kv_cache_usage_perc", "dpserve:prefix_cache_hit_rate"):
        assert name in text, name
    assert re.search(r'dpserve:num_requests_running\{engine="0",model_name="tiny"\}', text)
    generated = re.search(r'dpserve:generation_tokens_total\{model_name="tiny"\} (\S+)', text)
    assert generated and float(generated.group(1)) >= 3


# ---- disconnects and a dying engine -----------------------------------------------


def _metric(http: httpx.Client, pattern: str) -> float:
    match = re.search(pattern + r" (\S+)", http.get("/metrics").text)
    assert match, pattern
    return float(match.group(1))


def test_disconnect_mid_stream_frees_the_request(srv, http):
    aborted = r'dpserve:request_success_total\{finished_reason="abort",model_name="tiny"\}'
    before = _metric(http, aborted)
    body = _c(max_tokens=900, ignore_eos=True, stream=True)
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        with client.stream("POST", C, json=body) as stream:
            lines = stream.iter_lines()
            for _ in range(6):
                next(lines)
            assert srv.stats().num_running == 1
    wait_idle(srv)  # long before 900 tokens could have been generated
    assert _metric(http, aborted) == before + 1
    assert _metric(http, r'dpserve:num_requests_running\{engine="0",model_name="tiny"\}') == 0
    assert _metric(http, r'dpserve:kv_cache_usage_perc\{engine="0",model_name="tiny"\}') == 0

    # A non-streaming client that gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + C, json=_c(max_tokens=900, ignore_eos=True),
                   timeout=httpx.Timeout(30, read=0.3))  # connecting may be slow
    wait_idle(srv)
    assert _metric(http, aborted) == before + 2


def test_async_llm_abort_and_aclose_free_requests(srv):
    from dpserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=800, ignore_eos=True)

    async def run() -> None:
        llm = srv.llm
        ids = llm.encode("Hello")
        stream = llm.generate(ids, params, "t-abort")
        assert not (await stream.__anext__()).finished
        await llm.abort("t-abort")  # from outside: the stream just ends
        rest = [out async for out in stream]
        assert not any(out.finished for out in rest)
        stream = llm.generate(ids, params, "t-close")
        await stream.__anext__()
        await stream.aclose()  # the consumer stops iterating
        assert llm.num_unfinished_requests == 0

    srv.call(run(), timeout=30)
    wait_idle(srv)


def test_dead_engine_fails_requests_at_once(tiny_llama):
    with serve(tiny_llama) as served, httpx.Client(base_url=served.url, timeout=30) as http:
        core = served.client.core
        real_step, calls = core.step, [0]

        def failing_step():
            calls[0] += 1
            if calls[0] > 20:
                raise RuntimeError("injected fault")
            return real_step()

        core.step = failing_step
        body = _c(max_tokens=500, ignore_eos=True)
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(http.post, C, json=body)  # in flight with the stream below
            with http.stream("POST", C, json={**body, "stream": True}) as stream:
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            _check_error(plain.result(timeout=20), 503, None)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and "injected fault" in error["message"]
        assert served.llm.is_dead
        _check_error(http.post(C, json=body), 503, None)
        _check_error(http.get("/health"), 503, None)


# ---- /engines and the admin routes with one in-process engine ------------------------


def test_engines_view_of_one_engine_and_no_admin_routes_without_the_flag(srv, http, oai):
    first = http.get("/engines").json()
    assert first["data_parallel_size"] == 1 and first["admin"] is False
    [row] = first["engines"]
    assert (row["rank"], row["state"], row["cordoned"], row["restarts"]) == (
        0, "serving", False, 0)
    # The engine's one worker (TP=1): this process, asked of the engine.
    [worker] = row["tp_workers"]
    assert (worker["tp_rank"], worker["pid"], worker["device"]) == (0, os.getpid(), "cpu")
    assert row["pid"] == os.getpid() and worker["rss_bytes"] > 0
    assert first["tensor_parallel_size"] == 1
    oai.completions.create(model=MODEL, prompt="Hello world", max_tokens=32, **GREEDY)
    [row] = http.get("/engines").json()["engines"]
    assert row["tokens_per_s"] > 0  # tokens were generated between the two polls
    resp = http.post("/engines/0/cordon")
    assert resp.status_code == 404 and "message" in resp.json()["error"]


def test_admin_routes_need_a_coordinator(tiny_llama):
    with serve(tiny_llama, enable_admin_api=True) as served:
        resp = httpx.post(served.url + "/engines/0/cordon", json={}, timeout=10)
        assert resp.status_code == 400, resp.text
        assert "coordinator" in resp.json()["error"]["message"]
        assert httpx.post(served.url + "/engines/0/reboot", json={},
                          timeout=10).status_code == 404
        assert httpx.get(served.url + "/engines", timeout=10).json()["admin"] is True
