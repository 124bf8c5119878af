"""The Ray backend (`dpserve.launch.ray_backend`) on a real two-node Ray cluster on
loopback (each node declares one CPU and a resource of its own) with real
engine actors on a tiny model (the placement planner, which needs no Ray, is
in test_ray_placement.py): one engine per node serving a front-end client over tcp, ranks that
cannot be placed failing fast with what is missing, a bounded placement
wait, and a local Ray instance whose engine hits a fatal error. After each
manager closes, no actor, placement group or process of it is left."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from dpserve import SamplingParams
from dpserve.config import EngineArgs, EngineConfig
from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError
from dpserve.launch.addresses import AddressAllocator, ZmqAddresses
from dpserve.launch.coordinator import DPCoordinator
from dpserve.launch.engines import EngineStartupError
from dpserve.launch.ray_backend import RayEngineManager, RayPlacementError, connect_ray
from dpserve.protocol import EngineCoreRequest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.alone]

HOST = "127.0.0.1"
START_TIMEOUT = 120.0
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# ---- a real two-node cluster on loopback ----------------------------------------------------


def _config(model, dp: int, **kw) -> EngineConfig:
    return EngineArgs(model=str(model), data_parallel_size=dp, threads_per_engine=1,
                      max_model_len=256, num_kv_blocks=64, data_parallel_backend="ray",
                      **kw).create_config()


def _tcp_addresses() -> ZmqAddresses:
    return AddressAllocator(local_only=False, host=HOST).engine_addresses(1)


def _descendants() -> list[psutil.Process]:
    """This process's descendants, less multiprocessing's resource tracker (it lives
    as long as this process once a spawned process, e.g. the coordinator, was started)."""
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return procs


def _all_gone(procs: list[psutil.Process | int], timeout: float = 15.0) -> list[str]:
    """Wait (bounded) for `procs` to exit; return those still running (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                p = psutil.Process(p) if isinstance(p, int) else p
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes on 127.0.0.1, one CPU each: "head" (the driver's) and "worker"."""
    from ray.cluster_utils import Cluster

    from dpserve.launch.ray_backend import _keep_ray_on_loopback

    _keep_ray_on_loopback()
    node = dict(num_cpus=1, node_ip_address=HOST, object_store_memory=80 << 20)
    with pytest.MonkeyPatch.context() as env:  # the cluster's processes see these
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            include_dashboard=False, resources={"head": 1}, **node))
        try:
            cluster.add_node(resources={"worker": 1}, **node)
        except BaseException:
            cluster.shutdown()
            raise
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    procs = _descendants()
    cluster.shutdown()
    left = _all_gone(procs)
    assert not left, f"Ray processes left behind: {left}"


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def _live_placement_groups() -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED"]


def _live_actors() -> list[str]:
    return [a["ActorClassName"] for a in ray._private.state.actors().values()
            if a["State"] != "DEAD"]


