"""Greedy's overflow-first candidate (issue 13): packed phase-0 micro-batches, the split's
own phase-1 assignment, and a split with every sequence first given as one phase.

The first batch is step 1 of the stream benchmark's 2d-long epoch at 2M-token steps (h200x32,
opensora-stdit3-xl): five 432,000-token videos and three small sequences. Four videos at
degree 8 fill the cluster; the fifth runs first, and at degree 32 the small ones share its
micro-batch (no recompute there), paying the per-micro-batch constant once. Before the
phase-0 micro-batches were packed, each small sequence paid that constant in phase 0, so
greedy kept the fifth video alone at degree 16 (1.649 s against 1.569 s when written)."""

from __future__ import annotations

import numpy as np
import pytest
from dcp_opt.solvers.common import finish
from dcp_opt.solvers.greedy import level as greedy_level
from dcp_opt.solvers.greedy.assign import rule_draft, to_phases, uniform_draft
from dcp_opt.solvers.greedy.instance import Draft, make_instance
from dcp_opt.solvers.greedy.local import improve
from dcp_opt.solvers.greedy.plan import plan_greedy

from dcp_opt import Batch, CostModel, Sequence, cluster_preset, model_preset, validate
from dcp_opt.perturb import perturbed_cost_models
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.workloads import Workload

BIG = (120, 45, 80)  # 432,000 tokens
SHAPES = [BIG, BIG, (1, 15, 27), BIG, (15, 23, 40), BIG, (60, 30, 54), BIG]


@pytest.fixture(scope="module")
def case():
    batch = Batch(tuple(Sequence(i, s) for i, s in enumerate(SHAPES)))
    return batch, CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32"))


def _time(phases, batch, cost) -> float:
    return finish(phases, batch, cost, planner="rule", started=0.0).predicted_step_time_s


def _unpacked(phases) -> list[list[Group]]:
    """The same plan with every micro-batch split into one per sequence."""
    return [
        [
            Group(
                g.start_rank,
                g.degree,
                tuple(
                    MicroBatch((i,), mb.recompute_layers)
                    for mb in g.micro_batches
                    for i in mb.sequence_ids
                ),
            )  # fmt: skip
            for g in phase.groups
        ]
        for phase in phases
    ]


def _plan_kept_before(batch, cost) -> list[list[Group]]:
    """What greedy planned before: the fifth video alone at degree 16 on ranks 0-15, then the
    four others at degree 8, the small ones after them (recompute as the table needs)."""
    inst = make_instance(batch, cost)
    r = {int(d): inst.r_min[:, k].tolist() for k, d in enumerate(inst.degrees)}
    big = [i for i, s in enumerate(SHAPES) if s == BIG]
    small = [i for i, s in enumerate(SHAPES) if s != BIG]

    def mb(ids, d):
        return MicroBatch(tuple(ids), max(r[d][i] for i in ids))

    rest = [[mb([i], 8)] for i in big[:4]]
    rest[2].append(mb(small[2:], 8))
    rest[3].append(mb(small[:2], 8))
    return [
        [Group(0, 16, (mb([big[4]], 16),))],
        [Group(8 * k, 8, tuple(m)) for k, m in enumerate(rest)],
    ]


def test_phase0_packs_small_sequences_with_a_big_video(case):
    batch, cost = case
    res = plan_greedy(batch, cost)
    assert validate(res.plan, batch, cost) == []
    assert len(res.plan.phases) == 2
    first = [mb for g in res.plan.phases[0].groups for mb in g.micro_batches]
    assert any(len(mb.sequence_ids) > 1 for mb in first)
    # the packing is what gains: the same plan unpacked, and the plan kept before, are slower
    t = res.predicted_step_time_s
    assert t < _time(_unpacked(res.plan.phases), batch, cost) - 1e-6
    assert t < _time(_plan_kept_before(batch, cost), batch, cost) - 1e-6


