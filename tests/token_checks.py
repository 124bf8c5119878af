"""Token-exact checks against transformers, shared by test_moe and
test_tensor_parallel: transformers' float32 greedy ids and an offline `LLM`'s,
for prompts given as token ids. Not a test module: test modules import it,
never each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GREEDY_TOKENS = 10  # the token-exact checks against transformers (test_moe, test_tensor_parallel)


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int = GREEDY_TOKENS
              ) -> list[list[int]]:
    """transformers' float32 greedy continuation of each prompt (up to and with EOS)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False)[0, len(prompt):].tolist()
        out.append(ids[:ids.index(eos) + 1] if eos in ids else ids)
    return out


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int = GREEDY_TOKENS
           ) -> list[list[int]]:
    """An offline `LLM`'s greedy token ids for each prompt (token ids in, ids out)."""
    from dpserve import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
