"""One stalled API server cannot stall an engine (engine/output_sender.py), over real
processes.

An engine process with two front-ends played by the test (raw ZMQ sockets), one of
which stops reading: the other's requests run to the end; the engine drops the
silent one, aborts its requests (KV freed) and rejects what it sends meanwhile;
when it reads again it gets what ZMQ held, then one notice ending each of its
requests with ABORT, and nothing of them after; then it is served as before.

`dpserve serve --api-server-count 2` with one engine, long greedy streams
on both API servers, then SIGSTOP one API server. The other's streams all finish
with their normal greedy text, within a bound that catches a stall (before, they
waited forever); their pace before and after the stop is printed, not asserted (no
timing asserts in tests: the figures go in the closing notes); the engine drops
the stopped API server (its counter, its log line naming the front-end) and aborts
its requests there. After SIGCONT
the stopped API server's streams end (finish reason "abort"): none hangs. SIGTERM
then leaves no process behind.

Which API server serves a stream: the kernel spreads connections over the API
servers sharing the listening socket, so each stream has its own connection,
and the API server process that holds the other end of it (psutil) is the one."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import time
from dataclasses import dataclass, field

import httpx
import msgspec
import psutil
import pytest
import zmq
from helpers import all_gone, descendants, offline_greedy_texts, output, serve, stop, wait_until

from dpserve.config import EngineArgs
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.engines import EngineProcManager
from dpserve.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    UtilityCall,
    engine_identity,
)
from dpserve.sampling_params import SamplingParams

pytestmark = pytest.mark.procs

PROMPTS = [f"Once upon a time {i}" for i in range(48)]
PER_SERVER = 6  # streams opened until each API server has this many
# Long enough that the engine still runs the stopped server's requests once ZMQ's queue
# and the kernel's socket buffer for it are full (~600 steps) and its backlog is too.
MAX_TOKENS = 1000
ARGS = ("--api-server-count", "2", "--threads-per-engine", "1", "--max-model-len", "1024",
        "--engine-output-stall-timeout", "2", "--engine-output-backlog", "8KiB")
NEW_CONNECTIONS = httpx.Limits(max_keepalive_connections=0)


@dataclass
class Stream:
    prompt: str
    identified: asyncio.Event = field(default_factory=asyncio.Event)
    server: int | None = None  # the index of the API server that serves it
    times: list[float] = field(default_factory=list)  # when each text chunk came
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


def _api_servers(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """API server index -> its process (named dpserve::APIServer_<i>)."""
    found = {}
    for p in launcher.children(recursive=True):
        m = re.fullmatch(r"dpserve::APIServer_(\d+)", p.name())
        if m:
            found[int(m.group(1))] = p
    return found


def _server_of(port: int, servers: dict[int, psutil.Process]) -> int | None:
    """The API server holding the server end of the connection from local `port`."""
    for index, p in servers.items():
        if any(c.raddr and c.raddr.port == port for c in p.net_connections(kind="tcp")):
            return index
    return None


async def _stream(client: httpx.AsyncClient, url: str, model: str, stream: Stream,
                  servers: dict[int, psutil.Process]) -> None:
    body = {"model": model, "prompt": stream.prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            _, port = resp.extensions["network_stream"].get_extra_info("client_addr")
            stream.server = await asyncio.to_thread(_server_of, port, servers)
            stream.identified.set()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    stream.error = chunk["error"]["message"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        stream.times.append(time.monotonic())
                        stream.text += choice["text"]
                    stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    except httpx.HTTPError as e:
        stream.error = repr(e)
    finally:
        stream.identified.set()


def _engine_state(url: str) -> dict[str, int]:
    """Engine 0's request_state_sizes, asked through whichever API server answers."""
    state = httpx.get(url + "/debug/request_state", timeout=5).json()
    return state["engines"]["0"]


