"""Step former (solvers/stream/step_former.py) and stream bound (solvers/bounds/stream.py), issue 13.

The property runs in scripts/nightly.py's list (HYPOTHESIS_PROFILE=nightly: 10,000 examples);
in CI it runs the `ci` profile's examples on streams of up to 80 samples.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.bounds.stream import stream_lower_bound
from dcp_opt.solvers.stream.step_former import data_order_steps, form_steps, form_steps_report
from hypothesis import given
from hypothesis import strategies as st

from dcp_opt import Batch, DcpOptError, InfeasibleError, Sequence
from tests import strategies as hs
from tests.toy import toy_cost

REL = 1e-9


def seqs(lengths, ids=None) -> list[Sequence]:
    ids = range(len(lengths)) if ids is None else ids
    return [Sequence(i, (n,)) for i, n in zip(ids, lengths, strict=True)]


def batches(stream, steps) -> list[Batch]:
    by = {s.id: s for s in stream}
    return [Batch(tuple(by[i] for i in s)) for s in steps]


def greedy_epoch(stream, steps, cost) -> float:
    return sum(run_planner("greedy", b, cost).predicted_step_time_s for b in batches(stream, steps))


def check_bounds(stream, steps, *, target, max_shift, tolerance) -> None:
    """The former's three bounds, and its step count (data order's)."""
    home = {i: k for k, s in enumerate(data_order_steps(stream, target)) for i in s}
    flat = [i for s in steps for i in s]
    assert sorted(flat) == sorted(s.id for s in stream), "every sample exactly once"
    assert len(steps) == len(set(home.values())), "as many steps as data order"
    tok = {s.id: s.num_tokens for s in stream}
    lo, hi = (1 - tolerance) * target, (1 + tolerance) * target
    for k, s in enumerate(steps):
        assert s, f"step {k} is empty"
        assert all(abs(k - home[i]) <= max_shift for i in s), f"step {k}: moved > K"
        total = sum(tok[i] for i in s)
        assert total <= hi * (1 + REL), f"step {k}: {total} tokens over {hi}"
        if k < len(steps) - 1:
            assert total >= lo * (1 - REL), f"step {k}: {total} tokens under {lo}"


# ---- data order, by hand ---------------------------------------------------------------------
def test_data_order_nearest_target():
    # target 10: 5 opens; 5 joins (10 is nearer 10 than 5); 5 would make 15, |15-10| > |10-10|:
    # close [0, 1]. 5 opens; 9 joins (14: 4 away, 5 was 5 away); 1 would make 15: close
    # [2, 3]. 1 opens the last step [4]. A 25-token sample (over 2 x target) sits alone.
    assert data_order_steps(seqs([5, 5, 5, 9, 1]), 10) == [[0, 1], [2, 3], [4]]
    assert data_order_steps(seqs([3, 25, 4], ids=[7, 8, 9]), 10) == [[7], [8], [9]]


def test_repair_pulls_a_sample_forward():
    # target 10, tolerance 0.1: band [9, 11]. Data order: [8] (8 + 6 = 14 is 4 away, 8 is 2:
    # close), [6, 1, 4] = 11, [2]. Step 0 is under 9: pull from step 1 a sample within K = 1
    # that fits its room (11 - 8 = 3): only the 1 -> [8, 1] = 9, [6, 4] = 10, [2].
    stream = seqs([8, 6, 1, 4, 2])
    assert data_order_steps(stream, 10) == [[0], [1, 2, 3], [4]]
    rep = form_steps_report(stream, target_tokens=10, max_shift=1, tolerance=0.1)
    assert rep.steps == [[0, 2], [1, 3], [4]] and rep.repaired == 1
    # K = 0 cannot move it: refused, naming the step and the band
    with pytest.raises(DcpOptError, match=r"tolerance: step 0 holds 8 tokens.*\[9, 11\]"):
        form_steps(stream, target_tokens=10, max_shift=0, tolerance=0.1)


def test_band_edges_are_the_users():
    # (1 - 0.3) x 10 is 7.000000000000001 in floating point; the band is still [7, 13]: three
    # 7-token samples (each alone: 7 + 7 = 14 is 4 away from 10, 7 is 3) are in it at K = 0
    stream = seqs([7, 7, 7])
    assert form_steps(stream, target_tokens=10, max_shift=0, tolerance=0.3) == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"target_tokens": 0}, "target_tokens"),
        ({"target_tokens": True}, "target_tokens"),
        ({"max_shift": -1}, "max_shift"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"budget_s": -1}, "budget_s"),
    ],
)
def test_bad_arguments_name_the_field(kw, field):
    args = {"target_tokens": 10, "max_shift": 1, "tolerance": 0.1, **kw}
    with pytest.raises(DcpOptError, match=rf"^{field}: "):
        form_steps(seqs([5, 5]), **args)


def test_sample_over_the_band_is_refused():
    # (1 + 0.1) x 10 = 11 tokens at most in a step: a 12-token sample fits no step
    with pytest.raises(DcpOptError, match=r"stream\[1\]: sequence 42 holds 12 tokens.*= 11"):
        form_steps(seqs([5, 12], ids=[41, 42]), target_tokens=10, max_shift=2, tolerance=0.1)


def test_sample_that_fits_nowhere_is_refused():
    # toy: 4 GPUs of 100 bytes; 30 tokens need 9 + 30/4 x (30 - 8 x 2) = 114 bytes per GPU
    # at degree 4 with both layers recomputed
    with pytest.raises(InfeasibleError, match=r"sequence 1 .*cannot fit"):
        form_steps(seqs([10, 30]), target_tokens=40, max_shift=1, tolerance=0.5, cost=toy_cost())


def test_former_minimises_the_given_proxy():
    """`proxy` replaces the greedy planner as the step-time predictor: the greedy itself gives
    the default's steps; a proxy that never changes keeps no exchange (data order, in band)."""
    cost = toy_cost()
    stream = seqs([10, 10, 2, 2, 2, 10, 10, 2, 2, 2])
    kw = {"target_tokens": 20, "max_shift": 1, "tolerance": 0.5, "cost": cost}
    kw.update(max_evals=50, budget_s=60.0)  # a result independent of the load
    default = form_steps(stream, **kw)
    assert default != data_order_steps(stream, 20)  # the greedy proxy finds an exchange here
    calls = []

    def greedy(batch):
        calls.append(len(batch))
        return run_planner("greedy", batch, cost).predicted_step_time_s

    assert form_steps(stream, **kw, proxy=greedy) == default and calls
    assert form_steps(stream, **kw, proxy=lambda b: 1.0) == data_order_steps(stream, 20)
    with pytest.raises(DcpOptError, match="^proxy: "):
        form_steps(stream, **kw, proxy=3.0)


