"""Engines in real processes: handshake, serving over ZMQ, utility calls, and
every way an engine can end (fatal error, start-up death, SIGTERM, shutdown,
an orphaned engine). Tiny random model; every wait is bounded; every process
is torn down even when a test fails."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import psutil
import pytest
import zmq

from dpserve.config import EngineArgs
from dpserve.engine.build import FAULT_FORWARD_ENV
from dpserve.frontend.engine_client import AsyncEngineClient, UtilityCallError
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.engines import EngineProcManager, EngineStartupError, wait_for_engine_startup
from dpserve.launch.process import shutdown, wait_for_any_exit
from dpserve.protocol import (
    EngineCoreRequest,
    FinishReason,
    HandshakeReady,
    SchedulerStats,
    engine_identity,
)
from dpserve.sampling_params import SamplingParams

ENGINE_KW = dict(max_model_len=256, num_kv_blocks=64, threads_per_engine=1)
pytestmark = pytest.mark.procs

START_TIMEOUT = 120.0  # generous: a loaded 2-core machine


@pytest.fixture(scope="module")
def engine_config(tiny_llama):
    return EngineArgs(model=str(tiny_llama), **ENGINE_KW).create_config()


@contextlib.contextmanager
def launched(config, num_engines: int = 1):
    """Spawn engines on fresh addresses; always tear them down."""
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(num_clients=1)
    mgr = EngineProcManager(config, addrs.handshake, num_engines=num_engines)
    try:
        yield mgr, addrs
    finally:
        mgr.close()
        alloc.cleanup()


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = 30.0):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def make_client(addrs) -> AsyncEngineClient:
    return AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], register_timeout=10.0)


@dataclass
class Finished:
    token_ids: list[int]
    finish_reason: FinishReason


async def collect(client: AsyncEngineClient, request_ids) -> dict[str, Finished]:
    """Outputs of `request_ids` until each has finished."""
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    done: dict[str, Finished] = {}
    while len(done) < len(tokens):
        for out in (await asyncio.wait_for(client.get_output(), 60)).outputs:
            if out.error is not None:  # no engine could run it (the client says why)
                raise EngineUnavailableError(out.error)
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = Finished(tokens[out.request_id], out.finish_reason)
    return done


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class Served:
    loop: asyncio.AbstractEventLoop
    client: AsyncEngineClient
    ready: HandshakeReady


@pytest.fixture(scope="module")
def served(engine_config):
    """One engine process and a client on a loop of their own, for the serving tests."""
    loop = asyncio.new_event_loop()
    try:
        with launched(engine_config) as (mgr, addrs):
            ready = mgr.wait_for_startup(addrs.init_metadata(), timeout=START_TIMEOUT)
            client = run(loop, make_client(addrs))
            try:
                yield Served(loop, client, ready[0])
            finally:
                run(loop, client.aclose())
    finally:
        loop.close()


# ---- serving -------------------------------------------------------------------


def test_handshake_reports_the_kv_cache(served):
    assert served.ready.num_kv_blocks == ENGINE_KW["num_kv_blocks"]
    assert served.ready.max_model_len == ENGINE_KW["max_model_len"]


def test_greedy_outputs_equal_the_offline_llm(served, tiny_llama):
    import torch

    from dpserve import LLM

    prompts = [[1, 2, 3], list(range(10, 40)), [7] * 17, list(range(100, 150, 3))]
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_llama), **ENGINE_KW)
        offline = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16),
                               use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    expected = [o.outputs[0].token_ids for o in offline]

    async def serve():
        for i, p in enumerate(prompts):
            await served.client.add_request(EngineCoreRequest(f"gen-{i}", p, greedy(16)))
        return await collect(served.client, [f"gen-{i}" for i in range(len(prompts))])

    got = run(served.loop, serve())
    assert [got[f"gen-{i}"].token_ids for i in range(len(prompts))] == expected
    assert {f.finish_reason for f in got.values()} == {FinishReason.LENGTH}


def test_abort_then_utility_calls(served):
    client = served.client

    async def scenario():
        await client.add_request(EngineCoreRequest("long", [5, 6, 7], greedy(200)))
        first = await asyncio.wait_for(client.get_output(), 60)  # it is running now
        assert [o.request_id for o in first.outputs] == ["long"]
        assert first.scheduler_stats is not None and first.scheduler_stats.num_running == 1
        await client.abort_requests(["long"])
        final = (await collect(client, ["long"]))["long"]
        assert final.finish_reason == FinishReason.ABORT
        assert len(final.token_ids) < 200 - 1

        stats = await client.call_utility("get_stats", result_type=SchedulerStats)
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == served.ready.num_kv_blocks
        assert stats.kv_cache_usage == 0.0
        assert await client.call_utility("reset_prefix_cache") is True
        assert await client.call_utility("get_request_counts") == [0, 0]
        with pytest.raises(UtilityCallError, match="no utility method 'no_such_method'"):
            await client.call_utility("no_such_method", 1, 2)
        with pytest.raises(UtilityCallError, match="no utility method 'step'"):
            await client.call_utility("step")  # the request path is not a utility
        with pytest.raises(UtilityCallError, match="TypeError"):
            await client.call_utility("get_stats", "unexpected argument")

        # The engine survived all of that.
        await client.add_request(EngineCoreRequest("after", [9, 9], greedy(5)))
        after = (await collect(client, ["after"]))["after"]
        assert (len(after.token_ids), after.finish_reason) == (5, FinishReason.LENGTH)

    run(served.loop, scenario())



# Names a front-end must not call, each with arguments that would do harm if it ran:
# the request path, a step, sleep / wake-up outside `control`, DP steps, the process's
# own lifecycle, dunders and attributes. Most exist on EngineCore or its process.
_REFUSED = [("step", []), ("add_request", [None]), ("abort_requests", [["x"]]),
            ("sleep", [2]), ("wake_up", []), ("execute_dummy_batch", []),
            ("shutdown", []), ("begin_drain", [0.0]), ("send_engine_dead", []),
            ("run_busy_loop", []), ("_call_utility", [None, 0]), ("__init__", []),
            ("__class__", []), ("execute_model", []), ("runner", []), ("control_", [])]


def test_only_listed_utilities_run(served):
    """Every other name gets an error answer naming it (no crash, no hang), and the
    engine serves on unchanged: a `sleep(2)` that ran would have freed its weights."""
    from dpserve.engine.core import EngineCore
    from dpserve.engine.process import EngineCoreProc

    existing = [m for m, _ in _REFUSED if hasattr(EngineCore, m) or hasattr(EngineCoreProc, m)]
    assert len(existing) >= 12, existing  # the premise: these are real methods
    client = served.client

    async def scenario():
        for method, args in _REFUSED:
            with pytest.raises(UtilityCallError, match=f"no utility method '{method}'"):
                await client.call_utility(method, *args, timeout=20)
        stats = await client.call_utility("get_stats", result_type=SchedulerStats)
        assert stats.num_free_blocks == served.ready.num_kv_blocks
        await client.add_request(EngineCoreRequest("after-refusals", [1, 2, 3], greedy(6)))
        return (await collect(client, ["after-refusals"]))["after-refusals"]

    after = run(served.loop, scenario(), timeout=120)
    assert (len(after.token_ids), after.finish_reason) == (6, FinishReason.LENGTH)

def test_bad_request_fails_alone(served):
    too_long = [5] * (ENGINE_KW["max_model_len"] + 44)

    async def scenario():
        await served.client.add_request(EngineCoreRequest("ok-1", [1, 2], greedy(6)))
        await served.client.add_request(EngineCoreRequest("bad", too_long, greedy(6)))
        await served.client.add_request(EngineCoreRequest("ok-2", [3, 4, 5], greedy(6)))
        return await collect(served.client, ["ok-1", "bad", "ok-2"])

    got = run(served.loop, scenario())
    assert got["bad"] == Finished([], FinishReason.ABORT)
    for rid in ("ok-1", "ok-2"):
        assert (len(got[rid].token_ids), got[rid].finish_reason) == (6, FinishReason.LENGTH)
    assert served.client.engines[0].num_requests == 0


# ---- death and shutdown ------------------------------------------------------------


def test_forward_fault_kills_engine_and_client_knows(engine_config, monkeypatch):
    monkeypatch.setenv(FAULT_FORWARD_ENV, "3")  # spawned engines inherit it
    loop = asyncio.new_event_loop()
    try:
        with launched(engine_config) as (mgr, addrs):
            mgr.wait_for_startup(addrs.init_metadata(), timeout=START_TIMEOUT)
            client = run(loop, make_client(addrs))

            async def scenario():
                await client.add_request(EngineCoreRequest("doomed", [1, 2, 3], greedy(20)))
                # At once, not at some timeout: bounded well below the 60 s a stalled
                # collect would take to be cut here (TimeoutError is not EngineDeadError).
                with pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
                    await asyncio.wait_for(collect(client, ["doomed"]), 60)
                with pytest.raises(EngineDeadError):
                    await client.call_utility("get_stats")

            try:
                run(loop, scenario())
            finally:
                run(loop, client.aclose())
            proc = mgr.processes[0]
            proc.join(timeout=10)
            assert proc.exitcode == 1
    finally:
        loop.close()


def test_engine_dying_at_startup_is_named(engine_config, tmp_path):
    missing = dataclasses.replace(engine_config.model, path=str(tmp_path / "no-such-model"))
    config = dataclasses.replace(engine_config, model=missing)
    with launched(config) as (mgr, addrs):
        # The death is named (a timeout would say "not ready after ..." instead).
        with pytest.raises(EngineStartupError, match=r"EngineCore_0 \(pid \d+, exit code 1\)"):
            mgr.wait_for_startup(addrs.init_metadata(), timeout=START_TIMEOUT)


def test_sigterm_exits_cleanly_and_shutdown_leaves_nothing(engine_config):
    with launched(engine_config, num_engines=2) as (mgr, addrs):
        ready = mgr.wait_for_startup(addrs.init_metadata(), timeout=START_TIMEOUT)
        assert sorted(ready) == [0, 1]
        p0, p1 = mgr.processes
        assert psutil.Process(p1.pid).cmdline()[0].startswith("dpserve::EngineCore_1")
        os.kill(p1.pid, signal.SIGTERM)
        assert wait_for_any_exit(mgr.processes, timeout=30) == [p1]
        assert p1.exitcode == 0 and p0.is_alive()

        pids = [p0.pid, p1.pid]
        shutdown(mgr.processes)
        shutdown(mgr.processes)  # idempotent
        assert p0.exitcode == 0  # SIGTERM from shutdown(): a clean exit too
        children = {c.pid for c in psutil.Process().children(recursive=True)}
        assert not children & set(pids)
        assert not any(psutil.pid_exists(pid) for pid in pids)


def _sigterm_with_requests(config, max_tokens: int, late: bool = True, again: bool = False):
    """Two requests running, then SIGTERM, then (`late`) one more request, and
    (`again`, once "late" was rejected) a second SIGTERM: returns how each of
    "a", "b", "late" ended ({} with `again`: what finished before the exit), and
    the exit code."""
    loop = asyncio.new_event_loop()
    try:
        with launched(config) as (mgr, addrs):
            mgr.wait_for_startup(addrs.init_metadata(), timeout=START_TIMEOUT)
            proc = mgr.processes[0]

            async def scenario() -> dict[str, Finished]:
                client = await make_client(addrs)
                try:
                    for rid in ("a", "b"):
                        await client.add_request(EngineCoreRequest(rid, [5, 6, 7],
                                                                   greedy(max_tokens)))
                    first: list = []  # outputs until both are running (the premise)
                    while {"a", "b"} - {o.request_id for o in first}:
                        first += (await asyncio.wait_for(client.get_output(), 60)).outputs
                    os.kill(proc.pid, signal.SIGTERM)
                    if not late:
                        got = await collect(client, ["a", "b"])
                    elif not again:
                        await client.add_request(EngineCoreRequest("late", [1, 2], greedy(4)))
                        got = await collect(client, ["a", "b", "late"])
                    else:
                        await client.add_request(EngineCoreRequest("late", [1, 2], greedy(4)))
                        got = await collect(client, ["late"])  # rejected: it drains
                        os.kill(proc.pid, signal.SIGTERM)
                        await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
                        while not client._outputs.empty():  # what came before the exit
                            for out in (await client.get_output()).outputs:
                                if out.finished:
                                    got[out.request_id] = Finished([], out.finish_reason)
                        return got
                    for out in reversed(first):  # the tokens `collect` did not see
                        got[out.request_id].token_ids[:0] = out.new_token_ids
                    return got
                finally:
                    await client.aclose()

            got = run(loop, scenario(), timeout=60)
            proc.join(timeout=30)
            return got, proc.exitcode
    finally:
        loop.close()


@pytest.fixture(scope="module")
def long_config(tiny_llama):
    """Room for two 1000-token requests: seconds of work, even on a fast machine."""
    return EngineArgs(model=str(tiny_llama), max_model_len=1024, num_kv_blocks=136,
                      threads_per_engine=1).create_config()


def test_sigterm_with_requests_drains_them(long_config):
    got, exitcode = _sigterm_with_requests(long_config, max_tokens=1000)
    assert exitcode == 0
    assert got["late"] == Finished([], FinishReason.ABORT)  # no new work while draining
    for rid in ("a", "b"):
        assert (len(got[rid].token_ids), got[rid].finish_reason) == (1000, FinishReason.LENGTH)


def test_sigterm_drain_aborts_at_the_shutdown_timeout(long_config):
    config = dataclasses.replace(long_config, shutdown_timeout=0.0)
    got, exitcode = _sigterm_with_requests(config, max_tokens=1000, late=False)
    assert exitcode == 0
    for rid in ("a", "b"):
        assert got[rid].finish_reason == FinishReason.ABORT and len(got[rid].token_ids) < 1000


def test_second_sigterm_exits_at_once(long_config):
    config = dataclasses.replace(long_config, shutdown_timeout=600.0)
    got, exitcode = _sigterm_with_requests(config, max_tokens=1000, again=True)
    assert exitcode == 0
    assert got == {"late": Finished([], FinishReason.ABORT)}  # a and b were not finished


_ORPHAN_SCRIPT = """
import sys, time
from dpserve.config import EngineArgs
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.engines import EngineProcManager
config = EngineArgs(model=sys.argv[1], max_model_len=64, num_kv_blocks=8,
                    threads_per_engine=1).create_config()
