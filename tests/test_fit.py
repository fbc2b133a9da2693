"""Coefficient fitting (dcp_opt.fit) and online recalibration (dcp_opt.recalibrate). Torch-free."""

import math
import warnings

import numpy as np
import pytest

from dcp_opt import Batch
from dcp_opt.errors import DcpOptError
from dcp_opt.fit import (
    PoorFitWarning,
    block_features,
    fit_block_time,
    fit_nonneg,
    fit_per_token,
    holdout_mask,
)
from dcp_opt.recalibrate import RecalibratedCostModel, RecalibrationConfig, Recalibrator
from dcp_opt.simulate import simulate
from tests.toy import toy_cost

GRID_1D = [[(s,)] * k for s in (64, 128, 256, 512, 1024, 2048) for k in (1, 2, 4)]


def test_block_features_by_hand():
    # 1D: lengths 3 and 4 -> Q = 9 + 16 = 25, T = 7, S = 2
    assert list(block_features("layer", [(3,), (4,)])) == [25, 7, 2]
    # 2D shape (F=2, 3x1 -> S=3): spatial Q = F*S^2 = 18, temporal Q = S*F^2 = 12, T = 6
    assert list(block_features("spatial", [(2, 3, 1)])) == [18, 6, 1]
    assert list(block_features("temporal", [(2, 3, 1)])) == [12, 6, 1]
    with pytest.raises(DcpOptError, match="block_type"):
        block_features("mlp", [(2, 3, 1)])


def test_block_features_match_cost_model():
    cost = toy_cost()
    batch = Batch.from_lengths([5, 7])
    want = sum(cost.features(s) for s in batch.sequences)  # [Q, T, S] = [74, 12, 2]
    assert list(block_features("layer", [(5,), (7,)])) == list(want)


def test_windowed_block_features_by_hand_and_as_the_cost_model():
    # Window 4: a sequence of 10 scores 10^2 - (10 - 4)^2 = 64 (~2 s w - w^2 = 80 - 16);
    # one of 3 (shorter than the window) stays 3^2 = 9. T = 13, S = 2.
    assert list(block_features("layer", [(10,), (3,)], window=4)) == [73, 13, 2]
    assert list(block_features("layer", [(10,), (3,)])) == [109, 13, 2]  # no window: s^2
    with pytest.raises(DcpOptError, match="window"):
        block_features("spatial", [(2, 3, 1)], window=4)
    # the same Q as a cost model of an all-windowed model (one definition, cost.windowed_quad)
    from dataclasses import replace

    cost = toy_cost()
    wcost = cost.with_(model=replace(cost.model, window=4, windowed_layers=cost.model.num_layers))
    want = sum(wcost.features(s) for s in Batch.from_lengths([10, 3]).sequences)
    assert list(block_features("layer", [(10,), (3,)], window=4)) == list(want)


def test_windowed_fit_recovers_the_quad_term():
    # times generated with the windowed Q: the windowed fit recovers them exactly, a fit on
    # plain s^2 cannot (the quad column no longer matches the times' shape)
    true = np.array([2e-7, 3e-5, 1e-4, 2e-3])
    x = np.array([[*block_features("layer", p, window=128), 1.0] for p in GRID_1D])
    y = x @ true
    fit = fit_block_time("layer", GRID_1D, y, window=128, warn=False)
    assert np.allclose(fit.coef, true, rtol=1e-6)
    assert fit.report.median_rel_err_test < 1e-6
    plain = fit_block_time("layer", GRID_1D, y, warn=False)
    assert plain.report.max_rel_err_test > 0.05


def test_fit_recovers_known_coefficients_exactly():
    # t = 2e-9 Q + 3e-6 T + 5e-5 S + 1e-4: noiseless data -> the fit returns these numbers.
    true = dict(quad=2e-9, lin=3e-6, seq=5e-5, const=1e-4)
    y = [
        true["quad"] * q + true["lin"] * t + true["seq"] * s + true["const"]
        for q, t, s in (block_features("layer", p) for p in GRID_1D)
    ]
    fit = fit_block_time("layer", GRID_1D, y)
    terms = fit.as_terms()
    for k, v in true.items():
        assert getattr(terms, k) == pytest.approx(v, rel=1e-6), k
    assert fit.report.median_rel_err_test < 1e-8
    assert fit.report.r2_test == pytest.approx(1.0)
    assert not fit.report.poor


