"""Issue 19: planner quality under the cost models users measure, not only the preset.

The perturbation knobs (dcp_opt/perturb.py, CostModel's measured-profile knobs) charge what
they say; under random cost models of the family every planner's plan is valid and at least
the bound, and greedy and cpsat are never slower than any simple-rule layout
(solvers/greedy/rules.py). CI cost: about 20-40 s at the ci profile on the 2-core machine.
"""

from __future__ import annotations

import numpy as np
import pytest
from dcp_opt.solvers import get_planner
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.common import finish
from dcp_opt.solvers.greedy.rules import rule_plans
from hypothesis import given
from hypothesis import strategies as st

from dcp_opt import CostModel, Sequence, cluster_preset, model_preset, simulate, validate
from dcp_opt.bounds import lower_bound
from dcp_opt.errors import DcpOptError
from dcp_opt.perturb import FAMILY, RANGES, fit_sp_overhead, perturb, perturbed_cost_models
from dcp_opt.result import STATUSES
from dcp_opt.workloads import Workload
from tests import strategies as hs
from tests.counts import EXAMPLES
from tests.test_properties import PLANNERS, REL, budgeted, run, sizes

BASE = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x8"))
MODELS = {"2d": "opensora-stdit3-xl", "1d": "llama-7b"}


# ---- the knobs charge what they say ------------------------------------------------------
def test_knobs_off_keep_the_preset_fingerprint_and_times():
    off = perturb(BASE, sp_step=0.0, replicated_seq_s=0.0, step_overhead_s=0.0)
    assert off.fingerprint() == BASE.fingerprint()
    f = BASE.features(Sequence(0, (16, 30, 40)))
    for d in BASE.cluster.allowed_degrees:
        assert off.time(f, d, 3) == BASE.time(f, d, 3)


def test_sp_overhead_scales_every_layer_at_its_degree_only():
    cost = BASE.with_(sp_compute_overhead=((2, 0.5), (8, 0.25)))
    f = np.array([BASE.features(Sequence(0, (16, 30, 40)))])
    for d, x in ((1, 0.0), (2, 0.5), (4, 0.0), (8, 0.25)):
        for got, want in zip(cost.layer_times(f, d), BASE.layer_times(f, d), strict=True):
            assert got == pytest.approx(want * (1 + x), rel=1e-12)
    assert cost.fingerprint() != BASE.fingerprint()


@pytest.mark.parametrize("d", [1, 4])
def test_replicated_work_is_paid_per_sample_on_every_rank(d):
    rep = 0.003
    cost = BASE.with_(replicated_seq_s=rep)
    seqs = [Sequence(i, s) for i, s in enumerate([(1, 9, 16), (16, 30, 40), (1, 45, 80)])]
    f = sum(BASE.features(s) for s in seqs)
    # not split by the degree: each member pays it for every sample of the micro-batch
    assert cost.time(f, d, 0) - BASE.time(f, d, 0) == pytest.approx(rep * len(seqs), rel=1e-9)
    # a recomputed layer repeats its forward share (1/3 of rep over L layers)
    L = BASE.model.num_layers
    extra = cost.time(f, d, L) - BASE.time(f, d, L)
    assert extra == pytest.approx(rep * len(seqs) * (1 + 1 / 3), rel=1e-9)


def test_step_overhead_is_paid_once_per_step_by_simulate_and_the_bound():
    cost = BASE.with_(step_overhead_s=0.25)
    batch = Workload.parse("2d-short").batch(0, 2**18)
    res = get_planner("greedy")(batch, BASE)
    a, b = simulate(res.plan, batch, BASE), simulate(res.plan, batch, cost)
    assert b.step_time_s - a.step_time_s == pytest.approx(0.25, rel=1e-9)
    assert b.finish_s == a.finish_s
    lb_a, lb_b = lower_bound(batch, BASE).value_s, lower_bound(batch, cost).value_s
    assert lb_b - lb_a == pytest.approx(0.25, rel=1e-9)


def test_attention_by_length_is_the_efficiency_it_says():
    """One block's attention over an axis of length s runs at efficiency s / (s + half) of
    the scaled preset's: the perturbed time less the preset's linear part is
    scale * quad * s^2 / eff(s)."""
    half, scale = 512.0, 1.2
    cost = perturb(BASE, attn_half_len=half, attn_scale=scale)
    b0, b1 = BASE.coeffs.blocks["spatial"].fwd, cost.coeffs.blocks["spatial"].fwd
    for s in (64, 1024, 8192):
        eff = s / (s + half)
        attention = b1.quad * s * s + b1.lin * s - b0.lin * s
        assert attention == pytest.approx(scale * b0.quad * s * s / eff, rel=1e-12)