def test_level_drafts_price_packed_phase0_exactly(case):
    """Each overflow-first / long-then draft's finish plus the gradient sync is the
    simulated step time of its plan (the draft ranks the candidates), the split's own
    drafts (phase 1 as the split assigned it) included."""
    batch, cost = case
    inst = make_instance(batch, cost)
    packed = 0
    hows = []
    for how, build in greedy_level.specs(inst, cost.cluster, np.inf):
        spec = build()
        hows.append(how)
        draft = spec if isinstance(spec, Draft) else rule_draft(inst, cost.cluster, spec)
        phases = to_phases(draft, inst, cost)
        packed += any(len(idx) > 1 for _, _, bins in draft.phase0 for idx, _ in bins)
        assert draft.finish_s + inst.sync == pytest.approx(_time(phases, batch, cost), rel=1e-9)
    assert packed
    assert any(how[-1] == "split" for how in hows)  # the split's own drafts are among them


MID, HALF = (120, 30, 54), (60, 45, 80)  # 194,400 and 216,000 tokens


def test_split_keeps_its_own_phase1_assignment():
    """Step 180 of the same epoch: three 432,000-token videos, one of 216,000 and three of
    194,400 tokens. Four degree-8 groups: a video alone on each of three, the 216,000 and
    two 194,400 on the fourth; the last 194,400 first at degree 16 on the ranks of two
    video groups. The overflow-first split assigns phase 1 so; re-assigned longest first
    (assign.rule_draft) a video lands after the phase-0 sequence and the split's finish is
    lost (greedy kept two degree-16 groups: 1.423 s against 1.350 s when written)."""
    shapes = [BIG, MID, BIG, BIG, HALF, MID, MID]
    batch = Batch(tuple(Sequence(i, s) for i, s in enumerate(shapes)))
    cost = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32"))
    inst = make_instance(batch, cost)
    r8 = inst.r_min[:, list(inst.degrees).index(8)].tolist()

    def alone(i, d=8):
        return (MicroBatch((i,), int(r8[i]) if d == 8 else 0),)

    # every 194,400- and 216,000-token sequence needs no recompute at 8 (r8 == 0), and
    # two of them do not fit one micro-batch there: each runs alone
    assert all(r8[i] == 0 for i, s in enumerate(shapes) if s != BIG)
    hand = [
        [Group(16, 16, alone(6, 16))],
        [
            Group(0, 8, alone(4) + alone(1) + alone(5)),
            Group(8, 8, alone(0)),
            Group(16, 8, alone(2)),
            Group(24, 8, alone(3)),
        ],
    ]
    res = plan_greedy(batch, cost)
    assert validate(res.plan, batch, cost) == []
    assert res.predicted_step_time_s <= _time(hand, batch, cost) * (1 + 1e-9)


def test_split_with_everything_first_is_one_phase():
    """A split that puts every sequence in phase 0 is a one-phase plan of degree-w groups,
    and is returned so: local.improve leaves two-phase drafts alone, and on
    combined 2d-balanced 2M seed 0 (28 sequences, h200x32) such a draft beat uniform degree
    8 by 1.4 ms and then kept greedy 33 ms above the local search on uniform degree 8."""
    base = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32"))
    cost = perturbed_cost_models(base)["combined"]
    batch = Workload.parse("2d-balanced").batch(0, 2 * 2**20)
    inst = make_instance(batch, cost)
    for _, build in greedy_level.specs(inst, cost.cluster, np.inf):
        d = build()
        if isinstance(d, Draft):
            assert d.phase0 == [] or d.groups != []
    j8 = list(inst.degrees).index(8)
    local = improve(inst, cost.cluster, uniform_draft(inst, cost.cluster, j8))
    res = plan_greedy(batch, cost)
    assert validate(res.plan, batch, cost) == []
    local_s = _time(to_phases(local, inst, cost), batch, cost)
    assert res.predicted_step_time_s <= local_s * (1 + 1e-9)
