"""The cost model by hand (issue 18, mutation testing of dcp_opt/cost/): every expectation
is arithmetic on literal numbers, written here from the formulas of docs/cost-model.md and
the comments of cost.py (cited at each test), never a call into cost.py that shares the code
under test. Coefficients are distinct and non-round, so that a swapped, dropped or doubled
term gives another number.

The 2D model of most tests: L = 3 layers, H = 4 heads, on 2 nodes of 3 GPUs (degrees 1, 3,
6), with hand-set coefficients (HAND_2D). A micro-batch of the videos (2, 1, 3) and (1, 2, 2)
(frames, height, width) has, summed over both (cost.py module doc):
    Q_spatial  = F S^2 = 2 * 3^2 + 1 * 4^2 = 34;   Q_temporal = S F^2 = 3 * 2^2 + 4 * 1^2 = 16
    T = 6 + 4 = 10 tokens;   S = 2 sequences.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dcp_opt import Batch, Cluster, CostModel, ModelSpec
from dcp_opt.cost import (
    BlockCoeffs,
    CostCoefficients,
    Efficiency,
    TermCoeffs,
    flops_coefficients,
    windowed_quad,
)
from dcp_opt.cost.cp import CPMeasurement
from dcp_opt.errors import DcpOptError


def close(got, want):
    return np.allclose(got, want, rtol=1e-12, atol=0)


# ---- FLOP-derived coefficients (flops_coefficients; docs/cost-model.md, "Compute") ----------
# Peak 1000 FLOP/s with these efficiencies: matmuls at 1000 * 0.5 = 500, attention at
# 1000 * 0.25 = 250 FLOP/s; backward 3x (matmuls) and 5x (attention) the forward; 7 s launch.
EFF = Efficiency(
    mfu_linear=0.5,
    mfu_attention=0.25,
    bwd_linear_ratio=3.0,
    bwd_attention_ratio=5.0,
    block_launch_s=7.0,
    microbatch_overhead_s=11.0,
    reserved_bytes=13.0,
)
PEAK = Cluster("peak", 1, 2, 1e6, 1000.0, 16.0, 4.0)


def terms(tc: TermCoeffs) -> tuple[float, float, float, float]:
    return (tc.quad, tc.lin, tc.seq, tc.const)


def test_flops_coefficients_of_a_gated_gqa_language_model():
    m = ModelSpec("gqa", "1d", 3, 8, 2, 12, vocab_size=10, gated_mlp=True, num_kv_heads=1)
    co = flops_coefficients(m, PEAK, EFF)
    # h = 8, f = 12, 2-byte dtype, kv/H = 1/2. Matmul parameters per block: q, o 2h^2 and
    # k, v 2 * h^2/2, SwiGLU 3hf: 128 + 64 + 288 = 480; forward FLOPs 2 per parameter = 960
    # -> 960 / 500 = 1.92 s per token. Causal attention 2h = 16 per unit of s^2 -> 16 / 250.
    assert set(co.blocks) == {"layer"}
    assert close(terms(co.blocks["layer"].fwd), (16 / 250, 1.92, 0.0, 7.0))
    # backward: attention 5x, matmuls 3x, launches 2x
    assert close(terms(co.blocks["layer"].bwd), (5 * 16 / 250, 3 * 1.92, 0.0, 14.0))
    # LM head 2 h V = 160 FLOPs per token forward (/ 500), twice that backward
    assert close((co.head_fwd_per_token_s, co.head_bwd_per_token_s), (0.32, 0.64))
    # saved bytes per token per layer: 2 * ((6 + 2 * 1/2) h + 4 f) = 2 * (56 + 48) = 208;
    # the layer input 1 block * 2 B * h = 16; logits + loss 6 V = 60
    assert close((co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer), (208, 16))
    assert co.head_bytes_per_token == 60
    # Ulysses: q, k, v, out: 4 h * 2 B = 64 bytes per token in 4 calls
    assert (co.a2a_bytes_per_token_layer, co.a2a_calls_per_layer) == (64, 4)
    assert (co.microbatch_overhead_s, co.reserved_bytes, co.source) == (11.0, 13.0, "flops")


def test_flops_coefficients_of_a_plain_mlp_language_model():
    m = ModelSpec("plain", "1d", 3, 8, 2, 12, vocab_size=10)
    co = flops_coefficients(m, PEAK, EFF)
    # multi-head qkvo 4h^2 = 256, plain MLP 2hf = 192: 448 parameters, 896 FLOPs / 500
    assert close(co.blocks["layer"].fwd.lin, 896 / 500)
    # saved: 2 * ((6 + 2) h + 2 f) = 2 * (64 + 24) = 176 bytes per token per layer
    assert co.act_bytes_per_token_layer == 176


def test_flops_coefficients_of_a_video_dit():
    m = ModelSpec("dit", "2d", 3, 8, 2, 12, text_tokens=5, causal=False, dtype_bytes=4)
    co = flops_coefficients(m, PEAK, EFF)
    # per block: qkvo 4h^2 + cross q, o 2h^2 + MLP 2hf = 256 + 128 + 192 = 576 parameters,
    # 1152 FLOPs, plus cross-attention scores and PV 4 h * 5 caption tokens = 160: 1312 / 500;
    # full attention 4h = 32 / 250; caption k, v 4 h^2 * 5 = 1280 per sequence / 500.
    fwd = (32 / 250, 1312 / 500, 1280 / 500, 7.0)
    bwd = (5 * 32 / 250, 3 * 1312 / 500, 3 * 1280 / 500, 14.0)
    assert set(co.blocks) == {"spatial", "temporal"}
    for b in co.blocks.values():
        assert close(terms(b.fwd), fwd) and close(terms(b.bwd), bwd)
    # head: projection to 64 patch channels, 2 h 64 = 1024 FLOPs (/ 500), 2x backward
    assert close((co.head_fwd_per_token_s, co.head_bwd_per_token_s), (2.048, 4.096))
    # saved: 2 blocks * 4 B * (13 h + 2 f) = 8 * 128 = 1024; input 2 * 4 * 8 = 64; head 4hb
    assert (co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer) == (1024, 64)
    assert co.head_bytes_per_token == 128
    # two DSP switches of the activations, h * 4 B each: 64 bytes per token in 2 calls
    assert (co.a2a_bytes_per_token_layer, co.a2a_calls_per_layer) == (64, 2)
    assert co.source == "flops"


# ---- features (cost.py module doc; CostModel._quad_1d) ---------------------------------------
def test_windowed_quad_by_hand():
    t = np.array([3.0, 10.0])
    # window 4 on a quarter of the layers: s^2 - 1/4 (s - 4)^2 for s > 4: 9, 100 - 9 = 91
    assert close(windowed_quad(t, 4, 0.25), [9.0, 91.0])
    assert close(windowed_quad(10.0, 4), 100.0 - 36.0)  # every layer windowed by default
    assert windowed_quad(10.0) == 100.0  # no window by default
    assert windowed_quad(5.0, 0, 0.5) == 25.0  # window 0: none, whatever the share


def test_language_features_by_hand():
    m = ModelSpec("win", "1d", 4, 8, 2, 12, vocab_size=10, window=4, windowed_layers=1)
    cost = CostModel(m, PEAK)
    batch = Batch.from_lengths([3, 10])
    # [Q, T, S]: one of 4 layers windowed at 4 keys: Q = s^2 - (s - 4)^2 / 4
    assert close(cost.features(batch.sequences[1]), [91.0, 10.0, 1.0])
    assert close(cost.batch_features(batch), [[9.0, 3.0, 1.0], [91.0, 10.0, 1.0]])
    plain = CostModel(replace(m, window=0, windowed_layers=0), PEAK)
    assert close(plain.features(batch.sequences[1]), [100.0, 10.0, 1.0])


def test_video_features_by_hand():
    cost = CostModel(DIT, HAND)
    batch = Batch.from_shapes([(2, 1, 3), (1, 2, 2)])
    # [F S^2, S F^2, T, 1] with S = height * width
    assert close(cost.features(batch.sequences[0]), [18.0, 12.0, 6.0, 1.0])
    assert close(cost.batch_features(batch), [[18.0, 12.0, 6.0, 1.0], [16.0, 4.0, 4.0, 1.0]])


def test_a_sequence_of_the_other_kind_is_refused_by_name():
    cost = CostModel(DIT, HAND)
    seq = Batch.from_lengths([5]).sequences[0]
    with pytest.raises(DcpOptError, match=r"sequence 0: a 1d shape \(5,\) does not fit the 2d "):
        cost.features(seq)


# ---- time of a micro-batch (cost.py module doc; docs/cost-model.md) --------------------------
DIT = ModelSpec("hand-dit", "2d", 3, 8, 4, 12, text_tokens=5, causal=False, num_params=1000.0)
HAND = Cluster("hand", 2, 3, 1000.0, 1000.0, 16.0, 4.0, 0.01, 0.05)
HAND_2D = CostCoefficients(
    blocks={
        "spatial": BlockCoeffs(TermCoeffs(0.5, 3.0, 7.0, 0.25), TermCoeffs(1.5, 5.0, 11.0, 0.75)),
        "temporal": BlockCoeffs(
            TermCoeffs(0.125, 2.0, 13.0, 0.5), TermCoeffs(0.375, 6.0, 17.0, 1.25)
        ),
    },
    head_fwd_per_token_s=0.01,
    head_bwd_per_token_s=0.03,
    microbatch_overhead_s=0.7,
    a2a_bytes_per_token_layer=64.0,
    a2a_calls_per_layer=2,
    act_bytes_per_token_layer=100.0,
    ckpt_bytes_per_token_layer=30.0,
    head_bytes_per_token=9.0,
    reserved_bytes=1000.0,
)
VIDEOS = Batch.from_shapes([(2, 1, 3), (1, 2, 2)]).sequences


def dit_cost(**kw) -> CostModel:
    return CostModel(DIT, HAND, HAND_2D, grad_reduce_bytes_per_param=2.0, **kw)


# One layer at d = 3: heads share ceil(4/3)/4 = 1/2; features [34, 16, 10, 2] (module doc).
# fwd = 1/2 (0.5 * 34 + 0.125 * 16) + (3 + 2) * 10/3 + (7 + 13) * 2/3 + (0.25 + 0.5)
#     = 9.5 + 50/3 + 40/3 + 0.75 = 40.25
# bwd = 1/2 (1.5 * 34 + 0.375 * 16) + (5 + 6) * 10/3 + (11 + 17) * 2/3 + (0.75 + 1.25)
#     = 28.5 + 110/3 + 56/3 + 2 = 515/6
FWD3, BWD3 = 40.25, 515 / 6
# compute = L (fwd + bwd) + T/d (head fwd + bwd) + overhead = 3 * (40.25 + 515/6) + 10/3 * 0.04 + 0.7
COMPUTE3 = 3 * (FWD3 + BWD3) + 10 / 3 * 0.04 + 0.7
# all-to-all of one layer at d = 3 (one node: 3 <= 3 GPUs per node): each rank sends
# (d-1)/d of its T/d tokens, 64 * 10/3 * 2/3 = 1280/9 bytes at 16 B/s, plus 2 calls x
# 0.01 s x (d - 1) peers
A2A3 = 1280 / 9 / 16 + 2 * 0.01 * 2


def test_microbatch_time_by_hand():
    cost = dit_cost()
    t = cost.microbatch_time(VIDEOS, 3, 2)
    # two recomputed layers: one more forward each; comm (2L + r) layers of all-to-alls
    assert close((t.compute_s, t.recompute_s), (COMPUTE3, 2 * FWD3))
    assert close(t.comm_s, (2 * 3 + 2) * A2A3)
    assert close(t.total_s, COMPUTE3 + 2 * FWD3 + 8 * A2A3)
    # at half speed compute and recompute take twice as long; communication does not
    slow = cost.microbatch_time(VIDEOS, 3, 2, speed=0.5)
    assert close(
        (slow.compute_s, slow.recompute_s, slow.comm_s), (2 * COMPUTE3, 4 * FWD3, t.comm_s)
    )


def test_layer_times_and_time_by_hand():
    cost = dit_cost()
    feats = np.array([[34.0, 16.0, 10.0, 2.0]])
    fwd, bwd = cost.layer_times(feats, 3)
    assert close(fwd, [FWD3]) and close(bwd, [BWD3])
    assert close(cost.time(feats, 3), [COMPUTE3 + 6 * A2A3])  # no recompute by default
    assert close(cost.time(feats, 3, 1), [COMPUTE3 + FWD3 + 7 * A2A3])
    assert close(cost.comm_time_per_layer(10.0, 3, False), A2A3)


# At d = 6 (both nodes): heads share ceil(4/6)/4 = 1/4.
# fwd = 1/4 * 19 + 5 * 10/6 + 20 * 2/6 + 0.75 = 4.75 + 50/6 + 40/6 + 0.75 = 20.5
# bwd = 1/4 * 57 + 11 * 10/6 + 28 * 2/6 + 2 = 14.25 + 166/6 + 2
FWD6, BWD6 = 20.5, 14.25 + 166 / 6 + 2
# all-to-all: 64 * 10/6 * 5/6 = 800/9 bytes; the peers on the other node, (6 - 3)/(6 - 1)
# = 0.6 of them, at 4 B/s, the rest at 16; latency 2 calls x 0.05 s x 5 peers
A2A6 = 800 / 9 * 0.4 / 16 + 800 / 9 * 0.6 / 4 + 2 * 0.05 * 5
COMPUTE6 = 3 * (FWD6 + BWD6) + 10 / 6 * 0.04 + 0.7


def test_a_group_across_nodes_by_hand():
    cost = dit_cost()
    t = cost.microbatch_time(VIDEOS, 6, 1)
    assert close(t.recompute_s, FWD6)
    assert close(t.compute_s, COMPUTE6)
    assert close(t.comm_s, 7 * A2A6)
    # one GPU sends nothing, whatever spans_nodes says
    assert close(cost.comm_time_per_layer(10.0, 1, True), 0.0)


def test_degree_columns_match_each_degree_by_hand():
    cost = dit_cost()
    feats = np.array([[34.0, 16.0, 10.0, 2.0], [18.0, 12.0, 6.0, 1.0]])
    fwd, bwd = cost.layer_times(feats, np.array([[3], [6]]))
    assert fwd.shape == (2, 2) and close(fwd[:, 0], [FWD3, FWD6]) and close(bwd[:, 0], [BWD3, BWD6])
    # the second row alone (2, 1, 3): fwd at d = 3 = 1/2 (9 + 1.5) + 5 * 2 + 20/3 + 0.75
    assert close(fwd[0, 1], 5.25 + 10 + 20 / 3 + 0.75)
    # another column on the same (memoised) model: its own rows, in its order
    fwd, _ = cost.layer_times(feats, np.array([[6], [3]]))
    assert close(fwd[:, 0], [FWD6, FWD3])
    r = np.array([[2, 0], [1, 0]])
    got = cost.time_by_degree(feats, np.array([3, 6]), r)
    # d = 6 with one recomputed layer: as test_a_group_across_nodes_by_hand
    want0 = [COMPUTE3 + 2 * FWD3 + 8 * A2A3, COMPUTE6 + FWD6 + 7 * A2A6]
    assert close(got[:, 0], want0)


class _PerDegree(CostModel):
    """A subclass that prices one degree at a time (as recalibrate.RecalibratedCostModel)."""

    def time_parts(self, feats, d, recompute_layers, **kw):
        assert np.ndim(d) == 0, "a per-degree subclass gets one degree"
        return super().time_parts(feats, d, recompute_layers, **kw)


def test_time_by_degree_of_a_per_degree_subclass():
    cost = _PerDegree(DIT, HAND, HAND_2D, grad_reduce_bytes_per_param=2.0)
    assert not cost.takes_degree_vectors and dit_cost().takes_degree_vectors
    feats = np.array([[34.0, 16.0, 10.0, 2.0]])
    got = cost.time_by_degree(feats, [3, 6], np.array([[2], [1]]))
    assert close(got[:, 0], [COMPUTE3 + 2 * FWD3 + 8 * A2A3, COMPUTE6 + FWD6 + 7 * A2A6])


def test_spans_nodes_default_is_more_gpus_than_a_node():
    # d = 3 fills one node of 3 exactly: NVLink latency (0.01), not the NIC's (0.05)
    cost = dit_cost()
    assert close(cost.time_parts(np.array([[34.0, 16.0, 10.0, 2.0]]), 3, 0)[2], [6 * A2A3])


def test_measured_knobs_by_hand():
    # sp_compute_overhead x = 0.1 at d = 3 multiplies the layer (launch constants included);
    # replicated_seq_s 0.9 s per sample over 3 layers: 1/3 of 0.3 in each forward, 2/3 in
    # each backward, for S = 2 samples: + 0.2 s forward, + 0.4 s backward per layer
    cost = dit_cost(sp_compute_overhead=((3, 0.1),), replicated_seq_s=0.9)
    fwd, bwd = cost.layer_times(np.array([[34.0, 16.0, 10.0, 2.0]]), 3)
    assert close(fwd, [1.1 * (FWD3 + 0.2)]) and close(bwd, [1.1 * (BWD3 + 0.4)])
    fwd6, _ = cost.layer_times(np.array([[34.0, 16.0, 10.0, 2.0]]), 6)
    assert close(fwd6, [FWD6 + 0.2])  # no overhead listed at 6


# ---- context parallelism on a 1D model (dcp_opt/cost/cp.py; heads split 1/d, K/V gathered) -------------
LM = ModelSpec("hand-lm", "1d", 2, 24, 6, 12, vocab_size=10, num_kv_heads=2, num_params=500.0)
ONE_NODE = Cluster("one", 1, 4, 1e6, 1000.0, 16.0, 4.0, 0.01, 0.05)
HAND_1D = replace(
    HAND_2D,
    blocks={"layer": HAND_2D.blocks["spatial"]},
    a2a_calls_per_layer=4,
)


def lm_cost(**kw) -> CostModel:
    return CostModel(LM, ONE_NODE, HAND_1D, grad_reduce_bytes_per_param=2.0, **kw)


def test_ulysses_and_cp_layers_by_hand():
    cost = lm_cost(sp_kinds=("ulysses", "cp"))
    seq = Batch.from_lengths([6]).sequences
    # 6 tokens: Q = 36, T = 6, S = 1, at d = 4. Ulysses: ceil(6/4)/6 = 1/3 of the heads;
    # cp: 1/4 of the attention (head-tail chunks).
    # Ulysses fwd = 0.5 * 36/3 + 3 * 6/4 + 7/4 + 0.25 = 6 + 4.5 + 1.75 + 0.25 = 12.5
    #         bwd = 1.5 * 36/3 + 5 * 6/4 + 11/4 + 0.75 = 18 + 7.5 + 2.75 + 0.75 = 29
    # cp      fwd = 0.5 * 9 + 6.5 = 11;  bwd = 1.5 * 9 + 11 = 24.5
    # compute = L (fwd + bwd) + 6/4 * 0.04 + 0.7
    uly = cost.microbatch_time(seq, 4, 1)
    cp = cost.microbatch_time(seq, 4, 1, kind="cp")
    assert close((uly.compute_s, uly.recompute_s), (2 * 41.5 + 0.06 + 0.7, 12.5))
    assert close((cp.compute_s, cp.recompute_s), (2 * 35.5 + 0.06 + 0.7, 11.0))
    fwd, _ = cost.layer_times(np.array([[36.0, 6.0, 1.0]]), np.array([[4]]), "cp")
    assert close(fwd, [[11.0]])
    # Ulysses at the same degree on the same (memoised) model keeps its own figure
    fwd, _ = cost.layer_times(np.array([[36.0, 6.0, 1.0]]), np.array([[4]]))
    assert close(fwd, [[12.5]])
    # Ulysses all-to-all at d = 4 (GQA, 2 kv heads of 6: the kv heads are repeated to 6,
    # model.ulysses_kv_heads, so the full 64 B): 64 * 6/4 * 3/4 = 72 bytes at 16 B/s, plus
    # 4 calls x 0.01 x 3 peers
    assert close(cost.comm_time_per_layer(6.0, 4, False), 72 / 16 + 4 * 0.01 * 3)


def test_measured_cp_collectives_by_hand():
    # K/V of one token: 2 kv heads x head_dim 4 x (K, V) x 2 B = 32 bytes; 6 tokens at d = 4
    # (one node): each rank sends (d-1)/d of the gathered 192 bytes, 144 (Thakur et al. 2005).
    # Measured at group size 4: all-gather 8 B/s and 0.3 s per call (0.1 per ring step),
    # reduce-scatter 4 B/s and 0.6 s (0.2 per step): 144/8 + 3 * 0.1 = 18.3 s forward,
    # 144/4 + 3 * 0.2 = 36.6 s backward. L = 2 layers, r = 1: forwards (L + r) x 18.3 and
    # backwards L x 36.6
    measured = (CPMeasurement(4, 8.0, 0.3, 4.0, 0.6),)
    cost = lm_cost(sp_kinds=("ulysses", "cp"), cp_comm=measured)
    seq = Batch.from_lengths([6]).sequences
    assert close(cost.microbatch_time(seq, 4, 1, kind="cp").comm_s, 3 * 18.3 + 2 * 36.6)


def test_cp_is_refused_for_a_video_model():
    with pytest.raises(DcpOptError, match="sp kind: 'cp' not allowed for the 2d model"):
        dit_cost().time_parts(np.array([[34.0, 16.0, 10.0, 2.0]]), 3, 0, kind="cp")


def test_gqa_all_to_all_bytes_by_hand():
    cost = lm_cost()
    # H = 6, kv = 2 (model.ulysses_kv_heads): d = 1, 2 divide kv: 2 kv heads sent, share
    # (2 + 2 * 2/6) / 4 = 2/3 of 64; d = 4: neither divides, repeated to 6 heads: share 1
    assert close(cost.a2a_bytes_per_token(np.array([1, 2, 4])), [128 / 3, 128 / 3, 64.0])
    assert cost.a2a_bytes_per_token(np.array([], dtype=int)).shape == (0,)


# ---- memory (Korthikanti et al. 2022 sec. 4; ZeRO sec. 3; cost.py module doc) ---------------
def test_memory_by_hand():
    cost = dit_cost()
    # model states: 1000 parameters x (2 + 4 + 12/6) B under zero1 on 6 GPUs = 8000, +1000
    # reserved; per token at d = 3 with r = 2 of 3 layers recomputed:
    # (3 - 2) * 100 + 2 * 30 + 100 (working layer) + 9 (head) = 269 bytes, x 10/3 tokens
    assert cost.fixed_bytes() == 9000.0
    assert close(cost.memory(10, 3, 2), 9000 + 10 / 3 * 269)
    assert close(cost.memory(10, 3), 9000 + 10 / 3 * 409)  # none recomputed by default
    unsharded = dit_cost(optimizer_sharding="none")
    assert unsharded.model_state_bytes() == 18000.0  # 1000 x (2 + 4 + 12)


def test_min_recompute_by_hand():
    cost = dit_cost()
    # 30 tokens at d = 3: t = 10 per member; room = capacity - 9000 fixed; all layers kept
    # need 10 * (4 * 100 + 9) = 4090, each recomputed layer saves 10 * (100 - 30) = 700
    caps = np.array([9000 + 4090, 9000 + 4090 - 1400, 9000 + 4090 - 1401, 9000 + 4090 - 2101])
    assert cost.min_recompute(30, 3, caps).tolist() == [0, 2, 3, -1]  # 4 > L = 3 layers
    # exactly at capacity with r = 2: memory(30, 3, 2) = 9000 + 10 * 269 = 11690
    assert close(cost.memory(30, 3, 2), 11690)
    # no room at all (capacity = fixed bytes) refuses even an empty micro-batch; half a byte
    # of room holds it
    assert cost.min_recompute(0, 3, 9000.0) == -1
    assert cost.min_recompute(0, 3, 9000.5) == 0
    # a recomputed layer that saves nothing (ckpt = act) cannot make a short fit
    flat = dit_cost().with_(coeffs=replace(HAND_2D, ckpt_bytes_per_token_layer=100.0))
    assert flat.min_recompute(30, 3, 9000 + 4090 - 0.5) == -1


def test_cp_memory_by_hand():
    cost = lm_cost(sp_kinds=("ulysses", "cp"))
    # states 500 x (2 + 4 + 12/4) = 4500, + 1000 reserved. cp keeps the gathered K/V of the
    # d - 1 others per layer: 2 kv heads x head_dim 4 x 2 (K, V) x 2 B = 32 bytes per token
    # each (cost.cp.kv_bytes_per_token), 3 x 32 = 96 at d = 4: act 100 + 96 = 196.
    # 8 tokens, d = 4, r = 1 of 2: 2 * ((2 - 1) * 196 + 30 + 196 + 9) = 862
    assert close(cost.memory(8, 4, 1, "cp"), 5500 + 862)
    assert close(cost.memory(8, 4, 1), 5500 + 2 * (100 + 30 + 100 + 9))
    # min_recompute: base 2 * (3 * 196 + 9) = 1194, saved 2 * (196 - 30) = 332 per layer
    assert cost.min_recompute(8, 4, 5500 + 1194 - 332, "cp") == 1
    assert cost.min_recompute(8, 4, 5500 + 1194 - 332) == 0  # Ulysses keeps all 2 layers


def test_capacity_by_hand():
    mixed = HAND.with_(memory_per_rank=(400.0, 300.0, 200.0, 500.0, 600.0, 700.0))
    cost = dit_cost(usable_memory_fraction=0.8).with_(cluster=mixed)
    # rank 0 alone by default; a group has its smallest member's memory
    assert close((cost.capacity(), cost.capacity(0, 3), cost.capacity(3, 3)), (320, 160, 400))
