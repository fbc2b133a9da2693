"""`dcp-opt whatif` with the full-attention video DiT presets on 3d batches: the plain sweep on
h200x32 and `--layouts` on h100x64, where a 14B model's states need zero3 or tensor
parallelism (issue 27)."""

from __future__ import annotations

import json

import pytest

from dcp_opt.cli import main
from dcp_opt.workloads import save_batch, standard_batch


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("b") / "wan.txt"
    save_batch(standard_batch("3d-wan2.1-720px", 0, num_gpus=8), path)  # 512K tokens
    return path


@pytest.mark.parametrize("model", ["wan2.1-14b", "hunyuanvideo-13b"])
def test_whatif_takes_a_3d_preset(batch_file, tmp_path, model):
    out = tmp_path / "w.json"
    args = ["whatif", "--lengths", str(batch_file), "--model", model, "--cluster", "h200x32"]
    args += ["--batches", "1", "--planners", "bucket,greedy", "--gpus", "32"]
    assert main([*args, "--inter-bw-scale", "1", "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["best_planner"] in ("bucket", "greedy") and doc["planners"]


def test_whatif_layouts_fit_a_14b_model_on_h100x64(batch_file, tmp_path):
    out = tmp_path / "l.json"
    args = ["whatif", "--layouts", "--lengths", str(batch_file), "--model", "wan2.1-14b"]
    args += ["--cluster", "h100x64", "--batches", "1", "--planners", "bucket,greedy"]
    assert main([*args, "--no-progress", "--json", str(out)]) == 0
    rows = {r["flags"]: r for r in json.loads(out.read_text())["rows"]}
    # 14.29B parameters under zero1 at tp 1: bf16 weights 28.6 GB + fp32 gradients 57.2 GB
    # alone pass the 72 GB an 80 GB GPU has after the reserve
    assert not rows["--tp 1 --optimizer-sharding zero1"]["fits"]
    assert rows["--tp 1 --optimizer-sharding zero3 --shard-domain 8"]["fits"]
    assert rows["--tp 2 --optimizer-sharding zero1"]["fits"]