def test_perturb_refuses_bad_knobs_and_leaves_the_base_unchanged():
    before = BASE.fingerprint()
    with pytest.raises(DcpOptError, match="sp_step: must be in"):
        perturb(BASE, sp_step=2.0)
    with pytest.raises(DcpOptError, match="not a knob"):
        perturb(BASE, warp_speed=1.0)
    with pytest.raises(DcpOptError, match="sp_compute_overhead"):
        BASE.with_(sp_compute_overhead=((3, 0.1),))  # 3 is not an allowed degree on h200x8
    with pytest.raises(DcpOptError, match="replicated_seq_s"):
        BASE.with_(replicated_seq_s=-1.0)
    assert BASE.fingerprint() == before


def test_family_is_distinct_and_within_the_ranges():
    fam = perturbed_cost_models(BASE)
    assert set(fam) == set(FAMILY)
    prints = {m.fingerprint() for m in fam.values()}
    assert len(prints) == len(fam)  # every perturbation moves something
    for knobs in FAMILY.values():
        for k, v in knobs.items():
            lo, hi, _ = RANGES[k]
            assert lo <= v <= hi, (k, v)


def test_fit_sp_overhead_recovers_it_from_noisy_samples():
    truth = perturb(BASE, sp_step=0.2, sp_per_doubling=0.1)
    rng = np.random.default_rng(0)
    f = np.array([BASE.features(Sequence(0, (16, 30, 40)))])
    samples = []
    for d in (1, 2, 4, 8):
        pred = float(sum(BASE.layer_times(f, d))[0])
        meas = float(sum(truth.layer_times(f, d))[0]) * 1.1  # a compute factor at every d
        for k in range(7):
            wild = 3.0 if k == 0 else 1.0  # one outlier per degree
            samples.append((d, pred, meas * wild * (1 + 0.01 * rng.standard_normal())))
    got = dict(fit_sp_overhead(samples))
    for d, x in truth.sp_compute_overhead:
        assert got[d] == pytest.approx(x, abs=0.03), (d, got[d], x)
    with pytest.raises(DcpOptError, match="degree-1"):
        fit_sp_overhead([(2, 1.0, 1.2)])


# ---- the case ----------------------------------------------------------------------
def test_expensive_sp_long_video_not_on_one_wide_group():
    """Issue 19: SP expensive (1.5x at any degree > 1) and 1.5x activation bytes, so the
    432K-token video fits no single H200; the rest are mostly images. Greedy had returned one
    uniform degree-4/8 layout (16M tokens, seed 1: 47.1 s against a 31.2 s bound; here, 4M
    tokens: 12.1 s at best uniform); the plan must keep the images at degree 1 and beat every
    rule layout (8.7 s: the video first on all 8 GPUs, then everything at degree 1)."""
    cost = perturb(BASE, sp_step=0.5, act_scale=1.5)
    batch = Workload.parse("2d-imageheavy").batch(2, 4 * 2**20)  # holds one 432K video
    assert max(s.num_tokens for s in batch.sequences) == 432_000
    res = get_planner("greedy")(batch, cost)
    rules = {n: _sim(ph, batch, cost) for n, ph in rule_plans(batch, cost).items()}
    assert res.predicted_step_time_s <= min(rules.values()) * (1 + REL)
    uniform = min(v for n, v in rules.items() if n.startswith("static-"))
    assert res.predicted_step_time_s < uniform * 0.8, (res.predicted_step_time_s, uniform)
    at_one = sum(
        len(mb.sequence_ids)
        for ph in res.plan.phases
        for g in ph.groups
        if g.degree == 1
        for mb in g.micro_batches
    )
    assert at_one >= 0.9 * len(batch)


BASE32 = {k: CostModel(model_preset(m), cluster_preset("h200x32")) for k, m in MODELS.items()}


