"""Continuous-batching scheduler: which tokens of which requests run each step.

Scope: the waiting and running queues, the token budget, chunked prefill,
preemption by recompute, and turning sampled tokens into per-request deltas
with stop checks. It holds the `KVCacheManager`. It does not run models,
detokenize, or match stop strings (the front-end does that and aborts).

One step, as `EngineCore.step()` drives it:

    out = scheduler.schedule()                     # advances num_computed_tokens
    runner_out = model_runner.execute(out)         # one row per sample=True entry
    deltas = scheduler.update_from_output(out, runner_out)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dpserve.config import CacheConfig, SchedulerConfig
from dpserve.engine.kv_cache import KVCacheManager
from dpserve.engine.kv_connector import KVConnector, TierLink
from dpserve.engine.pooling import PoolingCounts
from dpserve.engine.request import Request, RequestStatus
from dpserve.engine.spec_decode import SpecDecoder
from dpserve.engine.step_update import StepUpdater
from dpserve.engine.waiting_queue import WaitingQueue
from dpserve.protocol import EngineCoreOutput, SchedulerStats
from dpserve.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    """What `schedule()` has decided so far this step."""

    budget: int  # tokens left
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids
    done: int = 0  # running[:done] had their turn (scheduled, or not for want of budget)
    ran_out: bool = False  # a running request needed blocks only preemption gave


class Scheduler:
    """Continuous batching under a token budget, with chunked prefill and preemption.

    Contract:

    * `add_request(request)` queues a new request (`WaitingQueue`: under
      `--scheduling-policy priority` by priority, then tenants in turn, then
      arrival; `fcfs`: arrival; engine/waiting_queue.py). An id that is
      still unfinished, or a prompt longer than `max_model_len`, raises
      ValueError (callers should validate earlier).
      Here `max_model_len` is the config's, capped to what the whole KV cache
      holds (`num_blocks * block_size`): a request reaching it finishes with
      LENGTH, so a small cache shortens requests rather than stalling them.
    * `schedule()` picks this step's work, priority level by priority level
      (fcfs: one level): at each, the running requests first, in order; each
      gets min(tokens it still needs, budget left); then the waiting ones.
      `running` stays ordered by priority, then admission. When blocks run
      out, the LAST running request (the least urgent, latest admitted) is
      preempted (blocks freed, status PREEMPTED, back at the front of its
      tenant's waiting queue; it later recomputes prompt + outputs, possibly
      from the prefix cache), and nothing is admitted in that step. Waiting
      requests are admitted in the queue's order (with LoRA, a request whose
      adapter does not fit the slots beside the running requests' waits,
      keeping its place, and those behind it may go), under `max_num_seqs`,
      with their prefill chunked to the budget left; when the next one lacks
      blocks or a slot, running requests of a strictly less urgent priority
      that had no turn yet are preempted for it (vLLM's priority policy), else
      nobody behind it goes. `num_computed_tokens` advances here.
    * With a KV connector (the host tier): a waiting request's blocks past its
      local prefix hits are looked up there (still leaving the last token to
      compute); the hits get blocks, are loaded at the start of the step and
      count as computed at once (they cost no token budget). Blocks the step
      makes full are offered to the store; `SchedulerOutput.kv_transfer` says
      what to copy, and `tier.step_done` / `tier.step_failed` follow the execute
      (`TierLink`, engine/kv_connector.py).
    * `update_from_output(out, runner_out)` appends sampled tokens, checks
      stops, frees finished requests at once, and returns one
      `EngineCoreOutput` per request that got a token or finished. Rows for
      requests finished or aborted since `schedule()` are skipped. The part
      `updater` does it (`StepUpdater`, engine/step_update.py).
    * `--speculative-config` (engine/spec_decode.py): a running request computing
      its last known token may also compute up to K drafts (those worth their rows,
      within the budget and the KV lookahead); `update_from_output` keeps the accepted
      ones and rolls back the rest.
    * A pooling request (`Request.pooling`) runs like a prefill, never sampled: the step
      computing its last prompt token finishes it (stop) with its vector (engine/pooling.py).
      `SchedulerOutput.has_pooling` is set only while the engine holds one.
    * `finish_requests(ids, status)` finishes requests from outside (abort:
      FINISHED_ABORTED) and frees their blocks at once. It RETURNS their
      final `EngineCoreOutput`s (no tokens, finish_reason e.g. ABORT); no
      later `update_from_output` reports them again. Unknown or finished ids
      are ignored. Their ids reach the model runner in the next
      `SchedulerOutput.finished_req_ids`.
    """

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int,
                 lora_fits: Callable[[set[int]], bool] | None = None,
                 kv_connector: KVConnector | None = None) -> None:
        self.config = config
        # LoRA: whether a set of adapters fits the device slots at once (the engine's
        # LoRAManager.fits); None: no adapters.
        self.lora_fits = lora_fits
        # Invariant: no request grows past what the whole cache holds, so the
        # first running request can always get its blocks (by preempting the
        # others) and nothing waits forever.
        capacity = num_blocks * cache_config.block_size
        self.max_model_len = min(config.max_model_len, capacity)
        if capacity < config.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: "
                           "requests stop (length) at %d tokens", capacity,
                           config.max_model_len, capacity)
        self.kv_cache = KVCacheManager(num_blocks, cache_config.block_size,
                                       cache_config.enable_prefix_caching)
        # The host tier (no connector: off, and nothing below costs anything).
        assert kv_connector is None or cache_config.enable_prefix_caching, (
            "the tier names blocks by their hashes")
        self.tier = TierLink(kv_connector, self.kv_cache)
        self.requests: dict[str, Request] = {}  # request_id -> unfinished request
        self.waiting = WaitingQueue(config.policy == "priority", self.max_model_len)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # finished since the last schedule()
        self.num_preemptions = 0
        self.pooling = PoolingCounts()  # pooling requests held now, finished, their steps
        # Draft-free speculative decoding (--speculative-config; None: off).
        self.spec = (SpecDecoder(config.speculative, self.max_model_len)
                     if config.speculative is not None else None)
        # The update slot: runner outputs -> tokens, stops, deltas (and their counts).
        self.updater = StepUpdater(self.max_model_len, self.kv_cache, self.spec, self.pooling)

    # ---- queues --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        if request.num_tokens > self.max_model_len:
            limit = ("max_model_len" if self.max_model_len == self.config.max_model_len
                     else "the KV cache size")
            raise ValueError(f"request {request.request_id!r}: prompt of "
                             f"{request.num_tokens} tokens exceeds {limit} "
                             f"({self.max_model_len} tokens)")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.pooling.held += request.pooling is not None

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        ) -> list[EngineCoreOutput]:
        """Finish requests from outside; returns their final outputs (see class doc)."""
        assert status.finished
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.status = status
            self._free_request(request)
            outputs.append(EngineCoreOutput(
                req_id, [], finish_reason=request.finish_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0)))
        if outputs:
            # One O(n) pass per call, not one removal per id.
            self.waiting.remove_finished()
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the waiting requests (front-ends' admission control)."""
        return sum(r.num_prompt_tokens for r in self.waiting)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_waiting, num_running)."""
        return len(self.waiting), len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished_ids(self) -> list[str]:
        """Ids of requests finished since the last call (each step's schedule() passes
        them to the model runner; an idle engine hands them over itself)."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def state_sizes(self) -> dict[str, int]:
        """How many entries each per-request structure holds (all 0 when idle)."""
        return {"requests": len(self.requests), "waiting": len(self.waiting),
                "running": len(self.running), "finished_pending": len(self._finished_ids),
                **self.kv_cache.state_sizes()}

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv, generated = self.kv_cache, self.updater.num_generated_tokens
        stats = SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running),
            kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=self.num_preemptions,
            num_free_blocks=kv.num_free_blocks, num_generated_tokens=generated,
            num_pooled_requests=self.pooling.requests, num_pooling_steps=self.pooling.steps,
            waiting_by_priority=self.waiting.counts_by_priority())
        if self.spec is not None:
            self.spec.counters.fill(stats)
        self.tier.fill(stats)
        return stats

    # ---- schedule ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens, level by level: running requests, then waiting ones."""
        step = _Step(self.config.max_num_batched_tokens)
        if self.spec is not None:  # the drafts worth their rows (engine/spec_decode.py)
            self.spec.plan(self.running)
        admit = True
        while True:
            # 1. Running requests at least as urgent as the first waiting one (all of
            #    them once admission is over); preempt the last when blocks run out.
            limit = self.waiting.first_priority() if admit and not step.ran_out else None
            self._schedule_running(step, limit)
            if limit is None or step.budget <= 0:
                break
            # 2. Waiting requests more urgent than the next running one (none in a step
            #    that ran out of blocks); again from 1. when that one's turn comes.
            admit = not step.ran_out and self._schedule_waiting(step)
        # 3. Decode-shaped entries (a token, or one and its drafts) first, as the runner reads.
        decodes = [s for s in step.scheduled if s.num_new_tokens == 1 or s.spec_token_ids]
        others = [s for s in step.scheduled if s.num_new_tokens != 1 and not s.spec_token_ids]
        finished = self.take_finished_ids()
        # 4. Host tier: offer the blocks this step makes full; the step's copies.
        transfer = self.tier.step_transfer(self.kv_cache)
        return SchedulerOutput(
            scheduled=decodes + others, num_decodes=len(decodes),
            total_num_tokens=sum(s.num_new_tokens for s in step.scheduled),
            preempted_req_ids=step.preempted, finished_req_ids=finished, kv_transfer=transfer,
            has_pooling=self.pooling.held > 0)

    def _schedule_running(self, step: _Step, limit: int | None) -> None:
        """Running requests from `step.done` on, up to the first less urgent than `limit`
        (None: to the end) or the end of the budget."""
        running = self.running
        while step.done < len(running) and step.budget > 0:
            request = running[step.done]
            if limit is not None and self.waiting.priority(request) > limit:
                return
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            assert num_new > 0, f"{request} is running with nothing to compute"
            if self.spec is not None and num_new == 1:  # with its drafts, if they fit
                block_ids, drafts = self.spec.allocate(self.kv_cache, request, step.budget - 1)
            else:
                block_ids, drafts = self.kv_cache.allocate_slots(request, num_new), 0
            while block_ids is None:
                victim = running.pop()  # after `done`, or request itself: no turn yet
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                step.ran_out = True
                if victim is request:
                    return  # the request itself was the last one left to preempt
                block_ids = self.kv_cache.allocate_slots(request, num_new)
            step.scheduled.append(_scheduled(request, num_new, block_ids))
            step.budget -= num_new + drafts
            step.done += 1

    def _schedule_waiting(self, step: _Step) -> bool:
        """Admit waiting requests in the queue's order; True when it stopped because
        the next running request is at least as urgent as the next waiting one."""
        # LoRA: a request whose adapter does not fit the slots beside the running
        # requests' adapters waits (set aside, its place in the queue kept); the
        # requests behind it may go.
        loras = {r.lora_id for r in self.running if r.lora_id}
        set_aside: list[Request] = []
        turn = False
        while step.budget > 0 and (request := self.waiting.peek()) is not None:
            priority = self.waiting.priority(request)
            if step.done < len(self.running) and \
                    self.waiting.priority(self.running[step.done]) <= priority:
                turn = True
                break
            if request.request_id in step.preempted:
                break  # made room for a more urgent one: back next step, not this one
            if (request.lora_id and request.lora_id not in loras
                    and self.lora_fits is not None
                    and not self.lora_fits(loras | {request.lora_id})):
                self.waiting.pop(request, charge=False)
                set_aside.append(request)
                continue
            if len(self.running) >= self.config.max_num_seqs or not self._admit(step, request):
                if self._make_room(step, priority):
                    continue
                break  # nobody jumps the queue
            if request.lora_id:
                loras.add(request.lora_id)
        for request in reversed(set_aside):
            self.waiting.push_front(request)
        return turn

    def _admit(self, step: _Step, request: Request) -> bool:
        """Start the waiting `request` (the queue's next) if its first chunk gets blocks:
        into `running` at `step.done`, its chunk scheduled. False: no blocks."""
        hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
        num_loaded = self.tier.lookup(request, len(hit_blocks))  # host-tier hits after them
        num_new = min(request.num_tokens - num_hit - num_loaded, step.budget)
        block_ids = self.kv_cache.allocate_slots(request, num_loaded + num_new, hit_blocks)
        if block_ids is None:
            self.tier.admitted(request, None, 0, num_loaded)  # hits let go
            return False
        self.waiting.pop(request)
        assert request.num_computed_tokens == 0
        self.tier.admitted(request, block_ids, len(hit_blocks), num_loaded)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit + num_loaded
        if request.scheduled_at is None:
            request.scheduled_at = time.monotonic()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_loaded
        self.running.insert(step.done, request)  # after the as urgent, before the less
        step.done += 1
        step.scheduled.append(_scheduled(request, num_new, block_ids))
        step.budget -= num_new
        return True

    def _make_room(self, step: _Step, priority: int) -> bool:
        """Preempt the last running request for a waiting one of `priority` that lacks
        blocks or a slot, if it is strictly less urgent and had no turn this step."""
        running = self.running
        if step.done >= len(running) or self.waiting.priority(running[-1]) <= priority:
            return False
        victim = running.pop()
        self._preempt(victim)
        step.preempted.append(victim.request_id)
        return True

    def preempt_all(self) -> None:
        """Preempt every running request (a failed expert-parallel step)."""
        while self.running:
            self._preempt(self.running.pop())

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV; it will recompute prompt + outputs so far."""
        self.kv_cache.free(request)
        request.preempt()  # PREEMPTED, nothing computed
        self.num_preemptions += 1
        self.waiting.push_front(request)

    # ---- update --------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, free finished requests; one delta each.

        Rows of `runner_output` are matched to requests by id, so a request
        finished or aborted since `scheduler_output` was made is just skipped.
        """
        outputs, any_finished = self.updater.apply(self.requests, runner_output,
                                                   self._free_request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _free_request(self, request: Request) -> None:
        """Forget a finished request: free its blocks and tell the runner next step.
        The caller removes it from the waiting/running queues."""
        assert request.is_finished
        if request.trace is not None:  # its spans, now it is done here
            request.trace.finished(request)
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self.pooling.held -= request.pooling is not None


def _scheduled(request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
    start = request.num_computed_tokens
    request.num_computed_tokens = start + num_new
    return request.for_step(start, num_new, block_ids,
                            sample=start + num_new == request.num_tokens
                            and request.pooling is None)
