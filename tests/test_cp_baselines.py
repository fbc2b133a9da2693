"""The framework baselines of issue 16: megatron_dynamic_cp and verl_balanced."""

from __future__ import annotations

import pytest
from dcp_opt.solvers import FRAMEWORK_BASELINES, run_planner
from dcp_opt.solvers.baselines.verl import karmarkar_karp

from dcp_opt import Batch, CostModel, cluster_preset, validate
from dcp_opt.model import model_preset
from dcp_opt.workloads import STANDARD_WORKLOADS, standard_batch

COSTS = {  # cp offered on the 1D model: megatron_dynamic_cp's groups are cp there
    "1d": CostModel(
        model_preset("llama3-8b"), cluster_preset("h200x32"), sp_kinds=("ulysses", "cp")
    ),
    "2d": CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32")),
}


@pytest.mark.parametrize("planner", FRAMEWORK_BASELINES)
@pytest.mark.parametrize("workload", [w.name for w in STANDARD_WORKLOADS])
def test_valid_on_every_standard_workload(planner, workload):
    cost = COSTS[workload[:2]]
    batch = standard_batch(workload, seed=0, num_gpus=32, tokens_per_gpu=16384)
    res = run_planner(planner, batch, cost)
    assert validate(res.plan, batch, cost) == []
    assert res.lower_bound_s <= res.predicted_step_time_s
    kinds = {g.kind for ph in res.plan.phases for g in ph.groups if g.micro_batches}
    if planner == "verl_balanced" or workload.startswith("2d"):
        assert kinds == {"ulysses"}
    else:
        assert "cp" in kinds or all(g.degree == 1 for g in res.plan.phases[0].groups)


@pytest.mark.parametrize("workload", [w.name for w in STANDARD_WORKLOADS if w.kind == "1d"])
def test_megatron_groups_are_ring_where_ring_is_offered(workload):
    """Issue 25: Megatron-Core's CP is TransformerEngine's P2P ring, its default kind where
    the cost model offers ring; verl keeps Ulysses on the same cost model."""
    cost = COSTS["1d"].with_(sp_kinds=("ulysses", "cp", "ring"))
    batch = standard_batch(workload, seed=0, num_gpus=32, tokens_per_gpu=16384)
    res = run_planner("megatron_dynamic_cp", batch, cost, max_seqlen_per_rank=4096)
    assert validate(res.plan, batch, cost) == [] and res.stats["kind"] == "ring"
    assert {g.kind for ph in res.plan.phases for g in ph.groups if g.degree > 1} == {"ring"}
    verl = run_planner("verl_balanced", batch, cost)
    assert {g.kind for ph in verl.plan.phases for g in ph.groups} == {"ulysses"}


def test_megatron_schedule_gains_nothing_from_idle_ranks():
    cost = COSTS["1d"]
    batch = Batch.from_lengths([200_000, 50_000, 8000, 8000, 4000, 2000, 1000, 1000])
    res = run_planner("megatron_dynamic_cp", batch, cost)
    assert validate(res.plan, batch, cost) == []
    for ph in res.plan.phases:  # fill_empty_gpus: every rank works in every micro-step
        assert sum(g.degree for g in ph.groups if g.micro_batches) == 32


def test_karmarkar_karp_by_hand():
    # largest differencing on [8, 7, 6, 5, 4] into 2: differences 1, 1, then 4 - 1 - 1 = 2
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [14, 16]  # LDM's answer (the optimum 15/15 is not LDM's)
    parts = karmarkar_karp([1, 2, 3, 4, 5, 6], 3, equal_size=True)
    assert sorted(len(p) for p in parts) == [2, 2, 2]
    assert sorted(sum(i + 1 for i in p) for p in parts) == [7, 7, 7]
