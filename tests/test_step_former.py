"""Step former (solvers/step_former.py) and stream bound (solvers/stream_bound.py), issue 13.

The property runs in scripts/nightly.py's list (HYPOTHESIS_PROFILE=nightly: 10,000 examples);
in CI it runs the `ci` profile's examples on streams of up to 80 samples.
"""

from __future__ import annotations

import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.step_former import data_order_steps, form_steps, form_steps_report
from dcp_opt.solvers.stream_bound import stream_lower_bound
from hypothesis import given
from hypothesis import strategies as st

from dcp_opt import Batch, DcpOptError, Sequence
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


# ---- stream bound, by hand -------------------------------------------------------------------
def test_stream_bound_toy_arithmetic():
    # toy: 4 GPUs, time 6T/d + 0.5 per micro-batch, no sync. A 10-token sequence fits at
    # d = 1 without recompute, least work 6 x 10 = 60 GPU-s at any degree. Step [10, 10]:
    # work bound 120 / 4 + 0.5 = 30.5 >= critical path 6 x 10 / 4 + 0.5 = 15.5; two such
    # steps: 61. Movable (K > 0): 240 / 4 + 2 x 0.5 = 61 as well; the LP work row,
    # (6 + 0.5 / 6.5) x 40 / 4 = 60.77, is lower.
    cost = toy_cost()
    steps = [Batch.from_lengths([10, 10]), Batch.from_lengths([10, 10])]
    assert stream_lower_bound(steps, cost) == pytest.approx(61.0)
    assert stream_lower_bound(steps, cost, max_shift=2) == pytest.approx(61.0)
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
