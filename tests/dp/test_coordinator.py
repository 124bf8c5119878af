"""The DP coordinator process, driven by scripted engines and fake front-ends.

A real coordinator process and real ZMQ sockets; the peers are scripted in
this process. Every receive has a timeout; coordinators are always closed.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import msgspec
import psutil
import pytest
import zmq
from helpers import FakeFrontend, ScriptedEngines, assert_silent, recv_frames

from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.coordinator.tables import LoadTable
from dpserve.protocol import (
    COORDINATOR_READY,
    CoordinatorUpdate,
    EngineInfo,
    RankControl,
    RankEvent,
    RankState,
    RankStatus,
    RestartRank,
    ScaleEngines,
    StartDPWave,
    WakeEngines,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.procs]

@pytest.fixture
def running2(make_coordinator, ctx):
    """A coordinator with two ready scripted engines and one fake front-end."""
    coord = make_coordinator(2)
    engines = ScriptedEngines(ctx, coord, 2)
    engines.wait_ready()
    frontend = FakeFrontend(ctx, coord)
    first = frontend.recv()  # a new subscriber gets the state at once
    assert first == CoordinatorUpdate([[0, 0], [0, 0]], wave=0, running=False,
                                      ranks=[RankStatus(), RankStatus()],
                                      engines=[EngineInfo(), EngineInfo()])
    return coord, engines, frontend


def test_ready_only_after_all_engines_subscribed(make_coordinator, ctx):
    coord = make_coordinator(2)
    first, second = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    ScriptedEngines.subscribe(first, coord)
    assert_silent(first, 0.5)
    ScriptedEngines.subscribe(second, coord)
    assert recv_frames(first) == [COORDINATOR_READY]
    assert recv_frames(second) == [COORDINATOR_READY]
    assert coord.proc is not None and coord.proc.is_alive()


def test_tcp_addresses_and_exit_codes(make_coordinator, ctx):
    coord = make_coordinator(1, allocator=AddressAllocator(local_only=False))
    assert coord.front_publish_address.startswith("tcp://127.0.0.1:")
    engines = ScriptedEngines(ctx, coord, 1)
    engines.wait_ready()
    frontend = FakeFrontend(ctx, coord)
    frontend.send(WakeEngines(wave=0))
    assert engines.recv_start_wave(0) == StartDPWave(0)
    coord.close()  # SIGTERM: a clean exit
    assert coord.proc is not None and coord.proc.exitcode == 0


def test_startup_times_out_without_engines(make_coordinator):
    coord = make_coordinator(2, startup_timeout_s=2.0)
    assert coord.proc is not None
    coord.proc.join(timeout=30)
    assert coord.proc.exitcode == 1


def test_load_table_publishes_last_complete_step_first():
    table = LoadTable(2)
    table.apply(0, wave=0, step=1, counts=[1, 0])
    table.apply(1, wave=0, step=1, counts=[2, 0])
    table.apply(0, wave=0, step=2, counts=[5, 5])  # step 2 begins: step 1 is complete
    assert table.take() == [[1, 0], [2, 0]]
    assert table.take() == [[5, 5], [2, 0]]
    assert table.changed_at is None
    table.resize(3)
    assert table.counts == [[5, 5], [2, 0], [0, 0]]


def test_wave_complete_pauses_and_moves_to_next_wave(running2):
    _, engines, frontend = running2
    frontend.send(WakeEngines(wave=0, engine_index=1))
    assert engines.recv_start_wave(0) == StartDPWave(0, exclude_engine_index=1)
    assert frontend.wait_for(lambda u: u.counts is None).running
    engines.report(engine_index=0, wave_complete=0)
    update = frontend.wait_for(lambda u: u.counts is None)
    assert (update.wave, update.running) == (1, False)
    # Late or repeated news of the finished wave does not move the wave again.
    engines.report(engine_index=0, wave_complete=0)
    engines.report(engine_index=1, request_counts=[1, 0], step=1)  # a marker after it
    update = frontend.wait_for(lambda u: u.counts is not None and u.counts[1] == [1, 0])
    assert (update.wave, update.running) == (1, False)


def test_only_rank_0_completes_a_wave(running2):
    _, engines, frontend = running2
    engines.report(engine_index=1, wave_complete=0)
    engines.report(engine_index=1, request_counts=[1, 0], step=1)  # a marker after it
    update = frontend.wait_for(lambda u: u.counts is not None and u.counts[1] == [1, 0])
    assert (update.wave, update.running) == (0, False)


def test_request_for_finished_wave_restarts_engines(running2):
    _, engines, frontend = running2
    engines.report(engine_index=0, wave_complete=0)
    assert frontend.wait_for(lambda u: u.counts is None).wave == 1
    # Engine 1 got a request stamped wave 0 while paused in wave 1.
    engines.report(engine_index=1, start_wave=1)
    for engine in (0, 1):  # a broadcast: engine 1 sees it too and skips it
        assert engines.recv_start_wave(engine) == StartDPWave(1, exclude_engine_index=1)
    update = frontend.wait_for(lambda u: u.counts is None)
    assert (update.wave, update.running) == (1, True)
    # Already running: another engine's start_wave for this wave is a no-op. A marker
    # after it on the same socket: wave 1 ends, and engine 1's request for wave 2 wakes
    # every engine; the next thing engine 0 hears is that, not a start of wave 1.
    engines.report(engine_index=0, start_wave=1)
    engines.report(engine_index=0, wave_complete=1)
    engines.report(engine_index=1, start_wave=2)
    assert engines.recv_start_wave(0) == StartDPWave(2, exclude_engine_index=1)


def test_frontend_wakes_paused_engines(running2):
    _, engines, frontend = running2
    engines.report(engine_index=0, wave_complete=0)
    assert frontend.wait_for(lambda u: u.counts is None).wave == 1
    # A request stamped with the finished wave 0: every engine must be told.
    frontend.send(WakeEngines(wave=0, engine_index=0))
    assert engines.recv_start_wave(0) == StartDPWave(1, exclude_engine_index=None)
    update = frontend.wait_for(lambda u: u.counts is None)
    assert (update.wave, update.running) == (1, True)
    # Already running: a second wake-up sends nothing. A cordon after it on the same
    # socket is published once the coordinator has handled both; then wave 1 ends and
    # engine 1's request for wave 2 wakes every engine: the next thing engine 0 hears
    # is that, not a start of wave 1.
    frontend.send(WakeEngines(wave=1, engine_index=1))
    frontend.sock.send(msgspec.msgpack.encode(RankControl(1, "cordon")))
    frontend.wait_for(lambda u: u.engines is not None and u.engines[1].cordoned)
    engines.report(engine_index=0, wave_complete=1)
    engines.report(engine_index=1, start_wave=2)
    assert engines.recv_start_wave(0) == StartDPWave(2, exclude_engine_index=1)


def test_stale_counts_do_not_overwrite_newer(running2):
    _, engines, frontend = running2
    engines.report(engine_index=0, request_counts=[3, 1], wave=0, step=5)
    engines.report(engine_index=0, request_counts=[9, 9], wave=0, step=4)  # stale
    engines.report(engine_index=1, request_counts=[2, 2], wave=0, step=5)  # the marker
    update = frontend.wait_for(lambda u: u.counts is not None and u.counts[1] == [2, 2])
    assert update.counts == [[3, 1], [2, 2]]
    # A newer wave wins over a higher step of an older wave.
    engines.report(engine_index=0, request_counts=[4, 0], wave=1, step=0)
    engines.report(engine_index=0, request_counts=[8, 8], wave=0, step=99)  # stale
    engines.report(engine_index=1, request_counts=[0, 1], wave=1, step=0)  # the marker
    update = frontend.wait_for(lambda u: u.counts is not None and u.counts[1] == [0, 1])
    assert update.counts == [[4, 0], [0, 1]]


def test_scale_changes_published_counts(running2):
    _, engines, frontend = running2
    frontend.send(ScaleEngines(4))
    # A publish of the two old engines' counts may already be on its way.
    update = frontend.wait_for(lambda u: u.counts is not None and len(u.counts) != 2)
    assert update.counts == [[0, 0]] * 4
    engines.report(engine_index=3, request_counts=[1, 1], step=1)
    assert frontend.wait_for(lambda u: bool(u.counts) and u.counts[3] == [1, 1])
    frontend.send(ScaleEngines(1))
    update = frontend.wait_for(lambda u: u.counts is not None and len(u.counts) == 1)
    assert update.counts == [[0, 0]]


def test_counts_published_no_faster_than_interval(running2):
    _, engines, frontend = running2
    interval = 0.1  # the coordinator's stats_interval_s
    times: list[float] = []  # when each count publish arrived
    step = 0
    start = time.monotonic()
    while len(times) < 5:  # counts change every ~10 ms until 5 publishes came
        assert time.monotonic() - start < 60, f"only {len(times)} count publishes in 60 s"
        step += 1
        engines.report(engine_index=step % 2, request_counts=[step, 1], step=step)
        time.sleep(0.01)
        while frontend.sock.poll(0):
            if frontend.decoder.decode(frontend.sock.recv()).counts is not None:
                times.append(time.monotonic())
    # No faster than the interval: over the time they took (which a loaded machine
    # only stretches), at most one publish per interval, plus the first at once. A
    # publish per report would bring all 5 in ~50 ms.
    assert len(times) <= (times[-1] - start) / interval + 2, (step, times)
    # The last change is published (a quiet spell is not left unannounced).
    update = frontend.wait_for(lambda u: u.counts is not None
                               and max(u.counts[0][0], u.counts[1][0]) == step)
    assert sorted([update.counts[0][0], update.counts[1][0]])[1] == step


def test_coordinator_exits_when_parent_dies():
    script = textwrap.dedent("""
        import sys, time
        from dpserve.launch.coordinator import DPCoordinator
        coord = DPCoordinator(1)
        coord.start()
        print(coord.proc.pid, flush=True)
        time.sleep(60)
    """)
    tmp = tempfile.mkdtemp(prefix="dps-")  # the killed parent cannot clean its ipc dir
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))  # the repository
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              cwd=root, text=True, env={**os.environ, "TMPDIR": tmp})
    child_pid = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the parent did not report its coordinator in time"
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), f"parent printed {line!r}"
        child_pid = int(line)
        child = psutil.Process(child_pid)
        assert child.is_running()
        parent.kill()
        parent.wait(timeout=5)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "coordinator outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=5)
        if child_pid is not None and psutil.pid_exists(child_pid):
            try:
                psutil.Process(child_pid).kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- rank health -----------------------------------------------------------------


def _beat(engines: ScriptedEngines, rank: int, step: int, has_work: bool = False,
          incarnation: int = 0) -> None:
    engines.report(engine_index=rank, heartbeat=True, step=step, has_work=has_work,
                   incarnation=incarnation)


def _state(update: CoordinatorUpdate, rank: int) -> RankState | None:
    return update.ranks[rank].state if update.ranks else None


def test_silent_rank_turns_unhealthy_and_recovers(make_coordinator, ctx):
    coord = make_coordinator(2, heartbeat_timeout_s=2.0, stall_timeout_s=60)
    engines = ScriptedEngines(ctx, coord, 2)
    engines.wait_ready()
    frontend = FakeFrontend(ctx, coord)
    frontend.recv()
    _beat(engines, 0, step=1)
    _beat(engines, 1, step=1)
    # Rank 1 keeps beating, rank 0 goes silent: only rank 0 turns unhealthy.
    deadline = time.monotonic() + 30
    update = None
    while update is None or _state(update, 0) is not RankState.UNHEALTHY:
        assert time.monotonic() < deadline, update
        _beat(engines, 1, step=2)
        if frontend.sock.poll(100):
            update = frontend.decoder.decode(frontend.sock.recv())
    assert _state(update, 1) is RankState.SERVING
    assert "no heartbeat" in update.ranks[0].reason
    _beat(engines, 0, step=2)  # it beats again: serving, published at once
    update = frontend.wait_for(lambda u: _state(u, 0) is RankState.SERVING)
    assert update.ranks[0] == RankStatus(RankState.SERVING, 0)


def test_rank_with_work_but_no_step_is_stalled(make_coordinator, ctx):
    coord = make_coordinator(1, heartbeat_timeout_s=60, stall_timeout_s=2.0)
    engines = ScriptedEngines(ctx, coord, 1)
    engines.wait_ready()
    frontend = FakeFrontend(ctx, coord)
    frontend.recv()
    deadline = time.monotonic() + 30
    update = None
    while update is None or _state(update, 0) is not RankState.UNHEALTHY:
        assert time.monotonic() < deadline, update
        _beat(engines, 0, step=7, has_work=True)  # beating, but the step stands still
        if frontend.sock.poll(100):
            update = frontend.decoder.decode(frontend.sock.recv())
    assert "finished no step" in update.ranks[0].reason
    _beat(engines, 0, step=8, has_work=True)
    frontend.wait_for(lambda u: _state(u, 0) is RankState.SERVING)


def test_rank_events_and_incarnations(running2):
    _, engines, frontend = running2
    front = frontend.sock
    front.send(msgspec.msgpack.encode(RankEvent(1, RankStatus(RankState.DEAD, 0, "killed"))))
    update = frontend.wait_for(lambda u: _state(u, 1) is RankState.DEAD)
    assert update.ranks[1].reason == "killed"
    _beat(engines, 1, step=5, incarnation=0)  # the dead process cannot come back
    front.send(msgspec.msgpack.encode(RankEvent(0, RankStatus(RankState.SERVING, 0))))
    engines.report(engine_index=0, request_counts=[3, 3], step=1)  # a marker after it
    update = frontend.wait_for(lambda u: u.counts is not None and u.counts[0] == [3, 3])
    assert _state(update, 1) is RankState.DEAD
    _beat(engines, 1, step=0, incarnation=1)  # its successor is serving
    update = frontend.wait_for(lambda u: _state(u, 1) is RankState.SERVING)
    assert update.ranks[1].incarnation == 1
    front.send(msgspec.msgpack.encode(RankEvent(1, RankStatus(RankState.DEAD, 0, "late"))))
    engines.report(engine_index=0, request_counts=[4, 4], step=2)  # a marker after it
    update = frontend.wait_for(lambda u: u.counts is not None and u.counts[0] == [4, 4])
    assert update.ranks[1] == RankStatus(RankState.SERVING, 1)  # stale news dropped


def test_late_subscriber_gets_ready(running2, ctx):
    coord, _, _ = running2
    late = ctx.socket(zmq.SUB)  # a restarted engine subscribes after start-up
    ScriptedEngines.subscribe(late, coord)
    assert recv_frames(late) == [COORDINATOR_READY]


def test_draining_rank_is_published_and_stays_draining(running2):
    _, engines, frontend = running2
    _beat(engines, 1, step=3)
    engines.report(engine_index=1, heartbeat=True, step=4, has_work=True, draining=True)
    update = frontend.wait_for(lambda u: _state(u, 1) is RankState.DRAINING)
    assert "SIGTERM" in update.ranks[1].reason and _state(update, 0) is RankState.SERVING
    _beat(engines, 1, step=5)  # a draining process never serves again
    engines.report(engine_index=0, request_counts=[7, 7], step=1)  # a marker after it
    update = frontend.wait_for(lambda u: u.counts is not None and u.counts[0] == [7, 7])
    assert _state(update, 1) is RankState.DRAINING


def test_operators_cordon_restart_and_rank_figures(running2):
    """RankControl cordon / uncordon: published at once; restart: published once for the
    launchers, with the rank's incarnation; heartbeats' figures reach /engines' info."""
    _, engines, frontend = running2
    frontend.sock.send(msgspec.msgpack.encode(RankControl(1, "cordon")))
    update = frontend.wait_for(lambda u: u.engines is not None and u.engines[1].cordoned)
    assert not update.engines[0].cordoned and update.restart is None
    frontend.sock.send(msgspec.msgpack.encode(RankControl(1, "uncordon")))
    frontend.wait_for(lambda u: u.engines is not None and not u.engines[1].cordoned)
    frontend.sock.send(msgspec.msgpack.encode(RankControl(0, "restart")))
    update = frontend.wait_for(lambda u: u.restart is not None)
    assert update.restart == RestartRank(0, 0)
    # Heartbeats: 100 tokens over beats sent 2 s apart (the pace of the input, no event
    # to wait on) -> a rate > 0 that is no more than 100 tokens / 1 s (it would take the
    # coordinator hearing them under 1 s apart), KV usage, pid and host as sent.
    # TokenRate's arithmetic itself: test_rank_info.
    beat = dict(engine_index=1, heartbeat=True, kv_cache_usage=0.25, pid=4242, host="h1")
    engines.report(step=0, generated_tokens=0, **beat)
    time.sleep(2.0)
    engines.report(step=1, generated_tokens=100, **beat)
    update = frontend.wait_for(lambda u: u.engines is not None and u.engines[1].pid == 4242
                               and u.engines[1].tokens_per_s > 0)
    info = update.engines[1]
    assert (info.kv_cache_usage, info.host) == (0.25, "h1") and 0 < info.tokens_per_s <= 100
    assert update.engines[0].pid is None  # rank 0 sent no heartbeat
