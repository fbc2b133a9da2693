"""The certified lower bound (dcp_opt/bounds.py) against exhaustive optima on tiny clusters
with per-GPU speed factors and mixed memory (issue 18): never above a valid plan, and equal
to the optimum on instances where the optimum is known by hand.

Toy arithmetic (tests/toy.py): T tokens at degree d on a group of speed s (its slowest
member) take (6T/d + 0.5 + rT/d) / s seconds, no communication, no gradient sync unless
set; memory per member 9 + T/d * (30 - 8r) bytes on 4 GPUs (7.5 + ... on 8).
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dcp_opt import Batch, lower_bound, simulate, validate
from tests import strategies as hs
from tests.brute_force import brute_force
from tests.toy import toy_cost

REL = 1e-12

# (cluster keywords, lengths, optimum by hand, which term of the bound is tight)
TIGHT = {
    # 10 tokens alone on the speed-2 rank 0: (60 + 0.5) / 2 = 30.25 (needs 309 bytes: rank 0
    # has 400); 3 + 3 tokens on ranks 1, 2: 18.5 s each. No SP (degrees 1). The bound's
    # critical path: t(1) / max speed = 60.5 / 2.
    "speed-critical-path": (
        {"speed_factors": (2.0, 1.0, 1.0, 0.5), "memory_per_rank": (400, 100, 100, 100),
         "degrees": (1,)},
        [10, 3, 3],
        30.25,
        "longest",
    ),
    # SP on the fast pair: 10 tokens at degree 2 on ranks 0..1 (speed 2): (30 + 0.5) / 2 =
    # 15.25, 159 bytes per member (memory 160, 170); 2 tokens on each slow rank: 12.5 s,
    # 69 bytes (memory 70, 80).
    "speed-sp-critical-path": (
        {"speed_factors": (2.0, 2.0, 1.0, 1.0), "memory_per_rank": (160, 170, 70, 80),
         "degrees": (1, 2)},
        [10, 2, 2],
        15.25,
        "longest",
    ),
    # Two nodes of two, the fast node first: 8 tokens at degree 2 on ranks 0..1 (speed 1.5):
    # (24 + 0.5) / 1.5 = 16.333..; 3 tokens on rank 2 (speed 1): 18.5 > 16.33, so rank 2 and
    # 3 get 2 tokens each: 12.5 s. Memory: 9 + 4 * 30 = 129 (ranks 0..1 have 130, 200).
    "two-nodes-sp": (
        {"num_nodes": 2, "gpus_per_node": 2, "speed_factors": (1.5, 1.5, 1.0, 1.0),
         "memory_per_rank": (130, 200, 80, 75), "degrees": (1, 2)},
        [8, 2, 2],
        24.5 / 1.5,
        "longest",
    ),
    # Work: four equal sequences, one per rank, mixed memory, speeds <= 1 count as 1 in the
    # bound's weights, so with every speed 1: 4 * 6 * 3 / 4 + 0.5 = 18.5 = one rank's time.
    "work-mixed-memory": (
        {"memory_per_rank": (100, 99, 120, 150)},
        [3, 3, 3, 3],
        18.5,
        "work",
    ),
}  # fmt: skip


def tight_case(name: str):
    kw, lengths, optimum, term = TIGHT[name]
    cluster_kw = {k: v for k, v in kw.items() if k not in ("num_nodes", "gpus_per_node")}
    cost = toy_cost(kw.get("num_nodes", 1), kw.get("gpus_per_node", 4), 100.0, **cluster_kw)
    return cost, Batch.from_lengths(lengths), optimum, term


@pytest.mark.parametrize("name", sorted(TIGHT))
def test_bound_is_tight_where_the_optimum_is_known(name):
    cost, batch, optimum, term = tight_case(name)
    t, plan = brute_force(batch, cost)
    assert validate(plan, batch, cost) == []
    assert simulate(plan, batch, cost).step_time_s == pytest.approx(t, rel=REL)
    assert t == pytest.approx(optimum, rel=REL)  # the exhaustive optimum is the hand one
    bound = lower_bound(batch, cost)
    assert bound.value_s == pytest.approx(optimum, rel=REL)
    tight = bound.longest_s if term == "longest" else bound.work_s
    assert tight == pytest.approx(optimum, rel=REL)
    assert max(bound.work_s, bound.longest_s) == bound.value_s


def test_bound_terms_by_hand_with_speed_factors():
    # speed-critical-path: work = (60 + 18 + 18) / (2 + 1 + 1 + 1) + 0.5 / 2 = 19.45 (the
    # 0.5-speed rank weighs 1); longest = 60.5 / 2.
    cost, batch, _, _ = tight_case("speed-critical-path")
    bound = lower_bound(batch, cost)
    assert bound.work_s == pytest.approx(19.45, rel=REL)
    assert bound.longest_s == pytest.approx(30.25, rel=REL)
    assert bound.grad_sync_s == 0.0 and bound.source == "analytic"


def test_bound_adds_the_gradient_sync_to_each_term():
    cost, batch, optimum, _ = tight_case("speed-sp-critical-path")
    synced = cost.with_(grad_reduce_bytes_per_param=4.0)
    sync = synced.grad_sync_time()
    assert sync > 0
    bound, plain = lower_bound(batch, synced), lower_bound(batch, cost)
    assert bound.grad_sync_s == sync
    assert bound.value_s == pytest.approx(optimum + sync, rel=REL)
    assert bound.work_s == pytest.approx(plain.work_s + sync, rel=REL)
    assert bound.longest_s == pytest.approx(plain.longest_s + sync, rel=REL)
    assert brute_force(batch, synced)[0] == pytest.approx(optimum + sync, rel=REL)


def test_bound_is_per_batch_not_cached_across_batches():
    cost, batch, optimum, _ = tight_case("speed-critical-path")
    assert lower_bound(batch, cost).value_s == pytest.approx(optimum, rel=REL)
    shorter = Batch.from_lengths([8, 3, 3])  # 48.5 / 2
    assert lower_bound(shorter, cost).value_s == pytest.approx(24.25, rel=REL)
    assert lower_bound(batch, cost) is lower_bound(batch, cost)  # cached per batch


def test_bound_refuses_a_batch_that_fits_nowhere():
    cost, _, _, _ = tight_case("speed-critical-path")
    with pytest.raises(Exception, match="capacity"):
        lower_bound(Batch.from_lengths([1000]), cost)


# ---- random tiny mixed clusters: the bound is never above the exhaustive optimum ---------
@st.composite
def mixed_tiny(draw):
    nodes, per = draw(st.sampled_from([(1, 2), (1, 3), (1, 4), (2, 2), (2, 1)]))
    n = nodes * per
    speeds = tuple(draw(st.sampled_from([0.5, 0.8, 1.0, 1.5, 2.0, 3.0])) for _ in range(n))
    if draw(st.booleans()):  # flops cost model with communication, or the toy one
        base = draw(hs.flops_costs(mixed=False))
        cluster = base.cluster.with_(num_nodes=nodes, gpus_per_node=per, degrees=None)
        cost = hs.with_headroom(base.with_(cluster=cluster))
        mem = cost.cluster.memory_bytes
    else:
        cost, mem = toy_cost(nodes, per, 400.0), 400.0
    batch = draw(hs.batches_for(cost, max_seqs=4, tiny_ok=False))  # each fits one GPU
    mems = tuple(draw(st.sampled_from([0.5, 0.75, 1.0])) * mem for _ in range(n))
    mems = (mem, *mems[1:])  # rank 0 keeps the memory every sequence fits in
    cost = cost.with_(cluster=cost.cluster.with_(speed_factors=speeds, memory_per_rank=mems))
    # Some single-phase plan exists: every sequence fits the whole cluster as one group.
    tokens = [s.num_tokens for s in batch.sequences]
    assume(all(cost.min_recompute(tokens, n, cost.capacity(0, n)) >= 0))
    return cost, batch


@settings(max_examples=max(10, settings.default.max_examples))
@given(mixed_tiny())
def test_bound_is_never_above_the_optimum_on_mixed_clusters(case):
    cost, batch = case
    t, plan = brute_force(batch, cost)
    assert validate(plan, batch, cost) == []
    assert simulate(plan, batch, cost).step_time_s == pytest.approx(t, rel=1e-9)
    assert lower_bound(batch, cost).value_s <= t * (1 + 1e-9)
