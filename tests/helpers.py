"""Shared test helpers: start and stop `dpserve serve` processes, wait for them,
read their metrics, greedy references from one in-process engine, and GGUF
files written from tiny checkpoints as llama.cpp's converter writes them.

Imported by test modules as `from helpers import ...`: pytest (its default
"prepend" import mode) puts tests/ on sys.path for conftest.py, and each test's own
folder for the test. So a test module may import a neighbour in its own folder
(`from test_scheduler import ...`), never one in another folder: what two folders
share lives here, in tests/ (helpers, fakes, bench_smoke, the *_checks modules)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import psutil
import zmq

from dpserve.launch.addresses import pick_port
from dpserve.launch.coordinator import DPCoordinator
from dpserve.protocol import (
    COORDINATOR_READY,
    CoordinatorUpdate,
    EngineReport,
    RequestType,
    ScaleEngines,
    StartDPWave,
    WakeEngines,
)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that no process binding port 0 can take before
    the test binds it (dpserve's own choice: below the ephemeral range)."""
    return pick_port(host)


@contextmanager
def serve_app(app: Any, stop_first: Callable[[], None] | None = None
              ) -> Iterator[tuple[str, asyncio.AbstractEventLoop]]:
    """uvicorn serving an ASGI `app` in this process, on a thread with its own event
    loop, at a free 127.0.0.1 port: (its URL, that loop). On exit `stop_first()` runs
    (e.g. the engine's shutdown, which ends open streams), then uvicorn stops."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 60, "uvicorn to start")
        assert thread.is_alive(), "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", loop
    finally:
        if stop_first is not None:
            stop_first()
        server.should_exit = True
        thread.join(15)
        loop.close()
        sock.close()


def launch(model: str, *extra: str, env: dict[str, str] | None = None,
           host: str = "127.0.0.1", new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """Start `dpserve serve` on a free port without waiting for it; (process, base_url).

    The server's output goes to a temporary file (`proc.log`): `output(proc)` reads
    it. With `new_session` it leads a process group of its own, as a shell's
    foreground job (Ctrl-C signals the whole group: `os.killpg(proc.pid, SIGINT)`).
    """
    port = free_port(host)
    log = tempfile.NamedTemporaryFile("w+", prefix="dpserve-serve-", suffix=".log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpserve.cli", "serve", model, "--host", host, "--port",
         str(port), *extra],
        env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, text=True,
        start_new_session=new_session)
    proc.log = log  # type: ignore[attr-defined]
    return proc, f"http://{host}:{port}"


@contextmanager
def serve(model: str, *extra: str, env: dict[str, str] | None = None, timeout: float = 120,
          host: str = "127.0.0.1", headers: dict[str, str] | None = None,
          new_session: bool = False):
    """Start `dpserve serve` (see `launch`), wait for /health, yield (process, base_url);
    always clean up."""
    with serve_all([model, *extra], env=env, timeout=timeout, host=host, headers=headers,
                   new_session=new_session) as [(proc, url)]:
        yield proc, url


@contextmanager
def serve_all(*servers: list[str], env: dict[str, str] | list[dict[str, str]] | None = None,
              timeout: float = 120, host: str = "127.0.0.1",
              headers: dict[str, str] | None = None, new_session: bool = False):
    """Several servers at once, each `[model, *options]` as `serve` takes them (`env`:
    one for all, or a list, one per server): all are started before any is waited
    for, so their start-ups overlap (one start-up is a chain of single-threaded
    steps: alone it leaves a core idle). Yields [(process, base_url), ...] in order
    once every one is healthy; stops them all (at once) on exit."""
    envs = env if isinstance(env, list) else [env] * len(servers)
    assert len(envs) == len(servers), "one env per server"
    procs: list[tuple[subprocess.Popen, str]] = []
    try:
        for (model, *extra), server_env in zip(servers, envs):
            procs.append(launch(model, *extra, env=server_env, host=host,
                                new_session=new_session))
        for proc, url in procs:
            wait_healthy(proc, url, timeout, describe=lambda proc=proc: output(proc),
                         headers=headers)
        yield procs
    finally:
        stop_all([proc for proc, _ in procs])
        for proc, _ in procs:
            proc.log.close()  # type: ignore[attr-defined]


@contextmanager
def stopping(server: tuple[subprocess.Popen, str]):
    """One of `serve_all`'s servers, for one test: yields it; stops it when the block
    ends (as `serve` does), so what the test did to it goes no further."""
    proc, _ = server
    try:
        yield server
    finally:
        stop(proc)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, describe=lambda: "",
                 headers: dict[str, str] | None = None) -> None:
    """Poll `url`/health until 200; fail (with `describe()`) if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited early:\n{describe()[-3000:]}"
        assert time.monotonic() < deadline, \
            f"server did not become healthy in time:\n{describe()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=1, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def output(proc: subprocess.Popen) -> str:
    """Everything a process started by `serve` has written so far."""
    with open(proc.log.name) as f:  # type: ignore[attr-defined]
        return f.read()


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM (a drain); if it still runs after `timeout` s, a second SIGTERM (stop
    at once), then SIGKILL; a no-op on a process that has exited."""
    stop_all([proc], timeout)


def stop_all(procs: list[subprocess.Popen], timeout: float = 10) -> None:
    """`stop` for several processes at once: each step goes to every one still running,
    then waits (`timeout` s at most) for them all."""
    for signal_it in (subprocess.Popen.terminate, subprocess.Popen.terminate,
                      subprocess.Popen.kill):
        running = [p for p in procs if p.poll() is None]
        if not running:
            return
        for p in running:
            signal_it(p)
        deadline = time.monotonic() + timeout
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def all_gone(procs: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


def process_names(procs: list[psutil.Process]) -> set[str]:
    """The dpserve names (prefix dropped) of the processes still running."""
    names = set()
    for p in procs:
        try:
            names.add(p.name().removeprefix("dpserve::"))
        except psutil.NoSuchProcess:
            pass
    return names


def wait_until(check: Callable[[], object], timeout: float, what: str = "condition",
               interval: float = 0.05):
    """Poll `check()` until truthy (returned) or fail after `timeout` s, naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """The sum of every sample of `name` (a prefix of the sample line) in /metrics."""
    text = httpx.get(url + "/metrics", timeout=5, headers=headers).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    assert values, f"metric {name} missing"
    return sum(values)


