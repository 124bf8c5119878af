"""Traces across dpserve's processes, received by a real OTLP/HTTP receiver.

DP=2 servers of the tiny model export to `OTLPReceiver` (tests/otlp_receiver.py: a
127.0.0.1 HTTP server decoding the exporter's protobufs); each request carries a
client `traceparent` of its own. Checked:

* one trace per request, the client's, across the API server and engine processes,
  with the right parents (client span > API root > parse / chat_template / admit /
  route; route > engine > queue / prefill / decode), with 1 and with 2 API servers;
* the `route` span names the chosen rank and its reason: `pinned` for
  X-data-parallel-rank, `session` for an X-Session-ID's turns, `cache_hit` for a
  repeated prompt under cache-aware placement; every candidate's load;
* `--trace-file`: every line one JSON span, the same spans as the receiver's;
* a request moved after its engine is SIGKILLed: one trace with the first placement
  (the killed rank), a `migrate` span (from it, linked to that placement) and the
  other rank's engine spans under it; spans reach the receiver at the drain's exit
  (that server exports only then: OTEL_BSP_SCHEDULE_DELAY of 10 minutes), including
  those of a request still streaming when SIGTERM came;
* a prefill/decode handoff (`--data-parallel-roles prefill:1,decode:1`): the first
  leg's engine spans on the prefill rank, a `migrate` span naming both ranks, the
  decode rank's engine spans under it, all in the client's trace.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import httpx
import pytest
from helpers import (
    FAULT_SEQS,
    descendants,
    output,
    premise_moved,
    proc_named,
    running_on,
    serve_all,
    stopping,
)
from otlp_receiver import OTLPReceiver, Span

pytestmark = [pytest.mark.procs, pytest.mark.slow]

DP_ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256")
SOON = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # export every 0.2 s
AT_EXIT = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}  # only the exit's flush exports
API_SPANS = {"parse", "admit", "route"}
ENGINE_SPANS = {"engine", "queue", "prefill", "decode"}
REASONS = {"pinned", "session", "cache_hit", "tier", "adapter", "least_loaded", "round_robin"}
MOVED_TOKENS = 240


def traceparent() -> tuple[str, str, str]:
    """(header, trace id, the client's span id): a fresh client span."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def servers(tiny_llama, receiver, tmp_path_factory):
    """1 API server (cache-aware, with a trace file), 2 API servers, and one for the
    SIGKILL test (exports only at exit): started at once."""
    model, otlp = str(tiny_llama), ("--otlp-traces-endpoint", receiver.url)
    trace_file = str(tmp_path_factory.mktemp("traces") / "spans.jsonl")
    with serve_all([model, *DP_ARGS, *otlp, "--load-balance", "cache-aware",
                    "--trace-file", trace_file],
                   [model, *DP_ARGS, *otlp, "--api-server-count", "2"],
                   [model, *DP_ARGS, *otlp, *FAULT_SEQS],
                   env=[SOON, SOON, AT_EXIT]) as (one, two, kill):
        yield {1: one, 2: two, "kill": kill, "trace_file": trace_file, "model": model}


def chat(url: str, tp: str, content: str, **headers: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   headers={"traceparent": tp, **headers},
                   json={"max_tokens": 6,
                         "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()


def complete_trace(receiver: OTLPReceiver, trace_id: str, names: set[str],
                   engines: int = 1) -> list[Span]:
    """The trace's spans once every name in `names` arrived, and `engines` engine spans
    if it names "engine" (each process exports its own batches: 30 s at most)."""
    def arrived() -> list[Span]:
        spans = receiver.trace(trace_id)
        enough = "engine" not in names or sum(s.name == "engine" for s in spans) >= engines
        return spans if names <= {s.name for s in spans} and enough else []

    return receiver.wait_for(arrived, 30, f"spans {sorted(names)} ({engines} engine)")


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


@pytest.mark.parametrize("api_servers", [1, 2])
def test_one_trace_per_request_across_processes(servers, receiver, api_servers):
    _, url = servers[api_servers]
    tp, trace_id, client_span = traceparent()
    reply = chat(url, tp, "Tell me about tracing")
    root_name = "POST /v1/chat/completions"
    spans = complete_trace(receiver, trace_id, {root_name, "chat_template", *API_SPANS,
                                                *ENGINE_SPANS})
    root = one(spans, root_name)
    assert root.parent_span_id == client_span
    assert root.service in {f"dpserve-api-server-{i}" for i in range(api_servers)}
    assert root.attributes["http.response.status_code"] == 200
    for name in ("parse", "chat_template", "admit", "route"):
        assert one(spans, name).parent_span_id == root.span_id, name
        assert one(spans, name).service == root.service
    route, engine = one(spans, "route"), one(spans, "engine")
    assert engine.parent_span_id == route.span_id
    assert engine.service == f"dpserve-engine-{route.attributes['dpserve.route.rank']}"
    assert engine.attributes["dpserve.rank"] == route.attributes["dpserve.route.rank"]
    assert engine.attributes["dpserve.output_tokens"] == reply["usage"]["completion_tokens"]
    for name in ("queue", "prefill", "decode"):
        assert one(spans, name).parent_span_id == engine.span_id, name
    assert one(spans, "prefill").events[0][0] == "chunk"
    assert route.attributes["dpserve.route.reason"] in REASONS
    assert {"dpserve.rank.0.load", "dpserve.rank.1.load"} <= set(route.attributes)
    # one trace: no span of this request's engine work went anywhere else
    engine_spans = [s for s in receiver.spans if s.name == "engine"
                    and s.attributes["dpserve.request_id"].startswith(reply["id"])]
    assert [s.trace_id for s in engine_spans] == [trace_id]


@pytest.mark.parametrize("api_servers", [1, 2])
def test_route_span_names_pinned_and_session_ranks(servers, receiver, api_servers):
    _, url = servers[api_servers]
    tp, pinned_trace, _ = traceparent()
    chat(url, tp, "Pinned to one", **{"X-data-parallel-rank": "1"})
    route = one(complete_trace(receiver, pinned_trace, {"route", "engine"}), "route")
    assert route.attributes["dpserve.route.reason"] == "pinned"
    assert route.attributes["dpserve.route.rank"] == 1
    assert one(receiver.trace(pinned_trace), "engine").service == "dpserve-engine-1"
    turns = []
    for content in ("First turn", "Second turn"):
        tp, trace_id, _ = traceparent()
        chat(url, tp, content, **{"X-Session-ID": f"tracing-{api_servers}"})
        turns.append(one(complete_trace(receiver, trace_id, {"route", "engine"}), "route"))
    assert [t.attributes["dpserve.route.reason"] for t in turns] == ["session", "session"]
    assert turns[0].attributes["dpserve.route.rank"] == turns[1].attributes["dpserve.route.rank"]


def test_route_span_names_a_cache_hit(servers, receiver):
    _, url = servers[1]  # cache-aware
    prompt = "A long story about caches, blocks and prefixes " * 4
    routes = []
    for _ in range(2):
        tp, trace_id, _ = traceparent()
        chat(url, tp, prompt)
        routes.append(one(complete_trace(receiver, trace_id, {"route", "engine"}), "route"))
    assert routes[0].attributes["dpserve.route.reason"] == "least_loaded"
    hit = routes[1].attributes
    assert hit["dpserve.route.reason"] == "cache_hit"
    assert hit["dpserve.route.rank"] == routes[0].attributes["dpserve.route.rank"]
    assert hit["dpserve.route.cache_blocks"] > 0
    assert hit[f"dpserve.rank.{hit['dpserve.route.rank']}.cache_blocks"] == \
        hit["dpserve.route.cache_blocks"]


def test_trace_file_holds_the_same_spans(servers, receiver):
    _, url = servers[1]
    tp, trace_id, _ = traceparent()
    chat(url, tp, "Write it down")
    names = {"POST /v1/chat/completions", "chat_template", *API_SPANS, *ENGINE_SPANS}
    received = complete_trace(receiver, trace_id, names)

    def in_file() -> list[dict]:
        with open(servers["trace_file"]) as f:
            lines = f.read().splitlines()
        spans = [json.loads(line) for line in lines]  # every line is one JSON object
        mine = [s for s in spans if s["trace_id"] == trace_id]
        return mine if names <= {s["name"] for s in mine} else []

    written = receiver.wait_for(in_file, 30, "the trace in the file")
    assert sorted((s["span_id"], s["parent_span_id"], s["name"]) for s in written) == \
        sorted((s.span_id, s.parent_span_id, s.name) for s in received)
    services = {s["service"] for s in written}
    assert "dpserve-api-server-0" in services and services & {"dpserve-engine-0",
                                                              "dpserve-engine-1"}


async def _streams(url: str, tps: list[str], started: list[int]) -> list[int]:
    """Stream one long completion per traceparent; their output token counts."""
    async def stream(client: httpx.AsyncClient, i: int, tp: str) -> int:
        body = {"prompt": f"Once upon a time {i}", "stream": True,
                "max_tokens": MOVED_TOKENS, "temperature": 0, "ignore_eos": True}
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"traceparent": tp}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    assert "error" not in chunk, chunk
                    n += 1
                    started[i] = 1
        return n

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(stream(client, i, tp) for i, tp in enumerate(tps)))


def test_migrated_request_shows_both_ranks_and_spans_flush_at_exit(servers, receiver):
    with stopping(servers["kill"]) as (proc, url):
        victim = proc_named(descendants(proc.pid), "EngineCore_1")
        parents = [traceparent() for _ in range(12)]
        started = [0] * len(parents)
        result: list[list[int]] = []
        runner = threading.Thread(target=lambda: result.append(asyncio.run(
            _streams(url, [tp for tp, _, _ in parents], started))))
        runner.start()
        receiver.wait_for(lambda: running_on(url, 1) > 0, 60, "rank 1 to run streams")
        victim.send_signal(signal.SIGKILL)
        runner.join(180)
        assert result and all(n >= 1 for n in result[0]), (result, output(proc)[-3000:])
        premise_moved(url, 0, "rank 1 was killed holding streams")
        # One more stream, under way when the drain begins: its spans come at exit.
        last_tp, last_trace, _ = traceparent()
        last_started = [0]
        last: list[list[int]] = []
        tail = threading.Thread(target=lambda: last.append(asyncio.run(
            _streams(url, [last_tp], last_started))))
        tail.start()
        receiver.wait_for(lambda: last_started[0], 60, "the last stream to begin")
        proc.send_signal(signal.SIGTERM)
        tail.join(120)
        assert last and last[0][0] >= 1
        assert proc.wait(60) == 0
    spans = complete_trace(receiver, last_trace, {"POST /v1/completions", "route",
                                                  *ENGINE_SPANS})
    assert one(spans, "engine").attributes["dpserve.finish_reason"] == "length"
    moved = [s for tp, trace_id, _ in parents for s in receiver.trace(trace_id)
             if s.name == "migrate"]
    assert moved, "no traced request shows its move"
    print(f"premise: {len(moved)} of {len(parents)} traced streams moved off rank 1")
    for migrate in moved:
        trace = receiver.trace(migrate.trace_id)
        assert migrate.attributes["dpserve.migrate.from_rank"] == 1
        assert migrate.attributes["dpserve.migrate.to_rank"] == 0
        first = one(trace, "route")
        assert first.attributes["dpserve.route.rank"] == 1  # where it ran first
        assert migrate.parent_span_id == first.span_id and migrate.links == [first.span_id]
        after = [s for s in trace if s.name == "engine" and s.parent_span_id == migrate.span_id]
        assert [s.service for s in after] == ["dpserve-engine-0"]
        assert after[0].attributes["dpserve.prior_output_tokens"] == \
            migrate.attributes["dpserve.migrate.tokens"]
        assert one(trace, "POST /v1/completions").parent_span_id is not None


@pytest.fixture(scope="module")
def pd_server(tiny_llama, receiver):
    with serve_all([str(tiny_llama), *DP_ARGS, "--num-kv-blocks", "128",
                    "--kv-offload-memory", "32MiB", "--data-parallel-roles",
                    "prefill:1,decode:1", "--otlp-traces-endpoint", receiver.url],
                   env=SOON) as [(_, url)]:
        yield url


def test_handoff_shows_the_prefill_and_the_decode_rank(pd_server, receiver):
    tp, trace_id, _ = traceparent()
    r = httpx.post(pd_server + "/v1/completions", timeout=60, headers={"traceparent": tp},
                   json={"prompt": "The quick brown fox jumps over the lazy dog " * 3,
                         "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    spans = complete_trace(receiver, trace_id, {"route", "migrate", "engine"}, engines=2)
    route, migrate = one(spans, "route"), one(spans, "migrate")
    assert (route.attributes["dpserve.route.rank"], route.attributes["dpserve.route.role"]) \
        == (0, "prefill")
    assert migrate.attributes["dpserve.migrate.from_rank"] == 0
    assert migrate.attributes["dpserve.migrate.to_rank"] == 1
    assert "handoff" in migrate.attributes["dpserve.migrate.why"]
    assert migrate.parent_span_id == route.span_id and migrate.links == [route.span_id]
    legs = {s.service: s for s in spans if s.name == "engine"}
    assert legs["dpserve-engine-0"].parent_span_id == route.span_id
    assert legs["dpserve-engine-0"].attributes["dpserve.output_tokens"] == 1
    assert legs["dpserve-engine-1"].parent_span_id == migrate.span_id
    assert legs["dpserve-engine-1"].attributes["dpserve.prior_output_tokens"] == 1
    assert legs["dpserve-engine-1"].attributes["dpserve.output_tokens"] == 7
