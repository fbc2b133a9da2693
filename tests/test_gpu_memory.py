"""scripts/gpu_memory.py --device cpu --tiny: the GPU memory script's code path end to end on
the CPU, in a fresh interpreter that cannot see the installed package (the GPU machine gets a
bare copy of the repository). The CUDA run is the same code at Llama-7B width in bf16, with
CudaClock and FlashAttention's varlen kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.test_gpu_preset import RUN_BARE  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_memory.py"


def _run(tmp_path, *args):
    argv = [sys.executable, "-c", RUN_BARE, str(SCRIPT), "--device", "cpu", "--tiny", *args]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_tiny_cpu_run_measures_every_shape_next_to_the_cost_model(tmp_path):
    out = tmp_path / "m.json"
    proc = _run(tmp_path, "--shapes", "48,16x3,20+28", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bootstrapped" in proc.stdout and "attention kernel 'reference'" in proc.stdout
    report = json.loads(out.read_text())
    assert [r["shape"] for r in report["rows"]] == ["48", "16x3", "20+28"]
    layers = report["layers"]
    for row in report["rows"]:
        assert row["tokens"] == 48 and row["sequences"] in (1, 2, 3)
        # one attention call per layer for all sequences of the micro-batch; no varlen on CPU
        assert (row["reference_calls"], row["varlen_calls"]) == (layers, 0)
        assert row["peak_bytes"] is None  # no allocator peak on the CPU
        # the cost model's activation term and the measured saved bytes agree in size (the
        # CPU reference adds int64 gather indices for mixed lengths; bf16 logits add some)
        assert 0.5 < row["saved_bytes"] / row["pred_saved_bytes"] < 2.0
        assert row["pred_peak_bytes"] > row["pred_saved_bytes"] > 0
        assert row["time_s"] > 0 and row["pred_time_s"] > 0
    assert report["kernel"] == "reference" and report["model"]["num_layers"] > layers


def test_bad_shape_is_refused_naming_the_option(tmp_path):
    proc = _run(tmp_path, "--shapes", "64,3y2")
    assert proc.returncode == 2
    assert "--shapes: '3y2' not allowed; allowed: LENGTH, LENGTHxCOUNT" in proc.stderr


def test_the_kernel_check_catches_a_wrong_varlen_kernel():
    """The GPU script's first stage compares varlen with the reference path; checked on CPU
    with stand-ins: the reference itself in bf16 passes, a kernel that ignores causality
    or the window does not."""
    from dcp_opt.runtime import attention as A

    gm = load_script(SCRIPT)

    def same(q, k, v, lengths, k_lengths, **opts):
        return A._reference_attention(q, k, v, lengths, k_lengths, softcap=None, sinks=None, **opts)

    def no_window(q, k, v, lengths, k_lengths, *, causal, scale, window):
        return same(q, k, v, lengths, k_lengths, causal=causal, scale=scale, window=None)

    def not_causal(q, k, v, lengths, k_lengths, *, causal, scale, window):
        return same(q, k, v, lengths, k_lengths, causal=False, scale=scale, window=None)

    assert gm.compare_kernels("cpu", same) < 3e-2
    assert gm.compare_kernels("cpu", no_window) > 3e-2
    assert gm.compare_kernels("cpu", not_causal) > 3e-2
    assert gm.kernel_check("cpu") == (True, "kernel check: varlen not available here; skipped")
