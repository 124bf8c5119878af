"""Operating a server (tiny model, real processes): `GET /engines` and the admin
routes `POST /engines/{rank}/cordon|uncordon|drain|restart` behind
`--enable-admin-api` (and `--api-key`). Requests are sent with the official
`openai` client; where each request ran is read from /metrics."""

from __future__ import annotations

import asyncio
import re
import threading

import httpx
import openai
import pytest
from helpers import (
    descendants,
    finished_by_engine,
    output,
    proc_named,
    serve,
    serve_all,
    stopping,
    wait_until,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]

DP_ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256")
ROW_KEYS = {"rank", "state", "cordoned", "waiting", "running", "kv_cache_usage",
            "tokens_per_s", "wave", "restarts", "incarnation", "host", "pid", "ttft_s",
            "tp_workers", "lora", "kv_tier", "spec_decode", "role", "handoffs"}


def engines(url: str, headers: dict | None = None) -> dict:
    resp = httpx.get(url + "/engines", headers=headers, timeout=5)
    assert resp.status_code == 200, resp.text
    return resp.json()


def row(url: str, rank: int, headers: dict | None = None) -> dict:
    return next(e for e in engines(url, headers)["engines"] if e["rank"] == rank)


async def complete(url: str, model: str, n: int, *, max_tokens: int = 8,
                   rank: int | None = None, api_key: str = "none") -> list[str]:
    """n completions at once with the openai client, each on a new connection (so that
    the kernel spreads them over the API servers); their finish reasons."""
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else None
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=120)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, http_client=http,
                                  max_retries=0) as client:
        outs = await asyncio.gather(*(client.completions.create(
            model=model, prompt=f"request {i}", max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True}, extra_headers=headers) for i in range(n)))
    return [o.choices[0].finish_reason for o in outs]


class Load:
    """Streams of long completions from a thread until `stop()`; what each ended with."""

    def __init__(self, url: str, model: str, streams: int = 8, rank: int | None = None,
                 rounds: int | None = None) -> None:
        self.url, self.model, self.streams, self.rank = url, model, streams, rank
        self.rounds = rounds  # None: until stop()
        self.finishes: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the load did not end"
        assert not self.errors, self.errors
        return self.finishes

    async def _run(self) -> None:
        done = 0
        while not self._stop.is_set() and (self.rounds is None or done < self.rounds):
            try:
                self.finishes += await complete(self.url, self.model, self.streams,
                                                max_tokens=200, rank=self.rank)
            except BaseException as e:  # noqa: BLE001 - reported by stop()
                self.errors.append(e)
                return
            done += 1


def by_api_server(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^dpserve:api_server_requests_finished_total\{.*api_server="(\d+)".*\} (\S+)$', text,
        re.M)}


KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def plain_and_keyed(tiny_llama):
    """A server without the admin routes and one with them behind an API key, started
    at once (their start-ups overlap); a test of its own uses (and stops) each."""
    model = str(tiny_llama)
    with serve_all([model, *DP_ARGS], [model, *DP_ARGS, "--enable-admin-api", "--api-key",
                                       "s3cret"], headers=KEY) as servers:
        yield servers


def test_admin_routes_404_without_the_flag(plain_and_keyed):
    with stopping(plain_and_keyed[0]) as (proc, url):
        for action in ("cordon", "uncordon", "drain", "restart"):
            resp = httpx.post(f"{url}/engines/1/{action}", timeout=5)
            assert resp.status_code == 404, resp.text
            assert set(resp.json()["error"]) >= {"message", "type", "code"}
        view = engines(url)  # the read-only view is there without the flag
        assert view["admin"] is False and view["data_parallel_size"] == 2
        assert [e["rank"] for e in view["engines"]] == [0, 1]
        assert all(set(e) == ROW_KEYS and e["state"] == "serving" for e in view["engines"])
        assert all(e["pid"] == proc_named(descendants(proc.pid), f"EngineCore_{e['rank']}").pid
                   for e in view["engines"])
        # TP=1: each rank's one worker is its engine core (the same heartbeat says so).
        assert all([(w["tp_rank"], w["pid"]) for w in e["tp_workers"]] == [(0, e["pid"])]
                   for e in view["engines"])


def test_admin_routes_need_the_api_key(plain_and_keyed):
    key = KEY
    with stopping(plain_and_keyed[1]) as (_, url):
        resp = httpx.post(f"{url}/engines/1/cordon", json={}, timeout=5)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert row(url, 1, key)["cordoned"] is False  # nothing happened
        assert engines(url, key)["admin"] is True
        assert httpx.get(url + "/engines", timeout=5).status_code == 401  # hosts, pids
        # With the key: bad rank 400, unknown action 404, a real one 200.
        for path, status in (("/engines/7/cordon", 400), ("/engines/x/cordon", 400),
                             ("/engines/1/reboot", 404), ("/engines/1/drain?timeout=-1", 400)):
            resp = httpx.post(url + path, json={}, headers=key, timeout=5)
            assert resp.status_code == status, (path, resp.text)
            assert "message" in resp.json()["error"]
        resp = httpx.post(f"{url}/engines/1/cordon", json={}, headers=key, timeout=15)
        assert resp.status_code == 200, resp.text
        assert resp.json()["rank"] == 1 and resp.json()["cordoned"] is True


