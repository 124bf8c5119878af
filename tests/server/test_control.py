"""Pause / resume, sleep / wake_up and admission control, on real `dpserve serve`
processes with a tiny model, hit by the official `openai` client.

Servers (module-scoped, each test leaves them resumed and awake):
* `dp_server`: DP 2 (a coordinator), 2 API servers, the admin API;
* `one_server`: DP 1 (no coordinator: engine utility calls), an API key, a fixed
  KV cache of 128 MiB, max 2 running and 2 queued requests;
* `lockstep_server`: DP 2 in lockstep, the admin API.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from helpers import descendants, metric, proc_named, serve_all, wait_until

pytestmark = pytest.mark.procs

KEY = "control-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KV_BLOCKS = 16384  # x 16 tokens x 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes = 128 MiB
KV_BYTES = KV_BLOCKS * 16 * 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """The three servers, started at once (their start-ups overlap)."""
    model = str(tiny_llama)
    with serve_all([model, "--data-parallel-size", "2", "--api-server-count", "2",
                    "--enable-admin-api", "--allow-unauthenticated-admin"],
                   [model, "--enable-admin-api", "--no-enable-elastic-ep", "--api-key", KEY,
                    "--num-kv-blocks",
                    str(KV_BLOCKS), "--max-num-seqs", "2", "--max-num-queued-requests", "2"],
                   [model, "--data-parallel-size", "2", "--data-parallel-lockstep",
                    "--enable-admin-api", "--allow-unauthenticated-admin"],
                   headers=AUTH, timeout=240) as started:
        yield {name: (proc, url, model) for name, (proc, url) in
               zip(("dp", "one", "lockstep"), started)}


@pytest.fixture(scope="module")
def dp_server(servers):
    return servers["dp"]


@pytest.fixture(scope="module")
def one_server(servers):
    return servers["one"]


@pytest.fixture(scope="module")
def lockstep_server(servers):
    return servers["lockstep"]


def _post(url: str, path: str, headers: dict | None = None, **params) -> dict:
    resp = httpx.post(url + path, params=params, json={}, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


class _Stream(threading.Thread):
    """One greedy streamed completion in a thread: chunk arrival times, usage, finish."""

    def __init__(self, url: str, model: str, max_tokens: int, key: str = "unused") -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.max_tokens = _client(url, key), model, max_tokens
        self.times: list[float] = []
        self.finish: str | None = None
        self.tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model, prompt="the pause test", max_tokens=self.max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    self.times.append(time.monotonic())
                    self.finish = choice.finish_reason or self.finish
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def started(self, chunks: int = 3) -> None:
        wait_until(lambda: len(self.times) >= chunks or not self.is_alive(), 60,
                   "the stream's first chunks")
        assert self.is_alive(), f"stream ended too soon: {self.error} {self.finish}"


def _greedy(url: str, model: str, key: str = "unused") -> str:
    out = _client(url, key).completions.create(model=model, prompt="sleep and wake",
                                               max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
    return out.choices[0].text


def _rejected(url: str, model: str, key: str = "unused") -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        _client(url, key).completions.create(model=model, prompt="hi", max_tokens=2)
    return info.value


def _round_trip(url: str) -> None:
    """A call through every engine's busy loop (each answers it between steps)."""
    assert httpx.get(url + "/debug/request_state", timeout=30).status_code == 200


def _generated(url: str) -> float:
    """Tokens the API servers have had from the engines (counted as outputs come)."""
    return metric(url, "dpserve:generation_tokens_total")


def _settled_count(url: str, stream: _Stream) -> tuple[int, float]:
    """The stream's chunk count and the tokens the engines sent, once both hold over 5
    round trips through every engine (outputs made before a pause have arrived)."""
    deadline = time.monotonic() + 60
    seen, held = (len(stream.times), _generated(url)), 0
    while held < 5:
        assert time.monotonic() < deadline, f"the stream never settled while paused: {seen}"
        _round_trip(url)
        now = (len(stream.times), _generated(url))
        held = held + 1 if now == seen else 0
        seen = now
    return seen


