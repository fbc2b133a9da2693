"""The profiler's block for full-attention video DiTs (kind "3d"): features by hand, a noiseless
fake device whose per-layer coefficients the fit must recover through a multi-layer call, the
real tiny blocks, and `dcp-opt profile` for the tiny targets and a 3d model."""

import json
import warnings

import pytest
import torch
from dcp_opt.runtime.profile import measure as P
from dcp_opt.runtime.profile.blocks import ProfileTarget, dit3d_target

from dcp_opt import Batch, ModelSpec, cluster_preset
from dcp_opt.fit import block_features
from dcp_opt.profile_io import cost_model_from_profile, save_profile
from tests.test_profiler import BWD, FWD, FakeClock, H, ScaleExp, _Charge

J = 5  # joint text tokens per sample
SPEC = ModelSpec(
    "fake3d", "3d", 12, H, 2, 16, text_tokens=J, causal=False, text_mode="joint",
    single_layers=8, dtype_bytes=4,
)  # fmt: skip
GRID = P.ProfileConfig(
    grid=P.Grid(frames=(1, 2, 4), spatial=((2, 2), (4, 4), (4, 6)), pack_2d=(1, 2)),
    warmup=0, repeats=1, passes=1, min_time_s=0.0, num_threads=None,
)  # fmt: skip


def test_3d_features_by_hand():
    # (2,3,4): 24 video tokens, (1,2,2): 4; joint text 5 each: Q = 29^2 + 9^2 = 841 + 81 = 922
    assert list(block_features("layer", [(2, 3, 4), (1, 2, 2)], joint_text=J)) == [922, 28, 2]
    # cross-attention: the text is not in the sequence, Q = 24^2 + 4^2 = 592
    assert list(block_features("layer", [(2, 3, 4), (1, 2, 2)])) == [592, 28, 2]


class ThreeLayerBlock:
    """A 3d "layer" adapter that runs 3 layers per call (one double, two single) on FakeClock:
    each layer costs FWD / BWD of its features, so a call costs 3x; the profile must give
    one layer's coefficients."""

    block_type, layers_per_call, joint_text = "layer", 3, J

    def __init__(self, clock):
        self.clock, self.module = clock, ScaleExp()

    def make_inputs(self, shapes, *, dtype, device):
        t = sum(f * h * w for f, h, w in shapes)
        return [(torch.randn(t, H, dtype=dtype).requires_grad_(True), tuple(shapes))]

    def forward(self, inputs):
        out = []
        for x, shapes in inputs:
            q = sum((f * h * w + J) ** 2 for f, h, w in shapes)  # written out, not the code's
            t, n = sum(f * h * w for f, h, w in shapes), len(shapes)
            fwd = 3 * (FWD["quad"] * q + FWD["lin"] * t + FWD["seq"] * n + FWD["const"])
            bwd = 3 * (BWD["quad"] * q + BWD["lin"] * t + BWD["seq"] * n + BWD["const"])
            out.append(self.module(_Charge.apply(x, self.clock, fwd, bwd)))
        return out


def test_fake_clock_3d_profile_recovers_one_layers_coefficients(tmp_path):
    clock = FakeClock()
    target = ProfileTarget(SPEC, {"layer": ThreeLayerBlock(clock)}, signature="fake3d")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # noiseless: no poor-fit warning
        prof = P.profile_model(target, GRID, clock=clock, progress=False)
    got = prof.coefficients.blocks["layer"]
    for k, v in FWD.items():
        assert getattr(got.fwd, k) == pytest.approx(v, rel=1e-6), k
    for k, v in BWD.items():
        assert getattr(got.bwd, k) == pytest.approx(v, rel=1e-6), k
    # exp(x*w) saves x and y, 2 * 8 * 4 = 64 B per token per call, 3 layers: 64 / 3 per layer;
    # a checkpointed call keeps its input once, as a checkpointed layer does: 32 B
    assert prof.coefficients.act_bytes_per_token_layer == pytest.approx(64 / 3)
    assert prof.coefficients.ckpt_bytes_per_token_layer == pytest.approx(32)
    # The saved profile prices a (3, 4, 4) sample at degree 1: 48 video tokens, Q = 53^2 =
    # 2809; per layer fwd 2809e-6 + 48 x 2e-4 + 3e-3 + 5e-3 = 0.020409, bwd 2 x 2809e-6 +
    # 48 x 4e-4 + 1e-3 + 2e-3 = 0.027818; 12 layers: 12 x 0.048227 = 0.578724 s
    path = save_profile(prof, tmp_path / "fake3d.json")
    cost = cost_model_from_profile(path, SPEC, cluster_preset("h200x8"))
    t = cost.microbatch_time(list(Batch.from_shapes([(3, 4, 4)]).sequences), 1)
    assert t.total_s == pytest.approx(0.578724, rel=1e-6)


