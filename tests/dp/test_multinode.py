"""Several hosts, played on one machine: 127.0.0.1 is the head, 127.0.0.2 the
other host (Linux routes all of 127/8 to loopback). Real `dpserve serve`
processes: a head with one local engine plus a headless host with the other;
external load balancing (one server per rank, waves still in step); hybrid
load balancing (each host balances over its own engines)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import psutil
import pytest
from helpers import (
    MULTIHOST_ARGS,
    all_gone,
    complete_all,
    descendants,
    dp_args,
    finished_by_engine,
    free_port,
    offline_greedy_texts,
    premise_held,
    premise_moved,
    read_log,
    serve,
    start_background,
    stop,
    wait_healthy,
    wait_until,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]

def _wave(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(r"^dpserve:dp_wave (\S+)$", text, re.M)
    assert m, "no dpserve:dp_wave in /metrics"
    return float(m.group(1))


def test_head_and_headless_host(tiny_llama):
    """Each rank split over 2 tensor-parallel workers (TP=1 headless hosts: the
    other tests here): each host runs its rank's whole TP group."""
    model, rpc, tp = str(tiny_llama), free_port(), 2
    tp_args = ("--tensor-parallel-size", str(tp))
    headless, log = start_background(model, "--headless", "--data-parallel-size-local", "1",
                           "--data-parallel-start-rank", "1", *dp_args(2, rpc), *tp_args)
    try:
        with serve(model, "--data-parallel-size-local", "1", *dp_args(2, rpc),
                   *tp_args) as (head, url):
            children = descendants(head.pid) + descendants(headless.pid)
            for host, rank in ((head, 0), (headless, 1)):  # each host's own group
                workers = [p.name() for p in descendants(host.pid) if "TPWorker" in p.name()]
                assert workers == [f"dpserve::TPWorker_{rank}_{t}" for t in range(1, tp)]
            asyncio.run(complete_all(url, model, [f"p{i}" for i in range(24)],
                                      max_tokens=4))
            served = finished_by_engine(url)
            assert served.get(0, 0) > 0 and served.get(1, 0) > 0, served
            assert headless.poll() is None
            head.send_signal(signal.SIGTERM)
            assert head.wait(15) is not None
        # Stopping the head stops the headless host's engine, then the host itself.
        assert headless.wait(20) is not None, read_log(log)[-2000:]
        assert all_gone(children, timeout=10), [p for p in children if p.is_running()]
    finally:
        stop(headless, 15)
        log.close()


def test_headless_host_restarts_a_killed_engine(tiny_llama):
    """A headless host's engine SIGKILLed mid-run: its streams move to the head's rank
    (heartbeats stop), the host starts a new process that handshakes with the head
    again, and the head routes to it once its heartbeats say so."""
    model, rpc = str(tiny_llama), free_port()
    headless, log = start_background(model, "--headless", "--data-parallel-size-local", "1",
                                     "--data-parallel-start-rank", "1", *dp_args(2, rpc))
    try:
        with serve(model, "--data-parallel-size-local", "1", *dp_args(2, rpc)) as (head, url):
            victim = next(p for p in descendants(headless.pid)
                          if p.name() == "dpserve::EngineCore_1")
            prompts = [f"story {i}" for i in range(12)]
            expected = offline_greedy_texts(model, prompts, max_tokens=120, ignore_eos=True)

            async def streams() -> list[str]:
                async with httpx.AsyncClient(timeout=120) as client:
                    async def one(prompt: str) -> str:
                        text = []
                        async with client.stream("POST", url + "/v1/completions", json={
                                "model": model, "prompt": prompt, "max_tokens": 120,
                                "temperature": 0, "stream": True,
                                "ignore_eos": True}) as resp:
                            async for line in resp.aiter_lines():
                                if line.startswith("data: {"):
                                    text.append(json.loads(line[6:])["choices"][0]["text"])
                                    if len(text) == 5 and prompt == prompts[0]:
                                        premise_held(url, 1, "SIGKILL")
                                        victim.send_signal(signal.SIGKILL)
                        return "".join(text)

                    return await asyncio.gather(*(one(p) for p in prompts))

            assert asyncio.run(streams()) == expected
            assert not victim.is_running()
            premise_moved(url, 0, "rank 1 was killed holding streams")

            def rank1() -> dict:
                return httpx.get(url + "/health", params={"rank": 1}, timeout=5).json()[
                    "ranks"][0]

            wait_until(lambda: rank1()["state"] == "serving" and rank1()["incarnation"] == 1,
                       timeout=90, what="rank 1 back as a new process")
            before = finished_by_engine(url).get(1, 0)
            asyncio.run(complete_all(url, model, ["a", "b", "c"], max_tokens=4, rank=1))
            assert finished_by_engine(url).get(1, 0) - before == 3
            assert "restarting it (incarnation 1)" in read_log(log)
    finally:
        stop(headless, 15)
        log.close()


