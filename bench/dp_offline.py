"""Data-parallel scaling of the engines alone: `dpserve.LLM` at DP=1 and DP=2, no HTTP.

Why: on a small machine `bench/dp_scaling.py` (real servers) also runs the load
generator and the API server on the cores the engines use, so its DP=2/DP=1
ratio counts their CPU against DP=2. Here the offline API drives the engines
(`LLM(data_parallel_size=N, threads_per_engine=1)`, each engine bound to a core
of its own by `--cpu-bind auto`), so the ratio is the engines' own.

Each size: one warm-up batch, then --rounds batches of 64 x N requests (random
token prompts of --prompt-len tokens, --output-len greedy tokens, ignore_eos,
at most --max-num-seqs running per engine); fresh prompts every batch, so the
prefix cache never hits. Prints a markdown section (--out appends it).

    .venv/bin/python bench/dp_offline.py [--model PATH] [--sizes 1,2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_scaling import machine, vocab_size  # noqa: E402


def measure(model: str | None, size: int, args: argparse.Namespace, vocab: int) -> list[float]:
    """Output tok/s of each round at DP=`size`."""
    from dpserve import LLM, SamplingParams

    rng = np.random.default_rng(size)

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": rng.integers(0, vocab, args.prompt_len).tolist()}
                for _ in range(n)]

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rates = []
    with LLM(model, dtype=args.dtype, data_parallel_size=size, threads_per_engine=1,
             max_num_seqs=args.max_num_seqs) as llm:
        llm.generate(prompts(16 * size), params, use_tqdm=False)
        for r in range(args.rounds):
            batch = prompts(64 * size)
            start = time.monotonic()
            done = llm.generate(batch, params, use_tqdm=False)
            elapsed = time.monotonic() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in done)
            assert tokens == len(batch) * args.output_len, tokens
            rates.append(tokens / elapsed)
            print(f"DP={size} round {r + 1}: {rates[-1]:.1f} tok/s", file=sys.stderr, flush=True)
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="append the markdown section to this file")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    vocab = vocab_size(args.model)
    results = {size: measure(args.model, size, args, vocab) for size in sizes}
    base = statistics.median(results[sizes[0]])
    lines = [f"\n## data-parallel scaling of the engines alone (bench/dp_offline.py), "
             f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
             f"- machine: {machine()}",
             f"- command: `python {shlex.join(sys.argv)}`",
             f"- `dpserve.LLM(data_parallel_size=N, threads_per_engine=1)`, {args.dtype}, "
             f"64 x N requests per round, {args.prompt_len} -> {args.output_len} tokens, "
             f"at most {args.max_num_seqs} running per engine; median of {args.rounds} "
             f"rounds\n",
             "| DP | output tok/s (rounds) | vs DP=" + str(sizes[0]) + " |",
             "|---:|---:|---:|"]
    for size in sizes:
        rates = results[size]
        lines.append(f"| {size} | {statistics.median(rates):.1f} "
                     f"({' / '.join(f'{r:.1f}' for r in rates)}) | "
                     f"{statistics.median(rates) / base:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
