"""`--api-server-count M > 1`: the launcher serves through M API-server processes.

Scope: `run_api_servers` starts the M processes (`APIServerProcManager`),
waits for all of them to be ready (watching the engines meanwhile), puts this
host's engines under supervision (`EngineLaunch.supervise`), lets the API
servers serve and watches every process until:

    SIGTERM/SIGINT    DRAIN to every API server, wait for them (bounded:
                      --shutdown-timeout + DRAIN_MARGIN_S): 0; a second signal:
                      128 + the signal
    an API server     restarted in its place under the failure policy
    exits             (`dpserve.launch.policy`: the others serve on; one that
                      cannot be restarted stops the server: 1)
    engines lost      (the supervisor's `on_fatal`) the server stops: 1

The API servers' Prometheus values live in a private PROMETHEUS_MULTIPROC_DIR,
removed at exit; the API servers are stopped first, while the engines still run.

Not here: the HTTP socket and the options (`dpserve.entrypoints.serve`), the
API server itself (`dpserve.entrypoints.api_server`).
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from dpserve.launch.api_server_pipe import APIServerSpec
from dpserve.launch.api_servers import (
    APIServerProcManager,
    APIServerStartupError,
    APIServerTarget,
)
from dpserve.launch.policy import FailureAction, RestartBudget, decide
from dpserve.launch.watch import StopSignal, wait_drained, watch

if TYPE_CHECKING:
    from dpserve.config import EngineConfig
    from dpserve.launch.host import EngineLaunch

logger = logging.getLogger("dpserve.serve")


def run_api_servers(target: APIServerTarget, shared: Mapping[str, Any], config: EngineConfig,
                    specs: Sequence[APIServerSpec], sock: socket.socket,
                    launch: EngineLaunch, on_serving: Callable[[], None]) -> int:
    """Start the API-server processes (`target`, with `shared` arguments each), then
    watch every process; `on_serving()` once they serve.

    Returns 0 after a drain (SIGTERM/SIGINT), 128 + the signal after a second one,
    1 when any process died.
    """
    metrics_dir = tempfile.mkdtemp(prefix="dpserve-metrics-")
    api: APIServerProcManager | None = None
    stop: StopSignal | None = None
    try:
        api = APIServerProcManager(target, specs, sock, metrics_dir, shared)
        api.wait_for_startup(also_watch=launch.processes)
        stop = StopSignal()
        launch.supervise(config, on_status=api.broadcast_rank_status,
                         on_fatal=stop.engine_died, stopping=lambda: stop.signum is not None)
        api.start_serving()
        on_serving()
        return _watch_serving(api, stop, config, launch)
    finally:
        if api is not None:
            api.close()  # API servers first: they drain while the engines still run
        if stop is not None:
            stop.restore()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _watch_serving(api: APIServerProcManager, stop: StopSignal, config: EngineConfig,
                   launch: EngineLaunch) -> int:
    """Until a signal (drain) or a death that stops the server; the exit code."""
    budget = RestartBudget(config.parallel.max_engine_restarts)  # per API server
    while True:
        exited = watch(stop, api.processes, api)
        if stop.signum is not None:
            return _drain(api, stop, config.shutdown_timeout, launch)
        reason = stop.death or "; ".join(
            f"process {p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in exited)
        if stop.death is not None or not _restart(api, exited, config, budget):
            logger.error("%s; stopping the server", reason)
            api.stop_after_death(reason)
            return 1


def _drain(api: APIServerProcManager, stop: StopSignal, timeout: float,
           launch: EngineLaunch) -> int:
    logger.info("signal %d: draining the API servers (up to %g s)", stop.signum, timeout)
    api.request_drain()
    code, why = wait_drained(stop, api.processes, launch.processes, timeout, api)
    if code != 0:
        api.stop_after_death(why)  # fail what is left, then stop them
    return code


def _restart(api: APIServerProcManager, exited: list[BaseProcess], config: EngineConfig,
             budget: RestartBudget) -> bool:
    """Restart API servers that died (the others serve on meanwhile); False when the
    policy says stop (stop, or the restart limit reached) or one does not start."""
    policy = config.parallel.engine_failure_policy
    for proc in exited:
        what = f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        index = api.processes.index(proc)
        if decide(policy, budget, index, can_isolate=False).action is FailureAction.STOP:
            return False
        logger.warning("%s; restarting it (the other API servers serve on)", what)
        try:
            api.restart(proc)
        except APIServerStartupError as e:
            logger.error("%s could not be restarted: %s", proc.name, e)
            return False
    return True