def test_headless_host_without_a_head_fails_clearly(tiny_llama):
    rpc = free_port()  # nobody listens there
    # One restart of the engine that found no head (the default allows 5, each a new
    # engine process and another 3 s wait), then the host gives up.
    proc, log = start_background(str(tiny_llama), "--headless", "--data-parallel-size-local", "1",
                       "--data-parallel-start-rank", "1", "--engine-ready-timeout", "3",
                       "--max-engine-restarts", "1", *dp_args(2, rpc))
    try:
        code = proc.wait(90)  # bounded: the 3 s waits, start-up on a loaded machine
        out = read_log(log)
        assert code != 0
        assert f"tcp://127.0.0.1:{rpc}" in out and "within 3 s" in out, out[-2000:]
        assert "Traceback" not in out.splitlines()[-1]
    finally:
        stop(proc, 15)
        log.close()


def test_external_lb_one_server_per_rank_waves_in_step(tiny_llama):
    model, rpc = str(tiny_llama), free_port()
    ports = [free_port(), free_port()]
    hosts = ["127.0.0.1", "127.0.0.2"]
    with ExitStack() as stack:
        procs = []
        for rank in (0, 1):
            proc, log = start_background(model, "--host", hosts[rank], "--port", str(ports[rank]),
                               "--data-parallel-rank", str(rank),
                               "--data-parallel-lockstep", "--data-parallel-sync-interval", "4",
                               *dp_args(2, rpc))
            stack.callback(log.close)
            stack.callback(stop, proc, 15)
            procs.append((proc, log))
        urls = [f"http://{h}:{p}" for h, p in zip(hosts, ports)]
        for (proc, log), url in zip(procs, urls):
            wait_healthy(proc, url, timeout=120, describe=lambda log=log: read_log(log))
        # Each server fronts its own rank only.
        for rank, url in enumerate(urls):
            asyncio.run(complete_all(url, model, ["a", "b", "c"], max_tokens=3))
            assert set(finished_by_engine(url)) == {rank}
            other = 1 - rank
            resp = httpx.post(url + "/v1/completions", headers={
                "X-data-parallel-rank": str(other)}, json={"model": model, "prompt": "x",
                                                           "max_tokens": 2})
            assert resp.status_code == 400
        # Waves stay in step: work sent to rank 0 alone still moves both servers'
        # view of the wave (rank 1 ran dummy batches in it).
        start_wave = _wave(urls[1])
        asyncio.run(complete_all(urls[0], model, ["d", "e"], max_tokens=3))
        deadline = time.monotonic() + 15
        while not (_wave(urls[0]) == _wave(urls[1]) > start_wave):
            assert time.monotonic() < deadline, (_wave(urls[0]), _wave(urls[1]))
            time.sleep(0.1)
        children = [c for proc, _ in procs for c in descendants(proc.pid)]
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, log in procs:
            assert proc.wait(20) is not None, read_log(log)[-2000:]
        assert all_gone(children, timeout=10)


def test_hybrid_lb_each_host_balances_over_its_engines(tiny_llama):
    model, rpc = str(tiny_llama), free_port()
    ports = [free_port(), free_port()]
    layout = [("127.0.0.1", "2", "0"), ("127.0.0.2", "1", "2")]  # host, local size, start
    with ExitStack() as stack:
        procs = []
        for (host, local, start), port in zip(layout, ports):
            proc, log = start_background(model, "--host", host, "--port", str(port),
                               "--data-parallel-hybrid-lb", "--data-parallel-size-local",
                               local, "--data-parallel-start-rank", start, *dp_args(3, rpc))
            stack.callback(log.close)
            stack.callback(stop, proc, 15)
            procs.append((proc, log))
        urls = [f"http://{host}:{port}" for (host, _, _), port in zip(layout, ports)]
        for (proc, log), url in zip(procs, urls):
            wait_healthy(proc, url, timeout=180, describe=lambda log=log: read_log(log))
        asyncio.run(complete_all(urls[0], model, [f"q{i}" for i in range(24)],
                                  max_tokens=4))
        asyncio.run(complete_all(urls[1], model, [f"r{i}" for i in range(6)], max_tokens=4))
        first, second = finished_by_engine(urls[0]), finished_by_engine(urls[1])
        assert set(first) == {0, 1} and min(first.values()) > 0, first
        assert set(second) == {2}, second
        for _, log in procs:  # tcp:// on loopback without a secret: served, with a warning
            assert "has no --data-parallel-secret" in read_log(log)


