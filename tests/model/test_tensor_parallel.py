"""Tensor parallelism end to end, offline: `LLM(path, tensor_parallel_size=N)`
runs worker 0 in this process and N-1 spawned `TPWorker` processes
(dpserve/engine/executor.py).

Greedy tokens at TP=2 and TP=3 equal transformers' float32 greedy tokens on
tiny Llama, Qwen2, Qwen3 and Qwen2-MoE checkpoints (TP=3 with one KV head:
replicated on every worker), batched, with chunked prefill, a prefix-cache
hit and preemption; the default model gives the same greedy text at TP=3 as
at TP=1. The workers live exactly as long as the LLM (and exit when its
process is SIGKILLed), and a SIGKILLed worker makes the next generate raise an
error naming it.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import wait_until
from token_checks import greedy, hf_greedy

from dpserve import LLM, SamplingParams
from dpserve.errors import TensorParallelError
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.procs]

SHARED = list(range(40, 80))  # a 40-token prefix shared by the prefix-cache prompts
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [11, 12, 13], list(range(100, 140)),
           [7] * 5 + list(range(200, 230)), [300, 301]]
PREFIX_PROMPTS = [SHARED + [9, 10], SHARED + [20, 21, 22]]
# 6 heads; TP=2 splits 6 KV heads, TP=3 replicates a single one.
KV_HEADS = {2: 6, 3: 1}
ARCHS = {
    "llama": {},
    "qwen2": {},  # q/k/v biases
    "qwen3": {"head_dim": 16},  # q/k norms
    "qwen2_moe": {"moe_intermediate_size": 48, "shared_expert_intermediate_size": 96},
}
# Small enough that the batch outgrows the KV cache (preemption); 16-token steps
# chunk every prompt longer than that.
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=6,
              max_model_len=64)


def worker_pids() -> list[int]:
    """This process's TP worker children (by their process title)."""
    return [p.pid for p in psutil.Process().children()
            if p.cmdline()[:1] and p.cmdline()[0].startswith("dpserve::TPWorker_")]


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_equal_transformers(tmp_path, arch, tp):
    path = make_tiny_model(tmp_path / arch, arch, hidden_size=96, num_attention_heads=6,
                           num_key_value_heads=KV_HEADS[tp], intermediate_size=96,
                           **ARCHS[arch])
    with LLM(str(path), tensor_parallel_size=tp, **ENGINE) as llm:
        assert len(llm.engine.executor.worker_info()) == tp
        assert greedy(llm, PROMPTS) == hf_greedy(path, PROMPTS)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0  # the batch did not fit: some were recomputed
        first = greedy(llm, PREFIX_PROMPTS[:1])
        second = greedy(llm, PREFIX_PROMPTS[1:])
        assert llm.get_stats().prefix_cache_hits >= stats.prefix_cache_hits + 32
        assert first + second == hf_greedy(path, PREFIX_PROMPTS)


