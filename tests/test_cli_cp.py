"""`--sp-kinds` on plan, simulate, bench and whatif, and the kind map (where cp or Ulysses wins,
dcp_opt.analysis.kind_map) that whatif writes with it (issue 16)."""

from __future__ import annotations

import json

import pytest

from dcp_opt import CostModel, cluster_preset, model_preset
from dcp_opt.analysis.kind_map import distribution_rows, kind_map, whatif_kind_map
from dcp_opt.cli import main
from dcp_opt.errors import DcpOptError
from dcp_opt.histogram import LengthDistribution
from tests.test_cp_cost import COST


def test_kind_map_cell_by_hand():
    # test_cp_cost's toy (2 layers; capacity ample, so r = 0 for both kinds), 1000 tokens at
    # d=4. cp: compute L (fwd + bwd) = 2 (5e-4 + 1e-3) = 3e-3 s, comm 2L x 5.1e-5 = 2.04e-4 s.
    # Ulysses: ceil(6/4)/6 = 1/3 of the attention, fwd 1e-3/3 + 2.5e-4, bwd twice that:
    # compute 2 x 3 x (1e-3/3 + 2.5e-4) = 3.5e-3 s, plus 2L all-to-alls of its own formula
    cp_s = 3e-3 + 4 * 5.1e-5
    u_s = 3.5e-3 + 4 * float(COST.comm_time_per_layer(1000, 4, False))
    doc = kind_map(COST.with_(sp_kinds=("ulysses", "cp")), [1000], degrees=[4])
    cell = doc["cells"][0][0]
    assert cell["cp_s"] == pytest.approx(cp_s, rel=1e-12)
    assert cell["ulysses_s"] == pytest.approx(u_s, rel=1e-12)
    assert cell["cp_over_ulysses"] == pytest.approx(cp_s / u_s, rel=1e-12)
    assert cell["winner"] == ("cp" if cp_s < u_s else "ulysses") == "cp"
    assert doc["lengths"] == [1000] and doc["degrees"] == [4] and doc["token_share"] is None


