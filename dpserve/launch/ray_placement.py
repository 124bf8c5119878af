"""Where each DP rank of the Ray backend runs: its resources, the nodes, the plan.

Scope (pure but for `cluster_nodes`, which reads Ray's view of its nodes):
`engine_bundles` / `rank_needs` (what one rank needs: one bundle per CPU
tensor-parallel worker, or one GPU bundle and one CPU bundle), `RayNode` (a node
as the planner sees it), `plan_placement` (the node of each rank, per pack
strategy: fill, strict, span), `master_node` (the node of the DP master address).

Invariants: a rank is one placement group on one node (its TP workers run where
its actor runs); rank 0 runs on the DP master's node; a rank that cannot fit
fails before any placement group is made, with what it needs, what is missing
and what each node has.

Not here: creating placement groups and actors (`dpserve.launch.ray_backend`).

Design: docs/design/ray.md
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dpserve.config import EngineConfig

logger = logging.getLogger("dpserve.launch.ray_backend")

PACK_STRATEGIES = ("strict", "fill", "span")
NODE_ID_LABEL = "ray.io/node-id"  # Ray's built-in node label (bundle label selectors)
_EPS = 1e-6  # Ray resources are fixed-point floats


class RayPlacementError(RuntimeError):
    """A DP rank cannot be placed on the Ray cluster (the message says what is missing)."""


def check_pack_strategy(strategy: str) -> str:
    if strategy not in PACK_STRATEGIES:
        raise ValueError(f"data_parallel_pack_strategy must be one of "
                         f"{', '.join(PACK_STRATEGIES)}, got {strategy!r}")
    return strategy


@dataclass(frozen=True)
class RayNode:
    """One alive Ray node as the planner sees it."""

    node_id: str  # hex
    ip: str
    total: dict[str, float]  # resource -> amount the node has
    available: dict[str, float]  # resource -> amount free now

    def describe(self, need: dict[str, float], left: dict[str, float],
                 master: bool = False) -> str:
        """`node 1a2b3c4d (10.0.0.5, DP master): CPU 0 of 8` (what is left of each need)."""
        have = ", ".join(f"{k} {left.get(k, 0.0):g} of {self.total[k]:g}" if k in self.total
                         else f"no {k}" for k in need)
        return f"node {self.node_id[:8]} ({self.ip}{', DP master' if master else ''}): {have}"


def engine_bundles(config: EngineConfig) -> list[dict[str, float]]:
    """The placement-group bundles of one DP rank (docs/design/ray.md: what one rank needs)."""
    tp = config.parallel.tensor_parallel_size
    threads = config.parallel.threads_per_engine
    if config.device == "cuda":
        return [{"GPU": float(tp)}, {"CPU": float(threads or 1)}]
    per_worker = float(max(1, (threads or tp) // tp))
    return [{"CPU": per_worker} for _ in range(tp)]


def rank_needs(bundles: Sequence[dict[str, float]]) -> dict[str, float]:
    """What one rank needs on one node: its bundles added up."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    return need


def room(free: dict[str, float], need: dict[str, float]) -> int:
    """How many ranks needing `need` fit in `free`."""
    counts = [math.floor(free.get(k, 0.0) / v + _EPS) for k, v in need.items() if v > 0]
    return max(0, min(counts)) if counts else 0


def plan_placement(nodes: Sequence[RayNode], master_id: str, need: dict[str, float],
                   num_ranks: int, strategy: str, *, ranks_per_node: int | None = None,
                   use_total: bool = False, first_rank: int = 0) -> list[RayNode]:
    """The node of each rank first_rank..first_rank+num_ranks-1 (docs/design/ray.md:
    pack strategies; ranks added by scaling, first_rank > 0, may run on any node).

    Plans on the nodes' free resources (`use_total`: on all they have).
    Raises RayPlacementError naming the first rank that does not fit, what it
    needs and what every node has left.
    """
    check_pack_strategy(strategy)
    master = next((n for n in nodes if n.node_id == master_id), None)
    if master is None:
        raise RayPlacementError(f"the DP master node {master_id[:8]} is not an alive Ray node")
    order = [master, *sorted((n for n in nodes if n is not master),
                             key=lambda n: (n.ip, n.node_id))]
    free = {n.node_id: dict(n.total if use_total else n.available) for n in order}
    per_node = {"fill": None, "span": 1, "strict": ranks_per_node}[strategy]
    if strategy == "strict" and per_node is None:
        per_node = min(room(free[master.node_id], need), num_ranks) or 1
    plan: list[RayNode] = []
    for node in order:
        left = num_ranks - len(plan)
        fits = room(free[node.node_id], need)
        if per_node is None:  # fill: as many as fit
            take = min(fits, left)
        else:  # strict/span: its whole share, or none
            share = min(per_node, left)
            take = share if fits >= share else 0
        if node is master and take == 0 and first_rank == 0:
            break  # rank 0 runs on the master node, or nowhere
        for _ in range(take):
            plan.append(node)
            for key, amount in need.items():
                free[node.node_id][key] = free[node.node_id].get(key, 0.0) - amount
    if len(plan) < num_ranks:
        raise RayPlacementError(_unplaceable(first_rank + len(plan), order, free, need,
                                             strategy, per_node, use_total, first_rank))
    return plan


def _unplaceable(rank: int, order: list[RayNode], left: dict[str, dict[str, float]],
                 need: dict[str, float], strategy: str, per_node: int | None,
                 use_total: bool, first_rank: int = 0) -> str:
    rule = {"fill": "", "span": ", one rank per node",
            "strict": f", {per_node} rank(s) per node"}[strategy]
    where = "on the DP master node (where the launcher runs)" if rank == 0 else "on one node"
    missing = ", ".join(sorted({k for n in order for k, v in need.items()
                                if left[n.node_id].get(k, 0.0) + _EPS < v}))
    if not missing:  # strict/span: room enough, but not for a whole share on a new node
        missing = f"another node (the cluster has {len(order)})"
    counted = "counting everything the cluster has" if use_total else "free now"
    after = f"after ranks {first_rank}-{rank - 1}" if rank > first_rank else (
        "before any rank" if rank == 0 else f"before rank {rank}")
    nodes = "; ".join(n.describe(need, left[n.node_id], i == 0) for i, n in enumerate(order))
    return (f"cannot place DP rank {rank} (pack strategy {strategy!r}{rule}): it needs "
            f"{need} {where}; missing: {missing}. Left per "
            f"node {after} ({counted}): {nodes}")


def cluster_nodes() -> list[RayNode]:
    import ray

    try:  # not public API; without it, plan on the totals (resources in use are waited for)
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except (ImportError, AttributeError) as e:
        logger.warning("cannot read the nodes' free resources (%s); using their totals", e)
        free = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
    return [RayNode(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]),
                    dict(free.get(n["NodeID"], {})))
            for n in ray.nodes() if n.get("Alive")]


def master_node(nodes: list[RayNode], ip: str, own_node_id: str) -> RayNode:
    """The node whose IP is the DP master address; this process's own if several."""
    matches = [n for n in nodes if n.ip == ip]
    if not matches:
        raise RayPlacementError(
            f"no Ray node has the DP master address {ip} (nodes: "
            f"{', '.join(sorted({n.ip for n in nodes}))}); run the launcher on a node of "
            f"the cluster and pass that node's IP as the DP master address")
    return next((n for n in matches if n.node_id == own_node_id), matches[0])
