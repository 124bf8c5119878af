"""`dpserve serve --data-parallel-roles prefill:1,decode:1` against a colocated DP=2
server (both with a host tier, tiny model): the client sees the same text (greedy,
streamed and not, a prefix hit, structured output; n=2 seeded sampling), and from
the engines' side the prefill rank ran the prompts and saved them to the tier while
the decode rank loaded them from it and computed only the tail.
"""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import metric_sum, serve_all

pytestmark = pytest.mark.procs

COMMON = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256",
          "--num-kv-blocks", "128", "--kv-offload-memory", "32MiB")
ROLES = ("--data-parallel-roles", "prefill:1,decode:1")
HANDOFFS = "dpserve:pd_handoffs_total"
BLOCK = 16  # the engines' default --block-size

# Long enough for several full KV blocks each (the tiny model's tokenizer: ~2 chars/token).
PROMPTS = [f"Story {i}: the quick brown fox jumps over the lazy dog and then it runs far "
           f"away into the dark forest where the owls sing at night, {i * 7}" for i in range(4)]
# Shares the first prompt's first blocks: a prefix hit on the prefill rank.
PREFIX_HIT = PROMPTS[0][:100] + " and nothing else happened that day, or so they said."
# The second test's own prompts: pytest-randomly runs the two in either order and
# neither may find the other's blocks cached.
OTHER_PROMPTS = [f"Tale {i}: a small red hen walks along the river bank and then she finds "
                 f"a bag of grain under the old mill by the bridge, {i * 11}" for i in range(3)]


@pytest.fixture(scope="module")
def servers(tiny_llama):
    model = str(tiny_llama)
    with serve_all([model, *COMMON], [model, *COMMON, *ROLES]) as (colocated, pd):
        yield model, colocated[1], pd[1]


def complete(url: str, model: str, prompt: str, stream: bool = False, **extra: object
             ) -> tuple[list[str], int]:
    """The completion's texts (one per choice) and its prompt tokens (usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        return [c["text"] for c in data["choices"]], data["usage"]["prompt_tokens"]
    body["stream_options"] = {"include_usage": True}
    texts: dict[int, str] = {}
    usage = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]["prompt_tokens"]
    return [texts[i] for i in sorted(texts)], usage


def labelled(url: str, name: str, label: str) -> float:
    """The sum of `name`'s series whose labels include `label` (e.g. 'engine="1"')."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def per_engine(url: str, name: str, engine: int) -> float:
    """An engine's cumulative counter `dpserve:<name>_total` from /metrics."""
    return labelled(url, f"dpserve:{name}_total", f'engine="{engine}"')


ENGINE_COUNTERS = [("prefix_cache_queries", 0), ("prefix_cache_hits", 0),
                   ("kv_offload_store_bytes", 0), ("external_prefix_cache_hits", 0),
                   ("external_prefix_cache_hits", 1)]
TTFT = "dpserve:pd_time_to_first_token_seconds_count"


def counters(url: str) -> dict[tuple[str, int | str], float]:
    """The counters the tests compare before and after their requests (the module's
    servers are shared and the tests run in any order)."""
    got: dict[tuple[str, int | str], float] = {
        key: per_engine(url, *key) for key in ENGINE_COUNTERS}
    got[(HANDOFFS, "")] = metric_sum(url, HANDOFFS)
    got[("dpserve:pd_handoff_latency_seconds_count", "")] = metric_sum(
        url, "dpserve:pd_handoff_latency_seconds_count")
    for role in ("prefill", "decode"):
        got[(TTFT, role)] = labelled(url, TTFT, f'role="{role}"')
    return got


def grown(before: dict, after: dict) -> dict:
    return {key: after[key] - before[key] for key in before}


def test_greedy_text_equals_colocated_streamed_and_not_with_a_prefix_hit(servers):
    model, colocated, pd = servers
    before = {url: counters(url) for url in (colocated, pd)}
    got = {}
    for name, url in (("colocated", colocated), ("pd", pd)):
        got[name] = [complete(url, model, PROMPTS[0]), complete(url, model, PROMPTS[1]),
                     complete(url, model, PROMPTS[2], stream=True),
                     complete(url, model, PROMPTS[3], stream=True),
                     complete(url, model, PREFIX_HIT)]
    assert got["pd"] == got["colocated"]
    lengths = [tokens for _, tokens in got["pd"]]
    assert min(lengths) >= 3 * BLOCK, lengths  # several full blocks each
    # From the engines' side: every request was handed off; the prefill rank (0) looked
    # every prompt up, hit the shared prefix in its own cache and saved the prompts to
    # the tier; the decode rank (1) loaded the four distinct prompts' full blocks from
    # the tier instead of computing them.
    new = grown(before[pd], counters(pd))
    assert new[(HANDOFFS, "")] == 5
    assert grown(before[colocated], counters(colocated))[(HANDOFFS, "")] == 0
    assert new[("prefix_cache_queries", 0)] >= sum(lengths) - len(lengths)
    assert new[("prefix_cache_hits", 0)] >= BLOCK  # the prefix hit
    assert new[("kv_offload_store_bytes", 0)] > 0
    tier_hits = new[("external_prefix_cache_hits", 1)]
    assert tier_hits >= sum(n // BLOCK * BLOCK for n in lengths[:4]), (tier_hits, lengths)
    assert new[("external_prefix_cache_hits", 0)] == 0
    rows = httpx.get(pd + "/engines", timeout=5).json()["engines"]
    assert [(r["role"], r["handoffs"]) for r in rows] == [("prefill", 0), ("decode", 0)]
    rows = httpx.get(colocated + "/engines", timeout=5).json()["engines"]
    assert [r["role"] for r in rows] == ["both", "both"]


def test_structured_output_and_seeded_n2_equal_colocated(servers):
    model, colocated, pd = servers
    before = counters(pd)
    got = {}
    for name, url in (("colocated", colocated), ("pd", pd)):
        got[name] = [
            complete(url, model, OTHER_PROMPTS[0] + " code:", ignore_eos=False,
                     structured_outputs={"regex": "[0-9]{3}-[xy]{2}"}),
            # Sampled, seeded: the decode rank's draws go on where the prefill rank's
            # stopped (one per token), so the text is the colocated one.
            complete(url, model, OTHER_PROMPTS[1], n=2, temperature=1.0, seed=1234),
            complete(url, model, OTHER_PROMPTS[2], stream=True, n=2, temperature=0.8, seed=7),
        ]
    assert got["pd"] == got["colocated"]
    [code], _ = got["pd"][0]
    assert len(code) == 6 and code[3] == "-", code
    new = grown(before, counters(pd))
    assert new[(HANDOFFS, "")] == 5  # 1 + 2 + 2 completions
    # Every handoff reached its decode rank.
    assert new[("dpserve:pd_handoff_latency_seconds_count", "")] == 5
    assert metric_sum(pd, "dpserve:pd_handoffs_in_flight") == 0
    # Every first token came from the prefill rank (one per request), every later one
    # from the decode rank.
    assert new[(TTFT, "prefill")] == 3 and new[(TTFT, "decode")] == 0
    assert labelled(pd, "dpserve:pd_inter_token_latency_seconds_count", 'role="decode"') > 0
