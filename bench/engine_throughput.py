"""Offline engine throughput: dpserve's EngineCore vs transformers' batched generate.

The workload: N requests of P random prompt tokens, each generating exactly O
tokens (ignore_eos), on the default model unless --model is given. Both sides
use the same weights, dtype and thread count; the figure is output tokens per
second of wall time after the model is loaded (one small warm-up run first).

    .venv/bin/python bench/engine_throughput.py [--append bench/results/DATE-TOPIC.md]

Prefix-cache block hashing (sha256 now, builtin hash() before):
`--prefix-caching` turns the cache on in the dpserve run (off by default: the
random prompts share no prefix, so it only adds the hashing), `--block-hash
builtin` swaps the old hash back in for that run (in-process: one engine),
and `--hash-micro` times one block's hash both ways (ns per block, best of 5)
and, with `--prefix-caching`, its share of the run: blocks hashed (every full
block of every request once: N * ((P + O) // block_size)) x ns / wall time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # Skip the first ids: small vocabularies keep their special tokens there.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def _builtin_hash_block(parent_hash, token_ids):
    """The prefix-cache hash before sha256 (builtin hash of a tuple), for comparison."""
    return hash((0x5D1F_0B1A if parent_hash is None else parent_hash, *token_ids))


def hash_micro(block_size: int, reps: int = 20000) -> dict[str, float]:
    """ns per block hash, chained as the engine does, best of 5: sha256 vs builtin."""
    import random

    from dpserve.block_hash import hash_block

    tokens = [random.Random(0).randrange(100, 49152) for _ in range(block_size)]
    out = {}
    for name, fn in (("sha256", hash_block), ("builtin", _builtin_hash_block)):
        best = float("inf")
        for _ in range(5):
            parent = None
            start = time.perf_counter_ns()
            for _ in range(reps):
                parent = fn(parent, tokens)
            best = min(best, (time.perf_counter_ns() - start) / reps)
        out[name] = best
    return out


def run_dpserve(args, prompts) -> dict:
    from dpserve import LLM, SamplingParams
    from dpserve.engine import kv_cache

    kwargs = {}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    sha256_hash_block = kv_cache.hash_block
    if args.block_hash == "builtin":
        kv_cache.hash_block = _builtin_hash_block  # read at call time by the KV manager
    try:
        llm = LLM(args.model, threads_per_engine=args.threads,
                  enable_prefix_caching=args.prefix_caching, **kwargs)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
    finally:
        kv_cache.hash_block = sha256_hash_block
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == len(prompts) * args.output_len, generated
    return {"elapsed_s": elapsed, "output_tokens": generated,
            "output_tok_s": generated / elapsed, "path": llm.config.model.path,
            "block_size": llm.config.cache.block_size}


def run_transformers(args, prompts, path: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor(prompts)
    gen = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
    with torch.inference_mode():
        model.generate(x[:2, :16], max_new_tokens=4, min_new_tokens=4,
                       **{**gen, "attention_mask": torch.ones_like(x[:2, :16])})
        start = time.perf_counter()
        y = model.generate(x, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                           **gen)
        elapsed = time.perf_counter() - start
    generated = (y.shape[1] - x.shape[1]) * y.shape[0]
    return {"elapsed_s": elapsed, "output_tokens": generated,
            "output_tok_s": generated / elapsed}


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {dev}, torch {torch.__version__}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--prefix-caching", action="store_true",
                   help="prefix caching on in the dpserve run (it hashes every full block)")
    p.add_argument("--block-hash", choices=["sha256", "builtin"], default="sha256",
                   help="the prefix-cache block hash of the dpserve run (builtin: the old one)")
    p.add_argument("--hash-micro", action="store_true",
                   help="also time one block hash, sha256 vs builtin (module docstring)")
    p.add_argument("--append", metavar="FILE", help="append a results section to FILE")
    args = p.parse_args()

    import json

    from transformers import AutoConfig

    from dpserve.checkpoint.loader import resolve_model

    path = str(resolve_model(args.model))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab)
    ours = run_dpserve(args, prompts)
    print(f"dpserve:      {ours['output_tok_s']:.1f} output tok/s "
          f"({ours['output_tokens']} tokens in {ours['elapsed_s']:.1f} s)")
    if args.hash_micro:
        ours["hash_ns"] = hash_micro(ours["block_size"])
        blocks = args.num_requests * ((args.prompt_len + args.output_len) // ours["block_size"])
        ours["blocks_hashed"] = blocks if args.prefix_caching else 0
        for name, ns in ours["hash_ns"].items():
            share = ours["blocks_hashed"] * ns / 1e9 / ours["elapsed_s"]
            print(f"block hash {name}: {ns:.0f} ns per {ours['block_size']}-token block; "
                  f"{ours['blocks_hashed']} blocks = {100 * share:.4f}% of the run")
    ref = None
    if not args.skip_transformers:
        ref = run_transformers(args, prompts, path)
        print(f"transformers: {ref['output_tok_s']:.1f} output tok/s "
              f"({ref['output_tokens']} tokens in {ref['elapsed_s']:.1f} s)")
        print(f"ratio:        {ours['output_tok_s'] / ref['output_tok_s']:.2f}x")
    result = {"dpserve": ours, "transformers": ref}
    print(json.dumps(result))
    if args.append:
        _append(args.append, args, ours, ref)
    return 0


def _append(path: str, args, ours: dict, ref: dict | None) -> None:
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    lines = [
        f"\n## engine_throughput, {datetime.date.today().isoformat()}\n",
        f"- machine: {machine()}",
        f"- command: `{cmd}`",
        f"- workload: {args.num_requests} requests x {args.prompt_len} prompt tokens -> "
        f"{args.output_len} output tokens, greedy, ignore_eos, float32, "
        f"{args.threads} threads, model {args.model or 'default (SmolLM2-135M-Instruct)'}",
        f"- dpserve: **{ours['output_tok_s']:.1f} output tok/s** "
        f"({ours['elapsed_s']:.1f} s)",
    ]
    if ref:
        lines.append(f"- transformers batched generate: {ref['output_tok_s']:.1f} output "
                     f"tok/s ({ref['elapsed_s']:.1f} s)")
        lines.append(f"- ratio dpserve / transformers: "
                     f"**{ours['output_tok_s'] / ref['output_tok_s']:.2f}x**")
    if args.prefix_caching:
        lines.insert(4, f"- prefix caching on, block hash {args.block_hash}")
    if "hash_ns" in ours:
        for name, ns in ours["hash_ns"].items():
            share = ours["blocks_hashed"] * ns / 1e9 / ours["elapsed_s"]
            lines.append(f"- block hash {name}: {ns:.0f} ns per {ours['block_size']}-token "
                         f"block (best of 5); {ours['blocks_hashed']} blocks hashed in the "
                         f"run = {100 * share:.4f}% of its wall time")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