@pytest.mark.parametrize("mode, single, per_call", [("joint", 8, 2), ("cross", 0, 1)])
def test_tiny_3d_blocks_measure(mode, single, per_call):
    # joint 4 double : 8 single -> one double and two single blocks a call (gcd 4)
    spec = ModelSpec(
        "t", "3d", 12, 24, 4, 32, text_tokens=3, causal=False, text_mode=mode,
        single_layers=single,
    )  # fmt: skip
    target = dit3d_target(spec)
    layer = target.blocks["layer"]
    assert layer.layers_per_call == per_call + (mode == "joint")
    assert layer.joint_text == (3 if mode == "joint" else 0)
    ((img, txt, ctx),) = layer.make_inputs(
        [(2, 2, 3), (1, 2, 2)], dtype=torch.float32, device="cpu"
    )
    assert img.shape == (16, 24) and txt.shape == (6, 24)  # 12 + 4 video, 2 x 3 text tokens
    p = P.measure_block(
        layer, ((2, 2, 3), (1, 2, 2)), recompute=False, clock=P.CpuClock(), warmup=0,
        repeats=1, dtype=torch.float32,
    )  # fmt: skip
    assert p.fwd_s > 0 and p.bwd_s > 0 and p.tokens == 16 and p.saved_bytes > 0


def test_tiny_3d_block_takes_a_published_head_width():
    # 128-wide heads (every 3d preset): Wan's RoPE split 44 + 42 + 42, no multiple of 6 needed
    spec = ModelSpec("w", "3d", 2, 256, 2, 64, text_tokens=2, causal=False, text_mode="cross")
    layer = dit3d_target(spec).blocks["layer"]
    out = layer.forward(layer.make_inputs([(1, 2, 2)], dtype=torch.float32, device="cpu"))
    assert out[0].shape == (4, 256)


@pytest.mark.parametrize("target", ["tiny-mmdit", "tiny-wan"])
def test_cli_profiles_a_tiny_3d_model(tmp_path, capsys, target):
    from dcp_opt.cli import main
    from dcp_opt.profile_io import load_profile

    out = tmp_path / "p.json"
    argv = ["profile", "-o", str(out), "--quick", "--no-progress", "--json", "--no-cache"]
    argv += ["--target", target, "--hidden", "24", "--heads", "2", "--ffn", "32", "--layers", "4"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["fit"]["layer"]["fwd"]["n_train"] >= 4
    prof = load_profile(out)
    assert prof.model.kind == "3d" and prof.model.num_layers == 4
    assert prof.model.text_mode == ("joint" if target == "tiny-mmdit" else "cross")
    assert prof.model.single_layers == (2 if target == "tiny-mmdit" else 0)


def test_cli_profile_refuses_a_non_3d_model_and_odd_heads(tmp_path, capsys):
    from dcp_opt.cli import main

    assert main(["profile", "-o", str(tmp_path / "a.json"), "--model", "llama-7b"]) == 2
    assert "is a 1d model; allowed: a 3d model preset" in capsys.readouterr().err
    argv = ["profile", "-o", str(tmp_path / "b.json"), "--target", "tiny-wan"]
    assert main([*argv, "--hidden", "20", "--heads", "4"]) == 2  # head width 5
    assert "even and >= 6" in capsys.readouterr().err