def finished_by_engine(url: str) -> dict[int, float]:
    """engine rank -> requests it finished (dpserve:engine_requests_finished)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    pattern = re.compile(r'^dpserve:engine_requests_finished_total\{(.*)\} (\S+)$')
    counts: dict[int, float] = {}
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            engine = int(re.search(r'engine="(\d+)"', m.group(1)).group(1))
            counts[engine] = counts.get(engine, 0.0) + float(m.group(2))
    return counts


def finished_by_engine_and_api_server(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """(engine -> requests finished, API server -> requests finished), all API servers'
    (one scrape: dpserve:engine_requests_finished, dpserve:api_server_requests_finished)."""
    text = httpx.get(url + "/metrics", headers={"Connection": "close"}, timeout=10).text

    def counts(metric: str, label: str) -> dict[str, float]:
        found: dict[str, float] = {}
        for key, value in re.findall(rf'^{metric}_total{{[^}}]*{label}="(\d+)"[^}}]*}} (\S+)$',
                                     text, re.M):
            found[key] = found.get(key, 0.0) + float(value)
        return found

    return (counts("dpserve:engine_requests_finished", "engine"),
            counts("dpserve:api_server_requests_finished", "api_server"))


async def complete_all(url: str, model: str, prompts: list[str], *, max_tokens: int,
                       concurrency: int = 16, rank: int | None = None,
                       headers: dict[str, str] | None = None) -> list[str]:
    """Greedy completions of `prompts` over HTTP, `concurrency` at a time."""
    headers = dict(headers or {})
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        async with limit:
            resp = await client.post(url + "/v1/completions", headers=headers, json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0})
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def offline_greedy_texts(model: str, prompts: list[str], max_tokens: int,
                         **params) -> list[str]:
    """Greedy completions from one in-process engine on one thread, as each DP engine runs.

    Computed once per test session for the same model directory, prompts and
    parameters (greedy: the same texts every time); each caller gets its own list."""
    key = (model, tuple(prompts), max_tokens, tuple(sorted(params.items())))
    if key not in _OFFLINE_GREEDY:
        _OFFLINE_GREEDY[key] = _offline_greedy_texts(model, prompts, max_tokens, **params)
    return list(_OFFLINE_GREEDY[key])


_OFFLINE_GREEDY: dict[tuple, list[str]] = {}


def _offline_greedy_texts(model: str, prompts: list[str], max_tokens: int,
                          **params) -> list[str]:
    import torch

    from dpserve import LLM, SamplingParams

    threads = torch.get_num_threads()
    try:  # the engines run one thread each: the same arithmetic
        return [o.outputs[0].text for o in LLM(model, threads_per_engine=1).generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
            use_tqdm=False)]
    finally:
        torch.set_num_threads(threads)


def nonblank_stop_string(text: str, length: int) -> str:
    """`length` characters of `text` from its middle on, starting at a non-blank one
    (a stop string that cannot be all whitespace); fails if there is none."""
    starts = [i for i in range(len(text) // 2, len(text) - length + 1)
              if not text[i].isspace()]
    assert starts, f"no non-blank stop string of {length} characters in {text!r}"
    return text[starts[0]: starts[0] + length]


# ---- several hosts, played on one machine ---------------------------------------------

MULTIHOST_ARGS = ("--threads-per-engine", "1", "--max-model-len", "256", "--num-kv-blocks", "64")


def start_background(model: str, *args: str) -> tuple[subprocess.Popen,
                                                        tempfile._TemporaryFileWrapper]:
    """`dpserve serve` in the background (no health wait), output to a temp file."""
    log = tempfile.NamedTemporaryFile("w+", prefix="dpserve-node-", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "dpserve.cli", "serve", model, *args],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, log


def read_log(log) -> str:
    with open(log.name) as f:
        return f.read()


def dp_args(size: int, rpc_port: int, *extra: str) -> list[str]:
    """The options of one host of a DP group whose head is 127.0.0.1:`rpc_port`."""
    return ["--data-parallel-size", str(size), "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc_port), *MULTIHOST_ARGS, *extra]


# ---- faults: one DP=2 server, streams, a fault in the middle ---------------------------

FAULT_PROMPTS = [f"Once upon a time {i}" for i in range(32)]
FAULT_TOKENS = 128
# For a server whose rank a fault hits mid-stream: 4 sequences at a time, so each rank
# holds its share of the fault streams (running and waiting) for several of the API
# server's round trips to it (`streams_with_fault(on_rank=)`), not for one or two.
FAULT_SEQS = ("--max-num-seqs", "4")


def proc_named(children: list[psutil.Process], name: str) -> psutil.Process:
    found = [p for p in children if p.is_running() and p.name() == f"dpserve::{name}"]
    assert len(found) == 1, [p.name() for p in children]
    return found[0]


def rank_health(url: str, rank: int | None = None) -> httpx.Response:
    return httpx.get(url + "/health", params={} if rank is None else {"rank": rank}, timeout=5)


def wait_rank(url: str, rank: int, predicate, timeout: float = 60.0) -> dict:
    """Poll /health?rank= until `predicate(rank's entry)`; that entry."""
    deadline = time.monotonic() + timeout
    while True:
        entry = rank_health(url, rank).json()["ranks"][0]
        if predicate(entry):
            return entry
        assert time.monotonic() < deadline, f"rank {rank} never got there: {entry}"
        time.sleep(0.1)


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{.*}})? (\S+)$",
                                                      text, re.M))


# A fault test proves its premise from the engine side, and fails loudly when it did
# not hold: the API server can stream far behind the engines, so "every client stream
# has begun" does not mean the faulted rank still holds any of them.
MIGRATIONS = "dpserve:request_migrations_total"
RETRIES = "dpserve:request_retries_total"


def held_by(url: str, rank: int) -> int:
    """Requests rank `rank`'s engine holds now (its routing map, asked of the engine
    itself through /debug/request_state)."""
    state = httpx.get(url + "/debug/request_state", timeout=15).json()
    return state["engines"][str(rank)]["client_of"]


def premise_held(url: str, rank: int, fault: str) -> int:
    """Assert rank `rank` holds requests right before `fault` hits it; how many."""
    held = held_by(url, rank)
    print(f"premise: rank {rank} held {held} requests when the {fault} came")
    assert held > 0, (f"premise did not hold: rank {rank} held no request when the {fault} "
                      "came (its engine had finished them), so the test would prove nothing")
    return held


def premise_moved(url: str, before: float, what: str, retries: bool = False) -> float:
    """Assert `dpserve:request_migrations_total` rose past `before` (a request moved
    mid-stream to another rank, as `what` claims); the count now. `retries`: requests
    re-sent before their API server had any of their tokens count too (a frozen rank's
    running requests: on a loaded machine the API server may not have read a token of
    theirs when the rank stops, though the engine ran them)."""
    names = (MIGRATIONS, RETRIES) if retries else (MIGRATIONS,)
    now = sum(metric_sum(url, name) for name in names)
    assert now > before, (f"premise did not hold: {what}, but no request moved "
                          f"({' + '.join(names)} stayed at {before:g})")
    return now


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                  chunks: list[int], index: int, rank: int | None = None,
                  max_tokens: int = FAULT_TOKENS) -> str:
    """One greedy completion, streamed; counts its chunks in `chunks[index]`."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    text = []
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                chunks[index] += 1
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


