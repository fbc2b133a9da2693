"""The cost model's checks, gradient sync, fingerprints, memo and loss normaliser by hand
(issue 18, mutation testing of dcp_opt/cost/); the models and coefficients of
tests/test_cost_hand.py, whose docstring gives the rules: every expectation is arithmetic on
literal numbers or a documented message, never a call into the code under test."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from dcp_opt import Batch, Cluster, CostModel
from dcp_opt.cost import (
    MemoCache,
    combine_fingerprints,
    default_normalizer_kind,
    loss_normalizer,
)
from dcp_opt.cost.cp import CPMeasurement
from dcp_opt.errors import DcpOptError
from tests.test_cost_hand import DIT, HAND, HAND_2D, LM, close, dit_cost, lm_cost


# ---- the gradient sync (Thakur et al. 2005) ---------------------------------------------------
def test_two_gpus_sync_their_gradients():
    two = Cluster("two", 1, 2, 1e6, 1000.0, 16.0, 4.0)
    # unsharded: no closing micro-step of the sharded modes (issue 14)
    cost = CostModel(
        DIT, two, HAND_2D, "none", grad_reduce_bytes_per_param=2.0, step_overhead_s=0.3
    )
    # ring all-reduce: 2 (2-1)/2 x 1000 parameters x 2 B at 16 B/s = 125 s, + 0.3 s
    assert close(cost.grad_sync_time(), 125.3)


def test_one_gpu_pays_the_closing_step_and_the_overhead():
    one = Cluster("one", 1, 1, 1e6, 1000.0, 16.0, 4.0)
    cost = CostModel(DIT, one, HAND_2D, grad_reduce_bytes_per_param=2.0, step_overhead_s=0.3)
    # no ring on one GPU; zero1's closing one-token step (208.49 s, test_closing_step_by_hand)
    assert close(cost.grad_sync_time(), 0.3 + 208.49)


def test_the_ring_pays_its_most_loaded_link():
    from tests.test_topology import rail_fabric

    rail = Cluster("rail", 2, 2, 1e6, 1000.0, 400e9, 50e9, topology=rail_fabric())
    cost = CostModel(DIT, rail, HAND_2D, "none", grad_reduce_bytes_per_param=2.0)
    # the ring's rail1 -> spine link carries 2 chunks at 25 GB/s (test_rail_fabric_ring_by_hand):
    # 2 (4-1)/4 x 1000 x 2 B x 2 / 25e9
    assert close(cost.grad_sync_time(), 2 * 3 / 4 * 2000 * 2 / 25e9)


# ---- checks and their messages (docs: a bad field gets a one-line error naming it) ----------
@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"optimizer_sharding": "zero9"},
            r"optimizer_sharding: 'zero9' not allowed; allowed: \['none', 'zero1', 'zero2', 'zero3'\]",
        ),
        ({"usable_memory_fraction": 0}, r"usable_memory_fraction: must be in \(0, 1\], got 0"),
        ({"usable_memory_fraction": 1.5}, r"usable_memory_fraction: must be in \(0, 1\], got 1.5"),
        ({"replicated_seq_s": -1.0}, r"replicated_seq_s: must be a finite number >= 0, got -1.0"),
        (
            {"step_overhead_s": float("inf")},
            "step_overhead_s: must be a finite number >= 0, got inf",
        ),
        ({"replicated_seq_s": "x"}, "replicated_seq_s: must be a finite number >= 0, got 'x'"),
        (
            {"sp_compute_overhead": ((2, 0.1),)},
            r"sp_compute_overhead: must be distinct \(degree, x\) pairs with degree in \[1, 3, 6\] "
            r"and finite x >= 0, got \(\(2, 0.1\),\)",
        ),
        ({"sp_compute_overhead": ((3, float("inf")),)}, "sp_compute_overhead: must be distinct"),
        ({"sp_compute_overhead": ((3, -0.5),)}, "sp_compute_overhead: must be distinct"),
        ({"sp_compute_overhead": ((3, 0.1), (3, 0.2))}, "sp_compute_overhead: must be distinct"),
        ({"sp_compute_overhead": (("three", 0.1),)}, "sp_compute_overhead: must be distinct"),
    ],
)
def test_bad_fields_are_refused_by_name(kw, message):
    with pytest.raises(DcpOptError, match=message):
        dit_cost(**kw)


@pytest.mark.parametrize("kinds", [("cp",), ("ulysses", "ulysses"), ("ulysses", "star"), "ulysses"])
def test_bad_sp_kinds_are_refused_by_name(kinds):
    with pytest.raises(
        DcpOptError,
        match=r"sp_kinds: .* not allowed; allowed: distinct entries of \['ulysses', 'cp', "
        r"'ring'\], 'ulysses' included",
    ):
        lm_cost(sp_kinds=kinds)


def test_sp_kinds_and_measurements_are_normalised():
    # any order in: the kinds in cost.cp.SP_KINDS order, the measurements by group size
    m2, m4 = (CPMeasurement(g, 8.0, 0.3, 4.0, 0.6) for g in (2, 4))
    cost = lm_cost(sp_kinds=["cp", "ulysses"], cp_comm=[m4, m2])
    assert (cost.sp_kinds, cost.cp_comm) == (("ulysses", "cp"), (m2, m4))
    # cp is for 1D causal models: refused on the video model up front
    with pytest.raises(DcpOptError, match="sp kind: 'cp' not allowed for the 2d model"):
        dit_cost(sp_kinds=("ulysses", "cp"))


def test_missing_block_coefficients_are_refused_by_name():
    only = replace(HAND_2D, blocks={"spatial": HAND_2D.blocks["spatial"]})
    with pytest.raises(
        DcpOptError,
        match=r"cost coefficients: no entry for block types \['temporal'\] of model 'hand-dit'",
    ):
        CostModel(DIT, HAND, only)


def test_sp_compute_overhead_is_normalised():
    # pairs of any numeric spelling, any order: stored as sorted (int, float) pairs; x = 0 is
    # allowed (no overhead)
    cost = dit_cost(sp_compute_overhead=[(6.0, "0.25"), (3, 0)])
    assert cost.sp_compute_overhead == ((3, 0.0), (6, 0.25))
    assert [type(v) for v in cost.sp_compute_overhead[1]] == [int, float]


# ---- fingerprints: what a plan was made for --------------------------------------------------
def test_fingerprint_tells_every_field_apart():
    base = dit_cost()
    variants = [
        base,
        base.with_(usable_memory_fraction=0.8),
        base.with_(grad_reduce_bytes_per_param=4.0),
        base.with_(optimizer_sharding="none"),
        base.with_(coeffs=replace(HAND_2D, reserved_bytes=999.0)),
        base.with_(model=replace(DIT, num_layers=4)),
        base.with_(cluster=HAND.with_(intra_node_bw=17.0)),
        base.with_(sp_compute_overhead=((3, 0.1),)),
        base.with_(sp_compute_overhead=((3, 0.2),)),
        base.with_(replicated_seq_s=0.1),
        base.with_(replicated_seq_s=0.2),
        base.with_(step_overhead_s=0.1),
        base.with_(step_overhead_s=0.2),
        base.with_(closing_step_s=2.5),
        base.with_(closing_step_s=3.5),
        base.with_(sp_kinds=("ulysses", "cp"), model=replace(DIT, kind="1d", num_layers=4),
                   coeffs=replace(HAND_2D, blocks={"layer": HAND_2D.blocks["spatial"]})),
    ]  # fmt: skip
    lm = lm_cost(sp_kinds=("ulysses", "cp"))
    variants += [
        lm,
        *(lm.with_(cp_comm=(CPMeasurement(2, bw, 1e-3, 2e3, 2e-3),)) for bw in (1e3, 3e3)),
    ]
    prints = [c.fingerprint() for c in variants]
    assert len(set(prints)) == len(prints)
    assert all(len(p) == 16 and int(p, 16) >= 0 for p in prints)
    assert dit_cost().fingerprint() == prints[0]  # equal models, equal prints


def test_fingerprints_of_saved_plans_stay_valid():
    """Pinned: plans and profiles saved by earlier versions carry these prints, and a knob
    left off must not enter the hash (cost.py fingerprint). A change here invalidates every
    saved plan of such a model: announce it and update the pins."""
    assert dit_cost().fingerprint() == "1a48dc56fda12140"
    knobs = dit_cost(
        sp_compute_overhead=((3, 0.1),),
        replicated_seq_s=0.2,
        step_overhead_s=0.3,
        closing_step_s=2.5,
    )
    assert knobs.fingerprint() == "95dd38743399c45c"
    assert lm_cost(sp_kinds=("ulysses", "cp")).fingerprint() == "cc754d11b8cfb096"
    measured = (CPMeasurement(2, 1e3, 1e-3, 2e3, 2e-3),)
    assert lm_cost(sp_kinds=("ulysses", "cp"), cp_comm=measured).fingerprint() == "6d3e8406a860a213"


def test_combined_fingerprint_is_16_hex_of_both():
    # sha256 of the concatenation, its first 16 hex digits (a digest, not the formula: the
    # test checks length and that both halves count)
    a = combine_fingerprints("ab", "cd")
    assert len(a) == 16 and a == hashlib.sha256(b"abcd").hexdigest()[:16]
    assert a != combine_fingerprints("ab", "ce")


# ---- the memo ---------------------------------------------------------------------------------
def test_memo_holds_max_entries_then_evicts_the_oldest():
    memo = MemoCache()
    for i in range(MemoCache.MAX_ENTRIES):
        memo[i] = i
    assert len(memo) == MemoCache.MAX_ENTRIES and 0 in memo
    memo["new"] = 1
    assert len(memo) == MemoCache.MAX_ENTRIES and 0 not in memo and "new" in memo


@pytest.mark.parametrize("error", [KeyError, RuntimeError, StopIteration])
def test_memo_eviction_tolerates_another_threads_eviction(error):
    """Another thread (AsyncPlanner) may evict the same entry first (KeyError), change the
    dict during iteration (RuntimeError) or empty it (StopIteration): the insert stands."""

    class Raced(MemoCache):
        MAX_ENTRIES = 1

        def __delitem__(self, key):
            raise error("raced")

    memo = Raced()
    memo["a"], memo["b"] = 1, 2
    assert memo["b"] == 2


# ---- the loss normaliser ----------------------------------------------------------------------
def test_loss_normalizer_by_hand():
    batch = Batch.from_lengths([3, 5])
    assert (loss_normalizer(batch, "tokens"), loss_normalizer(batch, "samples")) == (8.0, 2.0)
    assert default_normalizer_kind(LM) == "tokens"
    assert default_normalizer_kind(DIT) == "samples"


# ---- the sharded modes' closing micro-step and the sync volume (issue 14) -------------------
def test_closing_step_by_hand():
    # one token at degree 1 (heads share 4/4 = 1, features Q = T = S = 1):
    # fwd = (0.5 + 0.125) + (3 + 2) + (7 + 13) + (0.25 + 0.5) = 26.375
    # bwd = (1.5 + 0.375) + (5 + 6) + (11 + 17) + (0.75 + 1.25) = 42.875
    # L (fwd + bwd) + head (0.01 + 0.03) + overhead 0.7 = 3 * 69.25 + 0.74 = 208.49
    slow = HAND.with_(speed_factors=(0.5, 1.0, 1.0, 1.0, 1.0, 1.0))
    assert close(dit_cost().closing_step_time(), 208.49)
    assert close(dit_cost().with_(cluster=slow).closing_step_time(), 208.49 / 0.5)  # slowest
    assert dit_cost(optimizer_sharding="none").closing_step_time() == 0.0
    assert dit_cost(closing_step_s=2.5).closing_step_time() == 2.5
    # the step's sync: 2 (6-1)/6 x 1000 x 2 B at the NIC's 4 B/s + the closing step + 0.3 s
    sync = dit_cost(step_overhead_s=0.3).grad_sync_time()
    assert close(sync, 2 * 5 / 6 * 2000 / 4 + 208.49 + 0.3)


def test_sync_bytes_follow_the_mode_unless_set():
    # runtime/sharding.py: an fp32 all-reduce (4 B) for `none`; all-gather bf16 weights 2 B +
    # reduce-scatter fp32 gradients 4 B, as a ring all-reduce of 3 B, for the sharded modes
    follows = CostModel(DIT, HAND, HAND_2D)
    assert follows.grad_reduce_bytes_per_param == 3.0
    assert follows.with_(optimizer_sharding="none").grad_reduce_bytes_per_param == 4.0
    assert CostModel(DIT, HAND, HAND_2D, "none").grad_reduce_bytes_per_param == 4.0
    fixed = dit_cost()  # 2.0 set: kept through a change of mode
    assert fixed.with_(optimizer_sharding="none").grad_reduce_bytes_per_param == 2.0
    # any finite number >= 0 is a volume (0: a runtime that reduces nothing)
    assert [dit_cost().with_(grad_reduce_bytes_per_param=v).grad_reduce_bytes_per_param
            for v in (0, 0.5)] == [0.0, 0.5]  # fmt: skip


def test_a_copy_forgets_the_memo():
    # with_ gives a fresh memo: a figure memoised for the old cluster is not reused
    cost = dit_cost()
    assert close(cost.closing_step_time(), 208.49)
    slow = HAND.with_(speed_factors=(0.5, 1.0, 1.0, 1.0, 1.0, 1.0))
    assert close(cost.with_(cluster=slow).closing_step_time(), 208.49 / 0.5)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), True, "2"])
def test_bad_sync_bytes_are_refused_by_name(bad):
    with pytest.raises(
        DcpOptError, match=r"grad_reduce_bytes_per_param: must be a finite number >= 0 or None"
    ):
        CostModel(DIT, HAND, HAND_2D, grad_reduce_bytes_per_param=bad)
