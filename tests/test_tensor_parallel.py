"""Tensor parallelism (runtime/tensor_parallel.py) under plans, TinyLM: one step's gradient and
one AdamW step equal single-process training to 1e-9 (float64, gloo, world 4 = 2 units of TP
2): a Ulysses group of degree 2 across the units with packed micro-batches of mixed lengths,
units running unequal micro-batch counts with one idle in a phase, recompute on and off.
Refusals name the field and leave the model unchanged."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from dcp_opt.runtime import LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.groups import TPGroups
from dcp_opt.runtime.sharding import shard
from dcp_opt.runtime.tensor_parallel import (
    TensorParallelError,
    apply_tensor_parallel,
    check_plan_heads,
    tp_plan,
)
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch, Cluster, CostModel, ModelSpec, make_plan
from dcp_opt.plan import Group, MicroBatch, Plan

from .reference import lm_objective

TOL = 1e-9
CFG = LMConfig(vocab_size=32, hidden=16, num_heads=4, num_layers=2, ffn_hidden=24)
SPEC = ModelSpec("tiny-lm", "1d", 2, 16, 4, 24, vocab_size=32, dtype_bytes=8)
BATCH = Batch.from_lengths([5, 11, 2, 8, 7, 3, 9, 4])  # odd totals: padding to t is needed
_TP: dict = {}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)


def unit_plan(phases, *, kind: str = "tokens", t: int = 2) -> Plan:
    """A plan over 2 units, recorded for tensor_parallel t."""
    cost = CostModel(SPEC, Cluster("cpu", 1, 2, 1e15, 1e12, 1e10, 1e10))
    plan = make_plan(phases, BATCH, cost, planner="hand", normalizer_kind=kind)
    return dataclasses.replace(plan, tensor_parallel=t)


def ulysses_plan() -> Plan:
    """Phase 0: both units in one Ulysses group of degree 2 (two packed micro-batches);
    phase 1: unit 0 runs three micro-batches, unit 1 is idle."""
    p0 = [Group(0, 2, (MicroBatch((0, 1, 2), 1), MicroBatch((3,), 0)))]
    three = (MicroBatch((4,), 0), MicroBatch((5, 7), 2), MicroBatch((6,), 0))
    return unit_plan([p0, [Group(0, 1, three)]])


def uneven_plan() -> Plan:
    """Unit 0 runs five micro-batches while unit 1 runs two, then unit 1 alone (unit 0 idle)."""
    five = tuple(MicroBatch((i,), i % 2) for i in (0, 2, 4, 6, 7))
    p0 = [Group(0, 1, five), Group(1, 1, (MicroBatch((3, 5), 1),))]
    p1 = [Group(1, 1, (MicroBatch((1,), 0),))]
    return unit_plan([p0, p1], kind="samples")


def make_model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(CFG).double()


def make_data(batch: Batch, seed: int) -> dict:
    out = {}
    for s in batch.sequences:
        g = torch.Generator().manual_seed(seed * 1000 + s.id)
        out[s.id] = torch.randint(CFG.vocab_size, (s.shape[0] + 1,), generator=g)
    return out


def tp_groups(t: int) -> TPGroups:
    if t not in _TP:  # collective: created once per degree, in the same order on every rank
        _TP[t] = TPGroups.create(t)
    return _TP[t]


def full(x: torch.Tensor) -> torch.Tensor:
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().clone()


def job_step(ctx, plan_json: str, seed: int, mode: str | None = None):
    """One TP step then one AdamW step; (loss, full gradients, full parameters after). With
    `mode` (zero1, zero2) the step runs under shard(..., tp=): FSDP2 over the units; the
    optimizer steps inside it and the gradients come back as None."""
    plan = Plan.from_json(plan_json)
    tp = tp_groups(plan.tensor_parallel)
    model, state, task = make_model(seed), SPState(), LMTask()
    parallelize(model, state)
    apply_tensor_parallel(model, tp)
    qkv = model.layers[0].attn.qkv.weight  # GPU j holds q_j, k_j, v_j: 3 H / t rows
    assert qkv.to_local().shape == (3 * CFG.hidden // tp.degree, CFG.hidden)
    data = make_data(BATCH, seed)
    if mode is not None:
        sh = shard(model, adamw, mode=mode, pool=ctx.pool, task=task, tp=tp)
        report = execute_step(
            plan, task, model, data, pool=ctx.pool, state=state, step=0, tp=tp, sharding=sh
        )
        return report.loss, None, [full(p) for p in model.parameters()]
    report = execute_step(plan, task, model, data, pool=ctx.pool, state=state, step=0, tp=tp)
    # summed over the unit too: no gradient left Partial (the norms' under SequenceParallel)
    bad = [
        (n, p.grad.placements, p.placements)
        for n, p in model.named_parameters()
        if p.grad.placements != p.placements
    ]
    assert not bad, bad
    grads = [full(p.grad) for p in model.parameters()]
    adamw(model.parameters()).step()
    return report.loss, grads, [full(p) for p in model.parameters()]


def reference(kind: str, seed: int):
    model, data = make_model(seed), make_data(BATCH, seed)
    before = [p.detach().clone() for p in model.parameters()]
    loss = lm_objective(model, data, kind)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    adamw(model.parameters()).step()
    return float(loss.detach()), grads, before, [p.detach().clone() for p in model.parameters()]


def rel(got, want) -> float:
    return float((got - want).norm()) / max(float(want.norm()), 1e-300)


def check_step(workers: DistWorkers, plan: Plan, seed: int = 3, *, kind=None, mode=None) -> float:
    want_loss, want_grads, before, want = reference(kind or plan.normalizer_kind, seed)
    worst = 0.0
    for loss, grads, params in workers.run(job_step, plan.to_json(), seed, mode):
        assert abs(loss - want_loss) <= TOL * abs(want_loss), (loss, want_loss)
        for g, w in zip(grads or want_grads, want_grads, strict=True):
            worst = max(worst, rel(g, w))
        for p, w, b in zip(params, want, before, strict=True):
            worst = max(worst, rel(p - b, w - b))  # relative to the update
    assert worst <= TOL, worst
    return worst


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(4, timeout_s=60.0)
    yield w
    w.close()


def test_tp2_ulysses2_step_and_adamw_equal_single_process(workers):
    print("tp2 x ulysses2: worst relative error", check_step(workers, ulysses_plan()))


def test_tp2_unequal_micro_batch_counts_and_an_idle_unit(workers):
    print("tp2 uneven: worst relative error", check_step(workers, uneven_plan()))


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("plan", [ulysses_plan, uneven_plan], ids=["ulysses2", "uneven"])
def test_tp2_with_zero_sharding_over_the_units(workers, plan, mode):
    made = dataclasses.replace(plan(), optimizer_sharding=mode)
    print(f"tp2 {mode} {plan.__name__}: worst", check_step(workers, made, mode=mode))


def test_a_wrong_step_is_caught(workers):
    """The check can fail: the same run against the other normaliser's reference."""
    with pytest.raises(AssertionError):
        check_step(workers, uneven_plan(), kind="tokens")


