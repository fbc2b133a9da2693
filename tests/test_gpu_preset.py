"""scripts/gpu_preset.py --smoke: the GPU preset script's code path, on the CPU at tiny sizes.

No GPU here: the CUDA run (H200, bf16) is the same code with full-size blocks, CudaClock and
the larger grids; this runs it end to end as the GPU machine would, in a fresh interpreter
that cannot see the installed package (that machine gets a bare copy of the repository)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

pytest.importorskip("torch")
pytest.importorskip("transformers")

from dcp_opt import cluster_preset  # noqa: E402
from dcp_opt.profile_io import cost_model_from_profile, load_profile  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_preset.py"
# Hide the editable install's import finder, then run the script as `python3 script ...`.
RUN_BARE = (
    "import runpy, sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in repr(f)]; "
    "sys.argv = [sys.argv[1], *sys.argv[2:]]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_smoke_run_writes_loadable_presets(tmp_path):
    out = tmp_path / "presets"
    argv = [sys.executable, "-c", RUN_BARE, str(SCRIPT), "--smoke", "--out-dir", str(out)]
    argv += ["--dtype", "bfloat16"]  # the GPU run's dtype (CPU bf16 is slow, sizes are tiny)
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bootstrapped" in proc.stdout  # imported from the checkout, not the install
    for key, blocks in (("llama-7b", ["layer"]), ("stdit3-xl", ["spatial", "temporal"])):
        path = out / f"smoke-cpu_{key}.profile.json"
        prof = load_profile(path)
        assert prof.device["type"] == "cpu" and prof.date.endswith("Z")
        assert prof.method["preset"]["job"] == key and prof.method["preset"]["smoke"]
        # Extrapolated to the real depth, whatever the tiny widths.
        assert prof.model.num_layers == {"llama-7b": 32, "stdit3-xl": 28}[key]
        assert list(prof.coefficients.blocks) == blocks
        cost = cost_model_from_profile(path, prof.model, cluster_preset("h200x8"))
        # A checkpointed layer keeps only its input tokens (bf16): hidden * 2 bytes; what
        # every layer shares (caption, positions) is not counted per layer.
        assert prof.model.dtype_bytes == 2
        assert cost.coeffs.ckpt_bytes_per_token_layer == pytest.approx(prof.model.hidden * 2)
        assert cost.coeffs.act_bytes_per_token_layer > 4 * prof.model.hidden * 2
        points = json.loads((out / f"smoke-cpu_{key}.points.json").read_text())
        assert {p["recompute"] for p in points.values()} == {False, True}
        for block in blocks:  # one summary row per block
            assert any(line.split()[:2] == [f"smoke-{key}", block] for line in
                       proc.stdout.splitlines())  # fmt: skip
    # An existing preset is never replaced without --force, checked before measuring.
    before = (out / "smoke-cpu_stdit3-xl.profile.json").read_text()
    assert _script().main(["--smoke", "--out-dir", str(out), "--models", "stdit3-xl"]) == 2
    assert (out / "smoke-cpu_stdit3-xl.profile.json").read_text() == before


def _script():
    return load_script(SCRIPT)


def test_bad_model_list_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--smoke", "--models", "gpt-9"])
    assert e.value.code == 2
    assert "allowed: ['llama-7b', 'stdit3-xl']" in capsys.readouterr().err


def test_device_prefix():
    mod = _script()
    assert mod.prefix_for("NVIDIA H200", smoke=False) == "h200"
    assert mod.prefix_for("NVIDIA A100-SXM4-80GB", smoke=False) == "nvidia-a100-sxm4-80gb"
    assert mod.prefix_for("NVIDIA H200", smoke=True) == "smoke-cpu"


def test_full_size_stdit_target_is_the_stdit3_xl_preset():
    # The GPU run's STDiT3-XL-like target, built at full width (weights moved to the meta
    # device): its layer shape must be dcp_opt's preset, so the written preset loads for it.
    import torch

    from dcp_opt import model_preset
    from dcp_opt.profile_io import layer_fingerprint

    target = _script().build("stdit3-xl", smoke=False, dtype=torch.bfloat16, device="meta")
    preset = model_preset("opensora-stdit3-xl")
    assert layer_fingerprint(target.model) == layer_fingerprint(preset)
    assert (target.model.num_layers, target.model.text_tokens) == (28, 300)
    assert target.blocks["spatial"].text.shape == (300, 1152)
    assert target.model.dtype_bytes == 2
