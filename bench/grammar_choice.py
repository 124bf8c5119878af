"""Which grammar library: compile time of a few JSON schemas and per-token mask time
on the default model's tokenizer (SmolLM2, vocabulary 49,152), xgrammar vs llguidance.

    .venv/bin/python bench/grammar_choice.py

Measured on this project's shared 2-core CPU box (xgrammar 0.2.8, llguidance 1.9.1;
two runs of 200 tokens, noisy): xgrammar compile 5-24 ms, mask 14-80 us/token;
llguidance compile 1-14 ms (plus 0.7-0.9 s once for its tokenizer), mask 10-105
us/token. outlines-core builds a whole DFA index per schema: not timed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from transformers import AutoTokenizer

from dpserve.checkpoint.loader import resolve_model

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
            "price": {"type": "number"}}, "required": ["id", "price"]}},
        "kind": {"enum": ["a", "b", "c"]}}, "required": ["items", "kind"]},
    {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"},
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
     "required": ["date", "ok", "note"]},
]
STEPS = 200


def middle_allowed(bitmask: torch.Tensor, vocab: int) -> int:
    bits = ((bitmask[0].view(-1, 1) >> torch.arange(32)) & 1).flatten()[:vocab]
    nz = bits.nonzero()
    return int(nz[len(nz) // 2])


def walk(done: Callable[[], bool], fill: Callable[[], None], accept: Callable[[int], object],
         mask: torch.Tensor, vocab: int) -> float:
    """Mean seconds per token of fill + accept along a valid path (the middle allowed
    token at each step; choosing it is not timed)."""
    spent, n = 0.0, 0
    while n < STEPS and not done():
        t = time.perf_counter()
        fill()
        spent += time.perf_counter() - t
        token = middle_allowed(mask, vocab)
        t = time.perf_counter()
        accept(token)
        spent += time.perf_counter() - t
        n += 1
    return spent / max(n, 1)


def report(lib: str, i: int, compile_s: float, per_token_s: float) -> None:
    print(f"{lib:10} schema {i}: compile {compile_s * 1e3:6.1f} ms, "
          f"mask {per_token_s * 1e6:6.1f} us/token")


def bench_xgrammar(tok, vocab: int) -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    for i, s in enumerate(SCHEMAS):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(s), any_whitespace=False))
        compile_s = time.perf_counter() - t
        mask = xgr.allocate_token_bitmask(1, vocab)
        report("xgrammar", i, compile_s, walk(
            m.is_terminated, lambda m=m, mask=mask: m.fill_next_token_bitmask(mask, 0),
            m.accept_token, mask, vocab))


def bench_llguidance(tok, vocab: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    print(f"llguidance tokenizer {(time.perf_counter() - t) * 1e3:.0f} ms")
    for i, s in enumerate(SCHEMAS):
        t = time.perf_counter()
        m = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(s)))
        compile_s = time.perf_counter() - t
        mask = lt.allocate_token_bitmask(1, vocab)
        report("llguidance", i, compile_s, walk(
            m.is_stopped, lambda m=m, mask=mask: lt.fill_next_token_bitmask(m, mask, 0),
            m.consume_token, mask, vocab))


def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    vocab = 49152
    bench_xgrammar(tok, vocab)
    bench_llguidance(tok, vocab)


if __name__ == "__main__":
    main()
