"""Expert parallelism across DP ranks x TP workers, in real worker processes.

Each test spawns one process per worker (2 DP ranks x 2 TP workers, or 1 x 2),
forms a gloo TP group per rank and a DP group of the ranks' worker 0s, as the
engine and its TP executor do, and builds a `ModelRunner` with
`enable_expert_parallel` and its `TensorParallel`: worker t of rank d holds the
experts of EP index d*2+t, whole. Each rank forwards its own tokens (different
counts, so the DP exchange pads), or a lockstep dummy batch beside another
rank's real one; every rank's logits must equal a TP=1, no-EP model's on the
same tokens, every worker of a rank must run the same number of TP
collectives, and the worker 0s the same number of DP ones (their peers none).
An elastic re-shard to DP size 1 then spreads the experts over rank 0's two
workers alone. A DP rank SIGKILLed mid-forward fails that forward on both of the
other rank's workers, which then serve on in step.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from dpserve.config import EngineArgs
from dpserve.errors import ExpertParallelError, TensorParallelError
from dpserve.model.runner import ModelRunner
from dpserve.model.tensor_parallel import TensorParallel
from dpserve.sampling_params import SamplingParams
from dpserve.step import ScheduledRequest, SchedulerOutput
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = [pytest.mark.procs, pytest.mark.slow]

TIMEOUT_S = 180.0  # a whole run of the workers
GROUP_TIMEOUT = datetime.timedelta(seconds=60)  # a collective whose peer never comes

KILL_LEAD = "worker 0 dies at its first reduce-scatter"
A, B = [5, 17, 99, 3, 42, 7, 8, 200, 33, 1, 250, 9], [11, 12, 13, 14, 15]
C, D, E = [300, 301, 2, 40, 41, 42, 43], [7] * 9, list(range(100, 110))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """qwen2_moe (a shared expert, sliced over the TP workers) and qwen3_moe (per-head
    q/k norms): 8 experts, moe_intermediate_size 32."""
    root = tmp_path_factory.mktemp("ep_tp")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("qwen2_moe", "qwen3_moe")}


def _prompt_logits(runner: ModelRunner, prompt: list[int]) -> np.ndarray:
    """Logits [len(prompt), vocab] of one prefill (through the runner's input seam)."""
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    req = ScheduledRequest("r", list(prompt), len(prompt), 0, len(prompt), blocks, True,
                           SamplingParams(temperature=0), None)
    inputs = runner.prepare_inputs(SchedulerOutput([req], 0, len(prompt)))
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_meta,
                              runner.kv_caches)
        return runner.model.compute_logits(hidden).numpy()


def _gloo(store: Path, rank: int, size: int) -> Any:
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = GROUP_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.FileStore(str(store), size), rank, size, options)


def _step(runner: ModelRunner, action: tuple) -> np.ndarray | None:
    """One planned action: ("prompt", tokens), ("dummy",), ("reshard", rank, size), or
    ("prompt", tokens, KILL_LEAD): worker 0 SIGKILLs itself at its first
    reduce-scatter (mid-forward, after the layer's gathers), the others just run it."""
    ep = runner.expert_parallel
    if action[0] == "prompt" and action[2:] == (KILL_LEAD,) and runner.tp.rank == 0:
        ep._reduce_scatter = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # fault
    if action[0] == "prompt":
        return _prompt_logits(runner, action[1])
    if action[0] == "dummy":
        runner.execute_dummy()
    else:
        runner.reshard_experts(action[1], action[2])
        if action[2] == 1:  # the engine's DP group is gone at DP size 1
            runner.expert_parallel.group_source = lambda: None
    return None


