"""`dpserve serve`: launch the engines and serve them over OpenAI-compatible HTTP.

Scope: the launcher. It checks the options and binds host:port once, before
loading anything; resolves the config once; starts the coordinator (N > 1) and
the engines, waits for every READY; then runs uvicorn itself (M == 1) or starts
the M API-server processes (`dpserve.entrypoints.api_server`), waits for all of
them and watches every process. It makes the shared state directory
(`--state-dir`, else a private one removed at exit) and, with M > 1, the
Prometheus multiprocess directory.

Invariants: a port in use fails before any model loads, and no other process
can take it meanwhile; any engine, the coordinator or an API server dying stops
the server with exit code 1 (in-flight requests get a 503 first); SIGTERM or
Ctrl-C drain it (exit 0; with M > 1 bounded by the timeout plus
`DRAIN_MARGIN_S`), a second signal stops at once; every child is shut down
(terminate -> join -> kill tree), API servers first, before the launcher exits.

Not here: an API server's own start-up and drain (`dpserve.entrypoints.api_server`),
the engines' drain (`dpserve.engine.process`), spawning and watching
(`dpserve.launch`).

Design: docs/design/processes.md
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

from dpserve.config import ConfigError, EngineArgs, EngineConfig
from dpserve.entrypoints.api_server import (
    APIServerOptions,
    APIServerSpec,
    run_api_server,
    serve_http,
)
from dpserve.frontend.routing import DEFAULT_LOAD_BALANCE, LOAD_BALANCE_POLICIES
from dpserve.launch.api_server_watch import run_api_servers
from dpserve.launch.api_servers import APIServerStartupError
from dpserve.launch.engines import EngineStartupError
from dpserve.launch.headless import run_headless_host
from dpserve.launch.host import launch_engines
from dpserve.launch.process import start_engine_forkserver, stop_engine_forkserver
from dpserve.logging_utils import name_process, scrub_argv
from dpserve.placement import can_scale
from dpserve.server.auth import add_auth_args, check_admin_exposure
from dpserve.server.batches.options import add_batch_args
from dpserve.server.batches.store import init_batch_state
from dpserve.server.limits import RequestLimits, add_limit_args
from dpserve.server.log_options import LogOptions, add_log_args
from dpserve.server.openai.extras import HTTPOptions, add_http_args
from dpserve.server.openai.tools import add_tool_args
from dpserve.server.responses.store import add_response_store_args, store_in
from dpserve.server.state_dir import state_directory
from dpserve.server.tenants import add_tenant_args
from dpserve.tracing.options import GROUP as TRACING

if TYPE_CHECKING:
    from dpserve.launch.host import EngineLaunch

logger = logging.getLogger("dpserve.serve")


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
    add_tool_args(parser)
    parser.add_argument("--engine-ready-timeout", type=float, default=600.0,
                        help="Seconds to wait for the engines to load the model.")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                        help="Larger request bodies (on any route) get HTTP 413.")
    parser.add_argument("--load-balance", default=DEFAULT_LOAD_BALANCE,
                        choices=list(LOAD_BALANCE_POLICIES),
                        help="How the API server places requests on engines. cache-aware "
                             "(default): the engine that holds the longest prefix of the "
                             "prompt (as far as the API servers sent it there; with "
                             "--api-server-count N they share what they placed through the "
                             "DP coordinator) unless it is much busier than the least "
                             "loaded; least-loaded: the lowest 4*waiting + running (from "
                             "the DP coordinator); round-robin: in turn.")
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
    add_response_store_args(parser.add_argument_group("Responses API store"))
    add_batch_args(parser.add_argument_group("state directory, files and batches"))
    add_tenant_args(parser.add_argument_group("tenants"))
    limits = parser.add_argument_group("request limits")
    add_limit_args(limits)
    EngineArgs.add_cli_args(parser.add_argument_group("engine options"),
                            groups={"request limits": limits,
                                    TRACING: parser.add_argument_group(TRACING)})


def _check_args(args: argparse.Namespace) -> APIServerOptions | None:
    """Every option's ConfigError (naming it) before anything loads; the API
    servers' options, None with --headless (no HTTP there)."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.engine_ready_timeout <= 0:
        raise ConfigError(f"--engine-ready-timeout must be positive, got "
                          f"{args.engine_ready_timeout}")
    if args.max_request_body_bytes < 1024:
        raise ConfigError(f"--max-request-body-bytes must be at least 1024, got "
                          f"{args.max_request_body_bytes}")
    for option in ("max_num_queued_requests", "max_num_queued_tokens"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    if args.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1, got "
                          f"{args.api_server_count}")
    if args.headless:
        RequestLimits.from_args(args)
        LogOptions.from_args(args)
        HTTPOptions.from_args(args)
        return None
    options = APIServerOptions.from_args(args)  # HTTP, log, auth and limit options
    check_admin_exposure(args, options.auth)
    if options.tenants.limits is not None and (
            getattr(args, "data_parallel_rank", None) is not None
            or getattr(args, "data_parallel_hybrid_lb", False)):
        raise ConfigError("--tenant-limits cannot be used with external or hybrid load "
                          "balancing (--data-parallel-rank, --data-parallel-hybrid-lb): "
                          "each host would keep its own ledger")
    return options


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
    """Run the server until SIGTERM/Ctrl-C or a dpserve process dies (1):
    check the options -> bind -> launch the engines -> serve -> stop."""
    # First of all: the title replaces the command line (secrets leave `ps`).
    scrub_argv()
    name_process("Headless" if args.headless else
                 "APIServer_0" if args.api_server_count == 1 else "Launcher")
    options = _check_args(args)
    if options is None:
        return run_headless(args)
    engine_args = EngineArgs.from_cli(args)
    if args.enable_admin_api and engine_args.enable_elastic_ep is None and can_scale(
            engine_args):  # the scale route is served: ready to scale (a coordinator at DP=1)
        engine_args = dataclasses.replace(engine_args, enable_elastic_ep=True)
    engine_args.check_options()  # a bad option fails before anything starts
    sock = _bind(args.host, args.port)  # before loading anything: fail fast, hold the port
    try:
        # The state directory (removed at exit unless the user named it: --state-dir)
        # with the Responses API's store file and the files and batches, for every
        # API server.
        with state_directory(options.batches.state_dir) as state_dir:
            init_batch_state(state_dir)
            options = dataclasses.replace(
                options, responses=store_in(options.responses, state_dir),
                batches=dataclasses.replace(options.batches, state_dir=state_dir))
            error = _launch_and_serve(args, engine_args, options, sock)
    finally:
        sock.close()
    if isinstance(error, int):
        return error
    print(f"dpserve: error: {error}", file=sys.stderr)  # last, after the children's logs
    return 1


