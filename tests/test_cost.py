"""Cost-model pieces by hand on the toy (tests/toy.py: 2 layers, 1 parameter, T tokens at
degree d take 6T/d + 0.5 s, memory 9 + T/d * (30 - 8r) bytes on 4 GPUs), for the knobs and
paths the planners' tests never vary (issue 18, mutation testing): the per-degree SP compute
overhead, the gradient sync, the step's collectives, the fits check on mixed memory, and the
coefficients' JSON form."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dcp_opt import Batch, CostModel, cluster_preset, model_preset
from dcp_opt.cost import CostCoefficients, runtime_reduce_bytes
from dcp_opt.errors import DcpOptError, InfeasibleError
from tests.toy import toy_cost


def test_sp_compute_overhead_scales_layer_time_at_its_degree_only():
    base = toy_cost()
    cost = base.with_(sp_compute_overhead=((2, 0.1),))
    assert (cost.sp_factor(2), cost.sp_factor(4), cost.sp_factor(1)) == (1.1, 1.0, 1.0)
    seq = Batch.from_lengths([8]).sequences
    # 8 tokens: layers 6 * 8 / d seconds, x 1.1 at d = 2; the 0.5 s overhead is not a layer.
    assert cost.microbatch_time(seq, 2).total_s == pytest.approx(24 * 1.1 + 0.5)
    assert cost.microbatch_time(seq, 4).total_s == pytest.approx(12 + 0.5)
    assert base.microbatch_time(seq, 2).total_s == pytest.approx(24 + 0.5)
    # one recomputed layer's forward (8/2 s) is a layer too
    assert cost.microbatch_time(seq, 2, 1).recompute_s == pytest.approx(4 * 1.1)


@pytest.mark.parametrize(
    "nodes, per, want",
    [(1, 4, 2 * 3 / 4 * 4 / 2.0 + 0.25), (2, 2, 2 * 3 / 4 * 4 / 0.5 + 0.25), (1, 1, 0.25)],
    ids=["one node", "two nodes", "one GPU"],
)
def test_grad_sync_is_a_ring_all_reduce_at_the_right_rate(nodes, per, want):
    # 1 parameter x 4 bytes, ring all-reduce 2 (N-1)/N x bytes (Thakur et al. 2005) at 2 B/s
    # inside a node, 0.5 B/s across, plus the 0.25 s step overhead; one GPU: the overhead only.
    cost = toy_cost(nodes, per)
    cost = cost.with_(
        cluster=cost.cluster.with_(intra_node_bw=2.0, inter_node_bw=0.5),
        grad_reduce_bytes_per_param=4.0,
        step_overhead_s=0.25,
    )
    assert cost.grad_sync_time() == pytest.approx(want)


@pytest.mark.parametrize(
    "mode, want",
    [
        ("none", {"grad_all_reduce": 2 * 3 / 4 * 4.0}),
        ("zero1", {"param_all_gather": 3 / 4 * 2.0, "grad_reduce_scatter": 3 / 4 * 4.0}),
        ("zero3", {"param_all_gather": 3 / 4 * 2.0, "grad_reduce_scatter": 3 / 4 * 4.0}),
    ],
)
def test_step_collectives_and_the_matching_reduce_bytes(mode, want):
    cost = toy_cost().with_(optimizer_sharding=mode)
    assert cost.step_collectives() == pytest.approx(want)
    # grad_reduce_bytes_per_param that makes the all-reduce time carry the same bytes
    synced = cost.with_(grad_reduce_bytes_per_param=runtime_reduce_bytes(mode))
    assert 2 * 3 / 4 * synced.grad_reduce_bytes_per_param == pytest.approx(sum(want.values()))


def test_runtime_reduce_bytes_refuses_an_unknown_mode():
    assert (runtime_reduce_bytes("none"), runtime_reduce_bytes("zero2")) == (4.0, 3.0)
    with pytest.raises(DcpOptError, match=r"optimizer_sharding: 'zero9' not allowed; allowed: "):
        runtime_reduce_bytes("zero9")


def test_the_sync_volume_follows_the_mode_unless_given():
    toy = toy_cost()
    cost = CostModel(toy.model, toy.cluster, toy.coeffs)  # no figure given: the runtime's
    assert cost.grad_reduce_bytes_per_param == 3.0  # zero1: all-gather 2 B + reduce-scatter 4 B
    assert cost.with_(optimizer_sharding="none").grad_reduce_bytes_per_param == 4.0
    assert (
        cost.with_(usable_memory_fraction=0.5)
        .with_(optimizer_sharding="none")
        .grad_reduce_bytes_per_param
        == 4.0
    )  # still following after another change
    # a given figure (bf16 gradient reduction: 2 B) is the user's, whatever the mode
    bf16 = cost.with_(grad_reduce_bytes_per_param=2)
    assert bf16.with_(optimizer_sharding="none").grad_reduce_bytes_per_param == 2.0
    assert bf16.fingerprint() != cost.fingerprint()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "2", True])
def test_a_bad_sync_volume_or_closing_step_is_refused(bad):
    toy = toy_cost()
    with pytest.raises(DcpOptError, match=r"^grad_reduce_bytes_per_param: must be a finite"):
        CostModel(toy.model, toy.cluster, toy.coeffs, grad_reduce_bytes_per_param=bad)
    if not isinstance(bad, bool):
        with pytest.raises(DcpOptError, match=r"^closing_step_s: must be a finite number"):
            CostModel(toy.model, toy.cluster, toy.coeffs, closing_step_s=bad)


def test_the_closing_micro_step_is_one_token_at_degree_1_in_the_sharded_modes():
    # The toy's own one-token micro-batch: 2 layers x (1 + 2) s x 1 token + 0.5 s = 6.5 s,
    # paid after the last phase by every rank (runtime/sharding.py, finish_step) and so in
    # grad_sync_time (the toy sends no sync bytes); the slowest rank (speed 0.5) sets its pace.
    cost = toy_cost().with_(closing_step_s=None)
    seq = Batch.from_lengths([1]).sequences
    assert cost.closing_step_time() == cost.microbatch_time(seq, 1).total_s == 6.5
    assert cost.grad_sync_time() == 6.5
    slow = toy_cost(speed_factors=(1.0, 0.5, 1.0, 1.0)).with_(closing_step_s=None)
    assert slow.closing_step_time() == 13.0
    # none runs no closing step; a given figure replaces the cost model's own
    assert cost.with_(optimizer_sharding="none").grad_sync_time() == 0.0
    assert cost.with_(closing_step_s=0.25).grad_sync_time() == 0.25
    assert cost.with_(optimizer_sharding="zero3").closing_step_time() == 6.5
    # a cost model that reprices micro-batches (measured factor 2 at degree 1) reprices it
    from dcp_opt.recalibrate import RecalibratedCostModel

    twice = RecalibratedCostModel(cost.model, cost.cluster, cost.coeffs, degree_factors=((1, 2.0),))
    assert twice.closing_step_time() == 13.0


def test_check_fits_uses_the_roomiest_placement_of_the_largest_degree():
    # Degrees 1 and 2 on ranks with 50, 100, 300, 400 bytes: the largest degree, 2, has
    # capacities min(50, 100) = 50 at rank 0 and 300 at rank 2. All layers recomputed, T
    # tokens at degree 2 need 9 + T/2 * 14: 40 tokens need 289 (fits 300), 44 need 317.
    cost = toy_cost(memory_per_rank=(50.0, 100.0, 300.0, 400.0), degrees=(1, 2))
    cost.check_fits(Batch.from_lengths([3, 40]))
    with pytest.raises(InfeasibleError, match=r"sequence 2 \(shape \(44,\), 44 tokens\)") as e:
        cost.check_fits(Batch.from_lengths([3, 40, 44, 50]))
    assert (e.value.sequence_id, e.value.need_bytes, e.value.capacity_bytes) == (2, 317.0, 300.0)
    assert "largest degree 2 with all 2 layers recomputed" in str(e.value)


def test_coefficients_round_trip_through_their_dict():
    coeffs = toy_cost().coeffs
    assert CostCoefficients.from_dict(coeffs.to_dict()) == coeffs
    changed = coeffs.to_dict() | {"microbatch_overhead_s": 0.75}
    assert CostCoefficients.from_dict(changed) == replace(coeffs, microbatch_overhead_s=0.75)
    flops = CostModel(toy_cost().model, toy_cost().cluster).coeffs  # FLOP-derived preset
    assert CostCoefficients.from_dict(flops.to_dict()) == flops
    broken = coeffs.to_dict()
    del broken["blocks"]["layer"]["fwd"]
    with pytest.raises(DcpOptError, match=r"cost coefficients: malformed \('fwd'\)"):
        CostCoefficients.from_dict(broken)


def comm_cost() -> CostModel:
    """The toy on two one-GPU nodes with 4 bytes of all-to-all per token and layer, 1 B/s in a
    node, 0.25 B/s across, no latency: one layer's forward at degree 2 moves 4 * T/2 * 1/2
    bytes, all of it to the other node."""
    cost = toy_cost(2, 1)
    return cost.with_(
        cluster=cost.cluster.with_(inter_node_bw=0.25),
        coeffs=replace(cost.coeffs, a2a_bytes_per_token_layer=4.0),
    )


def test_time_sums_compute_recompute_and_comm_and_passes_the_span_on():
    cost = comm_cost()
    seqs = Batch.from_lengths([8]).sequences
    feats = cost.features(seqs[0])[None, :]
    # degree 2 across the nodes, 1 recomputed layer: compute 24 + 0.5, recompute 4, comm
    # (2*2 + 1) layers x 8 bytes at 0.25 B/s = 160
    assert float(cost.time(feats, 2, 1)[0]) == pytest.approx(24.5 + 4 + 160)
    assert cost.microbatch_time(seqs, 2, 1).total_s == pytest.approx(188.5)
    # told the group stays in one node, the same bytes go at 1 B/s: 40
    inside = cost.microbatch_time(seqs, 2, 1, spans_nodes=False)
    assert inside.comm_s == pytest.approx(40.0)
    assert float(cost.time(feats, 2, 1, spans_nodes=False)[0]) == pytest.approx(24.5 + 4 + 40)


def test_step_collectives_scale_with_the_parameter_count():
    base = toy_cost()
    cost = base.with_(model=replace(base.model, num_params=3.0))
    assert cost.step_collectives() == pytest.approx(
        {"param_all_gather": 3 / 4 * 2.0 * 3, "grad_reduce_scatter": 3 / 4 * 4.0 * 3}
    )
    assert cost.with_(optimizer_sharding="none").step_collectives() == pytest.approx(
        {"grad_all_reduce": 2 * 3 / 4 * 4.0 * 3}
    )


def test_check_fits_capacity_is_the_groups_smallest_member():
    # Ranks 2..3 hold 400 and 300 bytes: a degree-2 group there has 300, not rank 2's 400.
    cost = toy_cost(memory_per_rank=(50.0, 100.0, 400.0, 300.0), degrees=(1, 2))
    with pytest.raises(InfeasibleError) as e:
        cost.check_fits(Batch.from_lengths([44]))  # needs 317
    assert e.value.capacity_bytes == 300.0
    # bytes in readable units (issue 28: the toy's 317 bytes printed as "0.0 GB" before)
    assert "needs 317 B per GPU" in str(e.value) and "capacity 300 B" in str(e.value)


@pytest.mark.parametrize("kind", ["ulysses", "cp"])
@pytest.mark.parametrize("subclass", [False, True])
def test_time_by_degree_rows_are_the_one_degree_calls_bit_for_bit(kind, subclass):
    from dcp_opt import cluster_preset, model_preset, standard_batch

    class PerDegree(CostModel):  # reprices time_parts: the per-degree loop
        def time_parts(self, *a, **kw):
            return super().time_parts(*a, **kw)

    cls = PerDegree if subclass else CostModel
    cost = cls(model_preset("llama3-8b"), cluster_preset("h200x32"))
    assert cost.takes_degree_vectors is not subclass
    feats = cost.batch_features(standard_batch("1d-short", seed=2))
    degrees = cost.cluster.allowed_degrees
    rec = (np.arange(len(degrees) * len(feats)).reshape(len(degrees), -1) % 3).astype(int)
    got = cost.time_by_degree(feats, degrees, rec, kind=kind)
    kw = {} if kind == "ulysses" else {"kind": kind}
    for row, d, r in zip(got, degrees, rec, strict=True):
        assert np.array_equal(row, cost.time(feats, d, r, **kw))
    if kind == "cp":  # the kind reaches the cost model: context parallelism costs differ
        assert not np.array_equal(got, cost.time_by_degree(feats, degrees, rec))


def test_recalibrated_model_keeps_the_sync_following_the_mode():
    """A recalibrated model (and its base, and its copies) charges each mode's own collectives
    when its source left the volume to the mode, and keeps an explicit volume as given."""
    from dcp_opt.recalibrate import Recalibrator

    base = CostModel(model_preset("llama-7b"), cluster_preset("h200x32"))
    rc = Recalibrator().corrected(base)
    for mode, expect in (("none", 4.0), ("zero1", 3.0), ("zero3", 3.0)):
        assert rc.with_(optimizer_sharding=mode).grad_reduce_bytes_per_param == expect
        assert rc.base.with_(optimizer_sharding=mode).grad_reduce_bytes_per_param == expect
    assert type(rc.with_(optimizer_sharding="none")) is type(rc)
    fixed = Recalibrator().corrected(base.with_(grad_reduce_bytes_per_param=2.0))
    assert fixed.with_(optimizer_sharding="none").grad_reduce_bytes_per_param == 2.0
