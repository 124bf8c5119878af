"""Prefill/decode disaggregation, its IO-free parts: `--data-parallel-roles` checks,
roles and placement by role (`RankTable`), and a handoff's phases in the
`InFlightBook` (first leg, continuation, abort and evacuation in between).

Pure logic: no process, no socket, no event loop.
"""

from __future__ import annotations

import pytest

from dpserve.config import EngineArgs
from dpserve.errors import ConfigError
from dpserve.frontend.migration import PENDING, PREFILL, SENT, InFlightBook
from dpserve.frontend.rank_table import RankTable
from dpserve.frontend.roles import Roles, can_hand_off, first_leg
from dpserve.frontend.routing import Router
from dpserve.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
    RankState,
    RankStatus,
)
from dpserve.sampling_params import SamplingParams


def table(n: int = 3, prefill: int = 1) -> RankTable:
    t = RankTable(range(n), Router("least-loaded"))
    t.roles = Roles(prefill)
    for rank in range(n):
        t.register(rank)
    return t


def request(rid: str = "r", **params: object) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(40)),
                             sampling_params=SamplingParams(**{"max_tokens": 8, **params}))


# ---- the option -------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (dict(data_parallel_roles="prefill:1,decode:2"),
     "data_parallel_roles must add up to data_parallel_size (2): 1 + 2 = 3"),
    (dict(data_parallel_roles="prefill:2,decode:0"),
     "data_parallel_roles needs at least one prefill and one decode rank"),
    (dict(data_parallel_roles="prefill=1"), "data_parallel_roles must be prefill:P,decode:D"),
    (dict(data_parallel_roles="prefill:1,decode:1", kv_offload_memory=None),
     "data_parallel_roles needs --kv-offload-memory"),
    (dict(data_parallel_roles="prefill:1,decode:1", data_parallel_rank=0),
     "data_parallel_roles cannot be combined with --data-parallel-rank"),
])
def test_bad_roles_are_one_line_config_errors(options, message):
    args = EngineArgs(**{"data_parallel_size": 2, "kv_offload_memory": "16MiB", **options})
    with pytest.raises(ConfigError) as e:
        args.check_options()
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_roles_add_up_and_resolve():
    args = EngineArgs(data_parallel_size=3, data_parallel_roles="decode:2,prefill:1",
                      kv_offload_memory="16MiB")
    args.check_options()
    from dpserve.placement import data_parallel_roles

    assert data_parallel_roles(args) == (1, 2)


# ---- roles and placement ------------------------------------------------------------------

def test_roles_follow_the_rank_count():
    roles = Roles(2)
    assert [roles.role_of(r) for r in range(4)] == ["prefill", "prefill", "decode", "decode"]


def test_which_requests_are_handed_off():
    assert can_hand_off(request(), 256)
    assert not can_hand_off(request(max_tokens=1), 256)  # the prefill rank is done
    assert not can_hand_off(request(prompt_logprobs=1), 256)
    assert not can_hand_off(request(), 41)  # no room for a second token
    pinned = request()
    pinned.data_parallel_rank = 1
    assert not can_hand_off(pinned, 256)
    pooled = request()
    pooled.pooling = PoolingParams()
    assert not can_hand_off(pooled, 256)
    leg = first_leg(request(min_tokens=5))
    assert (leg.sampling_params.max_tokens, leg.sampling_params.min_tokens) == (1, 1)
    assert leg.do_remote_decode


def test_new_requests_go_to_prefill_ranks_and_continuations_to_decode_ranks():
    t = table(4, prefill=2)

    def placed(req: EngineCoreRequest) -> int:
        engine = t.choose(req)
        t.assign(engine)
        return engine.rank

    assert {placed(request(f"p{i}")) for i in range(8)} == {0, 1}
    cont = request()
    cont.prior_output_token_ids = [5]
    assert {placed(cont) for _ in range(8)} == {2, 3}
    assert t.hands_off(request(), t.engines[0], 256)
    assert not t.hands_off(request(), t.engines[2], 256)  # a decode rank runs it whole


def test_no_decode_rank_serving_means_colocated_and_no_prefill_rank_means_decode_ranks_prefill():
    t = table(2, prefill=1)
    t.apply_status(1, RankStatus(RankState.DEAD, 0, "exit code -9"))
    assert not t.hands_off(request(), t.engines[0], 256)
    cont = request()
    cont.prior_output_token_ids = [5]
    assert t.choose(cont).rank == 0
    t = table(2, prefill=1)
    t.apply_status(0, RankStatus(RankState.DEAD, 0, "exit code -9"))
    assert t.choose(request()).rank == 1


