"""The `cp` (all-gather-KV context parallelism) cost model, by hand (dcp_opt/cost/cp.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dcp_opt.cluster import Cluster
from dcp_opt.cost import BlockCoeffs, CostCoefficients, CostModel, TermCoeffs
from dcp_opt.errors import DcpOptError
from dcp_opt.model import ModelSpec, model_preset
from dcp_opt.topology.presets import two_level

# 6 query heads of 8 dims, 2 kv heads: one token's K and V = 2 * 2 * 8 * 2 B = 64 B per layer
MODEL = ModelSpec("t", "1d", 2, 48, 6, 96, vocab_size=100, num_kv_heads=2)
CLUSTER = Cluster("c", 2, 4, 80e9, 1e15, 1e9, 1e8, 1e-6, 1e-5)
COEFFS = CostCoefficients(
    blocks={"layer": BlockCoeffs(TermCoeffs(1e-9, 1e-6), TermCoeffs(2e-9, 2e-6))},
    head_fwd_per_token_s=0.0,
    head_bwd_per_token_s=0.0,
    microbatch_overhead_s=0.0,
    a2a_bytes_per_token_layer=4 * 48 * 2,
    a2a_calls_per_layer=4,
    act_bytes_per_token_layer=1000.0,
    ckpt_bytes_per_token_layer=100.0,
    head_bytes_per_token=10.0,
    reserved_bytes=0.0,
)
COST = CostModel(MODEL, CLUSTER, COEFFS)


def test_allgather_time_inside_and_across_nodes():
    # d=4 in one node, T=1000: (d-1)/d * T * 64 B = 48000 B at 1e9 B/s = 4.8e-5 s, plus
    # 3 ring steps x 1e-6 s = 5.1e-5 s
    inside = COST.comm_time_per_layer(1000, 4, False, "cp")
    assert inside == pytest.approx(5.1e-5, rel=1e-12)
    # d=8 over two nodes: 7/8 * 1000 * 64 = 56000 B at the NIC's 1e8 B/s = 5.6e-4 s, plus
    # 7 steps x 1e-5 s = 7e-5 s
    assert COST.comm_time_per_layer(1000, 8, True, "cp") == pytest.approx(6.3e-4, rel=1e-12)
    assert COST.comm_time_per_layer(1000, 1, False, "cp") == 0.0  # one GPU gathers nothing


def test_compute_has_no_head_limit():
    # one 1000-token sequence: Q = 1e6. At d=4 cp does 1/4 of the attention (head-tail
    # balance): 1e-9 * 1e6 / 4 = 2.5e-4, plus the linear 1e-6 * 1000 / 4 = 2.5e-4 -> 5e-4 s.
    # Ulysses with 6 heads over 4 ranks does ceil(6/4)/6 = 1/3: 3.333e-4 + 2.5e-4 s.
    f = COST.features(_seq(1000))
    fwd_cp, bwd_cp = COST.layer_times(f, 4, "cp")
    fwd_u, _ = COST.layer_times(f, 4)
    assert fwd_cp == pytest.approx(5e-4, rel=1e-12)
    assert bwd_cp == pytest.approx(2 * 5e-4, rel=1e-12)
    assert fwd_u == pytest.approx(1e-3 / 3 + 2.5e-4, rel=1e-12)


def test_time_parts_charges_gather_forward_backward_and_recompute():
    # L=2, r=1: comm = (2 L + r) x one gather = 5 x 5.1e-5 s; compute = L (fwd + bwd) =
    # 2 x 1.5e-3 s; recompute = r x fwd = 5e-4 s
    f = COST.features(_seq(1000))
    c, r, m = COST.time_parts(f, 4, 1, spans_nodes=False, kind="cp")
    assert (c, r, m) == pytest.approx((3e-3, 5e-4, 5 * 5.1e-5), rel=1e-12)


def test_memory_holds_the_gathered_kv():
    # per local token and saved layer cp keeps (d-1) x 64 B more: at d=4, r=0, L=2, T=1000
    # there are 250 local tokens and L + 1 = 3 such layers: 250 * 3 * 192 = 144000 B more
    extra = COST.memory(1000, 4, 0, "cp") - COST.memory(1000, 4, 0)
    assert extra == pytest.approx(144000.0, rel=1e-12)
    # r = 2: only the one working layer holds it: 250 * 192 = 48000 B
    assert COST.memory(1000, 4, 2, "cp") - COST.memory(1000, 4, 2) == pytest.approx(48000.0)
    # min_recompute: where Ulysses just fits with no recompute (250 * 3010 B), cp needs
    # one layer (r=0: 250 * 3586 B; r=1: 250 * (1192 + 100 + 1192 + 10) = 250 * 2494 B)
    cap = float(COST.memory(1000, 4, 0))
    assert int(COST.min_recompute(1000, 4, cap)) == 0
    assert int(COST.min_recompute(1000, 4, cap, "cp")) == 1


def test_topology_two_level_graph_prices_the_ring_as_the_formula():
    graph = CostModel(MODEL, CLUSTER.with_(topology=two_level(CLUSTER)), COEFFS)
    for d, start in ((4, 0), (8, 0)):
        cls = graph.cluster.comm_class(start, d)
        want = COST.comm_time_per_layer(1000, d, d > 4, "cp")
        assert graph.comm_time_per_layer(1000, d, cls, "cp") == pytest.approx(want, rel=1e-12)
        got = graph.comm_time_per_layer(1000, d, None, "cp")  # the per-degree default
        assert got == pytest.approx(want, rel=1e-12)


def test_vectorised_matches_scalar():
    tokens = np.array([100.0, 1000.0, 5000.0])
    d = np.array([[2], [4], [8]])
    got = COST.comm_time_per_layer(tokens, d, d > 4, "cp")
    for i, dd in enumerate((2, 4, 8)):
        for j, t in enumerate(tokens):
            assert got[i, j] == COST.comm_time_per_layer(t, dd, dd > 4, "cp")


def test_bad_kind_and_cp_on_2d_are_one_line_errors():
    with pytest.raises(DcpOptError, match="sp kind: 'star' not allowed; allowed"):
        COST.time_parts(COST.features(_seq(10)), 2, 0, kind="star")
    dit = CostModel(model_preset("opensora-stdit3-xl"), CLUSTER)
    with pytest.raises(DcpOptError, match="'cp' not allowed for the 2d model"):
        dit.memory(100, 2, 0, "cp")


def test_cp_wins_past_the_heads_and_loses_across_nodes_without_gqa():
    # llama-7b (32 heads, no GQA) on 8 x 8 GPUs: at degree 64 Ulysses can split no further
    # than 32 heads, cp splits 1/64: a 1M-token sequence gains. At degree 16 over two nodes
    # cp's ring moves 15/16 of the whole K/V (2h per token) at the NIC rate, Ulysses 15/16 of
    # a sixteenth of q, k, v, o (4h): a 32K-token sequence loses
    from dcp_opt import cluster_preset

    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x64"))
    long_f, mid_f = cost.features(_seq(1 << 20)), cost.features(_seq(1 << 15))
    assert cost.time(long_f, 64, 0, kind="cp") < cost.time(long_f, 64, 0)
    assert cost.time(mid_f, 16, 0, kind="cp") > cost.time(mid_f, 16, 0)


def _seq(tokens: int):
    from dcp_opt.batch import Sequence

    return Sequence(0, (tokens,))
