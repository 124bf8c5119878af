"""The Ray backend's placement planner (`dpserve.launch.ray_placement.plan_placement`) on
made-up nodes, and the options the manager refuses before it connects to Ray.
Pure logic in milliseconds: needs no Ray installed (`import ray` happens only
when a manager connects)."""

from __future__ import annotations

import sys

import pytest

from dpserve.config import EngineArgs, EngineConfig
from dpserve.launch.addresses import AddressAllocator, ZmqAddresses
from dpserve.launch.ray_backend import RayEngineManager
from dpserve.launch.ray_placement import (
    RayNode,
    RayPlacementError,
    check_pack_strategy,
    engine_bundles,
    plan_placement,
    rank_needs,
)


def _config(model, dp: int) -> EngineConfig:
    return EngineArgs(model=str(model), data_parallel_size=dp, threads_per_engine=1,
                      max_model_len=256, num_kv_blocks=64,
                      data_parallel_backend="ray").create_config()


def _tcp_addresses() -> ZmqAddresses:
    return AddressAllocator(local_only=False, host="127.0.0.1").engine_addresses(1)


def _ray_not_started() -> bool:
    ray = sys.modules.get("ray")  # None when Ray is not installed or never imported
    return ray is None or not ray.is_initialized()


# ---- the planner, on made-up nodes --------------------------------------------------------


def _node(name: str, ip: str, cpus: float, **extra: float) -> RayNode:
    total = {"CPU": cpus, **extra}
    return RayNode(name * 8, ip, total, dict(total))


MASTER = _node("m", "10.0.0.1", 4)
SMALL = _node("s", "10.0.0.2", 2)  # ordered by IP after the master
BIG = _node("b", "10.0.0.3", 8)
NODES = [BIG, SMALL, MASTER]
CPU1 = {"CPU": 1.0}


def _plan(num_ranks: int, strategy: str, **kw) -> list[str]:
    return [n.node_id[0] for n in plan_placement(NODES, MASTER.node_id, CPU1, num_ranks,
                                                 strategy, **kw)]


def test_fill_fills_nodes_in_order_master_first():
    assert _plan(8, "fill") == list("mmmmssbb")
    assert _plan(3, "fill") == list("mmm")


def test_strict_runs_the_same_number_per_node_and_skips_small_nodes():
    # The master holds 4: so does every node used; SMALL (room 2) is skipped.
    assert _plan(8, "strict") == list("mmmmbbbb")
    assert _plan(5, "strict", ranks_per_node=2) == list("mmssb")
    assert _plan(6, "strict") == list("mmmmss")  # the rest (2) fits on SMALL


def test_span_puts_one_rank_per_node():
    assert _plan(3, "span") == list("msb")
    with pytest.raises(RayPlacementError, match=r"rank 3 .*one rank per node"):
        _plan(4, "span")


def test_rank_that_does_not_fit_names_what_is_missing():
    with pytest.raises(RayPlacementError) as e:
        _plan(15, "fill")
    msg = str(e.value)
    assert "cannot place DP rank 14" in msg and "missing: CPU" in msg
    assert "node mmmmmmmm (10.0.0.1, DP master): CPU 0 of 4" in msg
    with pytest.raises(RayPlacementError, match=r"rank 0 .*missing: GPU.*no GPU"):
        plan_placement(NODES, MASTER.node_id, {"GPU": 1.0, "CPU": 1.0}, 1, "fill")


def test_rank_zero_must_run_on_the_master_node():
    busy_master = RayNode(MASTER.node_id, MASTER.ip, MASTER.total, {"CPU": 0.0})
    for strategy in ("fill", "strict", "span"):
        with pytest.raises(RayPlacementError, match="rank 0 .*DP master node"):
            plan_placement([busy_master, BIG], MASTER.node_id, CPU1, 1, strategy)
    # Counting everything the nodes have, it fits (resources in use are waited for).
    assert plan_placement([busy_master, BIG], MASTER.node_id, CPU1, 1, "fill",
                          use_total=True) == [busy_master]


def test_ranks_added_by_scaling_may_run_off_the_master_and_are_named():
    busy_master = RayNode(MASTER.node_id, MASTER.ip, MASTER.total, {"CPU": 0.0})
    assert plan_placement([busy_master, BIG], MASTER.node_id, CPU1, 2, "fill",
                          first_rank=3) == [BIG, BIG]
    small = RayNode(SMALL.node_id, SMALL.ip, SMALL.total, {"CPU": 1.0})
    with pytest.raises(RayPlacementError) as e:
        plan_placement([busy_master, small], MASTER.node_id, CPU1, 2, "fill", first_rank=3)
    assert "cannot place DP rank 4" in str(e.value) and "after ranks 3-3" in str(e.value)
    assert "missing: CPU" in str(e.value)


@pytest.mark.parametrize("bad", ["pack", "", "STRICT"])
def test_pack_strategy_is_validated(bad, tiny_llama):
    with pytest.raises(ValueError, match="data_parallel_pack_strategy must be one of "
                                         "strict, fill, span"):
        check_pack_strategy(bad)
    with pytest.raises(ValueError, match="data_parallel_pack_strategy"):
        plan_placement(NODES, MASTER.node_id, CPU1, 1, bad)
    # The manager refuses it before connecting to Ray.
    with pytest.raises(ValueError, match="data_parallel_pack_strategy"):
        RayEngineManager(_config(tiny_llama, 1), _tcp_addresses().init_metadata(),
                         pack_strategy=bad)
    assert _ray_not_started()


def test_init_metadata_must_use_tcp(tiny_llama):
    addrs = AddressAllocator()  # ipc://
    try:
        with pytest.raises(ValueError, match="must be tcp://"):
            RayEngineManager(_config(tiny_llama, 1), addrs.engine_addresses().init_metadata())
    finally:
        addrs.cleanup()
    assert _ray_not_started()



def test_a_tensor_parallel_rank_asks_one_bundle_per_worker_on_one_node(tiny_llama):
    """DP x TP on Ray: each rank's placement group holds a CPU bundle per TP worker
    (threads shared out), and the planner places whole ranks: a node with room for
    fewer workers than a rank has runs none of it."""
    config = EngineArgs(model=str(tiny_llama), data_parallel_size=2, tensor_parallel_size=2,
                        threads_per_engine=4, max_model_len=256, num_kv_blocks=64,
                        data_parallel_backend="ray").create_config()
    bundles = engine_bundles(config)
    assert bundles == [{"CPU": 2.0}, {"CPU": 2.0}]
    need = rank_needs(bundles)
    assert need == {"CPU": 4.0}
    plan = plan_placement(NODES, MASTER.node_id, need, 3, "fill")
    assert [n.node_id[0] for n in plan] == ["m", "b", "b"]  # SMALL (2 CPUs) holds no rank
