"""A tensor-parallel worker process, and what worker 0 sends it.

Scope: the process target `run_tp_worker` (worker t > 0 of a DP rank: title
`dpserve::TPWorker_<dp_rank>_<t>`, its device or cores, its `ModelRunner`
holding shard t, then a loop over the broadcast), the forming of a rank's TP
group (`form_group`, also called by worker 0), where each worker runs
(`worker_config`: its threads; `worker_device`, `worker_cpus`; worker 0 too,
through `engine.build`) and the trimmed step a peer gets (`peer_step`).

Messages (worker 0 -> peers, one broadcast each, `shm_broadcast`):

    ("execute", SchedulerOutput)       run the step; no reply (worker 0 samples)
    ("rpc", method, args, kwargs)      run ModelRunner.<method>; reply on the pipe
    ("shutdown",)                      leave the loop and exit 0

Replies (peer -> worker 0, its own pipe): ("hello", pid) once attached,
("ready", device) once its model is loaded, ("ok", result) / ("error", text)
for each rpc. Any failure is reported, logged with its traceback, and ends
the process (exit 1): the group's collectives cannot go on without it, and
worker 0's monitor takes the whole DP rank down.

Not here: starting, watching and stopping the workers (`dpserve.engine.executor`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import sys
from typing import Any

from dpserve.config import EngineConfig
from dpserve.engine.shm_broadcast import BroadcastHandle, BroadcastReader
from dpserve.errors import ExpertParallelError
from dpserve.sampling_params import SamplingParams
from dpserve.step import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

GROUP_FORM_TIMEOUT_S = 120.0  # every worker is alive and forming it when this starts
_NO_PROMPT_LOGPROBS = SamplingParams()  # what a peer reads of most requests' params


def worker_config(config: EngineConfig) -> EngineConfig:
    """The config every worker of a rank runs with: `threads_per_engine // N` torch
    threads each (at least 1; unset: 1)."""
    parallel = config.parallel
    threads = max(1, (parallel.threads_per_engine or 1) // parallel.tensor_parallel_size)
    return dataclasses.replace(config, parallel=dataclasses.replace(
        parallel, threads_per_engine=threads))


def form_group(store_path: str, tp_rank: int, size: int, device: str,
               collective_timeout: float) -> Any:
    """This worker's handle of the rank's TP group: gloo on loopback (a TP group is
    on one host) or NCCL on CUDA, rendezvous through a FileStore at `store_path`.
    Collectives time out after `collective_timeout` s."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, size)
    store.set_timeout(datetime.timedelta(seconds=GROUP_FORM_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=collective_timeout)
    if device == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return dist.ProcessGroupNCCL(store, tp_rank, size, nccl)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, tp_rank, size, gloo)


def worker_device(config: EngineConfig, rank: int, tp_rank: int) -> int:
    """The visible CUDA device of tensor-parallel worker `tp_rank` of DP rank `rank`:
    local rank r, worker t -> r*N + t (shared, with a warning, when too few)."""
    import torch

    size = config.parallel.tensor_parallel_size
    index = (rank - config.parallel.data_parallel_start_rank) * size + tp_rank
    count = torch.cuda.device_count()
    if index >= count:
        logger.warning("engine %d, worker %d: device %d wanted but only %d CUDA device(s) "
                       "visible; sharing device %d", rank, tp_rank, index, count, index % count)
    return index % count


def worker_cpus(config: EngineConfig, rank: int, tp_rank: int) -> list[int] | None:
    """The cores of tensor-parallel worker `tp_rank` of DP rank `rank`: its equal
    slice of the rank's core list (`ParallelConfig.cpu_groups`), None when the rank
    is not bound. With fewer cores than workers, workers share them round-robin."""
    groups = config.parallel.cpu_groups
    local_rank = rank - config.parallel.data_parallel_start_rank
    if not groups or not 0 <= local_rank < len(groups):
        return None
    cores, size = list(groups[local_rank]), config.parallel.tensor_parallel_size
    if len(cores) < size:
        return [cores[tp_rank % len(cores)]]
    per = len(cores) // size
    return cores[tp_rank * per:(tp_rank + 1) * per]


def bind_cpus(cores: list[int], what: str) -> bool:
    """Keep this process (its torch threads, created after this) on `cores`; False
    (logged) when they were taken away since the launcher looked."""
    try:
        os.sched_setaffinity(0, cores)
    except OSError as e:
        logger.warning("%s: could not bind to cores %s (%s); not bound", what,
                       ",".join(map(str, cores)), e)
        return False
    logger.info("%s: bound to CPU core(s) %s", what, ",".join(map(str, cores)))
    return True


def device_name(device: Any) -> str:
    """"cpu", or "cuda:<index>" of the current device (a runner's device is plain "cuda")."""
    if device.type != "cuda":
        return str(device)
    import torch

    return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"


