"""Pipeline x tensor parallelism in the runtime (runtime/pipeline with runtime.groups.
PipelineTPGroups): on 4 gloo ranks in float64, 2 stages x 1 unit x TP 2, TinyLM and a
transformers Llama (GQA) split by apply_tensor_parallel, then into stages: columns under 1F1B
with variable micro-batches and per-stage recompute, and a micro-step plan under GPipe. The
step's loss and gradients (full tensors) equal single-process training on the same batch to
1e-9; each TP rank sends its token shard to the same TP rank of the next stage; no gradient
is left Partial. A plan and groups that do not match are refused by name before any
collective."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dcp_opt.runtime import LMTask, SPState, execute_step, parallelize
from dcp_opt.runtime.groups import PipelineTPGroups
from dcp_opt.runtime.pipeline import build_stage
from dcp_opt.runtime.pipeline.checks import stage_of
from dcp_opt.runtime.tensor_parallel import apply_tensor_parallel
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt.plan import Plan

from .test_pipeline_runtime import (
    BATCH,
    MBS,
    make_data,
    make_model,
    mb,
    pipeline_plan,
    reference,
)

TOL = 1e-9
WORLD = 4
_GROUPS: dict = {}


def with_tp(plan: Plan, t: int = 2) -> Plan:
    return dataclasses.replace(plan, tensor_parallel=t)


def cases() -> dict[str, Plan]:
    columns = [[(0, 1, "ulysses", MBS)]]
    steps = [[(0, 1, "ulysses", [m])] for m in (mb([2], (0, 1)), mb([0, 1, 7], (1, 0)),
                                                mb([3, 4, 5, 6], (1, 2)))]  # fmt: skip
    return {
        "pp2 x tp2 columns, 1f1b": with_tp(pipeline_plan(columns, BATCH, num_ranks=1,
                                                         stage_layers=(1, 3))),
        "pp2 x tp2 micro-steps, gpipe": with_tp(pipeline_plan(
            steps, BATCH, num_ranks=1, stage_layers=(2, 2), schedule="gpipe", micro_steps=True)),
    }  # fmt: skip


def groups(t: int, stages: int) -> PipelineTPGroups:
    if (t, stages) not in _GROUPS:  # collective: once per worker, in the same order
        _GROUPS[(t, stages)] = PipelineTPGroups.create(t, stages)
    return _GROUPS[(t, stages)]


def full(x: torch.Tensor) -> torch.Tensor:
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().clone()


def job(ctx, plan_json: str, seed: int, step: int):
    """(loss, this stage's full gradients by model name, gradients left off their parameter's
    placement, this GPU's stage and TP rank)."""
    plan = Plan.from_json(plan_json)
    tp = groups(plan.tensor_parallel, plan.pipeline.num_stages)
    model, state = make_model(seed), SPState()
    parallelize(model, state, sync_weights=False)
    apply_tensor_parallel(model, tp)
    qkv = model.layers[0].attn.qkv.weight  # GPU j holds q_j, k_j, v_j: 3 H / t rows
    assert qkv.to_local().shape[0] == qkv.shape[0] // plan.tensor_parallel
    stage = build_stage(model, plan.pipeline.stage_layers, stage_of(plan, ctx.rank))
    return run_stage(ctx, plan, LMTask(), stage, make_data(BATCH, seed), state, step, tp)


def run_stage(ctx, plan, task, stage, data, state, step: int, tp):
    """One step of this rank's stage: (loss, its full gradients by model name, gradients
    left off their parameter's placement, (stage, TP rank))."""
    report = execute_step(plan, task, stage, data, pool=ctx.pool, state=state, step=step,
                          batch=BATCH, tp=tp)  # fmt: skip
    names = stage.model_parameter_names()
    off = [n for n, p in names.items() if p.grad.placements != p.placements]
    return report.loss, {n: full(p.grad) for n, p in names.items()}, off, (tp.stage, tp.tp_rank)


def worst_error(results, want_loss: float, want: dict) -> float:
    """The worst relative error of the loss and of every gradient over the ranks, after
    checking no gradient is left off its parameter's placement and every parameter is on
    some stage."""
    worst = 0.0
    for loss, grads, off, _ in results:
        assert off == []
        worst = max(worst, abs(loss - want_loss) / abs(want_loss))
        for n, g in grads.items():
            worst = max(worst, float((g - want[n]).norm()) / (float(want[n].norm()) or 1.0))
    assert {n for r in results for n in r[1]} == set(want)
    return worst


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(WORLD, timeout_s=60.0)
    yield w
    w.close()


@pytest.mark.parametrize("name", list(cases()))
def test_pipeline_with_tensor_parallelism_equals_single_process(workers, name):
    plan = cases()[name]
    results = workers.run(job, plan.to_json(), 3, 5)
    want_loss, want = reference(BATCH, 3, 5)
    assert [r[3] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # the rank map
    worst = worst_error(results, want_loss, want)
    print(f"{name}: worst relative error {worst:.1e}")
    assert worst <= TOL


def test_a_wrong_gradient_is_caught_under_tp(workers):
    plan = cases()["pp2 x tp2 columns, 1f1b"]
    results = workers.run(job, plan.to_json(), 4, 5)  # other weights than the reference's
    assert worst_error(results, *reference(BATCH, 3, 5)) > 1e-3


def job_hf(ctx, plan_json: str, seed: int, step: int):
    """The HF Llama's step, as `job`."""
    from dcp_opt.runtime.hf import HFCausalLMTask, parallelize_hf, tiny_llama

    from .test_pipeline_runtime_hf import SHAPE
    from .test_pipeline_runtime_hf import make_data as hf_data

    plan = Plan.from_json(plan_json)
    tp = groups(plan.tensor_parallel, plan.pipeline.num_stages)
    model, state = tiny_llama(**SHAPE, seed=seed), SPState()
    parallelize_hf(model, state, sync_weights=False)
    apply_tensor_parallel(model, tp)
    stage = build_stage(model, plan.pipeline.stage_layers, stage_of(plan, ctx.rank))
    return run_stage(ctx, plan, HFCausalLMTask(), stage, hf_data(BATCH, seed), state, step, tp)


def test_hf_llama_pipeline_with_tensor_parallelism_equals_single_process(workers):
    from .test_pipeline_runtime_hf import hf_reference

    plan = cases()["pp2 x tp2 columns, 1f1b"]
    results = workers.run(job_hf, plan.to_json(), 3, 5)
    worst = worst_error(results, *hf_reference(BATCH, 3, 5))
    print(f"hf llama pp2 x tp2: worst relative error {worst:.1e}")
    assert worst <= TOL


def job_refused(ctx, plan_json: str):
    """A TP pipeline plan run without tp, and a TP-free one with tp: both refused."""
    plan = Plan.from_json(plan_json)
    tp = groups(2, 2)
    model, state = make_model(0), SPState()
    parallelize(model, state, sync_weights=False)
    stage = build_stage(model, plan.pipeline.stage_layers, stage_of(plan, ctx.rank))
    out = []
    for p, g in ((plan, None), (dataclasses.replace(plan, tensor_parallel=1), tp)):
        try:
            execute_step(p, LMTask(), stage, make_data(BATCH, 0), pool=ctx.pool, state=state,
                         step=0, batch=BATCH, tp=g)  # fmt: skip
            out.append("ran")
        except ValueError as e:
            out.append(str(e))
    return out


def test_a_mismatched_plan_and_groups_are_refused_before_any_collective(workers):
    plan = cases()["pp2 x tp2 columns, 1f1b"]
    for got in workers.run(job_refused, plan.to_json()):
        assert "plan.tensor_parallel: 2 with tp of degree 1" in got[0]
        assert "plan.tensor_parallel: 1 with tp of degree 2" in got[1]


@pytest.mark.slow
def test_pp2_x_sp2_x_tp2_on_eight_ranks_equals_single_process():
    # all three at once: 2 stages x 2 units x TP 2; a Ulysses group of both units (columns,
    # 1F1B), and micro-steps that re-form the groups (one unit idle in one of them)
    columns = with_tp(pipeline_plan([[(0, 2, "ulysses", MBS)]], BATCH, num_ranks=2,
                                    stage_layers=(1, 3)))  # fmt: skip
    steps = with_tp(pipeline_plan([
        [(0, 2, "ulysses", [mb([2], (1, 2))])],
        [(0, 1, "ulysses", [mb([0, 1], (0, 1))]), (1, 1, "ulysses", [mb([3, 4, 5], (1, 0))])],
        [(0, 1, "ulysses", []), (1, 1, "ulysses", [mb([6], (0, 3))])],
        [(0, 2, "ulysses", [mb([7], (1, 1))])],
    ], BATCH, num_ranks=2, stage_layers=(1, 3), micro_steps=True))  # fmt: skip
    want_loss, want = reference(BATCH, 3, 5)
    w = DistWorkers(8, timeout_s=120.0)
    try:
        for plan in (columns, steps):
            results = w.run(job, plan.to_json(), 3, 5)
            assert [r[3] for r in results] == [(s, j) for s in (0, 1) for _ in (0, 1)
                                               for j in (0, 1)]  # fmt: skip
            worst = worst_error(results, want_loss, want)
            assert worst <= TOL, (plan.pipeline.micro_steps, worst)
        # and ZeRO over each stage's units of each TP rank (FSDP2 on the ("dp", "tp") mesh)
        sharded_step_is_adamw(w.run(job_sharded, columns.to_json(), "zero1", 3, 5))
    finally:
        w.close()


def job_sharded(ctx, plan_json: str, mode: str, seed: int, step: int):
    """One sharded step of a TP stage: (loss, its whole parameters by model name after
    AdamW)."""
    from dcp_opt.runtime.sharding import shard

    from .test_pipeline_sharding import adamw

    plan = Plan.from_json(plan_json)
    tp = groups(plan.tensor_parallel, plan.pipeline.num_stages)
    model, state = make_model(seed), SPState()
    parallelize(model, state, sync_weights=False)
    apply_tensor_parallel(model, tp)
    stage = build_stage(model, plan.pipeline.stage_layers, stage_of(plan, ctx.rank))
    names = {id(p): n for n, p in stage.model_parameter_names().items()}
    order = [names[id(p)] for p in stage.parameters()]  # fully_shard swaps the objects
    sh = shard(stage, adamw, mode=mode, pool=ctx.pool, task=LMTask(), tp=tp)
    report = execute_step(plan, LMTask(), stage, make_data(BATCH, seed), pool=ctx.pool,
                          state=state, step=step, batch=BATCH, tp=tp, sharding=sh)  # fmt: skip
    return report.loss, {n: full(p) for n, p in zip(order, stage.parameters(), strict=True)}


def sharded_step_is_adamw(results) -> None:
    """Every rank's loss and whole parameters equal single-process AdamW on the batch, to
    TOL of the update; the stages cover the model."""
    from .test_pipeline_sharding import reference as adamw_reference

    want_loss, before, want = adamw_reference("tokens", seed=3)
    covered = set()
    for loss, got in results:
        assert abs(loss - want_loss) <= TOL * abs(want_loss), (loss, want_loss)
        for n, g in got.items():
            err = float((g - want[n]).norm()) / max(float((want[n] - before[n]).norm()), 1e-300)
            assert err <= TOL, f"{n}: {err:.3e}"
        covered |= set(got)
    assert covered == set(want)


@pytest.mark.dist
def test_a_sharded_tensor_parallel_stage_step_is_adamw(workers):
    # 2 stages x 1 unit x TP 2: FSDP2 over one unit on the ("dp", "tp") mesh (the 8-rank
    # test above shards over 2 units)
    sharded_step_is_adamw(workers.run(job_sharded, cases()["pp2 x tp2 columns, 1f1b"].to_json(),
                                      "zero3", 3, 5))  # fmt: skip


def job_unsplit(ctx, plan_json: str):
    """A TP plan with tp on a model that apply_tensor_parallel never split: refused before
    any collective, the model's parameters unchanged."""
    plan = Plan.from_json(plan_json)
    tp = groups(2, 2)
    model, state = make_model(0), SPState()
    parallelize(model, state, sync_weights=False)
    stage = build_stage(model, plan.pipeline.stage_layers, stage_of(plan, ctx.rank))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        execute_step(plan, LMTask(), stage, make_data(BATCH, 0), pool=ctx.pool, state=state,
                     step=0, batch=BATCH, tp=tp)  # fmt: skip
        out = "ran"
    except ValueError as e:
        out = str(e)
    same = all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    return out, same


def test_a_model_not_split_for_the_plans_tensor_parallelism_is_refused(workers):
    plan = cases()["pp2 x tp2 columns, 1f1b"]
    for msg, same in workers.run(job_unsplit, plan.to_json()):
        assert "model: its parameters are not split by tensor parallelism of degree 2" in msg
        assert same


def job_checkpoint(ctx, plan_json: str, ckdir: str):
    """A TP stage trained one step and saved (its DTensor shards under the model's names); a
    fresh TP stage of another init loads it; the unsplit model (no TP) loads it on every rank.
    (this stage's full parameters by name after the step, after the load; the whole model's
    after its load)."""
    from dcp_opt.runtime import checkpoint

    plan = Plan.from_json(plan_json)
    tp = groups(plan.tensor_parallel, plan.pipeline.num_stages)
    got = []
    for seed, train in ((3, True), (11, False)):
        model, state = make_model(seed), SPState()
        parallelize(model, state, sync_weights=False)
        apply_tensor_parallel(model, tp)
        stage = build_stage(model, plan.pipeline.stage_layers, stage_of(plan, ctx.rank))
        opt = torch.optim.AdamW(stage.parameters(), lr=0.05)
        if train:
            execute_step(plan, LMTask(), stage, make_data(BATCH, seed), pool=ctx.pool,
                         state=state, step=0, tp=tp)  # fmt: skip
            opt.step()
            checkpoint.save(ckdir, model=stage, optimizer=opt, step=1)
        else:
            assert checkpoint.load(ckdir, model=stage, optimizer=opt) == 1
        got.append({n: full(p) for n, p in stage.model_parameter_names().items()})
    whole = make_model(13)
    parallelize(whole, SPState(), sync_weights=False)
    assert checkpoint.load(ckdir, model=whole) == 1
    return got[0], got[1], {n: full(p) for n, p in whole.named_parameters()}


@pytest.mark.dist
def test_a_tensor_parallel_stage_checkpoints_and_loads_anywhere(workers, tmp_path):
    plan = cases()["pp2 x tp2 columns, 1f1b"]
    results = workers.run(job_checkpoint, plan.to_json(), str(tmp_path))
    saved = {}
    for trained, loaded, _ in results:
        assert trained.keys() == loaded.keys()
        assert all(torch.equal(trained[n], loaded[n]) for n in trained)
        saved.update(trained)
    for _, _, whole in results:  # every stage's TP shards, read back whole without TP
        assert whole.keys() == saved.keys()
        assert all(torch.equal(whole[n], saved[n]) for n in whole)