async def streams_with_fault(url: str, model: str, fault, prompts=FAULT_PROMPTS,
                             max_tokens: int = FAULT_TOKENS,
                             on_rank: int | None = None, also=None) -> list[str]:
    """Stream every prompt at once; call `fault()` once every stream has begun (its
    first chunk came). With `on_rank`, at once when rank `on_rank`'s engine has run
    requests over two of its steps in a row (asked of the engine: its requests have
    tokens, so the fault finds them mid-stream there; the premise, printed, and a
    loud failure when it never came), whatever the client has seen: the API server
    can stream far behind the engines (on a loaded machine the engines had finished
    every stream before its first chunks came), and one rank can finish its share
    before another's streams have begun. `also` (a callable, with `on_rank`) is one
    more condition the engine side must meet first (say, a handoff happened). Without
    `on_rank` a fault test checks the premise itself (`premise_held`)."""
    chunks = [0] * len(prompts)
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(stream_completion(client, url, model, p, chunks, i,
                                                             max_tokens=max_tokens))
                 for i, p in enumerate(prompts)]
        deadline, runs = time.monotonic() + 60, 0
        while on_rank is None and min(chunks) < 1 or on_rank is not None and runs < 2:
            assert time.monotonic() < deadline, (
                f"premise did not hold: no moment for the fault in 60 s (chunks {chunks}, "
                f"rank {on_rank} running over {runs} steps in a row)")
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            assert not failed, f"a stream failed before the fault: {failed[0].exception()!r}"
            ended = [t for t in tasks if t.done()]
            assert on_rank is not None or not ended, f"a stream ended before the fault: {chunks}"
            if on_rank is not None:
                running = await asyncio.to_thread(running_on, url, on_rank)
                ready = also is None or await asyncio.to_thread(also)
                runs = runs + 1 if running and ready else 0
                continue  # at once: no sleep between the last poll and the fault
            await asyncio.sleep(0.02)
        if on_rank is not None:
            print(f"premise: rank {on_rank} ran {running} requests right before the fault")
        await asyncio.to_thread(fault)
        return await asyncio.gather(*tasks)


