"""MoE models over real engine processes: lockstep by itself, and expert parallelism.

A tiny random Mixtral (8 experts, top-2) at DP=2: with
`enable_expert_parallel` each rank holds half the experts (measured: their
parameter bytes are half of one engine's) and the outputs equal one engine
token for token; requests all pinned to rank 0 complete while rank 1 runs
dummy batches, the waves end on both ranks, and both ranks ran the same
number of expert-parallel collectives. Served through the official openai
client, lockstep switches on without --data-parallel-lockstep.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import openai
import pytest
from drain_checks import check_drain
from helpers import (
    FAULT_SEQS,
    descendants,
    expected_greedy,
    offline_greedy_texts,
    output,
    premise_moved,
    proc_named,
    serve,
    serve_all,
    stopping,
    streams_with_fault,
)

from dpserve import LLM, SamplingParams
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.procs

PROMPTS = [{"prompt_token_ids": [5 + i, 17, 99, 3, 42 + 2 * i, 7, 8]} for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
TEXT_PROMPTS = [f"Once upon a time {i}" for i in range(6)]
FAULT_PROMPTS = [f"Once upon a time {i}" for i in range(12)]


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral")


def _tokens(llm: LLM, **kwargs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, **kwargs)]


def _settled(states: list[dict]) -> bool:
    """Both ranks paused in the same wave (the last one ended everywhere)."""
    return not any(s["running"] for s in states) and states[0]["wave"] == states[1]["wave"]


def _wait_settled(get_states, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        states = get_states()
        if _settled(states):
            return states
        assert time.monotonic() < deadline, f"waves did not end on both ranks: {states}"
        time.sleep(0.05)


def test_expert_parallel_equals_one_engine_with_half_the_experts(tiny_mixtral):
    one = LLM(str(tiny_mixtral), threads_per_engine=1, max_model_len=256)
    expected = _tokens(one)
    whole = one.engine.call_utility("expert_info")
    assert whole["experts"] == [0, 8] and not whole["expert_parallel"]
    ep = LLM(str(tiny_mixtral), data_parallel_size=2, enable_expert_parallel=True,
             max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8)
    try:
        assert _tokens(ep) == expected  # spread over both ranks, chunked prefill
        info = [ep.engine.call_utility("expert_info", rank=r) for r in (0, 1)]
        assert [i["experts"] for i in info] == [[0, 4], [4, 8]]
        assert all(i["expert_parallel"] for i in info)
        assert [i["expert_bytes"] for i in info] == [whole["expert_bytes"] // 2] * 2

        def states() -> list[dict]:
            return [ep.engine.call_utility("get_dp_state", rank=r) for r in (0, 1)]

        before = _wait_settled(states)
        assert all(s["lockstep"] for s in before)
        # Every request on rank 0: rank 1 keeps in step with dummy batches.
        assert _tokens(ep, data_parallel_rank=0) == expected
        after = _wait_settled(states)
        assert after[1]["dummy_batches"] > before[1]["dummy_batches"]
        assert after[0]["wave"] > before[0]["wave"]
        info = [ep.engine.call_utility("expert_info", rank=r) for r in (0, 1)]
        assert info[0]["collectives"] == info[1]["collectives"] > 0  # they matched
    finally:
        ep.shutdown()


# Servers for two tests each, started at once (their start-ups overlap): each test
# still has a server of its own, stopped when it ends.
@pytest.fixture(scope="module")
def served_pair(tiny_mixtral):
    """With and without expert parallelism."""
    model, args = str(tiny_mixtral), ("--data-parallel-size", "2", "--threads-per-engine",
                                      "1", "--max-model-len", "256")
    with serve_all([model, *args, "--enable-expert-parallel"], [model, *args]) as servers:
        yield dict(zip(("ep", "plain"), servers))


@pytest.fixture(scope="module")
def killed_ep_server(tiny_mixtral):
    """Expert parallel, for a SIGKILLed rank (restarted)."""
    with serve(str(tiny_mixtral), "--data-parallel-size", "2", "--enable-expert-parallel",
               "--threads-per-engine", "1", "--max-model-len", "256", *FAULT_SEQS,
               "--engine-failure-policy", "restart") as server:
        yield server


def test_served_with_expert_parallel_through_the_openai_client(served_pair, tiny_mixtral):
    model = str(tiny_mixtral)
    expected = offline_greedy_texts(model, TEXT_PROMPTS, max_tokens=12)
    with stopping(served_pair["ep"]) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)

        def complete(prompt: str, rank: int | None = None) -> str:
            headers = {"X-data-parallel-rank": str(rank)} if rank is not None else None
            return client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                             temperature=0,
                                             extra_headers=headers).choices[0].text

        def states() -> list[dict]:
            engines = httpx.get(url + "/debug/dp_state", timeout=10).json()["engines"]
            return [engines["0"]["dp"], engines["1"]["dp"]]

        assert [complete(p) for p in TEXT_PROMPTS] == expected
        before = _wait_settled(states)
        assert [complete(p, rank=0) for p in TEXT_PROMPTS] == expected
        after = _wait_settled(states)
        assert all(s["lockstep"] for s in after)
        assert after[1]["dummy_batches"] > before[1]["dummy_batches"]
        engines = httpx.get(url + "/debug/dp_state", timeout=10).json()["engines"]
        assert [engines[r]["experts"]["experts"] for r in "01"] == [[0, 4], [4, 8]]


def test_moe_without_expert_parallel_runs_lockstep_by_itself(served_pair, tiny_mixtral):
    model = str(tiny_mixtral)
    expected = offline_greedy_texts(model, TEXT_PROMPTS[:3], max_tokens=8)
    with stopping(served_pair["plain"]) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
        got = [client.completions.create(model=model, prompt=p, max_tokens=8,
                                         temperature=0).choices[0].text
               for p in TEXT_PROMPTS[:3]]
        assert got == expected
        engines = httpx.get(url + "/debug/dp_state", timeout=10).json()["engines"]
        assert all(engines[r]["dp"]["lockstep"] for r in "01")
        assert [engines[r]["experts"]["experts"] for r in "01"] == [[0, 8], [0, 8]]


def test_a_rank_killed_under_expert_parallel_loses_nothing(killed_ep_server, tiny_mixtral):
    """SIGKILL rank 1 mid-stream: rank 0's collective fails at once, it drops that step
    (its requests recompute later) and holds every request, its own and those moved
    from rank 1, until rank 1's new process is back in the group; every stream then
    ends as an undisturbed run does."""
    model = str(tiny_mixtral)
    expected = expected_greedy(model, FAULT_PROMPTS)
    with stopping(killed_ep_server) as (proc, url):
        victim = proc_named(descendants(proc.pid), "EngineCore_1")

        def kill_while_it_runs_streams() -> None:
            victim.send_signal(signal.SIGKILL)

        got = asyncio.run(streams_with_fault(url, model, kill_while_it_runs_streams,
                                             FAULT_PROMPTS, on_rank=1))
        assert got == expected
        premise_moved(url, 0, "rank 1 was killed holding streams")
        log = output(proc)
        assert "expert-parallel step failed" in log  # rank 0 was mid-forward: dropped
        assert "engine 0 hit a fatal error" not in log
        # Rank 0 never stepped without rank 1's experts: it held its requests while a
        # generation lacked rank 1, or (rank 1 back from the forkserver within the
        # coordinator's regroup delay) the next generation it was named had rank 1.
        held = "engine 0: expert parallel needs every rank's experts; holding" in log
        assert held or re.search(r"engine 0: DP group generation [2-9]\d*: ranks \[0, 1\]",
                                 log), log[-4000:]
        assert re.search(r"engine 1: joined DP group generation \d+", log)
        engines = httpx.get(url + "/debug/dp_state", timeout=10).json()["engines"]
        assert engines["1"]["dp"]["regroups"] >= 1 and engines["0"]["dp"]["regroups"] >= 2


@pytest.mark.alone  # the drain's 503 checks race its long stream (as test_drain's)
def test_sigterm_to_the_process_group_drains_under_expert_parallel(tiny_mixtral):
    """As systemd stops a service: every process gets SIGTERM at once. A rank without
    requests of its own must not leave while the others' requests need its experts:
    under expert parallelism it stays in the running wave (dummy batches) and leaves
    when the wave ends; every stream finishes whole, exit code 0. The server leads a
    process group of its own, as a shell's foreground job."""
    with serve(str(tiny_mixtral), "--shutdown-timeout", "120", "--data-parallel-size", "2",
               "--enable-expert-parallel", "--threads-per-engine", "1",
               new_session=True) as server:
        check_drain(server, str(tiny_mixtral), group_signal=signal.SIGTERM)
