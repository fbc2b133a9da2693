"""The rank relaxation solved by recursion over the buddy tree (solvers/bounds/tree.py): the
same optimum as HiGHS on the same program with every class integer, an assignment that
reaches its value, a bound below every valid plan and the exhaustive optimum, and a hand
example.

Toy arithmetic (tests/toy.py): T tokens at degree 1 take 6T + 0.5 seconds (0.5 the
micro-batch constant), memory 9 + 30T bytes at no recompute.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from dcp_opt.solvers.bounds import tree as tree_bound
from dcp_opt.solvers.bounds.data import bound_data
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.bounds.rank import rank_bound, rank_milp, tree_solution
from dcp_opt.solvers.bounds.rank_plan import rank_plan
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dcp_opt import Batch, simulate, validate
from tests import strategies as hs
from tests.brute_force import brute_force
from tests.toy import toy_cost

REL = 1e-9


def test_granularity_by_hand():
    # 4 GPUs at degree 1, 400 bytes: four 4s and a 3 take 24.5 and 18.5 s alone. Some rank
    # holds two of them, at best a 4 and the 3 packed (7 tokens: 219 bytes fit), 6 * 7 +
    # 0.5 = 42.5; the work bound is (4 * 24 + 18) / 4 + 0.5 = 29.
    cost = toy_cost(1, 4, 400.0, degrees=(1,))
    batch = Batch.from_lengths([4, 4, 4, 4, 3])
    assert tree_bound.applicable(cost)
    sol, cls = tree_solution(batch, cost)
    assert sol.finish_s == pytest.approx(42.5, rel=REL)
    assert len(cls) == 2 and len(sol.groups) == 4
    rb = rank_bound(batch, cost)
    assert rb.source == "rank-tree" and rb.value_s == pytest.approx(42.5, rel=1e-8)
    t, _ = brute_force(batch, cost)
    assert t == pytest.approx(42.5, rel=REL) and rb.value_s <= t
    assert lp_bound(batch, cost).value_s < 42.5 - 1


def test_not_applicable_where_placements_are_not_the_buddy_blocks():
    assert not tree_bound.applicable(toy_cost(1, 3, 400.0, degrees=(1,)))  # 3 ranks
    mixed = toy_cost(1, 4, 400.0, speed_factors=(1.0, 1.0, 2.0, 1.0))
    assert not tree_bound.applicable(mixed)
    assert tree_bound.applicable(toy_cost(1, 4, 400.0))


def _path_loads(batch, cost, groups) -> np.ndarray:
    """Each rank's load in the relaxation, summed from an assignment's groups."""
    dat = bound_data(batch, cost)
    load = np.zeros(cost.cluster.num_gpus)
    for start, d, idx in groups:
        j = int(np.flatnonzero(dat.deg == d)[0])
        idx = list(idx)
        share = np.maximum(dat.work[idx, j] / d - dat.marg[idx, j], 0.0).sum()
        load[start : start + d] += dat.marg[idx, j].sum() + max(dat.const[j], share)
    return load


def _applicable_instance(data, max_seqs: int = 7):
    inst = data.draw(hs.instances(max_gpus=16, max_seqs=max_seqs, mixed=False))
    assume(tree_bound.applicable(inst.cost))
    return inst


@settings(max_examples=max(10, settings.default.max_examples // 2), deadline=None)
@given(data=st.data())
def test_the_recursion_equals_highs_on_the_same_program(data):
    inst = _applicable_instance(data)
    tree = tree_solution(inst.batch, inst.cost)
    assume(tree is not None)
    sol, _ = tree
    res, *_ = rank_milp(inst.batch, inst.cost, 1.0, 10.0, integer_share=0.0)
    assume(res.status == 0)  # proven optimal within the limit
    assert sol.finish_s == pytest.approx(res.fun, rel=1e-6, abs=1e-9)
    # the assignment covers every sequence once and reaches the value
    placed = sorted(i for _, _, idx in sol.groups for i in idx)
    assert placed == list(range(len(inst.batch)))
    assert _path_loads(inst.batch, inst.cost, sol.groups).max() == pytest.approx(
        sol.finish_s, rel=1e-9, abs=1e-12
    )


@settings(max_examples=max(10, settings.default.max_examples // 2), deadline=None)
@given(data=st.data(), dense=st.booleans())
def test_the_tree_bound_is_below_any_valid_plan(data, dense):
    inst = _applicable_instance(data, max_seqs=12)
    plan = data.draw(hs.valid_plans(inst, dense=dense, cp=True))
    sim = simulate(plan, inst.batch, inst.cost)
    rb = rank_bound(inst.batch, inst.cost, time_limit_s=0.3)
    assert sim.step_time_s >= rb.value_s * (1 - REL), (sim.step_time_s, rb)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_the_tree_plan_is_valid_and_above_the_bound(data):
    inst = _applicable_instance(data, max_seqs=8)
    res = rank_plan(inst.batch, inst.cost, time_limit_s=2.0)
    if res is not None:
        assert validate(res.plan, inst.batch, inst.cost) == []
        bound = rank_bound(inst.batch, inst.cost).value_s
        assert res.predicted_step_time_s >= bound * (1 - REL)


@settings(max_examples=max(10, settings.default.max_examples // 2), deadline=None)
@given(data=st.data())
def test_the_tree_bound_is_below_the_exhaustive_optimum(data):
    n = data.draw(st.sampled_from([2, 4]))
    cost = toy_cost(1, n, 400.0)
    batch = data.draw(hs.batches_for(cost, max_seqs=4, tiny_ok=False))
    t, plan = brute_force(batch, cost)
    assert validate(plan, batch, cost) == []
    assert rank_bound(batch, cost).value_s <= t * (1 + REL)


def test_many_distinct_sequences_fall_back_without_building_the_tables():
    # 64 distinct lengths: 3^64 pairs a level, far above MAX_PAIRS (a count that overflows
    # 64-bit integers, so the guard must use exact ones)
    cost = toy_cost(1, 4, 1e6)
    batch = Batch.from_lengths(list(range(1, 65)))
    assert tree_solution(batch, cost) is None
    assert rank_bound(batch, cost, time_limit_s=0.2).source == "rank-milp"


def _long_step():
    """2d-long's first kind of 2M-token step (h200x32, opensora-stdit3-xl): five videos of
    432,000 tokens and three short ones."""
    from dcp_opt import CostModel, Sequence
    from dcp_opt.inputs import load_cluster
    from dcp_opt.model import model_preset

    cost = CostModel(model_preset("opensora-stdit3-xl"), load_cluster("h200x32"))
    shapes = [(120, 45, 80)] * 5 + [(60, 30, 54), (15, 23, 40), (1, 15, 27)]
    return Batch(tuple(Sequence(i, s) for i, s in enumerate(shapes))), cost


def test_tree_candidate_replaces_a_slower_plan_and_keeps_a_close_one():
    from dcp_opt.solvers import run_planner
    from dcp_opt.solvers.bounds.rank_plan import CANDIDATE_MIN_GAP, tree_candidate

    batch, cost = _long_step()
    slow = run_planner("bucket", batch, cost)
    best = rank_plan(batch, cost)
    assert best.predicted_step_time_s < slow.predicted_step_time_s
    got = tree_candidate(slow, batch, cost, 0.0)
    assert validate(got.plan, batch, cost) == []
    assert got.predicted_step_time_s == best.predicted_step_time_s
    assert got.planner == slow.planner and got.stats["candidate"] == ["rank-tree"]
    # the tree plan itself is tried and kept; the try counts in its wall time
    t0 = time.perf_counter()
    again = tree_candidate(got, batch, cost, t0)
    assert again.plan is got.plan and 0 <= again.wall_time_s <= time.perf_counter() - t0
    # a plan within CANDIDATE_MIN_GAP of its bound is kept as it is
    close = type(slow)(**{**slow.__dict__, "lower_bound_s": slow.predicted_step_time_s})
    assert tree_candidate(close, batch, cost, 0.0) is close
    assert CANDIDATE_MIN_GAP < 0.05


def test_the_planners_are_never_slower_than_the_tree_plan():
    from dcp_opt.solvers import run_planner

    batch, cost = _long_step()
    best = rank_plan(batch, cost).predicted_step_time_s
    res = run_planner("cpsat", batch, cost, time_limit_s=0.1)
    assert res.predicted_step_time_s <= best
    assert run_planner("greedy", batch, cost).predicted_step_time_s <= best
    # cpsat reports the exact relaxation as its bound: tighter than the LP here
    tree = rank_bound(batch, cost).value_s
    assert res.stats["rank_bound_s"] == pytest.approx(tree, rel=1e-12)
    assert res.lower_bound_s == res.stats["rank_bound_s"] > res.stats["lp_bound_s"] * 1.05


def test_the_stream_bound_of_fixed_steps_takes_the_tree_term():
    from dcp_opt.solvers.bounds.stream import stream_lower_bound

    batch, cost = _long_step()
    tree = rank_bound(batch, cost).value_s
    assert tree > lp_bound(batch, cost).value_s * 1.05  # granularity the LP does not see
    assert stream_lower_bound([batch, batch], cost) == pytest.approx(2 * tree, rel=1e-12)
    # max_shift > 0: any reassignment, per-sequence terms only (no tree term)
    assert stream_lower_bound([batch, batch], cost, max_shift=1) < 2 * tree


def _cp_toy():
    """4 GPUs at degree 4, 2 layers, 1000 activation bytes a token a layer and free
    checkpoints; cp gathers 16 more a token from each of the 3 others (dcp_opt/cost/cp.py), so 400
    tokens fit Ulysses at r = 0 but cp only at r = 1, and 800 fit cp at r = 2. One layer's
    forward of 400 tokens is u = 1/3 s under cp (2 heads: a quarter of the attention each)
    and 2u under Ulysses (half); the empty micro-batch is 1 s, nothing else costs."""
    from dataclasses import replace

    from dcp_opt.cost import BlockCoeffs, TermCoeffs

    q = 1.0 / 120000  # u = q * 400^2 / 4
    toy = toy_cost(1, 4, 300010.0, degrees=(4,))  # the toy model: 2 layers, 1 parameter
    coeffs = replace(
        toy.coeffs,
        blocks={"layer": BlockCoeffs(TermCoeffs(quad=q), TermCoeffs(quad=2 * q))},
        microbatch_overhead_s=1.0,
        act_bytes_per_token_layer=1000.0,
        ckpt_bytes_per_token_layer=0.0,
        source="cp-toy",
    )
    cluster = toy.cluster.with_(intra_node_bw=1e18, inter_node_bw=1e18)  # cp's gather free
    return toy.with_(cluster=cluster, coeffs=coeffs, sp_kinds=("ulysses", "cp"))


def test_a_packed_cp_plan_is_above_the_bound():
    # Both sequences packed in one cp micro-batch at r = 2: 1 + 2 * (7u + u) = 19/3 s (each
    # pays its marginal 7u at its own cp r_min 1, and one more layer). Counting a member's
    # extra layers from Ulysses' r_min 0 gave each a share of min_r (3 - r) / 3 + r u = 1 s,
    # so a bound of 2 * 7u + 2 = 20/3 s, above this plan.
    from dcp_opt.solvers.common import finish

    from dcp_opt.plan import Group, MicroBatch

    cost = _cp_toy()
    batch = Batch.from_lengths([400, 400])
    group = Group(0, 4, (MicroBatch((0, 1), 2),), kind="cp")
    res = finish([[group]], batch, cost, planner="hand", started=0.0)
    assert res.predicted_step_time_s == pytest.approx(19 / 3, rel=1e-12)
    assert tree_bound.applicable(cost)
    assert rank_bound(batch, cost).value_s <= res.predicted_step_time_s
    assert lp_bound(batch, cost).value_s <= res.predicted_step_time_s


def test_pairs_count_the_sub_multiset_pairs_and_gate_the_recursion():
    # class sizes 0, 1, 2: pairs (a, b) with a + b <= c are 1, 3 and 6 of them
    brute = 1
    for c in (0, 1, 2):
        brute *= sum(1 for a in range(c + 1) for b in range(c + 1) if a + b <= c)
    assert tree_bound.pairs([0, 1, 2]) == brute == 18
    cost = toy_cost(1, 4, 400.0, degrees=(1,))
    batch = Batch.from_lengths([4, 4, 3])  # classes of 2 and 1: 6 * 3 = 18 pairs
    dat = bound_data(batch, cost)
    cls = [[0, 1], [2]]
    assert tree_bound.solve(dat, cls, 4, max_pairs=18) is not None
    assert tree_bound.solve(dat, cls, 4, max_pairs=17) is None


def test_one_gpu_is_a_tree_of_one_leaf():
    cost = toy_cost(1, 1, 400.0)
    assert tree_bound.applicable(cost)
    sol, _ = tree_solution(Batch.from_lengths([4, 3]), cost)
    assert sol.finish_s == pytest.approx(6 * 7 + 0.5, rel=REL)  # both packed on the one GPU


def test_every_state_reads_back_a_pair_of_its_own():
    cost = toy_cost(1, 4, 400.0)
    batch = Batch.from_lengths([4, 4, 4, 3, 3, 2])
    dat = bound_data(batch, cost)
    from dcp_opt.solvers.bounds.rank import _classes

    cls = _classes(dat)
    tree = tree_bound._Tree(dat, cls, np.array([len(m) for m in cls]), 4)
    for s in range(len(tree.vec)):  # the pair preferred is the largest A: any range error
        a, b = tree._arg(s, lambda ia, ib: -ia.astype(float))  # would pick another state's
        assert a + b == s and (tree.vec[a] + tree.vec[b] == tree.vec[s]).all()


def test_a_sequence_that_needs_sp_is_bounded_like_highs():
    # 45 bytes: 9 + T (30 - 8 r) per member fits T = 1 at degree 1 (39 bytes); T = 3 not even
    # at r = 2 there (51), only from degree 2 (1.5 tokens a member at r = 1: 42), so the 3's
    # class has no degree-1 entry (inf), which every state without it must not see
    cost = toy_cost(1, 4, 45.0)
    batch = Batch.from_lengths([3, 1, 1, 1])
    assert not np.isfinite(bound_data(batch, cost).marg[0, 0])  # the 3 at degree 1
    sol, _ = tree_solution(batch, cost)
    res, *_ = rank_milp(batch, cost, 1.0, 10.0, integer_share=0.0)
    assert res.status == 0 and np.isfinite(sol.finish_s)
    assert sol.finish_s == pytest.approx(res.fun, rel=1e-6)
    t, _ = brute_force(batch, cost)
    assert rank_bound(batch, cost).value_s <= t * (1 + REL)