def test_pause_keep_leaves_a_gap_and_resume_finishes(dp_server):
    _, url, model = dp_server
    stream = _Stream(url, model, max_tokens=600)
    stream.start()
    stream.started()
    try:
        assert _post(url, "/pause", mode="keep")["pause_mode"] == "keep"
        # Outputs made before the pause may still be on their way: settled once the
        # client's count holds over 5 round trips through every engine.
        frozen, generated = _settled_count(url, stream)
        frozen_at = time.monotonic()
        # Paused, each engine answers calls (its loop runs) but makes no token: over 20
        # more round trips no engine sends one and none reaches the client.
        for _ in range(20):
            _round_trip(url)
        assert _generated(url) == generated, "an engine made tokens while paused (keep)"
        assert len(stream.times) == frozen, "tokens arrived while paused (keep)"
        assert stream.is_alive()
        resumed_at = time.monotonic()
    finally:
        _post(url, "/resume")
    stream.join(120)
    assert stream.error is None, stream.error
    assert (stream.finish, stream.tokens) == ("length", 600)
    gaps = [b - a for a, b in zip(stream.times, stream.times[1:])]
    assert max(gaps) >= resumed_at - frozen_at  # the pause left its gap in the stream


def test_pause_abort_ends_requests_in_flight(dp_server):
    _, url, model = dp_server
    streams = [_Stream(url, model, max_tokens=600) for _ in range(2)]
    for s in streams:
        s.start()
    for s in streams:
        s.started()
    try:
        _post(url, "/pause", mode="abort")
        for s in streams:
            s.join(60)
            assert s.error is None, s.error
            assert s.finish == "abort"
            assert s.tokens is not None and s.tokens < 600
        error = _rejected(url, model)
        assert error.status_code == 503 and error.code == "server_paused"
        assert error.response.headers["retry-after"]
    finally:
        _post(url, "/resume")
    assert _greedy(url, model)


def _held(url: str) -> int:
    """Requests the engines hold now, all together (asked of each engine)."""
    engines = httpx.get(url + "/debug/request_state", timeout=30).json()["engines"]
    return sum(state["client_of"] for state in engines.values())


def test_pause_wait_answers_after_requests_finish(dp_server):
    _, url, model = dp_server
    # Long (the tiny model's context is 1,024): the pause must find it in flight.
    stream = _Stream(url, model, max_tokens=1000)
    stream.start()
    stream.started()
    answer: dict = {}
    pauser = threading.Thread(target=lambda: answer.update(_post(url, "/pause", mode="wait")))
    try:
        pauser.start()
        wait_until(lambda: httpx.get(url + "/is_paused").json()["is_paused"], 30, "paused")
        rejected = _rejected(url, model)
        # The premise: the pause was still waiting on the stream, which an engine held.
        held = _held(url)
        assert held > 0, ("premise did not hold: no engine held the stream after the "
                          "rejection, so the pause was no longer waiting on it")
        assert rejected.code == "server_paused"
        pauser.join(120)
        assert answer["is_paused"]
        # Answered once the engines hold no request: the stream ends in full, not aborted
        # (its last chunks may still be on their way to the client).
        stream.join(60)
        assert stream.error is None, stream.error
        assert (stream.finish, stream.tokens) == ("length", 1000)
    finally:
        pauser.join(120)
        _post(url, "/resume")


def test_state_is_the_same_on_every_api_server(dp_server):
    _, url, model = dp_server

    def seen(path: str, key: str) -> set[bool]:  # fresh connections: either API server
        return {httpx.get(url + path, headers={"Connection": "close"}).json()[key]
                for _ in range(12)}

    assert seen("/is_paused", "is_paused") == {False}
    try:
        _post(url, "/pause", mode="keep")
        assert seen("/is_paused", "is_paused") == {True}
        _post(url, "/sleep", level=1)
        assert seen("/is_sleeping", "is_sleeping") == {True}
        assert _rejected(url, model).code == "server_sleeping"
    finally:
        _post(url, "/wake_up")
        _post(url, "/resume")
    assert seen("/is_paused", "is_paused") == {False}
    assert seen("/is_sleeping", "is_sleeping") == {False}
    assert _post(url, "/reset_prefix_cache")["status"] == "ok"
    assert _greedy(url, model)


