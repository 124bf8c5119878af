"""Tenants and their limits on real servers (`dpserve serve --tenant-limits`), hit with
the official `openai` client and httpx (for the headers):

* one API server, one engine (the ledger in the API server): a tenant past its
  tokens_per_minute gets a 429 with Retry-After, RateLimit-* and x-ratelimit-*;
  --tenant-header picks the tenant (a malformed value is a 400 naming it);
  Anthropic's route answers its own shape; per-tenant series, unnamed tenants
  under "other";
* two API servers, two engines (the ledger in the DP coordinator): a tenant at
  max_requests_in_flight (its request held on a SIGSTOPped engine) is refused by
  both API servers while another tenant is served; tokens_per_minute holds over
  both together; a frozen coordinator means 503 for limited tenants only;
* a bad limits file or tenant header is one line naming the option.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from helpers import descendants, proc_named, serve, wait_until

pytestmark = pytest.mark.procs

ARGS = ("--threads-per-engine", "1", "--max-model-len", "256")
KEYS = {"alice": "sk-alice-" + "1" * 16, "bob": "sk-bob-" + "2" * 16}
PROMPT = [5, 6, 7, 8]  # 4 prompt tokens; with max_tokens 4 and ignore_eos a request uses 8
LIMITS = {"alice": {"max_requests_in_flight": 1},
          "tpm-a": {"tokens_per_minute": 24},  # 3 requests of 8 tokens
          "shared": {"tokens_per_minute": 24},
          "tiny": {"tokens_per_minute": 1},  # any request is over it
          "held": {"max_requests_in_flight": 50},
          "solo": {"max_requests_in_flight": 1},
          "metered": {"max_requests_in_flight": 50}}


def _files(tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("tenants")
    keys = folder / "keys"
    keys.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    keys.chmod(0o600)
    limits = folder / "limits.json"
    limits.write_text(json.dumps(LIMITS))
    return str(keys), str(limits)


def _auth(name: str, tenant: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {KEYS[name]}", "Connection": "close"}
    return headers | ({"X-Tenant-ID": tenant} if tenant else {})


@pytest.fixture(scope="module")
def one_server(tiny_llama, tmp_path_factory):
    keys, limits = _files(tmp_path_factory)
    with serve(str(tiny_llama), *ARGS, "--api-key-file", keys, "--tenant-limits", limits,
               "--tenant-header", "X-Tenant-ID") as (proc, url):
        yield proc, url, str(tiny_llama)


@pytest.fixture(scope="module")
def two_servers(tiny_llama, tmp_path_factory):
    keys, limits = _files(tmp_path_factory)
    with serve(str(tiny_llama), *ARGS, "--data-parallel-size", "2", "--api-server-count", "2",
               "--api-key-file", keys, "--tenant-limits", limits, "--tenant-header",
               "X-Tenant-ID", "--engine-heartbeat-timeout", "300",
               "--engine-stall-timeout", "300") as (proc, url):
        yield proc, url, str(tiny_llama), descendants(proc.pid)


def _client(url: str, name: str, tenant: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS[name], max_retries=0,
                         default_headers={"X-Tenant-ID": tenant} if tenant else None)


def _complete(url: str, model: str, headers: dict[str, str], **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=headers, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, **extra})


def _series(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    text = httpx.get(url + "/metrics", headers={"Connection": "close"}, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _assert_429(resp: httpx.Response, limit: str, value: int) -> None:
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", limit), error
    assert limit in error["message"] and str(value) in error["message"], error
    assert "--tenant-limits" in error["message"], error
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["RateLimit-Limit"] == str(value)
    assert resp.headers["RateLimit-Remaining"] == "0"
    assert int(resp.headers["RateLimit-Reset"]) >= 1
    kind = "requests" if limit == "max_requests_in_flight" else "tokens"
    assert resp.headers[f"x-ratelimit-limit-{kind}"] == str(value)
    assert resp.headers[f"x-ratelimit-remaining-{kind}"] == "0"


# ---- one API server: the ledger in the API server ----------------------------------


def test_tokens_per_minute_refuses_past_the_limit_and_not_others(one_server):
    _, url, model = one_server
    before = _series(url, "dpserve:tenant_rejections_total", tenant="tpm-a",
                     limit="tokens_per_minute")
    client = _client(url, "bob", tenant="tpm-a")  # the header names the tenant, not the key
    for _ in range(3):
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                          extra_body={"ignore_eos": True})
        assert done.usage.total_tokens == 8
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                  extra_body={"ignore_eos": True})
    _assert_429(refused.value.response, "tokens_per_minute", 24)
    assert refused.value.response.headers["x-ratelimit-reset-tokens"].endswith("s")
    # Another tenant (bob by his key) is served meanwhile.
    assert _complete(url, model, _auth("bob")).status_code == 200
    assert _series(url, "dpserve:tenant_rejections_total", tenant="tpm-a",
                   limit="tokens_per_minute") == before + 1


def test_a_malformed_tenant_header_is_a_400_naming_it(one_server):
    _, url, model = one_server
    for bad in ("", "a b", "x" * 65, "team/a"):
        resp = _complete(url, model, _auth("alice") | {"X-Tenant-ID": bad})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "X-Tenant-ID", resp.text
        assert "X-Tenant-ID" in resp.json()["error"]["message"]


def test_anthropic_route_answers_a_limit_in_its_own_shape(one_server):
    _, url, model = one_server
    resp = httpx.post(url + "/v1/messages", timeout=60, headers={
        "x-api-key": KEYS["alice"], "X-Tenant-ID": "tiny", "anthropic-version": "2023-06-01"},
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 429, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    assert "tokens_per_minute" in body["error"]["message"]
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["x-ratelimit-limit-tokens"] == "1"


def test_per_tenant_series_and_unnamed_tenants_are_other(one_server):
    _, url, model = one_server
    name = "dpserve:tenant_requests_total"
    before = {t: _series(url, name, tenant=t) for t in ("metered", "other", "bob")}
    tokens = _series(url, "dpserve:tenant_generation_tokens_total", tenant="metered")
    prompt = _series(url, "dpserve:tenant_prompt_tokens_total", tenant="metered")
    queued = _series(url, "dpserve:tenant_queue_time_seconds_count", tenant="metered")
    for _ in range(2):
        assert _complete(url, model, _auth("alice", "metered")).status_code == 200
    assert _complete(url, model, _auth("alice", "zed-not-named")).status_code == 200
    assert _series(url, name, tenant="metered") == before["metered"] + 2
    assert _series(url, name, tenant="other") == before["other"] + 1
    assert _series(url, name, tenant="bob") == before["bob"]
    assert _series(url, "dpserve:tenant_generation_tokens_total", tenant="metered") == \
        tokens + 8
    assert _series(url, "dpserve:tenant_prompt_tokens_total", tenant="metered") == prompt + 8
    assert _series(url, "dpserve:tenant_queue_time_seconds_count", tenant="metered") == \
        queued + 2
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'tenant="zed-not-named"' not in text


def test_batch_lines_over_a_limit_wait_their_turn(one_server):
    """alice (one request in flight) runs a batch of 4 lines, up to 4 at once: the
    lines refused for her limit are retried, so every line is answered 200."""
    _, url, model = one_server
    client = _client(url, "alice")
    before = _series(url, "dpserve:tenant_rejections_total", tenant="alice",
                     limit="max_requests_in_flight")
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": model, "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}}
        for i in range(4)]
    upload = client.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines)
                                       .encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in (
        "completed", "failed", "cancelled") and b, 120, "the batch to end")
    assert done.status == "completed", done
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["l0", "l1", "l2", "l3"]
    assert all(x["response"]["status_code"] == 200 for x in out), out
    # The premise: her limit refused some line at least once (then it was retried).
    assert _series(url, "dpserve:tenant_rejections_total", tenant="alice",
                   limit="max_requests_in_flight") > before


# ---- two API servers: the ledger in the DP coordinator -----------------------------


def _answers_by_server(url: str, tenant: str, limit: str) -> dict[str, float]:
    return {s: _series(url, "dpserve:tenant_rejections_total", tenant=tenant, limit=limit,
                       api_server=s) for s in ("0", "1")}


def test_in_flight_limit_is_refused_by_every_api_server_while_others_are_served(two_servers):
    proc, url, model, children = two_servers
    engine = proc_named(children, "EngineCore_1")
    held = httpx.Client(timeout=120)
    os.kill(engine.pid, signal.SIGSTOP)  # alice's request stays in flight there
    try:
        with held.stream("POST", url + "/v1/completions", headers=_auth("alice") | {
                "X-data-parallel-rank": "1"}, json={"model": model, "prompt": PROMPT,
                                                     "max_tokens": 4, "stream": True}):
            before = _answers_by_server(url, "alice", "max_requests_in_flight")
            refused = 0
            # Fresh connections until both API servers have refused alice (bounded).
            while min(n - before[s] for s, n in _answers_by_server(
                    url, "alice", "max_requests_in_flight").items()) < 1:
                assert refused < 60, "one API server never answered"
                _assert_429(_complete(url, model, _auth("alice")), "max_requests_in_flight",
                            1)
                refused += 1
                # bob, another tenant, is served meanwhile (on the running engine).
                resp = _complete(url, model, _auth("bob") | {"X-data-parallel-rank": "0"})
                assert resp.status_code == 200, resp.text
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        held.close()
    # The held request ended (the client went away): alice is admitted again.
    wait_until(lambda: _complete(url, model, _auth("alice")).status_code == 200, 30,
               "alice to be admitted once her request ended")


def _tokens_per_minute_holds_over_both(url: str, model: str, tenant: str) -> None:
    """`tenant` (24 tokens a minute) over fresh connections until both API servers have
    refused it: together they served exactly what the limit allows."""
    before = _series(url, "dpserve:tenant_requests_total", tenant=tenant)
    rejected = _answers_by_server(url, tenant, "tokens_per_minute")
    served = 0
    for _ in range(60):  # fresh connections: whichever API server accepts answers
        resp = _complete(url, model, _auth("bob", tenant))
        if resp.status_code == 200:
            served += 1
        else:
            _assert_429(resp, "tokens_per_minute", 24)
        now = _answers_by_server(url, tenant, "tokens_per_minute")
        if all(now[s] > rejected[s] for s in now):
            break
    assert all(now[s] > rejected[s] for s in now), now
    assert served == 3
    assert _series(url, "dpserve:tenant_requests_total", tenant=tenant) == before + 3


def test_tokens_per_minute_holds_over_both_api_servers(two_servers):
    _, url, model, _ = two_servers
    _tokens_per_minute_holds_over_both(url, model, "shared")


def test_one_engine_and_two_api_servers_share_a_coordinator_ledger(tiny_llama,
                                                                  tmp_path_factory):
    """One engine needs no coordinator, but two API servers with limits start one for
    the ledger."""
    keys, limits = _files(tmp_path_factory)
    with serve(str(tiny_llama), *ARGS, "--api-server-count", "2", "--api-key-file", keys,
               "--tenant-limits", limits, "--tenant-header", "X-Tenant-ID") as (proc, url):
        proc_named(descendants(proc.pid), "DPCoordinator")
        _tokens_per_minute_holds_over_both(url, str(tiny_llama), "shared")


def _api_server_of(children, client_port: int):
    """The API-server process that holds the connection from our `client_port`."""
    found = [p for p in children if p.is_running() and p.name().startswith(
        "dpserve::APIServer_") and any(c.raddr and c.raddr.port == client_port
                                       for c in p.net_connections("tcp"))]
    assert len(found) == 1, found
    return found[0]


def test_a_killed_api_server_does_not_pin_its_tenants(two_servers):
    """solo's one request in flight is held (its engine stopped) by an API server that
    is then SIGKILLed: the coordinator forgets what the silent API server held, so
    solo is admitted again (by the survivor or the restarted one)."""
    proc, url, model, children = two_servers
    engine = proc_named(children, "EngineCore_1")
    held = httpx.Client(timeout=120)
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        with held.stream("POST", url + "/v1/completions", headers=_auth("alice", "solo") | {
                "X-data-parallel-rank": "1"}, json={"model": model, "prompt": PROMPT,
                                                     "max_tokens": 4, "stream": True}) as resp:
            assert resp.status_code == 200  # admitted: its headers came
            port = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
            _assert_429(_complete(url, model, _auth("alice", "solo")),
                        "max_requests_in_flight", 1)
            _api_server_of(children, port).kill()
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the stream broke with its API server
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        held.close()
    wait_until(lambda: _complete(url, model, _auth("alice", "solo")).status_code == 200, 60,
               "solo to be admitted once its API server was gone")


def test_a_frozen_coordinator_means_503_for_limited_tenants_only(two_servers):
    _, url, model, children = two_servers
    coordinator = proc_named(children, "DPCoordinator")
    os.kill(coordinator.pid, signal.SIGSTOP)
    try:
        resp = _complete(url, model, _auth("alice", "held"))
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "tenant_ledger_unavailable"
        assert resp.headers["Retry-After"] == "1"
        # A tenant with no limits never waits for the ledger.
        assert _complete(url, model, _auth("alice", "unlimited")).status_code == 200
    finally:
        os.kill(coordinator.pid, signal.SIGCONT)
    wait_until(lambda: _complete(url, model, _auth("alice", "held")).status_code == 200, 30,
               "the coordinator to answer again")


# ---- the command line ---------------------------------------------------------------


@pytest.mark.parametrize("option, value, extra, words", [
    ("--tenant-limits", '{"alice": {"tpm": 5}}', (), ["--tenant-limits", "'alice'", "'tpm'"]),
    ("--tenant-limits", "{", (), ["--tenant-limits", "not valid JSON"]),
    ("--tenant-limits", '{"a": {"tokens_per_minute": 9}}', ("--data-parallel-size", "2",
                                                            "--data-parallel-hybrid-lb"),
     ["--tenant-limits", "hybrid"]),
    ("--tenant-header", "Authorization", (), ["--tenant-header", "'Authorization'"]),
])
def test_bad_tenant_options_are_one_line(tmp_path, option, value, extra, words):
    if option == "--tenant-limits":
        path = tmp_path / "limits.json"
        path.write_text(value)
        value = str(path)
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", option, value, *extra],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr
