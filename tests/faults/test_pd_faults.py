"""Faults mid-handoff on `dpserve serve --data-parallel-roles prefill:1,decode:1`
(tiny model, DP=2, host tier): SIGKILL of the prefill rank while it runs first legs,
SIGKILL of the decode rank while it runs continuations. Every stream completes with
the colocated greedy text (an undisturbed in-process run); the premise is checked
from the engine side (the rank ran requests right before the fault, and requests
moved); once the rank is back, new requests are handed off again.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from helpers import (
    FAULT_SEQS,
    descendants,
    metric_sum,
    offline_greedy_texts,
    output,
    premise_moved,
    proc_named,
    serve_all,
    stopping,
    streams_with_fault,
    wait_rank,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]

PD_ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256",
           "--num-kv-blocks", "256", "--kv-offload-memory", "32MiB",
           "--data-parallel-roles", "prefill:1,decode:1", *FAULT_SEQS,
           # small steps: a prompt's prefill takes ~20, so the prefill rank holds first
           # legs long enough for the fault to find them there
           "--max-num-batched-tokens", "8")
# Several full KV blocks each; distinct from the first block on (no prefix sharing).
PROMPTS = [f"Tale {i}: " + "the quick brown fox jumps over the lazy dog. " * 10
           for i in range(24)]  # ~166 tokens each
TOKENS = 48
HANDOFFS = "dpserve:pd_handoffs_total"


@pytest.fixture(scope="module")
def pd_servers(tiny_llama):
    with serve_all(*[[str(tiny_llama), *PD_ARGS]] * 2) as servers:
        yield dict(zip(("prefill", "decode"), servers))


def expected(model: str) -> list[str]:
    return offline_greedy_texts(model, PROMPTS, max_tokens=TOKENS, ignore_eos=True)


def moved(url: str) -> float:
    return (metric_sum(url, "dpserve:request_retries_total")
            + metric_sum(url, "dpserve:request_migrations_total"))


def handed_off_again(url: str, model: str) -> None:
    """The restarted rank serves its role again: new requests are handed off."""
    before = metric_sum(url, HANDOFFS)
    for prompt in PROMPTS[:3]:
        resp = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert resp.status_code == 200, resp.text
    assert metric_sum(url, HANDOFFS) - before == 3


@pytest.mark.parametrize("role, rank", [("prefill", 0), ("decode", 1)])
def test_sigkill_mid_handoff_every_stream_completes_with_the_colocated_text(
        pd_servers, tiny_llama, role, rank):
    model = str(tiny_llama)
    want = expected(model)
    with stopping(pd_servers[role]) as (proc, url):
        victim = proc_named(descendants(proc.pid), f"EngineCore_{rank}")
        try:
            got = asyncio.run(streams_with_fault(url, model,
                                                 lambda: victim.send_signal(signal.SIGKILL),
                                                 PROMPTS, max_tokens=TOKENS, on_rank=rank,
                                                 also=lambda: metric_sum(url, HANDOFFS) > 0))
        except Exception:
            print("server log:", "\n".join(line for line in output(proc).splitlines()
                                            if "ERROR" in line or "WARN" in line)[-4000:])
            raise
        assert got == want
        # Requests it held moved to the other rank (first legs re-sent whole, or
        # continuations migrated with their tokens), which ran them colocated.
        assert moved(url) > 0, f"premise did not hold: rank {rank} was killed holding " \
                               f"requests, but none moved"
        if role == "decode":
            premise_moved(url, 0, "the decode rank was killed holding continuations")
        assert metric_sum(url, HANDOFFS) > 0  # handoffs happened (the fault waited for one)
        wait_rank(url, rank, lambda e: e["state"] == "serving" and e["incarnation"] == 1)
        handed_off_again(url, model)
