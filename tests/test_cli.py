"""The dcp-opt command line and the bench, in-process (main([...])) and once via subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dcp_opt.solvers as solvers
import pytest

from dcp_opt import (
    Batch,
    Cluster,
    CostModel,
    ModelSpec,
    Plan,
    cluster_preset,
    model_preset,
    simulate,
    validate,
)
from dcp_opt.analysis.bench import BENCH_SCHEMA, BenchConfig, planner_kwargs, run_bench
from dcp_opt.cli import main
from tests import stub_planners

STUB_MODULE = "dcp_opt.solvers._test_stub"


@pytest.fixture
def stubs(monkeypatch):
    """Register the stub planners as if they lived in dcp_opt.solvers."""
    monkeypatch.setitem(sys.modules, STUB_MODULE, stub_planners)
    for name, fn in [("stub_whole", "plan_whole"), ("stub_nodes", "plan_nodes")]:
        monkeypatch.setitem(solvers.PLANNERS, name, f"_test_stub:{fn}")
    monkeypatch.setitem(solvers.PLANNERS, "stub_boom", "_test_stub:plan_boom")


def _lengths(tmp_path: Path, text: str, name: str = "b.txt") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dcp-opt: error: ")
    assert "Traceback" not in err
    return lines[0]


# ---- plan and simulate -------------------------------------------------------------------------
def test_plan_writes_plan_and_summary_then_simulate_round_trip(stubs, tmp_path, capsys):
    lengths = _lengths(tmp_path, "4096\n1024\n16384\n2048\n")
    plan_path, summary_path = tmp_path / "plan.json", tmp_path / "s.json"
    common = ["--lengths", lengths, "--cluster", "h200x16", "--model", "llama-1b"]
    rc = main(
        ["plan", *common, "--planner", "stub_nodes", "--out", str(plan_path)]
        + ["--json", str(summary_path)]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "stub_nodes" in out and "lower bound" in out and "imbalance" in out
    s = json.loads(summary_path.read_text())
    plan = Plan.from_json(plan_path.read_text())
    # Check the summary against an independent simulation of the written plan.
    batch = Batch.from_lengths([4096, 1024, 16384, 2048])
    cost = CostModel(model_preset("llama-1b"), cluster_preset("h200x16"))
    assert validate(plan, batch, cost) == []
    sim = simulate(plan, batch, cost)
    assert s["predicted_step_time_s"] == pytest.approx(sim.step_time_s)
    assert s["gap"] == pytest.approx(s["predicted_step_time_s"] / s["lower_bound_s"] - 1)
    assert s["imbalance"] == pytest.approx(sim.imbalance)
    # 16 GPUs = 2 nodes of 8: the stub runs two degree-8 groups, 4 sequences in all.
    assert (s["num_phases"], s["num_groups"], s["num_micro_batches"]) == (1, 2, 4)
    assert s["degrees"] == [{"8": 2}]
    assert s["num_sequences"] == 4 and s["num_tokens"] == 4096 + 1024 + 16384 + 2048

    rc = main(["simulate", str(plan_path), *common, "--json", str(tmp_path / "sim.json")])
    assert rc == 0
    assert "step time" in capsys.readouterr().out
    assert json.loads((tmp_path / "sim.json").read_text())["step_time_s"] == pytest.approx(
        sim.step_time_s
    )


def test_simulate_prints_every_violation(stubs, tmp_path, capsys):
    lengths = _lengths(tmp_path, "4096\n1024\n")
    plan_path = tmp_path / "plan.json"
    common = ["--cluster", "h200x8", "--model", "llama-1b"]
    assert (
        main(
            ["plan", "--lengths", lengths, *common, "--planner", "stub_whole"]
            + ["--out", str(plan_path)]
        )
        == 0
    )
    capsys.readouterr()
    # Another batch: the plan misses sequence 2, its fingerprint no longer matches, and its
    # token normaliser 4096 + 1024 = 5120 is not the new batch's 5120 + 512 = 5632.
    other = _lengths(tmp_path, "4096\n1024\n512\n", "other.txt")
    assert main(["simulate", str(plan_path), "--lengths", other, *common]) == 1
    err = capsys.readouterr().err
    assert "MISSING_SEQUENCE" in err and "FINGERPRINT_MISMATCH" in err
    assert "BAD_NORMALIZER: tokens normaliser 5120.0" in err
    assert "3 violation(s)" in err
    # Under another cluster with --ignore-fingerprint the same plan is a what-if: h200x16 has
    # 16 ranks, the plan 8 -> WRONG_NUM_RANKS (and uncovered ranks) are still reported.
    assert (
        main(
            [
                "simulate",
                str(plan_path),
                "--lengths",
                lengths,
                "--cluster",
                "h200x16",
                "--model",
                "llama-1b",
                "--ignore-fingerprint",
            ]
        )
        == 1
    )
    assert "WRONG_NUM_RANKS" in capsys.readouterr().err


def test_plan_from_standard_workload_on_24_gpus(stubs, capsys, tmp_path):
    out = tmp_path / "s.json"
    rc = main(
        [
            "plan",
            "--workload",
            "1d-short",
            "--seed",
            "3",
            "--cluster",
            "h200x24",
            "--planner",
            "stub_nodes",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    s = json.loads(out.read_text())
    # 24 GPUs = 3 nodes -> three degree-8 groups; the 1D default model is llama-7b.
    assert s["degrees"] == [{"8": 3}] and s["model"] == "llama-7b" and s["cluster"] == "h200x24"
    assert s["num_tokens"] >= 24 * 65536


def test_plan_with_a_sequence_that_needs_the_whole_cluster(stubs, tmp_path, capsys):
    # 600,000 tokens of llama-7b on one node of 8 H200 fit only at degree 8, even with every
    # layer recomputed (checked below), so the plan must give that sequence the whole cluster.
    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x8"))
    assert int(cost.min_recompute(600_000, 4)) == -1 and int(cost.min_recompute(600_000, 8)) >= 0
    lengths = _lengths(tmp_path, "600000\n2048\n512\n")
    out = tmp_path / "s.json"
    rc = main(
        [
            "plan",
            "--lengths",
            lengths,
            "--cluster",
            "h200x8",
            "--planner",
            "stub_whole",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["degrees"] == [{"8": 1}] and s["model"] == "llama-7b"
    assert s["peak_memory_gb"] <= s["capacity_gb"]


REAL_PLANNERS = ("static_tuned", "dcp_inter_pac", "bucket")


@pytest.mark.parametrize("planner", REAL_PLANNERS)
def test_real_planner_on_24_gpus_and_on_a_whole_cluster_sequence(planner, tmp_path, capsys):
    plan_path, out = tmp_path / "p.json", tmp_path / "s.json"
    common = ["--planner", planner, "--out", str(plan_path), "--json", str(out)]
    assert (
        main(["plan", "--workload", "2d-long", "--seed", "1", "--cluster", "h200x24", *common]) == 0
    )
    s = json.loads(out.read_text())
    assert s["cluster"] == "h200x24" and s["planner"] == planner
    assert (
        main(
            [
                "simulate",
                str(plan_path),
                "--workload",
                "2d-long",
                "--seed",
                "1",
                "--cluster",
                "h200x24",
            ]
        )
        == 0
    )
    # 600,000 llama-7b tokens on h200x8 fit only at degree 8 (see the stub test above): the
    # micro-batch holding sequence 0 must run on a group of all 8 ranks.
    lengths = _lengths(tmp_path, "600000\n2048\n512\n")
    assert main(["plan", "--lengths", lengths, "--cluster", "h200x8", *common]) == 0
    plan = Plan.from_json(plan_path.read_text())
    (degree,) = [g.degree for _, g, _, mb in plan.micro_batches() if 0 in mb.sequence_ids]
    assert degree == 8
    assert main(["simulate", str(plan_path), "--lengths", lengths, "--cluster", "h200x8"]) == 0


# ---- bad input: one line, exit 2 ---------------------------------------------------------------
@pytest.mark.parametrize(
    "text, extra, field",
    [
        ("100\n", ["--cluster", "h900x3"], "cluster: unknown preset 'h900x3'"),
        ("100\n", ["--model", "gpt-17"], "model: unknown preset 'gpt-17'"),
        ("100\nabc\n", [], "b.txt:2: expected integers"),
        ("100\n0\n", [], "b.txt:2: expected one length >= 1"),
        ("100\n-5\n", [], "b.txt:2"),
        ("# nothing\n\n", [], "lengths file b.txt: no sequences"),
        ("[1, 2", [], "b.txt: not valid JSON"),
        ("100\n1,9,16\n", [], "mixes 1D lengths and 2D shapes"),
        ("1,9,16\n", ["--model", "llama-7b"], "model: 'llama-7b' is a 1d model"),
        ("100\n2000000\n", [], "sequence 1 (shape (2000000,), 2000000 tokens) cannot fit"),
        ("100\n", ["--planner", "nope"], "planner: 'nope' not allowed"),
        ("100\n", ["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, text, extra, field):
    lengths = _lengths(tmp_path, text)
    rc = main(["plan", "--lengths", lengths, "--cluster", "h200x8", *extra])
    assert rc == 2
    line = _one_error_line(capsys)
    assert field in line, line


def test_infeasible_sequence_names_need_and_capacity(tmp_path, capsys):
    assert main(["plan", "--lengths", _lengths(tmp_path, "2000000\n"), "--cluster", "h200x8"]) == 2
    line = _one_error_line(capsys)
    assert "needs" in line and "GB per GPU" in line and "capacity" in line


def test_bad_plan_file_and_missing_file(tmp_path, capsys):
    lengths = _lengths(tmp_path, "100\n")
    bad = tmp_path / "plan.json"
    bad.write_text('{"schema_version": 99}')
    assert main(["simulate", str(bad), "--lengths", lengths, "--cluster", "h200x8"]) == 2
    assert "plan.schema_version: 99 not supported" in _one_error_line(capsys)
    assert main(["simulate", str(tmp_path / "none.json"), "--lengths", lengths]) == 2
    assert "plan file" in _one_error_line(capsys)
    assert main(["plan", "--lengths", str(tmp_path / "none.txt")]) == 2
    assert "cannot read" in _one_error_line(capsys)


def test_subprocess_entry_point_bad_input(tmp_path):
    lengths = _lengths(tmp_path, "100\n0\n")
    exe = Path(sys.executable).with_name("dcp-opt")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "dcp_opt.cli"]
    out = subprocess.run(
        [*cmd, "plan", "--lengths", lengths, "--cluster", "h200x8"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dcp-opt: error: b.txt:2: expected one length >= 1 or frames,height,width >= 1, got '0'"
    ]


# ---- bench -------------------------------------------------------------------------------------
SUMMARY_KEYS = {
    "workload",
    "model",
    "planner",
    "num_batches",
    "num_valid",
    "num_errors",
    "all_valid",
    "median_step_time_s",
    "median_lower_bound_s",
    "median_gap",
    "median_imbalance",
    "median_speedup_vs_bucket",
    "median_speedup_vs_static_tuned",
    "min_speedup_vs_bucket",
    "min_speedup_vs_static_tuned",
    "median_wall_time_s",
    "max_wall_time_s",
    "errors",
}
BATCH_KEYS = {
    "workload",
    "planner",
    "seed",
    "num_sequences",
    "num_tokens",
    "status",
    "valid",
    "violations",
    "step_time_s",
    "lower_bound_s",
    "planner_bound_s",
    "gap",
    "imbalance",
    "comm_share",
    "wall_time_s",
    "speedup_vs_bucket",
    "speedup_vs_static_tuned",
    "error",
}


def test_bench_tiny_writes_documented_json(stubs, monkeypatch, tmp_path, capsys):
    # Let the stubs stand in for the two references, so the speedups are defined.
    monkeypatch.setitem(solvers.PLANNERS, "bucket", "_test_stub:plan_whole")
    monkeypatch.setitem(solvers.PLANNERS, "static_tuned", "_test_stub:plan_nodes")
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--batches",
            "2",
            "--workloads",
            "1d-short",
            "--cluster",
            "h200x16",
            "--planners",
            "bucket,static_tuned,stub_boom",
            "--json",
            str(out),
            "--no-progress",
            "--tokens-per-gpu",
            "16384",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "1d-short" in captured.out and "stub_boom" in captured.out
    assert "boom: injected planner failure" in captured.err
    doc = json.loads(out.read_text())
    assert doc["schema"] == BENCH_SCHEMA
    assert doc["config"]["seeds"] == [0, 1] and doc["config"]["num_gpus"] == 16
    assert all(set(r) == SUMMARY_KEYS for r in doc["summary"])
    assert all(set(r) == BATCH_KEYS for r in doc["batches"])
    rows = {r["planner"]: r for r in doc["summary"]}
    assert rows["bucket"]["all_valid"] and rows["static_tuned"]["num_valid"] == 2
    assert rows["stub_boom"]["num_errors"] == 2 and rows["stub_boom"]["median_step_time_s"] is None
    # Speedups are per-batch ratios of the recorded step times; the reference against itself is 1.
    by = {(b["planner"], b["seed"]): b for b in doc["batches"]}
    for seed in (0, 1):
        want = by[("bucket", seed)]["step_time_s"] / by[("static_tuned", seed)]["step_time_s"]
        assert by[("static_tuned", seed)]["speedup_vs_bucket"] == pytest.approx(want)
        assert by[("bucket", seed)]["speedup_vs_bucket"] == pytest.approx(1.0)
        b = by[("bucket", seed)]
        assert b["gap"] == pytest.approx(b["step_time_s"] / b["lower_bound_s"] - 1)
    ratios = sorted(by[("static_tuned", s)]["speedup_vs_bucket"] for s in (0, 1))
    assert rows["static_tuned"]["median_speedup_vs_bucket"] == pytest.approx(sum(ratios) / 2)
    assert rows["static_tuned"]["min_speedup_vs_bucket"] == pytest.approx(ratios[0])


def test_bench_strict_exit_and_unbuilt_planner(stubs, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(solvers.PLANNERS, "unbuilt", "no_such_module:plan")
    rc = main(
        [
            "bench",
            "--batches",
            "1",
            "--workloads",
            "1d-short",
            "--cluster",
            "h200x8",
            "--planners",
            "stub_whole,stub_boom,unbuilt",
            "--strict",
            "--no-progress",
            "--tokens-per-gpu",
            "8192",
        ]
    )
    assert rc == 1  # stub_boom failed and --strict was given
    assert "skipped: unbuilt" in capsys.readouterr().err
    assert main(["bench", "--planners", "nope", "--no-progress"]) == 2
    assert "planners: ['nope'] not allowed" in _one_error_line(capsys)
    assert main(["bench", "--workloads", "3d-x", "--no-progress"]) == 2
    assert "workload: '3d-x' not allowed" in _one_error_line(capsys)


def test_bench_catches_an_invalid_plan(stubs, monkeypatch):
    # A planner whose plan drops a sequence: recorded as invalid, never crashes the bench.
    def plan_drop(batch, cost, **kw):
        res = stub_planners.plan_whole(batch, cost)
        d = res.plan.to_dict()
        d["phases"][0]["groups"][0]["micro_batches"].pop()
        return type(res)(
            res.status,
            Plan.from_dict(d),
            *(
                getattr(res, f)
                for f in ("predicted_step_time_s", "lower_bound_s", "wall_time_s", "planner")
            ),
        )

    plan_drop.extra_options = stub_planners.plan_whole.extra_options

    monkeypatch.setattr(stub_planners, "plan_drop", plan_drop, raising=False)
    monkeypatch.setitem(solvers.PLANNERS, "stub_drop", "_test_stub:plan_drop")
    doc = run_bench(BenchConfig("h200x8", ("1d-short",), ("stub_drop",), 1, tokens_per_gpu=8192))
    (row,) = doc["summary"]
    assert row["num_valid"] == 0 and "MISSING_SEQUENCE" in row["errors"][0]
    assert doc["batches"][0]["violations"] == ["MISSING_SEQUENCE"]


def test_planner_kwargs_maps_aliases():
    def a(batch, cost, *, time_limit=1.0, seed=0):
        pass

    def b(batch, cost, **options):
        pass

    assert planner_kwargs(a, time_limit_s=0.5, seed=3, num_workers=2) == (
        {"time_limit": 0.5, "seed": 3},
        ["num_workers"],
    )
    assert planner_kwargs(b, time_limit_s=0.5, seed=None) == ({"time_limit_s": 0.5}, [])


def test_bench_every_built_planner_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--batches", "1", "--workloads", "1d-short,2d-short", "--cluster", "h200x8"]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    built = solvers.available_planners()
    assert doc["config"]["planners"] == built and doc["skipped_planners"] == []
    assert all(set(r) == SUMMARY_KEYS for r in doc["summary"])
    assert [(r["workload"], r["planner"]) for r in doc["summary"]] == [
        (w, p) for w in ("1d-short", "2d-short") for p in built
    ]
    bad = [(r["workload"], r["planner"], r["errors"]) for r in doc["summary"] if not r["all_valid"]]
    assert bad == []
    for r in doc["summary"]:  # every plan is at least the certified bound
        assert r["median_gap"] >= -1e-9, r


def test_summary_json_takes_numpy_planner_stats(stubs, monkeypatch, tmp_path):
    import dataclasses

    import numpy as np

    def plan_np(batch, cost, **kw):
        res = stub_planners.plan_whole(batch, cost)
        return dataclasses.replace(res, stats={"nodes": np.int64(3), "bounds": np.arange(2)})

    plan_np.extra_options = stub_planners.plan_whole.extra_options

    monkeypatch.setattr(stub_planners, "plan_np", plan_np, raising=False)
    monkeypatch.setitem(solvers.PLANNERS, "stub_np", "_test_stub:plan_np")
    out = tmp_path / "s.json"
    lengths = _lengths(tmp_path, "4096\n")
    argv = ["plan", "--lengths", lengths, "--cluster", "h200x8", "--planner", "stub_np"]
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["stats"] == {"nodes": 3, "bounds": [0, 1]}


# ---- the user's own cost model: --profile, model and cluster files -----------------------------
LLAMA_1B = model_preset("llama-1b")
# 3 nodes x 4 GPUs: no preset has this shape.
A100_3X4 = {
    "name": "a100-3x4",
    "num_nodes": 3,
    "gpus_per_node": 4,
    "memory_bytes": 80e9,
    "peak_flops": 312e12,
    "intra_node_bw": 300e9,
    "inter_node_bw": 25e9,
}


def _profile_file(tmp_path: Path) -> str:
    """A profile of llama-1b with a runtime calibration (x1.25 compute, +2 ms per micro-batch,
    a measured gradient sync at world 8): its cost model is not the preset's."""
    from dcp_opt.profile_io import save_profile
    from tests.test_profile_io import _calibrated

    return str(save_profile(_calibrated(LLAMA_1B), tmp_path / "lm.profile.json"))


