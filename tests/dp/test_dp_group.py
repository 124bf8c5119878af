"""The lockstep DP group's generations, decided by a real coordinator process
driven by scripted engines (real ZMQ sockets, the DP store, a torch Store over
ZMQ, hosted by the coordinator): who is a member, when a new generation is formed, who may
end a wave. Every receive has a timeout; coordinators are always closed."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from helpers import FakeFrontend, ScriptedEngines, assert_silent, recv_frames

from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.coordinator import REFORM_DELAY_S
from dpserve.launch.coordinator.dp_group import SETTLE_GROUP_S, DPGroup
from dpserve.protocol import (
    EngineReport,
    RankEvent,
    RankState,
    RankStatus,
    RegroupDP,
    RequestType,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.procs]  # a real DP coordinator process


def recv_regroup(engines: ScriptedEngines, engine: int = 0) -> RegroupDP:
    """The next message to `engine`, which must be REGROUP_DP."""
    tag, body = recv_frames(engines.subs[engine])
    assert tag == RequestType.REGROUP_DP.value
    return msgspec.msgpack.decode(body, type=RegroupDP)


def rank_event(front: FakeFrontend, rank: int, state: RankState, incarnation: int) -> None:
    front.send(RankEvent(rank, RankStatus(state, incarnation, "scripted")))  # type: ignore[arg-type]


class Heartbeats:
    """Scripted engines' heartbeat threads, in one: every 0.3 s a heartbeat for each
    rank in `beating` (rank -> incarnation); change the dict to stop or start one."""

    def __init__(self, address: str) -> None:
        self.beating: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        with zmq.Context() as context, context.socket(zmq.PUSH) as push:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(address)
            while not self._stop.wait(0.3):
                for rank, incarnation in list(self.beating.items()):
                    push.send(msgspec.msgpack.encode(EngineReport(
                        rank, heartbeat=True, incarnation=incarnation)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def lockstep3(make_coordinator, ctx) -> Iterator[tuple]:  # noqa: F811
    """A lockstep coordinator (store on a free port) with three ready scripted engines
    (not beating yet) and a fake front-end."""
    store = ("127.0.0.1", AddressAllocator(local_only=False).free_port())
    coord = make_coordinator(3, dp_store=store, heartbeat_timeout_s=2.0)
    engines = ScriptedEngines(ctx, coord, 3)
    engines.wait_ready()
    front = FakeFrontend(ctx, coord)
    front.recv()  # the state a new subscriber gets at once
    beats = Heartbeats(coord.engine_report_address)
    yield coord, engines, front, store, beats
    beats.close()


def test_first_generation_has_every_rank_and_the_store_lives_in_the_coordinator(lockstep3):
    from dpserve.engine.dp_store import ZmqStore, store_address

    _, engines, _, (host, port), beats = lockstep3
    assert_silent(engines.subs[0], 1.0)  # no group before the engines are heard
    beats.beating.update({0: 0, 1: 0, 2: 0})  # loaded, in their busy loops
    for engine in range(3):  # every engine hears the same generation
        assert recv_regroup(engines, engine) == RegroupDP(1, [0, 1, 2], 3)
    # The store the engines form their groups over answers (no engine hosts it).
    client = ZmqStore(store_address(host, port), None, datetime.timedelta(seconds=5))
    try:
        client.set("probe", b"1")
        assert client.get("probe") == b"1"
    finally:
        client.close()


def test_membership_follows_deaths_restarts_and_failures(lockstep3):
    _, engines, front, _, beats = lockstep3
    beats.beating.update({0: 0, 1: 0, 2: 0})
    for engine in range(3):
        assert recv_regroup(engines, engine) == RegroupDP(1, [0, 1, 2], 3)
    # Rank 0 dies (the old store host): a generation without it, at once.
    del beats.beating[0]
    rank_event(front, 0, RankState.RESTARTING, 0)
    assert recv_regroup(engines, 1) == RegroupDP(2, [1, 2], 3)
    # Rank 1 leads now: its wave_complete counts, rank 2's does not.
    engines.report(engine_index=2, wave_complete=0)
    engines.report(engine_index=1, request_counts=[1, 0], step=1)  # a marker after it
    update = front.wait_for(lambda u: u.counts is not None and u.counts[1] == [1, 0])
    assert update.wave == 0
    engines.report(engine_index=1, wave_complete=0)
    assert front.wait_for(lambda u: u.counts is None).wave == 1
    # A failed collective of the current generation: the same ranks again, after
    # a short wait for the launcher's news; news of an older generation is dropped.
    engines.report(engine_index=2, group_failed=1)
    assert_silent(engines.subs[1], REFORM_DELAY_S / 2)
    engines.report(engine_index=1, group_failed=2)
    engines.report(engine_index=2, group_failed=2)  # one failure, one new generation
    assert recv_regroup(engines, 1) == RegroupDP(3, [1, 2], 3)
    assert_silent(engines.subs[1], REFORM_DELAY_S * 1.5)
    # Rank 0's new process beats: serving again, so a generation with it.
    beats.beating[0] = 1
    assert recv_regroup(engines, 1) == RegroupDP(4, [0, 1, 2], 3)
    # It stops beating (frozen): unhealthy, left out; the old process's news is
    # dropped. Isolated ranks (dead for good) are left out as well.
    del beats.beating[0]
    assert recv_regroup(engines, 1) == RegroupDP(5, [1, 2], 3)
    engines.report(engine_index=0, heartbeat=True, incarnation=0)
    del beats.beating[2]
    rank_event(front, 2, RankState.DEAD, 0)
    assert recv_regroup(engines, 1) == RegroupDP(6, [1], 3)
    assert_silent(engines.subs[1], 0.5)


def test_news_of_a_death_after_a_failed_collective_forms_the_group_after_the_settle():
    """Pure logic (times passed in): a survivor's failed collective usually comes
    before the launcher's news of the death. Once the news is in, the generation of
    the survivors is formed after SETTLE_GROUP_S, not the longer wait a failure with
    no news gets (else a fast restart returns first and the survivors idle until it)."""
    group = DPGroup()
    serving = [RankStatus(RankState.SERVING)] * 2
    assert group.next(serving, [True, True], now=0.0) is None  # settling
    assert group.next(serving, [True, True], now=SETTLE_GROUP_S) == RegroupDP(1, [0, 1], 2)
    group.on_failed(1, now=10.0)  # rank 0's all-reduce failed: rank 1 was killed
    assert group.next(serving, [True, True], now=10.0) is None  # no news yet: wait
    restarting = [RankStatus(RankState.SERVING), RankStatus(RankState.RESTARTING, 0)]
    assert group.next(restarting, [True, False], now=10.1) is None
    assert group.next(restarting, [True, False], now=10.1 + SETTLE_GROUP_S) == \
        RegroupDP(2, [0], 2)
    assert 10.1 + SETTLE_GROUP_S < 10.0 + REFORM_DELAY_S  # (the premise: sooner)
    assert group.due is None


def test_no_regroup_messages_without_lockstep(make_coordinator, ctx):  # noqa: F811
    coord = make_coordinator(2)
    engines = ScriptedEngines(ctx, coord, 2)
    engines.wait_ready()
    front = FakeFrontend(ctx, coord)
    rank_event(front, 1, RankState.DEAD, 0)
    engines.report(engine_index=0, heartbeat=True)
    engines.report(engine_index=0, group_failed=1)
    assert_silent(engines.subs[0], REFORM_DELAY_S * 1.5)
