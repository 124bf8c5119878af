"""`BatchRunner`: the background task that runs batches inside an API server.

Every API server runs one (started with the app, stopped when it drains). It
claims one unfinished batch at a time from the shared `BatchStore` (a lease: one
API server runs a given batch; any of them shows its progress) and runs it:

    validating   every line checked (`check_file`, off the event loop): any bad
                 line -> failed, with OpenAI's `errors` naming the lines
    in_progress  the lines not yet answered, in file order, each through the
                 endpoint's serving function (`BatchHandler`: the same ones the
                 HTTP routes call, so the same checks, admission, balancer and
                 engines), at most `concurrency` at once; each result is
                 committed (`BatchStore.record`) before it counts
    finalizing   the output and error files written -> completed
    cancelling   (a cancel mark, polled) the lines in flight aborted -> cancelled,
                 with the files of the lines answered so far

Lowest priority: no new line starts while an engine has requests waiting (the DP
coordinator's counts; without one, this API server's requests past
`max_num_seqs`) or while the server is paused or asleep; a line refused for load
(429, 503) is retried, not answered; so is one over its tenant's --tenant-limits,
unless it alone is over a limit (the error names a `param`: it can never fit).

Stopping: when the server drains (or its engines die) or the lease is lost, the
lines in flight are cancelled (their engine requests aborted) and nothing more is
recorded; on a drain the lease is given back, so a server started on the same
state directory resumes the batch at once (after a SIGKILL: once the lease runs
out), skipping the lines recorded. So every line is answered exactly once.

Not here: the SQL (`dpserve.server.batches.store`), the line format
(`dpserve.server.batches.format`), the routes (`dpserve.server.batches.routes`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel

from dpserve.frontend.cluster import ClusterView
from dpserve.server.batches.format import (
    BatchLine,
    check_file,
    error_body,
    failed_line,
    output_line,
    parse_line,
    read_lines,
)
from dpserve.server.batches.store import BatchStore, Claimed
from dpserve.server.errors import APIError, to_api_error

logger = logging.getLogger(__name__)

# (a line's request body as JSON, the batch creator's key id) -> the endpoint's answer
BatchHandler = Callable[[bytes, "str | None"], Awaitable[BaseModel]]
IDLE_POLL_S = 0.5  # how often an idle runner looks for a batch to run
TURN_POLL_S = 0.05  # how often a runner waiting for its turn looks again
WATCH_S = 1.0  # how often a running batch's lease is renewed and its cancel mark read
RETRY_S = 1.0  # the wait before a line refused for load is sent again
READ_LINES = 256  # input lines read per trip to a worker thread
HOLD_LOG_S = 30.0  # a batch held for interactive work says so at most this often
_TENANT_LIMITS = ("max_requests_in_flight", "max_queued_tokens", "tokens_per_minute")
_RETRIED = ("too_many_requests", "server_paused", "server_sleeping", "engine_unavailable",
            "server_draining", "engine_dead", "tenant_ledger_unavailable")


class BatchRunner:
    """One API server's batch runner (module docstring)."""

    def __init__(self, store: BatchStore, handlers: Mapping[str, BatchHandler],
                 cluster: ClusterView, stopping: Callable[[], bool], runner_id: str,
                 concurrency: int, max_num_seqs: int) -> None:
        """`handlers`: endpoint url -> its serving function (a url without one is
        answered with an error line); `stopping()`: the server drains or is dead."""
        self.store = store
        self.handlers = dict(handlers)
        self.cluster = cluster
        self.stopping = stopping
        self.runner_id = runner_id
        self.concurrency = concurrency
        self.max_num_seqs = max_num_seqs

    async def run(self) -> None:
        """Claim and run batches until the server stops."""
        while not self.stopping():
            try:
                claimed = await self.store.claim(self.runner_id)
            except sqlite3.Error as e:
                logger.warning("cannot read the batch store: %s", e)
                claimed = None
            if claimed is None:
                await asyncio.sleep(IDLE_POLL_S)
                continue
            batch_id = claimed.batch["id"]
            try:
                await _BatchRun(self, claimed).run()
            except Exception:  # noqa: BLE001 - the runner outlives one batch's failure
                logger.exception("batch %s stopped", batch_id)
                await asyncio.sleep(IDLE_POLL_S)
            finally:
                # Given back (unless finished): the next claim may take it at once.
                await asyncio.shield(self._release(batch_id))

    async def _release(self, batch_id: str) -> None:
        try:
            await self.store.release(batch_id, self.runner_id)
        except sqlite3.Error as e:
            logger.warning("batch %s: cannot give back its lease: %s", batch_id, e)

    def engines_busy(self) -> bool:
        """Interactive work waits (or the server is paused / asleep): no new line."""
        control = self.cluster.control
        if control.paused is not None or control.sleep_level > 0:
            return True
        if self.cluster.has_coordinator:
            return any(r.waiting > 0 for r in self.cluster.ranks() if r.serving)
        return any(requests > self.max_num_seqs for requests, _ in self.cluster.queued())


