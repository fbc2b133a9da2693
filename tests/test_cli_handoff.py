"""Issue 28: the first hour as a user. `--version`, `python -m dcp_opt`, plans moved between
commands (the fingerprint names what differs; simulate/show read what the plan records), the
default model said, readable memory units, a profile's device against the cluster, your own
epoch over the stream (`bench --stream --lengths/--histogram`), internal errors exit 3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_opt import cluster_preset, model_preset
from dcp_opt.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY_PROFILE = REPO / "benchmarks" / "results" / "tiny_lm_bf16.profile.json"  # measured on cpu


def _file(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _plan(tmp_path: Path, *extra: str) -> tuple[str, list[str]]:
    """A greedy plan of three sequences for llama-1b on h200x8 (zero2), and its inputs."""
    lengths = _file(tmp_path, "l.txt", "4096\n65536\n128\n")
    inputs = ["--lengths", lengths, "--cluster", "h200x8"]
    out = str(tmp_path / "plan.json")
    argv = ["plan", *inputs, "--model", "llama-1b", "--optimizer-sharding", "zero2", *extra]
    assert main([*argv, "--out", out]) == 0
    return out, inputs


# ---- item 1 ---------------------------------------------------------------------------------
def test_version_and_python_m_dcp_opt():
    from dcp_opt import __version__

    exe = Path(sys.executable).parent / "dcp-opt"
    for cmd in ([str(exe), "--version"], [sys.executable, "-m", "dcp_opt", "--version"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == f"dcp-opt {__version__}", r
    r = subprocess.run(
        [sys.executable, "-m", "dcp_opt", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "plan" in r.stdout and "exit codes" in r.stdout


# ---- item 6: plan hand-offs -----------------------------------------------------------------
def test_a_fingerprint_mismatch_names_what_differs(tmp_path, capsys):
    plan, inputs = _plan(tmp_path)
    capsys.readouterr()
    rc = main(["simulate", plan, *inputs, "--model", "llama-7b", "--optimizer-sharding", "zero1"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "FINGERPRINT_MISMATCH" in err
    assert "model: plan made for 'llama-1b #" in err and "inputs give 'llama-7b #" in err
    assert "optimizer_sharding: plan made for 'zero2', inputs give 'zero1'" in err
    assert "cluster:" not in err  # the same cluster is not named
    assert "coefficients" not in err  # FLOP coefficients follow the model: not a second line


def test_a_plan_without_recorded_inputs_still_says_what_it_can(tmp_path, capsys):
    # a plan written by the Python API (make_plan) records no inputs: the mismatch still
    # names the sharding, the GPU count and the batch from the plan itself
    plan, inputs = _plan(tmp_path)
    doc = json.loads(Path(plan).read_text())
    assert doc["fingerprint_inputs"]["optimizer_sharding"] == "zero2"
    del doc["fingerprint_inputs"]
    Path(plan).write_text(json.dumps(doc))
    other = _file(tmp_path, "m.txt", "4096\n128\n")
    rc = main(["simulate", plan, "--lengths", other, "--cluster", "h200x16", "--model", "llama-1b",
               "--optimizer-sharding", "zero3"])  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert "(the plan records no inputs)" in err
    assert "optimizer_sharding: plan made for 'zero2', inputs give 'zero3'" in err
    assert "cluster: plan made for 8 GPUs, inputs give 'h200x16' with 16" in err
    assert "batch: plan made for 3 sequences" in err


def test_simulate_and_show_read_what_the_plan_records(tmp_path, capsys):
    # before, simulate assumed zero1 (and llama-7b): a zero2 plan was a FINGERPRINT_MISMATCH
    plan, inputs = _plan(tmp_path)
    capsys.readouterr()
    assert main(["simulate", plan, inputs[0], inputs[1]]) == 0
    out, err = capsys.readouterr()
    assert "step sync   zero2:" in out
    assert "--model not given: llama-1b, as the plan records" in err
    assert "--cluster not given: h200x8, as the plan records" in err
    png = tmp_path / "p.png"
    assert main(["show", plan, inputs[0], inputs[1], "--out", str(png)]) == 0 and png.exists()


def test_the_default_model_is_said(tmp_path, capsys):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    assert main(["plan", "--lengths", lengths, "--cluster", "h200x8"]) == 0
    assert "--model not given: llama-7b, the default for 1d inputs" in capsys.readouterr().err
    # bad input stays one line, and the line says which model it was judged against
    big = _file(tmp_path, "big.txt", "4096\n4000000\n")
    assert main(["plan", "--lengths", big, "--cluster", "h200x8"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-opt: error: sequence 1")
    assert lines[0].endswith("(with --model not given: llama-7b, the default for 1d inputs)")


def test_memory_of_a_small_model_is_in_readable_units(tmp_path, capsys):
    # tiny-lm's profile: 131.6 MB peak, printed as "0.1 / 126.9 GB" and "0.1 GB" before
    lengths = _file(tmp_path, "l.txt", "4096\n65536\n128\n")
    plan = str(tmp_path / "p.json")
    argv = ["--lengths", lengths, "--cluster", "h200x8", "--profile", str(TINY_PROFILE)]
    assert main(["plan", *argv, "--out", plan]) == 0
    assert main(["simulate", plan, *argv]) == 0
    out = capsys.readouterr().out
    balance = next(x for x in out.splitlines() if x.startswith("balance"))
    assert balance.endswith(" MB / 126.9 GB"), balance
    peak = next(x for x in out.splitlines() if x.startswith("peak memory"))
    assert " MB (capacity 126.9 GB)" in peak, peak


def test_format_bytes():
    from dcp_opt.errors import format_bytes

    assert [format_bytes(x) for x in (0, 512, 1.5e3, 3.2e6, 141e9, 2e12)] == [
        "0 B", "512 B", "1.5 kB", "3.2 MB", "141.0 GB", "2.0 TB",
    ]  # fmt: skip


# ---- item 7: the profile's device -------------------------------------------------------------
def test_a_cpu_profile_planned_for_gpus_is_warned(tmp_path, capsys):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    argv = ["plan", "--lengths", lengths, "--cluster", "h200x8", "--profile", str(TINY_PROFILE)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: profile tiny_lm_bf16.profile.json: the profile was measured on cpu" in err
    assert "'h200x8' (8 GPUs of 989 TFLOP/s)" in err


@pytest.mark.parametrize(
    ("device", "cluster", "warned"),
    [
        ({"type": "cpu", "name": "x86_64"}, "h200x8", True),
        ({"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}, "h200x8", True),
        ({"type": "cuda", "name": "NVIDIA H200"}, "h200x8", False),
        ({"type": "cuda", "name": "NVIDIA A100-SXM4-80GB"}, "a100x16", False),
        ({"type": "cuda", "name": "NVIDIA GB200"}, "gb200-nvl72", False),
        ({"type": "cuda", "name": "NVIDIA H100"}, "gb200-nvl72", True),
        ({"name": "fuzz"}, "h200x8", False),  # nothing recorded: nothing to say
    ],
)
def test_device_mismatch(device, cluster, warned):
    from dcp_opt import flops_coefficients
    from dcp_opt.profile_io import Profile, device_mismatch

    m = model_preset("llama-1b")
    prof = Profile(flops_coefficients(m, cluster_preset("h200x8")), m, device, "2026-01-01")
    assert (device_mismatch(prof, cluster_preset(cluster)) is not None) == warned


# ---- item 8: your own epoch over the stream ---------------------------------------------------
def test_bench_stream_runs_your_own_1d_epoch_in_data_order(tmp_path):
    lengths = _file(tmp_path, "mine.txt", "\n".join(str(128 + 97 * i % 9000) for i in range(800)))
    out = tmp_path / "s.json"
    argv = ["bench", "--stream", "--quick", "--lengths", lengths, "--cluster", "h200x8",
            "--no-progress", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert [e["workload"] for e in doc["epochs"]] == ["1d:mine.txt"]
    assert doc["epochs"][0]["num_sequences"] == 800
    methods = {r["method"] for r in doc["methods"]}
    # 1D: the project's planners and the frameworks, no published (2D-only) sampler
    assert {"greedy@2M", "megatron_dynamic_cp@2M", "verl_balanced@2M", "greedy+cp@2M"} <= methods
    assert not any(r["family"] == "published" for r in doc["methods"])
    assert all(r["dropped_share"] == 0 for r in doc["methods"])


def test_run_stream_epoch_keeps_the_data_order_and_runs_published_on_2d(tmp_path):
    from dcp_opt import Batch
    from dcp_opt.analysis.stream import QUICK, StreamConfig, data_order_steps, run_stream_epoch

    shapes = [(1, 9, 16)] * 60 + [(15, 15, 27)] * 12 + [(30, 23, 40)] * 3
    epoch = Batch.from_shapes(shapes[::-1])  # the big ones first: data order is kept
    config = StreamConfig(cluster="h200x8", **{**QUICK, "step_sizes": (2**18,)})
    doc = run_stream_epoch(epoch, config, name="mine")
    rows = {r["method"]: r for r in doc["methods"]}
    assert {"bucket", "dcp_inter_pac", "greedy@0.25M"} <= set(rows)
    assert doc["config"]["epoch"] == "mine" and doc["fidelity"] == []
    steps = data_order_steps(epoch, 2**18)
    assert rows["greedy@0.25M"]["num_steps"] == len(steps)
    assert steps[0][0] == 0 and max(epoch.by_id[i].num_tokens for i in steps[0]) == 30 * 23 * 40


def test_bench_stream_histogram_draws_an_epoch(tmp_path):
    hist = _file(tmp_path, "h.csv", "length,count\n512,10\n2048,5\n8192,1\n")
    out = tmp_path / "s.json"
    argv = ["bench", "--stream", "--quick", "--histogram", hist, "--epoch-batches", "1",
            "--cluster", "h200x8", "--no-progress", "--step-sizes", "0.5", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["epochs"][0]["workload"] == "1d:h.csv"
    assert doc["epochs"][0]["num_tokens"] >= 2**21  # 1 batch of 2M tokens, drawn
    assert doc["config"]["num_batches"] == 1


def test_epoch_batches_help_gives_the_real_default(capsys):
    from dcp_opt.analysis.stream import StreamConfig

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default {StreamConfig().num_batches};" in help_text and "default 256" not in help_text


# ---- exit codes -------------------------------------------------------------------------------
def test_an_internal_error_exits_3_with_one_line(tmp_path, capsys, monkeypatch):
    cli_main = sys.modules["dcp_opt.cli.main"]  # (dcp_opt.cli.main is also the function)

    def broken(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(cli_main, "simulate", broken)
    lengths = _file(tmp_path, "l.txt", "128\n")
    rc = main(["plan", "--lengths", lengths, "--cluster", "h200x8", "--model", "llama-1b"])
    assert rc == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dcp-opt: internal error: RuntimeError: injected")
    assert "bug" in err[0] and "DCP_OPT_TRACEBACK=1" in err[0]


def test_readme_documents_exit_code_3():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "Exit code 3 is an internal error, a bug in dcp_opt" in readme


def test_tokens_per_gpu_with_a_lengths_file_is_refused_not_ignored(tmp_path, capsys):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    argv = ["plan", "--lengths", lengths, "--cluster", "h200x8", "--tokens-per-gpu", "1024"]
    assert main(argv) == 2
    assert "--tokens-per-gpu: only with --workload" in capsys.readouterr().err


def test_simulate_takes_ring_from_a_plan_that_records_no_inputs(tmp_path, capsys):
    # A plan with ring groups and no fingerprint_inputs (made through the Python API before
    # they were recorded): simulate offered only ulysses,cp and called the ring group BAD_KIND.
    lengths = _file(tmp_path, "l.txt", "131072\n262144\n")
    out = str(tmp_path / "plan.json")
    common = ["--lengths", lengths, "--cluster", "h200x8", "--model", "llama-7b"]
    assert main(["plan", *common, "--sp-kinds", "ulysses,cp,ring", "--out", out]) == 0
    doc = json.loads(Path(out).read_text())
    kinds = {g["kind"] for ph in doc["phases"] for g in ph["groups"]}
    assert "ring" in kinds, kinds  # the instance is one where ring wins
    for g in (g for ph in doc["phases"] for g in ph["groups"]):
        g["kind"] = "ring"
    doc.pop("fingerprint_inputs")
    Path(out).write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["simulate", out, *common, "--ignore-fingerprint"]) == 0, capsys.readouterr()
