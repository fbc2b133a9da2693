"""validate() on plans no planner produces, on a multi-node cluster with mixed memory and
speed (issue 18): uncovered first / middle / last ranks, out-of-memory micro-batches on every
group (including groups whose memory differs from rank 0's), and every violation code.

Memory is checked against the toy arithmetic written out here (tests/toy.py docstring), not
against CostModel.memory: on 8 GPUs the model states take 1 * (2 + 4 + 12/8) = 7.5 bytes
(zero1), and T tokens at degree d with r recomputed layers need 7.5 + T/d * (30 - 8r) bytes
per member. A group's capacity is its smallest member's memory (usable fraction 1).
"""

from __future__ import annotations

import pytest

from dcp_opt import Batch, Group, MicroBatch, Plan, make_plan, validate
from dcp_opt.plan import Phase, Pipeline
from dcp_opt.validate import CODES, InvalidPlanError, ensure_valid
from tests.toy import toy_cost

# Two nodes of four; rank 0 is neither the smallest nor the largest memory, and inside the
# groups below the smallest member is not the first one.
MEMORY = (100.0, 60.0, 90.0, 70.0, 55.0, 50.0, 65.0, 75.0)
SPEED = (1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 0.8, 1.2)
LAYOUT = [(0, 1), (1, 1), (2, 2), (4, 4)]  # capacities 100, 60, 70, 50


def mixed_cost():
    return toy_cost(2, 4, 80.0, memory_per_rank=MEMORY, speed_factors=SPEED)


def need(tokens: int, degree: int, recompute: int = 0) -> float:
    return 7.5 + tokens / degree * (30 - 8 * recompute)


def capacity(start: int, degree: int) -> float:
    return min(MEMORY[start : start + degree])


def largest_fitting(start: int, degree: int, recompute: int = 0) -> int:
    t = 1
    while need(t + 1, degree, recompute) <= capacity(start, degree):
        t += 1
    return t


def codes(plan, batch, cost, **kw) -> list[str]:
    return sorted(v.code for v in validate(plan, batch, cost, **kw))


def test_the_toy_arithmetic_is_the_cost_models():
    # The arithmetic above is what the cost model computes (else the tests below test nothing).
    cost = mixed_cost()
    assert cost.fixed_bytes() == 7.5
    assert float(cost.memory(5, 2, 1)) == need(5, 2, 1)
    assert [cost.capacity(s, d) for s, d in LAYOUT] == [capacity(s, d) for s, d in LAYOUT]


def _fitting_plan(cost, oom_group: int | None = None, phase: int = 0, phases: int = 1):
    """One micro-batch per group sized to fit (the largest that does); in group `oom_group`
    of `phase`, a second micro-batch one token over its capacity."""
    lengths, groups, oom_id = [], [[] for _ in range(phases)], None
    for p in range(phases):
        for j, (s, d) in enumerate(LAYOUT):
            mbs = [MicroBatch((len(lengths),))]
            lengths.append(largest_fitting(s, d))
            if p == phase and j == oom_group:
                oom_id = len(lengths)
                mbs.append(MicroBatch((oom_id,)))
                lengths.append(largest_fitting(s, d) + 1)
            groups[p].append(Group(s, d, tuple(mbs)))
    batch = Batch.from_lengths(lengths)
    return make_plan(groups, batch, cost, planner="hand"), batch, oom_id


def test_plan_that_fits_every_group_of_a_mixed_cluster_is_valid():
    # Every group holds the most its own smallest member allows: rank 0 holds more than
    # rank 1 could; ranks 2..3 hold more than the 60 bytes a group at 0 of degree 2 has.
    cost = mixed_cost()
    plan, batch, _ = _fitting_plan(cost, phases=2)
    assert validate(plan, batch, cost) == []
    assert ensure_valid(plan, batch, cost) is plan


