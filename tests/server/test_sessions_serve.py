"""Sticky sessions through a real server: `dpserve serve --data-parallel-size 2
--api-server-count 2` (tiny random model) hit over HTTP, each request on a new
connection so that the kernel hands them to both API servers.

Where each batch of a session's requests ran is read from /metrics (summed over the
API servers): the engine counters that went up, and the API servers that answered.
A session's follow-ups all land on one rank whichever API server takes them, for an
`X-Session-ID`, a `user`, Anthropic's `metadata.user_id` and a Responses API chain;
a cordoned rank's session moves and its follow-ups complete; a Responses chain that
moved stays moved after the uncordon on the API server that never saw it move (the
rank kept in the shared store). Batches are 4 requests at once: never enough to make
a rank hot (a load over 32).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest
from helpers import finished_by_engine_and_api_server, serve, wait_until

pytestmark = [pytest.mark.procs]

BATCH = 4
SERVERS = ("0", "1")


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(str(tiny_llama), "--data-parallel-size", "2", "--api-server-count", "2",
               "--threads-per-engine", "1", "--max-model-len", "512", "--enable-admin-api",
               "--allow-unauthenticated-admin", timeout=180) as (_, url):
        yield url, str(tiny_llama)


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


Send = Callable[[httpx.AsyncClient, int], Awaitable[httpx.Response]]


def batches_on_both_servers(url: str, send: Send, max_batches: int = 12
                            ) -> tuple[set[str], dict[str, float]]:
    """Batches of `BATCH` requests at once (`send(client, i)`, each on a new connection)
    until each API server answered some: (the ranks they ran on, per API server)."""
    ranks: set[str] = set()
    served = {s: 0.0 for s in SERVERS}
    for _ in range(max_batches):
        engines_before, servers_before = finished_by_engine_and_api_server(url)
        asyncio.run(_batch(send))
        engines_after, servers_after = finished_by_engine_and_api_server(url)
        ran = _delta(engines_before, engines_after)
        assert sum(ran.values()) == BATCH, ran
        ranks |= set(ran)
        for s, n in _delta(servers_before, servers_after).items():
            served[s] += n
        if all(served[s] > 0 for s in SERVERS):
            return ranks, served
    raise AssertionError(f"one API server answered all {max_batches} batches: {served}")


async def _batch(send: Send) -> None:
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=no_reuse) as client:
        responses = await asyncio.gather(*(send(client, i) for i in range(BATCH)))
    for r in responses:
        assert r.status_code == 200, r.text


def _rank_of_one(url: str, send: Send) -> tuple[str, httpx.Response]:
    """One request (`send(client, 0)`): the rank it ran on, and its response."""
    engines_before, _ = finished_by_engine_and_api_server(url)

    async def one() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await send(client, 0)

    response = asyncio.run(one())
    assert response.status_code == 200, response.text
    ran = _delta(engines_before, finished_by_engine_and_api_server(url)[0])
    assert list(ran.values()) == [1.0], ran
    return next(iter(ran)), response


def _cordon(url: str, rank: str, action: str = "cordon") -> None:
    resp = httpx.post(f"{url}/engines/{rank}/{action}", json={}, timeout=15)
    assert resp.status_code == 200 and resp.json()["cordoned"] is (action == "cordon"), \
        resp.text
    # Both API servers hear the coordinator's publish; ask fresh connections a few times.
    for _ in range(4):
        wait_until(lambda: _row(url, rank)["cordoned"] is (action == "cordon"), 10,
                   f"rank {rank} {action}ed in /engines")


def _row(url: str, rank: str) -> dict:
    body = httpx.get(url + "/engines", headers={"Connection": "close"}, timeout=5).json()
    return next(e for e in body["engines"] if str(e["rank"]) == rank)


def test_an_x_session_id_sticks_on_both_api_servers_and_moves_off_a_cordoned_rank(server):
    url, model = server

    def send(client: httpx.AsyncClient, i: int):
        return client.post(url + "/v1/completions", headers={"X-Session-ID": "conv-1"},
                           json={"model": model, "prompt": f"Hello there, turn {i}",
                                 "max_tokens": 2, "temperature": 0})

    ranks, _ = batches_on_both_servers(url, send)
    assert len(ranks) == 1, ranks
    (home,) = ranks
    other = "1" if home == "0" else "0"
    _cordon(url, home)
    try:
        ranks, served = batches_on_both_servers(url, send)
        assert ranks == {other}, (home, ranks, served)  # moved; every follow-up completed
    finally:
        _cordon(url, home, "uncordon")
    # Too long a session id: a 400 naming the header, in each API's error shape.
    long_id = {"X-Session-ID": "s" * 257}
    r = httpx.post(url + "/v1/chat/completions", headers=long_id, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-ID", r.text
    r = httpx.post(url + "/v1/messages", headers=long_id, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "X-Session-ID" in r.json()["error"]["message"]


def test_user_and_metadata_user_id_stick_on_both_api_servers(server):
    url, model = server

    def chat(client: httpx.AsyncClient, i: int):
        return client.post(url + "/v1/chat/completions", json={
            "model": model, "user": "alice", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"Question {i}?"}]})

    def message(client: httpx.AsyncClient, i: int):
        return client.post(url + "/v1/messages", json={
            "model": model, "max_tokens": 2, "metadata": {"user_id": "bob"},
            "messages": [{"role": "user", "content": f"Question {i}?"}]})

    for send in (chat, message):
        ranks, _ = batches_on_both_servers(url, send)
        assert len(ranks) == 1, (send.__name__, ranks)


def test_a_responses_chain_sticks_moves_when_cordoned_and_stays_moved(server):
    url, model = server

    def respond(previous: str | None) -> Send:
        def send(client: httpx.AsyncClient, i: int):
            return client.post(url + "/v1/responses", json={
                "model": model, "input": f"And then {i}?", "max_output_tokens": 2,
                "temperature": 0, **({"previous_response_id": previous} if previous else {})})
        return send

    home, first = _rank_of_one(url, respond(None))
    first_id = first.json()["id"]
    ranks, _ = batches_on_both_servers(url, respond(first_id))
    assert ranks == {home}, (home, ranks)  # both API servers know it (one by its record)
    other = "1" if home == "0" else "0"
    _cordon(url, home)
    try:
        moved_to, moved = _rank_of_one(url, respond(first_id))  # on one API server
        assert moved_to == other
    finally:
        _cordon(url, home, "uncordon")
    # The API server that did not move it still has `home` for this chain, which may
    # take requests again: the stored rank of the moved response says `other`.
    ranks, served = batches_on_both_servers(url, respond(moved.json()["id"]))
    assert ranks == {other}, (home, ranks, served)
