"""EngineCoreProc: one EngineCore in its own process, wired to front-ends by ZMQ.

Scope: the start-up handshake with the launcher, the busy loop that drives the
`EngineCore` it holds, utility calls (pause / sleep ones through `ControlCalls`,
`dpserve.engine.control`), the engine-dead signal, signal handling and the
parent-death watcher. Its parts: `EngineIO` (`dpserve.engine.io_threads`: two IO
threads, sockets -> input queue and output queue -> sockets) and `OutputRouter`
(`dpserve.engine.output_sender`: which front-end owns each request).
`run_engine_core`: the process target.

Not here: scheduling and the model (`EngineCore`), address allocation and process
spawning (`dpserve.launch`), the data-parallel part (`DPLink` in `dpserve.engine.dp`:
coordinator link, lockstep waves; held when the init metadata names a coordinator).

Sockets of engine `rank` (identity = `engine_identity(rank)`):

    handshake  DEALER -> launcher ROUTER   HandshakeHello / EngineInitMetadata / HandshakeReady
    input i    DEALER -> front-end i ROUTER  [RequestType byte, msgpack body]; first an
               empty frame so the ROUTER learns (and can route to) this engine
    output i   PUSH   -> front-end i PULL    one msgpack EngineCoreOutputs per message; no
               blocking send: one that stops reading is dropped (engine/output_sender.py)
    DP (dp_size > 1): see `DPLink`; its coordinator SUB socket is read by the input
               thread, which queues START_DP_WAVE and REGROUP_DP as requests

A dying engine sends [ENGINE_CORE_DEAD, identity] on every output socket, so a
front-end with several engines knows which one died.

Signals (`_StopSignals`): SIGINT is ignored (Ctrl-C reaches the whole process group;
the launcher decides). The first SIGTERM stops an idle engine at once; an engine with
requests drains instead: new ADDs finish at once with ABORT, the requests in flight
run for up to `config.shutdown_timeout` s, then the rest are aborted (their final
outputs say ABORT) and it exits 0. A second SIGTERM exits at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import sys
import time
from typing import Any

import msgspec
import zmq

from dpserve.config import EngineConfig
from dpserve.engine.build import build_engine_core, place_engine
from dpserve.engine.control import ControlCalls, EngineControl
from dpserve.engine.dp import DPLink
from dpserve.engine.input_reader import CLIENT_NEWS, IO_FAILED, PEER_LOST
from dpserve.engine.io_threads import EngineIO
from dpserve.engine.output_sender import OutputRouter
from dpserve.logging_utils import name_process
from dpserve.parent_watch import start_parent_watcher
from dpserve.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInitMetadata,
    FinishReason,
    HandshakeHello,
    HandshakeReady,
    RequestType,
    SchedulerStats,
    UtilityCall,
    UtilityOutput,
    engine_identity,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 120.0  # wait for the launcher's init metadata
_IDLE_WAIT_S = 0.5  # the busy loop's longest block on an empty input queue

# Utility calls: the EngineCore's `UtilityTable` (every other name is refused by
# name, and the engine serves on), answered by the EngineCore unless the process
# answers them itself (these, with its own state included). Callers: server/ops/engines.py
# and app.py (/engines, /debug), async_llm.py's get_stats, the sync client, tests.
_PROC_UTILITIES = frozenset({"get_dp_state", "request_state_sizes"})
# Pause / sleep without a coordinator: `control(op, arg, token)` changes this engine's
# ControlState; answered (with the state) once it is reached.
_CONTROL_UTILITY = "control"



class EngineCoreProc:
    """Runs an EngineCore in this process, fed and drained by two IO threads.

    Construction does the whole start-up: handshake (HELLO -> init
    metadata), build the EngineCore (model + KV cache), start the IO threads
    (they connect and register with every front-end), then send READY.
    Without a handshake address (Ray actors) `init` is given and the READY
    message is only kept, as `self.ready`, for the caller.
    `run_busy_loop()` runs until SystemExit (signals) or a fatal error.
    """

    def __init__(self, config: EngineConfig, rank: int, handshake_address: str | None,
                 local: bool = True, init: EngineInitMetadata | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S, incarnation: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.incarnation = incarnation  # restarts of this rank before this process
        self.local = local  # on the launcher's host (else: watch the front-ends' links)
        self.secret = config.parallel.data_parallel_secret
        self.handshake_timeout = handshake_timeout
        self.identity = engine_identity(rank)
        # The input and output threads, and their queues.
        self.io = EngineIO(rank, self.identity, self.secret, not local, config.parallel)
        self.input_queue = self.io.input_queue
        self.drain_deadline: float | None = None  # set by a SIGTERM with requests in flight
        self._drain_logged = False
        self._result_checker = msgspec.msgpack.Encoder()
        self.dp: DPLink | None = None  # the data-parallel part, when dp_size > 1

        if handshake_address is None:  # addresses known before start (Ray actors)
            if init is None:
                raise ValueError("an engine without a handshake address needs its init metadata")
            self.ready = self._start(init, local)
        else:
            self.ready = self._start_with_handshake(handshake_address, local)
        logger.info("engine %d ready: %d KV blocks, serving %d front-end(s)", rank,
                    self.engine_core.num_kv_blocks, self.num_clients)

    def _start_with_handshake(self, handshake_address: str, local: bool) -> HandshakeReady:
        """HELLO -> init metadata -> start -> READY, over a DEALER to the launcher."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        linger_ms = 0  # on failure, do not wait to flush anything
        try:
            secure(sock, "client", self.secret)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            sock.connect(handshake_address)
            init = _say_hello(sock, local, handshake_address, self.handshake_timeout)
            ready = self._start(init, local)
            sock.send(msgspec.msgpack.encode(ready))
            linger_ms = 5000
        finally:
            sock.close(linger=linger_ms)
            ctx.term()  # returns once READY is delivered (or the linger ran out)
        return ready

    def _start(self, init: EngineInitMetadata, local: bool) -> HandshakeReady:
        """Build the engine and connect it as `init` says; return the READY message."""
        self.num_clients = len(init.output_addresses)
        # Which front-end owns each request; the queue the output thread empties.
        self.outputs = OutputRouter(self.rank, self.num_clients, self._stats,
                                    self.io.output_queue)
        # Subscribe now, so the coordinator hears from us while the model loads.
        self.dp = DPLink.from_init(init, self.config, self.rank, self.incarnation)
        place_engine(self.config, self.rank)
        if self.config.parallel.enable_expert_parallel and init.dp_size > 0 and \
                init.dp_size != self.config.parallel.data_parallel_size:
            # Elastic EP: a rank started (or restarted) after a change of the DP size
            # holds its share of the experts for the size now.
            self.config = dataclasses.replace(self.config, parallel=dataclasses.replace(
                self.config.parallel, data_parallel_size=init.dp_size))
        self.engine_core = build_engine_core(self.config, self.rank, self.incarnation,
                                             on_failure=self.io.fail)
        ep = self.engine_core.runner.expert_parallel
        if ep is not None and self.dp is not None:  # MoE layers use the lockstep DP group
            ep.group_source = self.dp.expert_group
        self.control = EngineControl(self.engine_core)  # pause / sleep (dpserve.control)
        self.control_calls = ControlCalls(
            self.control, self.rank, self.num_clients,
            send=self.outputs.put,
            publish=self._publish,
            report_done=self.dp.report_control_done if self.dp is not None else None)
        if self.dp is not None:  # all subscribed; READY brings the LoRA registry; group next
            self.engine_core.lora.replay(self.dp.wait_ready(), self.rank)
        # Start registering with the front-ends before READY: the launcher
        # starts them on READY, and the frames wait in our sockets till then.
        self.io.start(init, self.dp.take_publish_socket() if self.dp is not None else None)
        if self.dp is not None:
            self.dp.start_heartbeats(self.engine_core.workers.tp_worker_info)
        return HandshakeReady(local=local, num_kv_blocks=self.engine_core.num_kv_blocks,
                              # capped to what the KV cache holds
                              max_model_len=self.engine_core.scheduler.max_model_len)

    # ---- the busy loop ---------------------------------------------------

    def run_busy_loop(self) -> None:
        """Serve until SystemExit (a signal) or an exception (fatal)."""
        core = self.engine_core
        while True:
            # 0. Draining (SIGTERM): exit once no request is left.
            if self.drain_deadline is not None:
                self._drain_step()
            # 1. Take in everything the front-ends sent; block only when idle.
            self._process_input_queue()
            self.control_calls.check()
            if self.dp is not None and self.dp.needs_group():
                self._wait_for_group()  # lockstep: no steps outside a formed DP group
                continue
            self._report_load()
            # 2. Step the engine: schedule -> execute -> update.
            forward_passes = core.num_forward_passes
            outputs = core.step() if self.control.can_step else []  # paused/asleep: no
            # 3. Send each request's delta to the front-end that owns it; say when a
            #    pause / sleep state is reached.
            self._publish(outputs)
            self.control_calls.check()
            # 4. DP: lockstep bookkeeping (dummy batch, all-reduce, wave end),
            #    then tell the coordinator when [waiting, running] or the wave changed.
            if self.dp is not None:
                self.dp.step_done()
                has_work = core.has_unfinished_requests()
                # Paused / asleep on purpose is no stall (heartbeats); a lockstep wave
                # still runs while paused requests wait, so resume needs no wake-up.
                self.dp.has_work = has_work and self.control.can_step
                self.dp.kv_cache_usage = core.scheduler.kv_cache.usage
                update = core.scheduler.updater  # what the update slot counted
                self.dp.ttft_s, self.dp.ttft_at = (update.recent_ttft.mean(
                    time.monotonic()), time.monotonic())
                self.dp.generated_tokens = update.num_generated_tokens
                self.dp.lora = core.lora.report()
                self._leave_group_if_ep_failed()
                self.dp.after_step(executed=core.num_forward_passes > forward_passes,
                                   has_work=has_work,
                                   run_dummy_batch=self._dummy_batch
                                   if self.control.state.sleep_level == 0 else _no_dummy)
                self._report_load()

    def _dummy_batch(self) -> None:
        self.engine_core.execute_dummy_batch()
        self._leave_group_if_ep_failed()

    def _leave_group_if_ep_failed(self) -> None:
        """An expert-parallel collective failed (a peer died): leave the DP group and
        hold every request until the coordinator forms one with every rank again."""
        reason, self.engine_core.ep_failure = self.engine_core.ep_failure, None
        if reason is not None and self.dp is not None:
            self.dp.group_failed(f"expert-parallel collective: {reason}")

    def begin_drain(self) -> None:
        """Finish the requests in flight (up to the shutdown timeout), then exit.
        Called from the SIGTERM handler: it only sets the deadline."""
        self.drain_deadline = time.monotonic() + self.config.shutdown_timeout
        if self.dp is not None:
            self.dp.draining = True  # the next heartbeat: this rank takes no new work

    def _drain_step(self) -> None:
        """Raise SystemExit once no request is left; at the deadline, abort them first."""
        assert self.drain_deadline is not None
        if not self._drain_logged:
            self._drain_logged = True
            logger.info("engine %d: draining %d request(s) (up to %g s)", self.rank,
                        len(self.outputs.owner), self.config.shutdown_timeout)
        timed_out = time.monotonic() >= self.drain_deadline
        if timed_out and self.outputs.owner:
            logger.warning("engine %d: shutdown timeout: aborting %d request(s)", self.rank,
                           len(self.outputs.owner))
            self._publish(self.engine_core.abort_requests(list(self.outputs.owner)))
        if timed_out or not self.holds_work():
            self._take_queued()  # ADDs that came in meanwhile get their ABORT, not silence
            logger.info("engine %d: drained", self.rank)
            raise SystemExit(0)

    def holds_work(self) -> bool:
        """Requests here, or (expert parallel) a running wave: the other ranks' requests
        need this rank's experts until the wave ends everywhere."""
        return self.engine_core.has_unfinished_requests() or (
            self.dp is not None and self.dp.expert_parallel and self.dp.running)

    def _wait_for_group(self) -> None:
        """Lockstep without a DP group: hold every request (no step) until the
        coordinator names a generation with this rank, then join it."""
        assert self.dp is not None
        self.dp.has_work = False  # waiting, not stalled: no stall alarm meanwhile
        self._report_load()
        if not self.dp.join_pending(self.engine_core.has_unfinished_requests()):
            try:  # not named yet: wait for the coordinator, but not forever
                self._handle(*self.input_queue.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                pass

    def _report_load(self) -> None:
        if self.dp is not None:
            self.dp.report(self.engine_core.get_request_counts(),
                           self.engine_core.scheduler.num_waiting_tokens())

    def _process_input_queue(self) -> None:
        # Lockstep: a running wave keeps every engine stepping, work or not.
        idle = not (self.engine_core.has_unfinished_requests() and self.control.can_step) \
            and not (self.dp is not None and self.dp.running)
        if idle:
            try:  # nothing to step: wait, but not forever
                self._handle(*self.input_queue.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                return
        self._take_queued()

    def _take_queued(self) -> None:
        """Handle every input already queued, without waiting."""
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, request_type: Any, body: Any, client_index: int) -> None:
        if request_type is RequestType.ADD:
            self._add_request(body, client_index)
        elif request_type is RequestType.ABORT:
            self._publish(self.engine_core.abort_requests(body))
        elif request_type is RequestType.UTILITY:
            self._call_utility(body, client_index)
        elif request_type is RequestType.START_DP_WAVE:
            if self.dp is not None:
                self.dp.on_start_wave(body)
        elif request_type is RequestType.REGROUP_DP:
            if self.dp is not None:
                self.dp.on_regroup(body)
                size = self.dp.take_reshard()
                if size is not None:  # elastic EP: this rank's new share of the experts
                    self.engine_core.executor.collective_rpc("reshard_experts", self.rank, size)
        elif request_type is RequestType.CONTROL:
            self._publish(self.control.apply(body))
        elif request_type == IO_FAILED:  # an IO thread or a TP worker died
            raise RuntimeError(body)
        elif request_type == CLIENT_NEWS:
            self._client_news(client_index, body)
        elif request_type == PEER_LOST:
            logger.warning("engine %d: %s; shutting down", self.rank, body)
            raise SystemExit(0)
        else:
            logger.warning("ignoring request type %r (not handled by this engine)", request_type)

    def _add_request(self, request: EngineCoreRequest, source: int) -> None:
        """Queue a request; a bad one finishes at once with ABORT, the engine lives on."""
        client = request.client_index
        try:
            if not 0 <= client < self.num_clients:
                client = source  # answer where it came from
                raise ValueError(f"client_index {request.client_index} is out of range "
                                 f"(this engine serves {self.num_clients} front-ends)")
            if self.drain_deadline is not None:
                raise ValueError("the engine is shutting down")
            if client in self.outputs.dropped:
                raise ValueError(f"front-end {client} was dropped for leaving outputs unread")
            if self.control.rejects_new:
                raise ValueError("the engine is paused or asleep")
            if self.dp is not None:
                self.dp.on_request(request.current_wave)
            self.engine_core.add_request(request)
        except ValueError as e:
            logger.warning("rejected request %s: %s", request.request_id, e)
            rejected = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)
            self.outputs.send(client, [rejected])
            return
        self.outputs.owner[request.request_id] = client

    def _call_utility(self, call: UtilityCall, client_index: int) -> None:
        """Run a utility (`_PROC_UTILITIES`, `control`, the core's table); any
        other name, and any failure, is answered with an error, never fatal."""
        out = UtilityOutput(call.call_id)
        if call.method == _CONTROL_UTILITY:
            self.control_calls.call(call, client_index)
            return
        try:
            if call.method in _PROC_UTILITIES:
                result = getattr(self, call.method)(*call.args)
            else:  # AttributeError for a name the table lacks
                result = self.engine_core.call_utility(call.method, *call.args)
            self._result_checker.encode(result)  # fail here, not in the output thread
            out.result = result
        except Exception as e:
            logger.warning("utility call %s%s failed: %s", call.method, tuple(call.args), e)
            out.failure_message = f"{call.method}() failed: {type(e).__name__}: {e}"
        self.outputs.put(client_index, EngineCoreOutputs(
            engine_index=self.rank, utility_output=out, timestamp=time.monotonic()))

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        """Outputs to their front-ends (`OutputRouter`); idle: stats to all."""
        self.outputs.publish(outputs, idle=not self.engine_core.has_unfinished_requests())

    def _stats(self) -> SchedulerStats:
        stats = self.engine_core.get_stats()
        if self.dp is not None:
            stats.wave = self.dp.wave
        return stats

    def _client_news(self, client: int, reason: str | None) -> None:
        """A front-end dropped for not reading (`reason`): abort its requests, take no new
        ones until it reads again (None); their ends reach it then (OutputSender)."""
        if reason is None:
            self.outputs.dropped.discard(client)
            return
        ids = self.outputs.drop(client)
        logger.warning("engine %d: dropped front-end %d: %s; aborting its %d request(s)",
                       self.rank, client, reason, len(ids))
        self._publish(self.engine_core.abort_requests(ids))
        self.outputs.put(client, None)  # after the aborts: it may come back

    def request_state_sizes(self) -> dict[str, int]:
        """Utility: the core's sizes, the routing map and the drops (`OutputRouter`)."""
        return {**self.engine_core.request_state_sizes(), **self.outputs.sizes()}

    def get_dp_state(self) -> dict[str, int | bool] | None:
        """Utility: this engine's DP state (wave, dummy batches...); None without DP."""
        return self.dp.state() if self.dp is not None else None

    # ---- the end -----------------------------------------------------------

    def send_engine_dead(self) -> None:
        """Tell every front-end this engine is dead; wait (bounded) for the flush."""
        self.io.send_engine_dead()

    def shutdown(self) -> None:
        """Stop the TP workers, then the IO threads (bounded); queued outputs go first."""
        self.engine_core.shutdown()
        self.io.stop()
        if self.dp is not None:
            self.dp.close()


