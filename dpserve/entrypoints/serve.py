"""`dpserve serve`: launch the engines and serve them over OpenAI-compatible HTTP.

Processes (N = --data-parallel-size engines, M = --api-server-count API servers):

    M == 1:
    main process  "dpserve::APIServer_0"     launcher + FastAPI/uvicorn
    M > 1:
    main process  "dpserve::Launcher"        launcher only; watches every process
    children      "dpserve::APIServer_<i>"   FastAPI/uvicorn, i < M (entrypoints/api_server.py)
    ------
      |  API server i: ROUTER inputs[i] (bind) / PULL outputs[i] (bind)  (AsyncEngineClient)
      v
    children      "dpserve::EngineCore_<r>"  EngineCoreProc (model + KV cache), r < N
    child (N > 1) "dpserve::DPCoordinator"   engines' load counts -> every API server

The launcher validates the options and binds host:port once, before loading
anything (so a port in use fails at once, and no other process can take it
while the engines load); every API server serves on that one socket. It
resolves the config once, starts the coordinator (N > 1) and then the engines
(their init metadata names the coordinator's and all M API servers'
addresses) and waits for every READY (failing at once, with one line, if any
of them dies). Then, with M == 1, it runs uvicorn itself; with M > 1 it
starts the M API-server processes, waits for all of them to be ready (one
line if any fails), lets them serve and watches every process.

Any engine, the coordinator or an API server dying stops the server with exit
code 1 (in-flight requests fail with a 503 first). SIGTERM or Ctrl-C drain it:
new requests and /health get 503, requests in flight get --shutdown-timeout
seconds to finish, then the rest are aborted (finish_reason "abort"), and the
exit code is 0 (see `dpserve.entrypoints.api_server`). With M == 1 uvicorn's
signal handling does it; with M > 1 the launcher sends DRAIN to every API
server and waits for them (bounded: the timeout plus `DRAIN_MARGIN_S`). A
second signal stops at once (128 + the signal). Engines ignore SIGINT (Ctrl-C
reaches the whole process group; their launcher decides); `--headless` hosts
pass SIGTERM/SIGINT on to their engines as SIGTERM, which drain alike
(`dpserve.engine.process`). Either way every child is shut down (terminate ->
join -> kill tree), API servers first, before the launcher exits. With M > 1 the
API servers' Prometheus values live in a private PROMETHEUS_MULTIPROC_DIR
that the launcher removes at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from dpserve.config import ConfigError, EngineArgs, EngineConfig, ParallelConfig
from dpserve.logging_utils import name_process, scrub_argv
from dpserve.security import warn_plain_tcp
from dpserve.server.auth import add_auth_args
from dpserve.server.extras import add_http_args
from dpserve.server.limits import RequestLimits, add_limit_args
from dpserve.server.log_options import add_log_args

if TYPE_CHECKING:
    from dpserve.entrypoints.api_server import APIServerOptions, APIServerSpec
    from dpserve.launch.api_servers import APIServerProcManager
    from dpserve.launch.engines import EngineProcManager
    from dpserve.launch.host import EngineLaunch
    from dpserve.launch.supervisor import RestartBudget

logger = logging.getLogger("dpserve.serve")

DRAIN_MARGIN_S = 15.0  # beyond --shutdown-timeout: aborts, closing connections, exits


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face directory, .gguf file or hub name "
                             "(default: built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    add_auth_args(parser)
    parser.add_argument("--enable-admin-api", action="store_true",
                        help="Serve the admin routes (/pause, /resume, /sleep, /wake_up, "
                             "/reset_prefix_cache, /scale_elastic_ep, per-rank cordon/uncordon/"
                             "drain/restart), behind the API key; without a key only with "
                             "--allow-unauthenticated-admin on a loopback --host.")
    parser.add_argument("--max-num-queued-requests", type=int, default=None,
                        help="Answer 429 (Retry-After) when every serving engine has this "
                             "many requests waiting (default: no limit).")
    parser.add_argument("--max-num-queued-tokens", type=int, default=None,
                        help="Answer 429 (Retry-After) when every serving engine has this "
                             "many prompt tokens waiting (default: no limit).")
    parser.add_argument("--served-model-name", default=None, nargs="+",
                        help="Model name(s) clients use; the first is reported (default: "
                             "the model argument, or SmolLM2-135M-Instruct).")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Parse tool calls from the output for tool_choice "auto" (with '
                             "--tool-call-parser). \"required\" and named tool choices need "
                             "no flag: the output is constrained to the tools' schema.")
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                        help="How tool calls are written in the model's output: hermes "
                             "(<tool_call>{...}</tool_call>), llama3_json ({\"name\": ..., "
                             "\"parameters\": ...}).")
    parser.add_argument("--engine-ready-timeout", type=float, default=600.0,
                        help="Seconds to wait for the engines to load the model.")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                        help="Larger request bodies (on any route) get HTTP 413.")
    parser.add_argument("--load-balance", default="least-loaded",
                        choices=["least-loaded", "round-robin", "cache-aware"],
                        help="How the API server places requests on engines: the lowest "
                             "4*waiting + running (from the DP coordinator), in turn, or "
                             "cache-aware: the engine that holds the longest prefix of the "
                             "prompt (as far as this API server sent it there) unless it is "
                             "much busier than the least loaded.")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API-server processes sharing the one listening socket (1: the "
                             "API server runs in the main process).")
    parser.add_argument("--headless", action="store_true",
                        help="Run this host's engines for a head elsewhere (with "
                             "--data-parallel-start-rank, --data-parallel-size-local and the "
                             "head's --data-parallel-address/--data-parallel-rpc-port); no "
                             "API server.")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="Log level of uvicorn's own logger.")
    add_http_args(parser.add_argument_group("HTTP options"))
    add_log_args(parser.add_argument_group("logging options"))
    limits = parser.add_argument_group("request limits")
    add_limit_args(limits)
    EngineArgs.add_cli_args(parser.add_argument_group("engine options"),
                            groups={"request limits": limits})


def _check_args(args: argparse.Namespace) -> None:
    RequestLimits.from_args(args)  # ConfigError naming the option
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.engine_ready_timeout <= 0:
        raise ConfigError(f"--engine-ready-timeout must be positive, got "
                          f"{args.engine_ready_timeout}")
    if args.max_request_body_bytes < 1024:
        raise ConfigError(f"--max-request-body-bytes must be at least 1024, got "
                          f"{args.max_request_body_bytes}")
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser "
                          "(hermes or llama3_json)")
    for option in ("max_num_queued_requests", "max_num_queued_tokens"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    from dpserve.server.auth import AuthOptions, check_admin_exposure
    from dpserve.server.extras import HTTPOptions
    from dpserve.server.log_options import LogOptions

    LogOptions.from_args(args)  # their ConfigErrors before anything loads
    HTTPOptions.from_args(args)
    if not args.headless:
        check_admin_exposure(args, AuthOptions.from_args(args))
    if args.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1, got "
                          f"{args.api_server_count}")


def _bind(host: str, port: int) -> socket.socket:
    """Bind host:port for every API server (they listen on it when they serve).

    SO_REUSEADDR only (restarts are not blocked by old TIME_WAIT connections),
    never SO_REUSEPORT: no other process can listen on the port while this
    socket is open.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--port {port} on {host} cannot be used: "
                          f"{e.strerror or e}") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/Ctrl-C or a dpserve process dies (1)."""
    from dpserve.entrypoints.api_server import APIServerOptions, APIServerSpec
    from dpserve.launch.api_servers import APIServerStartupError
    from dpserve.launch.engines import EngineStartupError
    from dpserve.launch.host import launch_engines

    # First of all: the title replaces the command line (secrets leave `ps`).
    scrub_argv()
    name_process("Headless" if args.headless else
                 "APIServer_0" if args.api_server_count == 1 else "Launcher")
    _check_args(args)
    if args.headless:
        return run_headless(args)
    engine_args = EngineArgs.from_cli(args)
    engine_args.check_options()  # a bad option fails before anything starts
    sock = _bind(args.host, args.port)  # before loading anything: fail fast, hold the port
    from dpserve.launch.process import start_engine_forkserver, stop_engine_forkserver

    if args.data_parallel_backend != "ray":
        start_engine_forkserver()  # imports torch while the config resolves
    num_api_servers = args.api_server_count
    launch: EngineLaunch | None = None
    try:
        config = engine_args.create_config()
        # Until the serving phase installs its own handlers, a stop signal
        # unwinds through `finally`.
        signal.signal(signal.SIGTERM, _raise_system_exit)
        signal.signal(signal.SIGINT, _raise_system_exit)
        if num_api_servers == 1:  # this process serves HTTP: load while the engines start
            from dpserve.frontend.tokenizer import preload_tokenizer

            preload_tokenizer(config.model.tokenizer)
        launch = launch_engines(config, num_api_servers, ready_timeout=args.engine_ready_timeout)
        specs = [APIServerSpec(i, launch.input_binds(i), launch.output_binds(i), launch.ranks,
                               launch.max_model_len, launch.coordinator_address)
                 for i in range(num_api_servers)]
        options = APIServerOptions.from_args(args)
        if num_api_servers == 1:
            return _serve_in_process(options, config, specs[0], sock, launch)
        return _run_api_servers(options, config, specs, sock, launch)
    except EngineStartupError as e:
        error = f"engine failed to start: {e}"
    except APIServerStartupError as e:
        error = f"API server failed to start: {e}"
    finally:
        if launch is not None:
            launch.close()
        else:  # failed before the engines (the model, say): the forkserver goes too
            stop_engine_forkserver()
        sock.close()
    print(f"dpserve: error: {error}", file=sys.stderr)  # last, after the children's logs
    return 1


def run_headless(args: argparse.Namespace) -> int:
    """`--headless`: this host's engines for a head elsewhere; no API server.

    Exits when its engines exit (they stop when the head goes away): 0 if
    they all stopped cleanly, 1 otherwise. SIGTERM/SIGINT drain the engines
    (each gets SIGTERM, finishes its requests for up to --shutdown-timeout s),
    then the same exit codes; a second signal stops at once (128 + the signal).
    """
    from dpserve.launch.addresses import url_host
    from dpserve.launch.engines import EngineProcManager

    config = EngineArgs.from_cli(args).create_config()
    p = config.parallel
    if p.local_lb:
        raise ConfigError("--headless hosts run engines for a head's balancer; they take no "
                          "--data-parallel-rank or --data-parallel-hybrid-lb")
    if p.data_parallel_start_rank == 0:
        raise ConfigError("--headless needs --data-parallel-start-rank > 0 (rank 0 runs on "
                          "the head)")
    head = f"tcp://{url_host(p.data_parallel_address)}:{p.data_parallel_rpc_port}"
    warn_plain_tcp(p.data_parallel_address, p.data_parallel_secret)
    logger.info("headless: engines %s for the head at %s", p.local_ranks, head)
    stop = _StopSignal()
    manager = EngineProcManager(config, head, num_engines=p.data_parallel_size_local,
                                start_rank=p.data_parallel_start_rank, local=False,
                                handshake_timeout=args.engine_ready_timeout)
    try:
        failed = _supervise_headless(stop, manager, p)
        if stop.signum is not None:
            logger.info("signal %d: draining the engines (up to %g s)", stop.signum,
                        config.shutdown_timeout)
            for proc in manager.processes:
                if proc.is_alive():
                    proc.terminate()  # an engine drains on its first SIGTERM
            code = _wait_drained(stop, manager.processes, [], config.shutdown_timeout)[0]
            return 1 if code == 0 and any(manager.finished_procs().values()) else code
        if failed:
            print(f"dpserve: error: {'; '.join(failed)} (see its log above)", file=sys.stderr)
            return 1
        logger.info("headless: every engine stopped (the head went away)")
        return 0
    finally:
        manager.close()
        stop.restore()



def _supervise_headless(stop: _StopSignal, manager: EngineProcManager,
                        p: ParallelConfig) -> list[str]:
    """Watch this host's engines until a signal or until none runs: an engine that
    exits cleanly (its head went away) stays down; one that fails is restarted
    under policy restart (it handshakes with the head again, which then routes to
    it; --max-engine-restarts per rank in the supervisor's window); under isolate
    it stays down; under stop the host stops. Returns the failures that ended it."""
    from dpserve.launch.supervisor import RestartBudget

    budget = RestartBudget(p.max_engine_restarts)
    incarnations = dict.fromkeys(manager.ranks, 0)
    failed: list[str] = []
    while stop.signum is None:
        live = [proc for proc in manager.processes if proc.exitcode is None]
        if not live:
            return failed
        for proc in _watch(stop, live):
            rank = manager.ranks[manager.processes.index(proc)]
            what = f"{proc.name} exited with code {proc.exitcode}"
            if proc.exitcode == 0:
                continue
            if p.engine_failure_policy == "restart" and budget.take(rank):
                incarnations[rank] += 1
                logger.warning("%s; restarting it (incarnation %d)", what, incarnations[rank])
                manager.respawn(rank, incarnations[rank])
                continue
            failed.append(what)
            if p.engine_failure_policy == "stop":
                return failed
            logger.error("rank %d is out: %s", rank, what)
    return failed


def _serve_in_process(options: APIServerOptions, config: EngineConfig,
                      spec: APIServerSpec, sock: socket.socket, launch: EngineLaunch) -> int:
    """M == 1: API server 0 runs here; engine deaths follow the failure policy."""
    from dpserve.entrypoints.api_server import serve_http

    async def on_ready(client, server) -> None:
        launch.supervise(config, on_status=client.set_rank_status, on_fatal=client.mark_dead,
                         stopping=lambda: server.drain_requested)
        _log_serving(options, config, spec, sock, 1)

    return asyncio.run(serve_http(options, config, spec, sock, on_ready))


def _run_api_servers(options: APIServerOptions, config: EngineConfig,
                     specs: list[APIServerSpec], sock: socket.socket,
                     launch: EngineLaunch) -> int:
    """M > 1: start the API-server processes, then watch every process.

    Returns 0 after a drain (SIGTERM/SIGINT), 128 + the signal after a second one,
    1 when any process died.
    """
    from dpserve.launch.api_servers import APIServerProcManager
    from dpserve.launch.supervisor import RestartBudget

    metrics_dir = tempfile.mkdtemp(prefix="dpserve-metrics-")
    api: APIServerProcManager | None = None
    stop: _StopSignal | None = None
    try:
        api = APIServerProcManager(options, config, specs, sock, metrics_dir)
        api.wait_for_startup(also_watch=launch.processes)
        stop = _StopSignal()
        launch.supervise(config, on_status=api.broadcast_rank_status,
                         on_fatal=stop.engine_died, stopping=lambda: stop.signum is not None)
        api.start_serving()
        _log_serving(options, config, specs[0], sock, len(specs))
        budget = RestartBudget(config.parallel.max_engine_restarts)  # per API server
        while True:
            exited = _watch(stop, api.processes, api)
            if stop.signum is not None:
                logger.info("signal %d: draining the API servers (up to %g s)", stop.signum,
                            config.shutdown_timeout)
                api.request_drain()
                code, why = _wait_drained(stop, api.processes, launch.processes,
                                          config.shutdown_timeout, api)
                if code != 0:
                    api.stop_after_death(why)  # fail what is left, then stop them
                return code
            reason = stop.death or "; ".join(
                f"process {p.name} (pid {p.pid}) exited with code {p.exitcode}"
                for p in exited)
            if stop.death is not None or not _restart_api_servers(api, exited, config,
                                                                    budget):
                logger.error("%s; stopping the server", reason)
                api.stop_after_death(reason)
                return 1
    finally:
        if api is not None:
            api.close()  # API servers first: they drain while the engines still run
        if stop is not None:
            stop.restore()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _restart_api_servers(api: APIServerProcManager, exited: list[BaseProcess],
                         config: EngineConfig, budget: RestartBudget) -> bool:
    """Restart API servers that died (the others serve on meanwhile); False when the
    policy is stop, the restart limit is reached, or one does not start."""
    from dpserve.launch.api_servers import APIServerStartupError

    p = config.parallel
    for proc in exited:
        what = f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        index = api.processes.index(proc)
        if p.engine_failure_policy == "stop" or not budget.take(index):
            return False
        logger.warning("%s; restarting it (the other API servers serve on)", what)
        try:
            api.restart(proc)
        except APIServerStartupError as e:
            logger.error("%s could not be restarted: %s", proc.name, e)
            return False
    return True


class _StopSignal:
    """The launcher's SIGTERM/SIGINT while serving: remember it, wake `_watch`."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the latest
        self.count = 0  # signals so far
        self.death: str | None = None  # set by engine_died
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._write_fd)
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum  # the wakeup fd wakes the loop
        self.count += 1

    def engine_died(self, reason: str) -> None:
        """The supervisor stops the server (policy stop, or engines lost): wake `_watch`."""
        self.death = reason
        try:
            os.write(self._write_fd, b"!")
        except OSError:
            pass

    def drain(self) -> None:
        try:
            os.read(self.fd, 512)
        except BlockingIOError:
            pass

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_wakeup_fd)
        os.close(self.fd)
        os.close(self._write_fd)


