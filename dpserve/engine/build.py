"""What an engine process sets up before it serves: the device or the CPU cores it
runs on, its `EngineCore`, and (tests only) faults injected into its forward.

Scope: called by `EngineCoreProc` (`dpserve.engine.process`) once the launcher's
init metadata has come, in the engine process itself; nothing here talks to
another process.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpserve import tracing
from dpserve.config import EngineConfig
from dpserve.engine.tp_worker import bind_cpus, worker_cpus, worker_device

if TYPE_CHECKING:
    from dpserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

# Test-only fault injection: the engine's N-th model execution raises, or hangs, or
# every one first sleeps S seconds (a slow forward: work that outlasts a deadline on
# any machine); optionally only on one rank (see `_maybe_inject_forward_fault`).
FAULT_FORWARD_ENV = "DPSERVE_FAULT_FORWARD_AT"
FAULT_HANG_ENV = "DPSERVE_FAULT_FORWARD_HANG_AT"
FAULT_DELAY_ENV = "DPSERVE_FAULT_FORWARD_DELAY_S"
FAULT_RANK_ENV = "DPSERVE_FAULT_RANK"
# Test-only: "RANK:PATH": that rank's first process waits until PATH exists before it
# loads its model (at most HOLD_START_LIMIT_S), so a test holds it in STARTING.
FAULT_HOLD_START_ENV = "DPSERVE_FAULT_HOLD_START"
HOLD_START_LIMIT_S = 300.0


def place_engine(config: EngineConfig, rank: int) -> None:
    """Put this engine on its CUDA device, or bind it to its CPU cores."""
    _choose_device(config, rank)
    _bind_cpus(config, rank)


def _choose_device(config: EngineConfig, rank: int) -> None:
    """CUDA: the engine of local rank r (r-th on this host) uses visible device r,
    or, with N tensor-parallel workers, device r*N (its workers r*N+1 .. r*N+N-1:
    `worker_device`).

    Under Ray each actor sees only its own GPU, so that is device 0.
    """
    if config.device != "cuda":
        return
    import torch

    index = worker_device(config, rank, 0)
    torch.cuda.set_device(index)
    logger.info("engine %d: CUDA device %d", rank, index)


def _bind_cpus(config: EngineConfig, rank: int) -> None:
    """CPU: keep this engine on the cores of its local rank (`ParallelConfig.cpu_groups`;
    with tensor parallelism, worker 0's slice of them); a rank added by scaling
    beyond them stays unbound."""
    cores = worker_cpus(config, rank, 0)
    if cores is None:
        if config.parallel.cpu_groups:
            logger.info("engine %d: no core list for its local rank; not bound", rank)
        return
    if bind_cpus(cores, f"engine {rank}") and config.parallel.threads_per_engine is None:
        import torch

        torch.set_num_threads(len(cores))


def build_engine_core(config: EngineConfig, rank: int, incarnation: int,
                      on_failure: Callable[[str], None] | None = None) -> EngineCore:
    """The EngineCore of `rank` (its model loaded, its KV cache sized), with the
    test-only forward faults the environment asks for. `on_failure(reason)`: called
    (from another thread) when a tensor-parallel worker of the rank dies."""
    from dpserve.engine.core import EngineCore

    tracing.install(config.tracing, "engine", rank)  # flushed by EngineCore.shutdown
    _maybe_hold_start(rank, incarnation)
    engine_core = EngineCore(config, dp_rank=rank)
    engine_core.executor.on_failure = on_failure
    _maybe_inject_forward_fault(engine_core, rank, incarnation)
    return engine_core


def _maybe_hold_start(rank: int, incarnation: int) -> None:
    """TEST-ONLY: with DPSERVE_FAULT_HOLD_START=r:PATH, rank r's first process waits
    until PATH exists (a test creates it once its check is done), at most
    HOLD_START_LIMIT_S; restarts and other ranks start at once."""
    spec = os.environ.get(FAULT_HOLD_START_ENV)
    if not spec:
        return
    held, _, path = spec.partition(":")
    if int(held) != rank or incarnation > 0:
        return
    logger.warning("TEST-ONLY: rank %d holds its start until %s exists (%s)", rank, path,
                   FAULT_HOLD_START_ENV)
    deadline = time.monotonic() + HOLD_START_LIMIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _maybe_inject_forward_fault(engine_core: EngineCore, rank: int, incarnation: int) -> None:
    """TEST-ONLY fault injection, from the environment: the N-th call of
    `executor.execute` raises RuntimeError (DPSERVE_FAULT_FORWARD_AT=N) or never
    returns (DPSERVE_FAULT_FORWARD_HANG_AT=N); every call first sleeps S seconds
    (DPSERVE_FAULT_FORWARD_DELAY_S=S). With DPSERVE_FAULT_RANK=r only rank r's
    first process is affected (its restarts run clean)."""
    raise_at, hang_at = (int(os.environ.get(name) or 0) for name in
                         (FAULT_FORWARD_ENV, FAULT_HANG_ENV))
    delay = float(os.environ.get(FAULT_DELAY_ENV) or 0)
    only_rank = os.environ.get(FAULT_RANK_ENV)
    if not (raise_at or hang_at or delay) or (only_rank is not None and
                                              (int(only_rank) != rank or incarnation > 0)):
        return
    execute = engine_core.executor.execute
    calls = itertools.count(1)

    def execute_with_fault(scheduler_output: Any) -> Any:
        call = next(calls)
        if call == raise_at:
            raise RuntimeError(f"injected fault: forward #{raise_at} ({FAULT_FORWARD_ENV})")
        if call == hang_at:
            logger.warning("TEST-ONLY: forward #%d hangs (%s)", hang_at, FAULT_HANG_ENV)
            while True:
                time.sleep(3600)
        if delay:
            time.sleep(delay)
        return execute(scheduler_output)

    engine_core.executor.execute = execute_with_fault  # type: ignore[method-assign]
    if raise_at or hang_at:
        logger.warning("TEST-ONLY fault injection: forward #%d will %s", raise_at or hang_at,
                       "raise" if raise_at else "hang")
    if delay:
        logger.warning("TEST-ONLY fault injection: every forward sleeps %g s first (%s)",
                       delay, FAULT_DELAY_ENV)
