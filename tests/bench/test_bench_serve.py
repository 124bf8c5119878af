"""The serving load generator (dpserve/benchmark/serve.py) against a fake server.

`FakeOpenAIServer` is NOT dpserve: it is a minimal OpenAI-compatible streaming
server that lives only in this test, so the load generator can be checked
without a model. It streams `max_tokens` one-word chunks with fixed delays and
a usage chunk, records the bodies it gets and the most requests it had in
flight, and can be told to fail every k-th request (HTTP 500 or an error event
mid-stream) or to stall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dpserve.benchmark import serve
from dpserve.benchmark.serve import BenchConfig, add_cli_args, main, make_prompts, run_benchmark


class FakeOpenAIServer:
    """Fake OpenAI-compatible streaming server for testing the load generator only."""

    def __init__(self, first_token_delay: float = 0.05, token_delay: float = 0.005,
                 fail_every: int = 0, fail_mode: str = "http") -> None:
        self.first_token_delay = first_token_delay
        self.token_delay = token_delay
        self.fail_every = fail_every  # fail arrivals k, 2k, ... (0 = never)
        self.fail_mode = fail_mode  # "http": 500 up front; "stream": error event after 2 tokens
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.bodies.append(body)
            fail = self.fail_every and len(self.bodies) % self.fail_every == 0
            if fail and self.fail_mode == "http":
                return JSONResponse({"error": {"message": "fake failure"}}, status_code=500)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return StreamingResponse(self._stream(body, bool(fail)),
                                     media_type="text/event-stream")

        return app

    async def _stream(self, body: dict, fail: bool):
        chat = "messages" in body
        prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
        n = body["max_tokens"]

        def chunk(text: str | None, usage: dict | None = None) -> str:
            choices = [] if text is None else [
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}]
            return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n"

        try:
            if chat:
                yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
            await asyncio.sleep(self.first_token_delay)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.token_delay)
                if fail and i == 2:
                    yield 'data: {"error": {"message": "fake failure mid-stream"}}\n\n'
                    return
                yield chunk(f" w{i}")
            yield chunk(None, {"prompt_tokens": len(prompt), "completion_tokens": n,
                               "total_tokens": len(prompt) + n})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def __enter__(self) -> FakeOpenAIServer:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self._app(), log_level="warning", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=5)


def _run(server: FakeOpenAIServer, **kw) -> tuple:
    config = BenchConfig(base_url=server.base_url, **kw)
    return config, asyncio.run(run_benchmark(config))


def test_completions_counts_latency_and_concurrency() -> None:
    with FakeOpenAIServer(first_token_delay=0.05, token_delay=0.005) as server:
        config, res = _run(server, num_prompts=20, concurrency=4, prompt_len=32,
                           output_len=8, warmup=2, vocab_size=1000)
    assert (res.completed, res.failed, res.not_sent) == (20, 0, 0)
    assert res.model == "fake-model"  # discovered from /v1/models
    assert len(server.bodies) == 22  # warm-up requests sent but not counted
    assert server.max_in_flight == 4  # reached, never exceeded
    for body in server.bodies:
        assert body["ignore_eos"] is True and body["max_tokens"] == 8
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["model"] == "fake-model"
        assert len(body["prompt"]) == 32 and all(100 <= t < 1000 for t in body["prompt"])
    assert res.total_output_tokens == 20 * 8 and res.total_input_tokens == 20 * 32
    for r in res.requests:
        assert r.ok and r.output_tokens == 8 and len(r.itl_s) == 7
        assert r.ttft_s >= 0.05 and r.e2e_s >= r.ttft_s
    for lat in (res.ttft_ms, res.itl_ms, res.e2e_ms):
        assert 0 < lat.p50 <= lat.p90 <= lat.p99
    assert res.ttft_ms.p50 >= 50.0
    assert res.output_throughput == pytest.approx(160 / res.duration_s)
    assert res.request_throughput == pytest.approx(20 / res.duration_s)
    assert res.total_token_throughput == pytest.approx((160 + 640) / res.duration_s)


def test_chat_endpoint_skips_role_chunk() -> None:
    with FakeOpenAIServer(first_token_delay=0.03) as server:
        _, res = _run(server, endpoint="chat", model="named", num_prompts=6, concurrency=3,
                      prompt_len=10, output_len=5, warmup=0)
    assert (res.completed, res.failed) == (6, 0)
    body = server.bodies[0]
    assert body["model"] == "named" and len(body["messages"][0]["content"].split()) == 10
    assert all(r.ttft_s >= 0.03 and len(r.itl_s) == 4 for r in res.requests)
    assert res.total_output_tokens == 30


@pytest.mark.parametrize("mode", ["http", "stream"])
def test_failures_counted_with_error_text(mode: str) -> None:
    with FakeOpenAIServer(first_token_delay=0.01, fail_every=3, fail_mode=mode) as server:
        _, res = _run(server, num_prompts=9, concurrency=2, output_len=4, warmup=0)
    assert (res.completed, res.failed) == (6, 3)
    failed = [r for r in res.requests if not r.ok]
    assert all(("HTTP 500" if mode == "http" else "mid-stream") in r.error for r in failed)
    assert res.total_output_tokens == 6 * 4  # failed requests are not counted


def test_request_timeout_and_max_duration_bound_the_run() -> None:
    with FakeOpenAIServer(first_token_delay=5.0) as server:
        _, res = _run(server, num_prompts=2, concurrency=2, warmup=0, timeout=0.3)
    assert (res.completed, res.failed) == (0, 2)
    assert all(r.error.startswith("timeout") for r in res.requests)
    assert res.ttft_ms is None

    # Unbounded, this run would take ~40 s (200 requests of ~0.4 s, 2 at a time);
    # --max-duration must end it after ~1.5 s (a generous bound for a loaded machine).
    with FakeOpenAIServer(first_token_delay=0.01, token_delay=0.05) as server:
        t0 = time.monotonic()
        _, res = _run(server, num_prompts=200, concurrency=2, output_len=8, warmup=1,
                      max_duration=1.5)
    assert time.monotonic() - t0 < 25.0  # far below the ~40 s unbounded, even when loaded
    assert res.completed > 0 and res.not_sent > 0
    assert res.completed + res.failed + res.not_sent == 200
    assert all("max-duration" in r.error for r in res.requests if not r.ok)


def test_a_swallowed_cancellation_does_not_run_past_max_duration(monkeypatch) -> None:
    """Python 3.11's wait_for can lose a cancellation that lands as its request ends;
    the worker must still stop at the deadline instead of sending every prompt."""
    sent: list[int] = []

    async def fake_send_swallowing_cancellation(client, config, model, prompt, rec) -> None:
        sent.append(1)
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # the lost cancellation: the request ends normally
        rec.ok, rec.output_tokens = True, 1

    monkeypatch.setattr(serve, "_send", fake_send_swallowing_cancellation)
    config = BenchConfig(base_url="http://127.0.0.1:9", model="m", num_prompts=400,
                         concurrency=2, warmup=0, max_duration=0.5)
    res = asyncio.run(run_benchmark(config))
    assert res.not_sent > 0 and len(sent) == res.completed + res.failed < 400
    assert res.completed + res.failed + res.not_sent == 400


def test_main_writes_json_and_markdown(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    defaults = parser.parse_args([])
    assert (defaults.num_prompts, defaults.concurrency, defaults.prompt_len,
            defaults.output_len, defaults.warmup, defaults.endpoint) == (64, 16, 128, 64, 2,
                                                                        "completions")
    out, md = tmp_path / "r.json", tmp_path / "B.md"
    with FakeOpenAIServer(first_token_delay=0.01) as server:
        args = parser.parse_args(["--base-url", server.base_url + "/v1", "--num-prompts", "5",
                                  "--concurrency", "2", "--output-len", "3", "--api-key", "s3",
                                  "--json-out", str(out), "--append-md", str(md)])
        assert main(args) == 0
    assert server.bodies and "Output throughput (tok/s)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["config"]["num_prompts"] == 5 and doc["config"]["concurrency"] == 2
    assert doc["config"]["api_key"] == "***" and doc["completed"] == 5
    assert doc["total_output_tokens"] == 15 and len(doc["requests"]) == 5
    text = md.read_text()
    assert "## bench serve" in text and "- command: `" in text and "- machine: " in text


def test_prompts_are_seeded_and_config_validated() -> None:
    config = BenchConfig(prompt_len=16, vocab_size=500)
    assert make_prompts(config, 3, seed=7) == make_prompts(config, 3, seed=7)
    assert make_prompts(config, 3, seed=7) != make_prompts(config, 3, seed=8)
    with pytest.raises(ValueError, match="concurrency"):
        BenchConfig(concurrency=0)
    with pytest.raises(ValueError, match="endpoint"):
        BenchConfig(endpoint="embeddings")


def test_prompt_mix_exact_proportions_seeded_order() -> None:
    config = BenchConfig(prompt_mix="16:4,64:1", vocab_size=500)
    prompts = make_prompts(config, 20, seed=3)
    lengths = [len(p) for p in prompts]
    assert sorted(lengths) == [16] * 16 + [64] * 4  # exact: 20 is a multiple of 4 + 1
    assert make_prompts(config, 20, seed=3) == prompts  # same seed, same sequence
    assert [len(p) for p in make_prompts(config, 20, seed=4)] != lengths  # shuffled by seed
    assert lengths != [16, 16, 16, 16, 64] * 4
    chat = BenchConfig(endpoint="chat", prompt_mix="3:1,7:1")
    assert sorted(len(p.split()) for p in make_prompts(chat, 4, seed=0)) == [3, 3, 7, 7]
    # Without a mix the prompts are what they always were (comparable across versions).
    plain = BenchConfig(prompt_len=16, vocab_size=500)
    rng = random.Random(7)
    assert make_prompts(plain, 2, seed=7) == [[rng.randrange(100, 500) for _ in range(16)]
                                              for _ in range(2)]
    for bad in ("", "16", "16:0", "16:4,x:1", "16:4:2", "0:1"):
        with pytest.raises(ValueError, match="prompt_mix"):
            BenchConfig(prompt_mix=bad)


def test_prompt_mix_from_cli_reaches_the_server(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    md = tmp_path / "B.md"
    with FakeOpenAIServer(first_token_delay=0.01) as server:
        args = parser.parse_args(["--base-url", server.base_url, "--num-prompts", "6",
                                  "--concurrency", "2", "--output-len", "2", "--warmup", "0",
                                  "--prompt-mix", "8:2,40:1", "--append-md", str(md)])
        assert main(args) == 0
    assert sorted(len(b["prompt"]) for b in server.bodies) == [8, 8, 8, 8, 40, 40]
    assert "mixed 8:2,40:1 prompt -> 2 output tokens" in md.read_text()
    assert main(parser.parse_args(["--prompt-mix", "8:2,40"])) == 2


def test_main_reports_unreachable_server(capsys) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert main(parser.parse_args(["--base-url", f"http://127.0.0.1:{port}"])) == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err
    assert main(parser.parse_args(["--concurrency", "0"])) == 2
    assert "concurrency must be at least 1" in capsys.readouterr().err


def test_given_prompts_are_sent_in_order() -> None:
    """run_benchmark(config, prompts): those prompts (after the random warm-up), in order."""
    prompts = [[100 + i] * (3 + i) for i in range(5)]
    with FakeOpenAIServer() as server:
        config = BenchConfig(base_url=server.base_url, concurrency=1, warmup=1, output_len=2)
        res = asyncio.run(run_benchmark(config, prompts))
        sent = [b["prompt"] for b in server.bodies]
    assert res.completed == 5 and res.failed == 0
    assert sent[1:] == prompts and sent[0] not in prompts
    assert [r.prompt_tokens for r in res.requests] == [3, 4, 5, 6, 7]
