"""EngineCore: the in-process, IO-free engine.

It owns the scheduler, the KV-cache manager (inside the scheduler) and the
model runner. `step()` is schedule -> execute -> update and returns the new
tokens of each request that made progress. No sockets, no threads: a process
wrapper or the offline `LLM` drives it.

Utility calls (what a front-end may ask between two steps) go through its
`UtilityTable` (`dpserve.engine.utilities`): `call_utility(name, *args)`. The
core registers its views there, and each feature its own calls.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from dpserve import tracing
from dpserve.config import EngineConfig
from dpserve.engine.executor import make_executor
from dpserve.engine.kv_connector import make_host_tier
from dpserve.engine.lora_sync import EngineLoRA
from dpserve.engine.request import Request, RequestStatus
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.utilities import UtilityTable, WorkerUtilities
from dpserve.errors import ExpertParallelError
from dpserve.prompt import check_prompt
from dpserve.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from dpserve.step import ModelRunnerOutput
from dpserve.structured.manager import StructuredOutputManager
from dpserve.tracing.engine_trace import RequestTrace

logger = logging.getLogger(__name__)

_EMPTY_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class EngineCore:
    def __init__(self, config: EngineConfig, dp_rank: int = 0) -> None:
        start = time.monotonic()
        self.config = config
        self.dp_rank = dp_rank
        # The model on one worker, or on the N of tensor parallelism (this process
        # is worker 0). The rank picks its experts under EP.
        self.executor = make_executor(config, dp_rank)
        self.runner = self.executor.driver  # worker 0's: read here, changed via executor
        try:
            # The block count is a run-time result: it travels as a value, the
            # config stays as the user resolved it. Every worker must hold it.
            self.num_kv_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
            self.executor.collective_rpc("initialize_kv_cache", self.num_kv_blocks)
            # The host's KV tier (--kv-offload-memory; None: off, nothing changes).
            kv_tier = make_host_tier(config, self.executor, dp_rank)
        except BaseException:
            self.executor.shutdown()
            raise
        # LoRA adapters (--enable-lora): registered, on the host, resident in slots.
        self.lora = EngineLoRA(config.lora, self.executor)
        manager = self.lora.manager
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_kv_blocks,
                                   lora_fits=manager.fits if manager else None,
                                   kv_connector=kv_tier)
        try:
            for name, path in config.lora.modules if config.lora else ():
                self.lora.add(name, path)
        except BaseException:
            self.executor.shutdown()
            raise
        # What a front-end may call between two steps: the core's views, each feature's.
        self.utilities = UtilityTable()
        self.utilities.register(get_stats=self.get_stats,
                                get_request_counts=self.get_request_counts,
                                reset_prefix_cache=self.reset_prefix_cache,
                                request_state_sizes=self.request_state_sizes)
        self.workers = WorkerUtilities(self.executor, config.model.path)
        self.workers.register(self.utilities)
        self.lora.register(self.utilities)
        self.vocab_size = int(config.model.hf_config["vocab_size"])
        # Requests with structured output wait here until their grammar is compiled.
        self.structured = StructuredOutputManager(
            config.model.tokenizer, self.vocab_size,
            compile_timeout=config.limits.structured_outputs_compile_timeout)
        self.num_forward_passes = 0  # model executions by step(), cumulative
        self.ep_failure: str | None = None  # set when an expert-parallel collective failed
        # First legs of prefill/decode handoffs (`do_remote_decode`) not finished yet.
        self.handoffs: set[str] = set()
        logger.info("engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens)",
                    time.monotonic() - start, self.num_kv_blocks, config.cache.block_size,
                    self.num_kv_blocks * config.cache.block_size)

    # ---- requests -------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; raises ValueError if it can never run."""
        ids = request.prompt_token_ids
        prior = request.prior_output_token_ids or []
        check_prompt(ids, self.config.model.max_model_len, self.vocab_size,
                     prior_token_ids=prior, max_tokens=0 if request.pooling else None)
        if request.pooling is not None:
            self._check_pooling(request)
        limits, stops = self.config.limits, request.sampling_params.stop_token_ids
        # The front-end appends the model's extra end ids: they do not count.
        eos, extra = set(self.config.model.eos_token_ids), 0
        while extra < min(len(eos), len(stops)) and stops[-1 - extra] in eos:
            extra += 1
        request.sampling_params.check_limits(limits.max_stop_token_ids + extra,
                                             limits.max_logit_bias)
        lora_id, lora_key = self.lora.acquire(request)
        req = Request(
            request.request_id, ids, request.sampling_params,
            eos_token_id=request.eos_token_id, arrival_time=request.arrival_time or None,
            prior_output_token_ids=prior, cache_salt=request.cache_salt,
            lora_id=lora_id, lora_cache_key=lora_key, pooling=request.pooling,
            priority=request.priority, tenant=request.tenant)
        if request.trace_headers is not None and tracing.active():
            req.trace = RequestTrace(request.trace_headers, self.dp_rank, len(prior))
        try:
            self._queue(req)
        except BaseException:
            if lora_id:  # the adapter this call acquired
                self.lora.release([req.request_id])
            raise
        if request.do_remote_decode:
            self.handoffs.add(req.request_id)

    def _check_pooling(self, request: EngineCoreRequest) -> None:
        """ValueError for a pooling request that cannot run: more dimensions than the
        hidden size, a structured-output constraint (nothing is sampled)."""
        assert request.pooling is not None
        hidden = int(self.config.model.hf_config["hidden_size"])
        dims = request.pooling.dimensions
        if dims is not None and dims > hidden:
            raise ValueError(f"request {request.request_id!r}: dimensions {dims} exceeds "
                             f"the model's hidden size ({hidden})")
        if request.sampling_params.structured_outputs is not None:
            raise ValueError(f"request {request.request_id!r}: a pooling request samples "
                             f"nothing, so it takes no structured output")

    def _queue(self, req: Request) -> None:
        if req.sampling_params.structured_outputs is None:
            self.scheduler.add_request(req)
            return
        if req.request_id in self.scheduler.requests or req.request_id in \
                self.structured.pending:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        if req.num_tokens > self.scheduler.max_model_len:  # as scheduler.add_request checks
            raise ValueError(f"request {req.request_id!r}: prompt of {req.num_tokens} tokens "
                             f"exceeds {self.scheduler.max_model_len} tokens")
        self.structured.add(req)  # to the scheduler once its grammar is compiled

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort requests; returns their final outputs (finish reason ABORT).

        Unknown or already finished ids are ignored.
        """
        outputs = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs += [EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ABORT)
                    for r in self.structured.abort(request_ids)]
        self.lora.release([o.request_id for o in outputs])
        self.handoffs.difference_update(request_ids)
        self._forget_if_idle()
        return outputs

    def unfinished_request_ids(self) -> list[str]:
        """Every request in the engine: scheduled or waiting for its grammar."""
        return [*self.scheduler.requests, *self.structured.pending]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.structured.pending)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_waiting, num_running); waiting counts those waiting for a grammar."""
        waiting, running = self.scheduler.get_request_counts()
        return waiting + len(self.structured.pending), running

    # ---- the step -------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step and return what each request got from it."""
        failed = self._admit_structured()
        if not self.scheduler.has_unfinished_requests():
            return failed
        # 1. Schedule: which requests compute how many tokens this step (and, with
        #    LoRA, which slot holds each one's adapter).
        scheduler_output = self.scheduler.schedule()
        self.lora.plan(scheduler_output)
        # 2. Execute: one forward pass over all of them, then sample.
        runner_output = _EMPTY_OUTPUT
        if not scheduler_output.is_empty:
            started = time.perf_counter()
            try:
                runner_output = self.executor.execute(scheduler_output)
            except ExpertParallelError as e:
                self.scheduler.tier.step_failed(scheduler_output)
                self.runner.forget_requests(scheduler_output.finished_req_ids)
                self._drop_failed_step(str(e))
                return []
            self.num_forward_passes += 1
            if self.scheduler.spec is not None:  # drafts are planned by what a row costs
                self.scheduler.spec.observe_step(scheduler_output, time.perf_counter() - started)
        # (host tier: the step's loads are done, its saves copied by worker 0)
        self.scheduler.tier.step_done(scheduler_output)
        # 3. Update: append tokens, check stops, free finished requests.
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.lora.release([o.request_id for o in failed + outputs if o.finished])
        if scheduler_output.is_empty:  # no step comes to prove the host-tier saves copied
            self._commit_kv_saves()
        if self.handoffs:
            self._commit_for_handoffs(failed + outputs)
        self._forget_if_idle()
        return failed + outputs

    def _commit_for_handoffs(self, outputs: list[EngineCoreOutput]) -> None:
        """Invariant: the first leg of a handoff finishes only once its prompt's full
        blocks are committed in the host's KV tier (the decode rank loads them as soon
        as the front-end sees this output). One worker commits right after execute;
        tensor parallel defers commits to the next step, so commit them now."""
        done = [o.request_id for o in outputs if o.finished and o.request_id in self.handoffs]
        if done:
            self.handoffs.difference_update(done)
            self._commit_kv_saves()

    def _admit_structured(self) -> list[EngineCoreOutput]:
        """0. Requests whose grammar is compiled go to the scheduler; with nothing else
        to run, wait a little for one (no busy spin). Returns failed requests' outputs."""
        if not self.structured.pending:
            return []
        if not self.scheduler.has_unfinished_requests():
            self.structured.wait(timeout=0.05)
        ready, failed = self.structured.take_ready()
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as e:  # checked in add_request; never fatal here
                logger.error("%s", e)
                failed.append((request, str(e)))
        # The reason travels to the client (`error`: its front-end fails the request).
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ABORT,
                                    error=f"request {r.request_id}: {e}")
                   for r, e in failed]  # (logged by the manager)
        self.lora.release([o.request_id for o in outputs])
        return outputs

    def _drop_failed_step(self, reason: str) -> None:
        """An expert-parallel collective failed mid-forward (a peer rank died): nothing
        of the step is kept. Every running request is preempted (it recomputes its
        prompt and outputs so far later) and the prefix cache is dropped, since
        blocks of this step may hold partial KV. `ep_failure` tells the engine
        process to leave the DP group."""
        logger.warning("expert-parallel step failed (%s): %d running request(s) preempted, "
                       "prefix cache dropped", reason.splitlines()[0],
                       len(self.scheduler.running))
        self.scheduler.preempt_all()
        self.scheduler.reset_prefix_cache()
        self.ep_failure = reason

    def _forget_if_idle(self) -> None:
        """With nothing left to schedule, no step will carry the ids of the requests that
        just finished to the runner: hand them over now, so nothing of theirs stays
        (nor does a host-tier save wait for a step to commit it)."""
        if not self.has_unfinished_requests():
            self.runner.forget_requests(self.scheduler.take_finished_ids())
            self._commit_kv_saves()

    def _commit_kv_saves(self) -> None:
        """Tensor parallel: host-tier saves wait for the next step to prove that every
        worker copied them (`HostTierConnector`); with no step coming (idle, or
        nothing to run), an rpc that every worker answers proves it instead."""
        tier = self.scheduler.tier.connector
        if tier is not None and tier.has_pending_commits():
            self.executor.collective_rpc("kv_tier_barrier")
            tier.commit_pending()

    # ---- views, utility calls, sleep and the end ------------------------------

    def call_utility(self, name: str, *args: Any) -> Any:
        """Run utility `name` (`UtilityTable`); AttributeError for one not registered."""
        return self.utilities.call(name, *args)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False if requests still hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def request_state_sizes(self) -> dict[str, int]:
        """Entries in every per-request structure of the scheduler, KV manager and model
        runner (leak checks: all 0, with every KV block free, once idle)."""
        return {**self.scheduler.state_sizes(), "generators": len(self.runner.generators),
                "grammar_pending": len(self.structured.pending),
                "handoffs": len(self.handoffs),
                "lora_requests": self.lora.num_requests()}

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.num_waiting += len(self.structured.pending)
        if (tier := self.scheduler.tier.connector) is not None:
            stats.kv_tier_load_seconds = self.runner.kv_copier.load_seconds
            stats.kv_tier_num_blocks, stats.kv_tier_used_blocks = tier.store_blocks(
                time.monotonic())
        return stats

    def execute_dummy_batch(self) -> None:
        try:
            self.executor.execute_dummy()
        except ExpertParallelError as e:  # nothing to drop: the dummy computes nothing
            logger.warning("expert-parallel dummy batch failed (%s)", str(e).splitlines()[0])
            self.ep_failure = str(e)

    def sleep(self, level: int) -> None:
        """Free the KV cache (level 1) and the weights (level 2). Every request must
        be finished first (EngineControl aborts them); cached prefixes are forgotten."""
        if self.has_unfinished_requests():
            raise RuntimeError("sleep with requests in flight; abort them first")
        self.scheduler.reset_prefix_cache()
        self.executor.collective_rpc("set_sleep_level", level)

    def wake_up(self) -> None:
        """Restore what `sleep` freed; the KV cache (and the LoRA slots) come back empty."""
        self.executor.collective_rpc("set_sleep_level", 0)
        self.lora.wake_up()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the host tier, export the spans
        not yet sent (idempotent)."""
        if self.scheduler.tier.connector is not None:
            self.scheduler.tier.connector.close()
        if self.runner.profiler.running:  # a session left open: its trace, written
            with contextlib.suppress(Exception):
                self.workers.stop_profile()
        self.executor.shutdown()
        tracing.shutdown()