def test_kind_map_where_a_kind_does_not_fit():
    # llama-7b on h200x32 (32 heads, no GQA): a 256K-token sequence fits at d=2 under
    # Ulysses only (cp also holds the gathered K/V); 1M fits at d=2 under neither
    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x32"))
    doc = kind_map(cost, [262144, 1048576], degrees=[2, 32])
    only_u, neither = doc["cells"][0][0], doc["cells"][1][0]
    assert only_u["cp_s"] is None and only_u["ulysses_s"] > 0
    assert only_u["winner"] == "ulysses" and only_u["cp_over_ulysses"] is None
    assert neither == {"ulysses_s": None, "cp_s": None, "cp_over_ulysses": None, "winner": None}
    # at d=32 both fit; cp moves 31/32 of the whole sequence's K and V over the NIC at every
    # layer (Ulysses 31/32 of a 32nd of q, k, v, o): Ulysses wins
    assert doc["cells"][1][1]["winner"] == "ulysses" and doc["cells"][1][1]["cp_over_ulysses"] > 1
    with pytest.raises(DcpOptError, match="kind map: cp is for 1D models"):
        kind_map(CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x8")))


def test_distribution_rows_by_hand():
    # 300, 1000, 5000 tokens with probabilities .5, .3, .2: power-of-two bins from 256; rows at
    # each bin with tokens, its lower edge clamped into [300, 5000]: 300, 512, 4096. Token
    # shares 150 : 300 : 1000 of 1450
    dist = LengthDistribution(((300,), (1000,), (5000,)), (0.5, 0.3, 0.2))
    lengths, shares = distribution_rows(dist)
    assert lengths == [300, 512, 4096]
    assert shares == pytest.approx([150 / 1450, 300 / 1450, 1000 / 1450], rel=1e-12)


# ---- the command line --------------------------------------------------------------------------
PLAN = ["--workload", "1d-balanced", "--model", "llama3-8b", "--cluster", "h200x32"]


def test_plan_and_simulate_with_cp(tmp_path, capsys):
    plan, summary = tmp_path / "p.json", tmp_path / "s.json"
    args = [*PLAN, "--sp-kinds", "ulysses,cp"]
    assert main(["plan", *args, "--out", str(plan), "--json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    # on this workload greedy gives some groups cp (bench_cp.py: llama3-8b chooses cp)
    assert s["sp_kinds"]["cp"] > 0 and sum(s["sp_kinds"].values()) == pytest.approx(1.0)
    assert "sp kinds    cp" in capsys.readouterr().out
    kinds = {g["kind"] for ph in json.loads(plan.read_text())["phases"] for g in ph["groups"]}
    assert "cp" in kinds
    # simulate takes the kinds the plan records when --sp-kinds is not given (issue 28); told
    # other kinds, the plan is invalid (exit 1) and the note names the flag
    assert main(["simulate", str(plan), *PLAN, "--sp-kinds", "ulysses"]) == 1
    assert "--sp-kinds ulysses,cp" in capsys.readouterr().err
    for given in ([], ["--sp-kinds", "ulysses,cp"]):
        out = tmp_path / "sim.json"
        assert main(["simulate", str(plan), *PLAN, *given, "--json", str(out)]) == 0
        sim = json.loads(out.read_text())
        assert sim["step_time_s"] == pytest.approx(s["predicted_step_time_s"], rel=1e-9)
    # Ulysses-only planning of the same batch is never faster (solvers/kinds.py)
    assert main(["plan", *PLAN, "--json", str(summary)]) == 0
    u = json.loads(summary.read_text())
    assert u["sp_kinds"] == {"ulysses": 1.0}
    assert s["predicted_step_time_s"] <= u["predicted_step_time_s"] * (1 + 1e-12)


@pytest.mark.parametrize(
    ("command", "value", "needle"),
    [
        (["plan", *PLAN], "ring", "--sp-kinds: 'ring' not allowed; allowed: 'ulysses' with"),
        (["plan", *PLAN], "cp", "--sp-kinds: 'cp' not allowed"),
        (["plan", *PLAN], "ulysses,ulysses", "--sp-kinds: 'ulysses,ulysses' not allowed"),
        (["plan", "--workload", "2d-short", "--cluster", "h200x8"], "ulysses,cp",
         "--sp-kinds: 'cp' not allowed for 2d"),
        (["bench", "--workloads", "1d-short", "--no-progress"], "ulysses,star",
         "--sp-kinds: 'ulysses,star' not allowed"),
        (["plan", "--workload", "2d-short", "--cluster", "h200x8"], "ulysses,ring",
         "--sp-kinds: 'ring' not allowed for 2d"),
    ],
)  # fmt: skip
def test_bad_sp_kinds_is_one_line(capsys, command, value, needle):
    assert main([*command, "--sp-kinds", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dcp-opt: error:") and needle in err and "\n" not in err


def test_bench_passes_the_kinds(tmp_path, capsys):
    out = tmp_path / "b.json"
    base = ["bench", "--workloads", "1d-balanced", "--planners", "greedy", "--batches", "1",
            "--model-1d", "llama3-8b", "--no-progress", "--json", str(out)]  # fmt: skip
    times = {}
    for kinds in ("ulysses", "ulysses,cp"):
        assert main([*base, "--sp-kinds", kinds]) == 0
        doc = json.loads(out.read_text())
        assert doc["config"]["sp_kinds"] == kinds.split(",")
        times[kinds] = doc["summary"][0]
    capsys.readouterr()
    # the same batch: with cp offered the bound is lower (it takes the least over the kinds,
    # dcp_opt/cost/ sp_kinds), so the kinds reached the cost model; greedy is never slower
    u, cp = times["ulysses"], times["ulysses,cp"]
    assert cp["median_lower_bound_s"] < u["median_lower_bound_s"]
    assert cp["median_step_time_s"] <= u["median_step_time_s"] * (1 + 1e-12)


def test_whatif_writes_the_kind_map(tmp_path, capsys):
    lens = tmp_path / "l.txt"
    lens.write_text("\n".join(str(n) for n in (2048, 3000, 9000, 40000, 70000, 150000)) + "\n")
    out, png = tmp_path / "w.json", tmp_path / "w.png"
    args = ["whatif", "--lengths", str(lens), "--model", "llama3-8b", "--planners",
            "bucket,greedy", "--batches", "1", "--sweep-batches", "1", "--gpus", "32",
            "--inter-bw-scale", "1", "--no-progress", "--json", str(out)]  # fmt: skip
    assert main([*args, "--sp-kinds", "ulysses,cp", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "where each SP kind wins" in text and "SP kinds it uses" in text
    doc = json.loads(out.read_text())
    km = doc["kind_map"]
    assert doc["config"]["sp_kinds"] == ["ulysses", "cp"]
    assert km["lengths"] == [2048, 8192, 32768, 65536, 131072]  # the bins that hold tokens
    assert km["degrees"] == [2, 4, 8, 16, 32] and len(km["cells"]) == 5
    assert sum(km["token_share"]) == pytest.approx(1.0)
    assert sum(km["best_planner_kind_shares"].values()) == pytest.approx(1.0)
    # the cell the planner compares: short sequences at degree 32 gain from cp (no head limit)
    assert km["cells"][0][-1]["winner"] == "cp" and km["cells"][0][-1]["cp_over_ulysses"] < 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Ulysses only (the default): no map in the document
    dist = LengthDistribution.from_lengths(str(lens))
    assert (
        whatif_kind_map(dist, CostModel(model_preset("llama3-8b"), cluster_preset("h200x32")), [])
        == {}
    )