addrs = AddressAllocator().engine_addresses(1)
mgr = EngineProcManager(config, addrs.handshake)
mgr.wait_for_startup(addrs.init_metadata(), timeout=60)
print(mgr.processes[0].pid, flush=True)
time.sleep(120)
"""


def test_engine_exits_when_its_parent_dies(tiny_llama):
    tmp = tempfile.mkdtemp(prefix="dps-")  # the killed launcher cannot clean its ipc dir
    env = {**os.environ, "TMPDIR": tmp}
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny_llama)],
                              stdout=subprocess.PIPE, env=env)
    engine_pid = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], START_TIMEOUT)
        assert ready, "the intermediate launcher did not report its engine in time"
        engine_pid = int(parent.stdout.readline())
        engine = psutil.Process(engine_pid)
        # Its parent is the launcher's forkserver (dpserve.launch.process.engine_context).
        assert engine in psutil.Process(parent.pid).children(recursive=True)
        parent.kill()
        parent.wait(timeout=5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(engine):
            time.sleep(0.1)
        assert not _alive(engine), "the orphaned engine did not exit by itself"
    finally:
        parent.kill()
        parent.wait(timeout=5)
        parent.stdout.close()
        if engine_pid is not None and psutil.pid_exists(engine_pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(engine_pid).kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- the pieces alone (no engine process) -----------------------------------------


def test_addresses_are_unique_and_cleaned_up():
    a, b = AddressAllocator(), AddressAllocator()
    x, y = a.engine_addresses(2), b.engine_addresses(2)
    names = [x.handshake, *x.inputs, *x.outputs, a.new_address("coord-in"),
             a.new_address("coord-out"), y.handshake, *y.inputs, *y.outputs]
    assert len(set(names)) == len(names) and all(n.startswith("ipc://") for n in names)
    assert a.ipc_dir != b.ipc_dir and os.path.isdir(a.ipc_dir)
    a.cleanup()
    a.cleanup()
    b.cleanup()
    assert not os.path.exists(a.ipc_dir) and not os.path.exists(b.ipc_dir)
    tcp = AddressAllocator(local_only=False).engine_addresses(3)
    ports = [addr.rsplit(":", 1)[1] for addr in (tcp.handshake, *tcp.inputs, *tcp.outputs)]
    ports.append(str(tcp.dp_master_port))  # the DP group's TCP store
    assert len(set(ports)) == len(ports) == 8
    meta = x.init_metadata(dp_size=2)
    assert meta.input_addresses == list(x.inputs) and meta.dp_size == 2
    assert meta.dp_master_port == x.dp_master_port > 0


def test_startup_wait_is_bounded():
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(1)
    try:
        with pytest.raises(EngineStartupError, match=r"not ready after 0 s: rank 0 NEW"):
            wait_for_engine_startup(addrs.handshake, addrs.init_metadata(), [0], timeout=0.3)
    finally:
        alloc.cleanup()


def test_client_death_fails_pending_calls_at_once():
    """A fake engine that registers but never answers; mark_dead from another thread."""
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(1)
    ctx = zmq.Context()
    fake = ctx.socket(zmq.DEALER)
    fake.setsockopt(zmq.IDENTITY, engine_identity(0))
    fake.setsockopt(zmq.LINGER, 0)

    async def scenario():
        client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], register_timeout=5)
        try:
            fake.connect(addrs.inputs[0])
            fake.send(b"")
            call = asyncio.ensure_future(client.call_utility("get_stats", timeout=20))
            for _ in range(1000):  # the call reached the "engine" (10 s at most)
                if fake.poll(0):
                    break
                await asyncio.sleep(0.01)
            assert fake.poll(0), "the call never reached the engine"
            threading.Thread(target=client.mark_dead, args=("launcher: EngineCore_0 died",)
                             ).start()
            # At once: long before the call's own 20 s timeout.
            with pytest.raises(EngineDeadError, match="EngineCore_0 died"):
                await asyncio.wait_for(call, 10)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(client.get_output(), 10)
            with pytest.raises(EngineDeadError):
                await client.add_request(EngineCoreRequest("x", [1], greedy(1)))
        finally:
            await client.aclose()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        fake.close()
        ctx.term()
        alloc.cleanup()


def test_send_waits_for_registration_with_a_bound():
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(1)

    async def scenario():
        client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], register_timeout=0.3)
        try:
            with pytest.raises(TimeoutError, match="engine 0 did not register"):
                await client.add_request(EngineCoreRequest("x", [1], greedy(1)))
            assert client.engines[0].num_requests == 0
        finally:
            await client.aclose()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        alloc.cleanup()
