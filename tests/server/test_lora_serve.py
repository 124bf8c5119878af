"""LoRA adapters served DP-wide, for real: `dpserve serve` at DP=2 with two API servers
(`--api-server-count 2`), a tiny Llama, PEFT adapters built as tests/lora_checks.py
does, the official `openai` client and httpx.

* `model: <adapter>` gives the offline LLM's greedy text with that adapter (and not
  the base model's); /v1/models lists the adapters with `parent`;
* an adapter loaded through `POST /v1/load_lora_adapter` serves on both API servers
  (fresh connections: each API server answers some; the per-API-server counter
  shows both did);
* a rank SIGKILLed after the load comes back and serves the adapter (requests pinned
  to it); a rank added by `POST /scale_elastic_ep` serves it; a SIGKILLed DP
  coordinator's successor keeps the run-time adapters; at DP=1 (no coordinator) a
  restarted engine gets them from the engine client; at DP=1 with two API servers
  LoRA starts a coordinator, so both see a load;
* routing (cache-aware) sends an adapter's requests to the rank where it is
  resident, seen in /engines, `dpserve:lora_adapter_loaded` and the per-engine
  finished counts;
* a bad adapter (not an adapter, rank over --max-lora-rank) -> 400 naming the
  problem and a rank, and nothing stays loaded anywhere (the same name then loads
  on every rank, which any rank still holding it would refuse);
* unload -> 404 on every API server; unloading again -> 404; loading a name in use
  -> 400 (vLLM's code); the admin routes take JSON only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import openai
import pytest
from helpers import descendants, finished_by_engine, metric, proc_named, serve, wait_until
from lora_checks import make_adapter

from dpserve import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.procs, pytest.mark.slow]

PROMPT = "Once upon a time"
MAX_TOKENS = 8
FRESH = {"Connection": "close"}  # a new connection each: both API servers answer some
RANK_HEADER = "X-data-parallel-rank"


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """name -> adapter directory: a (loaded at start), b (loaded at run time), and a
    rank-32 one (over --max-lora-rank 16)."""
    root = tmp_path_factory.mktemp("lora_serve")
    return {"a": make_adapter(tiny_llama, root / "a", rank=8, seed=1),
            "b": make_adapter(tiny_llama, root / "b", rank=4, seed=2),
            "big": make_adapter(tiny_llama, root / "big", rank=32, seed=3),
            "notadapter": tiny_llama}


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters):
    """The offline LLM's greedy text: base model and each adapter."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out = {"base": llm.generate([PROMPT], params)[0].outputs[0].text}
        for i, name in enumerate(("a", "b"), start=1):
            out[name] = llm.generate([PROMPT], params, lora_request=LoRARequest(
                name, i, str(adapters[name])))[0].outputs[0].text
    finally:
        llm.shutdown()
    assert len(set(out.values())) == 3, out  # the adapters change the greedy text
    return out


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    with serve(str(tiny_llama), "--dtype", "float32", "--data-parallel-size", "2",
               "--data-parallel-size-max", "3", "--api-server-count", "2",
               "--enable-lora", "--max-loras", "2", "--lora-modules",
               f"a={adapters['a']}", "--enable-admin-api", "--allow-unauthenticated-admin",
               "--num-kv-blocks", "64", "--load-balance", "cache-aware",
               timeout=300) as (proc, url):
        yield proc, url


def _complete(url: str, model: str, rank: int | None = None) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           default_headers={**FRESH, **({RANK_HEADER: str(rank)}
                                                        if rank is not None else {})})
    try:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].text
    finally:
        client.close()


def _post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=FRESH, timeout=180)


@contextlib.contextmanager
def _loaded(url: str, name: str, path: Path):
    """Adapter `name` loaded from `path` through the admin API for the block, then
    unloaded (each test loads its own: they run in any order on one server)."""
    resp = _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert resp.status_code == 200, resp.text
    try:
        yield
    finally:
        _post(url, "/v1/unload_lora_adapter", {"lora_name": name})