def _worker(path: str, dp_rank: int, dp_size: int, tp_rank: int, tp_size: int,
            stores: Path, plan: list[tuple], results: Any) -> None:
    """One TP worker of one DP rank: its groups, its runner, its rank's plan."""
    try:
        torch.set_num_threads(1)
        tp = TensorParallel(tp_rank, tp_size, _gloo(stores / f"tp{dp_rank}", tp_rank, tp_size))
        config = EngineArgs(model=path, data_parallel_size=dp_size,
                            tensor_parallel_size=tp_size, enable_expert_parallel=True,
                            dtype="float32", max_model_len=256, num_kv_blocks=32,
                            threads_per_engine=1).create_config()
        runner = ModelRunner(config, dp_rank, tp)
        ep = runner.expert_parallel
        if tp_rank == 0 and dp_size > 1:  # only worker 0 is in the DP group
            dp_group = _gloo(stores / "dp", dp_rank, dp_size)
            ep.group_source = lambda: dp_group
        runner.initialize_kv_cache(32)
        out: dict[str, Any] = dict(logits=[], experts=[], ep=[], tp=[], failed={})
        for i, action in enumerate(plan):
            try:
                out["logits"].append(_step(runner, action))
            except (ExpertParallelError, TensorParallelError) as e:
                out["logits"].append(None)
                out["failed"][i] = type(e).__name__
            out["experts"].append(runner.model.expert_info()["experts"])
            out["ep"].append(ep.collectives)
            out["tp"].append(tp.collectives)
            if out["failed"].get(i) == "TensorParallelError":
                break  # the rank is down as a group
        results.put((dp_rank, tp_rank, out))
    except BaseException:
        results.put((dp_rank, tp_rank, {"error": traceback.format_exc()}))
        raise


def _run_workers(path: Path, dp_size: int, tp_size: int, plans: list[list[tuple]],
                 stores: Path, killed: frozenset = frozenset()) -> dict[tuple[int, int], dict]:
    """Every worker's results, keyed (dp_rank, tp_rank), but those of the workers in
    `killed` (each must end by SIGKILL); every wait bounded."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = {(d, t): ctx.Process(target=_worker, daemon=True,
                                 args=(str(path), d, dp_size, t, tp_size, stores, plans[d],
                                       results))
             for d in range(dp_size) for t in range(tp_size)}
    got: dict[tuple[int, int], dict] = {}
    try:
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) < len(procs) - len(killed):
            try:
                d, t, out = results.get(timeout=1.0)
            except queue.Empty:
                dead = [k for k, p in procs.items()
                        if k not in got and k not in killed and not p.is_alive()]
                assert not dead, f"workers {dead} died without a result"
                assert time.monotonic() < deadline, f"only {sorted(got)} reported in time"
                continue
            assert "error" not in out, f"worker {(d, t)} failed:\n{out['error']}"
            got[(d, t)] = out
        for key, p in procs.items():
            p.join(timeout=30)
            expected = -signal.SIGKILL if key in killed else 0
            assert p.exitcode == expected, f"worker {key} exit code {p.exitcode}"
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return got


def _reference(path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    """A TP=1, no-EP runner's logits of each prompt (in this process)."""
    config = EngineArgs(model=str(path), dtype="float32", max_model_len=256,
                        num_kv_blocks=32).create_config()
    runner = ModelRunner(config)
    runner.initialize_kv_cache(32)
    return [_prompt_logits(runner, p) for p in prompts]


def _check_logits(got: dict, plans: list[list[tuple]], path: Path) -> int:
    """Every worker's logits of every prompt equal the reference; returns how many."""
    prompts = [a[1] for plan in plans for a in plan if a[0] == "prompt"]
    expected = dict(zip(map(tuple, prompts), _reference(path, prompts), strict=True))
    checked = 0
    for (d, _t), out in got.items():
        for i, action in enumerate(plans[d]):
            if action[0] == "prompt":
                np.testing.assert_allclose(out["logits"][i], expected[tuple(action[1])],
                                           rtol=0, atol=1e-4)
                checked += 1
    return checked


