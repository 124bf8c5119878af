"""`dpserve serve`: launch the engine and serve it over OpenAI-compatible HTTP.

Processes (one API server; N = --data-parallel-size engines):

    main process  "dpserve::APIServer_0"     launcher + FastAPI/uvicorn
      |  ROUTER in (bind) / PULL out (bind)          (AsyncEngineClient)
      v
    children      "dpserve::EngineCore_<r>"  EngineCoreProc (model + KV cache), r < N
    child (N > 1) "dpserve::DPCoordinator"   engines' load counts -> the API server

The launcher resolves the config once, starts the coordinator (N > 1) and
then the engines (their init metadata names the coordinator's addresses),
waits for every READY (failing at once, with one line, if any of them dies),
then runs uvicorn. A watchdog stops the server when any engine or the
coordinator dies (exit code 1); SIGTERM or Ctrl-C stop it gracefully
(uvicorn drains for up to 2 s, then the exit code is 128 + the signal, as
usual). Either way every child is shut down (terminate -> join -> kill tree)
before the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import sys

from dpserve.config import EngineArgs, EngineConfig
from dpserve.logging_utils import name_process

logger = logging.getLogger("dpserve.serve")

_GRACEFUL_SHUTDOWN_S = 2


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face directory, .gguf file or hub name "
                             "(default: built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on /v1/* "
                             "(default: $DPSERVE_API_KEY; none = open).")
    parser.add_argument("--served-model-name", default=None,
                        help="Model name clients use (default: the model argument, or "
                             "SmolLM2-135M-Instruct).")
    parser.add_argument("--engine-ready-timeout", type=float, default=600.0,
                        help="Seconds to wait for the engines to load the model.")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                        help="Larger request bodies get HTTP 413.")
    parser.add_argument("--load-balance", default="least-loaded",
                        choices=["least-loaded", "round-robin"],
                        help="How the API server places requests on engines: the lowest "
                             "4*waiting + running (from the DP coordinator), or in turn.")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="Log level of uvicorn's own logger.")
    EngineArgs.add_cli_args(parser.add_argument_group("engine options"))


def _check_args(args: argparse.Namespace) -> None:
    from dpserve.config import ConfigError

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.engine_ready_timeout <= 0:
        raise ConfigError(f"--engine-ready-timeout must be positive, got "
                          f"{args.engine_ready_timeout}")
    if args.max_request_body_bytes < 1024:
        raise ConfigError(f"--max-request-body-bytes must be at least 1024, got "
                          f"{args.max_request_body_bytes}")
    # Fail before loading any model if the address cannot be listened on.
    try:
        with socket.create_server((args.host, args.port), reuse_port=False):
            pass
    except OSError as e:
        raise ConfigError(f"--port {args.port} on {args.host} cannot be used: "
                          f"{e.strerror or e}") from None


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/Ctrl-C or an engine (or the coordinator) dies (1)."""
    from dpserve.coordinator import DPCoordinator
    from dpserve.launcher import AddressAllocator, EngineProcManager, EngineStartupError

    _check_args(args)
    config = EngineArgs.from_cli(args).create_config()
    dp_size = config.parallel.data_parallel_size
    name_process("APIServer_0")
    # Until uvicorn installs its own handlers, SIGTERM unwinds through `finally`.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(num_clients=1)
    coordinator: DPCoordinator | None = None
    manager: EngineProcManager | None = None
    try:
        if dp_size > 1:  # the coordinator first: engines connect to it while loading
            coordinator = DPCoordinator(dp_size, alloc,
                                        startup_timeout_s=args.engine_ready_timeout)
            coordinator.start()
            addrs = dataclasses.replace(
                addrs, coordinator_input=coordinator.engine_publish_address,
                coordinator_output=coordinator.engine_report_address)
        others = [coordinator.proc] if coordinator is not None and coordinator.proc else []
        manager = EngineProcManager(config, addrs.handshake, num_engines=dp_size)
        ready = manager.wait_for_startup(addrs.init_metadata(dp_size=dp_size),
                                         timeout=args.engine_ready_timeout, also_watch=others)
        max_model_len = min(r.max_model_len for r in ready.values())
        return asyncio.run(_serve_http(
            args, config, addrs, manager, max_model_len, others,
            coordinator.front_publish_address if coordinator is not None else None))
    except EngineStartupError as e:
        print(f"dpserve: error: engine failed to start: {e}", file=sys.stderr)
        return 1
    finally:
        if manager is not None:
            manager.close()
        if coordinator is not None:
            coordinator.close()
        alloc.cleanup()


async def _serve_http(args: argparse.Namespace, config: EngineConfig, addrs, manager,
                      max_model_len: int, others: list, coordinator_address: str | None,
                      ) -> int:
    import uvicorn

    from dpserve.frontend.async_llm import AsyncLLM
    from dpserve.frontend.engine_client import AsyncEngineClient
    from dpserve.server.app import build_app

    client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], engine_ranks=manager.ranks,
                               client_index=0, max_model_len=max_model_len,
                               coordinator_address=coordinator_address,
                               load_balance=args.load_balance)
    client.watch_processes([*manager.processes, *others])  # any death stops the server
    llm = AsyncLLM(config, client)
    name = args.served_model_name or _default_served_name(args.model)
    app = build_app(llm, name, api_key=args.api_key,
                    max_request_body_bytes=args.max_request_body_bytes)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S, access_log=False))
    watchdog = asyncio.create_task(_stop_when_dead(llm, server))
    logger.info("serving %s on http://%s:%d (model %s, max_model_len %d, %d engine(s))",
                name, args.host, args.port, config.model.path, max_model_len,
                len(manager.ranks))
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        llm.shutdown()
    if llm.is_dead:
        logger.error("an engine or the DP coordinator died; the server stopped")
        return 1
    return 0


async def _stop_when_dead(llm, server) -> None:
    while not server.should_exit:
        if llm.is_dead:
            # Give in-flight requests a moment to receive their error, then stop.
            await asyncio.sleep(0.5)
            server.should_exit = True
            return
        await asyncio.sleep(0.1)


def _default_served_name(model: str | None) -> str:
    # As vLLM does: clients name the model the way the server was given it.
    return model if model is not None else "SmolLM2-135M-Instruct"


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