def _finished_by_api_server(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("dpserve:api_server_requests_finished"):
            server = line.split('api_server="')[1].split('"')[0]
            out[server] = out.get(server, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_adapter_text_equals_offline_and_models_lists_it(server, tiny_llama, adapters,
                                                          expected):
    _, url = server
    base = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
    assert _complete(url, base) == expected["base"]
    assert _complete(url, "a") == expected["a"]
    cards = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=5).json()["data"]}
    assert cards["a"]["parent"] == base and cards["a"]["root"] == str(adapters["a"])
    assert cards["a"]["object"] == "model" and cards[base]["parent"] is None
    with pytest.raises(openai.NotFoundError) as e:
        _complete(url, "nope")
    assert e.value.body["code"] == "model_not_found"
    # Responses name the adapter (vLLM's), chat and streams too; the chat text is the
    # adapter's, not the base model's.
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        messages = [{"role": "user", "content": PROMPT}]
        chats = {name: client.chat.completions.create(
            model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            for name in (base, "a")}
        assert chats["a"].model == "a" and chats[base].model == base
        assert chats["a"].choices[0].message.content != chats[base].choices[0].message.content
        stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert {c.model for c in chunks} == {"a"}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["a"]
    finally:
        client.close()


def test_load_through_one_api_server_serves_on_both(server, adapters, expected):
    _, url = server
    with _loaded(url, "b", adapters["b"]):
        before = _finished_by_api_server(url)
        texts = [_complete(url, "b") for _ in range(12)]
        assert texts == [expected["b"]] * 12
        after = _finished_by_api_server(url)
        assert len(after) == 2 and all(after[s] > before.get(s, 0) for s in after), (
            before, after)
        for _ in range(6):  # every API server lists it
            ids = [c["id"] for c in httpx.get(url + "/v1/models", headers=FRESH,
                                              timeout=5).json()["data"]]
            assert "b" in ids
        again = _post(url, "/v1/load_lora_adapter", {"lora_name": "b",
                                                      "lora_path": str(adapters["b"])})
        assert again.status_code == 400 and "already been loaded" in again.text


def test_bad_adapter_is_400_and_loads_nowhere(server, adapters):
    _, url = server
    for path, problem in ((adapters["notadapter"], "adapter_config.json"),
                          (adapters["big"], "max_lora_rank"), ("/no/such/dir", "/no/such")):
        resp = _post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(path)})
        assert resp.status_code == 400, resp.text
        message = resp.json()["error"]["message"]
        assert problem in message and "rank 0:" in message, message
        with pytest.raises(openai.NotFoundError):
            _complete(url, "c")
    # Nothing was left on any rank: every rank takes the name now (one holding it
    # would refuse, and the load would be a 400).
    resp = _post(url, "/v1/load_lora_adapter", {"lora_name": "c",
                                                 "lora_path": str(adapters["a"])})
    assert resp.status_code == 200, resp.text
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    form = httpx.post(url + "/v1/load_lora_adapter", timeout=10,
                      content=json.dumps({"lora_name": "d", "lora_path": str(adapters["a"])}))
    assert form.status_code == 415, form.text  # JSON only


def _incarnation(url: str, rank: int) -> int:
    return next(r["incarnation"] for r in httpx.get(url + "/health", timeout=5).json()["ranks"]
                if r["rank"] == rank)


def _serving_again(url: str, rank: int, old: int) -> bool:
    """`rank` serves in a process newer than incarnation `old`."""
    ranks = httpx.get(url + "/health", timeout=5).json()["ranks"]
    return any(r["rank"] == rank and r["state"] == "serving" and r["incarnation"] > old
               for r in ranks)


def _engines(url: str) -> dict[int, dict]:
    return {row["rank"]: row for row in httpx.get(url + "/engines", headers=FRESH,
                                                  timeout=5).json()["engines"]}