def test_cordon_stops_new_work_in_both_api_servers_and_uncordon_resumes(tiny_llama):
    model = str(tiny_llama)
    with serve(model, *DP_ARGS, "--api-server-count", "2", "--enable-admin-api",
               "--allow-unauthenticated-admin") as (_, url):
        # /engines numbers are real: under load, requests wait or run and tokens flow.
        with Load(url, model, streams=16) as load:
            busy = wait_until(lambda: [e for e in engines(url)["engines"]
                                       if e["waiting"] + e["running"] > 0], 60, "load in view")
            assert busy
            wait_until(lambda: all(e["tokens_per_s"] > 0 for e in engines(url)["engines"]),
                       60, "tokens/s on every rank")
            wait_until(lambda: any(e["kv_cache_usage"] > 0 for e in engines(url)["engines"]),
                       60, "KV usage under load")
            wait_until(lambda: all(e["ttft_s"] > 0 for e in engines(url)["engines"]),
                       60, "a time to first token on every rank")
        assert set(load.finishes) == {"length"}

        resp = httpx.post(f"{url}/engines/1/cordon", json={}, timeout=15)
        assert resp.status_code == 200 and resp.json()["cordoned"] is True, resp.text
        assert row(url, 1)["state"] == "serving"  # cordoned is not a state: it serves on
        before, servers_before = finished_by_engine(url), by_api_server(url)
        assert asyncio.run(complete(url, model, 40)) == ["length"] * 40
        after, servers_after = finished_by_engine(url), by_api_server(url)
        assert after.get(1, 0) - before.get(1, 0) == 0  # nothing new went to rank 1
        assert after.get(0, 0) - before.get(0, 0) == 40
        # ... from either API server: both placed requests, none on rank 1.
        assert all(servers_after.get(i, 0) > servers_before.get(i, 0) for i in ("0", "1")), \
            (servers_before, servers_after)
        # Pinned to the cordoned rank: 503, the rank is named.
        pinned = httpx.post(url + "/v1/completions", headers={"X-data-parallel-rank": "1"},
                            json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert pinned.status_code == 503 and "cordoned" in pinned.json()["error"]["message"]

        resp = httpx.post(f"{url}/engines/1/uncordon", json={}, timeout=15)
        assert resp.status_code == 200 and resp.json()["cordoned"] is False, resp.text
        before = finished_by_engine(url)
        assert asyncio.run(complete(url, model, 40)) == ["length"] * 40
        assert finished_by_engine(url).get(1, 0) - before.get(1, 0) > 0


def test_drain_answers_when_empty_and_restart_serves_as_a_new_incarnation(tiny_llama):
    model = str(tiny_llama)
    with serve(model, *DP_ARGS, "--enable-admin-api", "--allow-unauthenticated-admin"
               ) as (proc, url):
        # Drain under load pinned to rank 1 (seconds of work): answered once it holds nothing.
        with Load(url, model, streams=48, rank=1, rounds=1) as load:
            wait_until(lambda: row(url, 1)["running"] > 0, 60, "rank 1 busy")
            resp = httpx.post(f"{url}/engines/1/drain?timeout=120", json={}, timeout=150)
            assert resp.status_code == 200, resp.text
            assert resp.json()["cordoned"] is True
            assert (resp.json()["waiting"], resp.json()["running"]) == (0, 0)
            view = row(url, 1)
            assert view["cordoned"] and view["waiting"] == view["running"] == 0
        assert load.stop() == ["length"] * 48  # drained, not cut
        before = finished_by_engine(url)
        assert asyncio.run(complete(url, model, 8)) == ["length"] * 8
        assert finished_by_engine(url).get(1, 0) == before.get(1, 0)  # stays cordoned
        assert httpx.post(f"{url}/engines/1/uncordon", json={},
                          timeout=15).status_code == 200

        # Restart rank 1 under load: a new process, its requests move, none is cut.
        old_pid = proc_named(descendants(proc.pid), "EngineCore_1").pid
        assert row(url, 1)["pid"] == old_pid
        with Load(url, model, streams=16) as load:
            wait_until(lambda: row(url, 1)["running"] > 0, 60, "rank 1 busy")
            resp = httpx.post(f"{url}/engines/1/restart?timeout=120", json={}, timeout=150)
            assert resp.status_code == 200, resp.text
        assert set(load.stop()) == {"length"}
        assert resp.json()["state"] == "serving" and resp.json()["incarnation"] == 1
        new_pid = proc_named(descendants(proc.pid), "EngineCore_1").pid
        assert new_pid != old_pid
        view = wait_until(lambda: (r := row(url, 1))["pid"] == new_pid and r, 30, "new pid")
        assert view["restarts"] == 1 and view["incarnation"] == 1
        before = finished_by_engine(url)
        assert asyncio.run(complete(url, model, 4, rank=1)) == ["length"] * 4
        assert finished_by_engine(url).get(1, 0) - before.get(1, 0) == 4
        assert "restart asked by an operator" in output(proc)
