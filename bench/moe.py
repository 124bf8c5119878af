"""Mixture of experts at DP=2, with and without expert parallelism (offline `LLM`).

The model: a random Mixtral-shaped checkpoint built here with transformers
(8 experts, top-2; by default hidden 768, expert intermediate 2048, 6 layers:
about 0.9 GB of expert weights in float32, most of the model), kept in
--model-dir between runs. Rows, each a fresh `LLM(model, data_parallel_size=2,
threads_per_engine=1, ...)`:

* dp2: every rank holds every expert (lockstep on by itself, as for any MoE);
* dp2-ep: `enable_expert_parallel=True`: each rank holds half the experts.

Per row: a warm-up, then --prompts prompts of --prompt-len random tokens,
--max-tokens greedy output tokens each (ignore_eos), all submitted at once:
output tokens/s over the generate() call, resident memory (RSS) of each engine
process after the run, and the expert parameter bytes each rank reports
(`expert_info`). Both rows' outputs are compared token for token (EP must not
change them; a mismatch is reported, and the exit status is 1).

    .venv/bin/python bench/moe.py [--prompts 32] [--max-tokens 64] [--out BENCHMARKS.md]

It prints a markdown section for BENCHMARKS.md; --out appends it there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import psutil


def build_model(path: Path, hidden: int, inter: int, layers: int) -> Path:
    """The random Mixtral checkpoint (built once per shape)."""
    from dpserve.testing.tiny_model import make_tiny_model

    if (path / "config.json").is_file():
        return path
    print(f"building a random Mixtral ({layers} layers, hidden {hidden}, 8 experts of "
          f"{inter}) in {path} ...", flush=True)
    return make_tiny_model(path, "mixtral", hidden_size=hidden, intermediate_size=inter,
                           num_hidden_layers=layers, num_attention_heads=hidden // 64,
                           num_key_value_heads=max(1, hidden // 256),
                           initializer_range=0.02)


def engine_rss() -> dict[int, float]:
    """MiB resident per engine process of this process (by its title)."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            name = p.name()
            if name.startswith("dpserve::EngineCore_"):
                out[int(name.rsplit("_", 1)[1])] = p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, ValueError):
            pass
    return out


def run_row(model: Path, expert_parallel: bool, prompts: list[list[int]],
            max_tokens: int) -> dict[str, Any]:
    from dpserve import LLM, SamplingParams

    llm = LLM(str(model), data_parallel_size=2, threads_per_engine=1,
              enable_expert_parallel=expert_parallel, max_model_len=1024,
              kv_cache_memory="512MiB")
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                     SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        experts = [llm.engine.call_utility("expert_info", rank=r) for r in (0, 1)]
        return dict(seconds=seconds, tok_s=sum(map(len, tokens)) / seconds, tokens=tokens,
                    rss=engine_rss(), experts=experts)
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "dpserve-bench-moe")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="append the markdown section here")
    args = parser.parse_args()
    model_dir = args.model_dir / f"mixtral-{args.hidden}-{args.intermediate}-{args.layers}"
    model = build_model(model_dir, args.hidden, args.intermediate, args.layers)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 380) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    rows = {}
    for name, ep in (("dp2", False), ("dp2-ep", True)):
        print(f"running {name} ...", flush=True)
        rows[name] = run_row(model, ep, prompts, args.max_tokens)
    same = rows["dp2"]["tokens"] == rows["dp2-ep"]["tokens"]
    lines = [f"## MoE at DP=2, with and without expert parallelism (bench/moe.py), "
             f"{datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; random Mixtral, "
             f"{args.layers} layers, hidden {args.hidden}, 8 experts x {args.intermediate} "
             f"(top-2), float32, one torch thread per engine. {args.prompts} prompts x "
             f"{args.prompt_len} tokens -> {args.max_tokens} tokens, all at once.", "",
             f"Command: `{' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}`", "",
             "| row | output tok/s | s | RSS rank 0 / 1 (MiB) | expert MiB rank 0 / 1 |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        rss = " / ".join(f"{r['rss'].get(k, float('nan')):.0f}" for k in (0, 1))
        exp = " / ".join(f"{e['expert_bytes'] / 2**20:.0f}" for e in r["experts"])
        lines.append(f"| {name} | {r['tok_s']:.1f} | {r['seconds']:.1f} | {rss} | {exp} |")
    lines += ["", f"Outputs of both rows equal token for token: {'yes' if same else 'NO'}.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
