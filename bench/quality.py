"""Quality cost of bfloat16 and of `--quantization int8` against float32: greedy
agreement and perplexity.

Scope: the default model (SmolLM2-135M-Instruct) unless --model names another.
* Greedy agreement: --prompts prompts x --tokens greedy tokens (ignore_eos) from
  `dpserve.LLM` in float32, in bfloat16 (`--dtype bfloat16`, what `auto` picks on
  CPUs with native bfloat16) and in int8 (with the LM head in float32, and in
  bfloat16 as the engine runs it on such CPUs):
  the fraction of positions with the same
  token by position, the fraction before each prompt's first divergence (after
  it the two texts go separate ways), the share of identical completions, and
  the first divergence position (median, min).
* Perplexity of TEXT (plain English, below) in one teacher-forced prefill, float32
  vs bfloat16 vs int8 (and int8 with the LM head quantised too, to show why it
  stays float).
Prints a markdown table.

    .venv/bin/python bench/quality.py [--model PATH] [--prompts 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TEXT = """\
The river rose slowly through the night, and by morning the low fields along its banks
were covered in brown water. Farmers who had lived in the valley for many years said they
had seen worse floods, but few of them had seen the water come up so quietly. There was no
storm and no sudden wall of water, only a steady rain in the hills that had lasted for a week.

In the town, the school was closed and the market moved to the square in front of the
church, which stood on higher ground. People carried bread, vegetables and bottles of water
up the hill in wheelbarrows and on their backs. Children thought it was a holiday. Their
parents watched the river and talked about the bridge, which was old and made of stone.

By the third day the rain stopped. The water went down as slowly as it had come, leaving
mud on the roads, in the cellars and across the fields. It took the rest of the summer to
clean the houses and repair the fences, and the harvest that year was small. Still, nobody
had been hurt, and the old bridge, to everyone's surprise, was still standing.
"""

PROMPT_STEMS = [
    "Write a short story about", "Explain in simple words how", "List three facts about",
    "What is the capital of", "Give me a recipe for", "Describe the history of",
    "Why do people enjoy", "Summarise the idea of",
]
TOPICS = ["a lighthouse keeper", "photosynthesis works", "the Moon", "France",
          "pancakes", "the printing press", "gardening", "data parallel computing"]


def prompts(n: int) -> list[str]:
    stems, topics = PROMPT_STEMS, TOPICS
    return [f"{stems[i % len(stems)]} {topics[(i // len(stems) + i) % len(topics)]}."
            for i in range(n)]


# setting -> (dtype, quantization, LM head in int8 too, LM head dtype under int8)
SETTINGS = {"float32": ("float32", None, False, None),
            "bfloat16": ("bfloat16", None, False, None),
            "int8": ("float32", "int8", False, "float32"),
            "int8, LM head bfloat16": ("float32", "int8", False, "bfloat16"),
            "int8 + int8 LM head": ("float32", "int8", True, "float32")}


def greedy(model: str | None, setting: str, texts: list[str], tokens: int) -> list[list[int]]:
    from dpserve import LLM, SamplingParams
    from dpserve.cpu_features import CPU_BF16_ENV

    dtype, quantization, _, head_dtype = SETTINGS[setting]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    # Under int8 the engine runs the LM head in bfloat16 unless DPSERVE_CPU_BF16=0.
    os.environ[CPU_BF16_ENV] = "1" if head_dtype == "bfloat16" else "0"
    with LLM(model, dtype=dtype, quantization=quantization) as llm:
        msgs = [[{"role": "user", "content": t}] for t in texts]
        return [list(o.outputs[0].token_ids) for o in llm.chat(msgs, params)]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    firsts = []
    for a, b in zip(base, other, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        firsts.append(first)
    total = sum(len(a) for a in base)
    same = sum(x == y for a, b in zip(base, other, strict=True)
               for x, y in zip(a, b, strict=True))
    identical = sum(f == len(a) for f, a in zip(firsts, base, strict=True))
    return {"same": same / total, "agree": sum(firsts) / total,
            "identical": identical / len(base), "median_first": statistics.median(firsts),
            "min_first": min(firsts)}


def perplexity(model: str | None, setting: str) -> float:
    """exp(mean NLL) of TEXT's tokens, teacher-forced in one prefill."""
    from transformers import AutoTokenizer

    from dpserve.checkpoint.loader import iter_weights
    from dpserve.checkpoint.registry import get_model_class
    from dpserve.config import EngineArgs
    from dpserve.model.attention import build_attention_metadata

    dtype_name, quantization, head, head_dtype = SETTINGS[setting]
    dtype = getattr(torch, dtype_name)
    cfg = EngineArgs(model=model).create_config().model
    ids = AutoTokenizer.from_pretrained(cfg.tokenizer)(TEXT)["input_ids"]
    lm = get_model_class(cfg.architecture)(cfg.hf_config, dtype, "cpu")
    lm.load_weights(iter_weights(Path(cfg.path)))
    if quantization == "int8":
        lm.quantize_weights(lm_head=head, head_dtype=getattr(torch, head_dtype))
    else:
        lm.prepack_weights()
    d, bs, n = lm.dims, 16, len(ids)
    blocks = -(-n // bs) + 1
    caches = [torch.zeros(2, blocks, bs, d.kv_heads, d.head_dim, dtype=dtype)
              for _ in range(d.layers)]
    meta = build_attention_metadata(np.array([n]), np.array([0]), np.arange(blocks)[None],
                                    0, bs, dtype, torch.device("cpu"),
                                    d.kv_heads * d.head_dim)
    with torch.inference_mode():
        hidden = lm(torch.tensor(ids), torch.arange(n), meta, caches)
        logits = lm.compute_logits(hidden[:-1])
        nll = F.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(float(nll))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    texts = prompts(args.prompts)
    base = greedy(args.model, "float32", texts, args.tokens)
    agr = {name: agreement(base, greedy(args.model, name, texts, args.tokens))
           for name in ("bfloat16", "int8", "int8, LM head bfloat16")}
    ppl = {name: perplexity(args.model, name) for name in SETTINGS}
    print(f"model: {args.model or 'default (SmolLM2-135M-Instruct)'}; {args.prompts} chat "
          f"prompts x {args.tokens} greedy tokens")
    print("\n| setting | perplexity | same greedy token (by position) | tokens before "
          "first divergence | identical completions | first divergence median (min) |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| float32 | {ppl['float32']:.3f} | 100% | 100% | 100% | - |")
    for name, a in agr.items():
        print(f"| {name} | {ppl[name]:.3f} | {a['same']:.1%} | {a['agree']:.1%} | "
              f"{a['identical']:.1%} | {a['median_first']:g} ({a['min_first']}) |")
    print(f"| int8 + int8 LM head | {ppl['int8 + int8 LM head']:.3f} | - | - | - | - |")


if __name__ == "__main__":
    main()
