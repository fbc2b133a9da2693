"""The cost model's checks, gradient sync, fingerprints, memo and loss normaliser by hand
(issue 18, mutation testing of dcp_opt/cost.py); the models and coefficients of
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
from dcp_opt.errors import DcpOptError
from tests.test_cost_hand import DIT, HAND, HAND_2D, LM, close, dit_cost


# ---- the gradient sync (Thakur et al. 2005) ---------------------------------------------------
def test_two_gpus_sync_their_gradients():
    two = Cluster("two", 1, 2, 1e6, 1000.0, 16.0, 4.0)
    # unsharded: no closing micro-step of the sharded modes (issue 14)
    cost = CostModel(
        DIT, two, HAND_2D, "none", grad_reduce_bytes_per_param=2.0, step_overhead_s=0.3
    )
    # ring all-reduce: 2 (2-1)/2 x 1000 parameters x 2 B at 16 B/s = 125 s, + 0.3 s
    assert close(cost.grad_sync_time(), 125.3)


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
    ]
    prints = [c.fingerprint() for c in variants]
    assert len(set(prints)) == len(prints)
    assert all(len(p) == 16 and int(p, 16) >= 0 for p in prints)
    assert dit_cost().fingerprint() == prints[0]  # equal models, equal prints


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