def test_default_model_same_text_at_tp3():
    chats = [[{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(temperature=0, max_tokens=16)
    texts = {}
    for tp in (1, 3):  # SmolLM2-135M: 9 heads, 3 KV heads
        with LLM(dtype="float32", tensor_parallel_size=tp, enforce_eager=True) as llm:
            texts[tp] = [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
    assert all(texts[1]) and texts[3] == texts[1]


def test_workers_live_as_long_as_the_llm(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2)
    info = llm.engine.executor.worker_info()
    assert [w.tp_rank for w in info] == [0, 1] and info[0].pid == os.getpid()
    assert [w.device for w in info] == ["cpu", "cpu"]
    assert worker_pids() == [info[1].pid]
    assert psutil.Process(info[1].pid).cmdline()[0].startswith("dpserve::TPWorker_0_1")
    assert info[1].rss_bytes > 0
    # Every worker holds its half of the 2 KV heads: a block is half the size.
    whole = LLM(str(tiny_llama)).engine.runner.block_bytes()
    assert llm.engine.executor.collective_rpc("block_bytes") == [whole // 2, whole // 2]
    llm.shutdown()
    assert worker_pids() == [] and not psutil.pid_exists(info[1].pid)

    llm = LLM(str(tiny_llama), tensor_parallel_size=2)  # dropped, not shut down
    pid = llm.engine.executor.worker_info()[1].pid
    del llm
    gc.collect()
    assert worker_pids() == [] and not psutil.pid_exists(pid)


def test_killed_worker_fails_the_next_generate(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2)
    try:
        assert len(greedy(llm, PROMPTS[:2])) == 2
        pid = llm.engine.executor.worker_info()[1].pid
        os.kill(pid, signal.SIGKILL)
        named = rf"tensor-parallel worker 1 \(pid {pid}\) of DP rank 0 exited \(exit code -9\)"
        with pytest.raises(TensorParallelError, match=named):
            greedy(llm, PROMPTS[:2])
        with pytest.raises(TensorParallelError, match=named):  # and stays failed
            greedy(llm, PROMPTS[:1])
    finally:
        llm.shutdown()
    assert worker_pids() == []


OWNER = """
import os, sys, time
from dpserve import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2)
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(llm.engine.executor.worker_info()[1].pid))
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(600)
"""


def test_workers_exit_when_their_engine_core_is_killed(tiny_llama, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    pid_file = tmp_path / "worker.pid"
    owner = subprocess.Popen([sys.executable, str(script), str(tiny_llama), str(pid_file)])
    try:
        wait_until(lambda: pid_file.exists() or owner.poll() is not None, 120,
                   "the LLM's worker started")
        worker = psutil.Process(int(pid_file.read_text()))
        assert worker.ppid() == owner.pid
        owner.kill()
        owner.wait(30)
        _, alive = psutil.wait_procs([worker], timeout=30)  # parent watch: it exits
        assert not alive
    finally:
        owner.kill()
        owner.wait(30)


def test_workers_share_out_the_rank_cores_and_threads(tiny_llama):
    import dataclasses

    from dpserve.config import EngineArgs
    from dpserve.engine.tp_worker import worker_config, worker_cpus

    config = EngineArgs(model=str(tiny_llama), tensor_parallel_size=2).create_config()

    def placed(groups, threads):
        return dataclasses.replace(config, parallel=dataclasses.replace(
            config.parallel, cpu_groups=groups, threads_per_engine=threads))

    bound = placed(((0, 1, 2, 3), (4, 5, 6, 7)), 4)
    assert [worker_cpus(bound, rank, t) for rank in (0, 1) for t in (0, 1)] == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    assert worker_cpus(placed(((5,),), 1), 0, 1) == [5]  # fewer cores than workers
    assert worker_cpus(placed(None, None), 0, 1) is None  # not bound
    assert worker_config(bound).parallel.threads_per_engine == 2
    assert worker_config(placed(None, None)).parallel.threads_per_engine == 1


def test_prompt_logprobs_and_seeded_sampling_equal_one_worker(tiny_llama):
    """What only worker 0 holds (seeded generators, penalties over all outputs) and
    what peers compute from their token window (prompt logprobs, chunked)."""
    prompt = {"prompt_token_ids": list(range(100, 140))}
    params = [SamplingParams(max_tokens=1, prompt_logprobs=3),
              SamplingParams(temperature=1.0, seed=7, max_tokens=12, frequency_penalty=0.5)]
    runs = []
    for tp in (1, 2):
        with LLM(str(tiny_llama), tensor_parallel_size=tp, dtype="float32",
                 max_num_batched_tokens=16, max_num_seqs=4) as llm:
            runs.append(llm.generate([prompt, prompt], params, use_tqdm=False))
    (logprobs1, seeded1), (logprobs2, seeded2) = runs
    assert seeded2.outputs[0].token_ids == seeded1.outputs[0].token_ids
    entries1, entries2 = logprobs1.prompt_logprobs, logprobs2.prompt_logprobs
    assert len(entries2) == len(entries1) == 40 and entries2[0] is None
    for e1, e2 in zip(entries1[1:], entries2[1:]):
        assert set(e2) == set(e1)  # the prompt token and the same top 3
        for token, lp in e1.items():
            assert e2[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
            assert e2[token].rank == lp.rank