def _engine_rss(proc: subprocess.Popen) -> int:
    return proc_named(descendants(proc.pid), "EngineCore_0").memory_info().rss


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wake_up_serves_the_same(one_server, level):
    proc, url, model = one_server
    before_text = _greedy(url, model, KEY)
    before = _engine_rss(proc)
    try:
        state = _post(url, "/sleep", headers=AUTH, level=level)
        assert state["sleep_level"] == level
        asleep = _engine_rss(proc)
        assert before - asleep >= 0.7 * KV_BYTES, (before, asleep, KV_BYTES)
        assert httpx.get(url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
        error = _rejected(url, model, KEY)
        assert error.status_code == 503 and error.code == "server_sleeping"
    finally:
        _post(url, "/wake_up", headers=AUTH)
    assert _engine_rss(proc) - asleep >= 0.7 * KV_BYTES  # the KV cache is back
    assert _greedy(url, model, KEY) == before_text


def test_control_routes_need_the_api_key(one_server):
    _, url, _ = one_server
    assert httpx.post(url + "/pause").status_code == 401
    assert httpx.get(url + "/is_paused").status_code == 401
    assert httpx.post(url + "/sleep", params={"level": 3}, json={},
                      headers=AUTH).status_code == 400
    assert httpx.post(url + "/pause", params={"mode": "x"}, json={},
                      headers=AUTH).status_code == 400


def test_overload_gets_429_with_retry_after_then_normal_service(one_server):
    _, url, model = one_server

    async def one(client: openai.AsyncOpenAI) -> object:
        try:
            out = await client.completions.create(model=model, prompt="overload", max_tokens=48,
                                                  temperature=0, extra_body={"ignore_eos": True})
            return out.usage.completion_tokens
        except openai.RateLimitError as e:
            return e

    async def burst() -> list[object]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                                    timeout=120)
        return await asyncio.gather(*(one(client) for _ in range(20)))

    results = asyncio.run(burst())
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert limited and served, results
    assert all(r == 48 for r in served), results
    for e in limited:
        assert e.status_code == 429 and e.code == "too_many_requests"
        assert int(e.response.headers["retry-after"]) >= 1
    assert _greedy(url, model, KEY)


def _dp_waves(url: str) -> dict[str, tuple[int, bool]]:
    """Each engine's (wave, running) (a round trip through every engine's loop)."""
    engines = httpx.get(url + "/debug/dp_state", timeout=30).json()["engines"]
    return {rank: (state["dp"]["wave"], state["dp"]["running"])
            for rank, state in engines.items()}


def test_paused_requests_get_503_and_start_no_wave(lockstep_server):
    _, url, model = lockstep_server
    first = metric(url, "dpserve:dp_wave")
    assert _greedy(url, model)  # one wave runs, and ends
    wait_until(lambda: metric(url, "dpserve:dp_wave") > first, 30, "the first wave's end")
    try:
        _post(url, "/pause", mode="abort")
        wave = metric(url, "dpserve:dp_wave")
        waves = _dp_waves(url)
        for _ in range(5):
            error = _rejected(url, model)
            assert error.status_code == 503 and error.code == "server_paused"
        # No wave starts: over 20 round trips through every engine's loop (a wave the
        # rejected requests had started would run there), no engine runs one or moves
        # on from the wave it was in, and neither does the front-end's count.
        for _ in range(20):
            assert _dp_waves(url) == waves, "a wave started while paused"
        assert metric(url, "dpserve:dp_wave") == wave
    finally:
        _post(url, "/resume")
    assert _greedy(url, model)
    wait_until(lambda: metric(url, "dpserve:dp_wave") > wave, 30, "a wave after resume")


@pytest.mark.parametrize("option, value", [("--max-num-queued-requests", "0"),
                                           ("--max-num-queued-tokens", "-5"),
                                           ("--max-num-queued-requests", "many")])
def test_bad_queue_limits_are_one_line_errors(tiny_llama, option, value):
    result = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                             "--port", "0", option, value], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert option in last and "Traceback" not in result.stderr, result.stderr

