"""Scaling without a declared ceiling: the ceiling is what the placement holds when the
change comes (`placement.engines_fit`: this host's cores per engine, or its CUDA
devices; Ray's cluster), `--data-parallel-size-max` only lowers it, and a change
beyond it gets a 409 naming what is missing. The resolution of `--enable-elastic-ep`
(on with the admin API, off by default at DP=1: no coordinator), then a real server
started with no ceiling flag, grown 1 -> 2 and shrunk back under streams."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from helpers import (
    FAULT_PROMPTS,
    FAULT_SEQS,
    descendants,
    expected_greedy,
    metric_sum,
    process_names,
    serve,
    streams_with_fault,
    wait_until,
)

from dpserve.config import ConfigError, EngineArgs
from dpserve.engine_config import ParallelConfig
from dpserve.launch.coordinator.autoscale import NO_CEILING, ScaleBook
from dpserve.placement import engines_fit, experts_fit
from dpserve.protocol import ScalePhase, ScaleRequest, ScaleResult
from dpserve.testing.tiny_model import make_tiny_model

CORES = len(os.sched_getaffinity(0))


def _parallel(tiny_llama, **kw: object) -> ParallelConfig:
    return EngineArgs.from_kwargs(model=str(tiny_llama), device="cpu",
                                  **kw).create_config().parallel


def test_elastic_resolution(tiny_llama):
    plain = _parallel(tiny_llama)
    assert not plain.elastic  # the default server: no coordinator, nothing that may join
    asked = _parallel(tiny_llama, enable_elastic_ep=True)
    assert asked.elastic and asked.data_parallel_size_max is None  # the placement's
    assert not asked.data_parallel_lockstep  # a dense model: no DP group for it
    lowered = _parallel(tiny_llama, enable_elastic_ep=True, data_parallel_size_max=3)
    assert lowered.elastic and lowered.data_parallel_size_max == 3
    two = _parallel(tiny_llama, data_parallel_size=2, threads_per_engine=1)
    assert two.elastic and two.data_parallel_size_max is None
    assert not _parallel(tiny_llama, data_parallel_size=2, enable_elastic_ep=False).elastic
    with pytest.raises(ConfigError, match="^enable_elastic_ep: --no-enable-elastic-ep"):
        _parallel(tiny_llama, enable_elastic_ep=False, data_parallel_size_max=2)
    with pytest.raises(ConfigError, match="^enable_elastic_ep: scaling at run time"):
        _parallel(tiny_llama, enable_elastic_ep=True, data_parallel_size=2,
                  data_parallel_hybrid_lb=True)


def test_engines_fit_the_cores_each_gets():
    one = ParallelConfig(data_parallel_size=1, threads_per_engine=1)
    assert engines_fit(one, "cpu", CORES) is None
    assert engines_fit(one, "cpu", CORES + 1) == (
        f"{CORES + 1} engines need {CORES + 1} CPU cores (1 each: --threads-per-engine 1); "
        f"this host has {CORES}")
    tp = ParallelConfig(1, threads_per_engine=None, tensor_parallel_size=2)  # a core each
    assert "2 each: one per tensor-parallel worker" in engines_fit(tp, "cpu", CORES)


def test_expert_parallel_caps_the_engines_at_one_expert_per_worker(tmp_path):
    model = make_tiny_model(tmp_path / "mixtral", "mixtral")  # 8 experts
    config = EngineArgs.from_kwargs(model=str(model), device="cpu", data_parallel_size=2,
                                    threads_per_engine=1,
                                    enable_expert_parallel=True).create_config()
    assert config.parallel.elastic and config.parallel.data_parallel_size_max is None
    assert experts_fit(config, 8) is None
    assert experts_fit(config, 9) == ("9 engines x tensor_parallel_size 1 = 9 expert-"
                                      "parallel workers, but the model has 8 experts (one "
                                      "at least each)")


def test_scale_book_refused_and_no_ceiling():
    book = ScaleBook(size_max=NO_CEILING)
    assert book.on_request(ScaleRequest("a", 1000), size=1, now=0.0) is None  # pending
    book.on_request(ScaleResult("a", False, "no room", refused=True), size=1, now=1.0)
    assert book.status.phase is ScalePhase.REFUSED and book.status.message == "no room"
    low = book.on_request(ScaleRequest("b", 0), size=1, now=2.0)
    assert low.phase is ScalePhase.FAILED and low.message == "new size 0 is below 1"


def _scale(url: str, size: int) -> httpx.Response:
    return httpx.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": size},
                      timeout=300)


def _names(proc) -> set[str]:
    return set(process_names(descendants(proc.pid)))


@pytest.mark.procs
@pytest.mark.slow
def test_no_ceiling_grows_refuses_beyond_the_host_and_shrinks(tiny_llama):
    assert CORES >= 2, "the premise: this host holds two one-thread engines"
    model = str(tiny_llama)
    prompts = FAULT_PROMPTS[:8]
    expected = expected_greedy(model, prompts)
    with serve(model, "--threads-per-engine", "1", "--max-model-len", "256",
               "--enable-admin-api", "--allow-unauthenticated-admin", "--shutdown-timeout",
               "120", *FAULT_SEQS) as (proc, url):
        assert {"EngineCore_0", "DPCoordinator"} <= _names(proc)

        def streams_while(size: int, rank: int) -> tuple[list[str], list[httpx.Response]]:
            done: list[httpx.Response] = []
            texts = asyncio.run(streams_with_fault(
                url, model, lambda: done.append(_scale(url, size)), prompts=prompts,
                on_rank=rank))
            return texts, done

        texts, [up] = streams_while(2, 0)
        assert up.status_code == 200, up.text
        assert up.json()["new_data_parallel_size"] == 2 and texts == expected
        # One engine more than the cores (one thread each) is refused, naming them;
        # nothing starts and the two engines serve on.
        beyond = _scale(url, CORES + 1)
        assert beyond.status_code == 409, beyond.text
        error = beyond.json()["error"]
        assert error["code"] == "insufficient_capacity"
        assert (f"{CORES + 1} engines need {CORES + 1} CPU cores (1 each: "
                f"--threads-per-engine 1); this host has {CORES}") in error["message"]
        assert {n for n in _names(proc) if n.startswith("EngineCore_")} == {
            "EngineCore_0", "EngineCore_1"}
        health = httpx.get(url + "/health", timeout=5).json()
        assert [r["state"] for r in health["ranks"]] == ["serving", "serving"], health

        texts, [down] = streams_while(1, 1)
        assert down.status_code == 200, down.text
        assert down.json()["new_data_parallel_size"] == 1 and texts == expected
        assert metric_sum(url, "dpserve:request_migrations_total") == 0
        wait_until(lambda: "EngineCore_1" not in _names(proc), 30, "EngineCore_1 to exit")
        assert proc.poll() is None
