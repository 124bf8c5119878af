"""Tensor parallelism's cost and memory on this machine: `dpserve.LLM` at TP=1 vs TP=N.

What it shows: how much of the model (weights + KV cache) each worker holds,
and what the per-step collectives cost. On a CPU host the workers share the
same cores and memory bandwidth, so TP=N is expected to be slower than TP=1:
the figure is the price of a model split over several devices, paid per step
(2 all-reduces per layer + one all-gather of the logits), not a speed-up.

For each size, in a fresh process (so resident memory is its own): load, one
warm-up, then
* single stream: one request, --output-len greedy tokens (decode-bound: the
  collectives' latency shows);
* batch: --batch requests of --prompt-len random tokens, --output-len tokens
  each (throughput).
Memory: the bytes of the weights and of the KV cache each worker holds (from
the engine), and the resident set of every worker process (psutil; includes
torch itself, ~0.3 GB a process).

    .venv/bin/python bench/tensor_parallel.py [--model PATH | --random-llama] [--sizes 1,2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_scaling import machine  # noqa: E402

# A random Llama whose heads divide by 2, 4 and 8 (SmolLM2-135M's 9 heads only by 3).
RANDOM_LLAMA = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                    intermediate_size=2816, num_hidden_layers=8, vocab_size=32768,
                    max_position_embeddings=2048)


def one_size(model: str | None, size: int, args: argparse.Namespace) -> dict:
    """Run in a child process: the figures of TP=`size` (see the module docstring)."""
    import numpy as np
    import psutil

    from dpserve import LLM, SamplingParams

    rng = np.random.default_rng(size)
    start = time.monotonic()
    llm = LLM(model, dtype=args.dtype, tensor_parallel_size=size,
              threads_per_engine=args.threads, max_num_seqs=args.batch, max_model_len=512)
    load_s = time.monotonic() - start
    vocab = llm.config.model.hf_config["vocab_size"]

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": rng.integers(0, vocab, args.prompt_len).tolist()}
                for _ in range(n)]

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts(2), params, use_tqdm=False)
    rates = {}
    for name, n in (("single", 1), ("batch", args.batch)):
        start = time.monotonic()
        done = llm.generate(prompts(n), params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in done)
        rates[name] = tokens / (time.monotonic() - start)
    runner = llm.engine.runner  # worker 0's
    weights = runner.weight_bytes
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    me = psutil.Process()
    workers = [me] + [p for p in me.children(recursive=True) if "TPWorker" in p.name()]
    rss = [p.memory_info().rss for p in workers]
    llm.shutdown()
    return dict(size=size, load_s=load_s, weights=weights, kv=kv, rss=rss, **rates)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--random-llama", action="store_true",
                   help=f"a random Llama built here instead: {RANDOM_LLAMA}")
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--threads", type=int, default=None,
                   help="threads_per_engine (shared out between a rank's workers)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="append the markdown section to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(one_size(args.model, int(args.child), args)))
        return 0
    model_name = args.model or "default (SmolLM2-135M-Instruct)"
    if args.random_llama:
        from dpserve.testing.tiny_model import make_tiny_model

        args.model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama",
                                         **RANDOM_LLAMA))
        model_name = f"random Llama {RANDOM_LLAMA}"
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        child = [sys.executable, __file__, *sys.argv[1:], "--child", str(size)]
        if args.random_llama:
            child = [c for c in child if c != "--random-llama"] + ["--model", args.model]
        out = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True,
                             timeout=1800)  # its stderr (logs, errors) passes through
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"TP={size}: {results[-1]}", file=sys.stderr, flush=True)
    base = results[0]
    lines = [f"\n## tensor parallel on this machine (bench/tensor_parallel.py), "
             f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
             f"- machine: {machine()}",
             f"- command: `python {shlex.join(sys.argv)}`",
             f"- model: {model_name}; {args.dtype}; `dpserve.LLM(tensor_parallel_size=N"
             f"{f', threads_per_engine={args.threads}' if args.threads else ''})`; single: "
             f"1 request, batch: {args.batch} requests of {args.prompt_len} random tokens; "
             f"{args.output_len} greedy tokens each\n",
             "| TP | weights / worker MiB | KV cache / worker MiB | RSS per worker MiB | "
             "load s | single tok/s | batch tok/s | batch vs TP=" + str(base["size"]) + " |",
             "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['size']} | {r['weights'] / 2**20:.1f} | {r['kv'] / 2**20:.1f} | "
                     f"{' / '.join(f'{x / 2**20:.0f}' for x in r['rss'])} | "
                     f"{r['load_s']:.1f} | {r['single']:.1f} | {r['batch']:.1f} | "
                     f"{r['batch'] / base['batch']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