def _launch_and_serve(args: argparse.Namespace, engine_args: EngineArgs,
                      options: APIServerOptions, sock: socket.socket) -> int | str:
    """Launch the engines, serve until the end: the exit code, or the one-line error
    when something failed to start. Everything started is stopped on return."""
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
        launch = launch_engines(config, num_api_servers, ready_timeout=args.engine_ready_timeout,
                                tenant_limits=options.tenants.limits)
        return _serve(options, config, sock, launch, num_api_servers)
    except EngineStartupError as e:
        return f"engine failed to start: {e}"
    except APIServerStartupError as e:
        return f"API server failed to start: {e}"
    finally:
        if launch is not None:
            launch.close()
        # Then the forkserver (an idle one, or one still importing torch when the
        # start-up failed before the engines) and the resource tracker: nothing of
        # dpserve is left in the process group when this process exits.
        stop_engine_forkserver()


def _serve(options: APIServerOptions, config: EngineConfig, sock: socket.socket,
           launch: EngineLaunch, num_api_servers: int) -> int:
    """Serve over the engines `launch` started: in this process (M == 1), or through
    M API-server processes (`dpserve.launch.api_server_watch`)."""
    specs = [APIServerSpec(i, launch.input_binds(i), launch.output_binds(i), launch.ranks,
                           launch.max_model_len, launch.coordinator_address,
                           launch.tenant_address, num_api_servers)
             for i in range(num_api_servers)]
    if num_api_servers == 1:
        return _serve_in_process(options, config, specs[0], sock, launch)
    return run_api_servers(run_api_server, dict(options=options, config=config), config,
                           specs, sock, launch, on_serving=lambda: _log_serving(
                               options, config, specs[0], sock, num_api_servers))


def run_headless(args: argparse.Namespace) -> int:
    """`--headless`: this host's engines for a head elsewhere; no API server
    (`dpserve.launch.headless`)."""
    config = EngineArgs.from_cli(args).create_config()
    return run_headless_host(config, args.engine_ready_timeout)


def _serve_in_process(options: APIServerOptions, config: EngineConfig,
                      spec: APIServerSpec, sock: socket.socket, launch: EngineLaunch) -> int:
    """M == 1: API server 0 runs here; engine deaths follow the failure policy."""

    async def on_ready(client, server) -> None:
        launch.supervise(config, on_status=client.set_rank_status, on_fatal=client.mark_dead,
                         stopping=lambda: server.drain_requested)
        _log_serving(options, config, spec, sock, 1)

    return asyncio.run(serve_http(options, config, spec, sock, on_ready))


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