def test_routing_prefers_the_rank_holding_the_adapter(server, adapters, expected):
    """`b` resident on rank 1 only (one request pinned there; on rank 0 it is only in
    host memory): unpinned requests for it all go to rank 1, on either API server."""
    _, url = server
    with _loaded(url, "r", adapters["b"]):
        assert _complete(url, "r", rank=1) == expected["b"]

        def resident_on_1_only() -> bool:  # (a rank's first heartbeat may be due: None)
            views = [_engines(url) for _ in range(4)]  # fresh connections: both servers
            lora = [[v[rank]["lora"] or {"resident": [], "cached": []} for rank in (0, 1)]
                    for v in views]
            return all("r" in one["resident"] and "r" not in zero["resident"]
                       and "r" in zero["cached"] for zero, one in lora)

        wait_until(resident_on_1_only, 30, "rank 1's heartbeat to show r resident")
        before = finished_by_engine(url)
        assert [_complete(url, "r") for _ in range(8)] == [expected["b"]] * 8
        after = finished_by_engine(url)
        assert after.get(1, 0) - before.get(1, 0) == 8, (before, after)
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert 'dpserve:lora_adapter_loaded{adapter="r",rank="1"} 1.0' in metrics
        assert 'dpserve:lora_adapter_loaded{adapter="r",rank="0"} 0.0' in metrics
        assert metric(url, "dpserve:lora_adapter_loads_total") >= 1


def test_a_restarted_coordinator_keeps_the_run_time_adapters(server, adapters, expected):
    """The coordinator holds the registry; SIGKILLed, its successor learns the run-time
    adapters from the engines' heartbeats: every API server still serves `k`."""
    proc, url = server
    with _loaded(url, "k", adapters["b"]):
        assert _post(url, "/engines/1/cordon", {}).status_code == 200  # the old one's
        old = proc_named(descendants(proc.pid), "DPCoordinator")
        os.kill(old.pid, signal.SIGKILL)

        def new_coordinator_heard() -> bool:  # its publish (cordon forgotten), after beats
            rows = [_engines(url) for _ in range(4)]
            return all(not r[1]["cordoned"] and r[0]["pid"] and r[1]["pid"] for r in rows)

        wait_until(new_coordinator_heard, 60, "the new coordinator's publish")
        assert proc_named(descendants(proc.pid), "DPCoordinator").pid != old.pid
        assert [_complete(url, "k") for _ in range(8)] == [expected["b"]] * 8


def test_restarted_rank_serves_the_run_time_adapter(server, adapters, expected):
    proc, url = server
    with _loaded(url, "rs", adapters["b"]):
        victim, old = proc_named(descendants(proc.pid), "EngineCore_1"), _incarnation(url, 1)
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: _serving_again(url, 1, old), 180, "rank 1 to serve again")
        assert proc_named(descendants(proc.pid), "EngineCore_1").pid != victim.pid
        assert _complete(url, "rs", rank=1) == expected["b"]
        assert _complete(url, "a", rank=1) == expected["a"]


def test_a_rank_that_missed_an_adapter_gets_it_back(server, adapters, expected, tmp_path):
    """Rank 1 restarts while the adapter's files are away: its replay fails and it
    serves without it (its heartbeat lists only `a`); once the files are back, API
    server 0's reconciliation (heartbeats lack it) loads it there."""
    proc, url = server
    moving = shutil.copytree(adapters["b"], tmp_path / "moving")
    with _loaded(url, "mv", moving):
        victim, old = proc_named(descendants(proc.pid), "EngineCore_1"), _incarnation(url, 1)
        os.kill(victim.pid, signal.SIGKILL)
        hidden = moving.rename(tmp_path / "hidden")
        wait_until(lambda: _serving_again(url, 1, old), 180, "rank 1 to serve again")

        new_pid = proc_named(descendants(proc.pid), "EngineCore_1").pid

        def lora_of_1() -> dict | None:
            return _engines(url)[1]["lora"]

        wait_until(lambda: _engines(url)[1]["pid"] == new_pid and lora_of_1(), 30,
                   "the new rank 1's first heartbeat")
        assert lora_of_1()["cached"] == ["a"]  # replayed, but not mv
        hidden.rename(moving)
        wait_until(lambda: "mv" in (lora_of_1() or {}).get("cached", []) +
                   (lora_of_1() or {}).get("resident", []), 60, "rank 1 to get mv back")
        assert _complete(url, "mv", rank=1) == expected["b"]


