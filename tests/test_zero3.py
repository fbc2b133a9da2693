"""ZeRO-3 per layer (Plan.shard_domain > 0, runtime/sharding.py): FSDP2 gathers each unit per
micro-step and reduce-scatters inside the shard domain every micro-step; the executor pads each
rank's micro-steps to the largest count of its domain with empty micro-steps. One training
step (forward, backward, AdamW) equals single-process training (float64, gloo, world 4, shard
domains of 2 (HSDP: 2 domains) and 4): hand-made plans with unequal micro-step counts, idle
ranks, Ulysses degree 2 groups and a different recompute per micro-batch; planners' plans;
seeded random plans; HF Llama. A hang fails the test through the pool's timeout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.nn.functional as F
from dcp_opt.runtime import LMTask, SPState, execute_step, parallelize
from dcp_opt.runtime.sharding import Sharding, ShardingModeError, shard
from dcp_opt.runtime.testing import DistWorkers
from dcp_opt.solvers import run_planner

from dcp_opt import Batch, Cluster, CostModel, make_plan
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Group, Plan
from dcp_opt.plan import MicroBatch as MB

from .reference import objective
from .test_sharding import (
    BATCH,
    TOL,
    adamw,
    cost_for,
    full_params,
    make_data,
    make_model,
    planner_cost,
    random_plan,
    reference,
)

WORLD = 4


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(WORLD, timeout_s=60.0)
    yield w
    w.close()


def per_layer(plan: Plan, s: int) -> Plan:
    return dataclasses.replace(plan, shard_domain=s)


def ragged_plan(cost: CostModel | None = None) -> Plan:
    """Phase 0: ranks 0-1 a Ulysses degree 2 group of 3 micro-batches recomputing 3, 0 and 2
    layers; rank 2 one micro-batch (recompute 1); rank 3 idle. Phase 1: all four together.
    Phase 2: rank 0 two micro-batches, ranks 1-3 idle. Recompute is capped at the model's
    layer count."""
    cost = cost or cost_for(WORLD, "zero3")
    cap = cost.model.num_layers

    def MicroBatch(ids, r):  # noqa: N802
        return MB(ids, min(r, cap))

    p0 = [
        Group(0, 2, (MicroBatch((0,), 3), MicroBatch((1,), 0), MicroBatch((2, 6), 2))),
        Group(2, 1, (MicroBatch((3,), 1),)),
    ]
    p1 = [Group(0, 4, (MicroBatch((4,), 1),))]
    p2 = [Group(0, 1, (MicroBatch((5,), 0), MicroBatch((7,), 2)))]
    return make_plan([p0, p1, p2], BATCH, cost, planner="ragged")


def job_train(ctx, cases: list, seed: int, step: int):
    """Per (plan JSON, batch dict): one per-layer zero3 step on a fresh TinyLM; the loss,
    the parameters after AdamW and the report's padding."""
    out = []
    for plan_json, batch_dict in cases:
        plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
        model, state, task = make_model(seed), SPState(), LMTask()
        parallelize(model, state)
        sh = shard(model, adamw, mode="zero3", pool=ctx.pool, task=task,
                   shard_domain=plan.shard_domain)  # fmt: skip
        report = execute_step(plan, task, model, make_data(batch, seed), pool=ctx.pool,
                              state=state, step=step, sharding=sh)  # fmt: skip
        out.append((report.loss, full_params(model), report.padding))
    return out


def check(workers, cases: list, seed: int = 3, step: int = 5) -> list:
    """Every (name, plan, batch) equals single-process AdamW to TOL (relative to the update);
    returns each case's padding by rank."""
    results = workers.run(job_train, [(p.to_json(), b.to_dict()) for _, p, b in cases], seed, step)
    paddings = []
    for k, (name, plan, batch) in enumerate(cases):
        want_loss, before, want = reference(plan, batch, seed)
        for rank_out in results:
            loss, got, _ = rank_out[k]
            assert abs(loss - want_loss) <= TOL * abs(want_loss), (name, loss, want_loss)
            for g, w, b in zip(got, want, before, strict=True):
                err = float((g - w).norm()) / max(float((w - b).norm()), 1e-300)
                assert err <= TOL, f"{name}: parameter error {err:.3e} > {TOL}"
        paddings.append([rank_out[k][2] for rank_out in results])
    return paddings