@pytest.mark.parametrize("phase", [0, 1])
@pytest.mark.parametrize("group", range(len(LAYOUT)))
def test_out_of_memory_on_every_group_of_a_mixed_cluster(group, phase):
    cost = mixed_cost()
    plan, batch, oom_id = _fitting_plan(cost, group, phase, phases=2)
    violations = validate(plan, batch, cost)
    assert [v.code for v in violations] == ["OUT_OF_MEMORY"], violations
    s, d = LAYOUT[group]
    assert f"phase {phase} group@{s}x{d} micro-batch 1: sequences [{oom_id}]" in str(violations[0])
    with pytest.raises(InvalidPlanError, match="OUT_OF_MEMORY"):
        ensure_valid(plan, batch, cost)


def test_memory_is_the_smallest_members_not_rank_0s_nor_the_first_members():
    cost = mixed_cost()
    # 3 tokens on rank 1 (60): 97.5 > 60 although rank 0 (100) would hold them.
    # 5 tokens on ranks 2..3 (90, 70) at degree 2: 82.5 > 70 although rank 2 holds 90.
    # 7 tokens on ranks 4..7 at degree 4 with everything recomputed: 7.5 + 7/4 * 14 = 32 fits.
    batch = Batch.from_lengths([3, 5, 7])
    plan = make_plan(
        [[Group(1, 1, (MicroBatch((0,)),)), Group(2, 2, (MicroBatch((1,)),)),
          Group(4, 4, (MicroBatch((2,), 2),))]],
        batch, cost, planner="hand",
    )  # fmt: skip
    bad = validate(plan, batch, cost)
    assert [v.code for v in bad] == ["OUT_OF_MEMORY"] * 2
    assert "group@1x1" in str(bad[0]) and "group@2x2" in str(bad[1])
    # Recompute lowers the need: the same 5 tokens at r=2 need 7.5 + 2.5 * 14 = 42.5 <= 70.
    # And 10 tokens on 4..7 with 2 recomputed: 7.5 + 10/4 * 14 = 42.5 <= 50.
    plan = make_plan(
        [[Group(2, 2, (MicroBatch((1,), 2),)), Group(4, 4, (MicroBatch((0, 2), 2),))]],
        batch, cost, planner="hand",
    )  # fmt: skip
    assert validate(plan, batch, cost) == []


@pytest.mark.parametrize("uncovered", [0, 3, 7], ids=["first", "middle", "last"])
@pytest.mark.parametrize("phase", [0, 1])
def test_an_uncovered_rank_is_reported(uncovered, phase):
    cost = mixed_cost()
    batch = Batch.from_lengths([1, 1])
    full = (Group(0, 4, (MicroBatch((0,)),)), Group(4, 4, (MicroBatch((1,)),)))
    holes = {
        0: (Group(1, 1), Group(2, 2, (MicroBatch((0,)),)), Group(4, 4, (MicroBatch((1,)),))),
        3: (Group(0, 2, (MicroBatch((0,)),)), Group(2, 1), Group(4, 4, (MicroBatch((1,)),))),
        7: (Group(0, 4, (MicroBatch((0,)),)), Group(4, 2, (MicroBatch((1,)),)), Group(6, 1)),
    }
    phases = [Phase(full), Phase(tuple(Group(g.start_rank, g.degree) for g in full))]
    phases[phase] = Phase(holes[uncovered])
    if phase == 1:  # the sequences run in phase 1; phase 0 is idle
        phases[0] = Phase(tuple(Group(g.start_rank, g.degree) for g in full))
    good = make_plan([full], batch, cost, planner="hand")
    plan = Plan(tuple(phases), 8, good.loss_normalizer, good.normalizer_kind, good.fingerprint)
    violations = validate(plan, batch, cost)
    assert [v.code for v in violations] == ["RANK_UNCOVERED"], violations
    assert f"phase {phase}: ranks [{uncovered}] in no group" in str(violations[0])


def _g(start, degree, *mbs):
    return Group(start, degree, tuple(MicroBatch(*m) for m in mbs))