def test_added_rank_serves_the_adapters(server, adapters, expected):
    _, url = server
    with _loaded(url, "sc", adapters["b"]):
        resp = httpx.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": 3},
                          timeout=300)
        assert resp.status_code == 200, resp.text
        assert _complete(url, "sc", rank=2) == expected["b"]
        assert _complete(url, "a", rank=2) == expected["a"]


def test_unload_is_404_on_every_api_server(server, adapters, expected):
    _, url = server
    resp = _post(url, "/v1/load_lora_adapter", {"lora_name": "u",
                                                 "lora_path": str(adapters["b"])})
    assert resp.status_code == 200, resp.text
    assert _complete(url, "u") == expected["b"]
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "u"}).status_code == 200
    for _ in range(8):
        with pytest.raises(openai.NotFoundError):
            _complete(url, "u")
    again = _post(url, "/v1/unload_lora_adapter", {"lora_name": "u"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "lora_not_found"


def test_without_a_coordinator_a_restarted_engine_gets_the_adapters(tiny_llama, adapters,
                                                                   expected):
    """DP=1, one API server: no coordinator, so no READY carries the registry; the
    engine client loads it into the restarted engine before a request names one."""
    with serve(str(tiny_llama), "--dtype", "float32", "--enable-lora", "--num-kv-blocks",
               "64", "--enable-admin-api", "--allow-unauthenticated-admin",
               "--no-enable-elastic-ep") as (proc, url):  # (the admin API would start one)
        resp = _post(url, "/v1/load_lora_adapter", {"lora_name": "b",
                                                     "lora_path": str(adapters["b"])})
        assert resp.status_code == 200, resp.text
        assert _complete(url, "b") == expected["b"]
        assert _engines(url)[0]["lora"]["resident"] == ["b"]
        victim = proc_named(descendants(proc.pid), "EngineCore_0")
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: _serving_again(url, 0, 0), 120, "engine 0 to serve again")
        assert proc_named(descendants(proc.pid), "EngineCore_0").pid != victim.pid
        assert _complete(url, "b") == expected["b"]


def test_one_engine_two_api_servers_share_the_registry(tiny_llama, adapters, expected):
    """DP=1 with `--api-server-count 2`: LoRA starts a coordinator to hold the registry,
    so an adapter loaded through one API server serves on the other."""
    with serve(str(tiny_llama), "--dtype", "float32", "--enable-lora", "--num-kv-blocks",
               "64", "--api-server-count", "2", "--enable-admin-api",
               "--allow-unauthenticated-admin") as (proc, url):
        assert proc_named(descendants(proc.pid), "DPCoordinator")
        resp = _post(url, "/v1/load_lora_adapter", {"lora_name": "b",
                                                     "lora_path": str(adapters["b"])})
        assert resp.status_code == 200, resp.text
        before = _finished_by_api_server(url)
        assert [_complete(url, "b") for _ in range(12)] == [expected["b"]] * 12
        after = _finished_by_api_server(url)
        assert len(after) == 2 and all(after[s] > before.get(s, 0) for s in after), (
            before, after)
        assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
        for _ in range(6):
            with pytest.raises(openai.NotFoundError):
                _complete(url, "b")
