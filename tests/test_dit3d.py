"""Full-attention video DiTs (ModelSpec kind "3d", issue 27): the cost model's attention FLOPs
of a 3-D sequence by hand (text included), the other terms, the workloads' token counts, and
valid plans for every preset. Expectations are arithmetic on literal numbers written from
dcp_opt/cost/dit3d.py's docstring, not calls into it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcp_opt import Batch, Cluster, CostModel, ModelSpec, validate
from dcp_opt.cli import main
from dcp_opt.cost import Efficiency, flops_coefficients
from dcp_opt.errors import DcpOptError
from dcp_opt.model import MODEL_PRESETS
from dcp_opt.plan import Plan
from dcp_opt.topology.presets import cluster_preset
from dcp_opt.video3d import VAES, opensora_px
from dcp_opt.workloads import Workload, standard_batch, video_buckets

# Peak 1000 FLOP/s: matmuls at 1000 * 0.5 = 500 FLOP/s, attention at 1000 * 0.25 = 250;
# backward 3x (matmuls) and 5x (attention) the forward; 7 s per block launch.
EFF = Efficiency(0.5, 0.25, 3.0, 5.0, 7.0, 11.0, 13.0)
PEAK = Cluster("peak", 1, 2, 1e6, 1000.0, 16.0, 4.0)
PRESETS_3D = ("opensora2-11b", "hunyuanvideo-13b", "wan2.1-14b", "wan2.1-1.3b")

# h = 8, 2 heads, f = 12; 3 layers of which 1 single-stream; 5 text tokens.
JOINT = ModelSpec("j", "3d", 3, 8, 2, 12, text_tokens=5, causal=False, text_mode="joint",
                  single_layers=1)  # fmt: skip
CROSS = ModelSpec("c", "3d", 3, 8, 2, 12, text_tokens=5, causal=False, text_mode="cross")


def test_joint_attention_flops_of_a_3d_sequence_include_the_text_by_hand():
    cost = CostModel(JOINT, PEAK, coeffs=flops_coefficients(JOINT, PEAK, EFF))
    # a clip of 2 latent frames x 3 x 4 tokens: v = 24 video tokens, + j = 5 text tokens
    # join the sequence: n = 29, every token sees every token (non-causal): 29^2 = 841 pairs.
    feats = cost.features(Batch.from_shapes([(2, 3, 4)]).sequences[0])
    assert feats.tolist() == [841.0, 24.0, 1.0]
    fwd = cost.layer_times(feats[None, :], 1)[0][0]
    # attention: QK^T and PV, 2 x 2 h = 32 FLOPs per pair: 32 * 841 = 26912 FLOPs / 250
    # = 107.648 s. Matmuls per token: q k v o 4h^2 = 256 + MLP 2hf = 192 = 448 parameters,
    # 896 FLOPs, for the 24 video tokens and the 5 text tokens: 896 * 29 / 500 = 51.968 s.
    # + 7 s launch.
    assert np.isclose(fwd, 26912 / 250 + 896 * 29 / 500 + 7.0, rtol=1e-12)
    # the same clip without its text would score 24^2 = 576 pairs: the text is in Q
    assert cost.features(Batch.from_shapes([(1, 1, 1)]).sequences[0])[0] == 36.0  # (1 + 5)^2


def test_cross_attention_3d_sequence_by_hand():
    co = flops_coefficients(CROSS, PEAK, EFF)
    f = co.blocks["layer"].fwd
    # self-attention over the video only: 4h = 32 FLOPs per pair; per video token: q k v o
    # 4h^2 = 256, cross q o 2h^2 = 128, MLP 2hf = 192 -> 576 parameters, 1152 FLOPs, + the
    # scores and PV against 5 text tokens 4hj = 160: 1312; per sample the text's k and v:
    # 2 x 2 h^2 j = 1280 FLOPs.
    assert np.allclose((f.quad, f.lin, f.seq, f.const), (32 / 250, 1312 / 500, 1280 / 500, 7.0))
    cost = CostModel(CROSS, PEAK, coeffs=co)
    assert cost.features(Batch.from_shapes([(2, 3, 4)]).sequences[0]).tolist() == [576, 24, 1]


def test_3d_memory_and_all_to_all_bytes_by_hand():
    j, c = flops_coefficients(JOINT, PEAK, EFF), flops_coefficients(CROSS, PEAK, EFF)
    # joint: 2 double-stream layers 10h + 2f = 104, 1 single-stream 8h + 2f = 88, 2 bytes:
    # 2 * (2/3 * 104 + 1/3 * 88) = 197.33...; cross: 2 * (15h + 2f) = 2 * 144 = 288
    assert np.isclose(j.act_bytes_per_token_layer, 2 * (2 / 3 * 104 + 1 / 3 * 88))
    assert c.act_bytes_per_token_layer == 288
    # Ulysses: q, k, v, out of the (self-)attention, 4h * 2 B = 64 per token, in 4 calls
    assert (j.a2a_bytes_per_token_layer, j.a2a_calls_per_layer) == (64, 4)
    assert (c.ckpt_bytes_per_token_layer, c.head_bytes_per_token) == (16, 64)


def test_3d_features_of_a_packed_batch_are_the_sum_of_its_rows():
    cost = CostModel(JOINT, PEAK, coeffs=flops_coefficients(JOINT, PEAK, EFF))
    b = Batch.from_shapes([(2, 3, 4), (1, 1, 1), (5, 2, 2)])
    rows = cost.batch_features(b)
    # each sample has its own text: (24 + 5)^2, (1 + 5)^2, (20 + 5)^2
    assert rows[:, 0].tolist() == [841.0, 36.0, 625.0]
    assert np.array_equal(rows, np.stack([cost.features(s) for s in b.sequences]))


def test_3d_model_fields_are_checked_by_name():
    with pytest.raises(DcpOptError, match="model.text_mode"):
        ModelSpec("x", "3d", 3, 8, 2, 12, causal=False)
    with pytest.raises(DcpOptError, match="model.text_mode"):
        ModelSpec("x", "2d", 3, 8, 2, 12, text_mode="joint")
    with pytest.raises(DcpOptError, match="model.single_layers"):
        ModelSpec("x", "3d", 3, 8, 2, 12, causal=False, text_mode="cross", single_layers=1)
    with pytest.raises(DcpOptError, match="model.causal"):
        ModelSpec("x", "3d", 3, 8, 2, 12, text_mode="cross")
    # 1d/2d documents (and fingerprints) do not change
    assert "text_mode" not in MODEL_PRESETS["opensora-stdit3-xl"].to_dict()
    assert ModelSpec.from_dict(JOINT.to_dict()) == JOINT


def test_3d_model_refuses_1d_lengths():
    cost = CostModel(JOINT, PEAK, coeffs=flops_coefficients(JOINT, PEAK, EFF))
    with pytest.raises(DcpOptError, match="does not fit"):
        cost.features(Batch.from_lengths([10]).sequences[0])


def test_tokens_of_the_published_vaes_and_buckets():
    # 4x causal temporal, 8x spatial, 2x2 patch: 129 frames -> 1 + 128 // 4 = 33 latent
    # frames; 720p at 9:16: ceil(720 / 16) x ceil(1280 / 16) = 45 x 80
    assert VAES["wan2.1"].shape(720, 1280, 129) == (33, 45, 80)
    assert VAES["hunyuanvideo"].shape(480, 854, 1) == (1, 30, 54)  # an image: one frame
    # Open-Sora 2.0's 256px and 768px at 16:9 (opensora/datasets/aspect.py)
    assert opensora_px(256) == (192, 336) and opensora_px(768) == (576, 1024)
    shapes = {b[2] for b in video_buckets("3d")}
    assert len(shapes) == 25 and (33, 45, 80) in shapes and (9, 9, 16) in shapes


def test_opensora2_stage_workloads_draw_their_buckets():
    b = standard_batch("3d-opensora2-768px", 0, num_gpus=1, tokens_per_gpu=2_000_000)
    # 768px clips of 129 frames: 33 x 36 x 64 = 76,032 tokens, the stage's largest sample
    assert max(s.num_tokens for s in b.sequences) <= 33 * 36 * 64
    assert {s.shape[1:] for s in b.sequences} <= {(12, 21), (36, 64)}
    assert Workload.parse("3d-opensora2-256px").name == "3d-opensora2-256px"
    with pytest.raises(DcpOptError, match="3d-balanced"):
        Workload.parse("3d-nope")


@pytest.mark.parametrize("name", PRESETS_3D)
def test_every_3d_preset_plans_validly_on_h200x32(name, tmp_path):
    out, plan = tmp_path / "s.json", tmp_path / "p.json"
    args = ["plan", "--workload", "3d-balanced", "--model", name, "--cluster", "h200x32"]
    assert main([*args, "--planner", "greedy", "--out", str(plan), "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["model"] == name and s["status"] == "feasible"
    # validated again here, independently of the command
    cost = CostModel(MODEL_PRESETS[name], cluster_preset("h200x32"))
    batch = standard_batch("3d-balanced", 0)
    assert validate(Plan.from_json(plan.read_text()), batch, cost) == []


def test_bench_one_batch_takes_a_3d_workload_with_its_own_model():
    from dcp_opt.analysis.bench import BenchConfig, run_bench

    cfg = BenchConfig("h200x8", ("3d-short", "2d-short"), ("bucket", "greedy"), 1,
                      models={"3d": "wan2.1-1.3b"}, tokens_per_gpu=16384)  # fmt: skip
    doc = run_bench(cfg)
    assert doc["config"]["models"]["3d"] == "wan2.1-1.3b"
    rows = {(r["workload"], r["planner"]): r for r in doc["summary"]}
    assert rows[("3d-short", "greedy")]["model"] == "wan2.1-1.3b"
    assert rows[("2d-short", "greedy")]["model"] == "opensora-stdit3-xl"
    assert all(r["all_valid"] for r in rows.values())


def test_stream_runs_the_published_samplers_on_a_3d_workload():
    from dcp_opt.analysis.stream import StreamConfig, run_stream

    cfg = StreamConfig(cluster="h200x8", workloads=("3d-opensora2-256px",), num_batches=2,
                       step_sizes=(2**20,), planners=("greedy",), published=("bucket",),
                       models={"3d": "wan2.1-1.3b"})  # fmt: skip
    doc = run_stream(cfg)
    methods = {r["method"] for r in doc["methods"]}
    assert {"bucket", "greedy@1M"} <= methods
    assert all(r["workload"] == "3d-opensora2-256px" for r in doc["methods"])
