"""Checkpoints of a pipeline run, fed by DcpLoader (docs/integration.md, "Checkpoints of a
pipeline run"): on 4 gloo ranks (2 stages x 2 units, TinyLM in float64), DcpLoader plans each
batch with pp_greedy at a fixed layer split and hands every rank its unit's samples; each rank
saves its stage under the whole model's names. A run resumed from the step-2 checkpoint
reaches the uninterrupted run's parameters and sees the same batches, on the same world and
on 2 ranks (2 stages x 1 unit: the loader replans the rest of the epoch); the checkpoint's
manifest lists the whole model; it loads into another layer split (each stage reads its
layers by name) and into the unsplit model on every rank."""

from __future__ import annotations

import json

import pytest
import torch
from dcp_opt.runtime import LMTask, SPState, TinyLM, checkpoint, execute_step, parallelize
from dcp_opt.runtime.data import DcpLoader
from dcp_opt.runtime.launch import cpu_cost_model
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.pipeline import build_stage
from dcp_opt.runtime.testing import DistWorkers, max_relative_error

from .test_pipeline_runtime import CFG

WORLD, SPLIT, OTHER_SPLIT = 4, (2, 2), (1, 3)
LENGTHS = [5, 19, 3, 17, 9, 2, 13, 12, 7, 21, 4, 8]  # 3 batches of 4 an epoch
STOP, SAVE_AT = 5, 2  # crosses into epoch 1
TOL = 1e-12  # plans may differ between runs (pp_greedy's budget is CPU time): sums reorder


def sample(i: int) -> torch.Tensor:
    return (3 * i + (1 + i % 3) * torch.arange(LENGTHS[i] + 1)) % CFG.vocab_size


def build(rank: int, split, init_seed: int, world: int = WORLD):
    torch.manual_seed(init_seed)
    state = SPState()
    model = parallelize(TinyLM(CFG).double(), state, sync_weights=False)
    stage = build_stage(model, split, rank // (world // len(split)))
    opt = torch.optim.AdamW(stage.parameters(), lr=0.05)
    cost = cpu_cost_model(model_spec(CFG), world, fit_tokens=12.0)
    options = {"pp": len(split), "stage_layers": split}
    loader = DcpLoader([sample(i) for i in range(len(LENGTHS))], LENGTHS, cost, batch_size=4,
                       planner="pp_greedy", planner_options=options, seed=5, agree="broadcast")  # fmt: skip
    return model, stage, opt, loader, state


def job_train(ctx, ckdir: str, stop: int, save_at: tuple, resume: bool, init_seed: int):
    """Train to `stop` steps (resuming first if asked): per step the batch's sequence ids and
    the plan's form; this stage's parameters (by model name) at each save and at the end."""
    _, stage, opt, loader, state = build(ctx.rank, SPLIT, init_seed, ctx.world_size)
    step = checkpoint.load(ckdir, model=stage, optimizer=opt, loader=loader) if resume else 0
    log, saved = [], {}
    while step < stop:
        for b in loader:
            assert b.plan.pipeline is not None and b.plan.pipeline.stage_layers == SPLIT
            opt.zero_grad(set_to_none=True)
            execute_step(b.plan, LMTask(), stage, b.samples, pool=ctx.pool, state=state,
                         step=step)  # fmt: skip
            opt.step()
            log.append((b.epoch, b.step, sorted(b.plan.sequence_ids())))
            step += 1
            if step in save_at:
                checkpoint.save(ckdir, model=stage, optimizer=opt, loader=loader, step=step)
                saved[step] = params(stage)
            if step == stop:
                break
        else:
            loader.set_epoch(loader.epoch + 1)
    return log, saved, params(stage)


def params(stage) -> dict:
    return {n: p.detach().clone() for n, p in stage.model_parameter_names().items()}


def job_load_split(ctx, ckdir: str):
    """Load the checkpoint (model and optimizer) into stages of another split."""
    _, stage, opt, loader, _ = build(ctx.rank, OTHER_SPLIT, init_seed=7)
    step = checkpoint.load(ckdir, model=stage, optimizer=opt)
    return step, params(stage), len(opt.state)


def job_load_whole(ctx, ckdir: str):
    """Load the checkpoint's model into the unsplit model on every rank."""
    torch.manual_seed(9)
    model = parallelize(TinyLM(CFG).double(), SPState(), sync_weights=False)
    step = checkpoint.load(ckdir, model=model)
    return step, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(WORLD, timeout_s=120.0)
    yield w
    w.close()


@pytest.fixture(scope="module")
def uninterrupted(workers, tmp_path_factory):
    ckdir = tmp_path_factory.mktemp("pp_ckpt")
    ranks = workers.run(job_train, str(ckdir), STOP, (SAVE_AT,), False, 0)
    return ckdir, ranks


@pytest.mark.dist
def test_a_pipeline_run_resumes_from_its_checkpoint(workers, uninterrupted, tmp_path):
    ckdir, ranks = uninterrupted
    manifest = json.loads((ckdir / f"step-{SAVE_AT:08d}" / "dcp_opt.json").read_text())
    whole = {n for n, _ in TinyLM(CFG).named_parameters()}
    assert set(manifest["model"]) == whole  # every stage's names, gathered
    # a copy: the resumed run saves nothing, but keep the reference folder untouched
    resumed = workers.run(job_train, str(ckdir), STOP, (), True, 3)  # another init: loaded over
    for rank in range(WORLD):
        log, _, final = ranks[rank]
        log_r, _, final_r = resumed[rank]
        assert log_r == log[SAVE_AT:]  # the loader resumed mid-epoch on the same batches
        assert final_r.keys() == final.keys()
        assert max_relative_error(list(final_r.values()), list(final.values())) <= TOL
    # the stages' units agree, and the stages cover the model between them
    stage_names = [set(ranks[r][2]) for r in range(WORLD)]
    assert stage_names[0] == stage_names[1] and stage_names[2] == stage_names[3]
    assert stage_names[0] | stage_names[2] == whole and not stage_names[0] & stage_names[2]


@pytest.mark.dist
def test_a_pipeline_checkpoint_loads_into_another_split_and_the_whole_model(workers, uninterrupted):
    ckdir, ranks = uninterrupted
    at_save = {}
    for r in range(WORLD):
        at_save.update(ranks[r][1][SAVE_AT])
    for rank, (step, got, opt_entries) in enumerate(workers.run(job_load_split, str(ckdir))):
        assert step == SAVE_AT and got and opt_entries == len(got)  # AdamW state per param
        assert all(torch.equal(got[n], at_save[n]) for n in got), rank
    for step, got in workers.run(job_load_whole, str(ckdir)):
        assert step == SAVE_AT and got.keys() == at_save.keys()
        assert all(torch.equal(got[n], at_save[n]) for n in got)


@pytest.mark.dist
def test_a_pipeline_run_resumes_on_another_world(uninterrupted):
    """Saved on 4 ranks (2 units a stage), resumed on 2 (1 unit a stage)."""
    ckdir, ranks = uninterrupted
    log, _, final = ranks[0]
    whole = {}
    for r in range(WORLD):
        whole.update(ranks[r][2])
    w2 = DistWorkers(2, timeout_s=120.0)
    try:
        resumed = w2.run(job_train, str(ckdir), STOP, (), True, 3)
    finally:
        w2.close()
    for log_r, _, final_r in resumed:
        assert log_r == log[SAVE_AT:]  # the same batches, replanned for 2 ranks
        assert max_relative_error([final_r[n] for n in final_r], [whole[n] for n in final_r]) <= TOL
