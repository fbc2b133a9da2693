"""The `ring` (ring attention) cost model, by hand (dcp_opt/cost/ring.py): GQA bytes, the
per-step overlap (fully hidden, exposed, and partly), memory, tables and bounds."""

from __future__ import annotations

import numpy as np
import pytest

from dcp_opt.batch import Batch, Sequence
from dcp_opt.build import make_plan
from dcp_opt.cost import CostModel
from dcp_opt.cost.ring import sent_bytes_per_layer
from dcp_opt.model import ModelSpec
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.simulate import simulate
from dcp_opt.table import seq_table
from dcp_opt.topology.presets import two_level
from dcp_opt.validate import validate
from tests.test_cp_cost import CLUSTER, COEFFS, MODEL

# MODEL: 2 layers, 6 query heads of 8 dims, 2 kv heads, 2-byte dtype: one token's K and V =
# 2 * 2 * 8 * 2 = 64 B per layer. CLUSTER: 2 nodes x 4, NVLink 1e9 B/s and 1e-6 s, NIC 1e8
# B/s and 1e-5 s. COEFFS: attention quad 1e-9 (forward), 2e-9 (backward), linear 1e-6, 2e-6.
COST = CostModel(MODEL, CLUSTER, COEFFS, sp_kinds=("ulysses", "cp", "ring"))


def _f(tokens: int):
    return COST.features(Sequence(0, (tokens,)))


def test_bytes_are_gqa_aware_and_backward_moves_kv_and_its_gradient():
    # T = 1000 at d = 4: a block is 250 tokens x 64 B = 16000 B; forward 3 blocks, backward
    # 3 K/V + 3 dK/dV blocks
    fwd, bwd = sent_bytes_per_layer(MODEL, 1000, 4)
    assert (float(fwd), float(bwd)) == (48000.0, 96000.0)
    mha = ModelSpec("t", "1d", 2, 48, 6, 96, vocab_size=100)  # 6 kv heads: 192 B per token
    assert float(sent_bytes_per_layer(mha, 1000, 4)[0]) == 3 * 48000.0


def test_transfer_fully_hidden_behind_each_steps_attention():
    # T = 1000 (Q = 1e6) at d = 4 in a node: a step's attention is 1e-9 * 1e6 / 16 = 6.25e-5 s
    # forward, 1.25e-4 s backward; one block 16000 B / 1e9 + 1e-6 = 1.7e-5 s, two 3.3e-5 s:
    # every transfer hides. Compute is cp's: L (fwd + bwd) = 2 * (5e-4 + 1e-3) = 3e-3 s
    c, r, m = COST.time_parts(_f(1000), 4, 1, spans_nodes=False, kind="ring")
    assert m == 0.0
    assert (c, r) == pytest.approx((3e-3, 5e-4), rel=1e-12)
    cp = COST.time_parts(_f(1000), 4, 1, spans_nodes=False, kind="cp")
    assert (c, r) == pytest.approx(cp[:2], rel=1e-12) and cp[2] > 0  # cp's gather is exposed


def test_transfer_exposed_across_nodes():
    # T = 1000 at d = 8 over two nodes: a block 125 x 64 = 8000 B at the NIC: X1 = 8e-5 + 1e-5
    # = 9e-5 s, X2 = 1.6e-4 + 1e-5 = 1.7e-4 s; a step's attention 1e-9 * 1e6 / 64 = 1.5625e-5 s
    # forward, 3.125e-5 s backward.
    # forward: 7 * (9e-5 - 1.5625e-5) = 5.20625e-4 s
    # backward: 2 * (9e-5 - 3.125e-5) + 6 * (1.7e-4 - 3.125e-5) = 1.175e-4 + 8.325e-4 = 9.5e-4 s
    # L = 2, r = 1: 2 * (5.20625e-4 + 9.5e-4) + 5.20625e-4 = 3.461875e-3 s
    _, _, m = COST.time_parts(_f(1000), 8, 1, spans_nodes=True, kind="ring")
    assert m == pytest.approx(3.461875e-3, rel=1e-12)
    # before overlap the forward ring's transfers take 7 * X1 (CostModel.comm_time_per_layer)
    assert COST.comm_time_per_layer(1000, 8, True, "ring") == pytest.approx(6.3e-4, rel=1e-12)


