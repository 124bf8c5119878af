"""Request limits, the structured-output compile deadline, cache_salt and --request-timeout.

Pure checks first (SamplingParams limits, salted prefix hashes, the salt combination,
the engine's compile deadline), then a real `dpserve serve` on a tiny random model hit
by httpx and the official openai client: every limit is a 400 whose message names the
field, the limit, the option and the value given; a pathological schema beside a live
stream gets its 400 within the deadline while the stream keeps its pace and its text;
equal salts share cached prompt blocks and different ones do not; a request past
--request-timeout is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import serve_all, stopping, wait_until

from dpserve.block_hash import hash_block, root_hash
from dpserve.engine.kv_cache import KVCacheManager
from dpserve.engine.request import Request
from dpserve.frontend.routing import PrefixTracker
from dpserve.sampling_params import SamplingParams
from dpserve.server.limits import request_salt
from dpserve.structured.grammar import FAULT_HOLD_COMPILE_ENV
from dpserve.structured.manager import StructuredOutputManager
from dpserve.structured.spec import StructuredOutputs

HELD = "dpserve-test-held-compile"  # a spec holding this text compiles once released


def held_schema(i: int = 0) -> dict:
    """A JSON schema (schema `i` of many) whose compile, engine's or API server's,
    waits until the test releases it (`FAULT_HOLD_COMPILE_ENV` names the release
    file): a compile past its deadline by construction, on a machine of any speed."""
    return {"type": "object", "properties": {f"{HELD}-{i}": {"type": "integer"}}}


def hold_compiles(release: Path) -> dict[str, str]:
    """The environment that holds the compiles of `held_schema`s until `release` exists."""
    return {FAULT_HOLD_COMPILE_ENV: f"{HELD}:{release}"}


# ---- pure checks --------------------------------------------------------------------------


def test_sampling_params_limits_name_the_field_limit_and_option() -> None:
    params = SamplingParams(stop_token_ids=list(range(300)),
                            logit_bias={i: 1.0 for i in range(2000)})
    with pytest.raises(ValueError) as e:
        params.check_limits()
    assert "stop_token_ids has 300 entries; at most 256" in str(e.value)
    assert "--max-stop-token-ids" in str(e.value)
    with pytest.raises(ValueError) as e:
        params.check_limits(max_stop_token_ids=300)
    assert "logit_bias has 2000 entries; at most 1024" in str(e.value)
    assert "--max-logit-bias" in str(e.value)
    params.check_limits(max_stop_token_ids=300, max_logit_bias=2000)  # raised: passes


def test_offline_llm_enforces_the_engine_limits(tiny_llama) -> None:
    """The engine's add_request applies --max-stop-token-ids / --max-logit-bias, so the
    offline LLM gets them (raised here, overridable) and goes on serving."""
    from dpserve import LLM

    with LLM(str(tiny_llama), max_stop_token_ids=4, max_logit_bias=2) as llm:
        with pytest.raises(ValueError, match=r"stop_token_ids has 5 entries; at most 4"):
            llm.generate("hi", SamplingParams(stop_token_ids=[1, 2, 3, 4, 5]), use_tqdm=False)
        with pytest.raises(ValueError, match=r"logit_bias has 3 entries; at most 2"):
            llm.generate("hi", SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}),
                         use_tqdm=False)
        out = llm.generate("hi", SamplingParams(max_tokens=3, stop_token_ids=[1, 2, 3, 4]),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1


def _hashes(prompt: list[int], salt: str | None) -> list[bytes]:
    kv = KVCacheManager(16, 4)
    request = Request("r", prompt, SamplingParams(), cache_salt=salt)
    kv.update_block_hashes(request)
    return request.block_hashes


def test_salted_prefix_hashes() -> None:
    prompt = list(range(1, 14))  # 3 full blocks of 4
    plain, a, a2, b = (_hashes(prompt, s) for s in (None, "a", "a", "b"))
    assert len(plain) == 3
    # Unsalted: today's chain (the root is the unsalted one).
    assert plain[0] == hash_block(None, prompt[:4]) == hash_block(root_hash(None), prompt[:4])
    assert a == a2  # equal salts share every block
    assert not set(a) & set(plain) and not set(a) & set(b)  # no block is shared otherwise
    # The router's record hashes the same way the engine does.
    tracker = PrefixTracker(4)
    assert tracker.hashes(prompt, "a") == a[:3] and tracker.hashes(prompt) == plain[:3]


def test_request_salt_cannot_collide_across_keys() -> None:
    assert request_salt("s", "key-a", per_key=False) == "s"
    assert request_salt(None, None, per_key=False) is None
    salts = [request_salt(user, key, per_key=True) for user, key in
             [(None, "key-a"), (None, "key-b"), ("s", "key-a"), ("s", "key-b"), (None, None)]]
    # A client who writes another key's salt as its own cache_salt gets something else.
    forged = request_salt(salts[0], "key-b", per_key=True)
    forged_unkeyed = request_salt(salts[0], None, per_key=True)
    assert len({*salts, forged, forged_unkeyed}) == 7 and None not in salts


def test_engine_compile_deadline_backstop(tiny_llama, tmp_path, monkeypatch) -> None:
    """The engine's compile pool (one thread here): a grammar not ready within the
    deadline (a held compile) fails its request with a message naming the option, and
    its thread is replaced, so a plain spec compiles while the held one still runs; the
    same spec then fails at once. Released, the written-off compile ends."""
    release = tmp_path / "release"
    for name, value in hold_compiles(release).items():
        monkeypatch.setenv(name, value)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    manager = StructuredOutputManager(str(tiny_llama), vocab, max_workers=1,
                                      compile_timeout=0.5)
    held = SamplingParams(structured_outputs=StructuredOutputs(json=held_schema()))
    try:
        manager.add(Request("held-1", [1, 2, 3], held))
        held_compile = manager.pending["held-1"].grammar.future
        failed: list = []
        wait_until(lambda: failed.extend(manager.take_ready()[1]) or failed, 60,
                   "the held grammar's deadline")
        assert [r.request_id for r, _ in failed] == ["held-1"]
        assert "--structured-outputs-compile-timeout" in failed[0][1]
        plain = SamplingParams(structured_outputs=StructuredOutputs(json_object=True))
        manager.add(Request("plain", [1, 2, 3], plain))
        done: list = []
        wait_until(lambda: done.extend(manager.take_ready()[0]) or done, 30,
                   "the plain grammar")
        assert [r.request_id for r in done] == ["plain"]
        assert not held_compile.done()  # held: still running on its written-off thread
        manager.add(Request("held-2", [1, 2, 3], held))
        ready, again = manager.take_ready()
        assert ready == [] and [r.request_id for r, _ in again] == ["held-2"]
        release.touch()
        held_compile.result(timeout=30)  # the written-off compile ends, and its thread
    finally:
        release.touch()
        manager.close()


# ---- through dpserve serve ------------------------------------------------------------------

COMPILE_TIMEOUT = 1.0
REQUEST_TIMEOUT = 1.5
# The timeout server's engine sleeps 10 ms before each forward (a test-only fault): a
# 1000-token request takes 10 s or more on any machine, past the timeout by construction.
SLOW_FORWARDS = {"DPSERVE_FAULT_FORWARD_DELAY_S": "0.01"}


TENANT_KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-fedcba9876543210"}


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    model = str(tiny_llama)
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{name} {key}\n" for name, key in TENANT_KEYS.items()))
    keys.chmod(0o600)
    # The limits server's held compiles are never released: its compile worker is
    # killed at each deadline.
    never = tmp_path_factory.mktemp("held") / "never-released"
    # One compile worker: the warm-up request starts it (a start-up is not the deadline's).
    with serve_all([model, "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT),
                    "--structured-outputs-compile-workers", "1"],
                   [model, "--request-timeout", str(REQUEST_TIMEOUT)],
                   [model, "--api-key-file", str(keys), "--prefix-cache-salt-per-key"],
                   env=[hold_compiles(never), SLOW_FORWARDS, {}], timeout=180) as started:
        yield dict(zip(("limits", "timeout", "per_key"), started))


@pytest.fixture(scope="module")
def server(servers):
    _, url = servers["limits"]
    return url, httpx.get(url + "/v1/models").json()["data"][0]["id"]


def _refused(url: str, path: str, body: dict | bytes, field: str, *words: str) -> dict:
    """POST; assert a 400 naming `field` whose message holds every one of `words`."""
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, timeout=60, **kw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


@pytest.mark.procs
def test_huge_stop_token_ids_and_logit_bias_are_refused_at_once(server) -> None:
    url, model = server
    ids = ",".join(["1"] * 1_900_000)  # 3.8 MB, under the 4 MiB body limit
    body = f'{{"model": "{model}", "prompt": "hi", "stop_token_ids": [{ids}]}}'.encode()
    start = time.monotonic()
    _refused(url, "/v1/completions", body, "stop_token_ids", "1900000", "256",
             "--max-stop-token-ids")
    bias = ",".join(f'"{i}": 1' for i in range(300_000))
    body = f'{{"model": "{model}", "prompt": "hi", "logit_bias": {{{bias}}}}}'.encode()
    _refused(url, "/v1/completions", body, "logit_bias", "300000", "1024", "--max-logit-bias")
    elapsed = time.monotonic() - start
    print(f"two ~4 MB refusals took {elapsed:.2f} s")
    assert elapsed < 10  # generous: parsing only, no engine step


@pytest.mark.procs
def test_every_cap_names_its_limit(server) -> None:
    url, model = server
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    cmpl = {"model": model, "prompt": "hi"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ("/v1/completions", {**cmpl, "stop": ["a"] * 5}, "stop", "5", "4", "--max-stop-strings"),
        ("/v1/completions", {**cmpl, "stop": ["x" * 300]}, "stop", "300", "256",
         "--max-stop-string-length"),
        ("/v1/chat/completions", {**chat, "tools": [tool] * 129}, "tools", "129", "128",
         "--max-tools"),
        ("/v1/chat/completions", {**chat, "tools": [{**tool, "function": {
            **tool["function"], "description": "d" * 300_000}}]}, "tools", "262144",
         "--max-tools-bytes"),
        ("/v1/completions", {**cmpl, "guided_choice": [str(i) for i in range(257)]},
         "guided_choice", "257", "256", "--max-structured-choices"),
        ("/v1/completions", {**cmpl, "structured_outputs": {"choice": ["c" * 40_000] * 2}},
         "structured_outputs", "65536", "--max-structured-choices-bytes"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "object", "description": "d" * 70_000}}}},
         "response_format", "65536", "--max-structured-outputs-bytes"),
        ("/v1/completions", {**cmpl, "guided_regex": "a" * 70_000}, "guided_regex", "70000",
         "--max-structured-outputs-bytes"),
        ("/v1/chat/completions", {**chat, "messages": chat["messages"] * 2049}, "messages",
         "2049", "2048", "--max-messages"),
        ("/v1/completions", {**cmpl, "prompt": ["hi"] * 9, "n": 16}, "n", "144", "128",
         "--max-request-fanout"),
        ("/v1/chat/completions", {**chat, "cache_salt": "s" * 257}, "cache_salt", "257", "256",
         "--max-cache-salt-length"),
    ]
    for path, body, field, *words in cases:
        _refused(url, path, body, field, *words)
    _refused(url, "/v1/completions", {**cmpl, "cache_salt": ""}, "cache_salt", "non-empty")
    # At the limit is fine: 128 engine requests (n=16 x 8 prompts).
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={**cmpl, "prompt": ["hi"] * 8, "n": 16, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


def _stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int,
            times: list[float] | None = None) -> tuple[str, list[float]]:
    """(text, arrival time of each chunk) of choice 0 of a greedy streamed completion
    with n=16 (16 sequences per step: a stream long enough to overlap the attack); the
    times go into `times` as they come when given."""
    text: list[str] = []
    times = [] if times is None else times
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True, n=16,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].index == 0:
            text.append(chunk.choices[0].text)
            times.append(time.monotonic())
    return "".join(text), times


def _mean_gap(times: list[float], start: float = 0.0, end: float = float("inf")
              ) -> float | None:
    gaps = [b - a for a, b in zip(times, times[1:]) if start <= a and b <= end]
    return sum(gaps) / len(gaps) if gaps else None


@pytest.mark.procs
def test_pathological_schema_beside_a_live_stream(server) -> None:
    """A schema whose compile outlasts the deadline (a held one: it never ends on its
    own) gets its 400 within about the deadline, and streams live all the while (one
    after another until the 400 came) write their idle text. Their pace during the
    attack against the idle pace is printed, not asserted (no timing asserts in tests)."""
    url, model = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # Warm the compile worker (started on first use: its start-up is not the deadline's).
    client.completions.create(model=model, prompt="hi", max_tokens=2,
                              extra_body={"guided_json": {"type": "object"}})
    prompt, tokens = "Once upon a time", 100
    idle_text, idle_times = _stream(client, model, prompt, tokens)
    result: dict = {"texts": [], "times": []}
    answered = threading.Event()

    def live() -> None:
        while not result["texts"] or not answered.is_set():
            result["texts"].append(_stream(client, model, prompt, tokens, result["times"])[0])

    thread = threading.Thread(target=live)
    thread.start()
    try:
        wait_until(lambda: len(result["times"]) >= 10, 30, "the live stream's first chunks")
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "hi", "structured_outputs": {"json": held_schema()}})
        end = time.monotonic()
    finally:
        answered.set()
        thread.join(120)
    print(f"the pathological schema's 400 came after {end - start:.2f} s")
    assert not thread.is_alive()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs"
    assert f"--structured-outputs-compile-timeout={COMPILE_TIMEOUT:g}" in error["message"], error
    # Generous (a busy machine); the compile itself never ends.
    assert end - start < COMPILE_TIMEOUT + 10, f"400 after {end - start:.2f} s"
    assert result["texts"] == [idle_text] * len(result["texts"])
    times = result["times"]
    assert times[0] < start and times[-1] > end, "the attack did not overlap the streams"
    attack, idle = _mean_gap(times, start, end), _mean_gap(idle_times)
    if attack is not None and idle:
        print(f"inter-token latency during the attack / idle: {attack / idle:.2f}")
    # A repeat is answered from the verdict cache at once, with the same 400.
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "hi", "structured_outputs": {"json": held_schema()}})
    assert r.status_code == 400 and "--structured-outputs-compile-timeout" in r.text


@pytest.mark.procs
def test_saturated_compile_pool_answers_every_request_in_bounded_time(server) -> None:
    """Four different held schemas at once on the one compile worker: each gets a 400
    (its compile timed out) or a 503 (no worker freed up within twice the deadline),
    all within that bound plus the worker restarts; none waits unbounded. Then a plain
    schema compiles again."""
    url, model = server

    def plain_ok(name: str) -> bool:
        """A schema not seen before (so the worker compiles it) gets a 200."""
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "hi", "max_tokens": 2,
            "guided_json": {"type": "object", "properties": {name: {"type": "integer"}}}})
        return r.status_code == 200

    # The worker may still be restarting after an earlier kill: until it answers.
    wait_until(lambda: plain_ok("before"), 60, "the compile worker ready")

    async def run() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def one(i: int) -> tuple[httpx.Response, float]:
                start = time.monotonic()
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": "hi", "guided_json": held_schema(1 + i)})
                return r, time.monotonic() - start
            return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(run())
    codes = sorted(r.status_code for r, _ in results)
    print("saturated pool:", [(r.status_code, round(t, 2)) for r, t in results])
    assert set(codes) <= {400, 503} and codes[0] == 400, codes
    for r, elapsed in results:
        code = r.json()["error"]["code"]
        assert code == ("structured_outputs_timeout" if r.status_code == 400
                        else "structured_outputs_busy"), r.text
        if r.status_code == 503:
            assert r.headers["Retry-After"] and "--structured-outputs-compile-workers" in r.text
        assert elapsed < 4 * COMPILE_TIMEOUT + 30, elapsed  # bounded (restarts included)
    wait_until(lambda: plain_ok("after"), 60, "a plain schema compiling again")


def _cached(client: openai.OpenAI, model: str, prompt: str, salt: str | None) -> int:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                    extra_body={} if salt is None else {"cache_salt": salt})
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.procs
def test_cache_salt_separates_prefix_cache(server) -> None:
    url, model = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "Data parallel serving runs several replicas of one model. " * 6
    assert _cached(client, model, prompt, "tenant-a") == 0
    assert _cached(client, model, prompt, "tenant-b") == 0  # another salt: no hit
    assert _cached(client, model, prompt, None) == 0  # unsalted: no hit on salted blocks
    assert _cached(client, model, prompt, "tenant-a") > 0  # equal salt: hit
    assert _cached(client, model, prompt, None) > 0  # unsalted as before


@pytest.mark.procs
def test_salt_per_key_keeps_tenants_apart(servers) -> None:
    """--prefix-cache-salt-per-key: a key's requests hit only its own cached prefixes,
    and no cache_salt a client sends reaches another key's."""
    _, url = servers["per_key"]
    alice, bob = (openai.OpenAI(base_url=url + "/v1", api_key=TENANT_KEYS[name],
                                max_retries=0, timeout=60) for name in ("alice", "bob"))
    model = alice.models.list().data[0].id
    prompt = "Each tenant's prompts stay its own business on a shared server. " * 6
    assert _cached(alice, model, prompt, None) == 0
    assert _cached(bob, model, prompt, None) == 0  # another key: no hit
    assert _cached(bob, model, prompt, "alice") == 0  # nor through a salt of her name
    assert _cached(alice, model, prompt, None) > 0  # her own prefix: a hit


