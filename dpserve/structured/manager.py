"""The engine's side of structured output.

* `StructuredOutputManager` compiles specs on a small thread pool (never on the
  busy loop), keeps compiled grammars in an LRU keyed by the spec (concurrent
  requests for one spec share one compile; at most `_CACHE_SIZE` grammars and
  `_CACHE_BYTES` of them, xgrammar's own cache at most `_XGRAMMAR_CACHE_BYTES`),
  and holds the requests whose grammar is not ready yet: `EngineCore` hands them
  to the scheduler once it is. A request whose grammar is not ready within
  `compile_timeout` s (--structured-outputs-compile-timeout) fails with an error
  naming it, and so does every later request for that spec while it is
  remembered (a backstop: the API server refuses such specs first, in a worker
  it can kill; here a compile cannot be stopped, only no longer waited for: its
  thread is replaced, `compile_pool.py`, so the compiles behind it go on).
* `RequestGrammar` is one request's matcher. It is created waiting for the
  compiled grammar; when ready it is fed the request's output tokens so far (a
  migrated request arrives with some). It survives preemption unchanged: a
  preempted request keeps its output tokens and only recomputes their KV.
* `grammar_bitmask` / `apply_bitmask`: the rows of a sampling batch that have a
  matcher get the tokens it forbids set to -inf, inside the sampler.

The tokenizer and the xgrammar compiler are loaded on the first structured
request (in the pool), so an engine that never sees one pays nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpserve.structured.compile_pool import CompilePool
from dpserve.structured.grammar import compile_spec
from dpserve.structured.spec import StructuredOutputs

if TYPE_CHECKING:  # the launcher imports the engine's modules without torch
    import torch

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept
_CACHE_BYTES = 512 << 20  # ... and their size at most (CompiledGrammar.memory_size_bytes)
_XGRAMMAR_CACHE_BYTES = 64 << 20  # xgrammar's GrammarCompiler cache
_TIMED_OUT_KEYS = 1024  # specs remembered as too slow to compile
_MAX_STUCK = 4  # compiles past their deadline still running (compile_pool.py)
_BITS = 32  # tokens per bitmask word (xgrammar's int32 layout)


class RequestGrammar:
    """One request's grammar matcher (see the module docstring)."""

    def __init__(self, future: cf.Future, stop_token_ids: list[int]) -> None:
        self.future = future
        self.stop_token_ids = stop_token_ids
        self.added_at = time.monotonic()
        self.matcher: Any = None

    def start(self, prior_tokens: Sequence[int]) -> str | None:
        """Make the matcher from the compiled grammar; an error message on failure."""
        import xgrammar as xgr

        try:
            compiled = self.future.result()
        except Exception as e:  # noqa: BLE001 - reported as the request's failure
            return str(e)
        self.matcher = xgr.GrammarMatcher(compiled,
                                          override_stop_tokens=self.stop_token_ids or None)
        for token in prior_tokens:
            if not self.accept(token):
                return f"output token {token} so far does not match the grammar"
        return None

    def accept(self, token: int) -> bool:
        """Advance on a sampled token; False if the grammar rejects it."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token taken: the request must end."""
        return self.matcher is not None and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles off the busy loop; holds requests until their grammar is ready."""

    def __init__(self, tokenizer: str, vocab_size: int, max_workers: int = 2,
                 compile_timeout: float = 10.0) -> None:
        self.tokenizer_path = tokenizer
        self.vocab_size = vocab_size
        self.max_workers = max_workers
        self.compile_timeout = compile_timeout
        self._timed_out: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.pending: dict[str, Any] = {}  # request id -> Request waiting for its grammar
        self._cache: collections.OrderedDict[tuple[str, str], cf.Future] = \
            collections.OrderedDict()
        self._pool: CompilePool | None = None
        self._compiler: Any = None
        self._compiler_ready_at: float | None = None  # time.monotonic() once loaded
        self._compiler_lock = threading.Lock()

    # ---- requests ------------------------------------------------------------

    def add(self, request: Any) -> None:
        """Start (or reuse) the compile of the request's spec; it waits in `pending`."""
        params = request.sampling_params
        stops = [request.eos_token_id] if request.eos_token_id is not None else []
        stops += [t for t in params.stop_token_ids if t not in stops]
        request.grammar = RequestGrammar(self._compile(params.structured_outputs), stops)
        self.pending[request.request_id] = request

    def take_ready(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """(requests whose grammar is ready, in arrival order; (request, error) failed)."""
        ready, failed = [], []
        now = time.monotonic()
        for req_id, request in list(self.pending.items()):
            if not request.grammar.future.done():
                # The deadline counts from the arrival, or from when the compiler was
                # loaded (the tokenizer, once per engine): not the load itself.
                ready_at = self._compiler_ready_at
                if ready_at is not None and \
                        now > max(request.grammar.added_at, ready_at) + self.compile_timeout:
                    del self.pending[req_id]
                    self._remember_timeout(request.sampling_params.structured_outputs)
                    if self._pool is not None:  # its thread is replaced; others go on
                        self._pool.write_off(request.grammar.future)
                    failed.append((request, self._timeout_message()))
                    logger.error("request %s: %s", req_id, self._timeout_message())
                continue
            del self.pending[req_id]
            error = request.grammar.start(request.output_token_ids)
            if error is None:
                ready.append(request)
            else:
                logger.error("request %s: structured output failed: %s", req_id, error)
                failed.append((request, error))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a pending grammar is ready, at most `timeout` seconds."""
        futures = [r.grammar.future for r in self.pending.values()]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def abort(self, request_ids: Sequence[str]) -> list[Any]:
        """Remove pending requests; returns those that were pending."""
        return [r for r in (self.pending.pop(i, None) for i in request_ids) if r is not None]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    # ---- compiling -----------------------------------------------------------

    def _timeout_message(self) -> str:
        return (f"the structured-output grammar did not compile within "
                f"{self.compile_timeout:g} s (--structured-outputs-compile-timeout)")

    def _remember_timeout(self, spec: StructuredOutputs) -> None:
        self._timed_out[_digest(spec)] = None
        while len(self._timed_out) > _TIMED_OUT_KEYS:
            self._timed_out.popitem(last=False)

    def _compile(self, spec: StructuredOutputs) -> cf.Future:
        if _digest(spec) in self._timed_out:  # known too slow: fail at once
            failed: cf.Future = cf.Future()
            failed.set_exception(TimeoutError(self._timeout_message()))
            return failed
        key = spec.key()
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = CompilePool(self._compile_now, self.max_workers, _MAX_STUCK)
        future = self._pool.submit(spec)
        self._cache[key] = future
        self._evict()
        return future

    def _evict(self) -> None:
        """Oldest grammars out until at most _CACHE_SIZE of at most _CACHE_BYTES remain
        (compiles still running count as nothing yet)."""
        def size(f: cf.Future) -> int:
            done = f.done() and not f.cancelled() and f.exception() is None
            return f.result().memory_size_bytes if done else 0

        total = sum(size(f) for f in self._cache.values())
        while self._cache and (len(self._cache) > _CACHE_SIZE or total > _CACHE_BYTES):
            _, oldest = self._cache.popitem(last=False)
            total -= size(oldest)

    def _compile_now(self, spec: StructuredOutputs) -> Any:
        return compile_spec(self._get_compiler(), spec)

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                          vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=_XGRAMMAR_CACHE_BYTES)
                self._compiler_ready_at = time.monotonic()
            return self._compiler


def _digest(spec: StructuredOutputs) -> bytes:
    kind, text = spec.key()
    return hashlib.sha256(f"{kind}\0{text}".encode()).digest()


def grammar_bitmask(requests: Sequence[Any], vocab_size: int,
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(bitmask [R, ceil(V/32)] int32 of the R constrained rows, their rows [R]);
    None when no row has a grammar. Bit j of word w allows token 32*w + j."""
    rows = [i for i, r in enumerate(requests)
            if getattr(r, "grammar", None) is not None and r.grammar.matcher is not None]
    if not rows:
        return None
    import torch

    bitmask = torch.full((len(rows), -(-vocab_size // _BITS)), -1, dtype=torch.int32)
    for k, i in enumerate(rows):
        requests[i].grammar.fill(bitmask, k)
    return bitmask, torch.tensor(rows, dtype=torch.int64)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place on logits [S, V]: forbidden tokens of the constrained rows -> -inf."""
    import torch

    vocab = logits.shape[1]
    bitmask, rows = bitmask.to(logits.device), rows.to(logits.device)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [R, V]
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
