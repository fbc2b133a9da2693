"""A Hugging Face model (LlamaForCausalLM, grouped-query attention) under the sharding modes:
one full training step equals single-process AdamW on the same global batch (float64, gloo,
worlds 2 and 4; tests/test_sharding.py has the plans and the reference's definition)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dcp_opt.runtime import SPState, execute_step
from dcp_opt.runtime.sharding import shard
from dcp_opt.runtime.testing import DistWorkers
from dcp_opt.solvers import run_planner

from dcp_opt import Cluster, CostModel
from dcp_opt.plan import Plan

from .reference import objective
from .test_sharding import BATCH, TOL, adamw, full_params


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def workers(request):
    w = DistWorkers(request.param, timeout_s=60.0)
    yield w
    w.close()


def job_train_hf(ctx, cases: list, seed: int, step: int):
    from dcp_opt.runtime.hf import HFCausalLMTask, parallelize_hf, tiny_llama

    out = []
    for plan_json, mode in cases:
        state, task = SPState(), HFCausalLMTask()
        model = parallelize_hf(tiny_llama(num_kv_heads=2, seed=seed), state)
        sh = shard(model, adamw, mode=mode, pool=ctx.pool, task=task)
        execute_step(Plan.from_json(plan_json), task, model, hf_data(seed), pool=ctx.pool,
                     state=state, step=step, sharding=sh)  # fmt: skip
        out.append(full_params(model))
    return out


def hf_data(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {s.id: torch.randint(128, (s.shape[0] + 1,), generator=g) for s in BATCH.sequences}


def test_hf_llama_training_step_equals_single_process_adamw(workers):
    from dcp_opt.runtime.hf import model_spec, tiny_llama

    ref = tiny_llama(num_kv_heads=2, seed=3)
    spec = model_spec(ref)
    modes = ("none", "zero3")
    plans = {}
    for m in modes:
        cost = CostModel(spec, Cluster("cpu", 1, workers.world_size, 1e15, 1e12, 1e10, 1e10),
                         None, m)  # fmt: skip
        plans[m] = run_planner("greedy", BATCH, cost).plan
    got = workers.run(job_train_hf, [(plans[m].to_json(), m) for m in modes], 3, 5)
    before = [p.detach().clone() for p in ref.parameters()]
    per_token = []
    for _, x in sorted(hf_data(3).items()):
        logits = ref(input_ids=x[None, :-1], use_cache=False).logits[0]
        per_token.append(F.cross_entropy(logits, x[1:], reduction="none"))
    objective(per_token, plans["none"].normalizer_kind).backward()
    adamw(ref.parameters()).step()
    for k, mode in enumerate(modes):
        for rank_out in got:
            for g, w, b in zip(rank_out[k], ref.parameters(), before, strict=True):
                err = float((g - w.detach()).norm()) / max(float((w.detach() - b).norm()), 1e-300)
                assert err <= TOL, f"HF Llama under {mode}: parameter error {err:.3e} > {TOL}"