# ---- a handoff's phases -------------------------------------------------------------------

def first_leg_done(book: InFlightBook, t: RankTable, rid: str = "r",
                   reason: FinishReason = FinishReason.LENGTH) -> EngineCoreOutput | None:
    req = request(rid)
    sent = book.add(req, 0, first_leg(req))
    assert sent.sampling_params.max_tokens == 1 and book.flights[rid].handoff == PREFILL
    t.assign(t.engines[0])
    passed, finished = book.accept(0, EngineCoreOutput(rid, [7], finish_reason=reason,
                                                       num_cached_tokens=16))
    assert not finished or reason is not FinishReason.LENGTH
    return passed


def test_a_first_leg_ends_unfinished_and_its_continuation_moves_like_a_migration():
    book, t = InFlightBook(), table(2)
    passed = first_leg_done(book, t)
    assert passed is not None and not passed.finished and passed.new_token_ids == [7]
    assert book.take_pending() == ["r"] and book.flights["r"].handoff == PENDING
    assert book.handoffs.in_flight == 1 and book.handoffs_at(0) == 1
    move = book.commit_handoff("r", t.engines[1], t, wave=0)
    assert move is not None and (move.source, move.target) == (0, 1)
    assert move.request.prior_output_token_ids == [7]
    assert move.request.sampling_params.max_tokens == 8 and not move.request.do_remote_decode
    assert book.flights["r"].handoff == SENT and t.engines[1].num_requests == 1
    assert t.engines[0].num_requests == 0 and book.flights["r"].moves == 0
    # The decode rank's first output ends the handoff; its cache hits stay hidden.
    passed, finished = book.accept(1, EngineCoreOutput("r", [8], num_cached_tokens=32))
    assert passed is not None and passed.num_cached_tokens == 0 and not finished
    assert book.flights["r"].handoff is None and len(book.latencies) == 1
    assert book.handoffs.handoffs == 1 and book.handoffs.in_flight == 0


def test_a_first_token_that_stops_the_request_ends_it_there():
    book, t = InFlightBook(), table(2)
    passed = first_leg_done(book, t, reason=FinishReason.STOP)
    assert passed is not None and passed.finished
    assert book.take_pending() == []


def test_an_abort_mid_handoff_ends_it_in_the_front_end():
    book, t = InFlightBook(), table(2)
    first_leg_done(book, t)
    by_rank, cancelled = book.abort_plan(["r"], t)
    assert by_rank == {} and cancelled == [("r", 0)]
    assert "r" not in book.flights and t.engines[0].num_requests == 0
    assert book.continuation("r", 0) is None  # the pending task finds nothing to send


def test_an_evacuation_mid_handoff_wins_and_the_continuation_is_not_sent():
    book, t = InFlightBook(), table(3, prefill=1)
    first_leg_done(book, t)
    change = t.apply_status(0, RankStatus(RankState.DEAD, 0, "exit code -9"))
    assert change is not None
    plan = book.plan_evacuation(0, change.why, False, t, wave=0)
    assert [(m.target, m.num_tokens) for m in plan.moves] in ([(1, 1)], [(2, 1)])
    assert book.flights["r"].handoff is None
    assert book.commit_handoff("r", t.engines[1], t, wave=0) is None


def test_a_first_leg_lost_with_its_rank_is_re_sent_whole():
    book, t = InFlightBook(), table(2)
    req = request()
    book.add(req, 0, first_leg(req))
    t.assign(t.engines[0])
    change = t.apply_status(0, RankStatus(RankState.DEAD, 0, "exit code -9"))
    plan = book.plan_evacuation(0, change.why, False, t, wave=0)
    [move] = plan.moves
    assert move.target == 1 and move.request.sampling_params.max_tokens == 8
    assert not move.request.do_remote_decode and book.flights["r"].handoff is None


def test_roles_follow_elastic_scaling():
    t = table(2, prefill=1)
    t.resize(3)  # the new rank decodes
    t.apply_status(2, RankStatus(RankState.SERVING, 0))
    t.register(2)
    assert [t.view(t.engines[r]).role for r in t.ranks] == ["prefill", "decode", "decode"]
    t.resize(1)  # only the prefill rank is left: it serves colocated
    assert not t.hands_off(request(), t.engines[0], 256)
    assert t.choose(request()).rank == 0