def test_ragged_plan_with_recompute_equals_single_process_adamw(workers):
    """Unequal counts, idle ranks, degree 2 groups and a different recompute walk in every
    micro-step: the executor pads to the domain's largest count, and the step is exact."""
    plan = ragged_plan()
    cases = [(f"ragged s={s}", per_layer(plan, s), BATCH) for s in (2, 4)]
    pad2, pad4 = check(workers, cases)
    # domains {0,1},{2,3}: phase 0 counts 3,3 | 1,0; phase 2 counts 2,0 | 0,0
    assert pad2 == [(0, 0, 0), (0, 0, 2), (0, 0, 0), (1, 0, 0)]
    # one domain of 4: phase 0 counts 3,3,1,0 -> pad to 3; phase 2 counts 2,0,0,0 -> pad to 2
    assert pad4 == [(0, 0, 0), (0, 0, 2), (2, 0, 2), (3, 0, 2)]


def test_planners_and_random_plans_run_per_layer(workers):
    """Greedy's and dcp_inter_pac's plans and seeded random plans (1-3 phases, random
    degrees, idle groups, random recompute per micro-batch), each over domains of 2 and 4."""
    cost, tight = cost_for(WORLD, "zero3"), planner_cost(WORLD, "zero3")
    rng = np.random.default_rng(26)
    made = [(n, run_planner(n, BATCH, tight).plan, BATCH) for n in ("greedy", "dcp_inter_pac")]
    for k in range(3):
        batch = Batch.from_lengths([int(x) for x in rng.integers(1, 12, rng.integers(2, 7))])
        made.append((f"random{k}", random_plan(rng, batch, cost), batch))
    cases = [(f"{n} s={s}", per_layer(p, s), b) for n, p, b in made for s in (2, 4)]
    paddings = check(workers, cases)
    padded = [name for (name, _, _), pad in zip(cases, paddings, strict=True) if any(map(sum, pad))]
    assert len(padded) >= 2, paddings  # plans whose domains needed empty micro-steps


def job_train_hf(ctx, plan_json: str, seed: int, step: int):
    from dcp_opt.runtime.hf import HFCausalLMTask, parallelize_hf, tiny_llama

    from .test_sharding_hf import hf_data

    plan = Plan.from_json(plan_json)
    state, task = SPState(), HFCausalLMTask()
    model = parallelize_hf(tiny_llama(num_kv_heads=2, seed=seed), state)
    sh = shard(model, adamw, mode="zero3", pool=ctx.pool, task=task,
               shard_domain=plan.shard_domain)  # fmt: skip
    execute_step(plan, task, model, hf_data(seed), pool=ctx.pool, state=state, step=step,
                 sharding=sh)  # fmt: skip
    return full_params(model)


def test_hf_llama_per_layer_equals_single_process_adamw(workers):
    from dcp_opt.runtime.hf import model_spec, tiny_llama

    from .test_sharding_hf import hf_data

    ref = tiny_llama(num_kv_heads=2, seed=3)
    cluster = Cluster("cpu", 1, WORLD, 1e15, 1e12, 1e10, 1e10)
    cost = CostModel(model_spec(ref), cluster, None, "zero3")
    plan = per_layer(ragged_plan(cost), 2)
    got = workers.run(job_train_hf, plan.to_json(), 3, 5)
    before = [p.detach().clone() for p in ref.parameters()]
    per_token = []
    for _, x in sorted(hf_data(3).items()):
        logits = ref(input_ids=x[None, :-1], use_cache=False).logits[0]
        per_token.append(F.cross_entropy(logits, x[1:], reduction="none"))
    objective(per_token, plan.normalizer_kind).backward()
    adamw(ref.parameters()).step()
    for rank_out in got:
        for g, w, b in zip(rank_out, ref.parameters(), before, strict=True):
            err = float((g - w.detach()).norm()) / max(float((w.detach() - b).norm()), 1e-300)
            assert err <= TOL, f"HF Llama per layer: parameter error {err:.3e} > {TOL}"


def test_bad_shard_domain_is_refused_before_the_model_changes():
    model = make_model(0)
    kinds = {n: type(p) for n, p in model.named_parameters()}
    with pytest.raises(DcpOptError, match=r"^shard_domain: 2 needs mode 'zero3', got 'zero1'"):
        shard(model, adamw, mode="zero1", pool=None, task=LMTask(), shard_domain=2)
    with pytest.raises(DcpOptError, match=r"^shard_domain: -1; allowed: an integer >= 0"):
        shard(model, adamw, mode="zero3", pool=None, task=LMTask(), shard_domain=-1)
    with pytest.raises(DcpOptError, match=r"^shard_domain: 2 does not divide the world of 1"):
        shard(model, adamw, mode="zero3", pool=None, task=LMTask(), shard_domain=2)
    assert {n: type(p) for n, p in model.named_parameters()} == kinds
    sh = Sharding("zero3", None, None, [], None, None, shard_domain=2)
    with pytest.raises(ShardingModeError, match=r"^shard_domain: the plan has 0 but this run"):
        sh.check_plan(ragged_plan())