@pytest.mark.parametrize("args, flag", [
    (("--data-parallel-size", "2", "--data-parallel-rank", "2"), "--data-parallel-rank"),
    (("--data-parallel-size", "2", "--data-parallel-size-local", "3"),
     "--data-parallel-size-local"),
    (("--data-parallel-size", "2", "--data-parallel-start-rank", "1",
      "--data-parallel-size-local", "1"), "--data-parallel-start-rank"),
    (("--headless", "--data-parallel-size", "2", "--data-parallel-hybrid-lb"), "--headless"),
])
def test_bad_multi_host_options_fail_in_one_line(tiny_llama, args, flag):
    out = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                          "--port", str(free_port()), *args], capture_output=True, text=True,
                         timeout=60, env={**os.environ})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], out.stderr


def _listening(procs) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket any of `procs` listens on."""
    out = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        out |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


RIGHT_SECRET = "the right secret, long enough to be accepted"  # 32+ characters
WRONG_SECRET = "a wrong secret, long enough to be accepted too"


def test_secret_head_timeout_and_bind_addresses(tiny_llama):
    """With --data-parallel-secret on both hosts, a head with the DP address 127.0.0.2
    serves through the other host's engine; its sockets listen on the DP address only
    (the HTTP port on --host). A host with the wrong secret never joins: the head gives
    up after its --engine-ready-timeout, saying which rank never said HELLO."""
    model, dp_host = str(tiny_llama), "127.0.0.2"

    def secret_args(rpc: int, secret: str) -> list[str]:
        return ["--data-parallel-size", "2", "--data-parallel-address", dp_host,
                "--data-parallel-rpc-port", str(rpc), "--data-parallel-secret", secret,
                *MULTIHOST_ARGS]

    # The wrong secret: the head times out.
    rpc = free_port(dp_host)
    outsider, out_log = start_background(
        model, "--headless", "--data-parallel-size-local", "1", "--data-parallel-start-rank",
        "1", *secret_args(rpc, WRONG_SECRET))
    head, head_log = start_background(
        model, "--port", str(free_port()), "--data-parallel-size-local", "1",
        "--engine-ready-timeout", "4", *secret_args(rpc, RIGHT_SECRET))
    try:
        assert head.wait(180) == 1, read_log(head_log)[-3000:]
        last = read_log(head_log).strip().splitlines()[-1]
        assert last.startswith("dpserve: error: engine failed to start: engines not ready "
                               "after 4 s") and "rank 1 NEW (no HELLO yet)" in last, last
    finally:
        for proc, log in ((head, head_log), (outsider, out_log)):
            stop(proc, 15)
            log.close()

    # The right secret: it serves, and listens on the DP address only.
    rpc = free_port(dp_host)
    insider, log = start_background(model, "--headless", "--data-parallel-size-local", "1",
                          "--data-parallel-start-rank", "1", *secret_args(rpc, RIGHT_SECRET))
    try:
        with serve(model, "--data-parallel-size-local", "1",
                   *secret_args(rpc, RIGHT_SECRET)) as (head, url):
            asyncio.run(complete_all(url, model, [f"s{i}" for i in range(16)], max_tokens=3))
            served = finished_by_engine(url)
            assert served.get(0, 0) > 0 and served.get(1, 0) > 0, served
            procs = [psutil.Process(head.pid), psutil.Process(insider.pid),
                     *descendants(head.pid), *descendants(insider.pid)]
            listening = _listening(procs)
            http_port = int(url.rsplit(":", 1)[1])
            assert ("127.0.0.1", http_port) in listening
            # (The rpc port's handshake socket is closed once every engine is ready.)
            others = listening - {("127.0.0.1", http_port)}
            assert others and {ip for ip, _ in others} == {dp_host}, listening
    finally:
        stop(insider, 15)
        log.close()