def _no_dummy() -> None:
    """Asleep (no KV cache, maybe no weights): keep the lockstep count, run nothing."""


def _say_hello(sock: zmq.Socket, local: bool, address: str,
               timeout: float) -> EngineInitMetadata:
    sock.send(msgspec.msgpack.encode(HandshakeHello(local=local)))
    if not sock.poll(timeout=int(timeout * 1000)):
        raise TimeoutError(f"no init metadata from the launcher at {address} within "
                           f"{timeout:g} s of HELLO (is the head running there, with the "
                           f"same data-parallel secret?)")
    return msgspec.msgpack.decode(sock.recv(), type=EngineInitMetadata)


# ---- process entry point ----------------------------------------------------


def run_engine_core(config: EngineConfig, rank: int, handshake_address: str,
                    local: bool = True, handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                    incarnation: int = 0) -> None:
    """Multiprocessing target: start one engine and serve until told to stop.

    Exit code 0 after SIGTERM (a drain, see the module docstring) or when the
    parent dies; 1 after a start-up failure or a fatal error, which is logged
    with its traceback and, once serving, announced with ENGINE_CORE_DEAD on
    every output socket.
    """
    name_process(f"EngineCore_{rank}")
    signals = _StopSignals()
    parent = multiprocessing.parent_process()  # None when not started by multiprocessing
    start_parent_watcher(parent.pid if parent is not None else os.getppid(), f"engine {rank}")
    proc: EngineCoreProc | None = None
    exit_code = 0
    try:
        proc = EngineCoreProc(config, rank, handshake_address, local,
                              handshake_timeout=handshake_timeout, incarnation=incarnation)
        signals.proc = proc
        proc.run_busy_loop()
    except SystemExit:
        signals.exiting = True
        logger.info("engine %d shutting down", rank)
    except BaseException as e:
        exit_code = 1
        if proc is None and isinstance(e, TimeoutError):  # a peer never came: no traceback
            logger.error("engine %d failed to start: %s", rank, e)
        elif proc is None:
            logger.exception("engine %d failed to start", rank)
        else:
            logger.exception("engine %d hit a fatal error", rank)
            proc.send_engine_dead()
    finally:
        if proc is not None:
            proc.shutdown()
    _exit_now(exit_code)


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: the IO threads are joined and the
    sockets flushed; unloading torch and the model would take another second or
    more, for every engine of every stop."""
    from multiprocessing import util

    util._exit_function()  # multiprocessing's finalizers: its semaphores are released
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class _StopSignals:
    """An engine process's SIGTERM/SIGINT (module docstring); installs itself.

    SIGTERM raises SystemExit in the main thread when the engine is not
    serving yet, is idle (under expert parallelism: outside a running wave too)
    or already drains; otherwise it only starts the
    drain. Once SystemExit was raised, signals no longer interrupt the cleanup.
    """

    def __init__(self) -> None:
        self.proc: EngineCoreProc | None = None  # set once serving
        self.exiting = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT or self.exiting:
            return
        proc = self.proc
        if proc is None or proc.drain_deadline is not None or not proc.holds_work():
            self.exiting = True
            raise SystemExit(0)
        proc.begin_drain()
