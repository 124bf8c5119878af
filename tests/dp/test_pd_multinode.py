"""Prefill and decode on two hosts (played on one machine, as tests/dp/test_multinode.py
does: a head with rank 0 and the API server on 127.0.0.2, a headless host with rank 1,
whose address towards the head is 127.0.0.1, each with its own KV store listening on
its own address): `--data-parallel-roles prefill:1,decode:1`. The prompt's blocks
cross from the head's store to the headless host's (`dpserve.kv_tier.pull`) before
the continuation goes to rank 1, which loads them from its own host's store; the
client gets the colocated greedy text."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import (
    MULTIHOST_ARGS,
    complete_all,
    free_port,
    metric_sum,
    offline_greedy_texts,
    output,
    read_log,
    serve,
    start_background,
    stop,
    wait_until,
)
from test_pd_serve import BLOCK, PROMPTS, per_engine

pytestmark = [pytest.mark.procs, pytest.mark.slow]

PD = ("--kv-offload-memory", "32MiB", "--data-parallel-roles", "prefill:1,decode:1")
HEAD = "127.0.0.2"  # the head's data-parallel address (its store's); the other host's: 127.0.0.1


def test_prefill_on_the_head_decode_on_a_headless_host(tiny_llama):
    model, rpc = str(tiny_llama), free_port(HEAD)
    group = ("--data-parallel-size", "2", "--data-parallel-address", HEAD,
             "--data-parallel-rpc-port", str(rpc), *MULTIHOST_ARGS, *PD)
    want = offline_greedy_texts(model, PROMPTS, max_tokens=16)
    headless, log = start_background(model, "--headless", "--data-parallel-size-local", "1",
                                     "--data-parallel-start-rank", "1", *group)
    try:
        with serve(model, "--data-parallel-size-local", "1", *group) as (head, url):
            # Handoffs pull only between known stores: wait for both ranks' heartbeats.
            wait_until(lambda: all(r["host"] for r in httpx.get(
                url + "/engines", timeout=5).json()["engines"]), 30, "both ranks' heartbeats")
            got = asyncio.run(complete_all(url, model, PROMPTS, max_tokens=16))
            assert got == want
            assert metric_sum(url, "dpserve:pd_handoffs_total") == len(PROMPTS)
            # The blocks crossed hosts, and rank 1 loaded them from its own host's store.
            pulled = metric_sum(url, "dpserve:pd_pulled_blocks_total")
            assert pulled >= len(PROMPTS) * 3, (pulled, [
                line for line in output(head).splitlines() if "pull" in line.lower()][-20:])
            assert per_engine(url, "external_prefix_cache_hits", 1) >= pulled * BLOCK
    finally:
        stop(headless, 15)
        print(read_log(log)[-2000:])
        log.close()