def running_on(url: str, rank: int) -> int:
    """Requests rank `rank`'s engine runs now (its scheduler, asked of the engine)."""
    state = httpx.get(url + "/debug/request_state", timeout=15).json()
    return state["engines"][str(rank)]["running"]


async def complete_n(url: str, model: str, n: int, rank: int | None = None) -> list[int]:
    """n short completions at once; their status codes."""
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    async with httpx.AsyncClient(timeout=60) as client:
        resps = await asyncio.gather(*(client.post(url + "/v1/completions", headers=headers,
                                                   json={"model": model, "prompt": f"new {i}",
                                                         "max_tokens": 4})
                                       for i in range(n)))
    return [r.status_code for r in resps]


def expected_greedy(model: str, prompts=FAULT_PROMPTS, max_tokens: int = FAULT_TOKENS
                    ) -> list[str]:
    return offline_greedy_texts(model, prompts, max_tokens=max_tokens, ignore_eos=True)


# ---- scripted peers of a real DP coordinator process --------------------------------

RECV_TIMEOUT_S = 30.0  # generous: a loaded 2-core machine


class ScriptedEngines:
    """N fake engines: a SUB per engine (START_DP_WAVE in), one PUSH for all reports.

    One PUSH keeps the reports of different engines in the order they were sent.
    """

    def __init__(self, ctx: zmq.Context, coord: DPCoordinator, n: int) -> None:
        self.subs = [ctx.socket(zmq.SUB) for _ in range(n)]
        for sub in self.subs:
            self.subscribe(sub, coord)
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(coord.engine_report_address)

    @staticmethod
    def subscribe(sub: zmq.Socket, coord: DPCoordinator) -> None:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(coord.engine_publish_address)

    def wait_ready(self) -> None:
        for sub in self.subs:
            assert recv_frames(sub) == [COORDINATOR_READY]

    def report(self, **fields: object) -> None:
        self.push.send(msgspec.msgpack.encode(EngineReport(**fields)))

    def recv_start_wave(self, engine: int = 0) -> StartDPWave:
        tag, body = recv_frames(self.subs[engine])
        assert tag == RequestType.START_DP_WAVE.value
        return msgspec.msgpack.decode(body, type=StartDPWave)


