"""Tracing in one process, with OpenTelemetry's in-memory exporter.

* the options: a bad URL or a missing directory is a ConfigError naming the option;
* the engine: a real scheduler driven by hand-made model outputs writes, for a traced
  request, `engine` > `queue` / `prefill` (an event per prefill chunk) / `decode`, with
  `preempted` events, under the carrier's span; an untraced request records nothing;
* the placement: `RouteTrace` over a real `RankTable` names the rank and the reason
  (pinned, session, cache hit, least loaded) and each candidate's figures; a move's
  `migrate` span is a child of the placement it leaves, linked to it;
* the API server: `build_app` over an in-process engine, a request with a client's
  `traceparent`: one trace, the client's, its root span the client span's child, with
  parse, chat template, admit and the engine's spans under it; no prompt text anywhere;
* the JSONL exporter: every line one JSON span, from two exporters on one file.

Across processes (OTLP/HTTP, DP=2, N API servers, migration): tests/server/test_tracing_serve.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from helpers import serve_app
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dpserve import tracing
from dpserve.config import CacheConfig, EngineArgs, SchedulerConfig
from dpserve.engine.request import Request
from dpserve.engine.scheduler import Scheduler
from dpserve.errors import ConfigError
from dpserve.frontend.migration import Move
from dpserve.frontend.rank_table import RankTable
from dpserve.frontend.route_trace import RouteTrace, migrate_span
from dpserve.frontend.routing import Router
from dpserve.protocol import EngineCoreRequest, Session
from dpserve.sampling_params import SamplingParams
from dpserve.step import ModelRunnerOutput
from dpserve.tracing import TracingConfig
from dpserve.tracing.engine_trace import RequestTrace
from dpserve.tracing.provider import JsonlSpanExporter
from dpserve.tracing.spans import carrier_of, start_span

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def make_scheduler(num_blocks: int = 32, budget: int = 64, max_model_len: int = 64
                   ) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=4, kv_cache_memory=None,
                                 gpu_memory_utilization=0.9, enable_prefix_caching=True,
                                 num_kv_blocks=num_blocks), num_blocks)


def make_request(req_id: str, num_prompt: int, **params) -> Request:
    return Request(req_id, [100 + i for i in range(num_prompt)], SamplingParams(**params),
                   eos_token_id=2)


def step(sched: Scheduler) -> None:
    """One step, each sampled row getting token 7 (never EOS)."""
    out = sched.schedule()
    req_ids = [s.req_id for s in out.scheduled if s.sample]
    sched.update_from_output(out, ModelRunnerOutput(req_ids, [7] * len(req_ids)))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """This process traces (as engine 3) into memory for the test."""
    exporter = InMemorySpanExporter()
    tracing.install(TracingConfig(trace_file="unused"), "engine", 3, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    found: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


# ---- options ------------------------------------------------------------------------


def test_bad_options_are_one_line_errors_naming_them(tmp_path):
    with pytest.raises(ConfigError, match="^otlp_traces_endpoint must be an http"):
        EngineArgs(otlp_traces_endpoint="localhost:4318")
    with pytest.raises(ConfigError, match="^trace_file .*no directory"):
        EngineArgs(trace_file=str(tmp_path / "missing" / "spans.jsonl"))
    args = EngineArgs(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces",
                      trace_file=str(tmp_path / "spans.jsonl"))
    assert args.tracing_config() == TracingConfig("http://127.0.0.1:4318/v1/traces",
                                                  str(tmp_path / "spans.jsonl"))
    assert EngineArgs().tracing_config() is None


def test_without_the_sdk_the_option_names_the_pip_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # a fake: the SDK not installed
                        lambda name, *a: None if name.startswith("opentelemetry")
                        else real(name, *a))
    with pytest.raises(ConfigError, match=r"^otlp_traces_endpoint needs the OpenTelemetry "
                       r"SDK .*pip install 'dpserve\[tracing\]'$"):
        EngineArgs(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    with pytest.raises(ConfigError, match=r"^trace_file needs"):
        EngineArgs(trace_file="spans.jsonl")


@pytest.mark.procs
def test_a_bad_flag_is_one_line_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tmp_path),
                           "--otlp-traces-endpoint", "localhost:4318"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "dpserve: error: --otlp-traces-endpoint must be an http:// or https:// URL (the "
        "OTLP/HTTP traces endpoint), got 'localhost:4318'")


def test_off_costs_a_shared_no_op():
    assert not tracing.active()
    assert tracing.child_span("parse", None) is tracing.child_span("tokenize", None)
    assert tracing.child_span("parse", {"traceparent": TRACEPARENT}) is \
        tracing.child_span("parse", None)  # tracing off: a carrier changes nothing


# ---- the engine ---------------------------------------------------------------------


def test_engine_spans_queue_prefill_chunks_decode_under_the_carrier(spans):
    parent = start_span("route", {"traceparent": TRACEPARENT})
    sched = make_scheduler(budget=8)
    traced = make_request("traced", 20, max_tokens=3)
    traced.trace = RequestTrace(carrier_of(parent), rank=3)
    plain = make_request("plain", 4, max_tokens=3)
    sched.add_request(traced)
    sched.add_request(plain)
    while sched.has_unfinished_requests():
        step(sched)
    parent.end()
    assert plain.trace is None
    found = by_name(spans)
    engine, = found["engine"]
    assert engine.context.trace_id == int(CLIENT_TRACE, 16)
    assert engine.parent.span_id == parent.context.span_id
    assert engine.attributes["dpserve.rank"] == 3
    assert engine.attributes["dpserve.prompt_tokens"] == 20
    assert engine.attributes["dpserve.output_tokens"] == 3
    assert engine.attributes["dpserve.finish_reason"] == "length"
    for name in ("queue", "prefill", "decode"):
        span, = found[name]
        assert span.parent.span_id == engine.context.span_id
    prefill, = found["prefill"]
    # 20 prompt tokens under a budget of 8: chunks of 8, 8 and 4
    assert [(e.attributes["dpserve.start"], e.attributes["dpserve.tokens"])
            for e in prefill.events] == [(0, 8), (8, 8), (16, 4)]
    assert found["queue"][0].end_time <= prefill.start_time <= prefill.end_time
    assert prefill.end_time <= found["decode"][0].start_time <= engine.end_time


def test_engine_records_preemptions(spans):
    # 3 blocks of 4 tokens: two requests of 4 prompt tokens each need a second block
    # while decoding, and one of them is preempted.
    sched = make_scheduler(num_blocks=3, budget=16, max_model_len=12)
    requests = [make_request(f"r{i}", 4, max_tokens=6, ignore_eos=True) for i in range(2)]
    for r in requests:
        r.trace = RequestTrace({"traceparent": TRACEPARENT}, rank=0)
        sched.add_request(r)
    while sched.has_unfinished_requests():
        step(sched)
    preempted = sum(r.num_preemptions for r in requests)
    assert preempted >= 1, "premise: the cache was too small for both"
    engines = by_name(spans)["engine"]
    assert sum(s.attributes["dpserve.preemptions"] for s in engines) == preempted
    assert sum(e.name == "preempted" for s in engines for e in s.events) == preempted


# ---- the placement ------------------------------------------------------------------


def table(policy: str = "least-loaded") -> RankTable:
    t = RankTable(range(3), Router(policy, block_size=4))
    for rank in range(3):
        t.register(rank)
    return t


def traced_request(rid: str, prompt: list[int], **kw) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(max_tokens=8),
                             trace_headers={"traceparent": TRACEPARENT}, **kw)


def route(t: RankTable, request: EngineCoreRequest) -> tuple[int, dict]:
    with RouteTrace(t, request) as r:
        rank = r.choose().rank
        t.assign(t.engines[rank])
        sent = r.carried_by(request)
    assert sent.trace_headers["traceparent"].split("-")[2] == f"{r.span.context.span_id:016x}"
    return rank, dict(r.span.attributes)


def test_route_names_the_rank_the_reason_and_every_candidate(spans):
    t = table("cache-aware")
    prompt = list(range(40))
    first, attrs = route(t, traced_request("a", prompt))
    assert attrs["dpserve.route.reason"] == "least_loaded"
    assert attrs["dpserve.route.rank"] == first
    assert attrs["dpserve.route.candidates"] == (0, 1, 2)
    assert [attrs[f"dpserve.rank.{r}.load"] for r in range(3)] == [0, 0, 0]
    rank, attrs = route(t, traced_request("b", prompt))  # the same prefix: its rank
    assert (rank, attrs["dpserve.route.reason"]) == (first, "cache_hit")
    assert attrs["dpserve.route.cache_blocks"] == attrs[f"dpserve.rank.{first}.cache_blocks"] == 9
    assert attrs[f"dpserve.rank.{first}.load"] == 1
    rank, attrs = route(t, traced_request("c", prompt, data_parallel_rank=2))
    assert (rank, attrs["dpserve.route.reason"]) == (2, "pinned")
    session = Session("conversation-1")
    rank, attrs = route(t, traced_request("d", [7] * 9, session=session))
    again, attrs = route(t, traced_request("e", [8] * 9, session=session))
    assert (again, attrs["dpserve.route.reason"]) == (rank, "session")
    routes = by_name(spans)["route"]
    assert len(routes) == 5 and all(s.parent.span_id == int(CLIENT_SPAN, 16) for s in routes)


def test_a_move_gets_a_migrate_span_under_and_linked_to_its_placement(spans):
    t = table()
    request = traced_request("a", [1, 2, 3])
    with RouteTrace(t, request) as r:
        r.choose()
        sent = r.carried_by(request)
    move = migrate_span(Move("a", sent, source=1, target=0, num_tokens=5), "rank 1 dead")
    migrate, = by_name(spans)["migrate"]
    assert migrate.parent.span_id == r.span.context.span_id
    assert [link.context.span_id for link in migrate.links] == [r.span.context.span_id]
    assert migrate.attributes["dpserve.migrate.from_rank"] == 1
    assert migrate.attributes["dpserve.migrate.to_rank"] == 0
    assert move.request.trace_headers["traceparent"].split("-")[1] == CLIENT_TRACE
    assert move.request.trace_headers != sent.trace_headers  # the engine's spans: under it


# ---- the API server -----------------------------------------------------------------


def test_api_request_is_one_trace_under_the_clients_span(spans, tiny_llama):
    from dpserve.frontend.async_llm import AsyncLLM
    from dpserve.server.app import build_app
    from dpserve.testing.inproc_client import InprocEngineClient

    config = EngineArgs(model=str(tiny_llama), num_kv_blocks=64).create_config()
    client = InprocEngineClient(config)
    llm = AsyncLLM(config, client)
    app = build_app(llm, "tiny")
    secret = "the secret word is armadillo"
    with serve_app(app, stop_first=llm.shutdown) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={
            "traceparent": TRACEPARENT}, json={"model": "tiny", "max_tokens": 4,
                                               "messages": [{"role": "user",
                                                             "content": secret}]})
        assert r.status_code == 200, r.text
        untraced = httpx.post(url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert untraced.status_code == 200
    found = by_name(spans)
    root, = found["POST /v1/chat/completions"]
    other, = found["POST /v1/completions"]  # no traceparent: a trace of its own
    assert root.context.trace_id == int(CLIENT_TRACE, 16) != other.context.trace_id
    assert root.parent.span_id == int(CLIENT_SPAN, 16)
    assert root.attributes["http.response.status_code"] == 200
    mine = [s for s in spans.get_finished_spans() if s.context.trace_id == root.context.trace_id]
    parents = {s.name: s.parent.span_id for s in mine}
    for name in ("parse", "chat_template", "admit", "engine"):
        assert parents[name] == root.context.span_id, name
    engine = next(s for s in mine if s.name == "engine")
    assert engine.attributes["dpserve.output_tokens"] == 4
    for span in mine:  # sizes, ids and timings only: never the prompt
        assert secret not in json.dumps({**dict(span.attributes),
                                         "events": [dict(e.attributes) for e in span.events]})


# ---- the JSONL file -----------------------------------------------------------------


def test_jsonl_exporters_share_a_file_one_span_per_line(tmp_path):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    path = str(tmp_path / "spans.jsonl")
    names = []
    for i in range(2):  # two processes' exporters, one file
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
        parent = provider.get_tracer("t").start_span(f"p{i}")
        parent.end()
        child = provider.get_tracer("t").start_span(
            f"c{i}", context=trace.set_span_in_context(parent),
            attributes={"dpserve.rank": i})
        child.end()
        provider.shutdown()
        names += [f"p{i}", f"c{i}"]
    lines = [json.loads(line) for line in open(path).read().splitlines()]
    assert [s["name"] for s in lines] == names
    assert lines[1]["parent_span_id"] == lines[0]["span_id"] and lines[0]["parent_span_id"] is None
    assert lines[3]["attributes"] == {"dpserve.rank": 1}
    assert all(len(s["trace_id"]) == 32 and s["end_unix_ns"] >= s["start_unix_ns"]
               for s in lines)
