"""`dpserve serve --speculative-config ...` with the official openai client: greedy
text as without speculation, max_tokens and stop strings honoured (text and token
count as without speculation; a stop inside one delta's run of accepted drafts:
test_spec_decode.py), the acceptance counters on /metrics and /engines, at DP=1 and on both ranks
of DP=2; a bad option is a one-line error naming the flag, before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import metric, nonblank_stop_string, serve

from dpserve.checkpoint.loader import resolve_model

pytestmark = [pytest.mark.procs, pytest.mark.slow]

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, ' \
       '"prompt_lookup_min": 1}'
CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''
PROMPT = f"Repeat this code exactly:\n\n{CODE}\nHere it is again:\n\n{CODE[:40]}"
MAX_TOKENS = 32


def test_a_bad_speculative_config_is_one_line_naming_the_flag(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama), "--speculative-config",
         '{"method": "eagle", "num_speculative_tokens": 2}'],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["dpserve: error: --speculative-config: method must be one of ngram "
                     "(draft-free), got 'eagle'"], proc.stderr[-2000:]


def offline(llm, **params) -> tuple[str, int]:
    """Text and token count of the greedy completion without speculation."""
    from dpserve import SamplingParams

    [out] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  **params), use_tqdm=False)
    return out.outputs[0].text, len(out.outputs[0].token_ids)


def test_served_with_drafts_keeps_greedy_text_stops_and_counts():
    from dpserve import LLM

    model = str(resolve_model(None))
    # The references, without speculation, from one engine on one thread as the
    # server's engine runs (one load of the model for both).
    with LLM(model, threads_per_engine=1) as llm:
        text, _ = offline(llm, ignore_eos=True)
        stop = nonblank_stop_string(text, 4)
        stop_text, stop_tokens = offline(llm, ignore_eos=True, stop=[stop])
    assert text.startswith(stop_text) and len(stop_text) < len(text)
    with serve(model, "--speculative-config", SPEC, "--threads-per-engine", "1") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        full = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert full.choices[0].text == text and full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == MAX_TOKENS
        stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stop=[stop],
                                            extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == stop_text
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage.completion_tokens == stop_tokens
        streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text
        drafted = metric(url, "dpserve:spec_decode_num_draft_tokens_total")
        accepted = metric(url, "dpserve:spec_decode_num_accepted_tokens_total")
        assert drafted > 0 and 0 < accepted <= drafted
        assert metric(url, "dpserve:spec_decode_num_drafts_total") > 0
        [row] = httpx.get(url + "/engines", timeout=10).json()["engines"]
        spec = row["spec_decode"]
        assert spec["accepted_tokens"] > 0 and 0 < spec["acceptance_rate"] <= 1
        assert spec["mean_acceptance_length"] > 1


def test_both_ranks_of_dp2_propose():
    model = str(resolve_model(None))
    with serve(model, "--speculative-config", SPEC, "--data-parallel-size", "2",
               "--threads-per-engine", "1") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def ask(i: int) -> str:
            out = client.completions.create(model=model, prompt=f"{i}. {PROMPT}",
                                            max_tokens=16, temperature=0)
            return out.choices[0].finish_reason

        with ThreadPoolExecutor(6) as pool:
            assert all(reason in ("stop", "length") for reason in pool.map(ask, range(6)))
        text = httpx.get(url + "/metrics", timeout=5).text
        drafts = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^dpserve:spec_decode_num_draft_tokens_total\{.*engine="(\d+)".*\} (\S+)$',
            text, re.M)}
        assert drafts.get("0", 0) > 0 and drafts.get("1", 0) > 0, drafts