@pytest.mark.procs
def test_request_timeout_aborts_in_the_engine(servers) -> None:
    proc, url = servers["timeout"]
    with stopping((proc, url)):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        # 16 completions of 1000 tokens, 10 s of forwards at least (SLOW_FORWARDS): past
        # the timeout (the streamed one proves it ran).
        body = {"model": model, "prompt": "Once", "max_tokens": 1000, "n": 16,
                "ignore_eos": True, "temperature": 1.0}
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        elapsed = time.monotonic() - start
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "request_timeout"
        assert f"--request-timeout={REQUEST_TIMEOUT:g}" in error["message"]
        assert elapsed < REQUEST_TIMEOUT + 5
        # Streamed: chunks, then an error event, then [DONE].
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert sum('"text"' in e for e in events[:-2]) > 0, "it never ran before the timeout"

        def idle() -> bool:
            """Every per-request structure empty, every KV block free (or cached)."""
            state = httpx.get(url + "/debug/request_state", timeout=10).json()
            engines = state["engines"].values()
            return (not any(state["api_server"].values())
                    and all(e["kv_free"] == e["kv_blocks"] for e in engines)
                    and not any(v for e in engines for k, v in e.items()
                                if k not in ("kv_blocks", "kv_free", "kv_cached")))

        wait_until(idle, 30, "every request state back to 0")
