"""The engine client's IO-free parts: the rank table and the migration planner.

Pure logic, no process, no socket, no event loop: rank states and their
freshness, cordon and placement, resize, and the evacuation plan (which
request goes where with which prior tokens, which fail and why).
"""

from __future__ import annotations

import pytest

from dpserve.frontend.errors import EngineUnavailableError
from dpserve.frontend.migration import InFlightBook
from dpserve.frontend.rank_table import RankTable
from dpserve.frontend.routing import Router
from dpserve.protocol import (
    CoordinatorUpdate,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    RankState,
    RankStatus,
)
from dpserve.sampling_params import SamplingParams


def table(n: int = 3, **kw: bool) -> RankTable:
    t = RankTable(range(n), Router("least-loaded"), **kw)
    for rank in range(n):
        t.register(rank)
    return t


def request(rid: str, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                             sampling_params=SamplingParams(max_tokens=8),
                             data_parallel_rank=rank)


def dead(incarnation: int = 0, reason: str = "exit code -9") -> RankStatus:
    return RankStatus(RankState.DEAD, incarnation, reason)


# ---- rank states ------------------------------------------------------------------------

def test_a_rank_that_stops_serving_is_evacuated_with_an_abort_unless_dead():
    t = table()
    change = t.apply_status(1, RankStatus(RankState.UNHEALTHY, 0, "no heartbeat"))
    assert change is not None and change.evacuate and change.abort_first
    assert change.why == "rank 1 unhealthy (no heartbeat)"
    change = t.apply_status(2, dead())
    assert change is not None and change.evacuate and not change.abort_first
    assert [e.rank for e in t.placeable()] == [0]


def test_old_news_and_serving_news_of_a_dead_incarnation_are_dropped():
    t = table()
    t.apply_status(1, RankStatus(RankState.SERVING, 2))
    assert t.apply_status(1, dead(1)) is None  # an older incarnation
    assert t.mark_dead(1, "ENGINE_CORE_DEAD") is not None
    assert t.apply_status(1, RankStatus(RankState.SERVING, 2)) is None  # we saw it die
    assert t.engines[1].status.state is RankState.DEAD
    change = t.apply_status(1, RankStatus(RankState.SERVING, 3))  # its successor
    assert change is not None and not change.evacuate and t.engines[1].serving
    assert t.mark_dead(1, "x") is not None and t.mark_dead(1, "again") is None


def test_draining_moves_nothing_and_a_replaced_process_is_evacuated():
    t = table()
    change = t.apply_status(0, RankStatus(RankState.DRAINING, 0))
    assert change is not None and not change.evacuate and not t.engines[0].placeable
    change = t.apply_status(1, RankStatus(RankState.SERVING, 1))  # restarted unseen
    assert change is not None and change.evacuate and change.abort_first


def test_fail_stop_kills_instead_of_moving_but_not_for_unhealthy():
    t = table(fail_stop=True)
    assert t.apply_status(0, RankStatus(RankState.UNHEALTHY, 0, "slow")).fail_stop is None
    change = t.apply_status(1, dead(0, "oom"))
    assert change.fail_stop == "rank 1 dead: oom" and not change.evacuate


def test_without_a_coordinator_a_dead_ranks_new_process_serves_on_registering():
    t = table()
    t.mark_dead(2, "exit")
    change = t.register(2)
    assert change is not None and change.status == RankStatus(RankState.SERVING, 1)
    tb = table(balanced=True)
    tb.mark_dead(2, "exit")
    assert tb.register(2) is None and not tb.engines[2].serving  # the coordinator says


# ---- placement ---------------------------------------------------------------------------

def test_pinned_requests_and_cordon():
    t = table()
    assert t.choose(request("a", 2)).rank == 2
    with pytest.raises(ValueError, match="out of range"):
        t.choose(request("b", 7))
    t.engines[2].info = EngineInfo(cordoned=True)
    with pytest.raises(EngineUnavailableError, match="cordoned"):
        t.choose(request("c", 2))
    t.apply_status(1, dead())
    with pytest.raises(EngineUnavailableError, match="data_parallel_rank 1 is dead"):
        t.choose(request("d", 1))
    assert t.choose(request("e")).rank == 0  # the only placeable rank
    t.apply_status(0, dead())
    with pytest.raises(EngineUnavailableError, match="no engine is serving"):
        t.choose(request("f"))


def test_least_loaded_counts_what_this_client_sent_until_the_next_publish():
    t = table(2, balanced=True)
    t.apply_update(CoordinatorUpdate(counts=[[0, 0], [0, 0]], wave=0, running=True))
    t.assign(t.choose(request("a")), 3)
    assert t.engines[0].sent_since_publish == 1 and t.engines[0].tokens_since_publish == 3
    assert t.choose(request("b")).rank == 1
    t.apply_update(CoordinatorUpdate(counts=[[5, 1], [0, 0]], wave=1, running=True,
                                     waiting_tokens=[40, 0]))
    assert t.engines[0].sent_since_publish == 0 and t.engines[0].waiting_tokens == 40


