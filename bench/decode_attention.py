"""dpserve's CPU kernels for a step's attention and element-wise ops, A/B inside a
real engine.

--compare attention (default): decode attention from the paged cache (dpserve's
kernel) against torch's path (gather each row's blocks, SDPA with a padding
mask); its "torch" steps see `attention.cpu_kernels` as unavailable, so decode
chunks take the gather + SDPA path, and the fused ops run as torch's ops too.
--compare fused-ops: the fused add + RMSNorm and RoPE + cache write
(`cpu_kernels.add_rms_norm`, `rotary_kv`) against torch's chains of small ops
(its "torch's ops" steps have the metadata's `fused_ops` cleared); attention is
the kernel's in both.

Scope: one child process, `dpserve.LLM` at DP=1 on the default model (or --model);
--prompts prompts of about 160 tokens decode 64 greedy tokens together (ignore_eos).
The two modes alternate in that one engine (each step's metadata picks the mode),
so both see the same machine state; the linears are the same in both. Per mode:
best of --runs timed generations after a warm-up, attention time per layer call
(by wrapping `paged_attention`; with the fused ops the cache write happens before
it), and whether the greedy tokens equal the other mode's.

    .venv/bin/python bench/decode_attention.py [--dtype bfloat16] [--prompts 16]
        [--compare fused-ops]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import dataclasses, json, sys, time, types
import dpserve.model.attention as A
import dpserve.model.llama as L
import dpserve.model.runner as R
compare, dtype, model = sys.argv[1], sys.argv[2], sys.argv[5]
n, runs = int(sys.argv[3]), int(sys.argv[4])
other = {"on": True}  # False: the mode compared against
kernels, no_kernels = A.cpu_kernels, types.SimpleNamespace(available=lambda: False)
build = R.build_attention_metadata
def build_for_mode(*args, **kwargs):
    if compare == "attention":
        A.cpu_kernels = kernels if other["on"] else no_kernels
        return build(*args, **kwargs)
    meta = build(*args, **kwargs)
    return meta if other["on"] else dataclasses.replace(meta, fused_ops=False)
R.build_attention_metadata = build_for_mode
spent = {"s": 0.0, "calls": 0}
original = A.paged_attention
def timed(q, k, v, cache, meta, **kw):
    start = time.perf_counter()
    out = original(q, k, v, cache, meta, **kw)
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
result = {}
for rep in range(runs):  # the modes alternate, each going first in turn
    for on in ((True, False) if rep % 2 == 0 else (False, True)):
        other["on"] = on
        spent.update(s=0.0, calls=0)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        r = result.setdefault(on, {"best": float("inf")})
        if took < r["best"]:
            r.update(best=took, per_call=spent["s"] / max(spent["calls"], 1))
        r["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
print(json.dumps({mode: {"tok_s": n * 64 / result[on]["best"],
                         "per_call_us": result[on]["per_call"] * 1e6,
                         "prompt_tokens": len(outs[0].prompt_token_ids),
                         "tokens": result[on]["tokens"]}
                  for mode, on in (("kernel", True), ("other", False))}))
"""


def run(args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, args.compare, args.dtype,
                           str(args.prompts), str(args.runs), args.model or ""],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--compare", default="attention", choices=["attention", "fused-ops"])
    args = ap.parse_args()
    other = "other"
    labels = (("dpserve kernel", "gather + SDPA") if args.compare == "attention"
              else ("fused ops", "torch's ops"))
    results = run(args)
    same = results["kernel"]["tokens"] == results[other]["tokens"]
    print(f"{args.dtype}, {args.prompts} prompts of {results['kernel']['prompt_tokens']} "
          f"tokens, 64 output tokens, best of {args.runs} runs of each (alternating)\n")
    print(f"| {args.compare} | attention per layer call | output tok/s |")
    print("|---|---:|---:|")
    for mode, label in zip(("kernel", other), labels, strict=True):
        r = results[mode]
        print(f"| {label} | {r['per_call_us']:.0f} us | {r['tok_s']:.1f} |")
    speedup = results["kernel"]["tok_s"] / results[other]["tok_s"]
    print(f"\n{labels[0]} / {labels[1]}: {speedup:.2f}x output tok/s; greedy tokens "
          f"{'equal' if same else 'differ'}")


if __name__ == "__main__":
    main()
