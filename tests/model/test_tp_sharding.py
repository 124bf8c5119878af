"""Tensor-parallel sharding, below the engine: what each worker holds and computes.

Workers here are real processes (spawned) in a real gloo group over a
FileStore, each loading its shard of a tiny random checkpoint through
`ModelRunner`; the logits of one prefill, all-gathered, must equal the whole
model's on every worker. The tiny models are chosen to reach every sharding
rule: a vocabulary that does not divide (the last shard padded), KV heads
fewer than the workers (replicated), OLMoE's q/k norm over the whole
projection (all-reduced squares), Mixtral's experts split by their
intermediate dimension. Options that cannot split the model are
one-line errors before anything starts.
"""

from __future__ import annotations

import multiprocessing
import queue
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpserve.config import ConfigError, EngineArgs
from dpserve.testing.tiny_model import make_tiny_model

PROMPT = [5, 17, 99, 3, 42, 7, 8, 200, 384, 0, 1, 250]  # 384: the padded shard's last row
WORKER_TIMEOUT_S = 120.0

# 6 heads and 96 intermediate divide by 2 and 3; vocabulary 385 divides by neither.
SHAPES = dict(hidden_size=96, num_attention_heads=6, intermediate_size=96, vocab_size=385)


def _worker_logits(path: str, rank: int, size: int, store: str, out: multiprocessing.Queue
                   ) -> None:
    """One TP worker: form the group, load the shard, run the prompt's prefill."""
    import torch
    import torch.distributed as dist

    from dpserve.model.runner import ModelRunner
    from dpserve.model.tensor_parallel import TensorParallel
    from dpserve.sampling_params import SamplingParams
    from dpserve.step import ScheduledRequest, SchedulerOutput

    torch.set_num_threads(1)
    tp = TensorParallel(rank, size)
    if size > 1:
        tp.group = dist.ProcessGroupGloo(dist.FileStore(store, size), rank, size)
    config = EngineArgs(model=path, dtype="float32", max_model_len=256,
                        num_kv_blocks=8).create_config()
    runner = ModelRunner(config, 0, tp)
    runner.initialize_kv_cache(8)
    request = ScheduledRequest("r", list(PROMPT), len(PROMPT), 0, len(PROMPT), [0], True,
                               SamplingParams(temperature=0), None)
    inputs = runner.prepare_inputs(SchedulerOutput([request], 0, len(PROMPT)))
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_meta,
                              runner.kv_caches)
        logits = runner.model.compute_logits(hidden)
    out.put((rank, logits.numpy(), runner.kv_heads, tp.collectives))


def sharded_logits(path: Path, size: int, tmp_path: Path) -> dict[int, tuple]:
    """rank -> (logits, KV heads held, collectives run) of `size` spawned workers."""
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = ctx.Queue()
    store = str(tmp_path / f"store-{size}")
    procs = [ctx.Process(target=_worker_logits, args=(str(path), r, size, store, results))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, *rest = results.get(timeout=WORKER_TIMEOUT_S)
            got[rank] = rest
        return got
    except queue.Empty:
        raise AssertionError(f"a TP worker gave no logits in {WORKER_TIMEOUT_S} s; exit "
                             f"codes {[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


CASES = [  # (arch, overrides, TP size, KV heads each worker holds)
    ("llama", dict(num_key_value_heads=3), 3, 1),
    ("llama", dict(num_key_value_heads=1), 2, 1),  # one KV head, replicated
    ("olmoe", dict(num_key_value_heads=6), 3, 2),  # q/k norm over the whole projection
    ("mixtral", dict(num_key_value_heads=2), 2, 1),
]  # Qwen2 (biases), Qwen3 (per-head norms), Qwen2-MoE (shared expert): end to end in
#    tests/model/test_tensor_parallel.py, against transformers


@pytest.mark.slow
@pytest.mark.parametrize("arch, overrides, size, kv_here", CASES,
                         ids=[f"{c[0]}-tp{c[2]}" for c in CASES])
def test_sharded_logits_equal_the_whole_model(tmp_path, arch, overrides, size, kv_here):
    path = make_tiny_model(tmp_path / arch, arch, **{**SHAPES, **overrides})
    whole = sharded_logits(path, 1, tmp_path)[0][0]
    assert whole.shape == (len(PROMPT), SHAPES["vocab_size"])
    workers = sharded_logits(path, size, tmp_path)
    assert sorted(workers) == list(range(size))
    for rank, (logits, kv_heads, _) in workers.items():
        assert kv_heads == kv_here, f"worker {rank} holds {kv_heads} KV heads"
        np.testing.assert_allclose(logits, whole, rtol=1e-4, atol=1e-4)
        assert (logits.argmax(-1) == whole.argmax(-1)).all()
    counts = {collectives for _, _, collectives in workers.values()}
    assert len(counts) == 1 and counts.pop() > 0, "workers ran different collectives"


@pytest.mark.parametrize("arch, overrides, size, says", [
    ("llama", dict(num_key_value_heads=2), 4, "must divide the model's 6 attention heads"),
    ("llama", dict(num_key_value_heads=3), 2, "must divide the model's 3 KV heads"),
    ("llama", dict(num_key_value_heads=6, intermediate_size=99), 2,
     "intermediate_size (99)"),
    ("olmoe", dict(num_key_value_heads=1), 2, "OLMoE's 1 KV heads"),
    ("qwen2_moe", dict(num_key_value_heads=6, moe_intermediate_size=45), 2,
     "moe_intermediate_size (45)"),
])
def test_models_that_cannot_split_are_refused(tmp_path, arch, overrides, size, says):
    path = make_tiny_model(tmp_path / arch, arch, **{**SHAPES, **overrides})
    with pytest.raises(ConfigError, match="tensor_parallel_size") as err:
        EngineArgs(model=str(path), tensor_parallel_size=size).create_config()
    assert says in str(err.value)


@pytest.mark.procs
def test_gguf_that_cannot_split_is_a_one_line_cli_error():
    """The default model is a GGUF file: 9 heads do not split over 2 workers."""
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", "--port", "0",
                           "-tp", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dpserve: error: --tensor-parallel-size 2 must divide"), last
    assert "9 attention heads" in last and "Traceback" not in proc.stderr
