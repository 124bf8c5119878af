"""A handoff's first leg from the engine's side (`do_remote_decode`): real engine cores
(tiny random Llama, float32, two tensor-parallel workers each) sharing a real store
process, as a prefill and a decode rank of one host do. Under tensor parallelism a
step's host-tier saves are committed only after the next step; a first leg must not
wait for that: its prompt's blocks are in the store when its one output leaves, so the
decode rank, asked at once, loads them all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from test_kv_tier_engine import ARENA_BYTES, BS, PROMPTS, STEP_LIMIT_S, make_core

from dpserve.frontend.roles import first_leg
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.kv_store import KVStore
from dpserve.protocol import EngineCoreRequest, FinishReason
from dpserve.sampling_params import SamplingParams

pytestmark = pytest.mark.procs

TOKENS = 6


@pytest.fixture
def store() -> Iterator[KVStore]:
    kv_store = KVStore(ARENA_BYTES, AddressAllocator())
    kv_store.start()
    try:
        yield kv_store
    finally:
        kv_store.close()


def step_until(core, done, what: str) -> list:
    outputs: list = []
    deadline = time.monotonic() + STEP_LIMIT_S
    while not done(outputs):
        assert time.monotonic() < deadline, what
        outputs += core.step()
    return outputs


def test_a_first_leg_under_tp_commits_its_prompt_before_its_output_leaves(tiny_llama, store):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prefill = make_core(tiny_llama, store, rank=0, tensor_parallel_size=2)
    decode = None
    try:
        # Other work goes on after the first leg finishes (no idle commit to rely on).
        prefill.add_request(EngineCoreRequest("busy", PROMPTS["c"], params))
        request = EngineCoreRequest("a", PROMPTS["a"], params)
        prefill.add_request(first_leg(request))
        outputs = step_until(prefill, lambda outs: any(
            o.request_id == "a" and o.finished for o in outs), "the first leg never finished")
        [first] = [o for o in outputs if o.request_id == "a" and o.new_token_ids]
        assert first.finish_reason is FinishReason.LENGTH and len(first.new_token_ids) == 1
        assert prefill.has_unfinished_requests()  # "busy" runs on: no step since
        assert prefill.request_state_sizes()["handoffs"] == 0
        # The decode rank, asked now, finds every full block of the prompt in the store.
        decode = make_core(tiny_llama, store, rank=1, tensor_parallel_size=2)
        decode.add_request(EngineCoreRequest("a", PROMPTS["a"], params,
                                             prior_output_token_ids=first.new_token_ids))
        rest = step_until(decode, lambda outs: any(o.finished for o in outs),
                          "the continuation never finished")
        assert sum(len(o.new_token_ids) for o in rest) == TOKENS - 1
        full_blocks = len(PROMPTS["a"]) // BS  # prompt + 1 token, the last one computed
        assert decode.get_stats().kv_tier_hits == full_blocks * BS
    finally:
        prefill.shutdown()
        if decode is not None:
            decode.shutdown()
