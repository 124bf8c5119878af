"""A frozen decode rank (SIGSTOP) and no decode rank left (SIGKILL under `--engine-failure-
policy isolate`) on `dpserve serve --data-parallel-roles prefill:1,decode:1` (tiny model,
DP=2, host tier): every stream completes with the colocated greedy text; with no decode
rank serving, the prefill rank decodes (nothing is handed off) and /engines shows it.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from helpers import (
    descendants,
    finished_by_engine,
    metric_sum,
    offline_greedy_texts,
    premise_moved,
    proc_named,
    serve_all,
    stopping,
    streams_with_fault,
    wait_rank,
)
from test_pd_faults import HANDOFFS, PD_ARGS, PROMPTS, TOKENS

pytestmark = [pytest.mark.procs, pytest.mark.slow]


@pytest.fixture(scope="module")
def pd_servers(tiny_llama):
    model = str(tiny_llama)
    with serve_all([model, *PD_ARGS],
                   [model, *PD_ARGS, "--engine-failure-policy", "isolate"]) as servers:
        yield dict(zip(("sigstop", "isolate"), servers))


def test_sigstop_decode_rank_every_stream_completes(pd_servers, tiny_llama):
    model = str(tiny_llama)
    prompts = PROMPTS[:16]
    want = offline_greedy_texts(model, prompts, max_tokens=TOKENS, ignore_eos=True)
    with stopping(pd_servers["sigstop"]) as (proc, url):
        victim = proc_named(descendants(proc.pid), "EngineCore_1")
        try:
            got = asyncio.run(streams_with_fault(url, model,
                                                 lambda: victim.send_signal(signal.SIGSTOP),
                                                 prompts, max_tokens=TOKENS, on_rank=1))
            assert got == want  # moved off the frozen decode rank, nothing doubled
            premise_moved(url, 0, "the decode rank was frozen holding continuations")
            entry = wait_rank(url, 1, lambda e: e["state"] == "unhealthy", timeout=30)
            assert "heartbeat" in entry["reason"]
        finally:
            victim.send_signal(signal.SIGCONT)
        wait_rank(url, 1, lambda e: e["state"] == "serving", timeout=30)


def test_no_decode_rank_left_the_prefill_rank_decodes(pd_servers, tiny_llama):
    model = str(tiny_llama)
    prompts = PROMPTS[:4]
    want = offline_greedy_texts(model, prompts, max_tokens=TOKENS, ignore_eos=True)
    with stopping(pd_servers["isolate"]) as (proc, url):
        proc_named(descendants(proc.pid), "EngineCore_1").send_signal(signal.SIGKILL)
        wait_rank(url, 1, lambda e: e["state"] == "dead", timeout=30)
        before, finished = metric_sum(url, HANDOFFS), finished_by_engine(url).get(0, 0)
        got = [httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": p, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}).json()["choices"][0]["text"] for p in prompts]
        assert got == want
        assert metric_sum(url, HANDOFFS) == before  # nothing handed off: colocated
        assert finished_by_engine(url).get(0, 0) - finished == len(prompts)
        rows = httpx.get(url + "/engines", timeout=5).json()["engines"]
        assert [(r["role"], r["state"]) for r in rows] == [("prefill", "serving"),
                                                           ("decode", "dead")]