@pytest.mark.parametrize(
    "model, workload, tokens, single_phase",
    [
        # 24 videos of 9 s and 23 of 3.4-4.4 s on 32 ranks: a single-phase layout leaves a
        # bin-packing remainder (12.24 s against a 10.65 s bound, 15 %); overflow-first
        # runs mid-size ones first at degree 8 on every rank (~4.8 %)
        ("sp-step", "2d-long", 16, 0.15),
        # a few long videos among 306 short samples under SP overhead: single-phase layouts
        # fill the long ones' SP groups with short samples at the SP degree (11.7 %, 5.4 %);
        # long-then runs the long ones first on their own groups (~1.9 %, ~0.6 %)
        ("combined", "2d-short", 2, 0.117),
        ("sp-per-doubling", "2d-short", 2, 0.054),
    ],
)
def test_h200x32_batches_levelled_by_a_wide_first_phase(model, workload, tokens, single_phase):
    """Issue 19 on the standard cluster (docs/cost-model.md): greedy within 5 % of the
    certified LP bound where its single-phase candidates were `single_phase` above it
    (figures when written; the assertion is the 5 %, and that a phase 0 is used)."""
    cost = perturbed_cost_models(BASE32[workload[:2]])[model]
    batch = Workload.parse(workload).batch(0, tokens * 2**20)
    res = get_planner("greedy")(batch, cost)
    bound = lp_bound(batch, cost, time_limit_s=1.0).value_s
    assert validate(res.plan, batch, cost) == []
    assert res.predicted_step_time_s <= bound * 1.05, (res.predicted_step_time_s, bound)
    assert len(res.plan.phases) == 2
    assert res.stats["candidate"][0] in ("overflow-first", "long-then")


def _sim(phases, batch, cost) -> float:
    return finish(phases, batch, cost, planner="rule", started=0.0).predicted_step_time_s


# ---- properties ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", PLANNERS)
def test_perturbed_plan_is_valid_and_at_least_the_bound(name):
    @given(st.data())
    def prop(data):
        EXAMPLES[f"perturbed_valid_and_at_least_the_bound[{name}]"] += 1
        inst = data.draw(hs.perturbed_instances(**sizes(name)))
        res = run(name, inst)
        assert res.status in STATUSES and res.ok, (res.status, res.message)
        assert validate(res.plan, inst.batch, inst.cost) == []
        sim = simulate(res.plan, inst.batch, inst.cost)
        bound = lower_bound(inst.batch, inst.cost)
        assert res.predicted_step_time_s == pytest.approx(sim.step_time_s, rel=REL)
        assert sim.step_time_s >= bound.value_s * (1 - REL), (sim.step_time_s, bound)
        assert res.predicted_step_time_s >= res.lower_bound_s * (1 - REL)

    budgeted(name, prop)()


ROBUST = [p for p in ("greedy", "cpsat") if p in PLANNERS]


@pytest.mark.parametrize("name", ROBUST)
def test_never_slower_than_a_simple_rule(name):
    """On homogeneous clusters (where the greedy's draft times are exact) the plan is at
    least as fast as every simple-rule layout of solvers/greedy/rules.py rule_plans."""

    @given(st.data())
    def prop(data):
        EXAMPLES[f"never_slower_than_a_simple_rule[{name}]"] += 1
        inst = data.draw(hs.perturbed_instances(mixed=False, **sizes(name)))
        res = run(name, inst)
        rules = {
            n: _sim(ph, inst.batch, inst.cost)
            for n, ph in rule_plans(inst.batch, inst.cost).items()
        }
        best = min(rules, key=rules.get)
        assert res.predicted_step_time_s <= rules[best] * (1 + REL) + 1e-12, (
            res.predicted_step_time_s,
            best,
            rules[best],
            res.stats.get("candidate"),
        )

    budgeted(name, prop)()


@pytest.mark.parametrize("dense", [True, False])
def test_perturbed_bounds_are_below_any_valid_plan(dense):
    """The analytic and the packing-aware LP bound stay below every valid plan (random tight
    plans, many tiny sequences included) under every perturbation."""

    @given(st.data())
    def prop(data):
        EXAMPLES[f"perturbed_bounds_below_any_valid_plan[{dense}]"] += 1
        inst = data.draw(hs.perturbed_instances())
        plan = data.draw(hs.valid_plans(inst, dense=dense, cp=True))
        sim = simulate(plan, inst.batch, inst.cost)
        assert sim.step_time_s >= lower_bound(inst.batch, inst.cost).value_s * (1 - REL)
        lp = lp_bound(inst.batch, inst.cost, upper_s=sim.step_time_s, time_limit_s=10.0)
        assert sim.step_time_s >= lp.value_s * (1 - REL), (sim.step_time_s, lp)

    prop()
