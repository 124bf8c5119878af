"""Structured-output specs checked off the event loop, under a deadline.

`GrammarChecker.check(spec, field)` answers, for the API server, whether a spec
compiles for the model's tokenizer within `--structured-outputs-compile-timeout`
seconds, before the request is sent to an engine:

* it runs in one of `--structured-outputs-compile-workers` worker processes
  (`dpserve.structured.compile_worker`, all started at the first structured
  request; a worker's start-up is not part of the deadline), driven each by
  its own thread, so the event loop and every other stream go on meanwhile;
* past the deadline the worker is killed (the compile stops using a core) and
  the request gets a 400 naming the limit; a fresh worker is started in the
  background before the slot takes work again;
* a spec waits for a free worker while the pool makes progress: a burst of
  ordinary specs queues and is compiled in turn, however long the queue takes;
  once no worker has come free for twice the deadline (every worker stuck on a
  compile that will time out, or restarting), the waiting specs get a 503 with
  Retry-After (code `structured_outputs_busy`); and at most
  `MAX_WAITING_PER_WORKER` per worker wait at once (more: 503 at once), never
  an unbounded queue;
* verdicts (compiles, fails with a message, timed out) are remembered in an LRU
  of `VERDICT_CACHE_SIZE` entries keyed by the spec's sha256, so a repeated spec,
  good or pathological, is answered at once.

Not here: the size limits of specs (server/limits.py), the engine's compile
(`dpserve.structured.manager`, which has the same deadline as a backstop).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from dpserve.frontend.errors import RequestError
from dpserve.server.errors import APIError
from dpserve.structured.compile_worker import CompileTimeout, CompileWorker, WorkerFailed
from dpserve.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)

VERDICT_CACHE_SIZE = 1024
MAX_WAITING_PER_WORKER = 64
BUSY_RETRY_AFTER_S = 5
_TIMED_OUT = "timed out"


class GrammarChecker:
    """A pool of compile workers with a deadline (see the module docstring)."""

    def __init__(self, tokenizer: str, vocab_size: int, workers: int, timeout: float) -> None:
        self.timeout = timeout
        self.num_workers = workers
        self._workers = [CompileWorker(tokenizer, vocab_size) for _ in range(workers)]
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="dpserve-grammar-check")
        self._idle: asyncio.Queue[CompileWorker] | None = None  # made on the loop
        self._waiting = 0
        self._freed_at = 0.0  # monotonic time a worker last came free (or the pool started)
        self._verdicts: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
        self.num_timeouts = 0
        atexit.register(self.close)

    async def check(self, spec: StructuredOutputs, field: str) -> None:
        """Return if `spec` compiles in time; RequestError (400) naming `field` if it does
        not compile or not within the deadline; APIError 503 when every worker is busy."""
        kind, text = spec.key()
        key = hashlib.sha256(f"{kind}\0{text}".encode()).digest()
        if key not in self._verdicts:
            self._verdicts[key] = await self._compile(kind, text, field)
            while len(self._verdicts) > VERDICT_CACHE_SIZE:
                self._verdicts.popitem(last=False)
        self._verdicts.move_to_end(key)
        verdict = self._verdicts[key]
        if verdict == _TIMED_OUT:
            raise RequestError(f"{field}: the structured-output grammar did not compile "
                               f"within {self.timeout:g} s (the limit, "
                               f"--structured-outputs-compile-timeout={self.timeout:g}); "
                               f"simplify the schema", param=field,
                               code="structured_outputs_timeout")
        if verdict is not None:
            raise RequestError(f"{field}: {verdict}", param=field)

    async def _compile(self, kind: str, text: str, field: str) -> str | None:
        worker = await self._take_worker(field)
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._threads, _check, worker, kind, text, self.timeout)
        # The worker is free again when its thread is done with it, whatever happens to
        # this request (a client that leaves does not hand a busy worker to another).
        job.add_done_callback(lambda _: self._release(worker, job))
        try:
            verdict = await asyncio.shield(job)
        except WorkerFailed as e:
            raise APIError(503, f"structured outputs are unavailable: {e}",
                           type="server_error", code="structured_outputs_unavailable") from None
        if verdict == _TIMED_OUT:
            self.num_timeouts += 1
            logger.warning("%s: a structured-output spec (%s, %d bytes) did not compile "
                           "within %g s; its worker was killed", field, kind, len(text),
                           self.timeout)
        return verdict

    def _release(self, worker: CompileWorker, job: asyncio.Future) -> None:
        if not job.cancelled() and job.exception() is None and job.result() == _TIMED_OUT:
            # Start the killed worker's successor before the slot takes work again.
            restart = asyncio.get_running_loop().run_in_executor(self._threads, _restart,
                                                                 worker)
            restart.add_done_callback(lambda _: self._free(worker))
        else:
            self._free(worker)

    def _free(self, worker: CompileWorker) -> None:
        assert self._idle is not None
        self._freed_at = time.monotonic()
        self._idle.put_nowait(worker)

    async def _take_worker(self, field: str) -> CompileWorker:
        if self._idle is None:  # first use: the other workers start in the background
            self._idle = asyncio.Queue()
            self._free(self._workers[0])
            loop = asyncio.get_running_loop()
            for w in self._workers[1:]:
                job = loop.run_in_executor(self._threads, _restart, w)
                job.add_done_callback(lambda _, w=w: self._free(w))
        if not self._idle.empty():
            return self._idle.get_nowait()
        busy = APIError(503, f"{field}: every structured-output compile worker is busy "
                        f"({self.num_workers}, --structured-outputs-compile-workers); retry "
                        f"later", type="server_error", code="structured_outputs_busy",
                        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})
        if self._waiting >= MAX_WAITING_PER_WORKER * self.num_workers:
            raise busy
        self._waiting += 1
        try:
            while True:  # as long as some worker came free within twice the deadline
                quiet_s = time.monotonic() - self._freed_at
                try:
                    return await asyncio.wait_for(self._idle.get(),
                                                  max(0.0, 2 * self.timeout - quiet_s))
                except TimeoutError:
                    if time.monotonic() - self._freed_at >= 2 * self.timeout:
                        raise busy from None
        finally:
            self._waiting -= 1

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _check(worker: CompileWorker, kind: str, text: str, timeout: float) -> str | None:
    try:
        return worker.check(kind, text, timeout)
    except CompileTimeout:
        return _TIMED_OUT


def _restart(worker: CompileWorker) -> None:
    """Start the killed worker's successor now, so the next check does not wait for it."""
    try:
        worker.start()
    except WorkerFailed as e:
        logger.warning("grammar compile worker: %s (retried on the next check)", e)
