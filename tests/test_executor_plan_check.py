"""execute_step refuses an invalid plan on every rank before any collective (issue 29).

World 2, gloo, TinyLM in float64, the batch of lengths 6, 4, 9, 5. Before the check these
hand-made plans trained without a word (measured with the code before this test: the valid
plan's loss is 3.669; a sequence twice gave 4.678, a sequence missing 2.983, overlapping
groups, two of four sequences never trained, 1.579, loss_normalizer 1.0 gave 88.06). Now
each fails on both ranks with InvalidPlanError naming its violation, with no collective
issued (every torch.distributed collective is counted) and no gradient written; so does a
recompute_layers beyond the model's layers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.distributed as dist
from dcp_opt.runtime import LMTask, SPState, execute_step, parallelize, plan_check
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch, InvalidPlanError, make_plan, validate
from dcp_opt.plan import Group, MicroBatch, Phase, Plan
from tests.test_runtime_equiv import cost_for, make_data, make_model

BATCH = Batch.from_lengths([6, 4, 9, 5])
COLLECTIVES = (
    "all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "reduce_scatter",
    "reduce_scatter_tensor", "send", "recv", "isend", "irecv",
)  # fmt: skip


def mbs(*ids: int) -> tuple[MicroBatch, ...]:
    return tuple(MicroBatch((s,), 0) for s in ids)


def valid(kind: str = "tokens") -> Plan:
    """Rank 0 trains sequences 0 and 1, rank 1 trains 2 and 3."""
    groups = [Group(0, 1, mbs(0, 1)), Group(1, 1, mbs(2, 3))]
    return make_plan([groups], BATCH, cost_for("1d", 2), planner="hand", normalizer_kind=kind)


def with_groups(plan: Plan, *groups: Group) -> Plan:
    return replace(plan, phases=(Phase(tuple(groups)),))


def bad_plans(kind: str = "tokens") -> dict[str, Plan]:
    ok = valid(kind)
    return {
        "duplicate": with_groups(ok, Group(0, 1, mbs(0, 1)), Group(1, 1, mbs(2, 3, 0))),
        "missing": with_groups(ok, Group(0, 1, mbs(0, 1)), Group(1, 1, mbs(2))),
        # rank 1 is in both: it runs the first group it finds, so 2 and 3 never train
        "overlap": with_groups(ok, Group(0, 2, mbs(0, 1)), Group(1, 1, mbs(2, 3))),
        "normalizer": replace(ok, loss_normalizer=1.0),
        # TinyLM has 3 layers (its `layers`): 4 is what no cost model for it can mean
        "recompute": with_groups(
            ok, Group(0, 1, mbs(0, 1)), Group(1, 1, (MicroBatch((2,), 0), MicroBatch((3,), 4)))
        ),
    }


CODES = {
    "duplicate": "DUPLICATE_SEQUENCE",
    "missing": "MISSING_SEQUENCE",
    "overlap": "RANK_OVERLAP",
    "normalizer": "BAD_NORMALIZER",
    "recompute": "BAD_RECOMPUTE",
}


def job_step(ctx, plan_json: str, with_batch: bool):
    """One step on this rank: ('ok', loss) or ('refused', type, message); with the number of
    collectives issued and whether any gradient was written."""
    model, state = make_model("1d", 3), SPState()
    parallelize(model, state)
    calls, real = [], {n: getattr(dist, n) for n in COLLECTIVES}

    def counting(name):
        def call(*a, **k):
            calls.append(name)
            return real[name](*a, **k)

        return call

    for n in COLLECTIVES:
        setattr(dist, n, counting(n))
    try:
        kw = {"batch": BATCH} if with_batch else {}
        data = make_data("1d", BATCH, 3)
        plan = Plan.from_json(plan_json)
        report = execute_step(plan, LMTask(), model, data, pool=ctx.pool, state=state, step=0, **kw)
        outcome = ("ok", report.loss)
    except InvalidPlanError as e:
        outcome = ("refused", [v.code for v in e.violations], str(e))
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return outcome, calls, any(p.grad is not None for p in model.parameters())


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(2, timeout_s=20.0)
    yield w
    w.close()


def test_the_hand_made_plans_are_what_validate_rejects():
    cost = cost_for("1d", 2)
    assert validate(valid(), BATCH, cost) == []
    for name, plan in bad_plans().items():
        assert CODES[name] in [v.code for v in validate(plan, BATCH, cost)], name


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CODES))
def test_an_invalid_plan_fails_every_rank_before_any_collective(workers, name):
    plan = bad_plans()[name]
    ranks = workers.run(job_step, plan.to_json(), True)
    for outcome, calls, grads in ranks:
        assert outcome[0] == "refused", outcome
        assert CODES[name] in outcome[1] and CODES[name] in outcome[2]
        assert calls == [] and not grads
    assert ranks[0][0] == ranks[1][0]  # one message on both ranks


@pytest.mark.dist
def test_without_the_batch_the_plan_alone_still_refuses_what_it_can(workers):
    # Duplicates, overlaps and a normaliser below one token per sequence need no batch; a
    # missing sequence shows in a "samples" normaliser (4 samples, 3 trained).
    cases = {**bad_plans(), "missing": bad_plans("samples")["missing"]}
    want = {**CODES, "missing": "BAD_NORMALIZER"}
    for name, plan in cases.items():
        for outcome, calls, grads in workers.run(job_step, plan.to_json(), False):
            assert outcome[0] == "refused" and want[name] in outcome[1], (name, outcome)
            assert calls == [] and not grads


@pytest.mark.dist
def test_a_valid_plan_runs_with_and_without_the_batch(workers):
    for kind in ("tokens", "samples"):
        for with_batch in (True, False):
            ranks = workers.run(job_step, valid(kind).to_json(), with_batch)
            for outcome, calls, grads in ranks:
                assert outcome[0] == "ok" and grads
                assert calls[0] == "all_gather"  # the plan-hash check comes first
            assert ranks[0][0][1] == ranks[1][0][1]


# ---- one process: the verdict's cache and the bounds -------------------------------------------
def test_the_verdict_is_computed_once_per_plan(monkeypatch):
    seen = []
    real = plan_check.plan_violations
    monkeypatch.setattr(
        plan_check, "plan_violations", lambda *a, **k: seen.append(a[0]) or real(*a, **k)
    )
    monkeypatch.setattr(plan_check, "_verdicts", type(plan_check._verdicts)())
    good, bad = valid(), bad_plans()["duplicate"]
    for _ in range(3):
        plan_check.check_plan_once(good, 2, batch=BATCH, num_layers=3)
        with pytest.raises(InvalidPlanError, match="DUPLICATE_SEQUENCE: ids \\[0\\]"):
            plan_check.check_plan_once(bad, 2, batch=BATCH, num_layers=3)
    assert seen == [good, bad]
    plan_check.check_plan_once(good, 2, num_layers=3)  # another key: checked again
    assert len(seen) == 3


@pytest.mark.parametrize(
    ("groups", "code", "text"),
    [
        ((Group(0, 1, mbs(0, 1)), Group(1, 2, mbs(2, 3))), "OUT_OF_RANGE", "ranks 0..1"),
        ((Group(0, 1, mbs(0, 1, 2, 3)),), "RANK_UNCOVERED", "phase 0: ranks [1] in no group"),
        ((Group(0, 1, mbs(0, 1)), Group(1, 1, (MicroBatch((2, 3), 4),))), "BAD_RECOMPUTE",
         "4 not in [0, 3]"),
        ((Group(0, 1, mbs(0, 1)), Group(1, 1, (MicroBatch((2, 3), -1),))), "BAD_RECOMPUTE",
         "-1 not in [0, 3]"),
        ((Group(0, 1, mbs(0, 1)), Group(1, 1, mbs(2, 3) + (MicroBatch((), 0),))),
         "EMPTY_MICRO_BATCH", "micro-batch 2: no sequence"),
        ((Group(0, 1, mbs(0, 1, 7)), Group(1, 1, mbs(2, 3))), "UNKNOWN_SEQUENCE", "ids [7]"),
    ],
)  # fmt: skip
def test_each_cost_free_violation_is_named(groups, code, text):
    plan = with_groups(valid(), *groups)
    found = plan_check.plan_violations(plan, 2, batch=BATCH, num_layers=3)
    assert found[0].code == code and text in found[0].message, found
    assert code in [v.code for v in validate(plan, BATCH, cost_for("1d", 2))]


def test_no_phase_and_a_wrong_normaliser_kind_count():
    plan = replace(valid(), phases=())
    codes = [v.code for v in plan_check.plan_violations(plan, 2, batch=BATCH)]
    assert codes == ["NO_PHASES", "MISSING_SEQUENCE"]
    samples = valid("samples")
    assert plan_check.plan_violations(samples, 2) == []
    assert plan_check.plan_violations(replace(samples, loss_normalizer=3.0), 2)[0].code == (
        "BAD_NORMALIZER"
    )
    tokens = valid()
    assert tokens.loss_normalizer == BATCH.num_tokens == 24
    assert plan_check.plan_violations(tokens, 2) == []
    assert plan_check.plan_violations(replace(tokens, loss_normalizer=23.0), 2, batch=BATCH)


def test_the_layer_count_comes_from_the_model():
    from dcp_opt.runtime.executor import _num_layers
    from torch import nn

    class Config:
        num_hidden_layers = 5

    hf_like = nn.Linear(1, 1)
    hf_like.config = Config()
    assert _num_layers(make_model("1d", 0)) == 3  # TinyLM.layers
    assert _num_layers(hf_like) == 5  # a transformers model's config
    Config.num_hidden_layers = True
    assert _num_layers(hf_like) is None  # not a count: only recompute >= 0 is checked
    assert _num_layers(nn.Linear(1, 1)) is None
