"""API servers: the HTTP front-end of `dpserve serve`, in the main process or in M of its own.

Scope: `serve_http` (one API server: AsyncEngineClient -> AsyncLLM -> FastAPI
app -> uvicorn on a socket the launcher bound), the process target
`run_api_server` for `--api-server-count M > 1` and its end of the pipe to the
launcher (`_LauncherLink`: READY / FAILED, then SERVE, STOPPING, DRAIN, DRAINED,
CLOSE), and the drain (`DrainingServer`: /v1/* and /health answer 503, requests
in flight get `shutdown_timeout` s, then the rest are aborted).

Invariants: API server i owns the engine sockets of client index i (outputs
come back by `client_index`); with M > 1 none serves before all M are ready,
and none closes its connections before every one has drained; a second signal
stops at once (128 + the signal); an API server stops when its engines die or
its launcher is gone (pipe closed, or re-parented: polled every second). Each
child sets PROMETHEUS_MULTIPROC_DIR before prometheus_client is imported.

Not here: binding the listening socket (`dpserve.entrypoints.serve`), the
launcher's side of the API-server processes and the watch over every process
(`dpserve.launch.api_servers`, `dpserve.launch.api_server_watch`), the pipe's
messages (`dpserve.launch.api_server_pipe`), the HTTP routes (`dpserve.server.app`).

Design: docs/design/processes.md
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing import connection
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from dpserve import tracing
from dpserve.config import EngineConfig
from dpserve.frontend.errors import EngineDeadError
from dpserve.launch.api_server_pipe import (
    API_SERVER_READY_TIMEOUT_S,
    APIServerSpec,
    ControlMessage,
)
from dpserve.logging_utils import name_process
from dpserve.parent_watch import start_parent_watcher
from dpserve.server.auth import AuthOptions
from dpserve.server.batches.options import BatchOptions
from dpserve.server.limits import RequestLimits
from dpserve.server.log_options import LogOptions, configure_access_log
from dpserve.server.metrics.stats_log import log_stats_every
from dpserve.server.openai.extras import HTTPOptions, uvicorn_kwargs
from dpserve.server.responses.store import ResponseStoreOptions
from dpserve.server.tenants import TenantOptions

if TYPE_CHECKING:
    import socket

    from fastapi import FastAPI

    from dpserve.frontend.async_llm import AsyncLLM
    from dpserve.frontend.engine_client import AsyncEngineClient

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5  # after a drain (or a force exit), uvicorn closes connections
_ABORT_WAIT_S = 5.0  # a drain waits this long for the final outputs of aborted requests
# M > 1: after its own drain an API server waits at most this long for CLOSE (the
# launcher gives up on the drain sooner: --shutdown-timeout + DRAIN_MARGIN_S).
_HOLD_MARGIN_S = 30.0

# Test-only fault injection: API server <index> fails while starting.
FAULT_START_ENV = "DPSERVE_FAULT_API_SERVER_START"


@dataclass(frozen=True)
class APIServerOptions:
    """The HTTP options every API server shares (from the `dpserve serve` flags)."""

    served_model_name: str
    auth: AuthOptions = field(repr=False)  # the accepted keys' digests, --metrics-auth
    max_request_body_bytes: int
    load_balance: str  # "least-loaded" | "round-robin" | "cache-aware"
    uvicorn_log_level: str
    enable_admin_api: bool = False  # the admin routes (pause, sleep, /engines/{rank}/...)
    max_num_queued_requests: int | None = None  # admission control (429)
    max_num_queued_tokens: int | None = None
    tool_call_parser: str | None = None  # --tool-call-parser (None: the template's format)
    http: HTTPOptions = HTTPOptions()  # CORS, TLS, root path, chat template, aliases
    log: LogOptions = LogOptions()  # request log, access log, stats line
    limits: RequestLimits = RequestLimits()  # the "request limits" group (server/limits.py)
    # The Responses API's store: its file (the launcher's, shared by all M), bounds.
    responses: ResponseStoreOptions = ResponseStoreOptions()
    # /v1/files and /v1/batches: the state directory (the launcher's), their bounds.
    batches: BatchOptions = BatchOptions()
    tenants: TenantOptions = TenantOptions()  # --tenant-limits, --tenant-header

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> APIServerOptions:
        names = args.served_model_name
        first = names[0] if isinstance(names, list) and names else names
        return cls(served_model_name=first or _default_served_name(args.model),
                   http=HTTPOptions.from_args(args), log=LogOptions.from_args(args),
                   auth=AuthOptions.from_args(args), limits=RequestLimits.from_args(args),
                   responses=ResponseStoreOptions.from_args(args),
                   batches=BatchOptions.from_args(args),
                   tenants=TenantOptions.from_args(args),
                   max_request_body_bytes=args.max_request_body_bytes,
                   load_balance=args.load_balance, uvicorn_log_level=args.uvicorn_log_level,
                   enable_admin_api=getattr(args, "enable_admin_api", False),
                   max_num_queued_requests=getattr(args, "max_num_queued_requests", None),
                   max_num_queued_tokens=getattr(args, "max_num_queued_tokens", None),
                   tool_call_parser=getattr(args, "tool_call_parser", None))


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT (or `request_drain()`) starts a drain:
    `llm.draining` at once (503s), the rest in `_watch_lifecycle`; a second
    signal is uvicorn's force exit."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM) -> None:
        super().__init__(config)
        self.llm = llm
        self.drain_requested = False
        self.signalled = False
        self.forced_by: int | None = None  # the second signal
        # M > 1 (set by the launcher link): after its own drain this server reports
        # DRAINED with `report_drained` and answers 503 until `released` (CLOSE).
        self.released: asyncio.Event | None = None
        self.report_drained: Callable[[], None] = lambda: None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only sets flags, which the loop polls.
        if self.signalled:
            self.forced_by = sig
            self.should_exit = self.force_exit = True
        self.signalled = True
        self.request_drain()

    def request_drain(self) -> None:
        """Drain as on a first signal (idempotent; the launcher's DRAIN)."""
        self.llm.draining = self.drain_requested = True


# on_ready(client, server): runs once everything is built, before uvicorn serves.
OnReady = Callable[["AsyncEngineClient", DrainingServer], Awaitable[None]]


async def serve_http(options: APIServerOptions, config: EngineConfig, spec: APIServerSpec,
                     sock: socket.socket, on_ready: OnReady) -> int:
    """Serve HTTP on `sock` until drained (0; the first SIGTERM/SIGINT or the
    launcher's DRAIN), stopped by a second signal (128 + it), or the engines die (1).
    """
    from dpserve.frontend.async_llm import AsyncLLM
    from dpserve.frontend.engine_client import from_config

    tracing.install(config.tracing, "api-server", spec.index)  # before build_app (spans)
    client = from_config(config, spec.input_address, spec.output_address,
                         engine_ranks=spec.engine_ranks, client_index=spec.index,
                         max_model_len=spec.max_model_len,
                         coordinator_address=spec.coordinator_address,
                         load_balance=options.load_balance,
                         share_prefixes=spec.api_server_count > 1)
    llm: AsyncLLM | None = None
    died = False
    try:
        llm = AsyncLLM(config, client, chat_template=options.http.chat_template)
        app = _app(llm, options, config, spec)
        # log_config=None: uvicorn's loggers use ours, so its lines name the process too.
        server = DrainingServer(uvicorn.Config(
            app, log_level=options.uvicorn_log_level, log_config=None,
            access_log=options.log.access_log, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            **uvicorn_kwargs(options.http)), llm)
        configure_access_log(options.log)
        await on_ready(client, server)
        watchdog = asyncio.create_task(_watch_lifecycle(llm, server, config.shutdown_timeout))
        interval = options.log.log_stats_interval
        stats = (asyncio.create_task(log_stats_every(llm, interval)) if interval else None)
        try:
            await server.serve(sockets=[sock])
        finally:
            watchdog.cancel()
            if stats is not None:
                stats.cancel()
        if server.forced_by is not None:
            await _abort_all(llm)  # best effort: the engines need not finish them
            return 128 + server.forced_by
        # Before shutdown(), which marks the client dead too. After a drain, engines
        # that stopped too (a SIGTERM to the whole process group) are no failure.
        died = llm.is_dead and not server.drain_requested
    finally:
        if llm is not None:
            llm.shutdown()
        else:
            client.shutdown()
        tracing.shutdown()  # the spans of the last requests, before the process exits
    if died:
        logger.error("stopped: %s", client.dead_reason or "the engines are dead")
        return 1
    return 0


def _app(llm: AsyncLLM, options: APIServerOptions, config: EngineConfig,
         spec: APIServerSpec) -> FastAPI:
    """The HTTP app of API server `spec.index` over `llm`, from the options."""
    from dpserve.server.app import build_app

    return build_app(llm, options.served_model_name, auth=options.auth,
                     max_request_body_bytes=options.max_request_body_bytes,
                     api_server_index=spec.index, enable_admin_api=options.enable_admin_api,
                     max_num_queued=(options.max_num_queued_requests,
                                     options.max_num_queued_tokens),
                     tool_call_parser=options.tool_call_parser, http_options=options.http,
                     log_requests=options.log.log_requests, request_limits=options.limits,
                     response_store=options.responses, batches=options.batches,
                     tenants=options.tenants.at(spec.tenant_address,
                                                config.parallel.data_parallel_secret))


async def _watch_lifecycle(llm: AsyncLLM, server: DrainingServer,
                           shutdown_timeout: float) -> None:
    """Stop uvicorn when the engines die, or after a drain once one is asked for."""
    while not server.should_exit:
        if llm.is_dead:
            # Give in-flight requests a moment to receive their error, then stop.
            await asyncio.sleep(0.5)
            server.should_exit = True
            return
        if server.drain_requested:
            try:
                await _drain(llm, server, shutdown_timeout)
                await _hold(llm, server, shutdown_timeout + _HOLD_MARGIN_S)
            finally:
                server.should_exit = True
            return
        await asyncio.sleep(0.1)


async def _drain(llm: AsyncLLM, server: DrainingServer, timeout: float) -> None:
    """Take no new work; let the requests in flight finish for up to `timeout` s, then
    abort the rest in the engines and wait (bounded) for their final outputs."""
    llm.draining = True  # /v1/* and /health: 503 (already set by `request_drain`)

    def waiting(until: float) -> bool:
        return (llm.num_unfinished_requests > 0 and time.monotonic() < until
                and not llm.is_dead and not server.force_exit)

    logger.info("draining: %d request(s) in flight get up to %g s to finish; new requests "
                "get 503", llm.num_unfinished_requests, timeout)
    deadline = time.monotonic() + timeout
    while waiting(deadline):
        await asyncio.sleep(0.1)
    if llm.num_unfinished_requests and not llm.is_dead and not server.force_exit:
        logger.warning("shutdown timeout (%g s): aborting %d request(s) still in flight",
                       timeout, await _abort_all(llm))
        deadline = time.monotonic() + _ABORT_WAIT_S
        while waiting(deadline):
            await asyncio.sleep(0.05)
    logger.info("drained: %d request(s) left", llm.num_unfinished_requests)


async def _hold(llm: AsyncLLM, server: DrainingServer, timeout: float) -> None:
    """M > 1: say DRAINED, then go on answering 503 until the launcher's CLOSE (every
    API server has drained), a second signal, dead engines or `timeout` s."""
    if server.released is None:
        return
    server.report_drained()
    deadline = time.monotonic() + timeout
    while (not server.released.is_set() and not server.force_exit and not llm.is_dead
           and time.monotonic() < deadline):
        await asyncio.sleep(0.05)
    if not server.released.is_set():
        logger.warning("no CLOSE from the launcher within %g s of draining; exiting", timeout)


async def _abort_all(llm: AsyncLLM) -> int:
    try:
        return await llm.abort_all()
    except EngineDeadError:  # an engine became unreachable: its requests fail instead
        return 0


def _default_served_name(model: str | None) -> str:
    # As vLLM does: clients name the model the way the server was given it.
    return model if model is not None else "SmolLM2-135M-Instruct"


# ---- the API server process -------------------------------------------------------


def run_api_server(options: APIServerOptions, config: EngineConfig, spec: APIServerSpec,
                   sock: socket.socket, conn: connection.Connection, parent_pid: int,
                   metrics_dir: str) -> None:
    """Process target `APIServer_<index>`: exit 0 after a drain (a signal or DRAIN) or
    when the launcher is gone, 128 + the signal after a second one, 1 on a failure
    or when the engines die."""
    name_process(f"APIServer_{spec.index}")
    # Before prometheus_client is imported: it picks multiprocess mode on import.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    # Until uvicorn serves (and drains on a signal), a stop signal unwinds through `finally`.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    signal.signal(signal.SIGINT, _raise_system_exit)
    start_parent_watcher(parent_pid, f"API server {spec.index}")
    link = _LauncherLink(conn, spec.index)
    exit_code = 1
    try:
        exit_code = asyncio.run(serve_http(options, config, spec, sock, link.on_ready))
    except SystemExit as e:  # a stop signal
        exit_code = e.code if isinstance(e.code, int) else 1
    except Exception as e:
        if link.reported_ready:
            logger.exception("API server %d failed", spec.index)
        else:
            logger.error("API server %d failed to start: %s", spec.index, e, exc_info=True)
            link.report_failure(f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    logger.info("API server %d exiting (code %d)", spec.index, exit_code)
    # Everything this process owns is closed by now: skip the interpreter's
    # teardown, which takes seconds once torch (via the tokenizer) is loaded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class _LauncherLink:
    """An API server process's end of its pipe to the launcher."""

    def __init__(self, conn: connection.Connection, index: int) -> None:
        self.conn = conn
        self.index = index
        self.reported_ready = False

    async def on_ready(self, client: AsyncEngineClient, server: DrainingServer) -> None:
        """Say READY, wait (bounded) for SERVE, then listen for STOPPING."""
        if os.environ.get(FAULT_START_ENV) == str(self.index):
            raise RuntimeError(f"injected start-up failure ({FAULT_START_ENV})")
        self.conn.send(ControlMessage("ready"))
        self.reported_ready = True
        logger.info("API server %d ready (client index %d); waiting for the launcher",
                    self.index, client.client_index)
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(self.conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:  # a closed pipe (the launcher died) is readable too: recv() raises EOFError
            await asyncio.wait_for(readable, API_SERVER_READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no SERVE from the launcher within "
                               f"{API_SERVER_READY_TIMEOUT_S:.0f} s of READY") from None
        finally:
            loop.remove_reader(self.conn.fileno())
        message = self.conn.recv()
        if message.kind != "serve":
            raise RuntimeError(f"expected SERVE from the launcher, got {message.kind}")
        server.released = asyncio.Event()
        server.report_drained = self._report_drained
        loop.add_reader(self.conn.fileno(), self._on_message, loop, client, server)

    def _on_message(self, loop: asyncio.AbstractEventLoop, client: AsyncEngineClient,
                    server: DrainingServer) -> None:
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            loop.remove_reader(self.conn.fileno())
            logger.error("the launcher is gone; stopping")
            server.should_exit = True
            if server.released is not None:
                server.released.set()
            return
        if message.kind == "stopping":
            client.mark_dead(message.detail)  # fails in-flight requests; then we exit 1
        elif message.kind == "rank" and message.status is not None:
            client.set_rank_status(message.rank, message.status)
        elif message.kind == "drain":
            server.request_drain()
        elif message.kind == "close" and server.released is not None:
            server.released.set()

    def _report_drained(self) -> None:
        logger.info("API server %d drained; answering 503 until every API server has",
                    self.index)
        try:
            self.conn.send(ControlMessage("drained"))
        except OSError:
            pass  # the launcher is gone: `_on_message` stops this server

    def report_failure(self, reason: str) -> None:
        try:
            self.conn.send(ControlMessage("failed", reason))
        except OSError:
            pass  # the launcher is gone: nobody to tell


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
