"""Offline engine throughput: dpserve's EngineCore vs transformers' batched generate.

The workload: N requests of P random prompt tokens, each generating exactly O
tokens (ignore_eos), on the default model unless --model is given. Both sides
use the same weights, dtype and thread count; the figure is output tokens per
second of wall time after the model is loaded (one small warm-up run first).

    .venv/bin/python bench/engine_throughput.py [--append BENCHMARKS.md]
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


def run_dpserve(args, prompts) -> dict:
    from dpserve import LLM, SamplingParams

    kwargs = {}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(args.model, threads_per_engine=args.threads, enable_prefix_caching=False,
              **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == len(prompts) * args.output_len, generated
    return {"elapsed_s": elapsed, "output_tokens": generated,
            "output_tok_s": generated / elapsed, "path": llm.config.model.path}


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
    p.add_argument("--append", metavar="FILE", help="append a results section to FILE")
    args = p.parse_args()

    import json

    from transformers import AutoConfig

    from dpserve.model.loader import resolve_model

    path = str(resolve_model(args.model))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab)
    ours = run_dpserve(args, prompts)
    print(f"dpserve:      {ours['output_tok_s']:.1f} output tok/s "
          f"({ours['output_tokens']} tokens in {ours['elapsed_s']:.1f} s)")
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
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
