"""Elastic expert parallelism: `POST /scale_elastic_ep` re-shards the experts.

A tiny random Mixtral (8 experts, top-2) served with --enable-expert-parallel at
DP=2 (up to 3) is scaled 2 -> 3 -> 1 while 8 greedy streams run: no
stream is cut and every one equals one engine's output; after each change
every rank reports (GET /debug/dp_state) the experts of its new share,
[r*8//N, (r+1)*8//N), and completions pinned to each rank still equal one
engine's. The DP link adopts a new size only from a generation with every
rank of it.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import (
    FAULT_PROMPTS,
    descendants,
    expected_greedy,
    offline_greedy_texts,
    output,
    process_names,
    serve,
    streams_with_fault,
    wait_until,
)

from dpserve.engine.dp import DPLink
from dpserve.protocol import RegroupDP
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = [pytest.mark.procs, pytest.mark.slow]

PROMPTS = FAULT_PROMPTS[:8]
SHORT = [f"Once upon a time {i}" for i in range(3)]
ARGS = ("--enable-expert-parallel", "--threads-per-engine", "1", "--max-model-len", "256",
        "--enable-admin-api", "--allow-unauthenticated-admin", "--shutdown-timeout", "120")


def _experts(url: str) -> dict[str, list[int]]:
    engines = httpx.get(url + "/debug/dp_state", timeout=30).json()["engines"]
    return {rank: e["experts"]["experts"] for rank, e in engines.items()}


def _share(size: int) -> dict[str, list[int]]:
    return {str(r): [r * 8 // size, (r + 1) * 8 // size] for r in range(size)}


def _scale(url: str, size: int) -> httpx.Response:
    return httpx.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": size},
                      timeout=300)


def _pinned(url: str, model: str, rank: int) -> list[str]:
    out = []
    for prompt in SHORT:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=120,
                          headers={"X-data-parallel-rank": str(rank)})
        assert resp.status_code == 200, resp.text
        out.append(resp.json()["choices"][0]["text"])
    return out


def test_scaling_reshards_the_experts(tmp_path):
    model = str(make_tiny_model(tmp_path / "mixtral", "mixtral"))
    expected = expected_greedy(model, PROMPTS)
    short = offline_greedy_texts(model, SHORT, max_tokens=12)
    with serve(model, *ARGS, "--data-parallel-size", "2", "--data-parallel-size-max", "3",
               timeout=180) as (proc, url):
        assert _experts(url) == _share(2)
        for size in (3, 1):  # grow by one rank, then shrink by two at once
            result: list[httpx.Response] = []
            texts = asyncio.run(streams_with_fault(
                url, model, lambda s=size, out=result: out.append(_scale(url, s)),
                prompts=PROMPTS))
            assert result[0].status_code == 200, result[0].text
            assert texts == expected, f"streams while scaling to {size}"
            wait_until(lambda s=size: {n for n in process_names(descendants(proc.pid))
                                       if n.startswith("EngineCore_")}
                       == {f"EngineCore_{r}" for r in range(s)}, 60,
                       f"exactly {size} engines")
            wait_until(lambda s=size: _experts(url) == _share(s), 60,
                       f"every rank to hold its share of {size}")
            for rank in range(size):
                assert _pinned(url, model, rank) == short, f"rank {rank} of {size}"
        log = output(proc)
        assert "re-sharded" in log
        assert proc.poll() is None


def test_a_new_size_is_adopted_only_with_every_rank_of_it():
    """DPLink (pure logic, sockets connect to nothing): re-shard once, to the size of a
    generation holding exactly ranks 0..M-1 with this one among them."""
    link = DPLink(1, 2, "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", lockstep=True,
                  expert_parallel=True)
    try:
        link.on_regroup(RegroupDP(1, [0, 1], 2))
        assert link.take_reshard() is None and link.dp_size == 2
        link.on_regroup(RegroupDP(2, [0, 2], 3))  # rank 1 is here, but not all of 0..2
        assert link.take_reshard() is None and link.dp_size == 2
        link.on_regroup(RegroupDP(3, [0, 1, 2], 3))
        assert link.take_reshard() == 3 and link.take_reshard() is None
        assert link.dp_size == 3
        link.on_regroup(RegroupDP(4, [0], 1))  # this rank is being removed: no re-shard
        assert link.take_reshard() is None and link.dp_size == 3
        link.on_regroup(RegroupDP(5, [0, 1], 0))  # size unknown (0): the old one stands
        assert link.take_reshard() is None
    finally:
        link.close()
