"""DP x TP served for real: `dpserve serve -dp 2 -tp 2` on loopback (a tiny Llama).

Four model processes: each rank's engine core is its worker 0 and starts worker
1 (`dpserve::TPWorker_<rank>_1`). Pinned requests on both ranks give the TP=1
greedy text; a TP worker SIGKILLed while its rank runs streams takes the whole
rank down: every stream still finishes with the text of an undisturbed run
(moved to the other rank), the rank comes back as a group (a new engine core
with a new worker), and after SIGTERM no process is left.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from drain_checks import check_drain
from helpers import (
    FAULT_PROMPTS,
    FAULT_SEQS,
    all_gone,
    descendants,
    finished_by_engine,
    output,
    premise_moved,
    serve,
    serve_all,
    stream_completion,
    streams_with_fault,
    wait_rank,
    wait_until,
)
from tp_checks import group_of, pinned, tp1_greedy, workers_view

pytestmark = [pytest.mark.procs, pytest.mark.slow]

TP_ARGS = ("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--dtype", "float32",
           "--threads-per-engine", "2", "--max-model-len", "256", *FAULT_SEQS)
PROMPTS = FAULT_PROMPTS[:16]
KILL_TOKENS = 160


async def streams(url: str, model: str) -> list[str]:
    """Every prompt streamed at once, nothing done to the server: the oracle."""
    chunks = [0] * len(PROMPTS)
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(
            stream_completion(client, url, model, p, chunks, i, max_tokens=KILL_TOKENS)
            for i, p in enumerate(PROMPTS)))


def test_dp2_tp2_serves_both_ranks_and_a_killed_worker_takes_its_rank_down(tiny_llama):
    model = str(tiny_llama)
    expected_pinned = tp1_greedy(model)
    with serve(model, *TP_ARGS, timeout=240) as (proc, url):
        core0, _ = group_of(proc.pid, 0)
        core1, worker1 = group_of(proc.pid, 1)
        expected_view = {r: [(0, c.pid, "cpu", True), (1, w.pid, "cpu", True)]
                         for r, (c, w) in enumerate((group_of(proc.pid, 0), (core1, worker1)))}
        wait_until(lambda: workers_view(url) == expected_view, 30, "/engines shows the workers")
        assert httpx.get(url + "/engines", timeout=5).json()["tensor_parallel_size"] == 2
        before = finished_by_engine(url)
        for rank in (0, 1):
            assert pinned(url, model, rank) == expected_pinned, f"rank {rank}"
        after = finished_by_engine(url)
        assert [after.get(r, 0) - before.get(r, 0) for r in (0, 1)] == [3, 3]

        undisturbed = asyncio.run(streams(url, model))
        got = asyncio.run(streams_with_fault(
            url, model, lambda: worker1.send_signal(signal.SIGKILL), prompts=PROMPTS,
            max_tokens=KILL_TOKENS, on_rank=1))
        assert got == undisturbed  # every stream finished, moved off the dead rank
        premise_moved(url, 0, "rank 1 lost its TP worker holding streams")
        assert "TPWorker_1_1" in output(proc) or "TP worker 1" in output(proc)

        # The rank comes back as a group: a new engine core with a new worker.
        wait_rank(url, 1, lambda e: e["state"] == "serving" and e["incarnation"] == 1,
                  timeout=120)
        new_core, new_worker = group_of(proc.pid, 1)
        assert new_core.pid != core1.pid and new_worker.pid != worker1.pid
        assert not core1.is_running() and not worker1.is_running()
        assert group_of(proc.pid, 0)[0].pid == core0.pid  # rank 0 was not touched
        assert pinned(url, model, 1) == expected_pinned
        everything = descendants(proc.pid)
    assert proc.returncode == 0, output(proc)[-3000:]
    assert all_gone(everything, 30), [p.name() for p in everything if p.is_running()]


@pytest.mark.alone  # the drain's 503 checks race its long stream (as test_drain's)
def test_tp2_scales_up_by_a_group_and_a_group_sigterm_drains_every_stream(tiny_llama):
    """DP=1 x TP=2: /engines asks the engine for its workers; scaling to DP=2 starts
    the new rank's group (engine core + worker), which serves; a SIGTERM to the
    whole process group (as Ctrl-C gives) reaches the TP workers too, which leave
    it to their engine cores: every stream finishes whole, exit 0, no process left."""
    model = str(tiny_llama)
    with serve_all([model, "--tensor-parallel-size", "2", "--threads-per-engine", "2",
                    "--data-parallel-size-max", "2", "--enable-admin-api",
                    "--allow-unauthenticated-admin"], new_session=True) as [server]:
        proc, url = server
        core, worker = group_of(proc.pid, 0)
        assert workers_view(url) == {0: [(0, core.pid, "cpu", True),
                                         (1, worker.pid, "cpu", True)]}
        resp = httpx.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": 2},
                          timeout=300)
        assert resp.status_code == 200, resp.text
        new_core, new_worker = group_of(proc.pid, 1)
        wait_until(lambda: workers_view(url).get(1) == [(0, new_core.pid, "cpu", True),
                                                        (1, new_worker.pid, "cpu", True)],
                   30, "the new rank's workers in /engines")
        assert pinned(url, model, 1) == pinned(url, model, 0)
        check_drain(server, model, group_signal=signal.SIGTERM)


def test_dp2_tp2_expert_parallel_in_lockstep_equals_one_engine(tmp_path):
    """`-dp 2 -tp 2 --enable-expert-parallel` on a tiny Mixtral: 8 experts over 4
    workers (2 each, whole experts), the ranks in lockstep waves (dummy batches on
    the idle one): pinned texts on both ranks equal one whole-model engine's."""
    from dpserve.testing.tiny_model import make_tiny_model

    model = str(make_tiny_model(tmp_path / "mixtral", "mixtral"))
    expected = tp1_greedy(model)
    with serve(model, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
               "--enable-expert-parallel", "--dtype", "float32", "--threads-per-engine", "2",
               "--max-model-len", "256", timeout=240) as (proc, url):
        for rank in (1, 0):  # rank 0 last: rank 1's tokens came with rank 0 idle
            assert pinned(url, model, rank) == expected, f"rank {rank}"
        engines = httpx.get(url + "/debug/dp_state", timeout=10).json()["engines"]
        assert all(engines[r]["dp"]["lockstep"] for r in "01")
        assert engines["0"]["dp"]["dummy_batches"] > 0  # it stepped with rank 1's waves
        assert [engines[r]["experts"]["experts"] for r in "01"] == [[0, 2], [4, 6]]
        assert "hit a fatal error" not in output(proc)