def test_resize_adds_starting_ranks_and_evacuates_removed_ones():
    t = table(2, balanced=True, elastic=True)
    t.register(2)  # registered before the coordinator named it
    changes = t.apply_update(CoordinatorUpdate(counts=None, wave=0, running=True, ranks=[
        RankStatus(), RankStatus(), RankStatus(RankState.STARTING)]))
    assert changes == [] and t.ranks == [0, 1, 2] and t.engines[2].registered
    changes = t.apply_update(CoordinatorUpdate(counts=None, wave=0, running=True,
                                               ranks=[RankStatus()]))
    assert t.ranks == [0]
    assert [(c.rank, c.evacuate, c.abort_first) for c in changes] == [
        (1, True, True), (2, True, True)]


# ---- the migration plan -----------------------------------------------------------------------

def book_with(t: RankTable, *flights: tuple[str, int | None, list[int]]) -> InFlightBook:
    book = InFlightBook(max_migrations=2)
    for rid, pin, tokens in flights:
        req = request(rid, pin)
        engine = t.engines[pin] if pin is not None else t.engines[1]
        book.add(req, engine.rank)
        t.assign(engine, 3)
        kept, finished = book.accept(engine.rank, EngineCoreOutput(rid, tokens))
        assert kept is not None and not finished
    return book


def test_the_plan_moves_with_prior_tokens_and_fails_pinned_requests():
    t = table()
    book = book_with(t, ("mid", None, [7, 8]), ("new", None, []), ("pinned", 1, [5]))
    change = t.apply_status(1, RankStatus(RankState.UNHEALTHY, 0, "stalled"))
    plan = book.plan_evacuation(1, change.why, change.abort_first, t, wave=4)
    assert plan.abort == ["mid", "new", "pinned"]
    moved = {m.request_id: m for m in plan.moves}
    assert set(moved) == {"mid", "new"} and {m.target for m in plan.moves} <= {0, 2}
    assert moved["mid"].request.prior_output_token_ids == [7, 8]
    assert moved["new"].request.prior_output_token_ids is None
    assert moved["mid"].request.current_wave == 4
    [failure] = plan.failures
    assert failure.request_id == "pinned" and "its pinned rank 1 unhealthy" in failure.error
    assert (book.num_migrations, book.num_retries, book.recomputed_tokens) == (1, 1, 8)
    assert t.engines[1].num_requests == 0 and "pinned" not in book.flights
    # Outputs the old rank still sends are dropped; the new rank's are kept.
    assert book.accept(1, EngineCoreOutput("mid", [9])) == (None, False)
    out = EngineCoreOutput("mid", [9])
    assert book.accept(moved["mid"].target, out) == (out, False)


def test_a_dead_rank_gets_no_abort_and_moves_are_bounded():
    t = table(2)
    book = book_with(t, ("r", None, [1]))
    book.flights["r"].moves = 2  # --max-request-migrations 2 used up
    plan = book.plan_evacuation(1, "rank 1 dead", False, t, wave=0)
    assert plan.abort == [] and plan.moves == []
    assert "moved 2 times already (--max-request-migrations)" in plan.failures[0].error


def test_with_no_serving_rank_left_every_request_fails():
    t = table(2)
    book = book_with(t, ("a", None, []), ("b", None, [3]))
    t.apply_status(0, dead())
    plan = book.plan_evacuation(1, "rank 1 dead", False, t, wave=0)
    assert [f.request_id for f in plan.failures] == ["a", "b"]
    assert all("no engine is serving" in f.error for f in plan.failures)
    assert book.flights == {}


# ---- the coordinator's news ---------------------------------------------------------------

def test_coordinator_news_keeps_the_latest_word():
    from dpserve.frontend.coordinator_link import CoordinatorNews
    from dpserve.protocol import ControlState

    news = CoordinatorNews()
    news.note(CoordinatorUpdate(counts=None, wave=3, running=True,
                                ranks=[RankStatus(), dead()], autoscale_decisions=[1, 0],
                                control=ControlState(seq=2, paused="keep"),
                                control_done=[2, 1], engines=[EngineInfo(), EngineInfo()]))
    assert (news.wave, news.running, news.autoscale_decisions) == (3, True, [1, 0])
    assert news.all_ranks[1].state is RankState.DEAD and news.info_updates == 1
    assert news.controls.state.paused == "keep" and news.controls.done == [2, 1]
    news.note(CoordinatorUpdate(counts=[[0, 0]], wave=4, running=False))  # wave news only
    assert (news.wave, news.running, news.autoscale_decisions) == (4, False, [1, 0])
    assert news.controls.state.seq == 2 and news.info_updates == 1


def test_each_ranks_store_address_comes_from_the_coordinators_figures():
    """A rank's heartbeat names its host's KV store (`EngineInfo.kv_store_address`):
    what a front-end asks a pull of; None for a rank that named none and for no rank."""
    from dpserve.protocol import EngineReport
    from dpserve.rank_info import RankInfoTable

    figures = RankInfoTable(2)
    address = "tcp://10.0.0.1:20001"
    figures.on_heartbeat(EngineReport(0, heartbeat=True, kv_store_address=address), 0.0)
    figures.on_heartbeat(EngineReport(1, heartbeat=True), 0.0)
    t = table(2)
    assert t.store_address_of(0) is None  # not heard from yet
    t.apply_update(CoordinatorUpdate(None, 0, True, engines=figures.take()))
    assert t.store_address_of(0) == address
    assert t.store_address_of(1) is None and t.store_address_of(7) is None