def test_transfer_partly_hidden_forward_exposed_backward_ends_hidden():
    # T = 200 (Q = 4e4) at d = 4 in a node: a step 2.5e-6 s forward, 5e-6 s backward; a block
    # 50 x 64 = 3200 B: X1 = 3.2e-6 + 1e-6 = 4.2e-6 s, X2 = 7.4e-6 s.
    # forward 3 * (4.2e-6 - 2.5e-6) = 5.1e-6 s; backward: the two one-block steps hide (4.2e-6
    # < 5e-6), the two middle steps expose 2 * (7.4e-6 - 5e-6) = 4.8e-6 s. L = 2, r = 0:
    # 2 * (5.1e-6 + 4.8e-6) = 1.98e-5 s
    _, _, m = COST.time_parts(_f(200), 4, 0, spans_nodes=False, kind="ring")
    assert m == pytest.approx(1.98e-5, rel=1e-9)
    # d = 2: one transfer forward, the backward's two steps one block each (no K/V + dK/dV
    # step): X1 = 100 x 64 / 1e9 + 1e-6 = 7.4e-6 s; steps 1e-9 * 4e4 / 4 = 1e-5 s forward:
    # everything hides
    assert COST.time_parts(_f(200), 2, 0, spans_nodes=False, kind="ring")[2] == 0.0
    assert COST.time_parts(_f(200), 1, 0, spans_nodes=False, kind="ring")[2] == 0.0


def test_slower_group_hides_more():
    # speed 0.5 doubles a step's attention (5e-6 s forward at T = 200, d = 4): X1 = 4.2e-6 s
    # hides; backward steps 1e-5 s hide X2 = 7.4e-6 s too
    _, _, m = COST.time_parts(_f(200), 4, 0, spans_nodes=False, speed=0.5, kind="ring")
    assert m == 0.0


def test_memory_holds_two_blocks_in_flight_not_the_gathered_whole():
    # ring keeps Ulysses' activations; the working layer holds 4 blocks (the backward's send
    # and receive buffers of K/V and dK/dV): 4 * 64 B per local token, any r. T = 1000, d = 4:
    # 250 * 256 = 64000 B; cp holds (d-1) * 64 B per local token per saved layer: 144000 B
    for r in (0, 1, 2):
        extra = COST.memory(1000, 4, r, "ring") - COST.memory(1000, 4, r)
        assert extra == pytest.approx(64000.0, rel=1e-12)
    assert COST.memory(1000, 4, 0, "cp") - COST.memory(1000, 4, 0) == pytest.approx(144000.0)
    assert COST.memory(1000, 1, 0, "ring") == COST.memory(1000, 1, 0)  # no ring at d = 1
    # min_recompute: where Ulysses just fits (250 * 3010 B), ring needs one layer (250 * 3266
    # B at r = 0; r = 1: 250 * (1000 + 100 + 1000 + 10 + 256) = 250 * 2366 B)
    cap = float(COST.memory(1000, 4, 0))
    assert int(COST.min_recompute(1000, 4, cap, "ring")) == 1


def test_topology_two_level_graph_prices_the_ring_as_the_formula():
    graph = CostModel(MODEL, CLUSTER.with_(topology=two_level(CLUSTER)), COEFFS)
    for d, start, tokens in ((4, 0, 200), (8, 0, 1000)):
        cls = graph.cluster.comm_class(start, d)
        want = COST.time_parts(_f(tokens), d, 1, spans_nodes=d > 4, kind="ring")
        got = graph.time_parts(_f(tokens), d, 1, spans_nodes=cls, kind="ring")
        assert got == pytest.approx(want, rel=1e-12)


def test_vectorised_degrees_match_scalar_calls():
    feats = np.stack([_f(200), _f(1000), _f(5000)])
    d = np.array([[2], [4], [8]])
    got = COST.time_parts(feats, d, 1, kind="ring")
    for i, dd in enumerate((2, 4, 8)):
        one = COST.time_parts(feats, dd, 1, kind="ring")
        for k in range(3):
            assert np.array_equal(got[k][i], one[k])