# Each code on the mixed 2 x 4 cluster (degrees 1, 2, 4, 8), with the exact messages it
# brings ({fp}: the inputs' fingerprint). An aligned group of an allowed degree never
# straddles nodes here, so NODE_STRADDLE comes with MISALIGNED. 4 tokens at degree 2 with both
# layers recomputed need 35.5 bytes: they fit anywhere.
WHOLE = [[_g(0, 8, ((0, 1),))]]
CASES = {
    "NO_PHASES": (
        [], {},
        ["NO_PHASES: the plan has no phase", "MISSING_SEQUENCE: ids [0, 1] are never trained"],
    ),
    "WRONG_NUM_RANKS": (WHOLE, {"num_ranks": 4}, ["WRONG_NUM_RANKS: plan has 4 ranks, cluster 8"]),
    "WRONG_LAYOUT": (
        WHOLE, {"tensor_parallel": 2},
        ["WRONG_LAYOUT: plan.tensor_parallel is 2; the cost model's is 1"],
    ),
    "BAD_DEGREE": (
        [[_g(0, 3, ((0, 1),)), _g(3, 1), _g(4, 4)]], {},
        ["BAD_DEGREE: phase 0 group 0 (ranks 0..2): degree 3; allowed [1, 2, 4, 8]"],
    ),
    "BAD_KIND": (
        [[Group(0, 8, (MicroBatch((0, 1)),), "ring")]], {},
        ["BAD_KIND: phase 0 group 0 (ranks 0..7): kind 'ring'; allowed ['ulysses']"],
    ),
    "MISALIGNED": (
        [[_g(0, 1), _g(1, 2, ((0, 1), 2)), _g(3, 1), _g(4, 4)]], {},
        ["MISALIGNED: phase 0 group 1 (ranks 1..2): start 1 is not a multiple of degree 2"],
    ),
    "NODE_STRADDLE": (
        [[_g(0, 2), _g(2, 1), _g(3, 2, ((0, 1), 2)), _g(5, 1), _g(6, 2)]], {},
        ["MISALIGNED: phase 0 group 2 (ranks 3..4): start 3 is not a multiple of degree 2",
         "NODE_STRADDLE: phase 0 group 2 (ranks 3..4): spans two nodes"],
    ),
    "OUT_OF_RANGE": (
        [[_g(0, 4), _g(4, 8, ((0, 1),))]], {},
        ["OUT_OF_RANGE: phase 0 group 1 (ranks 4..11): cluster has ranks 0..7",
         "RANK_UNCOVERED: phase 0: ranks [4, 5, 6, 7] in no group"],
    ),
    "RANK_OVERLAP": (
        [[_g(0, 4, ((0,),)), _g(4, 4, ((1,),)), _g(7, 1)]], {},
        ["RANK_OVERLAP: phase 0 group 2 (ranks 7..7): rank 7 also in group 1"],
    ),
    "RANK_UNCOVERED": (
        [[_g(0, 4, ((0, 1),)), _g(4, 2)]], {},
        ["RANK_UNCOVERED: phase 0: ranks [6, 7] in no group"],
    ),
    "EMPTY_MICRO_BATCH": (
        [[_g(0, 8, ((0, 1),), ((),))]], {},
        ["EMPTY_MICRO_BATCH: phase 0 group@0x8 micro-batch 1: no sequence"],
    ),
    "UNKNOWN_SEQUENCE": (
        [[_g(0, 8, ((0, 1, 9),))]], {}, ["UNKNOWN_SEQUENCE: ids [9] not in the batch"],
    ),
    "DUPLICATE_SEQUENCE": (
        [[_g(0, 4, ((0, 1),)), _g(4, 4, ((1,),))]], {},
        ["DUPLICATE_SEQUENCE: ids [1] appear more than once"],
    ),
    "MISSING_SEQUENCE": ([[_g(0, 8, ((0,),))]], {}, ["MISSING_SEQUENCE: ids [1] are never trained"]),
    "BAD_RECOMPUTE": (  # in two groups: each group's are reported
        [[_g(0, 4, ((0,), 3)), _g(4, 4, ((1,), -1))]], {},
        ["BAD_RECOMPUTE: phase 0 group@0x4 micro-batch 0: 3 not in [0, 2]",
         "BAD_RECOMPUTE: phase 0 group@4x4 micro-batch 0: -1 not in [0, 2]"],
    ),
    # rank 5 has 50 bytes: 2 tokens at degree 1 need 67.5 there (rank 0 would hold them)
    "OUT_OF_MEMORY": (
        [[_g(0, 4, ((0,),)), _g(4, 1), _g(5, 1, ((1,),)), _g(6, 2)]], {},
        ["OUT_OF_MEMORY: phase 0 group@5x1 micro-batch 0: sequences [1] need 68 B per GPU, "
         "capacity 50 B"],
    ),
    "FINGERPRINT_MISMATCH": (
        WHOLE, {"fingerprint": "x"}, ["FINGERPRINT_MISMATCH: plan 'x', inputs {fp}"],
    ),
    "BAD_NORMALIZER": (
        WHOLE, {"loss_normalizer": 3.0},
        ["BAD_NORMALIZER: tokens normaliser 3.0 does not match the batch"],
    ),
    "BAD_PIPELINE": (  # a pipeline whose stages do not hold the model's 2 layers
        WHOLE, {"pipeline": Pipeline((3,))},
        ["BAD_PIPELINE: pipeline.stage_layers: must sum to the model's 2 layers, got [3]"],
    ),
}  # fmt: skip


