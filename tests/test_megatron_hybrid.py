"""`megatron_hybrid_cp` calls the released Megatron-Core's BalancedCPScheduler (issue 25
item 2): the package's code ran (a spy on it), and its plans are valid on every 1D workload.
CI installs the `megatron` extra (scripts/test.sh); without it these tests are skipped and the
planner is refused with the install line."""

from __future__ import annotations

import sys
import warnings

import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.baselines.megatron_hybrid import MODULE

from dcp_opt import CostModel, cluster_preset, validate
from dcp_opt.errors import DcpOptError
from dcp_opt.model import model_preset
from dcp_opt.workloads import STANDARD_WORKLOADS, standard_batch

COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200x32"), sp_kinds=("ulysses", "cp"))


@pytest.fixture(scope="module")
def released():
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        return pytest.importorskip(MODULE, reason="the megatron extra is not installed")


@pytest.mark.parametrize("workload", [w.name for w in STANDARD_WORKLOADS if w.kind == "1d"])
def test_megatron_hybrid_cp_runs_the_package(released, monkeypatch, workload):
    calls = []
    real = released.BalancedCPScheduler.next_hdp_group

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(out[3])  # the package's sample ids per rank of this micro-step
        return out

    monkeypatch.setattr(released.BalancedCPScheduler, "next_hdp_group", spy)
    batch = standard_batch(workload, seed=0, num_gpus=32, tokens_per_gpu=16384)
    res = run_planner("megatron_hybrid_cp", batch, COST, max_seqlen_per_rank=8192)
    assert validate(res.plan, batch, COST) == []
    assert len(calls) == res.stats["micro_steps"] == len(res.plan.phases)
    # each phase holds exactly the package's groups: per micro-step, the sizes of its groups
    for ids_per_rank, phase in zip(calls, res.plan.phases, strict=True):
        package = sorted(
            ids_per_rank.count(ids) for ids in map(list, {tuple(x) for x in ids_per_rank})
        )
        assert package == sorted(g.degree for g in phase.groups)


def test_megatron_hybrid_cp_refused_without_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, MODULE, None)  # import of it raises ImportError
    with pytest.raises(DcpOptError, match=r"install the extra: pip install -e \".\[megatron\]\""):
        run_planner("megatron_hybrid_cp", standard_batch("1d-short", seed=0, num_gpus=32), COST)


def test_megatron_hybrid_cp_groups_are_ring_where_ring_is_offered(released):
    """Issue 25: the released package's groups run as Megatron runs them, TransformerEngine's
    P2P ring, the default kind where the cost model offers ring."""
    cost = COST.with_(sp_kinds=("ulysses", "cp", "ring"))
    batch = standard_batch("1d-long", seed=0, num_gpus=32, tokens_per_gpu=16384)
    res = run_planner("megatron_hybrid_cp", batch, cost, max_seqlen_per_rank=8192)
    assert validate(res.plan, batch, cost) == [] and res.stats["kind"] == "ring"
    assert {g.kind for ph in res.plan.phases for g in ph.groups if g.degree > 1} == {"ring"}
