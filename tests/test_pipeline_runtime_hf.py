"""The pipeline runtime on a transformers Llama decoder (grouped-query attention, RoPE from the
model's own rotary embedding): on 4 gloo ranks in float64, PP 2 x SP 2 (Ulysses), PP 2 with two
degree-1 columns of unequal counts and PP 4, with variable micro-batches and per-stage
recompute; the step's gradient equals single-process training through the model's own "sdpa"
attention to 1e-9. Models that cannot be split are refused by name, unchanged."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import SPState, execute_step
from dcp_opt.runtime.hf import HFCausalLMTask, parallelize_hf, tiny_llama
from dcp_opt.runtime.pipeline import StageSplitError, build_stage
from dcp_opt.runtime.testing import DistWorkers, reference_step

from dcp_opt import Batch
from dcp_opt.cost import loss_normalizer
from dcp_opt.plan import Plan

from .test_pipeline_runtime import (
    BATCH,
    WORLD,
    cases,
    check_against_reference,
    count_calls,
    make_data,
)

TOL = 1e-9
SHAPE = {"num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 64}
NAMES = ["pp2 x sp2 ulysses, 1f1b", "pp2 x 2 columns, unequal", "pp4, 1f1b"]


def job_hf(ctx, plan_json: str, batch_dict: dict, seed: int, step: int):
    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    model, state = tiny_llama(**SHAPE, seed=seed), SPState()
    parallelize_hf(model, state, sync_weights=False)
    stage = build_stage(model, plan.pipeline.stage_layers, ctx.rank // plan.num_ranks)
    calls = count_calls(stage)
    report = execute_step(
        plan, HFCausalLMTask(), stage, make_data(batch, seed), pool=ctx.pool, state=state,
        step=step, batch=batch,
    )  # fmt: skip
    grads = {n: p.grad.clone() for n, p in stage.model_parameter_names().items()}
    return report.loss, grads, [(a.phase, a.action) for a in report.actions], calls


def hf_reference(batch: Batch, seed: int, step: int):
    model = tiny_llama(**SHAPE, seed=seed)
    items = sorted(make_data(batch, seed).items())
    norm = loss_normalizer(batch, "tokens")
    loss = reference_step(HFCausalLMTask(), model, items, step=step, kind="tokens", normalizer=norm)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(WORLD, timeout_s=60.0)
    yield w
    w.close()


@pytest.mark.parametrize("name", NAMES)
def test_hf_llama_pipeline_equals_single_process(workers, name):
    plan = cases()[name]
    results = workers.run(job_hf, plan.to_json(), BATCH.to_dict(), 3, 5)
    assert check_against_reference(results, plan, *hf_reference(BATCH, 3, 5)) <= TOL


def test_unsplittable_models_are_refused_unchanged():
    tied = tiny_llama(**SHAPE)
    tied.config.tie_word_embeddings = True
    with pytest.raises(StageSplitError, match="tie_word_embeddings"):
        build_stage(tied, (2, 2), 0)
    plain = tiny_llama(**SHAPE)  # not parallelized: still on "sdpa"
    before = {n: p.clone() for n, p in plain.named_parameters()}
    with pytest.raises(StageSplitError, match="parallelize_hf"):
        build_stage(plain, (2, 2), 0)
    assert plain.config._attn_implementation == "sdpa"
    assert all(torch.equal(p, before[n]) for n, p in plain.named_parameters())
    plain.config.model_type = "gpt_neox"
    with pytest.raises(StageSplitError, match="'gpt_neox'.*allowed: \\['llama'\\]"):
        build_stage(plain, (2, 2), 0)