def _wait_until(check, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return result


def _offline_greedy(config: EngineConfig, prompts: list[list[int]]) -> list[list[int]]:
    """The same requests on one in-process EngineCore (the oracle)."""
    import torch

    from dpserve.engine.core import EngineCore

    threads = torch.get_num_threads()
    try:
        core = EngineCore(dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1)))
        for i, ids in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"o{i}", ids, GREEDY))
        tokens: dict[str, list[int]] = {f"o{i}": [] for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
        return [tokens[f"o{i}"] for i in range(len(prompts))]
    finally:
        torch.set_num_threads(threads)


async def _generate(client: AsyncEngineClient, prompts: list[list[int]], tag: str,
                    rank: int | None) -> tuple[list[list[int]], set[int]]:
    """Greedy completions of `prompts` (pinned to `rank` if given), and the engines used."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    engines = set()
    for rid, prompt in zip(ids, prompts):
        await client.add_request(EngineCoreRequest(rid, prompt, GREEDY, data_parallel_rank=rank))
        engines.add(client.engine_of(rid))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: set[str] = set()
    while len(finished) < len(ids):
        outputs = await asyncio.wait_for(client.get_output(), 30)
        for out in outputs.outputs:
            if out.error is not None:  # no engine could run it (the client says why)
                raise EngineUnavailableError(out.error)
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    return [tokens[rid] for rid in ids], engines


async def _serve_on_two_nodes(config: EngineConfig) -> tuple[RayEngineManager, dict]:
    alloc = AddressAllocator(local_only=False, host=HOST)
    coordinator = DPCoordinator(2, alloc)
    manager = client = None
    try:
        coordinator.start()
        addrs = alloc.engine_addresses(1).with_coordinator(coordinator)
        manager = RayEngineManager(config, addrs.init_metadata(dp_size=2), node_ip=HOST,
                                   placement_timeout=30)
        ready = await asyncio.to_thread(manager.wait_for_startup, START_TIMEOUT,
                                        [coordinator.proc])
        client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], engine_ranks=manager.ranks,
                                   coordinator_address=coordinator.front_publish_address,
                                   max_model_len=min(r.max_model_len for r in ready.values()))
        manager.watch_engines(client.mark_dead)
        client.watch_processes([coordinator.proc])
        results = {rank: await _generate(client, PROMPTS, f"r{rank}", rank) for rank in (0, 1)}
        results[None] = await _generate(client, PROMPTS * 2, "any", None)
        seen = dict(results=results, ready=ready, live_pgs=_live_placement_groups(),
                    live_actors=_live_actors(), titles=[
                        psutil.Process(manager.engine_info[r]["pid"]).cmdline()[0]
                        for r in (0, 1)])
        # A SIGKILLed engine: its run ref fails, the watcher tells the client.
        os.kill(manager.engine_info[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not client.dead and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        seen["dead_reason"] = client.dead_reason
        return manager, seen
    finally:
        if client is not None:
            await client.aclose()
        if manager is not None:
            manager.close()
        coordinator.close()


def test_one_engine_per_node_serves_a_client(ray_cluster, tiny_llama):
    config = _config(tiny_llama, 2)
    assert connect_ray(ray_cluster.address, HOST) == "joined"  # ours: the manager keeps it
    try:
        manager, seen = asyncio.run(_serve_on_two_nodes(config))
        head, worker = _node_with("head"), _node_with("worker")
        # Rank 0 on the driver's (master) node, rank 1 on the other one.
        assert manager.master_node_id == ray.get_runtime_context().get_node_id() == head
        assert [manager.node_of[r].node_id for r in (0, 1)] == [head, worker]
        assert [manager.engine_info[r]["node_id"] for r in (0, 1)] == [head, worker]
        assert manager.local_ranks == [0]
        assert [seen["ready"][r].local for r in (0, 1)] == [True, False]
        assert len(seen["live_pgs"]) == 2 and seen["live_actors"] == ["EngineCoreActor"] * 2
        assert seen["titles"] == ["dpserve::EngineCore_0", "dpserve::EngineCore_1"]
        # Greedy: both ranks give what one offline engine gives, wherever requests go.
        expected = _offline_greedy(config, PROMPTS)
        assert all(len(t) == GREEDY.max_tokens for t in expected)
        results = seen["results"]
        assert results[0] == (expected, {0}) and results[1] == (expected, {1})
        assert results[None] == (expected * 2, {0, 1})
        assert seen["dead_reason"].startswith("engine 1 (Ray actor) stopped: ActorDiedError")
        assert manager.exit_reasons.keys() == {1}
        # Closed: no actor, placement group or engine process is left.
        assert _wait_until(lambda: not _live_actors()), _live_actors()
        assert not _live_placement_groups()
        assert not _all_gone([manager.engine_info[r]["pid"] for r in (0, 1)])
        assert ray.is_initialized()  # the manager did not connect Ray: it stays connected
    finally:
        ray.shutdown()


@pytest.mark.parametrize("case", ["dp3_on_two_cpus", "gpu_nobody_has"])
def test_a_rank_that_cannot_be_placed_fails_fast(ray_cluster, tiny_llama, case):
    config = _config(tiny_llama, 3 if case == "dp3_on_two_cpus" else 1)
    if case == "gpu_nobody_has":
        config = dataclasses.replace(config, device="cuda")
    addrs = _tcp_addresses()
    start = time.monotonic()
    with pytest.raises(RayPlacementError) as e:
        RayEngineManager(config, addrs.init_metadata(dp_size=config.parallel.data_parallel_size),
                         ray_address=ray_cluster.address, node_ip=HOST)
    assert time.monotonic() - start < 60  # fails fast: no wait for resources (generous)
    msg = str(e.value)
    if case == "dp3_on_two_cpus":
        assert "cannot place DP rank 2" in msg and "missing: CPU" in msg, msg
        assert msg.count("CPU 0 of 1") == 2, msg  # what each node has
    else:
        assert "cannot place DP rank 0" in msg and "missing: GPU" in msg, msg
        assert msg.count("no GPU") == 2, msg
    assert not ray.is_initialized()  # the manager connected, so it disconnected


def test_an_engine_that_fails_to_start_fails_the_start_up(ray_cluster, tiny_llama):
    config = _config(tiny_llama, 1)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                   path="/nonexistent/model"))
    with RayEngineManager(config, _tcp_addresses().init_metadata(),
                          ray_address=ray_cluster.address, node_ip=HOST) as manager:
        # The death is named (a timeout would say so instead).
        with pytest.raises(EngineStartupError, match=r"engine 0 \(Ray actor on node \w+\) died "
                           r"during start-up: its constructor raised [\w.]+Error: "
                           r".*/nonexistent/model"):
            manager.wait_for_startup(timeout=START_TIMEOUT)
    assert not ray.is_initialized()


def test_the_placement_wait_is_bounded(ray_cluster, tiny_llama):
    from ray.util.placement_group import placement_group, remove_placement_group

    assert connect_ray(ray_cluster.address, HOST) == "joined"
    try:  # something else holds the worker node's CPU
        blocker = placement_group([{"CPU": 1}], strategy="STRICT_PACK", name="blocker",
                                  bundle_label_selector=[{"ray.io/node-id":
                                                          _node_with("worker")}])
        assert blocker.wait(10)
        start = time.monotonic()
        with pytest.raises(RayPlacementError, match=r"did not place DP rank\(s\) \[1\] within "
                                                    r"2 s.*CPU 0 of 1"):
            RayEngineManager(_config(tiny_llama, 2), _tcp_addresses().init_metadata(dp_size=2),
                             node_ip=HOST, placement_timeout=2)
        assert time.monotonic() - start < 60  # the 2 s wait, not forever (generous)
        assert _live_placement_groups() == ["blocker"]  # the manager removed its own
        remove_placement_group(blocker)
    finally:
        ray.shutdown()


def test_local_ray_instance_and_an_engine_that_dies(tiny_llama):
    """No address: a local Ray instance of its own, shut down by close(). The
    engine's first forward raises: ENGINE_CORE_DEAD reaches the client and
    the run ref reports the rank."""
    before = {p.pid for p in _descendants()}
    addrs = _tcp_addresses()

    async def run() -> tuple[RayEngineManager, str, list[psutil.Process]]:
        manager = RayEngineManager(_config(tiny_llama, 1), addrs.init_metadata(), node_ip=HOST,
                                   runtime_env={"env_vars": {"DPSERVE_FAULT_FORWARD_AT": "1"}})
        try:
            assert manager.started_ray and ray.is_initialized()
            await asyncio.to_thread(manager.wait_for_startup, START_TIMEOUT)
            spawned = [p for p in _descendants() if p.pid not in before]  # Ray's and the actor
            async with AsyncEngineClient(addrs.inputs[0], addrs.outputs[0]) as client:
                with pytest.raises(EngineDeadError, match=r"rank 0 dead .*ENGINE_CORE_DEAD"):
                    await _generate(client, PROMPTS[:1], "doomed", None)
            ended = await asyncio.to_thread(manager.wait_for_any_exit, 30)
            assert ended == [0] and manager.wait_for_any_exit(0) == []
            return manager, manager.exit_reasons[0], spawned
        finally:
            manager.close()

    manager, reason, spawned = asyncio.run(run())
    assert "injected fault" in reason
    assert not ray.is_initialized()  # it started Ray, so close() shut it down
    manager.close()  # idempotent
    assert len(spawned) > 3  # gcs, raylet, agents, the engine's worker...
    left = _all_gone(spawned)
    assert not left, f"the local Ray instance left processes behind: {left}"


def _engine_procs(pid: int, name: str) -> list[psutil.Process]:
    """Running (not zombie) descendants of `pid` titled dpserve::<name>."""
    from helpers import descendants

    found = []
    for p in descendants(pid):
        try:
            if p.name() == f"dpserve::{name}" and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.parametrize("fault", ["SIGKILL", "fatal error"])
def test_dead_engine_actor_is_restarted_and_nothing_remains(tiny_llama, fault):
    """`dpserve serve --data-parallel-backend ray`, DP=2, 16 streams running: engine
    actor 1's process is SIGKILLed, or its 40th forward raises (the actor stays
    alive, holding its placement group's CPU, until the restart ends it; the
    restarted actor, incarnation 1, runs clean). Every stream completes (equal
    to an undisturbed greedy run), /health?rank=1 leaves serving (SIGKILL:
    restarting), then serves with incarnation 1 (one new actor process), a
    request pinned to rank 1 is served by it; after SIGTERM no process the
    server started remains."""
    import threading

    from helpers import (
        FAULT_PROMPTS,
        complete_n,
        descendants,
        expected_greedy,
        finished_by_engine,
        metric_sum,
        output,
        premise_moved,
        rank_health,
        serve,
        streams_with_fault,
        wait_until,
    )

    model, prompts = str(tiny_llama), FAULT_PROMPTS[:16]
    expected = expected_greedy(model, prompts)
    env = {"DPSERVE_FAULT_FORWARD_AT": "40", "DPSERVE_FAULT_RANK": "1"} \
        if fault == "fatal error" else None
    with serve(model, "--data-parallel-size", "2", "--data-parallel-backend", "ray",
               "--threads-per-engine", "1", "--max-model-len", "256", env=env,
               timeout=180) as (proc, url):
        started = descendants(proc.pid)
        [victim] = _engine_procs(proc.pid, "EngineCore_1")
        seen: list[tuple[str, int]] = []  # rank 1's (state, incarnation), each change
        done = threading.Event()

        def watch_rank_1() -> None:
            deadline = time.monotonic() + 180
            while not done.is_set() and time.monotonic() < deadline:
                body = rank_health(url, 1).json()
                if "ranks" not in body:  # a moment with rank 1 in no list: look again
                    time.sleep(0.05)
                    continue
                entry = body["ranks"][0]
                if not seen or seen[-1] != (entry["state"], entry["incarnation"]):
                    seen.append((entry["state"], entry["incarnation"]))
                if seen[-1] == ("serving", 1):
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=watch_rank_1, daemon=True)
        watcher.start()
        try:
            kill = (lambda: victim.send_signal(signal.SIGKILL)) if fault == "SIGKILL" \
                else (lambda: None)
            got = asyncio.run(streams_with_fault(url, model, kill, prompts,
                                                 on_rank=1 if fault == "SIGKILL" else None))
            assert got == expected  # migrated streams equal an undisturbed greedy run
            # Moved mid-stream, or re-sent whole: through Ray, on a loaded machine, the
            # API server may not have read a token of the rank's running requests yet.
            premise_moved(url, 0, f"rank 1's {fault} came while it held streams",
                          retries=True)
            watcher.join(180)
        finally:
            done.set()
        assert seen[0] == ("serving", 0) and seen[-1] == ("serving", 1), seen
        out = ["restarting"] if fault == "SIGKILL" else ["restarting", "dead"]
        assert any(seen_state in out and inc == 0 for seen_state, inc in seen), seen
        # Ray retitles an actor's process between its tasks: wait for the run() title.
        wait_until(lambda: len(_engine_procs(proc.pid, "EngineCore_1")) == 1, timeout=60,
                   what="one EngineCore_1 actor process")
        [restarted] = _engine_procs(proc.pid, "EngineCore_1")
        assert restarted.pid != victim.pid
        before = finished_by_engine(url).get(1, 0)
        assert asyncio.run(complete_n(url, model, 4, rank=1)) == [200] * 4
        assert finished_by_engine(url).get(1, 0) - before == 4
        assert metric_sum(url, "dpserve:engine_restarts_total") == 1
        assert "rank 1: EngineCore_1 (Ray actor" in output(proc), output(proc)[-3000:]
        started += [p for p in descendants(proc.pid) if p not in started]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) is not None
        left = _all_gone(started, timeout=15)
        assert not left, f"left after SIGTERM: {left}\n{output(proc)[-3000:]}"


@pytest.mark.parametrize("target", ["server", "process group", "server, Ray frozen"])
def test_sigterm_with_streams_in_flight_leaves_no_process(tiny_llama, target):
    """`dpserve serve --data-parallel-backend ray`, DP=2 (a local Ray instance, two
    engine actors behind one endpoint: both serve), SIGTERM while 8 streams
    run, sent to the server alone, to its whole process group (as `timeout`,
    systemd or `kill -- -PGID` do: that also reaches the local Ray instance's
    gcs_server and raylet, after which Ray's calls block for a minute), or to
    the server with gcs_server and raylet stopped (SIGSTOP: Ray never answers):
    the server exits, and no process it started remains (API server,
    coordinator, both engine actors, Ray's own)."""
    from helpers import free_port, wait_healthy

    model, port = str(tiny_llama), free_port()
    url = f"http://{HOST}:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="dpserve-ray-") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpserve.cli", "serve", model, "--host", HOST, "--port",
             str(port), "--data-parallel-size", "2", "--data-parallel-backend", "ray",
             "--threads-per-engine", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started: list[psutil.Process] = []
        try:
            wait_healthy(proc, url, 180, describe=lambda: open(log.name).read())
            started = psutil.Process(proc.pid).children(recursive=True)
            names = {p.name() for p in started}
            assert {"gcs_server", "raylet", "dpserve::EngineCore_0",
                    "dpserve::EngineCore_1"} <= names, names
            if target == "server":  # both engine actors serve behind the one endpoint
                import httpx
                from helpers import complete_all, finished_by_engine

                asyncio.run(complete_all(url, model, [f"p{i}" for i in range(16)],
                                         max_tokens=4))
                served = finished_by_engine(url)
                assert served.get(0, 0) > 0 and served.get(1, 0) > 0, served
                assert httpx.get(url + "/health", timeout=5).status_code == 200
            if target == "server, Ray frozen":
                for p in started:
                    if p.name() in ("gcs_server", "raylet"):
                        p.suspend()
            streaming, ended_early = asyncio.run(_sigterm_while_streaming(
                proc, url, model, 8, group=target == "process group"))
            assert streaming == 8 and not ended_early  # every stream was under way
            assert proc.wait(45) is not None  # the issue: still running after 45 s
            assert proc.returncode == 0, open(log.name).read()[-3000:]  # no crash at exit
            left = _all_gone(started, timeout=15)
            assert not left, f"left after SIGTERM: {left}\n{open(log.name).read()[-3000:]}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            for p in started:  # only after a failure: the actors have their own sessions
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass


async def _sigterm_while_streaming(proc, url: str, model: str, num: int,
                                   group: bool) -> tuple[int, int]:
    """Start `num` streams, SIGTERM `proc` (or its process group) once each has
    sent a token, wait for every stream to end (cut or not); return how many
    had a token then and how many had ended before the signal."""
    import httpx

    first = asyncio.Event()
    got_token: set[int] = set()
    ended: set[int] = set()
    body = {"model": model, "prompt": "Hello", "max_tokens": 300, "stream": True,
            "ignore_eos": True}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        got_token.add(i)
                        if len(got_token) == num:
                            first.set()
        except httpx.HTTPError:
            pass
        finally:
            ended.add(i)

    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(num)]
        await asyncio.wait_for(first.wait(), 60)
        streaming, ended_early = len(got_token), len(ended)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
    return streaming, ended_early


def test_tensor_parallel_rank_on_ray_restarts_as_a_group(tiny_llama):
    """`-tp 2` under Ray: the rank's placement group holds a CPU bundle per worker, the
    engine actor starts its TP worker (its child, on the actor's node) and serves the
    TP=1 greedy texts; the worker SIGKILLed takes the rank down, the actor is
    restarted with a new worker (incarnation 1) that serves the same texts; after
    SIGTERM no process the server started remains."""
    from helpers import descendants, output, rank_health, serve, wait_until
    from tp_checks import group_of, pinned, tp1_greedy, workers_view

    model = str(tiny_llama)
    expected = tp1_greedy(model)
    with serve(model, "--tensor-parallel-size", "2", "--data-parallel-backend", "ray",
               "--threads-per-engine", "2", "--max-model-len", "256", "--dtype", "float32",
               timeout=180) as (proc, url):
        started = descendants(proc.pid)
        core, worker = group_of(proc.pid, 0)
        wait_until(lambda: workers_view(url) == {0: [(0, core.pid, "cpu", True),
                                                     (1, worker.pid, "cpu", True)]},
                   30, "/engines shows the rank's two workers")
        assert pinned(url, model, 0) == expected
        worker.send_signal(signal.SIGKILL)
        wait_until(lambda: rank_health(url, 0).json()["ranks"][0]["incarnation"] == 1
                   and rank_health(url, 0).json()["ranks"][0]["state"] == "serving", 120,
                   "rank 0 back as a new group")
        wait_until(lambda: len(_engine_procs(proc.pid, "TPWorker_0_1")) == 1, 60,
                   "the new actor's worker")
        [new_worker] = _engine_procs(proc.pid, "TPWorker_0_1")
        assert new_worker.pid != worker.pid and not worker.is_running()
        assert pinned(url, model, 0) == expected
        assert "TP worker" in output(proc) or "tensor-parallel worker 1" in output(proc)
        started += [p for p in descendants(proc.pid) if p not in started]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) is not None
        left = _all_gone(started, timeout=15)
        assert not left, f"left after SIGTERM: {left}\n{output(proc)[-3000:]}"

