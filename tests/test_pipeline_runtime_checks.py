"""What the pipeline runtime refuses, before any collective, with the field named: models it
cannot split, splits that do not fit the model, plans that do not fit the world, the stage or
the pool, schedules it does not run, bad per-stage recompute, other tasks and sharding. Each
refusal leaves the model unchanged. The stage itself: which layers and which of the model's
parameters each stage holds (pure, no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dcp_opt.runtime import (
    DiffusionTask,
    DiTConfig,
    GroupPool,
    LMTask,
    SPState,
    TinyDiT,
    TinyLM,
    parallelize,
)
from dcp_opt.runtime.pipeline import PipelinePlanError, StageSplitError, build_stage
from dcp_opt.runtime.pipeline.checks import (
    check_groups,
    check_pipeline_plan,
    check_stage_recompute,
    check_task,
)

from dcp_opt.plan import MicroBatch, Pipeline

from .test_pipeline_runtime import BATCH, CFG, cases, make_model, pipeline_plan


def test_stages_hold_consecutive_layers_and_the_ends():
    model = make_model(0)
    stages = [build_stage(model, (1, 2, 1), s) for s in range(3)]
    assert [list(st.layers) for st in stages] == [
        [model.layers[0]], [model.layers[1], model.layers[2]], [model.layers[3]]
    ]  # fmt: skip
    assert stages[0].embed is model.embed and stages[1].embed is None
    assert stages[2].head is model.head and stages[0].head is None
    names = [set(st.model_parameter_names()) for st in stages]
    assert set.union(*names) == {n for n, _ in model.named_parameters()}
    assert not names[0] & names[1] and not names[1] & names[2] and not names[0] & names[2]
    assert "embed.weight" in names[0] and "head.weight" in names[2]
    assert all(n.startswith("layers.1.") or n.startswith("layers.2.") for n in names[1])


def test_unsplittable_models_and_bad_splits_are_refused():
    dit = TinyDiT(DiTConfig())
    with pytest.raises(StageSplitError, match="TinyDiT cannot be split.*allowed: TinyLM"):
        build_stage(dit, (1, 1), 0)
    model = make_model(0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(StageSplitError, match="sum to 3 but TinyLM has 4 layers"):
        build_stage(model, (1, 2), 0)
    with pytest.raises(StageSplitError, match="integers >= 1"):
        build_stage(model, (4, 0), 0)
    with pytest.raises(StageSplitError, match="stage: 2; allowed: 0..1"):
        build_stage(model, (2, 2), 2)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert isinstance(model, TinyLM) and len(model.layers) == CFG.num_layers


def test_plans_that_do_not_fit_the_job_are_refused():
    plan = cases()["pp2 x sp2 ulysses, 1f1b"]  # 2 stages x 2 units, split (1, 3)
    stage = build_stage(make_model(0), (1, 3), 0)
    check_pipeline_plan(plan, 4, 1, stage)  # ranks 0 and 1 hold stage 0
    with pytest.raises(PipelinePlanError, match="model: TinyLM given.*build_stage"):
        check_pipeline_plan(plan, 4, 1, make_model(0))
    with pytest.raises(PipelinePlanError, match="but the world has 8"):
        check_pipeline_plan(plan, 8, 1, stage)
    with pytest.raises(PipelinePlanError, match="built as stage 0 but this rank holds stage 1"):
        check_pipeline_plan(plan, 4, 2, stage)
    other = build_stage(make_model(0), (2, 2), 0)
    with pytest.raises(PipelinePlanError, match="stage_layers: \\[1, 3\\] but the stage"):
        check_pipeline_plan(plan, 4, 0, other)
    tp = dataclasses.replace(plan, tensor_parallel=2)
    with pytest.raises(PipelinePlanError, match="tensor_parallel: 2 with tp of degree 1"):
        check_pipeline_plan(tp, 4, 0, stage)
    inter = dataclasses.replace(plan, pipeline=Pipeline((1, 3), "interleaved", 2))
    with pytest.raises(
        PipelinePlanError,
        match="'interleaved' with virtual_stages 2; allowed: .* with virtual_stages 1",
    ):
        check_pipeline_plan(inter, 4, 0, stage)


def test_bad_stage_recompute_is_refused():
    def with_mb(m: MicroBatch):
        groups = [[(0, 2, "ulysses", [m])]]
        return pipeline_plan(groups, BATCH, num_ranks=2, stage_layers=(1, 3))

    check_stage_recompute(with_mb(MicroBatch((0,), 0, ())))  # none at all
    check_stage_recompute(with_mb(MicroBatch((0,), 4, (1, 3))))
    for bad in [MicroBatch((0,), 2, (2, 0)), MicroBatch((0,), 1, (1,)), MicroBatch((0,), 3, ())]:
        with pytest.raises(PipelinePlanError, match="stage_recompute.*allowed: 2 entries"):
            check_stage_recompute(with_mb(bad))
    with pytest.raises(PipelinePlanError, match="summing to recompute_layers"):
        check_stage_recompute(with_mb(MicroBatch((0,), 3, (1, 1))))


def test_groups_tasks_and_sharding_are_checked():
    plan = cases()["pp2 x sp2 ulysses, 1f1b"]
    full = GroupPool({(0, 2): "g01", (2, 2): "g23"}, 0, 4, (1, 2))
    check_groups(plan, full)
    half = GroupPool({(0, 2): "g01"}, 0, 4, (1, 2))
    with pytest.raises(PipelinePlanError, match="stage 1 needs a process group at rank 2"):
        check_groups(plan, half)
    check_task(LMTask(), None)
    with pytest.raises(PipelinePlanError, match="DiffusionTask cannot run under a pipeline"):
        check_task(DiffusionTask(), None)
    with pytest.raises(PipelinePlanError, match="sharding: not built for this rank's stage"):
        check_task(LMTask(), object())


def test_a_split_model_is_refused_by_checkpoints_before_anything(tmp_path):
    # each rank updates only its stage: a checkpoint of its model copy would hold stale
    # weights for the other stages; refused (no collective, nothing written): pass the stage
    import dcp_opt.runtime.checkpoint as checkpoint

    from dcp_opt.errors import DcpOptError

    model = make_model(0)
    parallelize(model, SPState(), sync_weights=False)
    build_stage(model, (2, 2), 0)
    with pytest.raises(DcpOptError, match="split into pipeline stages.*allowed: this rank's stage"):
        checkpoint.save(tmp_path, model=model, step=1)
    with pytest.raises(DcpOptError, match="split into pipeline stages.*allowed: this rank's stage"):
        checkpoint.load(tmp_path, model=model)
    assert list(tmp_path.iterdir()) == []