def peer_step(so: SchedulerOutput, block_size: int) -> SchedulerOutput:
    """What a peer needs of a step: each request's window of tokens (the step's, drafts
    included, plus the next known one: a prompt-logprobs target), its drafts (the
    logits rows every worker computes), the blocks the step reaches, and
    of its SamplingParams only prompt_logprobs, its LoRA slot (and the step's LoRA
    plan and host-tier copies); no grammar, no finished ids (peers keep no per-request state)."""
    return SchedulerOutput([_peer_request(s, block_size) for s in so.scheduled],
                           so.num_decodes, so.total_num_tokens, lora=so.lora,
                           kv_transfer=so.kv_transfer)


def _peer_request(s: ScheduledRequest, block_size: int) -> ScheduledRequest:
    end = s.start + s.num_new_tokens
    k = s.sampling_params.prompt_logprobs
    return ScheduledRequest(
        s.req_id, s.tokens(s.start, end + 1), s.num_prompt_tokens, s.start, s.num_new_tokens,
        s.block_ids[:-(-end // block_size)], s.sample,
        _NO_PROMPT_LOGPROBS if k is None else SamplingParams(prompt_logprobs=k), None,
        needs_prompt_logprobs=s.needs_prompt_logprobs, token_offset=s.start,
        lora_slot=s.lora_slot, spec_token_ids=s.spec_token_ids)  # (logits rows: the same)


def run_tp_worker(config: EngineConfig, dp_rank: int, tp_rank: int, store_path: str,
                  handle: BroadcastHandle, conn: Any, device_index: int | None,
                  cpus: list[int] | None) -> None:
    """Process target of worker `tp_rank` > 0: serve the broadcast until shutdown,
    the engine core's death (parent watch, or the broadcast's writer check) or a
    failure (reported on `conn`, exit 1)."""
    from dpserve.logging_utils import name_process
    from dpserve.parent_watch import start_parent_watcher

    name_process(f"TPWorker_{dp_rank}_{tp_rank}")
    # A signal to the whole process group (Ctrl-C in a terminal, a group SIGTERM)
    # is the engine core's to act on: it drains, then stops its workers. A worker
    # that left on its own would take the rank down with every stream in it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    start_parent_watcher(handle.writer_pid, f"tensor-parallel worker {dp_rank}.{tp_rank}")
    try:
        reader = BroadcastReader(handle, tp_rank - 1)
        conn.send(("hello", os.getpid()))
        runner = _start_runner(config, dp_rank, tp_rank, store_path, device_index, cpus)
        conn.send(("ready", device_name(runner.device)))
        _serve(reader, runner, conn)
    except BaseException as e:  # noqa: BLE001 - reported, then this worker ends
        logger.exception("tensor-parallel worker %d.%d failed", dp_rank, tp_rank)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, ValueError):  # worker 0 is gone
            pass
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown (unloading torch and the model takes
    seconds), after multiprocessing's finalizers: the semaphores this process
    created (tqdm's lock) are released."""
    from multiprocessing import util

    util._exit_function()  # type: ignore[attr-defined]
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def _start_runner(config: EngineConfig, dp_rank: int, tp_rank: int, store_path: str,
                  device_index: int | None, cpus: list[int] | None) -> Any:
    """Place this worker (device or cores), form the group, load shard `tp_rank`."""
    from dpserve.model.runner import ModelRunner
    from dpserve.model.tensor_parallel import TensorParallel

    what = f"tensor-parallel worker {dp_rank}.{tp_rank}"
    if device_index is not None:
        import torch

        torch.cuda.set_device(device_index)
        logger.info("%s: CUDA device %d", what, device_index)
    if cpus is not None:
        bind_cpus(cpus, what)
    size = config.parallel.tensor_parallel_size
    group = form_group(store_path, tp_rank, size, config.device,
                       config.parallel.data_parallel_collective_timeout)
    return ModelRunner(config, dp_rank, TensorParallel(tp_rank, size, group))


def _serve(reader: BroadcastReader, runner: Any, conn: Any) -> None:
    """1. take the next message; 2. run it; 3. reply to an rpc. Until shutdown."""
    while True:
        message = reader.dequeue()  # BroadcastError once worker 0 is gone
        kind = message[0]
        if kind == "execute":
            try:
                runner.execute(message[1])
            except ExpertParallelError as e:  # worker 0 raised it on the same forward
                logger.warning("step dropped: %s", e)
        elif kind == "rpc":
            _, method, args, kwargs = message
            try:
                conn.send(("ok", getattr(runner, method)(*args, **kwargs)))
            except ExpertParallelError as e:  # as above (a lockstep dummy batch)
                conn.send(("error", f"{type(e).__name__}: {e}"))
        elif kind == "shutdown":
            reader.close()
            return
        else:
            raise ValueError(f"unknown tensor-parallel message {kind!r}")
