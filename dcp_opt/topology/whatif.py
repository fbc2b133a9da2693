"""What an oversubscribed fabric costs a plan: a sweep over the leaf oversubscription of a
two-tier fat-tree (presets.fat_tree), and a topology-blind plan priced on the graph.

    rows = sweep_oversubscription(model_preset("llama-7b"), batches, ratios=(1, 2, 4, 8))

For each ratio r:1 and each batch, the planner plans twice: on the fabric (it sees the
graph) and blind (the same cluster without its topology: the two-level model, NIC rate
across nodes, no oversubscription). Both plans are then priced on the graph by simulate().
A row: ratio, aware_step_s / blind_step_s (medians over the batches), blind_over_aware
(median per-batch ratio: > 1 where knowing the fabric pays), vs_nonblocking (the aware
step time over the 1:1 fabric's: "how much does an r:1 fabric cost my plan?"), and
cross_leaf_share (share of the aware plan's GPU-seconds in groups that span leaves).
"""

from __future__ import annotations

import statistics

from ..batch import Batch
from ..cluster import GB, Cluster
from ..cost import CostModel
from ..errors import DcpOptError
from ..model import ModelSpec
from ..simulate import simulate
from .presets import NDR, NVLINK4, fat_tree


def fat_tree_cluster(ratio: float, leaves: int = 4, nodes_per_leaf: int = 4) -> Cluster:
    """DGX H100 nodes (80 GB, NVLink 4, one 400G NIC per GPU) on an r:1 fat-tree."""
    topo = fat_tree(leaves, nodes_per_leaf, ratio)
    n = leaves * nodes_per_leaf
    return Cluster(f"h100-fattree-{ratio:g}to1", n, 8, 80 * GB, 989e12, NVLINK4, NDR, topology=topo)


def cross_domain_share(plan, sim, cluster: Cluster, level: int = -1) -> float:
    """Share of the plan's GPU-seconds spent in groups that span the fabric's level-`level`
    domains (default: the outermost below the cluster, the leaves)."""
    sizes = cluster.topology.domain_sizes if cluster.topology else (cluster.gpus_per_node,)
    if not sizes:
        return 0.0
    s = sizes[level]
    busy = across = 0.0
    for e in sim.events:
        t = (e.compute_s + e.recompute_s + e.comm_s) * e.degree
        busy += t
        if e.start_rank // s != (e.start_rank + e.degree - 1) // s:
            across += t
    return across / busy if busy else 0.0


def compare_blind(batch: Batch, cost: CostModel, planner: str = "greedy", **options) -> dict:
    """Plan `batch` on the fabric and blind (the cluster without its topology), price both
    on the fabric: {aware_s, blind_s, ratio = blind_s / aware_s, plans, cross-leaf shares}."""
    from ..solvers import run_planner

    if cost.cluster.topology is None:
        raise DcpOptError("cluster: has no topology; nothing to compare a blind plan with")
    blind_cost = cost.with_(cluster=cost.cluster.with_(topology=None))
    aware = run_planner(planner, batch, cost, **options).plan
    blind = run_planner(planner, batch, blind_cost, **options).plan
    sa, sb = simulate(aware, batch, cost), simulate(blind, batch, cost)
    return {
        "aware_s": sa.step_time_s,
        "blind_s": sb.step_time_s,
        "ratio": sb.step_time_s / sa.step_time_s,
        "aware_plan": aware,
        "blind_plan": blind,
        "aware_cross_leaf": cross_domain_share(aware, sa, cost.cluster),
        "blind_cross_leaf": cross_domain_share(blind, sb, cost.cluster),
    }


def sweep_oversubscription(
    model: ModelSpec,
    batches: list[Batch],
    ratios=(1.0, 2.0, 4.0, 8.0),
    *,
    leaves: int = 4,
    nodes_per_leaf: int = 4,
    planner: str = "greedy",
) -> list[dict]:
    """One row per ratio (module docstring); the first ratio is the reference of
    vs_nonblocking, so put 1 first."""
    if not batches or not ratios:
        raise DcpOptError("sweep: needs at least one batch and one ratio")
    rows, ref = [], None
    for r in ratios:
        cost = CostModel(model, fat_tree_cluster(r, leaves, nodes_per_leaf))
        got = [compare_blind(b, cost, planner) for b in batches]
        aware = [g["aware_s"] for g in got]
        ref = ref or aware
        rows.append(
            {
                "ratio": r,
                "aware_step_s": statistics.median(aware),
                "blind_step_s": statistics.median(g["blind_s"] for g in got),
                "blind_over_aware": statistics.median(g["ratio"] for g in got),
                "vs_nonblocking": statistics.median(a / b for a, b in zip(aware, ref, strict=True)),
                "cross_leaf_share": statistics.median(g["aware_cross_leaf"] for g in got),
                "blind_cross_leaf_share": statistics.median(g["blind_cross_leaf"] for g in got),
            }
        )
    return rows