def _json_file(tmp_path: Path, name: str, doc) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def _api_step_time(profile: str, model: ModelSpec, batch: Batch, cluster: str) -> float:
    """What the Python API predicts for greedy's plan with the profile's cost model."""
    from dcp_opt.solvers import get_planner

    from dcp_opt.profile_io import cost_model_from_profile

    cost = cost_model_from_profile(profile, model, cluster_preset(cluster))
    return simulate(get_planner("greedy")(batch, cost).plan, batch, cost).step_time_s


def test_plan_with_a_profile_is_the_python_apis_plan(tmp_path, capsys):
    from dcp_opt.workloads import standard_batch

    prof = _profile_file(tmp_path)
    argv = ["plan", "--workload", "1d-balanced", "--cluster", "h200x8", "--planner", "greedy"]
    argv += ["--tokens-per-gpu", "8192"]
    got, preset = tmp_path / "p.json", tmp_path / "preset.json"
    assert main([*argv, "--profile", prof, "--json", str(got)]) == 0
    assert main([*argv, "--model", "llama-1b", "--json", str(preset)]) == 0
    s, s_preset = json.loads(got.read_text()), json.loads(preset.read_text())
    batch = standard_batch("1d-balanced", 0, num_gpus=8, tokens_per_gpu=8192)
    want = _api_step_time(prof, LLAMA_1B, batch, "h200x8")
    assert s["predicted_step_time_s"] == pytest.approx(want, rel=1e-12)
    assert s["model"] == "llama-1b"
    # the calibration slows compute by 1.25x: far from the preset's FLOP-based figure
    assert s["predicted_step_time_s"] > 1.1 * s_preset["predicted_step_time_s"]