def test_fit_with_noise_is_close_and_nonnegative():
    rng = np.random.default_rng(1)
    true = np.array([1e-9, 2e-6, 0.0, 5e-5])  # a zero term must come back >= 0, near 0
    x = np.array([[*block_features("layer", p), 1.0] for p in GRID_1D])
    y = x @ true * rng.lognormal(0, 0.02, len(x))  # 2% multiplicative noise
    fit = fit_nonneg(x, y, ("quad", "lin", "seq", "const"))
    assert all(c >= 0 for c in fit.coef)
    assert fit.coef[0] == pytest.approx(1e-9, rel=0.1)
    assert fit.coef[1] == pytest.approx(2e-6, rel=0.1)
    assert fit.report.median_rel_err_test < 0.05
    assert fit.report.n_test == round(len(y) * 0.25)


def test_poor_fit_warns_and_flags():
    # y alternates x10 between equal feature rows: no linear model fits -> warning.
    x = np.array([[float(t), 1.0] for t in range(1, 21)])
    y = np.array([t * (10.0 if t % 2 else 1.0) for t in range(1, 21)])
    with pytest.warns(PoorFitWarning, match="poor fit"):
        fit = fit_nonneg(x, y, ("lin", "const"), label="bad")
    assert fit.report.poor and "bad" in fit.report.message


def test_fit_rejects_bad_input():
    with pytest.raises(DcpOptError, match="cannot fit 4 terms"):
        fit_block_time("layer", GRID_1D[:3], [1.0, 2.0, 3.0])
    with pytest.raises(DcpOptError, match="> 0"):
        fit_per_token([1, 2, 3], [1.0, -1.0, 2.0], label="x", with_const=False)


def test_fit_per_token_through_origin():
    # bytes = 1536 * T exactly -> per_token 1536
    fit = fit_per_token(
        [128, 256, 512, 1024],
        [1536 * t for t in (128, 256, 512, 1024)],
        label="act",
        with_const=False,
    )
    assert fit.coef[0] == pytest.approx(1536)


def test_holdout_mask_is_seeded_and_leaves_training_rows():
    a, b = holdout_mask(20, 0.25, seed=3), holdout_mask(20, 0.25, seed=3)
    assert (a == b).all() and a.sum() == 5
    assert holdout_mask(2, 0.9).sum() == 1  # never holds out every row


# ---- recalibration ------------------------------------------------------------------------
def test_recalibration_converges_to_a_steady_ratio():
    rc = Recalibrator()
    for _ in range(50):
        rc.observe(2, 1.0, 1.3)
        rc.observe(1, 1.0, 0.9)
    assert rc.factor(2) == pytest.approx(1.3, rel=1e-9)  # warm-up median is already exact
    assert rc.factor(1) == pytest.approx(0.9, rel=1e-9)
    assert rc.factor(4) == rc.factor(None)  # unseen degree -> all-degree factor
    d = rc.drift()
    assert d[2]["drift"] == pytest.approx(0.3) and d[2]["n"] == 50


def test_one_outlier_moves_the_factor_at_most_max_step():
    cfg = RecalibrationConfig(alpha=0.1, clip_log=0.3)
    rc = Recalibrator(cfg)
    for _ in range(20):
        rc.observe(2, 1.0, 1.0)
    before = rc.factor(2)
    rc.observe(2, 1.0, 1000.0)  # a 1000x outlier (e.g. a page fault storm)
    after = rc.factor(2)
    # bound: exp(0.1 * 0.3) = 1.0305
    assert after / before <= cfg.max_step + 1e-12
    assert after / before == pytest.approx(math.exp(0.03))
    assert after < 1.031