def _mean_gap(times: list[float], start: float, end: float) -> float:
    """Seconds per chunk between `start` and `end` (chunks come in bursts when the
    API server lags: a mean over a window, not single gaps)."""
    inside = [t for t in times if start <= t <= end]
    assert len(inside) >= 20, f"{len(inside)} chunks in the window; premise failed"
    return (inside[-1] - inside[0]) / (len(inside) - 1)


async def _wait(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.05)


async def _run(url: str, model: str, launcher: psutil.Process) -> dict:
    servers = _api_servers(launcher)
    assert sorted(servers) == [0, 1], servers
    streams: list[Stream] = []
    tasks: list[asyncio.Task] = []
    by_server: dict[int, list[Stream]] = {0: [], 1: []}
    async with httpx.AsyncClient(timeout=120, limits=NEW_CONNECTIONS) as client:
        # 1. One new connection at a time (an API server accepts every connection
        #    waiting at once), until each API server has PER_SERVER streams.
        for prompt in PROMPTS:
            if min(len(v) for v in by_server.values()) >= PER_SERVER:
                break
            streams.append(Stream(prompt))
            tasks.append(asyncio.create_task(_stream(client, url, model, streams[-1],
                                                     servers)))
            await asyncio.wait_for(streams[-1].identified.wait(), 60)
            assert streams[-1].error is None and streams[-1].server is not None, streams[-1]
            by_server[streams[-1].server].append(streams[-1])
        assert min(len(v) for v in by_server.values()) >= PER_SERVER, \
            f"{len(PROMPTS)} connections, spread {[len(v) for v in by_server.values()]}"
        # Every stream under way (60 chunks in: 50 to time before the stop).
        await _wait("every stream to be under way", lambda: all(
            len(s.times) >= 60 or s.error for s in streams), 120)
        assert not [s.error for s in streams if s.error], [s.error for s in streams]
        victim, healthy = 1, 0
        before = await asyncio.to_thread(_engine_state, url)
        # Premise: the engine runs requests of the API server about to stop.
        assert before[f"client_of_{victim}"] >= 1, before
        assert before["dropped_clients"] == 0, before
        # 2. Stop one API server; the other's streams must go on and finish.
        t_stop = time.monotonic()
        os.kill(servers[victim].pid, signal.SIGSTOP)
        try:
            _, late = await asyncio.wait(
                [t for t, s in zip(tasks, streams) if s.server == healthy], timeout=60)
            assert not late, f"{len(late)} of the other API server's streams did not " \
                             f"finish within 60 s of the stop"
            after = await asyncio.to_thread(wait_until, lambda: (
                (st := _engine_state(url))["dropped_clients"] >= 1 and st), 60,
                "the engine to drop the stopped API server")
            t_healthy_done = time.monotonic()
        finally:
            os.kill(servers[victim].pid, signal.SIGCONT)
        # 3. The stopped server's streams end; none hangs.
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return {"streams": by_server, "healthy": healthy, "victim": victim, "t_stop": t_stop,
            "t_done": t_healthy_done, "after": after}


