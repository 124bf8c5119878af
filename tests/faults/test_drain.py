"""Draining a real `dpserve serve` on SIGTERM: streams in flight finish whole,
new requests and /health get 503 with Retry-After, what is left at
--shutdown-timeout ends with finish_reason "abort", the exit code is 0 and no
process is left; a second SIGTERM stops at once. One API server, and two API
servers over two engines (one that has drained answers 503 until both have); a
`--headless` host drains its engine. Tiny random
model; every wait is bounded."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import httpx
import pytest
from drain_checks import Stream, check_drain, run_streams, wait_status
from helpers import (
    all_gone,
    descendants,
    dp_args,
    free_port,
    output,
    read_log,
    serve,
    serve_all,
    start_background,
    stop,
    stopping,
)

# After the rest, one test at a time (make test): the 503 checks race the stream that
# keeps a server draining (slow with another test file beside it).
pytestmark = [pytest.mark.procs, pytest.mark.alone]


# Servers for two tests each, started at once (their start-ups overlap): each test
# still has a server of its own, stopped when it ends (`check_drain` stops it).
@pytest.fixture(scope="module")
def sigterm_servers(tiny_llama):
    model = str(tiny_llama)
    with serve_all([model, "--shutdown-timeout", "120"],
                   [model, "--shutdown-timeout", "120", "--api-server-count", "2",
                    "--data-parallel-size", "2", "--threads-per-engine", "1"]) as servers:
        yield dict(zip(("one", "two"), servers))


@pytest.fixture(scope="module")
def group_servers(tiny_llama):
    """Each leads a process group, as a shell's foreground job: a group signal reaches
    its processes only."""
    with serve_all(*[[str(tiny_llama), "--shutdown-timeout", "120", "--data-parallel-size",
                      "2", "--threads-per-engine", "1"]] * 2, new_session=True) as servers:
        yield dict(zip((signal.SIGINT, signal.SIGTERM), servers))


@pytest.fixture(scope="module")
def one_seq_servers(tiny_llama):
    model = str(tiny_llama)
    with serve_all([model, "--shutdown-timeout", "1", "--max-num-seqs", "1"],
                   [model, "--shutdown-timeout", "600", "--max-num-seqs", "1"]) as servers:
        yield dict(zip(("timeout_1", "timeout_600"), servers))


def test_sigterm_drains_streams_in_flight(sigterm_servers, tiny_llama):
    check_drain(sigterm_servers["one"], str(tiny_llama))


def test_sigterm_drains_two_api_servers_and_two_engines(sigterm_servers, tiny_llama):
    check_drain(sigterm_servers["two"], str(tiny_llama), draining_checks=4, api_servers=2)


def test_ctrl_c_to_the_process_group_drains(group_servers, tiny_llama):
    # Engines and the coordinator get the SIGINT too: they leave the stop to the launcher.
    check_drain(group_servers[signal.SIGINT], str(tiny_llama), group_signal=signal.SIGINT)


def test_sigterm_to_the_process_group_drains(group_servers, tiny_llama):
    # As systemd stops a service: every process gets SIGTERM at once; engines drain
    # their own requests and the coordinator stops, which is no failure then.
    check_drain(group_servers[signal.SIGTERM], str(tiny_llama), group_signal=signal.SIGTERM)


def test_shutdown_timeout_aborts_what_is_left(one_seq_servers, tiny_llama):
    model = str(tiny_llama)
    # One sequence at a time: eight 1000-token streams cannot all finish in 1 s.
    with stopping(one_seq_servers["timeout_1"]) as (proc, url):
        children = descendants(proc.pid)

        async def signal_only(client: httpx.AsyncClient) -> None:
            proc.send_signal(signal.SIGTERM)

        streams = asyncio.run(run_streams(url, model, [1000] * 8, signal_only))
        assert proc.wait(60) == 0, output(proc)[-3000:]
        aborted = [s for s in streams if s.finish_reason == "abort"]
        assert len(aborted) >= 7, streams  # the first may have finished in time
        for s in streams:
            assert s.status == 200 and s.error is None, s
            assert s.finish_reason in ("abort", "length") and s.completion_tokens is not None
            assert (s.finish_reason == "length") == (s.completion_tokens == 1000), s
        assert all_gone(children, timeout=15), [p for p in children if p.is_running()]
        assert "aborting" in output(proc)


def test_second_sigterm_stops_at_once(one_seq_servers, tiny_llama):
    model = str(tiny_llama)
    with stopping(one_seq_servers["timeout_600"]) as (proc, url):
        children = descendants(proc.pid)

        async def signal_twice(client: httpx.AsyncClient) -> None:
            proc.send_signal(signal.SIGTERM)
            await wait_status(client, url, "/health", 503)  # the drain is under way
            proc.send_signal(signal.SIGTERM)

        # Drained, these would run for minutes (8000 steps, one at a time).
        streams = asyncio.run(run_streams(url, model, [1000] * 8, signal_twice))
        assert proc.wait(60) == 128 + signal.SIGTERM, output(proc)[-3000:]
        assert any(s.completion_tokens != 1000 for s in streams), streams
        assert all_gone(children, timeout=15), [p for p in children if p.is_running()]


def test_bad_shutdown_timeout_is_one_line(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                           "--port", str(free_port()), "--shutdown-timeout", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--shutdown-timeout" in lines[0], proc.stderr


def test_headless_host_drains_its_engine(tiny_llama):
    model, rpc = str(tiny_llama), free_port()
    headless, log = start_background(model, "--headless", "--data-parallel-size-local", "1",
                           "--data-parallel-start-rank", "1", *dp_args(2, rpc))
    try:
        with serve(model, "--data-parallel-size-local", "1", *dp_args(2, rpc)) as (head, url):
            children = descendants(headless.pid)

            async def signal_headless(client: httpx.AsyncClient) -> None:
                headless.send_signal(signal.SIGTERM)

            streams = asyncio.run(run_streams(url, model, [200] * 4, signal_headless,
                                               headers={"X-data-parallel-rank": "1"},
                                               first_token=True))
            assert headless.wait(60) == 0, read_log(log)[-3000:]
            assert streams == [Stream(200, 200, "length")] * 4, streams
            assert "engine 1: draining" in read_log(log)
            assert all_gone(children, timeout=15), [p for p in children if p.is_running()]
    finally:
        stop(headless, 15)
        log.close()