def test_packing_hides_a_short_sequence_and_tables_leave_the_exposure_out():
    # across nodes (d = 8) the short sequence alone exposes its transfers; packed with the
    # long one the long one's attention hides them, so packed < the sum of the two alone
    # less one empty micro-batch: the exposure is not additive. The table's marginal and
    # constant therefore leave it out (compute and recompute only), and every packed ring
    # micro-batch is no faster than either of its sequences alone.
    long_f, short_f = _f(4000), _f(100)
    t = {k: float(COST.time(v, 8, 0, spans_nodes=True, kind="ring"))
         for k, v in (("long", long_f), ("short", short_f), ("both", long_f + short_f),
                      ("empty", 0 * long_f))}  # fmt: skip
    assert t["both"] < t["long"] + t["short"] - t["empty"]
    assert t["both"] >= max(t["long"], t["short"])
    batch = Batch.from_lengths([4000, 100])
    tab = seq_table(batch, COST.with_(sp_kinds=("ulysses", "ring")))
    j = tab.degrees.index(8)
    add = [float(COST.additive_time(f, 8, 0, kind="ring")) for f in (long_f, short_f)]
    empty = float(COST.additive_time(0 * long_f, 8, 0, kind="ring"))
    assert tab.const[j] <= empty
    assert tab.time_marginal[:, j].sum() + tab.const[j] <= t["both"] * (1 + 1e-12)
    assert tab.time_marginal[:, j] == pytest.approx([a - empty for a in add], rel=1e-12)


def test_phase_with_ulysses_cp_and_ring_groups_is_priced_per_kind():
    batch = Batch.from_lengths([1000, 600, 200, 300])
    groups = [
        Group(0, 4, (MicroBatch((0,), 0),), "ring"),
        Group(4, 2, (MicroBatch((1, 3), 1),), "cp"),
        Group(6, 2, (MicroBatch((2,), 0),), "ulysses"),
    ]
    plan = make_plan([groups], batch, COST, planner="hand")
    assert validate(plan, batch, COST) == []
    sim = simulate(plan, batch, COST)
    for e in sim.events:
        seqs = [batch.by_id[s] for s in e.sequence_ids]
        kw = {} if e.kind == "ulysses" else {"kind": e.kind}
        want = COST.microbatch_time(seqs, e.degree, e.recompute_layers, **kw).total_s
        got = e.compute_s + e.recompute_s + e.comm_s
        assert got == pytest.approx(want, rel=1e-12)
    # a ring group is refused by a cost model that does not offer ring
    bad = validate(plan, batch, COST.with_(sp_kinds=("ulysses", "cp")), check_fingerprint=False)
    assert [v.code for v in bad] == ["BAD_KIND"]


def test_phase_of_ring_groups_only_and_its_micro_batches():
    batch = Batch.from_lengths([1000, 600, 200, 300])
    groups = [
        Group(0, 4, (MicroBatch((0, 2), 0), MicroBatch((3,), 1)), "ring"),
        Group(4, 4, (MicroBatch((1,), 0),), "ring"),
    ]
    plan = make_plan([groups], batch, COST, planner="hand")
    assert validate(plan, batch, COST) == []
    for e in simulate(plan, batch, COST).events:
        seqs = [batch.by_id[s] for s in e.sequence_ids]
        want = COST.microbatch_time(seqs, e.degree, e.recompute_layers, kind="ring")
        got = (e.compute_s, e.recompute_s, e.comm_s)
        assert got == pytest.approx((want.compute_s, want.recompute_s, want.comm_s), rel=1e-12)
        assert e.memory_bytes == pytest.approx(
            float(COST.memory(sum(s.num_tokens for s in seqs), 4, e.recompute_layers, "ring"))
        )


def test_validate_charges_a_ring_group_its_own_memory():
    # memory where 1000 tokens at d = 4, r = 0 fit as Ulysses (250 * 3010 B of activations)
    # but not as ring (250 * 3266 B): the ring group is OUT_OF_MEMORY, the Ulysses one valid;
    # ring at r = 1 (250 * 2366 B) fits
    need_u = float(COST.memory(1000, 4, 0))
    cost = COST.with_(cluster=CLUSTER.with_(memory_bytes=need_u / COST.usable_memory_fraction))
    batch = Batch.from_lengths([1000])

    def plan(kind, r):
        return make_plan([[Group(0, 4, (MicroBatch((0,), r),), kind)]], batch, cost, planner="h")

    assert validate(plan("ulysses", 0), batch, cost) == []
    assert [v.code for v in validate(plan("ring", 0), batch, cost)] == ["OUT_OF_MEMORY"]
    assert validate(plan("ring", 1), batch, cost) == []