@pytest.mark.slow
@pytest.mark.alone  # the pace it prints means something only with no test beside it
def test_a_stopped_api_server_cannot_stall_the_engine_for_the_other(tiny_llama):
    model = str(tiny_llama)
    with serve(model, *ARGS) as (proc, url):
        launcher = psutil.Process(proc.pid)
        children = descendants(proc.pid)
        run = asyncio.run(_run(url, model, launcher))
        healthy, victim = run["streams"][run["healthy"]], run["streams"][run["victim"]]
        # The other server's streams: whole (their text: below) ...
        for s in healthy:
            assert (s.error, s.finish_reason) == (None, "length"), s
        # ... and their pace (each stream's mean time per chunk from its 10th chunk to the
        # stop, and from the stop to its end), printed for the record.
        pre = statistics.median(_mean_gap(s.times, s.times[9], run["t_stop"]) for s in healthy)
        post = statistics.median(_mean_gap(s.times, run["t_stop"], run["t_done"])
                                 for s in healthy)
        ratio = post / pre
        # The engine dropped the stopped server and aborted its requests (KV freed).
        assert run["after"]["dropped_clients"] == 1, run["after"]
        log = output(proc)
        m = re.search(r"engine 0: dropped front-end 1: (.*); aborting its (\d+) request", log)
        assert m and "--engine-output-" in m.group(1), log[-3000:]
        assert 1 <= int(m.group(2)) <= len(victim), m.group(0)
        print(f"healthy API server: {pre * 1000:.2f} ms per chunk before the stop, "
              f"{post * 1000:.2f} ms after (ratio {ratio:.2f}), {len(healthy)} streams; "
              f"the stopped one: {len(victim)} streams, {m.group(2)} aborted by the engine")
        # The stopped server's streams ended after SIGCONT: aborted (a prefix of their
        # text), or whole if they were done before the drop.
        for s in victim:
            assert s.error is None and s.finish_reason in ("abort", "length"), s
        assert any(s.finish_reason == "abort" for s in victim)
        state = wait_until(lambda: (st := _engine_state(url))["client_of"] == 0 and st, 30,
                           "the engine to hold no request")
        assert state["kv_free"] == state["kv_blocks"], state
        assert "reads again" in output(proc)
        # Both API servers serve again.
        served: set[int | None] = set()
        for _ in range(40):
            served.add(_server_of_new_request(url, model, launcher))
            if served >= {0, 1}:
                break
        assert served == {0, 1}, served
        stop(proc)
        assert proc.returncode == 0, output(proc)[-3000:]
    assert all_gone(children, timeout=15), [p for p in children if p.is_running()]
    # Greedy text: the other server's streams whole, the stopped one's a prefix.
    used = [s.prompt for s in healthy + victim]
    expected = dict(zip(used, offline_greedy_texts(model, used, MAX_TOKENS, ignore_eos=True)))
    for s in healthy:
        assert s.text == expected[s.prompt], s.prompt
    for s in victim:
        assert expected[s.prompt].startswith(s.text), s.prompt


def _server_of_new_request(url: str, model: str, launcher: psutil.Process) -> int | None:
    """Which API server answers a fresh short completion (and that it answers)."""
    servers = _api_servers(launcher)
    with httpx.Client(timeout=30, limits=NEW_CONNECTIONS) as client:
        with client.stream("POST", url + "/v1/completions", json={
                "model": model, "prompt": "Hello", "max_tokens": 4, "stream": True}) as resp:
            assert resp.status_code == 200
            _, port = resp.extensions["network_stream"].get_extra_info("client_addr")
            index = _server_of(port, servers)
            resp.read()
    return index


# ---- one engine process, two front-ends played by the test ---------------------------


class FrontEnd:
    """Front-end `index` of one engine, as raw sockets: a ROUTER for requests, a PULL
    for outputs (`rcvhwm`: what its ZMQ takes in while the test does not read)."""

    def __init__(self, ctx: zmq.Context, addrs, index: int, rcvhwm: int = 1000) -> None:
        self.index = index
        self.input = ctx.socket(zmq.ROUTER)
        self.input.bind(addrs.inputs[index])
        self.output = ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, rcvhwm)
        self.output.bind(addrs.outputs[index])
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._calls = iter(range(1_000_000))

    def wait_registered(self, timeout: float = 60) -> None:
        assert self.input.poll(timeout * 1000), f"engine never registered with {self.index}"
        assert self.input.recv_multipart() == [engine_identity(0), b""]

    def _send(self, kind: RequestType, body: object) -> None:
        self.input.send_multipart([engine_identity(0), kind.value,
                                   msgspec.msgpack.encode(body)])

    def add(self, request_id: str, max_tokens: int) -> None:
        self._send(RequestType.ADD, EngineCoreRequest(
            request_id, [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                     ignore_eos=True),
            client_index=self.index))

    def read(self, timeout: float = 60) -> EngineCoreOutputs:
        assert self.output.poll(timeout * 1000), f"front-end {self.index}: no output"
        return self._decoder.decode(self.output.recv())

    def call(self, method: str) -> object:
        """A utility call; outputs of requests read meanwhile go to `self.seen`."""
        call_id = next(self._calls)
        self._send(RequestType.UTILITY, UtilityCall(call_id, method))
        while True:
            msg = self.read()
            if msg.utility_output is not None and msg.utility_output.call_id == call_id:
                return msg.utility_output.result


