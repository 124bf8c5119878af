"""DPLink: the data-parallel part of one engine process (held by `EngineCoreProc`).

Scope: this engine's link to the DP coordinator (built by `from_init` when the
init metadata names one): load reports (`report`), heartbeats from their own
thread, and in lockstep mode the request waves, dummy batches and the periodic
all-reduce that keep every engine stepping together, over the DP group
generation the coordinator names (`on_regroup`, `join_pending`).

Invariants: all engines run the same number of all-reduces per wave (they
leave a wave on the same one), so their collectives always match; an engine
without a formed group does not step; a failed collective is never fatal (the
engine leaves the group, says `group_failed` and waits, paused).

Sockets (the coordinator binds both): report PUSH -> coordinator PULL
(`EngineReport`); publish SUB <- coordinator XPUB (COORDINATOR_READY, then
START_DP_WAVE and REGROUP_DP; read here until READY, then handed to the input
thread). DP group: gloo, over the store the coordinator hosts.

Not here: the coordinator's side (`dpserve.launch.coordinator`), the engine's
loop (`dpserve.engine.process`).

Design: docs/design/dp-waves.md
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from dpserve.engine.step_update import TTFT_WINDOW_S
from dpserve.engine_config import EngineConfig
from dpserve.protocol import (
    COORDINATOR_READY,
    EngineInitMetadata,
    EngineReport,
    LoRAReport,
    RegroupDP,
    StartDPWave,
    TPWorkerInfo,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # wait for COORDINATOR_READY (all engines subscribed)
HEARTBEAT_S = 1.0  # heartbeats to the coordinator, from their own thread


class DPLink:
    """One engine's data-parallel part; module docstring, and docs/design/dp-waves.md.

    Connect at construction (so the subscription travels while the model
    loads); `wait_ready()` before serving; then the engine calls `on_request`
    / `on_start_wave` / `on_regroup` for inputs, `join_pending` while
    `needs_group()`, `after_step` after each step, `report` after each change.
    """

    @classmethod
    def from_init(cls, init: EngineInitMetadata, config: EngineConfig, rank: int,
                  incarnation: int) -> DPLink | None:
        """The link the launcher's init metadata names (None: no coordinator, DP 1)."""
        if init.coordinator_input is None or init.coordinator_output is None:
            return None
        parallel = config.parallel
        return cls(rank, init.dp_size, report_address=init.coordinator_output,
                   publish_address=init.coordinator_input,
                   secret=parallel.data_parallel_secret,
                   lockstep=parallel.data_parallel_lockstep, incarnation=incarnation,
                   sync_interval=parallel.data_parallel_sync_interval,
                   master_ip=init.dp_master_ip, master_port=init.dp_master_port,
                   kv_store_address=config.cache.kv_tier_remote_address,
                   collective_timeout=parallel.data_parallel_collective_timeout,
                   expert_parallel=parallel.enable_expert_parallel)

    def __init__(self, rank: int, dp_size: int, report_address: str, publish_address: str,
                 *, lockstep: bool = False, sync_interval: int = 32,
                 master_ip: str = "127.0.0.1", master_port: int = 0,
                 secret: str | None = None, incarnation: int = 0,
                 collective_timeout: float = 10.0, expert_parallel: bool = False,
                 kv_store_address: str | None = None) -> None:
        self.rank = rank
        self.incarnation = incarnation  # which process of this rank (restarts count up)
        self.has_work = False  # set by the busy loop after each step, read by heartbeats
        self.draining = False  # set on SIGTERM: heartbeats say so, front-ends stop sending
        self.kv_cache_usage = 0.0  # set by the busy loop after each step, read by heartbeats
        self.generated_tokens = 0  # ... and the output tokens sampled so far
        self.ttft_s = 0.0  # ... and the recent mean time to first token (at `ttft_at`;
        self.ttft_at = 0.0  # an engine idle for a whole window reports 0)
        self.lora: LoRAReport | None = None  # ... and its LoRA adapters (LoRA on)
        # Its host's KV store's tcp:// address (a server over several hosts): heartbeats
        # carry it to the front-ends, which ask that store for pulls.
        self.kv_store_address = kv_store_address or ""
        self._report_address = report_address
        self._secret = secret
        self._beats = threading.Event()  # set: heartbeats stop
        self.dp_size = dp_size
        self.lockstep = lockstep
        # Expert parallel: a group without every rank lacks experts, so it is not joined
        # (the engine holds its requests until a generation has every rank).
        self.expert_parallel = expert_parallel
        self._reshard_to: int | None = None  # elastic EP: a new DP size, not re-sharded yet
        self.sync_interval = sync_interval
        self.master = (master_ip, master_port)
        self.wave = 0  # the wave this engine is in (lockstep)
        self.running = False  # lockstep: in a running wave (else paused)
        self.dummy_batches = 0  # forward passes run only to keep in step
        self.all_reduces = 0
        self.group_all_reduces = 0  # ... of them in the current generation's group
        self._steps_since_sync = 0
        self._group = None  # torch.distributed ProcessGroupGloo of `generation` (lockstep)
        self._store = None  # ZmqStore: this engine's client of the coordinator's store
        self.collective_timeout = collective_timeout  # s: one join or all-reduce
        self.generation = 0  # the DP group generation named last (0: none yet)
        self.members: list[int] = []  # ... and its ranks
        self._pending = False  # named a member of `generation`, not joined yet
        self.regroups = 0  # generations joined
        self.group_failures = 0  # collectives or joins that failed here
        self._ctx = zmq.Context()
        self._report = secure(self._ctx.socket(zmq.PUSH), "client", secret)
        self._report.setsockopt(zmq.LINGER, 0)
        self._report.connect(report_address)
        self._publish: zmq.Socket | None = secure(self._ctx.socket(zmq.SUB), "client", secret)
        self._publish.setsockopt(zmq.LINGER, 0)
        self._publish.setsockopt(zmq.SUBSCRIBE, b"")
        self._publish.connect(publish_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._last_counts: tuple[int, ...] | None = None  # (waiting, running, tokens, wave)
        self._step = 0  # steps run so far: orders this engine's reports at the coordinator

    # ---- start-up ----------------------------------------------------------------

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, str]:
        """Block until the coordinator says READY; TimeoutError after `timeout` s.
        Returns the LoRA adapter registry READY carries (name -> path; {}: none)."""
        assert self._publish is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._publish.poll(int(left * 1000) + 1):
                raise TimeoutError(f"engine {self.rank}: no COORDINATOR_READY from the DP "
                                   f"coordinator within {timeout:.0f} s")
            frames = self._publish.recv_multipart()
            if frames[0] == COORDINATOR_READY:
                logger.info("engine %d: DP coordinator ready", self.rank)
                return msgspec.msgpack.decode(frames[1], type=dict[str, str]) \
                    if len(frames) > 1 else {}
            logger.debug("engine %d: ignoring coordinator message before READY", self.rank)

    def start_heartbeats(self, tp_workers: Callable[[], list[TPWorkerInfo]] | None = None
                         ) -> None:
        """Beat every `HEARTBEAT_S` from a thread with its own socket: `(step, has_work)`,
        and what /engines shows (`tp_workers()`: the rank's TP workers, their memory).

        The coordinator tells a frozen process (no beats) from a hung step
        (beats, work, but the step count stands still).
        """
        threading.Thread(target=self._beat, args=(tp_workers,),
                         name=f"EngineCore_{self.rank}_heartbeat", daemon=True).start()

    def _beat(self, tp_workers: Callable[[], list[TPWorkerInfo]] | None) -> None:
        ctx = zmq.Context()  # its own: sockets never cross threads
        sock = secure(ctx.socket(zmq.PUSH), "client", self._secret)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a coordinator away: drop beats, never pile up
        sock.connect(self._report_address)
        encoder = msgspec.msgpack.Encoder()
        pid, host = os.getpid(), socket.gethostname()
        try:
            while not self._beats.is_set():
                beat = EngineReport(self.rank, step=self._step, heartbeat=True,
                                    has_work=self.has_work, incarnation=self.incarnation,
                                    draining=self.draining,
                                    kv_cache_usage=self.kv_cache_usage,
                                    ttft_s=self.ttft_s if time.monotonic() - self.ttft_at
                                    < TTFT_WINDOW_S else 0.0,
                                    generated_tokens=self.generated_tokens, pid=pid,
                                    host=host, tp_workers=_workers(tp_workers),
                                    lora=self.lora,
                                    kv_store_address=self.kv_store_address)
                try:
                    sock.send(encoder.encode(beat), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self._beats.wait(HEARTBEAT_S)
        finally:
            sock.close()
            ctx.term()

    def take_publish_socket(self) -> zmq.Socket:
        """Hand the coordinator SUB socket to the thread that reads inputs from now on."""
        assert self._publish is not None, "the publish socket was already handed over"
        sock, self._publish = self._publish, None
        return sock

    # ---- waves (lockstep) -------------------------------------------------------------

    def on_request(self, request_wave: int) -> None:
        """A request stamped with the wave its front-end last saw has arrived."""
        if not self.lockstep or request_wave == self.wave:
            return
        if request_wave > self.wave:
            self.wave = request_wave
        elif not self.running:
            # That wave is over and the other engines may be paused: have the
            # coordinator start ours everywhere (we start it ourselves by stepping).
            self._send(EngineReport(self.rank, wave=self.wave, start_wave=self.wave))

    def on_start_wave(self, message: StartDPWave) -> None:
        """START_DP_WAVE from the coordinator."""
        if not self.lockstep or message.exclude_engine_index == self.rank:
            return
        if message.wave >= self.wave:
            self.wave = message.wave
            if not self.running:
                logger.debug("engine %d: starting wave %d", self.rank, message.wave)
                self.running = True

    def after_step(self, executed: bool, has_work: bool,
                   run_dummy_batch: Callable[[], None]) -> None:
        """Lockstep bookkeeping after one engine step (does nothing otherwise).

        Running until the every-`sync_interval`-steps all-reduce says no rank has
        work; a failed all-reduce leaves the group (see `_group_failed`)."""
        if not self.lockstep or self._group is None:
            return
        if not executed:
            if not has_work and not self.running:
                return  # paused and idle
            run_dummy_batch()  # running: the other ranks' collectives need our step
            self.dummy_batches += 1
            if self._group is None:  # its expert-parallel collectives failed: group left
                return
        self.running = True
        self._steps_since_sync += 1
        if self._steps_since_sync < self.sync_interval:
            return
        self._steps_since_sync = 0
        result = self._all_reduce_max([int(has_work)])
        if result is not None and not result[0]:
            self._end_wave()

    def _end_wave(self) -> None:
        """No member has work: pause; the group's leader tells the coordinator."""
        logger.debug("engine %d: wave %d finished", self.rank, self.wave)
        self.running = False
        if self.rank == (self.members[0] if self.members else 0):
            self._send(EngineReport(self.rank, wave=self.wave, wave_complete=self.wave))
        self.wave += 1

    # ---- the DP group (lockstep) --------------------------------------------------------

    def needs_group(self) -> bool:
        """Lockstep without a formed group: the engine must not step (it keeps its
        requests) until it has joined the generation the coordinator names."""
        return self.lockstep and self._group is None

    def on_regroup(self, message: RegroupDP) -> None:
        """REGROUP_DP: leave the current group; `join_pending` joins the new one if
        we are a member (else we wait for a generation that has us)."""
        if not self.lockstep or message.generation == self.generation:
            return
        logger.info("engine %d: DP group generation %d: ranks %s", self.rank,
                    message.generation, message.members)
        self._group = None
        self.generation, self.members = message.generation, list(message.members)
        self._pending = self.rank in self.members
        size = message.dp_size or self.dp_size
        if self.expert_parallel and self._pending and size != self.dp_size and \
                self.members == list(range(size)):
            # Elastic EP: every rank of the new size is here; the engine re-shards its
            # experts to (rank, size) before joining (`take_reshard`).
            self.dp_size = self._reshard_to = size
        if self.expert_parallel and self.members != list(range(self.dp_size)):
            logger.info("engine %d: expert parallel needs every rank's experts; holding "
                           "requests until the DP group has all %d ranks", self.rank,
                           self.dp_size)
            self._pending = False

    def take_reshard(self) -> int | None:
        """Expert parallel: the DP size to re-shard the experts to before joining (once);
        None when it did not change."""
        size, self._reshard_to = self._reshard_to, None
        return size

    def join_pending(self, has_work: bool) -> bool:
        """Join the generation named last, if we are a member and have not yet; then
        agree with the other members on (wave, running). Bounded by the collective
        timeout; a failure is reported and we wait for the next generation.
        False when there was nothing to join."""
        if not self._pending:
            return False
        self._pending = False
        import torch.distributed as dist

        from dpserve.engine.dp_store import GROUP_PREFIX, ZmqStore, gloo_device, store_address

        host, port = self.master
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        try:
            if self._store is None:  # one client for every generation (keys are prefixed)
                self._store = ZmqStore(store_address(host, port), self._secret, timeout)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [gloo_device(host)]  # gloo listens there, not everywhere
            self._group = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{GROUP_PREFIX}{self.generation}", self._store),
                self.members.index(self.rank), len(self.members), options)
        except (RuntimeError, OSError) as e:  # store/gloo errors: a member never came
            self._group_failed(f"joining: {e}")
            return True
        self.group_all_reduces = 0
        agreed = self._all_reduce_max([self.wave, int(has_work), int(self.running)])
        if agreed is None:
            return True
        self.regroups += 1
        self.wave, self._steps_since_sync = agreed[0], 0
        self.running = bool(agreed[1])
        if not agreed[1] and agreed[2]:  # a wave ran, and no member has work left
            self._end_wave()
        logger.info("engine %d: joined DP group generation %d (wave %d, %s)", self.rank,
                    self.generation, self.wave, "running" if self.running else "paused")
        return True

    def group_failed(self, reason: str) -> None:
        """A collective outside this class failed (expert parallel): leave the group."""
        if self._group is not None:
            self._group_failed(reason)

    def _group_failed(self, reason: str) -> None:
        """Leave the group, paused, and tell the coordinator (it forms the next)."""
        logger.warning("engine %d: DP group generation %d failed (%s); waiting for the "
                       "next generation", self.rank, self.generation, reason.splitlines()[0])
        self._group = None
        self.group_failures += 1
        self._send(EngineReport(self.rank, wave=self.wave, group_failed=self.generation))

    def _all_reduce_max(self, values: list[int]) -> list[int] | None:
        """Element-wise MAX over the group; None when it failed (group left)."""
        import torch
        import torch.distributed as dist

        assert self._group is not None
        tensor = torch.tensor(values, dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        try:
            self._group.allreduce([tensor], options).wait()
        except RuntimeError as e:  # a peer died (at once) or froze (after the timeout)
            self._group_failed(f"all-reduce: {e}")
            return None
        self.all_reduces += 1
        self.group_all_reduces += 1
        return [int(v) for v in tensor.tolist()]

    def expert_group(self) -> object | None:
        """The formed DP group (expert-parallel MoE layers run their collectives on it)."""
        return self._group

    # ---- load reports -------------------------------------------------------------------

    def step_done(self) -> None:
        """Count one engine step (reports carry the step they were taken after)."""
        self._step += 1

    def report(self, counts: tuple[int, int], waiting_tokens: int = 0) -> None:
        """Send `(waiting, running)` (and the waiting prompt tokens) with `(step, wave)`
        if counts or wave changed."""
        key = (*counts, waiting_tokens, self.wave)
        if key == self._last_counts:
            return
        if self._send(EngineReport(self.rank, request_counts=list(counts), step=self._step,
                                   wave=self.wave, waiting_tokens=waiting_tokens)):
            self._last_counts = key
        else:
            self._last_counts = None  # try again next time

    def report_control_done(self, seq: int) -> None:
        """Tell the coordinator this engine has reached pause / sleep state `seq`."""
        self._send(EngineReport(self.rank, control_done=seq))

    def state(self) -> dict[str, int | bool | list[int]]:
        """What the engine's `get_dp_state` utility call answers."""
        return dict(rank=self.rank, lockstep=self.lockstep, wave=self.wave,
                    running=self.running, dummy_batches=self.dummy_batches,
                    all_reduces=self.all_reduces, group_all_reduces=self.group_all_reduces,
                    steps=self._step,
                    generation=self.generation, members=list(self.members),
                    in_group=self._group is not None, regroups=self.regroups,
                    group_failures=self.group_failures)

    def _send(self, report: EngineReport) -> bool:
        try:
            self._report.send(self._encoder.encode(report), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # the coordinator is stuck or gone; the launcher watches it
            logger.warning("engine %d: could not queue a report to the DP coordinator",
                           self.rank)
            return False

    def close(self) -> None:
        self._beats.set()
        self._group = None
        if self._store is not None:
            self._store.close()
            self._store = None
        self._ctx.destroy(linger=0)


def _workers(source: Callable[[], list[TPWorkerInfo]] | None) -> list[TPWorkerInfo]:
    """The TP workers for a heartbeat; none when unknown or unreadable (a worker just
    died: the engine's monitor reports that, not the heartbeat)."""
    if source is None:
        return []
    try:
        return source()
    except Exception:  # noqa: BLE001 - a heartbeat never fails for a view
        return []
