"""The what-if analyser: histogram input, sampling, figures by hand arithmetic on the toy cost
model with stub planners, the sweeps, the CLI with the real planners, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dcp_opt import Batch, Group, MicroBatch, cluster_preset, make_plan, simulate, solvers
from dcp_opt.analysis.whatif import (
    Outcome,
    WhatIfConfig,
    degree_rows,
    run_whatif,
    scaled_cluster,
    spread,
)
from dcp_opt.cli import main
from dcp_opt.errors import DcpOptError
from dcp_opt.histogram import LengthDistribution
from tests import stub_planners
from tests.toy import toy_cost

STUB_MODULE = "dcp_opt.solvers._test_stub"


@pytest.fixture
def stubs(monkeypatch):
    """bucket -> one group per node (stub_nodes), greedy -> one whole-cluster group."""
    monkeypatch.setitem(sys.modules, STUB_MODULE, stub_planners)
    monkeypatch.setitem(solvers.PLANNERS, "bucket", "_test_stub:plan_nodes")
    monkeypatch.setitem(solvers.PLANNERS, "greedy", "_test_stub:plan_whole")
    monkeypatch.setitem(solvers.PLANNERS, "stub_boom", "_test_stub:plan_boom")


# ---- input -------------------------------------------------------------------------------------
def test_histogram_with_header_comments_and_repeated_bins():
    text = "# my corpus\nlength,count\n2048, 1\n512,2.5  # weights need not be integers\n512,0.5\n"
    d = LengthDistribution.from_histogram_text(text)
    # bins sorted by tokens; the two 512 rows add up to 3
    assert d.shapes == ((512,), (2048,)) and d.weights == (3.0, 1.0)
    assert d.kind == "1d"
    np.testing.assert_allclose(d.probabilities, [0.75, 0.25])
    s = d.summary()
    # mean = 0.75 * 512 + 0.25 * 2048 = 896; the median bin is 512, p90 2048
    assert s["mean_tokens"] == 896 and s["p50_tokens"] == 512 and s["p90_tokens"] == 2048


def test_histogram_2d_rows():
    d = LengthDistribution.from_histogram_text("frames,height,width,count\n1,9,16,3\n30,45,80,1\n")
    assert d.kind == "2d" and d.shapes == ((1, 9, 16), (30, 45, 80))


def test_token_histogram_by_hand():
    d = LengthDistribution.from_histogram_text("512,3\n2048,1\n")
    h = d.token_histogram()
    # power-of-two bins [512,1024), [1024,2048), [2048,4096)
    assert h["edges"] == [512, 1024, 2048, 4096]
    np.testing.assert_allclose(h["sequence_share"], [0.75, 0, 0.25])
    # tokens: 3 * 512 = 1536 and 2048 -> 1536 / 3584 and 2048 / 3584
    np.testing.assert_allclose(h["token_share"], [1536 / 3584, 0, 2048 / 3584])


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "no bins"),
        ("# only a comment\n", "no bins"),
        ("512,abc\n", ":1: count must be a number"),
        ("512,-1\n", ":1: count must be a finite number >= 0"),
        ("512,0\n1024,0\n", "positive total"),
        ("512.5,3\n", ":1: shape must be integers"),
        ("0,3\n", ":1: shape entries must be >= 1"),
        ("512,1\n4,8,8,1\n", ":2: 4 columns but earlier rows have 2"),
        ("512,1,2\n", ":1: expected `length,count`"),
        ("len,n\n512,1\n", ":1: header"),
    ],
)
def test_bad_histogram_names_the_problem(text, needle):
    with pytest.raises(DcpOptError, match=None) as e:
        LengthDistribution.from_histogram_text(text, source="h.csv")
    assert needle in str(e.value) and "h.csv" in str(e.value)


def test_lengths_file_counts_distinct_shapes(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("100\n300\n100\n100\n")
    d = LengthDistribution.from_lengths(f)
    assert d.shapes == ((100,), (300,)) and d.weights == (3.0, 1.0)


def test_sample_batch_stops_at_the_budget_and_is_seeded():
    one = LengthDistribution(((4,),), (1.0,))
    # 4, 8, 12 tokens: the third sequence crosses a budget of 10
    assert [s.shape for s in one.sample_batch(0, 10).sequences] == [(4,)] * 3
    assert len(one.sample_batch(0, 12)) == 3
    d = LengthDistribution(((100,), (1000,)), (3.0, 1.0))
    a, b = d.sample_batch(7, 200_000), d.sample_batch(7, 200_000)
    assert a == b and a != d.sample_batch(8, 200_000)
    assert a.num_tokens >= 200_000 and a.num_tokens - a.sequences[-1].num_tokens < 200_000
    # about 3/4 of the sequences are short (about 615 draws: 4 standard deviations ~ 0.07)
    share = np.mean([s.shape == (100,) for s in a.sequences])
    assert abs(share - 0.75) < 0.07


# ---- pieces by hand ----------------------------------------------------------------------------
def test_spread_percentiles():
    # numpy linear interpolation over 1..5: p10 = 1 + 0.4 = 1.4, p90 = 4.6
    s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"median": 3.0, "p10": pytest.approx(1.4), "p90": pytest.approx(4.6),
                 "min": 1.0, "max": 5.0}  # fmt: skip
    assert spread([]) is None


def test_scaled_cluster_matches_presets_and_rejects_bad_counts():
    base = cluster_preset("h200x32")
    assert scaled_cluster(base, 16) == cluster_preset("h200x16")
    assert scaled_cluster(base, 4) == cluster_preset("h200x4")
    assert scaled_cluster(base, 32) is base
    with pytest.raises(DcpOptError, match="gpus: 12 not allowed"):
        scaled_cluster(base, 12)
    mixed = toy_cost(speed_factors=(1.0, 1.0, 0.5, 0.5)).cluster
    with pytest.raises(DcpOptError, match="mixed"):
        scaled_cluster(mixed, 8)


def test_degree_rows_by_hand():
    cm = toy_cost()
    batch = Batch.from_lengths([8, 2, 2])
    # As tests/test_gantt.py: group (0, 2) runs seq 0 with r=1 for 24.5 + 4 = 28.5 s -> 57
    # GPU-s; group (2, 1) runs seqs 1 and 2 for 12.5 s each -> 25 GPU-s. Total 82 GPU-s.
    plan = make_plan(
        [[Group(0, 2, (MicroBatch((0,), 1),)), Group(2, 1, (MicroBatch((1,)), MicroBatch((2,))))]],
        batch,
        cm,
        planner="hand",
    )
    sim = simulate(plan, batch, cm)
    rows = degree_rows([(batch, Outcome("hand", sim.step_time_s, 0.0, sim))], cm)
    d1, d2 = rows
    assert d1["degree"] == 1 and d2["degree"] == 2
    assert d1["gpu_time_share"] == pytest.approx(25 / 82)
    assert d2["gpu_time_share"] == pytest.approx(57 / 82)
    assert d1["sequence_share"] == pytest.approx(2 / 3) and d2["token_share"] == pytest.approx(
        8 / 12
    )
    assert (d1["min_tokens"], d1["median_tokens"], d1["max_tokens"], d2["min_tokens"]) == (
        2,
        2,
        2,
        8,
    )
    # seq 0 recomputes 1 of the toy's 2 layers: half its layers; degree 1 recomputes none
    assert d2["recompute_fraction"] == pytest.approx(0.5) and d1["recompute_fraction"] == 0


# ---- the whole analysis on the toy model -------------------------------------------------------
def _toy_config(**kw) -> WhatIfConfig:
    base = dict(num_batches=2, sweep_batches=1, gpus=(2, 4), inter_bw_scales=(0.5, 1.0),
                tokens_per_gpu=3, planners=("bucket", "greedy", "stub_boom"))  # fmt: skip
    return WhatIfConfig(**{**base, **kw})


def test_run_whatif_on_the_toy_by_hand(stubs):
    cm = toy_cost(num_nodes=2, gpus_per_node=2)
    dist = LengthDistribution(((4,),), (1.0,))
    doc = run_whatif(dist, _toy_config(), cost=cm)
    rows = {r["planner"]: r for r in doc["planners"]}
    # Budget 4 GPUs x 3 tokens = 12 -> three sequences of 4 tokens.
    # greedy (whole cluster, d=4): each 6*4/4 + 0.5 = 6.5 s -> 19.5 s.
    # bucket (a d=2 group per node): each 6*4/2 + 0.5 = 12.5 s; node 0 runs two -> 25 s.
    assert rows["greedy"]["median_step_time_s"] == pytest.approx(19.5)
    assert rows["bucket"]["median_step_time_s"] == pytest.approx(25.0)
    assert rows["greedy"]["speedup"]["median"] == pytest.approx(25 / 19.5)
    assert rows["bucket"]["speedup"]["median"] == 1.0
    assert rows["greedy"]["median_tokens_per_s"] == pytest.approx(12 / 19.5)
    # memory: 9 B of states + 4/4 tokens * 30 B = 39 B of 100 B -> 61% headroom
    assert rows["greedy"]["peak_memory_gb"]["max"] * 1e9 == pytest.approx(39)
    assert rows["greedy"]["min_headroom"] == pytest.approx(0.61)
    # the failing planner is reported, never chosen
    assert rows["stub_boom"]["num_valid"] == 0 and "boom" in rows["stub_boom"]["errors"][0]
    assert doc["best_planner"] == "greedy"
    assert any("stub_boom" in w for w in doc["warnings"])
    assert [d["degree"] for d in doc["degrees"]] == [4]
    assert doc["degrees"][0]["gpu_time_share"] == pytest.approx(1.0)
    # sweep on 2 GPUs (one node): budget 6 -> two sequences; both stubs run one d=2 group,
    # 12.5 s each -> equal, speedup 1. On 4 GPUs it reuses the first batch: 25 / 19.5.
    g2, g4 = doc["sweep_gpus"]
    assert g2["cluster"] == "toy@2" and g2["speedup"]["greedy"]["median"] == pytest.approx(1.0)
    assert g4["speedup"]["greedy"]["median"] == pytest.approx(25 / 19.5)
    # the toy has no communication: the bandwidth changes nothing
    for r in doc["sweep_inter_bw"]:
        assert r["speedup"]["greedy"]["median"] == pytest.approx(25 / 19.5)
    json.dumps(doc)  # plain JSON types only


def test_sweep_point_where_a_bin_does_not_fit(stubs, monkeypatch):
    monkeypatch.setitem(solvers.PLANNERS, "bucket", "_test_stub:plan_whole")
    cm = toy_cost(num_nodes=2, gpus_per_node=2)
    # 20 tokens: at d=4, 5 per GPU: 9 + 5 * (30 - 8*2) = 79 B fits with both layers
    # recomputed; on 2 GPUs, 10 per GPU: 9 + 6 + 10 * 14 > 100 B fits nowhere.
    dist = LengthDistribution(((20,),), (1.0,))
    doc = run_whatif(dist, _toy_config(tokens_per_gpu=5, planners=("bucket", "greedy")), cost=cm)
    g2, g4 = doc["sweep_gpus"]
    assert g2["speedup"] == {"greedy": None} and "cannot fit" in g2["note"]
    assert g4["speedup"]["greedy"]["median"] == pytest.approx(1.0) and g4["note"] == ""


def test_a_bin_that_never_fits_is_one_error(stubs):
    cm = toy_cost(num_nodes=2, gpus_per_node=2)
    dist = LengthDistribution(((40,),), (1.0,), source="histogram big.csv")
    with pytest.raises(DcpOptError, match=r"histogram big.csv: bin \(40,\) cannot fit on toy"):
        run_whatif(dist, _toy_config(), cost=cm)


def test_bucket_is_required(stubs):
    with pytest.raises(DcpOptError, match="must include 'bucket'"):
        run_whatif(LengthDistribution(((4,),), (1.0,)), _toy_config(planners=("greedy",)),
                   cost=toy_cost())  # fmt: skip


# ---- CLI with the real planners ----------------------------------------------------------------
def test_cli_whatif_real_planners_writes_json_and_png(tmp_path, capsys):
    hist = tmp_path / "h.csv"
    hist.write_text("length,count\n1024,600\n4096,300\n16384,60\n65536,8\n")
    out, png = tmp_path / "w.json", tmp_path / "w.png"
    rc = main(
        ["whatif", "--histogram", str(hist), "--cluster", "h200x16", "--batches", "3",
         "--sweep-batches", "1", "--gpus", "8,16", "--inter-bw-scale", "0.5,1",
         "--time-limit", "0.3", "--json", str(out), "--plot", str(png), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "best planner" in text and "SP degrees it uses" in text and "headroom" in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == "dcp-opt-whatif/1" and doc["config"]["num_gpus"] == 16
    rows = {r["planner"]: r for r in doc["planners"]}
    assert rows["bucket"]["speedup"]["median"] == 1.0
    best = rows[doc["best_planner"]]
    for r in rows.values():
        if r["speedup"]:
            assert r["speedup"] == spread(r["speedup_per_batch"])
            assert best["speedup"]["median"] >= r["speedup"]["median"]
        if r["peak_memory_gb"]:  # validated plans fit
            assert r["peak_memory_gb"]["max"] <= r["capacity_gb"] * (1 + 1e-6)
    assert sum(d["gpu_time_share"] for d in doc["degrees"]) == pytest.approx(1.0)
    # the 16-GPU sweep point and bandwidth x1 reuse the first main batch
    first = best["speedup_per_batch"][0]
    assert doc["sweep_gpus"][1]["speedup"][doc["best_planner"]]["median"] == pytest.approx(first)
    assert doc["sweep_inter_bw"][1]["speedup"][doc["best_planner"]]["median"] == pytest.approx(
        first
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "text,extra,needle",
    [
        ("512,x\n", [], "h.csv:1: count must be a number"),
        ("512,1\n", ["--model", "opensora-stdit3-xl"], "model: 'opensora-stdit3-xl' is a 2d"),
        ("512,1\n", ["--gpus", "8,x"], "gpus: expected comma-separated numbers"),
        ("512,1\n", ["--gpus", "12"], "gpus: 12 not allowed"),
        ("512,1\n", ["--batches", "0"], "num_batches: must be >= 1"),
        ("512,1\n", ["--inter-bw-scale", "0"], "inter_bw_scales: every entry must be > 0"),
        ("20000000,1\n", [], "bin (20000000,) cannot fit on h200x32"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, capsys, text, extra, needle):
    hist = tmp_path / "h.csv"
    hist.write_text(text)
    assert main(["whatif", "--histogram", str(hist), *extra, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dcp-opt: error:") and needle in err and "\n" not in err


def test_cli_missing_file(tmp_path, capsys):
    assert main(["whatif", "--lengths", str(tmp_path / "nope.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_whatif_imports_neither_matplotlib_nor_rich():
    code = (
        "import sys, dcp_opt.analysis.whatif, dcp_opt.analysis.whatif_display, dcp_opt.histogram; "
        "print([m for m in ('matplotlib', 'rich', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_recommendation_lists_errors_when_no_planner_succeeds():
    from dcp_opt.analysis.whatif_display import recommendation

    doc = {
        "best_planner": None,
        "planners": [
            {"planner": "greedy", "errors": ["sequence 3 cannot fit"]},
            {"planner": "bucket", "errors": []},
        ],
    }
    assert recommendation(doc) == [
        "no planner gave a valid plan on any batch",
        "greedy: sequence 3 cannot fit",
    ]


@pytest.mark.parametrize(
    "data,says",
    [
        ("512,3\n".encode("utf-16"), "UTF-16 text; save it as UTF-8"),
        (b"512,3\n\xff\xfe\x00bad", "not UTF-8 text"),
    ],
)
def test_from_histogram_refuses_foreign_encodings_from_the_python_api(tmp_path, data, says):
    # The CLI read histograms safely; the Python API raised UnicodeDecodeError (session 7).
    f = tmp_path / "hist.csv"
    f.write_bytes(data)
    with pytest.raises(DcpOptError, match=f"histogram file .*hist.csv.*: {says}"):
        LengthDistribution.from_histogram(f)