class _BatchRun:
    """One claimed batch, run to its end or until the runner must stop."""

    def __init__(self, runner: BatchRunner, claimed: Claimed) -> None:
        self.runner = runner
        self.store = runner.store
        self.batch = claimed.batch
        self.id: str = claimed.batch["id"]
        self.api_key_id = claimed.api_key_id
        self.cancelled = claimed.cancel_requested
        self.lost = False  # the lease went to another API server
        self.free_slots = runner.concurrency  # lines it may start now
        self.hold_logged = -HOLD_LOG_S  # when a hold was last logged (monotonic)

    def halted(self) -> bool:
        """Stop starting lines: cancelled, lease lost, or the server stops."""
        return self.cancelled or self.lost or self.runner.stopping()

    async def run(self) -> None:
        status = self.batch["status"]
        if status == "validating" and not self.cancelled:
            if not await self._validate():
                return
            status = "in_progress"
        if status == "in_progress" and not self.cancelled:
            await self._run_lines()
        if self.lost or (self.runner.stopping() and not self.cancelled):
            return  # resumed later, by whoever claims it next
        if not self.cancelled and not await self._all_answered():
            return
        if self.cancelled:
            await self.store.finish(self.id, self.runner.runner_id, "cancelled",
                                    cancelled_at=int(time.time()))
            logger.info("batch %s cancelled", self.id)
            return
        if self.batch["status"] != "finalizing":
            await self.store.set_status(self.id, self.runner.runner_id, "finalizing",
                                        finalizing_at=int(time.time()))
        await self.store.finish(self.id, self.runner.runner_id, "completed",
                                completed_at=int(time.time()))
        logger.info("batch %s completed", self.id)

    async def _validate(self) -> bool:
        """Check every line: in_progress (True), or failed with the bad lines."""
        total, errors = await asyncio.to_thread(check_file, self.store.input_path(self.id),
                                                self.batch["endpoint"])
        if errors:
            await self.store.fail(self.id, self.runner.runner_id, errors)
            logger.info("batch %s failed validation (%d bad line(s))", self.id, len(errors))
            return False
        return await self.store.set_status(self.id, self.runner.runner_id, "in_progress",
                                           total=total, in_progress_at=int(time.time()))

    async def _run_lines(self) -> None:
        answered = await self.store.answered_lines(self.id)
        logger.info("batch %s: running (%d line(s) answered before)", self.id, len(answered))
        watch = asyncio.create_task(self._watch())
        tasks: set[asyncio.Task[None]] = set()
        try:
            async with aclosing(self._pending(answered)) as pending:
                async for line in pending:
                    if not await self._turn():
                        break
                    task = asyncio.create_task(self._answer(line))
                    tasks.add(task)
                    task.add_done_callback(self._line_done(tasks))
            while tasks and not self.halted():
                await asyncio.wait(set(tasks), timeout=TURN_POLL_S)
        finally:
            watch.cancel()
            for task in tasks:
                task.cancel()  # aborts its engine request
            if tasks:
                await asyncio.wait(set(tasks))
        counts = (await self.store.get(self.id) or {}).get("request_counts")
        logger.info("batch %s: %s%s", self.id, counts,
                    "" if not self.halted() else " (stopped)")

    async def _all_answered(self) -> bool:
        counts = (await self.store.get(self.id) or {})["request_counts"]
        if counts["completed"] + counts["failed"] == counts["total"]:
            return True
        logger.error("batch %s: %s lines answered, not finishing", self.id, counts)
        return False

    async def _pending(self, answered: set[int]) -> AsyncIterator[BatchLine]:
        """The lines not yet answered, in file order (read on a worker thread)."""
        lines = read_lines(self.store.input_path(self.id))
        try:
            while chunk := await asyncio.to_thread(
                    lambda: list(itertools.islice(lines, READ_LINES))):
                for number, text in chunk:
                    if number not in answered:
                        yield parse_line(text, number, self.batch["endpoint"])
        finally:
            lines.close()

    async def _turn(self) -> bool:
        """Wait for a free slot while the engines have no waiting work (and take it);
        False when the run must stop instead."""
        while not self.halted():
            if self.free_slots > 0:
                if not self.runner.engines_busy():
                    self.free_slots -= 1
                    return True
                self._log_hold()
            await asyncio.sleep(TURN_POLL_S)
        return False

    def _log_hold(self) -> None:
        """A line held for interactive work: said at most every `HOLD_LOG_S`."""
        now = time.monotonic()
        if now - self.hold_logged >= HOLD_LOG_S:
            self.hold_logged = now
            logger.info("batch %s: holding its next line: an engine has requests waiting "
                        "(or the server is paused)", self.id)

    def _line_done(self, tasks: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            self.free_slots += 1

        return done

    async def _watch(self) -> None:
        """Renew the lease and read the cancel mark until the run ends."""
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                held, cancel = await self.store.renew(self.id, self.runner.runner_id)
            except sqlite3.Error as e:
                logger.warning("batch %s: cannot renew its lease: %s", self.id, e)
                continue
            if not held:
                logger.warning("batch %s: its lease went to another API server", self.id)
            self.lost, self.cancelled = not held, cancel or self.cancelled

    async def _answer(self, line: BatchLine) -> None:
        """Run one line (retried while refused for load) and record its result."""
        while True:
            result = await self._dispatch(line)
            if result is not None:
                break
            if self.halted():
                return
            await asyncio.sleep(RETRY_S)
        ok, output = result
        if self.lost or self.runner.stopping():
            return  # not recorded: whoever resumes the batch answers it
        if not await asyncio.shield(self.store.record(self.id, self.runner.runner_id,
                                                      line.line, ok, output)):
            self.lost = True

    async def _dispatch(self, line: BatchLine) -> tuple[bool, dict[str, Any]] | None:
        """(succeeded, its output line), or None when refused for load (retry)."""
        handler = self.runner.handlers.get(line.url)
        if handler is None:
            return False, failed_line(line.custom_id, "unsupported_endpoint",
                                      f"{line.url} is not served by this server")
        try:
            if line.body.get("stream"):
                raise APIError(400, "stream is not supported in a batch", param="stream")
            answer = await handler(json.dumps(line.body).encode(), self.api_key_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the line's answer is the error
            error = to_api_error(e)
            if error.code in _RETRIED or (error.code in _TENANT_LIMITS and error.param is None):
                return None
            return False, output_line(line.custom_id, error.status_code, None, error_body(
                error.message, error.type, error.param, error.code))
        body = json.loads(answer.model_dump_json())
        return True, output_line(line.custom_id, 200, body.get("id"), body)