def _run_to_the_end(front: FrontEnd, ids: set[str]) -> dict[str, tuple[int, FinishReason]]:
    """request id -> (tokens, finish reason), reading until every one finished."""
    tokens = dict.fromkeys(ids, 0)
    done: dict[str, tuple[int, FinishReason]] = {}
    while len(done) < len(ids):
        for out in front.read().outputs:
            tokens[out.request_id] += len(out.new_token_ids)
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], out.finish_reason)
    return done


def test_engine_drops_a_front_end_that_stops_reading(tiny_llama, capfd):
    config = EngineArgs(model=str(tiny_llama), max_model_len=1024, threads_per_engine=1,
                        engine_output_stall_timeout=2,
                        engine_output_backlog="16KiB").create_config()
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(num_clients=2)
    ctx = zmq.Context()
    mgr = None
    try:
        fronts = [FrontEnd(ctx, addrs, 0), FrontEnd(ctx, addrs, 1, rcvhwm=1)]
        mgr = EngineProcManager(config, addrs.handshake, num_engines=1)
        mgr.wait_for_startup(addrs.init_metadata(), timeout=120)
        for front in fronts:
            front.wait_registered()
        # 1. Long requests from both; front-end 1 reads nothing.
        for i in range(4):
            fronts[1].add(f"b{i}", 1000)
            fronts[0].add(f"a{i}", 1000)
        assert _run_to_the_end(fronts[0], {f"a{i}" for i in range(4)}) == {
            f"a{i}": (1000, FinishReason.LENGTH) for i in range(4)}
        sizes = fronts[0].call("request_state_sizes")
        assert sizes["dropped_clients"] == 1, sizes
        assert (sizes["client_of"], sizes["kv_free"]) == (0, sizes["kv_blocks"]), sizes
        log = wait_until(lambda: capfd.readouterr().err, 10, "the engine's log")
        assert "engine 0: dropped front-end 1: its backlog of unread outputs passed 16384 " \
            "bytes (--engine-output-backlog); aborting its 4 request(s)" in log, log
        # 2. Dropped: what it sends now is not run.
        fronts[1].add("b-late", 1000)
        wait_until(lambda: "rejected request b-late: front-end 1 was dropped"
                   in capfd.readouterr().err, 30, "the engine to reject b-late")
        # 3. It reads again: what ZMQ held for it, then one notice, then nothing of them.
        stale: list[str] = []
        while not (msg := fronts[1].read()).outputs or not msg.outputs[0].finished:
            stale += [o.request_id for o in msg.outputs if not o.finished]
        assert set(stale) <= {f"b{i}" for i in range(4)} and stale, stale
        assert sorted((o.request_id, o.finish_reason, o.new_token_ids) for o in msg.outputs) \
            == [(rid, FinishReason.ABORT, []) for rid in ("b-late", "b0", "b1", "b2", "b3")]
        # 4. Served as before (and nothing more of the dropped requests came).
        fronts[1].add("b-new", 8)
        seen = []
        while not (msg := fronts[1].read()).outputs or not msg.outputs[-1].finished:
            seen += [o.request_id for o in msg.outputs]
        assert set(seen + [o.request_id for o in msg.outputs]) == {"b-new"}
        assert msg.outputs[-1].finish_reason == FinishReason.LENGTH
    finally:
        if mgr is not None:
            mgr.close()
        ctx.destroy(linger=0)
        alloc.cleanup()
