"""Decode attention from the paged cache (dpserve's CPU kernel) against torch's
path (gather each row's blocks, SDPA with a padding mask), inside a real engine.

Scope: one process, `dpserve.LLM` at DP=1 on the default model (or --model);
--prompts prompts of about 160 tokens decode 64 greedy tokens together (ignore_eos).
Each mode runs in its own child process; "torch" patches `attention.cpu_kernels`
there so decode chunks take the gather + SDPA path (the linears are the same in
both). Per mode: best of --runs timed generations after a warm-up, attention
time per layer call (by wrapping `paged_attention`), and whether the greedy
tokens equal the other mode's.

    .venv/bin/python bench/decode_attention.py [--dtype bfloat16] [--prompts 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time, types
import dpserve.model.attention as A
import dpserve.model.llama as L
mode, dtype, model = sys.argv[1], sys.argv[2], sys.argv[5]
n, runs = int(sys.argv[3]), int(sys.argv[4])
if mode == "torch":
    A.cpu_kernels = types.SimpleNamespace(available=lambda: False)
spent = {"s": 0.0, "calls": 0}
original = A.paged_attention
def timed(q, k, v, cache, meta):
    start = time.perf_counter()
    out = original(q, k, v, cache, meta)
    if not meta.prefill_groups:  # decode-only steps
        spent["s"] += time.perf_counter() - start
        spent["calls"] += 1
    return out
L.paged_attention = timed
from dpserve import LLM, SamplingParams
llm = LLM(model or None, dtype=dtype)
words = "the quick brown fox jumps over the lazy dog and runs far away " * 12
prompts = [f"{i} {words}" for i in range(n)]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
best, outs = float("inf"), None
for _ in range(runs):
    spent.update(s=0.0, calls=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    if took < best:
        best, per_call = took, spent["s"] / max(spent["calls"], 1)
print(json.dumps({"tok_s": n * 64 / best, "per_call_us": per_call * 1e6,
                  "prompt_tokens": len(outs[0].prompt_token_ids),
                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run(mode: str, args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, args.dtype, str(args.prompts),
                           str(args.runs), args.model or ""],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    results = {mode: run(mode, args) for mode in ("kernel", "torch")}
    same = results["kernel"]["tokens"] == results["torch"]["tokens"]
    print(f"{args.dtype}, {args.prompts} prompts of {results['kernel']['prompt_tokens']} "
          f"tokens, 64 output tokens, best of {args.runs}\n")
    print("| decode attention | per layer call | output tok/s |")
    print("|---|---:|---:|")
    for mode, label in (("kernel", "dpserve kernel"), ("torch", "gather + SDPA")):
        r = results[mode]
        print(f"| {label} | {r['per_call_us']:.0f} us | {r['tok_s']:.1f} |")
    speedup = results["kernel"]["tok_s"] / results["torch"]["tok_s"]
    print(f"\nkernel / torch: {speedup:.2f}x output tok/s; greedy tokens "
          f"{'equal' if same else 'differ'}")


if __name__ == "__main__":
    main()