def test_the_cases_cover_every_code():
    assert set(CASES) == set(CODES)


def _plan(phases, batch, cost, **changes) -> Plan:
    good = make_plan(WHOLE, batch, cost, planner="hand")
    fields = {
        "phases": tuple(Phase(tuple(gs)) for gs in phases),
        "num_ranks": 8,
        "loss_normalizer": good.loss_normalizer,
        "normalizer_kind": good.normalizer_kind,
        "fingerprint": good.fingerprint,
    } | changes
    return Plan(**fields)


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_violation_code_on_a_multi_node_mixed_cluster(code):
    cost = mixed_cost()
    batch = Batch.from_lengths([2, 2])
    phases, changes, want = CASES[code]
    good = make_plan(WHOLE, batch, cost, planner="hand")
    assert validate(good, batch, cost) == []
    plan = _plan(phases, batch, cost, **changes)
    violations = validate(plan, batch, cost)
    want = [w.replace("{fp}", repr(good.fingerprint)) for w in want]
    assert sorted(str(v) for v in violations) == sorted(want)
    with pytest.raises(InvalidPlanError, match=code) as e:
        ensure_valid(plan, batch, cost)
    assert e.value.violations == violations
    if code in ("FINGERPRINT_MISMATCH", "BAD_NORMALIZER"):
        assert validate(plan, batch, cost, check_fingerprint=False) == []
        assert ensure_valid(plan, batch, cost, check_fingerprint=False) is plan


def test_invalid_plan_error_names_three_violations_and_counts_the_rest():
    cost, batch = mixed_cost(), Batch.from_lengths([2, 2])
    three = validate(_plan([[_g(0, 8, ((0,), 3), ((1,), 4), ((), 0))]], batch, cost), batch, cost)
    assert len(three) == 3
    assert str(InvalidPlanError(three)) == "plan: 3 violation(s): " + "; ".join(map(str, three))
    four = three + validate(_plan([], batch, cost), batch, cost)[:1]
    assert str(InvalidPlanError(four)).endswith(str(three[2]) + " (+1 more)")
    five = three + validate(_plan([], batch, cost), batch, cost)
    assert len(five) == 5
    assert str(InvalidPlanError(five)) == (
        "plan: 5 violation(s): " + "; ".join(map(str, five[:3])) + " (+2 more)"
    )