def _watch(stop: _StopSignal, procs: Sequence[BaseProcess],
           api: APIServerProcManager | None = None) -> list[BaseProcess]:
    """Block until a stop signal or an engine death reported to `stop` ([]), or until
    any of `procs` exits (those that did). `api`: an API server that drained on a
    signal of its own is let go (`release_drained`)."""
    by_sentinel = {p.sentinel: p for p in procs}
    while stop.signum is None and stop.death is None:
        reports = api.drain_fds if api is not None else []
        ready = connection.wait([*by_sentinel, stop.fd, *reports], timeout=5.0)
        if stop.fd in ready:
            stop.drain()
        if api is not None and stop.signum is None and stop.death is None:
            api.release_drained()
        exited = [by_sentinel[s] for s in ready if s in by_sentinel]
        if exited and stop.signum is None:
            for proc in exited:
                proc.join(timeout=1.0)  # reap: exitcode becomes known
            return exited
    return []


def _wait_drained(stop: _StopSignal, draining: Sequence[BaseProcess],
                  watched: Sequence[BaseProcess], timeout: float,
                  api: APIServerProcManager | None = None) -> tuple[int, str]:
    """After the first signal: wait until every `draining` process has exited
    (`api`: the API servers' manager, whose DRAINED reports it passes on).

    Returns (exit code, why): 0 when they did; 1 when they still run after
    `timeout` + DRAIN_MARGIN_S, or a process in `watched` (engines) fails or
    a Ray actor dies first; 128 + the signal on a second signal.
    """
    deadline = time.monotonic() + timeout + DRAIN_MARGIN_S
    watched_by = {p.sentinel: p for p in watched}
    while True:
        alive = [p for p in draining if p.exitcode is None]
        if not alive:
            logger.info("drained: %s", ", ".join(f"{p.name} exited with code {p.exitcode}"
                                                  for p in draining))
            return 0, "drained"
        if stop.count > 1:
            logger.warning("second signal (%d): stopping at once", stop.signum)
            return 128 + (stop.signum or signal.SIGTERM), "stopped by a second signal"
        # Exit code 0: an engine stopped by the same signal (sent to the process group).
        dead = [p for p in watched if p.exitcode]
        if dead or stop.death is not None:
            why = stop.death or ", ".join(f"process {p.name} (pid {p.pid}) exited with code "
                                          f"{p.exitcode}" for p in dead)
            logger.error("%s while draining", why)
            return 1, why
        left = deadline - time.monotonic()
        if left <= 0:
            why = (f"{', '.join(p.name for p in alive)} still running "
                   f"{timeout + DRAIN_MARGIN_S:.0f} s after the signal")
            logger.error("%s; stopping them", why)
            return 1, why
        reports = api.drain_fds if api is not None else []
        ready = connection.wait([*(p.sentinel for p in alive), *watched_by, stop.fd,
                                 *reports], timeout=min(left, 1.0))
        if stop.fd in ready:
            stop.drain()
        if api is not None:
            api.release_drained()
        for proc in alive:
            if proc.sentinel in ready:
                proc.join(timeout=1.0)  # reap: exitcode becomes known
        for s in ready:
            if s in watched_by:
                watched_by[s].join(timeout=1.0)


def _log_serving(options: APIServerOptions, config: EngineConfig, spec: APIServerSpec,
                 sock: socket.socket, num_api_servers: int) -> None:
    host, port = sock.getsockname()[:2]
    logger.info("serving %s on http://%s:%d (model %s, max_model_len %d, %d engine(s), "
                "%d API server(s))", options.served_model_name, host, port,
                config.model.path, spec.max_model_len, len(spec.engine_ranks),
                num_api_servers)
    from dpserve.generation_config import log_generation_defaults

    log_generation_defaults(config.model.generation_defaults)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