# ---- stream bound, by hand -------------------------------------------------------------------
def test_stream_bound_toy_arithmetic():
    # toy without its 0.5 s per-micro-batch overhead (every constant 0, so the LP's work row
    # is the analytic one): a 10-token sequence fits at degree 4 without recompute (9 + 10/4 x
    # 30 = 84 bytes <= 100): 6 x 10 / 4 = 15 s, 60 GPU-s (degree 2 needs both layers
    # recomputed: 2 x (30 + 10) = 80 GPU-s). Step [10, 10]: work 120 / 4 = 30 s >= critical
    # path 15 s; two steps: 60 s, fixed; movable: 240 / 4 = 60 s as well.
    bare = toy_cost()
    bare = bare.with_(coeffs=replace(bare.coeffs, microbatch_overhead_s=0.0))
    steps = [Batch.from_lengths([10, 10]), Batch.from_lengths([10, 10])]
    assert stream_lower_bound(steps, bare) == pytest.approx(60.0)
    assert stream_lower_bound(steps, bare, max_shift=2) == pytest.approx(60.0)
    # with the overhead: the analytic bound is 30.5 a step (one 0.5 s constant at least) and
    # the greedy plan 31 s (the two sequences one after the other on 4 GPUs, 20 tokens do not
    # fit in one micro-batch: 9 + 5 x 30 > 100): 61 <= bound <= 62, fixed and movable
    cost = toy_cost()
    for k in (0, 2):
        assert 61.0 - 1e-9 <= stream_lower_bound(steps, cost, max_shift=k) <= 62.0 + 1e-9
    with pytest.raises(DcpOptError, match="^max_shift: "):
        stream_lower_bound(steps, cost, max_shift=-1)
    with pytest.raises(DcpOptError, match=r"^steps\[0\]: "):
        stream_lower_bound([[1, 2]], cost)


# ---- property: random streams ----------------------------------------------------------------
@st.composite
def stream_cases(draw):
    """A 1D cost model, a target, and a stream of mostly short samples with some long ones
    (up to the band's top, and what fits), ids in random order."""
    cost = draw(hs.cost_models(max_gpus=16, kind="1d"))
    cap = min(hs.max_fit_tokens(cost), 2**17)
    tolerance = draw(st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5]))
    target = draw(hs.ints(max(2, cap // 4), max(2, 2 * cap)))
    top = min(cap, int((1 + tolerance) * target))
    n = draw(hs.ints(1, 80))
    lengths = []
    for _ in range(n):
        if draw(hs.ints(0, 5)) == 0:  # one in six is long
            lengths.append(hs.log_int(draw, max(1, target // 4), max(1, top)))
        else:
            lengths.append(hs.log_int(draw, 1, max(1, min(top, target // 8))))
    ids = draw(st.permutations(range(n)))
    return cost, seqs(lengths, ids), target, draw(hs.ints(0, 3)), tolerance


@given(stream_cases())
def test_former_keeps_bounds_and_the_bound_holds(case):
    cost, stream, target, k, e = case
    data = data_order_steps(stream, target)
    in_band = max(s.num_tokens for s in stream) <= 2 * e * target
    try:
        steps = form_steps(
            stream, target_tokens=target, max_shift=k, tolerance=e, cost=cost, max_evals=24
        )
    except DcpOptError as err:
        # refused only where data order is outside the band (a sample over 2e x target)
        assert not in_band, err
        assert str(err).startswith("tolerance: ")
        return
    check_bounds(stream, steps, target=target, max_shift=k, tolerance=e)
    former = greedy_epoch(stream, steps, cost)
    if in_band:  # the search starts from data order and keeps only gains under its proxy
        assert former <= greedy_epoch(stream, data, cost) * (1 + REL)
    # the bounds: certified for data order's steps (K = 0) and for any reassignment (K > 0)
    fixed = stream_lower_bound(batches(stream, data), cost, lp_time_limit_s=0)
    movable = stream_lower_bound(batches(stream, data), cost, max_shift=max(k, 1))
    assert movable <= fixed * (1 + REL)
    assert fixed <= greedy_epoch(stream, data, cost) * (1 + REL)
    assert movable <= former * (1 + REL)
    # the former's own steps: their fixed bound holds, and the movable bound is the same as
    # data order's (it depends on the sequences and the step count, not on the assignment)
    assert stream_lower_bound(batches(stream, steps), cost, lp_time_limit_s=0) <= former * (1 + REL)
    again = stream_lower_bound(batches(stream, steps), cost, max_shift=max(k, 1))
    assert again == pytest.approx(movable, rel=1e-9)
