"""Pipeline parallelism composed with tensor parallelism (issue 30's acceptance: `dcp-opt plan
--pp 4` for a 70B model on h100x64 plans a real-document batch, `simulate` reads the plan).
Tensor parallelism is the cost model's (cost/units.py): a stage's ranks are units of t GPUs."""

import json

import numpy as np
import pytest
from dcp_opt.solvers import run_planner

from dcp_opt import CostModel, Plan, cluster_preset, model_preset, simulate, validate
from dcp_opt.cli import main
from dcp_opt.errors import DcpOptError
from dcp_opt.pipeline.stages import column_times, stage_layout
from dcp_opt.plan import Pipeline
from dcp_opt.workloads import standard_batch

L70 = model_preset("llama3-70b")
H100 = cluster_preset("h100x64")


def _lengths_file(tmp_path) -> str:
    """The WLB-LLM document sample (dcp_opt/data), 16K tokens per GPU of h100x64."""
    b = standard_batch("1d-wlbllm", 0, num_gpus=64, tokens_per_gpu=16384)
    path = tmp_path / "wlb.txt"
    path.write_text("\n".join(str(s.num_tokens) for s in b.sequences) + "\n")
    return str(path)


def test_cli_plan_70b_pp4_tp8_on_h100x64_then_simulate(tmp_path, capsys):
    lengths, out = _lengths_file(tmp_path), tmp_path / "plan.json"
    args = ["--lengths", lengths, "--model", "llama3-70b", "--cluster", "h100x64"]
    assert main(["plan", *args, "--pp", "4", "--tp", "8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["tensor_parallel"] == 8
    assert doc["schema_version"] == (4 if doc["pipeline"].get("micro_steps") else 3)
    plan = Plan.from_json(out.read_text())
    # 64 GPUs = 4 stages x 2 units x 8 GPUs: the plan's ranks are one stage's 2 units
    assert plan.pipeline.num_stages == 4 and plan.num_ranks == 2
    capsys.readouterr()
    assert main(["simulate", str(out), "--lengths", lengths]) == 0
    text = capsys.readouterr().out
    assert "4 stages" in text and "tensor_parallel 8" in text and "step time" in text


def test_cli_plan_70b_pp4_without_tp_says_what_fits(tmp_path, capsys):
    # 70B / 4 stages = 17.6e9 parameters x 6 B of weights and gradients per GPU > 80 GB
    rc = main(["plan", "--lengths", _lengths_file(tmp_path), "--model", "llama3-70b",
               "--cluster", "h100x64", "--pp", "4"])  # fmt: skip
    assert rc != 0
    assert "tensor parallelism" in capsys.readouterr().err


def test_tp_plan_is_valid_and_simulates_as_predicted():
    batch = standard_batch("1d-wlbllm", 1, num_gpus=64, tokens_per_gpu=16384)
    cost = CostModel(L70, H100, tensor_parallel=4)
    r = run_planner("pp_greedy", batch, cost, pp=4)
    assert r.plan.tensor_parallel == 4 and r.plan.num_ranks == 4  # 64 / (4 x 4)
    assert validate(r.plan, batch, cost) == []
    assert r.predicted_step_time_s == pytest.approx(simulate(r.plan, batch, cost).step_time_s)
    assert r.lower_bound_s <= r.predicted_step_time_s
    # the planner's tensor_parallel keyword on a cost model without TP: a plan of that TP
    r2 = run_planner("pp_greedy", batch, CostModel(L70, H100), pp=4, tensor_parallel=4)
    assert r2.plan.tensor_parallel == 4 and validate(r2.plan, batch, cost) == []


def test_tp_divides_a_stage_s_compute_and_adds_its_collectives():
    # one 32K-token micro-batch on one unit: compute / t (units.unit_coefficients), plus
    # the TP collectives of every layer (units.tp_comm_per_layer) >= 0
    pipe = Pipeline((20, 20, 20, 20), "1f1b", 1)
    one, eight = (stage_layout(CostModel(L70, H100, tensor_parallel=t), pipe) for t in (1, 8))
    assert (one.num_units, eight.num_units) == (16, 2)
    assert eight.gpu(3, 1) == 7  # unit s n + u of the cluster of units: GPUs 56..63
    feats = one.cost.batch_features(standard_batch("1d-long", 0, num_gpus=1, tokens_per_gpu=32768))
    rec = np.zeros((1, 4), dtype=int)
    f1, _, _ = column_times(one, feats[:1], 1, 0, "ulysses", rec)
    f8, _, _ = column_times(eight, feats[:1], 1, 0, "ulysses", rec)
    assert np.all(f8 < f1 / 4) and np.all(f8 > f1 / 8)


def test_a_plan_priced_on_another_tp_is_refused():
    with pytest.raises(
        DcpOptError, match="tensor_parallel: 8 on a cost model of tensor_parallel 1"
    ):
        stage_layout(CostModel(L70, H100), Pipeline((20, 20, 20, 20), "1f1b", 1), 8)


def test_per_layer_zero3_under_a_pipeline_is_refused_by_name(tmp_path, capsys):
    # its gathers are not priced per stage: the plan would understate its step
    rc = main(["plan", "--lengths", _lengths_file(tmp_path), "--model", "llama3-70b",
               "--cluster", "h100x64", "--pp", "4", "--tp", "8", "--optimizer-sharding",
               "zero3", "--shard-domain", "2"])  # fmt: skip
    assert rc != 0
    assert "shard_domain: 2 (zero3 per layer) is not priced under a pipeline" in (
        capsys.readouterr().err
    )