class FakeFrontend:
    """An XSUB: receives CoordinatorUpdate, sends WakeEngines / ScaleEngines."""

    def __init__(self, ctx: zmq.Context, coord: DPCoordinator) -> None:
        self.sock = ctx.socket(zmq.XSUB)
        self.sock.connect(coord.front_publish_address)
        self.sock.send(b"\x01")  # subscribe to everything
        self.decoder = msgspec.msgpack.Decoder(CoordinatorUpdate)

    def send(self, request: WakeEngines | ScaleEngines) -> None:
        self.sock.send(msgspec.msgpack.encode(request))

    def recv(self, timeout: float = RECV_TIMEOUT_S) -> CoordinatorUpdate:
        return self.decoder.decode(recv_frames(self.sock, timeout)[0])

    def wait_for(self, pred: Callable[[CoordinatorUpdate], bool],
                 timeout: float = RECV_TIMEOUT_S) -> CoordinatorUpdate:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "no matching update from the coordinator in time"
            update = self.recv(left)
            if pred(update):
                return update


def recv_frames(sock: zmq.Socket, timeout: float = RECV_TIMEOUT_S) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), f"nothing received in {timeout} s"
    return sock.recv_multipart()


def assert_silent(sock: zmq.Socket, seconds: float) -> None:
    assert not sock.poll(int(seconds * 1000)), f"unexpected message: {sock.recv_multipart()}"