def test_outliers_during_warmup_are_ignored_by_the_median():
    rc = Recalibrator(RecalibrationConfig(warmup=5))
    for m in (1.2, 1.2, 50.0, 1.2, 0.01):  # two outliers of five
        rc.observe(1, 1.0, m)
    assert rc.factor(1) == pytest.approx(1.2)


def test_lasting_drift_is_tracked():
    rc = Recalibrator()
    for _ in range(10):
        rc.observe(1, 1.0, 1.0)
    for _ in range(200):
        rc.observe(1, 1.0, 2.0)  # the machine got 2x slower
    assert rc.factor(1) == pytest.approx(2.0, rel=0.01)


def test_recalibration_rejects_nonpositive_times():
    with pytest.raises(DcpOptError, match="measured_s"):
        Recalibrator().observe(1, 1.0, 0.0)
    with pytest.raises(DcpOptError, match="alpha"):
        RecalibrationConfig(alpha=0.0)


def test_recalibrated_cost_scales_microbatch_times_in_simulate():
    from dcp_opt import Group, MicroBatch, make_plan

    cost = toy_cost()
    batch = Batch.from_lengths([10, 20])
    plan = make_plan(
        [[Group(0, 2, (MicroBatch((0,)),)), Group(2, 1, (MicroBatch((1,)),))]],
        batch,
        cost,
        planner="hand",
    )
    rc = Recalibrator()
    for _ in range(5):
        rc.observe(2, 1.0, 1.5)
        rc.observe(1, 1.0, 0.5)
    fixed = rc.corrected(cost)
    assert isinstance(fixed, RecalibratedCostModel)
    # toy: time = 6T/d + 0.5. seq 0 at d=2: 30.5 -> x1.5 = 45.75; seq 1 at d=1: 120.5 -> x0.5
    # = 60.25; step = max = 60.25 (no grad sync in the toy).
    assert simulate(plan, batch, cost).step_time_s == pytest.approx(120.5)
    assert simulate(plan, batch, fixed).step_time_s == pytest.approx(60.25)
    assert fixed.fingerprint() != cost.fingerprint()
    assert rc.corrected(fixed).base == cost  # re-correcting starts from the base model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed.with_(usable_memory_fraction=0.5)  # replace keeps the subclass


def test_recalibration_keeps_every_knob_of_its_base():
    """A recalibrated model charges what its base charges (SP overhead, replicated per-sample
    work, per-step cost), times the factor: the knobs survive `corrected` and `base`."""
    from dataclasses import fields

    from dcp_opt import CostModel, cluster_preset, model_preset

    cost = CostModel(
        model_preset("llama-1b"),
        cluster_preset("h200x8"),
        sp_compute_overhead=((2, 0.3), (4, 0.5)),
        replicated_seq_s=0.01,
        step_overhead_s=0.25,
    )
    rc = Recalibrator()
    for _ in range(5):
        rc.observe(2, 1.0, 1.0)  # factor 1: the recalibrated times must equal the base's
    fixed = rc.corrected(cost)
    for f in fields(CostModel):
        if f.init and f.name != "_cache":
            assert getattr(fixed, f.name) == getattr(cost, f.name), f.name
    assert fixed.base == cost
    assert fixed.grad_sync_time() == cost.grad_sync_time()
    feats = cost.features(Batch.from_lengths([4096]).sequences[0])
    assert float(fixed.time(feats, 2)) == float(cost.time(feats, 2))


def test_nonneg_fit_never_returns_a_negative_coefficient(monkeypatch):
    """bvls may return a bound-touching coefficient a rounding error below 0 (-2.7e-22 was
    seen in CI on a windowed profile, which profile_io then refused): the fit promises >= 0."""
    import types

    from dcp_opt import fit as fit_module

    def touching(a, b, **kw):  # the solver's answer with one coefficient at -3e-22
        return types.SimpleNamespace(x=np.array([1.0, -3e-22]))

    monkeypatch.setattr(fit_module, "lsq_linear", touching)
    coef = fit_module.nonneg_relative_lsq(np.array([[1.0, 0.0], [2.0, 1.0]]), np.array([1.0, 2.0]))
    assert np.all(coef >= 0) and coef[1] == 0.0
