"""Tensor parallelism together with ZeRO-3 per layer (runtime/sharding.py `shard(...,
mode="zero3", shard_domain=s, tp=tp)`): FSDP2 per block over the units' "dp" column of the TP
mesh, s units per shard domain (HSDP across domains). float64, gloo, world 4 = 2 units of TP 2,
s = 1 (two domains of one unit: HSDP + TP) and s = 2 (one domain: FSDP + TP). One step's
gradient (as the optimizer sees it, gathered to full) and one AdamW step equal
single-process training to 1e-9: units running unequal micro-step counts with one idle in a
phase, a Ulysses group of degree 2 across the units, recompute 0-2 per micro-batch; TinyLM
and HF Llama (GQA). The padding is per unit and equal on both GPUs of a unit. What stays
unbuilt is refused before the model changes."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from dcp_opt.runtime import LMTask, SPState, execute_step, parallelize
from dcp_opt.runtime.sharding import shard
from dcp_opt.runtime.tensor_parallel import apply_tensor_parallel
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Plan
from tests.test_tensor_parallel import (
    BATCH,
    TOL,
    full,
    make_data,
    make_model,
    reference,
    rel,
    snapshot,
    tp_groups,
    ulysses_plan,
    uneven_plan,
)


class RecordingAdamW(torch.optim.AdamW):
    """tests/test_tensor_parallel.py's AdamW that keeps the full gradients it steps on (a
    collective over the parameter mesh: every GPU steps together)."""

    def __init__(self, params):
        super().__init__(params, lr=1e-2, weight_decay=0.1, eps=1e-3)
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):
        self.grads = [full(p.grad) for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def per_layer(plan: Plan, s: int) -> Plan:
    return dataclasses.replace(plan, optimizer_sharding="zero3", shard_domain=s)


def job_tinylm(ctx, plan_json: str, seed: int):
    """One TP x per-layer zero3 step of TinyLM: (loss, full gradients, full parameters after,
    padding, this GPU's unit)."""
    plan = Plan.from_json(plan_json)
    tp = tp_groups(plan.tensor_parallel)
    model, state, task = make_model(seed), SPState(), LMTask()
    parallelize(model, state)
    apply_tensor_parallel(model, tp)
    sh = shard(model, RecordingAdamW, mode="zero3", pool=ctx.pool, task=task, tp=tp,
               shard_domain=plan.shard_domain)  # fmt: skip
    report = execute_step(plan, task, model, make_data(BATCH, seed), pool=ctx.pool,
                          state=state, step=0, tp=tp, sharding=sh)  # fmt: skip
    params = [full(p) for p in model.parameters()]
    return report.loss, sh.optimizer.grads, params, report.padding, tp.unit


def check(workers, plan: Plan, seed: int = 3) -> tuple[float, list]:
    """Every GPU's loss, gradient and update against single-process; (worst relative error,
    padding by GPU)."""
    want_loss, want_grads, before, want = reference(plan.normalizer_kind, seed)
    worst, paddings = 0.0, []
    for loss, grads, params, padding, unit in workers.run(job_tinylm, plan.to_json(), seed):
        assert abs(loss - want_loss) <= TOL * abs(want_loss), (loss, want_loss)
        assert len(grads) == len(want_grads)
        for g, w in zip(grads, want_grads, strict=True):
            worst = max(worst, rel(g, w))
        for p, w, b in zip(params, want, before, strict=True):
            worst = max(worst, rel(p - b, w - b))  # relative to the update
        paddings.append((unit, padding))
    assert worst <= TOL, worst
    return worst, paddings


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(4, timeout_s=60.0)
    yield w
    w.close()


# uneven_plan: phase 0 unit 0 runs 5 micro-batches (recompute 0, 1 alternating), unit 1 one
# (recompute 1); phase 1 unit 1 one, unit 0 idle. ulysses_plan: phase 0 both units in one
# degree 2 group (2 micro-batches, recompute 1, 0); phase 1 unit 0 three (recompute 0, 2, 0),
# unit 1 idle. Padding per unit (GPUs 2u, 2u + 1) up to the domain's largest count:
PADDING = {
    ("uneven", 1): [(0, 0), (0, 0)],  # every unit its own domain: nothing to match
    ("uneven", 2): [(0, 1), (4, 0)],  # phase 0: 5 vs 1; phase 1: 0 vs 1
    ("ulysses2", 1): [(0, 0), (0, 0)],
    ("ulysses2", 2): [(0, 0), (0, 3)],  # phase 1: 3 vs 0
}


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("name", ["uneven", "ulysses2"])
def test_tp2_per_layer_zero3_equals_single_process(workers, name, s):
    plan = per_layer({"uneven": uneven_plan, "ulysses2": ulysses_plan}[name](), s)
    worst, paddings = check(workers, plan)
    print(f"tp2 x zero3 per layer s={s} {name}: worst relative error {worst:.3e}")
    want = PADDING[(name, s)]
    assert paddings == [(u, want[u]) for u in (0, 0, 1, 1)], paddings


def test_a_wrong_step_is_caught(workers):
    """The check can fail: the run against the other normaliser's reference."""
    plan = per_layer(uneven_plan(), 2)
    with pytest.raises(AssertionError):
        check(workers, dataclasses.replace(plan, normalizer_kind="tokens"))


def job_hf(ctx, plan_json: str) -> tuple[float, float]:
    """HF Llama (GQA) under TP 2 x per-layer zero3: (loss error, worst gradient / update
    error) against tests/test_tensor_parallel_hf.py's single-process reference."""
    from dcp_opt.runtime.hf import HFCausalLMTask, parallelize_hf

    from tests.test_tensor_parallel_hf import base, reference
    from tests.test_tensor_parallel_hf import make_data as hf_data

    plan, data = Plan.from_json(plan_json), hf_data(BATCH)
    before = [p.detach().clone() for p in base("llama_gqa").parameters()]
    ref = copy.deepcopy(base("llama_gqa"))
    want_loss, want_grads, want = reference(ref, data, plan.normalizer_kind)
    tp, state, model = tp_groups(plan.tensor_parallel), SPState(), copy.deepcopy(base("llama_gqa"))
    parallelize_hf(model, state)
    apply_tensor_parallel(model, tp)
    task = HFCausalLMTask()
    sh = shard(model, RecordingAdamW, mode="zero3", pool=ctx.pool, task=task, tp=tp,
               shard_domain=plan.shard_domain)  # fmt: skip
    report = execute_step(plan, task, model, data, pool=ctx.pool, state=state, step=0, tp=tp,
                          sharding=sh)  # fmt: skip
    got = sh.optimizer.grads
    worst = max(rel(g, w) for g, w in zip(got, want_grads, strict=True))
    for p, w, b in zip(model.parameters(), want, before, strict=True):
        worst = max(worst, rel(full(p) - b, w - b))
    return abs(report.loss - want_loss) / abs(want_loss), worst


@pytest.mark.parametrize("s", [1, 2])
def test_hf_llama_tp2_per_layer_zero3_equals_single_process(workers, s):
    for loss_err, worst in workers.run(job_hf, per_layer(uneven_plan(), s).to_json()):
        assert loss_err <= TOL and worst <= TOL, (loss_err, worst)


def test_what_stays_unbuilt_with_tp_is_refused_unchanged():
    """`none` (a replica per GPU) is not built with TP; a shard domain counts units, so one
    that does not divide the units is refused naming them. The model is untouched."""
    model = make_model(0)
    before = snapshot(model)
    fake = SimpleNamespace(degree=2, mesh=None, num_units=2)  # refused before the mesh
    with pytest.raises(DcpOptError, match=r"^mode: 'none' with tensor parallelism not built"):
        shard(model, RecordingAdamW, mode="none", pool=None, task=LMTask(), tp=fake)
    with pytest.raises(
        DcpOptError, match=r"^shard_domain: 4 does not divide the 2 units of tensor_parallel 2"
    ):
        shard(model, RecordingAdamW, mode="zero3", pool=None, task=LMTask(), tp=fake,
              shard_domain=4)  # fmt: skip
    with pytest.raises(DcpOptError, match=r"^shard_domain: 2 needs mode 'zero3', got 'zero1'"):
        shard(model, RecordingAdamW, mode="zero1", pool=None, task=LMTask(), tp=fake,
              shard_domain=2)  # fmt: skip
    after = snapshot(model)
    assert all(after[k][0] is t and torch.equal(after[k][1], v) for k, (t, v) in before.items())