def _check_collectives(got: dict, dp_size: int, steps: int) -> None:
    """Each rank's workers ran the same TP collectives; the worker 0s the same DP
    ones over the first `steps` steps (the others: none)."""
    for d in range(dp_size):
        assert got[(d, 0)]["tp"] == got[(d, 1)]["tp"]
        assert got[(d, 1)]["ep"] == [0] * len(got[(d, 1)]["ep"])
    ep = [got[(d, 0)]["ep"][:steps] for d in range(dp_size)]
    assert all(e == ep[0] for e in ep)


def test_experts_over_two_ranks_of_two_workers_equal_one_model(models, tmp_path):
    path = models["qwen2_moe"]
    plans = [
        [("prompt", A), ("prompt", C), ("dummy",), ("reshard", 0, 1), ("prompt", E)],
        [("prompt", B), ("dummy",), ("prompt", D)],
    ]
    got = _run_workers(path, 2, 2, plans, tmp_path)
    assert _check_logits(got, plans, path) == 2 * 5  # both workers of each rank
    # Whole experts, two per worker over EP index d*2+t; then rank 0's alone.
    assert [got[(d, t)]["experts"][0] for d in (0, 1) for t in (0, 1)] == \
        [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert [got[(0, t)]["experts"][-1] for t in (0, 1)] == [[0, 4], [4, 8]]
    _check_collectives(got, 2, steps=3)
    assert got[(0, 0)]["tp"][0] == got[(1, 0)]["tp"][0]  # both ranks' first step: a prompt
    # Three forwards over the DP group: one count all-gather each, and per MoE layer
    # two all-gathers and a reduce-scatter (two layers); none after the re-shard.
    assert got[(0, 0)]["ep"] == [7, 14, 21, 21, 21]


def test_experts_over_the_two_workers_of_one_rank_equal_one_model(models, tmp_path):
    path = models["qwen3_moe"]
    plans = [[("prompt", A), ("dummy",), ("prompt", B)]]
    got = _run_workers(path, 1, 2, plans, tmp_path)
    assert _check_logits(got, plans, path) == 2 * 2
    assert [got[(0, t)]["experts"][0] for t in (0, 1)] == [[0, 4], [4, 8]]
    _check_collectives(got, 1, steps=3)
    assert got[(0, 0)]["ep"] == [0, 0, 0]  # no DP group: the TP sum finishes each layer


def test_a_dead_rank_fails_the_forward_on_both_workers_which_stay_in_step(models, tmp_path):
    """Rank 1's worker 0 is SIGKILLed mid-forward (after a layer's gathers, before its
    reduce-scatter): both of rank 0's workers raise ExpertParallelError at that
    forward's end (its peer, outside the DP group, told so by worker 0), and serve
    on, in step, at DP size 1; rank 1's peer sees its TP group broken."""
    path = models["qwen3_moe"]
    plans = [[("prompt", A), ("prompt", C), ("reshard", 0, 1), ("prompt", E)],
             [("prompt", B), ("prompt", D, KILL_LEAD)]]
    got = _run_workers(path, 2, 2, plans, tmp_path, killed=frozenset({(1, 0)}))
    assert [got[(0, t)]["failed"] for t in (0, 1)] == [{1: "ExpertParallelError"}] * 2
    assert got[(1, 1)]["failed"] == {1: "TensorParallelError"}
    # Before the fault and after the re-shard, rank 0 equals one model.
    ref = _reference(path, [A, E])
    for t in (0, 1):
        np.testing.assert_allclose(got[(0, t)]["logits"][0], ref[0], rtol=0, atol=1e-4)
        np.testing.assert_allclose(got[(0, t)]["logits"][3], ref[1], rtol=0, atol=1e-4)
    assert got[(0, 0)]["tp"] == got[(0, 1)]["tp"]
    # The failed forward: the count all-gather, then layer 1's two gathers; its
    # reduce-scatter failed and nothing more went over the DP group.
    assert got[(0, 0)]["ep"][:2] == [7, 10]
