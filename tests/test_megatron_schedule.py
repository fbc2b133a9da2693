"""Megatron-Core dev's dynamic-CP scheduler (solvers/baselines/megatron_schedule.py) and the
`megatron_dynamic_cp` planner's options (issue 25 item 1).

The first three tests are Megatron's own expectations, from NVIDIA/Megatron-LM dev at
d48bd6be0a85, tests/unit_tests/test_sequence_packing.py:693-725."""

from __future__ import annotations

import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.baselines.megatron_schedule import (
    align_to_vpp,
    cp_size_needed,
    group_spans,
    micro_step,
    schedule,
)

from dcp_opt import Batch, CostModel, cluster_preset, validate
from dcp_opt.errors import DcpOptError, InfeasibleError
from dcp_opt.model import model_preset


def test_megatron_larger_cp_group_for_short_sequences():
    # test_next_hdp_group_packing_aware_can_use_larger_cp_group_for_short_sequences:
    # 6144 needs 2 ranks at M = 4096 (both); 2048 on one rank would lift that rank to
    # 6144^2/2 + 2048^2 = 23.1M, packed into the CP-2 group both ranks reach 6144^2/2 +
    # 2048^2/2 = 20.97M, the lower peak (and under the cap 6144 x 4096 x 1.05 = 26.4M)
    step, waiting = micro_step([(0, 6144), (1, 2048)], 2, 4096)
    assert waiting == []
    assert step == [[0, 1], [0, 1]]


def test_megatron_fills_non_power_of_two_ranks_with_the_whole_group():
    # test_next_hdp_group_packing_aware_fills_non_power_of_two_dpxcp_group: 14 ranks, two
    # sequences of 50 at M = 100: groups of 1 cannot double to fill 14 ranks, so the
    # fallback packs both into one group of all 14 (50/14 + 50/14 <= 100 tokens a rank)
    step, waiting = micro_step([(0, 50), (1, 50)], 14, 100)
    assert waiting == []
    assert step == [[0, 1] for _ in range(14)]


def test_megatron_default_dynamic_cp_scheduler_groups():
    # test_default_dynamic_cp_scheduler_uses_packing_aware_grouping_by_default: DP 1 x CP 2
    assert schedule([(0, 6144), (1, 2048)], 2, 4096) == [[[0, 1], [0, 1]]]


def test_megatron_cp_size_needed_by_hand():
    # 2^ceil(log2(s / M)), at least 1 and min_cp: 2500 / 1000 -> 4; 1001 -> 2; 10 -> 1
    assert [cp_size_needed(s, 1000) for s in (2500, 1000, 1001, 10)] == [4, 1, 2, 1]
    assert cp_size_needed(10, 1000, min_cp_size=4) == 4


def test_megatron_micro_step_waits_and_doubles():
    # 4 ranks, M = 100: 400 opens a CP-4 group (all ranks, load 400^2/4 = 40000, cap
    # 400 x 100 x 1.05 = 42000); 50 packs into it (per rank 100 + 12.5 > 100: no), no rank
    # is free: it waits
    step, waiting = micro_step([(0, 400), (1, 50)], 4, 100)
    assert step == [[0]] * 4 and waiting == [(1, 50)]
    # 100, 100, 60 on 4 ranks: groups of 1 on ranks 0, 1, 2 (loads 10000, 10000, 3600);
    # rank 3 empty -> the first smallest group doubles onto ranks 0-1, the rest shift up
    step, waiting = micro_step([(0, 100), (1, 100), (2, 60)], 4, 100)
    assert waiting == []
    assert step == [[0], [0], [1], [2]]
    assert group_spans(step) == [(0, 2), (2, 1), (3, 1)]


def test_megatron_vpp_alignment_splits_the_last_micro_step():
    # one micro-step of groups [0,0 | 1 | 2] on 4 ranks; aligned to 2 micro-steps: cut at
    # the first boundary >= 2 ranks (rank 2): the later groups [1 | 2] refilled to 4 ranks
    # by doubling the first group ([1, 1, 2, 2]), the earlier [0, 0] doubled to all 4
    steps = align_to_vpp([[[0], [0], [1], [2]]], 2)
    assert steps == [[[1], [1], [2], [2]], [[0], [0], [0], [0]]]


def test_megatron_refuses_a_sequence_over_the_ranks():
    # 1000 tokens need CP 16 at M = 64 on 8 ranks: Megatron's assertion
    with pytest.raises(InfeasibleError, match="CP size 16"):
        schedule([(0, 1000)], 8, 64)


COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200x32"), sp_kinds=("ulysses", "cp"))


def test_megatron_planner_options_reach_the_schedule():
    batch = Batch.from_lengths([40_000, 9000, 3000, 3000, 2000, 1000] * 4)
    res = run_planner(
        "megatron_dynamic_cp", batch, COST, max_seqlen_per_rank=4096, recompute="full"
    )
    assert validate(res.plan, batch, COST) == []
    assert res.stats["max_seqlen_per_rank"] == 4096 and res.stats["pad_to_multiple_of"] == 64
    # 40,000 padded to 40,000 (a multiple of 64) needs 2^ceil(log2(9.77)) = 16 ranks
    first = res.plan.phases[0].groups
    assert max(g.degree for g in first) == 16
    assert {
        mb.recompute_layers for ph in res.plan.phases for g in ph.groups for mb in g.micro_batches
    } == {COST.model.num_layers}
    assert {g.kind for ph in res.plan.phases for g in ph.groups} == {"cp"}


def test_megatron_planner_counts_what_megatron_would_not_fit():
    # 131,072 tokens a rank with no recompute: every pack of a 2M step is over 141 GB
    batch = Batch.from_lengths([8192] * 64)
    res = run_planner(
        "megatron_dynamic_cp", batch, COST, max_seqlen_per_rank=131072, recompute="none"
    )
    assert validate(res.plan, batch, COST) == []
    assert res.stats["oom_micro_batches"] > 0
    ok = run_planner("megatron_dynamic_cp", batch, COST, max_seqlen_per_rank=8192)
    assert ok.stats["oom_micro_batches"] == 0


@pytest.mark.parametrize(
    "options, field",
    [
        ({"max_seqlen_per_rank": 0}, "max_seqlen_per_rank"),
        ({"recompute": "some"}, "recompute"),
        ({"pad_to_multiple_of": 1.5}, "pad_to_multiple_of"),
        ({"kind": "ring"}, "kind"),
    ],
)
def test_megatron_planner_refuses_bad_options(options, field):
    with pytest.raises(DcpOptError, match=field):
        run_planner("megatron_dynamic_cp", Batch.from_lengths([1000]), COST, **options)