def test_groups_after_an_out_of_range_group_are_still_checked():
    cost, batch = mixed_cost(), Batch.from_lengths([2, 2])
    # The out-of-range groups come first; the groups after them still count as covering.
    plan = _plan([[_g(-2, 2), _g(6, 4), _g(0, 4, ((0, 1),)), _g(4, 2)]], batch, cost)
    assert [str(v) for v in validate(plan, batch, cost)] == [
        "OUT_OF_RANGE: phase 0 group 0 (ranks -2..-1): cluster has ranks 0..7",
        "OUT_OF_RANGE: phase 0 group 1 (ranks 6..9): cluster has ranks 0..7",
        "RANK_UNCOVERED: phase 0: ranks [6, 7] in no group",
    ]


@pytest.mark.parametrize("start, degree", [(-2, 2), (6, 4), (0, 0)])
def test_an_out_of_range_group_gets_no_memory_check(start, degree):
    # 100 tokens would overflow any GPU here; out of range, the group has no members whose
    # memory could be read, so only its range is reported.
    cost, batch = mixed_cost(), Batch.from_lengths([100, 2])
    groups = [_g(start, degree, ((0,),)), _g(0, 4, ((1,),)), _g(4, 2)]
    codes = {v.code for v in validate(_plan([groups], batch, cost), batch, cost)}
    assert "OUT_OF_MEMORY" not in codes and "OUT_OF_RANGE" in codes


def test_unknown_ids_in_place_of_known_ones_are_reported():
    cost, batch = mixed_cost(), Batch.from_lengths([2, 2])
    plan = _plan([[_g(0, 8, ((0, 9),))]], batch, cost)  # as many ids as the batch has
    assert sorted(str(v) for v in validate(plan, batch, cost)) == [
        "MISSING_SEQUENCE: ids [1] are never trained",
        "UNKNOWN_SEQUENCE: ids [9] not in the batch",
    ]


def test_memory_of_a_micro_batch_with_an_unknown_id_counts_its_known_sequences():
    # Rank 0 (100 bytes) holds 3 tokens (97.5): an unknown id adds nothing; 4 tokens (127.5)
    # overflow whatever unknown id rides along.
    cost, batch = mixed_cost(), Batch.from_lengths([3, 4])
    plan = _plan([[_g(0, 1, ((0, 9),)), _g(1, 1), _g(2, 2), _g(4, 4, ((1, 8),))]], batch, cost)
    assert [v.code for v in validate(plan, batch, cost)] == ["UNKNOWN_SEQUENCE"]
    plan = _plan([[_g(0, 1, ((1, 9),)), _g(1, 1), _g(2, 2), _g(4, 4, ((0,),))]], batch, cost)
    assert sorted(v.code for v in validate(plan, batch, cost)) == [
        "OUT_OF_MEMORY",
        "UNKNOWN_SEQUENCE",
    ]


def test_a_micro_batch_needing_exactly_the_capacity_fits():
    # 2 tokens at degree 1 need 9 + 2 * 30 = 69 bytes on 4 GPUs (states 2 + 4 + 12/4).
    batch = Batch.from_lengths([2])
    for memory, want in ((69.0, []), (68.9, ["OUT_OF_MEMORY"])):
        cost = toy_cost(1, 4, memory)
        plan = make_plan([[Group(0, 1, (MicroBatch((0,)),))]], batch, cost, planner="hand")
        assert [v.code for v in validate(plan, batch, cost)] == want, memory


@pytest.mark.parametrize("count, shown", [(8, "[1, 2, 3, 4, 5, 6, 7, 8]"),
                                          (9, "[1, 2, 3, 4, 5, 6, 7, 8, ...]")])  # fmt: skip
def test_long_id_lists_are_cut_after_eight(count, shown):
    cost, batch = mixed_cost(), Batch.from_lengths([1] * (count + 1))
    plan = _plan([[_g(0, 8, ((0,),))]], batch, cost)
    assert [str(v) for v in validate(plan, batch, cost)] == [
        f"MISSING_SEQUENCE: ids {shown} are never trained"
    ]
