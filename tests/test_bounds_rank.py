"""The rank-assignment bound (solvers/bounds/rank.py rank_bound): a relaxation of every plan that
sees the packing's granularity, certified against exhaustive optima (tests/brute_force.py),
random valid plans of any number of phases, and an instance solved by hand where the
analytic and LP bounds are loose.

Toy arithmetic (tests/toy.py): T tokens at degree 1 take 6T + 0.5 seconds (0.5 the
micro-batch constant, shared by the sequences packed together), memory 9 + 30T bytes.
"""

from __future__ import annotations

import pytest
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.bounds.rank import _sibling_pairs, rank_bound
from dcp_opt.solvers.bounds.rank_plan import rank_plan
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_opt import Batch, lower_bound, simulate, validate
from tests import strategies as hs
from tests.brute_force import brute_force
from tests.test_bounds import mixed_tiny
from tests.toy import toy_cost

REL = 1e-9


def test_granularity_by_hand_where_the_other_bounds_are_loose():
    # 3 GPUs, degree 1 only, 400 bytes: sequences of 4, 4, 4, 3 tokens take 24.5, 24.5,
    # 24.5, 18.5 s alone. Three 4s on three ranks, and the 3 joins one of them: the best
    # packs it into that rank's micro-batch (7 tokens: 219 bytes fit), 6 * 7 + 0.5 = 42.5.
    # Work: (3 * 24 + 18) / 3 + 0.5 = 30.5. The LP's big-sequence rows: below T = 36.5 all
    # four exceed (T - 0.5) / 2 and would need four ranks, so it reaches 2 * 18 + 0.5 at
    # most. The relaxation: some rank holds two sequences, one a 4: 24 + 18 + 0.5.
    cost = toy_cost(1, 3, 400.0, degrees=(1,))
    batch = Batch.from_lengths([4, 4, 4, 3])
    t, plan = brute_force(batch, cost)
    assert validate(plan, batch, cost) == []
    assert t == pytest.approx(42.5, rel=REL)
    assert lower_bound(batch, cost).value_s == pytest.approx(30.5, rel=REL)
    lp_bound(batch, cost, time_limit_s=5.0)  # HiGHS loads once (~1.5 s) outside the limit
    lp = lp_bound(batch, cost, time_limit_s=5.0).value_s
    assert lp <= 36.5 * (1 + REL)
    rb = rank_bound(batch, cost, time_limit_s=5.0)
    assert rb.proven and rb.lp_s <= 36.5 * (1 + REL)
    assert rb.value_s == pytest.approx(42.5, rel=1e-5)
    assert rb.value_s <= t * (1 + REL)


def test_a_continuous_class_only_lowers_the_bound():
    # integer_share above every sequence: all classes continuous, the LP relaxation of the
    # same program (its optimum is the work bound, 30.5), so lp_bound's value stands
    cost = toy_cost(1, 3, 400.0, degrees=(1,))
    batch = Batch.from_lengths([4, 4, 4, 3])
    rb = rank_bound(batch, cost, time_limit_s=5.0, integer_share=10.0)
    assert rb.integer_classes == 0 and rb.classes == 2
    assert rb.value_s == rb.lp_s < 42.5


def test_sibling_pairs_only_where_the_placements_are_symmetric():
    # 4 ranks, degrees 1, 2, 4 aligned: pairs (0|1), (2|3), (0-1|2-3)
    pos = [(0, 1, s) for s in range(4)] + [(1, 2, 0), (1, 2, 2), (2, 4, 0)]
    assert _sibling_pairs(pos, 4) == [([0], [1]), ([2], [3]), ([0, 1], [2, 3])]
    # a degree-2 group that may start at rank 1 straddles (0|1) and (2|3): neither pair,
    # nor the halves (its mirror would start at rank 3)
    assert _sibling_pairs([*pos, (1, 2, 1)], 4) == []
    # 3 ranks: only (0|1); rank 2 has no sibling
    assert _sibling_pairs([(0, 1, s) for s in range(3)], 3) == [([0], [1])]


@settings(max_examples=max(10, settings.default.max_examples // 2), deadline=None)
@given(mixed_tiny())
def test_rank_bound_is_never_above_the_optimum_on_mixed_clusters(case):
    # per-rank speed factors (some below 1) and mixed memory, with and without communication
    cost, batch = case
    t, plan = brute_force(batch, cost)
    assert validate(plan, batch, cost) == []
    rb = rank_bound(batch, cost, time_limit_s=5.0)
    assert rb.value_s <= t * (1 + REL), (rb, t)
    assert rb.value_s >= rb.lp_s


@settings(max_examples=max(10, settings.default.max_examples // 2), deadline=None)
@pytest.mark.parametrize("dense", [True, False])
@given(data=st.data())
def test_rank_bound_is_below_any_valid_plan(dense, data):
    # random valid plans of several phases (a relaxation of every plan, not only the single-
    # phase ones the brute force enumerates)
    inst = data.draw(hs.instances(max_seqs=12))
    plan = data.draw(hs.valid_plans(inst, dense=dense, cp=True))
    sim = simulate(plan, inst.batch, inst.cost)
    rb = rank_bound(inst.batch, inst.cost, time_limit_s=0.3)  # the dual bound at a limit holds
    assert sim.step_time_s >= rb.value_s * (1 - REL), (sim.step_time_s, rb)


def test_rank_plan_by_hand():
    # the instance above: the relaxation's optimum as a plan; the 3 and one 4 share a
    # micro-batch (7 tokens, 219 bytes, no recompute), so it reaches the optimum 42.5
    cost = toy_cost(1, 3, 400.0, degrees=(1,))
    batch = Batch.from_lengths([4, 4, 4, 3])
    res = rank_plan(batch, cost, time_limit_s=5.0)
    assert validate(res.plan, batch, cost) == []
    assert res.predicted_step_time_s == pytest.approx(42.5, rel=REL)
    sizes = sorted(
        len(mb.sequence_ids) for g in res.plan.phases[0].groups for mb in g.micro_batches
    )
    assert sizes == [1, 1, 2]


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_rank_plan_is_a_valid_plan_above_the_bound(data):
    inst = data.draw(hs.instances(max_seqs=6))
    cost, batch = inst.cost, inst.batch
    res = rank_plan(batch, cost, time_limit_s=2.0)
    c = cost.cluster
    if c.speed_factors is None and c.memory_per_rank is None:
        assert res is not None  # every placement has the memory the relaxation assumed
    if res is not None:
        assert validate(res.plan, batch, cost) == []
        bound = rank_bound(batch, cost, time_limit_s=2.0).value_s
        assert res.predicted_step_time_s >= bound * (1 - REL)
