"""Lockstep data parallel over real processes: the DP coordinator, two engine
processes on a tiny model and a front-end client. In lockstep mode the
engines move through request waves together (the idle engine runs dummy
batches, an all-reduce ends each wave, rank 0 reports it, the coordinator
publishes the next wave); in the default mode they step independently."""

from __future__ import annotations

import asyncio
import time

import pytest

from dpserve import SamplingParams
from dpserve.config import EngineArgs
from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.launch.host import launch_engines
from dpserve.protocol import EngineCoreRequest

pytestmark = pytest.mark.procs

START_TIMEOUT = 120.0
SYNC_INTERVAL = 4


async def _serve_bursts(model: str, lockstep: bool, bursts: int) -> tuple[list[dict], int]:
    """Run `bursts` bursts of requests pinned to rank 0, each followed by an idle
    spell; return both engines' DP state and the last wave the client heard of."""
    config = EngineArgs(model=model, data_parallel_size=2, data_parallel_lockstep=lockstep,
                        data_parallel_sync_interval=SYNC_INTERVAL, threads_per_engine=1,
                        max_model_len=256, num_kv_blocks=64).create_config()
    launch = await asyncio.to_thread(launch_engines, config, 1, START_TIMEOUT)
    client = None
    try:
        client = AsyncEngineClient(launch.input_binds(0), launch.output_binds(0),
                                   engine_ranks=launch.ranks,
                                   coordinator_address=launch.coordinator_address,
                                   lockstep=config.parallel.data_parallel_lockstep)
        client.watch_processes(launch.processes)
        if lockstep:  # a slow start may form a group of rank 0 alone first: wait for both
            deadline = time.monotonic() + 60
            while not _in_one_group(await client.call_utility_all("get_dp_state")):
                assert time.monotonic() < deadline, "the two engines never formed one group"
                await asyncio.sleep(0.05)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for burst in range(bursts):
            ids = [f"b{burst}-{i}" for i in range(3)]
            for i, rid in enumerate(ids):
                await client.add_request(EngineCoreRequest(
                    rid, [1 + i, 2, 3, 4], params, data_parallel_rank=0))
            finished: set[str] = set()
            while len(finished) < len(ids):
                outputs = await asyncio.wait_for(client.get_output(), 30)
                finished |= {o.request_id for o in outputs.outputs if o.finished}
            if lockstep:  # the wave ends everywhere, then the coordinator says so
                deadline = time.monotonic() + 60  # generous: a loaded machine is slow
                while client.engines_running or client.current_wave != burst + 1:
                    if time.monotonic() > deadline:  # what each side believes, to debug
                        engines = await client.call_utility_all("get_dp_state")
                        raise AssertionError(f"burst {burst}: the client's (wave, running) "
                                             f"stays ({client.current_wave}, "
                                             f"{client.engines_running}); engines: {engines}")
                    await asyncio.sleep(0.02)
            else:  # an idle spell: 10 passes of every engine's loop, where a wave or
                # a dummy batch would run (each answers a call between them)
                for _ in range(10):
                    await client.call_utility_all("get_dp_state")
        by_rank = await client.call_utility_all("get_dp_state")
        assert sorted(by_rank) == [0, 1]
        return [by_rank[0], by_rank[1]], client.current_wave
    finally:
        if client is not None:
            await client.aclose()
        launch.close()


def _in_one_group(by_rank: dict) -> bool:
    states = [by_rank.get(r) or {} for r in (0, 1)]
    return all(s.get("in_group") and s.get("members") == [0, 1] for s in states) and \
        states[0]["generation"] == states[1]["generation"]


def test_lockstep_engines_move_through_waves_together(tiny_llama):
    states, client_wave = asyncio.run(_serve_bursts(str(tiny_llama), lockstep=True, bursts=3))
    rank0, rank1 = states
    assert client_wave == 3
    assert rank0["lockstep"] and rank0["wave"] == rank1["wave"] == 3
    assert not rank0["running"] and not rank1["running"]
    # Rank 1 never had a request: it stepped with dummy batches to keep in step.
    assert rank1["dummy_batches"] > 0
    # Every rank ran the same all-reduces in the group (its collectives match), at
    # least one per wave besides the one that joined it.
    assert rank0["generation"] == rank1["generation"]
    assert rank0["group_all_reduces"] == rank1["group_all_reduces"] >= 1 + 3


def test_default_mode_runs_no_waves_or_dummy_batches(tiny_llama):
    states, client_wave = asyncio.run(_serve_bursts(str(tiny_llama), lockstep=False,
                                                    bursts=2))
    assert client_wave == 0
    for state in states:
        assert not state["lockstep"]
        assert state["wave"] == 0 and state["dummy_batches"] == 0
        assert state["all_reduces"] == 0


@pytest.mark.parametrize("value", [0, -3])
def test_sync_interval_must_be_positive(value):
    from dpserve.config import ConfigError

    with pytest.raises(ConfigError, match="data_parallel_sync_interval"):
        EngineArgs(data_parallel_sync_interval=value).create_config()
