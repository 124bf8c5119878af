"""Checks shared by the served tensor-parallel tests (test_tensor_parallel_serve,
test_ray): a rank's process group, /engines' view of its workers, and greedy texts
pinned to a rank against one whole-model engine. Not a test module: test modules
import it, never each other."""

from __future__ import annotations

import httpx
from helpers import descendants, proc_named

PINNED = ["The quick brown fox", "Hello world, how", "def add(x, y):"]
PINNED_TOKENS = 24


def tp1_greedy(model: str) -> list[str]:
    """The pinned prompts' greedy texts from one whole-model engine (float32)."""
    from dpserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", threads_per_engine=1, max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=PINNED_TOKENS, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PINNED, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def pinned(url: str, model: str, rank: int) -> list[str]:
    """The pinned prompts on `rank` (X-data-parallel-rank), greedy."""
    texts = []
    for prompt in PINNED:
        resp = httpx.post(url + "/v1/completions", timeout=120,
                          headers={"X-data-parallel-rank": str(rank)},
                          json={"model": model, "prompt": prompt, "temperature": 0,
                                "max_tokens": PINNED_TOKENS, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    return texts


def workers_view(url: str) -> dict[int, list[tuple]]:
    """/engines' TP workers of each rank: (tp_rank, pid, device, has memory)."""
    rows = httpx.get(url + "/engines", timeout=5).json()["engines"]
    return {e["rank"]: [(w["tp_rank"], w["pid"], w["device"], w["rss_bytes"] > 0)
                        for w in e["tp_workers"]] for e in rows}


def group_of(server_pid: int, rank: int) -> tuple:
    """(engine core, its TP worker 1) of `rank`; the worker is the core's child."""
    kids = descendants(server_pid)
    core, worker = proc_named(kids, f"EngineCore_{rank}"), proc_named(kids, f"TPWorker_{rank}_1")
    assert worker.ppid() == core.pid, "a TP worker is started by its rank's engine core"
    return core, worker
