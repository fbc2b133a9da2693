"""The pipeline baselines (solvers/baselines/pipeline*.py) give valid plans at or above the
certified bound; Megatron's lockstep pricing too; `dcp-opt plan --pp` round-trips through
`dcp-opt simulate`."""

import json

import pytest
from dcp_opt.solvers import PIPELINE_BASELINES, run_planner
from dcp_opt.solvers.baselines.pipeline_megatron import megatron_pipeline_step

from dcp_opt import CostModel, Plan, cluster_preset, model_preset, simulate, validate
from dcp_opt.cli import main
from dcp_opt.workloads import standard_batch

COST = CostModel(model_preset("llama-7b"), cluster_preset("h200x32"))
BATCH = standard_batch("1d-wlbllm", 0, num_gpus=32, tokens_per_gpu=8192)


@pytest.mark.parametrize("name", PIPELINE_BASELINES)
def test_each_pipeline_baseline_plans_validly_above_the_bound(name):
    r = run_planner(name, BATCH, COST, pp=4)
    assert validate(r.plan, BATCH, COST) == []
    assert r.plan.planner == name
    assert r.lower_bound_s <= r.predicted_step_time_s
    assert r.predicted_step_time_s == pytest.approx(simulate(r.plan, BATCH, COST).step_time_s)


def test_megatron_under_pp_is_priced_above_the_bound():
    g = run_planner("pp_greedy", BATCH, COST, pp=4)
    mg = megatron_pipeline_step(BATCH, COST, pp=4)
    assert mg["num_micro_steps"] >= 1
    assert mg["step_time_s"] >= g.lower_bound_s


def test_megatron_under_pp_tunes_its_max_seqlen_as_a_user_sweeping_it():
    tuned = megatron_pipeline_step(BATCH, COST, pp=4)
    largest = megatron_pipeline_step(BATCH, COST, pp=4, max_seqlen_per_rank="max")
    assert len(tuned["tried"]) >= 2  # more than one M fits this batch
    assert largest["max_seqlen_per_rank"] == max(tuned["tried"])
    assert tuned["step_time_s"] == min(tuned["tried"].values()) <= largest["step_time_s"]
    m = min(tuned["tried"])
    fixed = megatron_pipeline_step(BATCH, COST, pp=4, max_seqlen_per_rank=m)
    assert fixed["max_seqlen_per_rank"] == m
    assert fixed["step_time_s"] == pytest.approx(tuned["tried"][m])


def test_megatron_under_pp_refuses_a_setting_that_does_not_fit():
    with pytest.raises(Exception, match="max_seqlen_per_rank=3 does not fit"):
        megatron_pipeline_step(BATCH, COST, pp=4, max_seqlen_per_rank=3)
    with pytest.raises(ValueError, match="'tuned', 'max' or an int"):
        megatron_pipeline_step(BATCH, COST, pp=4, max_seqlen_per_rank="best")


def test_interleaved_baselines_keep_counts_a_multiple_of_p():
    r = run_planner("pp_greedy", BATCH, COST, pp=4, schedule="interleaved", virtual_stages=2)
    assert validate(r.plan, BATCH, COST) == []
    assert all(len(g.micro_batches) % 4 == 0 for g in r.plan.phases[0].groups if g.micro_batches)


def test_cli_plan_pp_then_simulate(tmp_path, capsys):
    out = tmp_path / "plan.json"
    common = ["--workload", "1d-wlbllm", "--cluster", "h200x32", "--model", "llama-7b",
              "--tokens-per-gpu", "8192"]  # fmt: skip
    assert main(["plan", *common, "--pp", "4", "--out", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    doc = json.loads(out.read_text())  # 4: the planner answered micro-steps (plan-format)
    assert doc["schema_version"] == (4 if doc["pipeline"].get("micro_steps") else 3)
    assert plan.pipeline.num_stages == 4 and plan.planner == "pp_greedy"
    capsys.readouterr()
    assert main(["simulate", str(out), *common]) == 0
    assert "step time" in capsys.readouterr().out


def test_cli_pp_refuses_a_planner_without_a_pipeline_form(capsys):
    rc = main(["plan", "--workload", "1d-short", "--cluster", "h200x32", "--model", "llama-7b",
               "--pp", "2", "--planner", "bucket"])  # fmt: skip
    assert rc != 0
    assert "plans no pipeline" in capsys.readouterr().err
