"""The published training mixes of the full-attention video DiTs (dcp_opt/video3d.py): Wan 2.1's
720px stage and HunyuanVideo's 129-frame buckets, token arithmetic by hand, the workload
registry, and `dcp-opt plan --workload` on each with its own model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcp_opt import CostModel, validate
from dcp_opt.cli import main
from dcp_opt.model import MODEL_PRESETS
from dcp_opt.plan import Plan
from dcp_opt.topology.presets import cluster_preset
from dcp_opt.video3d import PUBLISHED_MIXES, published_mix
from dcp_opt.workloads import VIDEO_3D_WORKLOADS, Workload, standard_batch


def test_wan21_720px_tokens_by_hand():
    shapes, p = published_mix("wan2.1-720px")
    # a 5 s clip at 16 fps: 81 frames; causal 4x VAE: 1 + 80 // 4 = 21 latent frames;
    # 720 x 1280 through 8x VAE and 2x2 patch: 720 / 16 = 45, 1280 / 16 = 80 -> 21 x 45 x 80
    # = 75,600 tokens; the 720px image: 1 x 45 x 80 = 3,600
    assert (21, 45, 80) in shapes and (1, 45, 80) in shapes and (21, 80, 45) in shapes
    assert 21 * 45 * 80 == 75_600 and max(int(np.prod(s)) for s in shapes) == 75_600
    assert len(shapes) == 4 and p == pytest.approx([0.25] * 4)  # equal draws (assumed)


def test_hunyuanvideo_129f_tokens_by_hand():
    shapes, p = published_mix("hunyuanvideo-129f")
    # 129 frames: 1 + 128 // 4 = 33 latent frames; 544 x 960: ceil(544 / 16) = 34, 960 / 16
    # = 60 -> 33 x 34 x 60 = 67,320 tokens; 1104 x 832: 69 x 52 -> 33 x 69 x 52 = 118,404
    assert (33, 34, 60) in shapes and 33 * 34 * 60 == 67_320
    assert (33, 69, 52) in shapes and 33 * 69 * 52 == 118_404
    # the largest: 720 x 1280 and 960 x 960, 33 x 45 x 80 = 33 x 60 x 60 = 118,800
    assert max(int(np.prod(s)) for s in shapes) == 118_800
    assert len(shapes) == 10 and p == pytest.approx([0.1] * 10)


@pytest.mark.parametrize("mix", ["wan2.1-720px", "hunyuanvideo-129f"])
def test_published_mixes_are_workloads(mix):
    name = f"3d-{mix}"
    assert mix in PUBLISHED_MIXES and name in VIDEO_3D_WORKLOADS
    w = Workload.parse(name)
    assert (w.kind, w.distribution, w.name) == ("3d", mix, name)
    shapes, _ = published_mix(mix)
    b = standard_batch(name, 0, num_gpus=1, tokens_per_gpu=2_000_000)
    assert {s.shape for s in b.sequences} <= set(shapes)


@pytest.mark.parametrize(
    "workload, model",
    [("3d-wan2.1-720px", "wan2.1-14b"), ("3d-hunyuanvideo-129f", "hunyuanvideo-13b")],
)
def test_plan_takes_each_published_mix_with_its_model(workload, model, tmp_path):
    out, plan = tmp_path / "s.json", tmp_path / "p.json"
    args = ["plan", "--workload", workload, "--model", model, "--cluster", "h200x32"]
    assert main([*args, "--planner", "greedy", "--out", str(plan), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["status"] == "feasible"
    cost = CostModel(MODEL_PRESETS[model], cluster_preset("h200x32"))
    batch = standard_batch(workload, 0)
    assert validate(Plan.from_json(plan.read_text()), batch, cost) == []