def job_refused_without_tp(ctx, plan_json: str) -> str:
    model, state = make_model(0), SPState()
    parallelize(model, state)
    try:
        execute_step(Plan.from_json(plan_json), LMTask(), model, make_data(BATCH, 0),
                     pool=ctx.pool, state=state, step=0)  # fmt: skip
    except Exception as e:  # noqa: BLE001 (the message is the result)
        return str(e)
    return "ran"


def test_a_tp_plan_without_tp_groups_is_refused_on_every_rank(workers):
    for msg in workers.run(job_refused_without_tp, uneven_plan().to_json()):
        assert "plan.tensor_parallel: 2 needs tp=TPGroups.create(2)" in msg


# ---- refusals: before anything changes -----------------------------------------------------
FAKE_TP = SimpleNamespace(degree=2, mesh=None)  # refused before the mesh is touched


def snapshot(model):
    return {k: (type(v), v.clone()) for k, v in model.state_dict().items()}


def assert_refused(model, field: str) -> None:
    before = snapshot(model)
    with pytest.raises(TensorParallelError, match=field):
        apply_tensor_parallel(model, FAKE_TP)
    after = snapshot(model)
    assert before.keys() == after.keys()
    for k, (kind, value) in before.items():
        assert after[k][0] is kind and torch.equal(after[k][1], value), k


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (LMConfig(num_heads=1, hidden=16), "cfg.num_heads: 1"),
        (LMConfig(ffn_hidden=9), "cfg.ffn_hidden: 9"),
        (LMConfig(vocab_size=33), "cfg.vocab_size: 33"),
    ],
)
def test_tinylm_widths_that_t_does_not_divide_are_refused(cfg, field):
    torch.manual_seed(0)
    assert_refused(TinyLM(cfg).double(), field)


def test_a_parameter_outside_the_split_layers_is_refused():
    model = make_model(0)
    model.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    assert_refused(model, "model.scale")


def test_a_model_tp_cannot_split_is_refused():
    from dcp_opt.runtime import DiTConfig, TinyDiT

    assert_refused(TinyDiT(DiTConfig()), "model: 'TinyDiT'")
    with pytest.raises(TensorParallelError, match="tensor_parallel: 0"):
        tp_plan(make_model(0), 0)


def test_ulysses_degrees_whose_t_d_does_not_divide_the_heads_are_refused():
    model = make_model(0)  # 4 heads
    p0 = [Group(0, 2, (MicroBatch((0, 1, 2, 3, 4, 5, 6, 7), 0),))]
    check_plan_heads(unit_plan([p0], t=2), model)  # 4 % (2 x 2) == 0: runs
    with pytest.raises(TensorParallelError, match="heads 4 do not divide by tensor_parallel 4"):
        check_plan_heads(unit_plan([p0], t=4), model)
    cp = [Group(0, 2, (MicroBatch((0, 1, 2, 3, 4, 5, 6, 7), 0),), kind="cp")]
    with pytest.raises(TensorParallelError, match="kind 'cp' with tensor_parallel 2"):
        check_plan_heads(unit_plan([cp], t=2), model)


@pytest.mark.parametrize("mode", ["none"])
def test_sharding_modes_not_built_with_tp_are_refused_unchanged(mode):
    from dcp_opt.errors import DcpOptError

    model = make_model(0)
    before = snapshot(model)
    with pytest.raises(DcpOptError, match=f"mode: '{mode}' with tensor parallelism not built"):
        shard(model, adamw, mode=mode, pool=None, task=LMTask(), tp=FAKE_TP)
    assert all(torch.equal(before[k][1], v) for k, v in model.state_dict().items())
