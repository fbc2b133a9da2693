"""ZeRO under a pipeline (runtime/sharding.py `shard(stage, ...)`): each stage's parameters,
gradients and optimizer state sharded over the stage's ranks with FSDP2 (step-level: one
all-gather per stage at the start of the step, one reduce-scatter after a per-stage closing
pass, the optimizer on the shards). On 4 gloo ranks in float64 (2 stages x 2 units, TinyLM),
one full training step (forward, backward, AdamW) under zero1 / zero2 / zero3 equals
single-process AdamW on the same batch, for columns of unequal counts with an idle column,
a Ulysses group over both units, and micro-steps that re-form the groups. What is not built
is refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import LMTask, SPState, execute_step, parallelize
from dcp_opt.runtime.pipeline import PipelinePlanError, build_stage
from dcp_opt.runtime.sharding import shard
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Plan

from .reference import lm_objective
from .test_pipeline_runtime import BATCH, cases, make_data, make_model

TOL = 1e-9
LR, WD = 1e-2, 0.1
CASES = ("pp2 x 2 columns, unequal", "pp2 x sp2 ulysses, 1f1b", "pp2 x micro-steps, gpipe")


def adamw(params):
    # eps near the gradients' size: the update then depends on their scale
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=1e-3)


def job_step(ctx, plan_json: str, mode: str, seed: int, step: int):
    """One sharded pipeline step on a fresh model: (loss, this stage's whole parameters by
    model name after the optimizer step)."""
    plan = Plan.from_json(plan_json)
    model, state, task = make_model(seed), SPState(), LMTask()
    parallelize(model, state, sync_weights=False)
    stage = build_stage(model, plan.pipeline.stage_layers, ctx.rank // plan.num_ranks)
    names = {id(p): n for n, p in stage.model_parameter_names().items()}
    order = [names[id(p)] for p in stage.parameters()]  # fully_shard swaps the objects
    sh = shard(stage, adamw, mode=mode, pool=ctx.pool, task=task)
    report = execute_step(plan, task, stage, make_data(BATCH, seed), pool=ctx.pool, state=state,
                          step=step, sharding=sh)  # fmt: skip
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in stage.parameters()]
    return report.loss, {n: p.detach().clone() for n, p in zip(order, whole, strict=True)}


def reference(kind: str, seed: int):
    """Single-process AdamW on the whole batch, each sequence alone (tests/reference.py)."""
    model, data = make_model(seed), make_data(BATCH, seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = lm_objective(model, data, kind)
    loss.backward()
    adamw(model.parameters()).step()
    return (
        float(loss.detach()),
        before,
        {n: p.detach().clone() for n, p in model.named_parameters()},
    )


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(4, timeout_s=60.0)
    yield w
    w.close()


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", CASES)
def test_a_sharded_pipeline_step_is_single_process_adamw(workers, name, mode):
    plan = cases()[name]
    want_loss, before, want = reference(plan.normalizer_kind, seed=3)
    ranks = workers.run(job_step, plan.to_json(), mode, 3, 5)
    covered = set()
    for loss, got in ranks:
        assert abs(loss - want_loss) <= TOL * abs(want_loss), (name, mode, loss, want_loss)
        for n, g in got.items():
            # relative to the update, not to the weights: a far stricter test
            err = float((g - want[n]).norm()) / max(float((want[n] - before[n]).norm()), 1e-300)
            assert err <= TOL, f"{name} under {mode}: {n} error {err:.3e}"
        covered |= set(got)
    assert covered == set(want)  # the stages hold the whole model between them


def test_what_is_not_built_is_refused_before_anything_changes():
    from dcp_opt.runtime.pipeline.checks import check_task

    model = make_model(0)
    parallelize(model, SPState(), sync_weights=False)
    stage = build_stage(model, (2, 2), 0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    for kw in ({"mode": "none"}, {"mode": "zero3", "shard_domain": 2}):
        with pytest.raises(DcpOptError, match="a pipeline stage with mode.*allowed: mode 'zero1'"):
            shard(stage, adamw, pool=None, task=LMTask(), **kw)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(PipelinePlanError, match="sharding: not built for this rank's stage"):
        check_task(LMTask(), object(), stage)


def job_checkpoint(ctx, plan_json: str, ckdir: str):
    """A zero1 stage trained one step and saved; a fresh zero1 stage (another init) loads it:
    (whole parameters by name after the step, after the load; optimizer entries loaded)."""
    from dcp_opt.runtime import checkpoint

    plan = Plan.from_json(plan_json)
    out = []
    for seed, train in ((3, True), (11, False)):
        model, state, task = make_model(seed), SPState(), LMTask()
        parallelize(model, state, sync_weights=False)
        stage = build_stage(model, plan.pipeline.stage_layers, ctx.rank // plan.num_ranks)
        names = {id(p): n for n, p in stage.model_parameter_names().items()}
        order = [names[id(p)] for p in stage.parameters()]
        sh = shard(stage, adamw, mode="zero1", pool=ctx.pool, task=task)
        if train:
            execute_step(plan, task, stage, make_data(BATCH, seed), pool=ctx.pool, state=state,
                         step=0, sharding=sh)  # fmt: skip
            checkpoint.save(ckdir, model=stage, optimizer=sh.optimizer, step=1)
        else:
            assert checkpoint.load(ckdir, model=stage, optimizer=sh.optimizer) == 1
        whole = [p.full_tensor() for p in stage.parameters()]
        out.append({n: p.detach().clone() for n, p in zip(order, whole, strict=True)})
    return out[0], out[1], len(sh.optimizer.state)


@pytest.mark.dist
def test_a_sharded_stage_checkpoints_and_loads(workers, tmp_path):
    plan = cases()["pp2 x sp2 ulysses, 1f1b"]
    for saved, loaded, entries in workers.run(job_checkpoint, plan.to_json(), str(tmp_path)):
        assert saved.keys() == loaded.keys() and entries == len(saved)
        assert all(torch.equal(saved[n], loaded[n]) for n in saved)
