"""`dpserve serve --kv-offload-memory`: the host's KV store runs beside the engines,
is restarted when it dies, and leaves no process and no shared memory behind.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import psutil
import pytest
from helpers import (
    all_gone,
    descendants,
    dp_args,
    free_port,
    output,
    read_log,
    serve,
    start_background,
    stop,
    wait_until,
)

from dpserve.kv_tier.arena import leftover_arenas

pytestmark = pytest.mark.procs


def kv_stores(pid: int) -> list[psutil.Process]:
    """The server's running dpserve::KVStore processes."""
    found = []
    for p in descendants(pid):
        try:
            if p.name() == "dpserve::KVStore" and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def test_serve_starts_restarts_and_stops_its_kv_store(tiny_llama) -> None:
    with serve(str(tiny_llama), "--kv-offload-memory", "64MiB") as (proc, url):
        [store] = kv_stores(proc.pid)
        [arena] = leftover_arenas(proc.pid)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        store.kill()  # the supervisor starts the next generation, in a new arena
        [new_store] = wait_until(lambda: [p for p in kv_stores(proc.pid) if p.pid != store.pid],
                                 30, "a new KVStore process")
        wait_until(lambda: leftover_arenas(proc.pid) not in ([], [arena]), 30, "its arena")
        assert len(leftover_arenas(proc.pid)) == 1  # the dead store's was unlinked
        assert "restarting the KV store" in output(proc)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        proc.terminate()
        assert proc.wait(60) == 0, output(proc)[-3000:]
    assert all_gone([new_store], 10)
    assert leftover_arenas(proc.pid) == []


def test_kv_offload_memory_without_prefix_caching_is_one_line(tiny_llama) -> None:
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                           "--kv-offload-memory", "64MiB", "--no-enable-prefix-caching"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpserve: error: --kv-offload-memory "
                                                   "needs prefix caching"), proc.stderr


@pytest.mark.slow
def test_every_host_runs_its_own_kv_store(tiny_llama) -> None:
    """A head and a headless host (two hosts played on one machine): each starts its
    own store; the headless host restarts its own; none is left after the head stops
    (which stops the headless host)."""
    model, rpc, tier = str(tiny_llama), free_port(), ("--kv-offload-memory", "16MiB")
    headless, log = start_background(model, "--headless", "--data-parallel-size-local", "1",
                                     "--data-parallel-start-rank", "1", *dp_args(2, rpc),
                                     *tier)
    try:
        with serve(model, "--data-parallel-size-local", "1", *dp_args(2, rpc), *tier) \
                as (head, url):
            [head_store], [remote_store] = kv_stores(head.pid), kv_stores(headless.pid)
            assert len(leftover_arenas(head.pid)) == len(leftover_arenas(headless.pid)) == 1
            remote_store.kill()
            [restarted] = wait_until(lambda: [p for p in kv_stores(headless.pid)
                                              if p.pid != remote_store.pid], 30,
                                     "the headless host's new KVStore")
            assert kv_stores(head.pid) == [head_store]
            head.send_signal(signal.SIGTERM)
            assert head.wait(30) == 0
        assert headless.wait(30) is not None, read_log(log)[-2000:]
        assert all_gone([head_store, restarted], 10)
        assert leftover_arenas(head.pid) == leftover_arenas(headless.pid) == []
    finally:
        stop(headless, 15)
        log.close()