def test_model_and_cluster_json_files_plan_and_validate(tmp_path, capsys):
    spec = {**LLAMA_1B.to_dict(), "name": "my-lm", "num_layers": 20, "num_kv_heads": 8}
    model = _json_file(tmp_path, "my-lm.json", spec)
    cluster = _json_file(tmp_path, "c.json", {"cluster": A100_3X4})  # wrapped form
    lengths = _lengths(tmp_path, "4096\n70000\n1024\n16384\n300\n")
    common = ["--lengths", lengths, "--model", model, "--cluster", cluster]
    plan_path, summary = tmp_path / "plan.json", tmp_path / "s.json"
    assert main(["plan", *common, "--out", str(plan_path), "--json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert (s["model"], s["cluster"]) == ("my-lm", "a100-3x4")
    batch = Batch.from_lengths([4096, 70000, 1024, 16384, 300])
    cost = CostModel(ModelSpec.from_dict(spec), Cluster.from_dict(A100_3X4))
    plan = Plan.from_json(plan_path.read_text())
    assert validate(plan, batch, cost) == []
    assert s["predicted_step_time_s"] == pytest.approx(simulate(plan, batch, cost).step_time_s)
    assert main(["simulate", str(plan_path), *common]) == 0


def test_a_profiles_model_section_serves_as_a_model_file(tmp_path, capsys):
    lengths = _lengths(tmp_path, "4096\n")
    prof = _profile_file(tmp_path)
    out = tmp_path / "s.json"
    assert main(["plan", "--lengths", lengths, "--cluster", "h200x8", "--model", prof]) == 0
    assert main(["plan", "--lengths", lengths, "--cluster", "h200x8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["model"] == "llama-7b"  # the default, for comparison
    capsys.readouterr()


@pytest.mark.parametrize(
    "text, extra, field",
    [
        # --model names another layer shape than the profile measured: both are named
        ("100\n", ["--model", "llama-7b"], "measured for model 'llama-1b', whose layers differ"),
        ("1,9,16\n", [], "'llama-1b' is a 1d model but the batch holds 2d sequences"),
    ],
)
def test_profile_mismatches_are_one_line(tmp_path, capsys, text, extra, field):
    lengths = _lengths(tmp_path, text)
    prof = _profile_file(tmp_path)
    assert main(["plan", "--lengths", lengths, "--cluster", "h200x8", "--profile", prof, *extra])
    line = _one_error_line(capsys)
    assert field in line and "lm.profile.json" in line, line


def test_profile_with_a_model_of_the_same_layers_and_another_depth(tmp_path, capsys):
    # The profile measured one layer; a 32-layer model of that layer is planned with it.
    deep = {**LLAMA_1B.to_dict(), "name": "deep-lm", "num_layers": 32, "num_params": None}
    argv = ["plan", "--lengths", _lengths(tmp_path, "4096\n"), "--cluster", "h200x8"]
    argv += ["--profile", _profile_file(tmp_path), "--json"]
    out, out_deep = tmp_path / "s.json", tmp_path / "deep.json"
    assert main([*argv, str(out)]) == 0
    assert main([*argv, str(out_deep), "--model", _json_file(tmp_path, "m.json", deep)]) == 0
    s, s_deep = json.loads(out.read_text()), json.loads(out_deep.read_text())
    assert (s["model"], s_deep["model"]) == ("llama-1b", "deep-lm")
    # the Python API's figure for the deep model with this profile
    batch = Batch.from_lengths([4096])
    want = _api_step_time(argv[6], ModelSpec.from_dict(deep), batch, "h200x8")
    assert s_deep["predicted_step_time_s"] == pytest.approx(want, rel=1e-12)
    assert s_deep["predicted_step_time_s"] > s["predicted_step_time_s"]
    capsys.readouterr()


@pytest.mark.parametrize(
    "flag, content, field",
    [
        ("--model", '{"kind": "1d", "num_layers": 2, "hidden": 64', "m.json: not valid JSON"),
        ("--model", {**LLAMA_1B.to_dict(), "hidden": "x"}, "m.json: model.hidden: must be"),
        ("--model", {**LLAMA_1B.to_dict(), "kind": "4d"}, "m.json: model.kind: '4d' not allowed"),
        (
            "--model",
            {**LLAMA_1B.to_dict(), "kind": "3d"},
            "m.json: model.text_mode: '' not allowed",
        ),
        ("--model", {"kind": "1d", "hidden": 64}, "m.json: model: ModelSpec.__init__() missing"),
        ("--model", [1, 2], "m.json: expected a JSON object, got list"),
        ("--cluster", {**A100_3X4, "memory_bytes": "80GB"}, "m.json: cluster.memory_bytes"),
        ("--cluster", {**A100_3X4, "speed_factors": 5}, "m.json: cluster.speed_factors"),
        ("--cluster", {**A100_3X4, "num_nodes": 0}, "m.json: cluster.num_nodes"),
        ("--profile", {"kind": "1d"}, "m.json: profile.schema_version: missing"),
    ],
)
def test_bad_model_cluster_or_profile_file_is_one_line(tmp_path, capsys, flag, content, field):
    f = tmp_path / "m.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["plan", "--lengths", _lengths(tmp_path, "100\n"), flag, str(f)]) == 2
    assert field in _one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--model", "--cluster"])
def test_unknown_preset_mentions_json_files(tmp_path, capsys, flag):
    assert main(["plan", "--lengths", _lengths(tmp_path, "100\n"), flag, "nope.json"]) == 2
    line = _one_error_line(capsys)
    assert "unknown preset 'nope.json'" in line and line.endswith("or a JSON file")


def test_whatif_with_a_profile_is_run_whatif_with_its_cost(tmp_path, capsys):
    from dcp_opt.analysis.whatif import WhatIfConfig, run_whatif
    from dcp_opt.histogram import LengthDistribution
    from dcp_opt.profile_io import cost_model_from_profile

    prof = _profile_file(tmp_path)
    lengths = _lengths(tmp_path, "128\n4096\n4096\n30000\n")
    out = tmp_path / "w.json"
    argv = ["whatif", "--lengths", lengths, "--cluster", "h200x8", "--planners", "bucket"]
    argv += ["--batches", "1", "--sweep-batches", "1", "--gpus", "8", "--inter-bw-scale", "1"]
    argv += ["--tokens-per-gpu", "4096", "--no-progress", "--profile", prof, "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    config = WhatIfConfig("h200x8", None, 1, 1, (8,), (1.0,), 4096, ("bucket",))
    cost = cost_model_from_profile(prof, LLAMA_1B, cluster_preset("h200x8"))
    want = run_whatif(LengthDistribution.from_lengths(lengths), config, cost=cost)
    assert doc["config"]["model"] == "llama-1b"
    got, ref = doc["planners"][0], want["planners"][0]
    assert got["median_step_time_s"] == pytest.approx(ref["median_step_time_s"], rel=1e-12)


def test_bench_profile_replaces_the_model_of_its_kind_only(tmp_path, capsys):
    from dcp_opt.profile_io import cost_model_from_profile

    prof = _profile_file(tmp_path)
    out = tmp_path / "b.json"
    argv = ["bench", "--batches", "1", "--workloads", "1d-short,2d-short", "--cluster", "h200x8"]
    argv += ["--planners", "bucket", "--tokens-per-gpu", "4096", "--no-progress"]
    assert main([*argv, "--profile", prof, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())

    def make_cost(model, cluster):
        if model.kind == "2d":
            return CostModel(model, cluster)
        return cost_model_from_profile(prof, LLAMA_1B, cluster)

    config = BenchConfig("h200x8", ("1d-short", "2d-short"), ("bucket",), 1, tokens_per_gpu=4096)
    want = run_bench(config, make_cost=make_cost)
    assert doc["config"]["models"] == {"1d": "llama-1b", "2d": "opensora-stdit3-xl"}
    assert [r["model"] for r in doc["summary"]] == ["llama-1b", "opensora-stdit3-xl"]
    for got, ref in zip(doc["summary"], want["summary"], strict=True):
        assert got["median_step_time_s"] == pytest.approx(ref["median_step_time_s"], rel=1e-12)
    # a cluster file works for bench too: batches sized by its 12 GPUs
    out2 = tmp_path / "b2.json"
    cluster = _json_file(tmp_path, "c.json", A100_3X4)
    assert main([*argv, "--cluster", cluster, "--json", str(out2)]) == 0
    doc2 = json.loads(out2.read_text())
    assert doc2["config"]["num_gpus"] == 12 and all(r["all_valid"] for r in doc2["summary"])
