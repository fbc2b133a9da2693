"""Issue 29, the planners' side of "bounded in time and memory" and "inputs are exact or
refused": extreme finite figures give a plan with finite figures or a DcpOptError naming the
field (never nan, never a hang); every planner loop has an exit; CostModel(coeffs=) is
checked like a profile; run_planner refuses options a planner does not take and seeds CP-SAT
cannot hold; batches above the sequence cap are refused with how to split them."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
from dcp_opt.solvers import PLANNERS, get_planner, planner_options, run_planner
from dcp_opt.solvers import common as solvers_common
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.greedy.instance import layout, make_instance
from dcp_opt.solvers.stream.async_plan import AsyncPlanner

from dcp_opt import Batch, CostModel, cluster_preset, model_preset
from dcp_opt.cost import CostCoefficients, TermCoeffs
from dcp_opt.cost.coeffs import check_coefficients
from dcp_opt.errors import DcpOptError, check_planner_options

MODEL = model_preset("llama-1b")
BATCH = Batch.from_lengths([1024, 4096, 512, 8192, 300, 2000])
FAST = ("greedy", "bucket", "verl_balanced", "megatron_dynamic_cp", "packed")


def _cost(preset: str = "h200x8", **cluster) -> CostModel:
    """The preset with `cluster`'s figures set past Cluster's own range checks (which refuse
    every extreme value below: test_the_cluster_refuses_the_extreme_figures), so these tests
    reach the planners' and the cost model's own guards behind them."""
    c = copy.copy(cluster_preset(preset))
    for k, v in cluster.items():
        object.__setattr__(c, k, v)
    return CostModel(MODEL, c)


@pytest.mark.parametrize(
    "field, value",
    [("intra_node_bw", 1e-300), ("intra_node_bw", 1e300), ("inter_node_bw", 1e-300),
     ("intra_node_latency_s", 1e308), ("inter_node_latency_s", 1e308)],
)  # fmt: skip
def test_the_cluster_refuses_the_extreme_figures(field, value):
    # the first guard (dcp_opt/cluster.py): rates and latencies in ranges where costs stay
    # finite, the field named
    with pytest.raises(DcpOptError, match=rf"cluster\.{field}"):
        cluster_preset("h200x8").with_(**{field: value})


# ---- extreme finite figures -----------------------------------------------------------------
@pytest.mark.timeout(20)
def test_a_bandwidth_of_1e_300_is_refused_naming_it_not_a_hang():
    # The old code looped for ever in greedy's layout (RSS 6.4 GB in 60 s): a2a times of
    # 1e300 s per byte overflow to inf, the shares floor to garbage counts.
    with pytest.raises(DcpOptError, match=r"cluster\.intra_node_bw=1e-300"):
        run_planner("greedy", BATCH, _cost(intra_node_bw=1e-300))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("planner", FAST)
def test_a_bandwidth_of_1e_300_on_two_nodes_names_the_sequence_and_field(planner):
    # Across nodes the gradient sync runs at the NIC rate (finite): the all-to-all of a
    # degree-2 group inside a node is what overflows, sequence by sequence.
    with pytest.raises(DcpOptError, match=r"degree 2: its comm time.*intra_node_bw=1e-300"):
        run_planner(planner, BATCH, _cost("h200x16", intra_node_bw=1e-300))


@pytest.mark.timeout(20)
def test_a_latency_of_1e308_is_refused_naming_it_not_nan():
    # 4 calls x 1e308 s = inf; at degree 1 the old code then made inf x 0 = nan, and every
    # figure of every plan was nan with status feasible.
    with pytest.raises(DcpOptError, match=r"cluster\.intra_node_latency_s=1e\+308"):
        _cost(intra_node_latency_s=1e308)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "field, value",
    [
        ("inter_node_latency_s", 1e308),  # one node: no call crosses nodes
        ("intra_node_bw", 1e300),
        ("inter_node_bw", 1e-300),  # one node: unused
        ("memory_bytes", 1e300),
        ("peak_flops", 1e300),
    ],
)
@pytest.mark.parametrize("planner", [*FAST, "cpsat", "dcp_inter_pac", "dcp_intra"])
def test_extreme_finite_figures_plan_with_finite_figures(field, value, planner):
    cost = _cost(**{field: value})
    res = run_planner(planner, BATCH, cost)
    assert res.ok, res.message
    assert "Error" not in res.message  # cpsat: no OR-Tools TypeError on a 290-digit int
    assert math.isfinite(res.predicted_step_time_s) and res.predicted_step_time_s > 0
    assert math.isfinite(res.lower_bound_s)


def test_a_peak_of_1e_300_flops_is_refused_naming_it():
    with pytest.raises(DcpOptError, match=r"cluster\.peak_flops"):
        _cost(peak_flops=1e-300)


@pytest.mark.timeout(10)
def test_layout_ends_on_non_finite_times():
    # The loop itself, whatever the cost model lets through: shares of inf or nan seconds
    # are capped at the groups that fit, and the leftover loop ends.
    cost = _cost()
    inst = make_instance(BATCH, cost)
    items = np.arange(len(BATCH))
    pref = np.full(len(BATCH), len(inst.degrees) - 1)
    for target in (0.0, float("nan"), 1e-300):
        bad = replace(inst, time=np.full_like(inst.time, 1e308))
        out = layout(bad, items, pref, target, inst.num_gpus)
        assert sum(int(inst.degrees[j]) for j in out) <= inst.num_gpus


@pytest.mark.timeout(10)
def test_lp_bound_bracket_ends_when_work_overflows():
    # Times near the float limit: the separable test never holds (work sums to inf); the
    # old doubling loop ran for ever (inf * 2 = inf); now the analytic bound comes back.
    cost = _cost()
    from dcp_opt.solvers.bounds import data as bound_data_mod

    real = bound_data_mod.bound_data

    def huge(batch, c):
        dat = real(batch, c)
        return replace(dat, work=np.full_like(dat.work, np.inf))

    import dcp_opt.solvers.bounds.lp as lp

    lp.bound_data, saved = huge, lp.bound_data
    try:
        got = lp_bound(BATCH, cost, time_limit_s=0.0)
    finally:
        lp.bound_data = saved
    assert math.isfinite(got.value_s) and got.lp_solves == 0


# ---- CostModel(coeffs=) checked like a profile ------------------------------------------------
def _coeffs(**changes) -> CostCoefficients:
    return replace(CostModel(MODEL, cluster_preset("h200x8")).coeffs, **changes)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"microbatch_overhead_s": -1.0}, "microbatch_overhead_s"),
        ({"head_fwd_per_token_s": float("nan")}, "head_fwd_per_token_s"),
        ({"reserved_bytes": float("inf")}, "reserved_bytes"),
        ({"act_bytes_per_token_layer": 0.0}, "act_bytes_per_token_layer: must be > 0"),
        ({"ckpt_bytes_per_token_layer": -5.0}, "ckpt_bytes_per_token_layer"),
        ({"a2a_calls_per_layer": True}, "a2a_calls_per_layer"),
        ({"a2a_calls_per_layer": 2.5}, "a2a_calls_per_layer"),
        ({"a2a_bytes_per_token_layer": "4"}, "a2a_bytes_per_token_layer"),
    ],
)
def test_cost_model_refuses_bad_coefficients_naming_them(changes, field):
    with pytest.raises(DcpOptError, match=f"cost coefficients.{field}"):
        CostModel(MODEL, cluster_preset("h200x8"), _coeffs(**changes))


def test_negative_block_coefficients_are_refused_not_planned_to_a_negative_time():
    # The old code planned to a negative step time with status feasible.
    neg = TermCoeffs(quad=-1e-12, lin=-1e-6, seq=0.0, const=0.0)
    coeffs = _coeffs(blocks={"layer": replace(_coeffs().blocks["layer"], fwd=neg)})
    with pytest.raises(DcpOptError, match=r"cost coefficients\.blocks\.layer\.fwd\.quad"):
        CostModel(MODEL, cluster_preset("h200x8"), coeffs)


def test_the_preset_and_profile_coefficients_pass_the_check():
    check_coefficients(_coeffs())
    with pytest.raises(DcpOptError, match="must be a CostCoefficients"):
        check_coefficients({"blocks": {}})


def test_knobs_keep_their_checks():
    with pytest.raises(DcpOptError, match="usable_memory_fraction"):
        CostModel(MODEL, cluster_preset("h200x8"), usable_memory_fraction=1.5)
    with pytest.raises(DcpOptError, match="step_overhead_s"):
        CostModel(MODEL, cluster_preset("h200x8"), step_overhead_s=-1.0)
    with pytest.raises(DcpOptError, match="grad_reduce_bytes_per_param"):
        CostModel(MODEL, cluster_preset("h200x8"), grad_reduce_bytes_per_param=float("nan"))
    for name, value in (("usable_memory_fraction", "0.9"), ("step_overhead_s", True)):
        with pytest.raises(DcpOptError, match=name):  # no TypeError, no bool as 1
            CostModel(MODEL, cluster_preset("h200x8"), **{name: value})


def test_the_checker_raises_the_callers_error_class():
    class ProfileLikeError(DcpOptError):
        pass

    bad = _coeffs(reserved_bytes=-1.0)
    with pytest.raises(ProfileLikeError, match=r"profile\.coefficients\.reserved_bytes"):
        check_coefficients(bad, "profile.coefficients", ProfileLikeError)


# ---- planner options -------------------------------------------------------------------------
def test_a_misspelt_option_is_refused_naming_it_and_the_allowed_ones():
    cost = _cost()
    with pytest.raises(DcpOptError, match=r"cpsat: unknown option \['time_limt_s'\]; allowed: "):
        run_planner("cpsat", BATCH, cost, time_limt_s=1.0)
    with pytest.raises(DcpOptError, match=r"greedy: unknown options \['a', 'b'\].*'seed'"):
        run_planner("greedy", BATCH, cost, a=1, b=2)
    with pytest.raises(DcpOptError, match=r"bucket: unknown option \['degre'\]"):
        get_planner("bucket")(BATCH, cost, degre=2)  # the CLI and bench call this form


def test_every_planner_declares_its_options():
    for name in PLANNERS:
        opts = planner_options(get_planner(name))
        assert "seed" in opts, name
    assert set(planner_options(get_planner("greedy"))) >= {"seed", "time_limit_s"}


def test_a_planner_taking_options_without_declaring_them_is_refused():
    def plan_loose(batch, cost, *, seed=0, **opts):
        raise AssertionError("not reached")

    with pytest.raises(TypeError, match="extra_options"):
        planner_options(plan_loose)
    plan_loose.extra_options = ("knob",)
    assert planner_options(plan_loose) == ("seed", "knob")


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("seed", 2**64, "must be at most 2147483647"),
        ("seed", 2**31, "must be at most 2147483647"),
        ("seed", 10**400, "must be at most 2147483647 .* got an integer of 401 digits"),
        ("num_workers", 10**9, "must be at most 1024"),
    ],
    ids=["2**64", "2**31", "10**400", "workers 10**9"],
)
def test_huge_shared_options_are_a_clear_error(option, value, message):
    with pytest.raises(DcpOptError, match=f"cpsat.{option}: {message}"):
        run_planner("cpsat", BATCH, _cost(), **{option: value})
    check_planner_options(seed=2**31 - 1, num_workers=1024)  # the largest allowed


def test_async_planner_refuses_a_misspelt_option_at_once():
    with pytest.raises(DcpOptError, match=r"greedy: unknown option \['time_limt_s'\]"):
        AsyncPlanner(_cost(), "greedy", time_limt_s=1.0)


# ---- the sequence cap ------------------------------------------------------------------------
def test_a_batch_above_the_cap_is_refused_with_how_to_split_it(monkeypatch):
    monkeypatch.setattr(solvers_common, "MAX_SEQUENCES", 4)
    with pytest.raises(DcpOptError, match=r"greedy: batch of 6 sequences .* split it into 2"):
        run_planner("greedy", BATCH, _cost())
    with pytest.raises(DcpOptError, match="split it into 2 batches of at most 4"):
        get_planner("bucket")(BATCH, _cost())
    monkeypatch.setattr(solvers_common, "MAX_SEQUENCES", 6)
    assert run_planner("greedy", BATCH, _cost()).ok  # at the cap: planned


def test_the_planners_cap_is_the_batchs_cap():
    # One cap (session 7 had two: a batch of 1,000,001..1,048,576 sequences built and was
    # refused by every planner).
    from dcp_opt.batch import MAX_SEQUENCES

    assert solvers_common.MAX_SEQUENCES == MAX_SEQUENCES == 2**20


def _zero_time_cost(overhead_s: float) -> CostModel:
    base = CostModel(MODEL, cluster_preset("h200x8").with_(intra_node_latency_s=0.0))
    zero = TermCoeffs()
    coeffs = replace(
        base.coeffs,
        blocks={"layer": replace(base.coeffs.blocks["layer"], fwd=zero, bwd=zero)},
        head_fwd_per_token_s=0.0,
        head_bwd_per_token_s=0.0,
        microbatch_overhead_s=overhead_s,
    )
    return CostModel(MODEL, base.cluster, coeffs, grad_reduce_bytes_per_param=0.0)


@pytest.mark.timeout(20)
def test_all_zero_time_coefficients_are_refused():
    # The old code divided by a 0 s step: ZeroDivisionError in greedy, cpsat and the
    # VideoSys methods (a traceback: the CLI's "all-zero profile coefficients").
    with pytest.raises(DcpOptError, match="every time coefficient is 0"):
        _zero_time_cost(0.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("planner", ["greedy", "bucket", "dcp_inter", "verl_balanced"])
def test_times_that_overflow_when_added_are_refused_naming_the_figure(planner):
    # 1e308 s per micro-batch is finite; two on one rank are not: a DcpOptError naming the
    # figure, not an inf step time (nor dcp_inter's int(inf) OverflowError).
    with pytest.raises(DcpOptError, match=r"overflows float64.*1e\+308"):
        run_planner(planner, BATCH, _zero_time_cost(1e308))
    assert run_planner(planner, BATCH, _zero_time_cost(1e-300)).ok  # tiny is fine
