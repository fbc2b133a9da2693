"""Planners offered ring (cost.sp_kinds with "ring", issue 25): each group's kind chosen over
ulysses, cp and ring, never slower than Ulysses-only greedy, bounds below every plan, the kind
map and the command line with ring."""

from __future__ import annotations

import json

import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.kinds import kind_shares
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_opt import Batch, CostModel, cluster_preset, validate
from dcp_opt.analysis.kind_map import kind_map, map_lines
from dcp_opt.bounds import lower_bound
from dcp_opt.cli.main import main
from dcp_opt.model import model_preset
from dcp_opt.table import seq_table
from tests.test_ring_cost import COST

ALL = ("ulysses", "cp", "ring")
BASE = CostModel(model_preset("llama3-8b"), cluster_preset("h200x64"))


def test_greedy_and_cpsat_choose_ring_where_it_wins():
    # llama3-8b (8 kv heads) at degree 64, 256K tokens: ring 2.65 s, cp 3.99 s, Ulysses
    # 5.25 s alone (32 heads cap Ulysses; ring hides most of its K/V steps behind attention)
    k = BASE.with_(sp_kinds=ALL)
    batch = Batch.from_lengths([262_144, 4096, 2048])
    ref = run_planner("greedy", batch, BASE)
    for name, opts in (("greedy", {}), ("cpsat", {"time_limit_s": 0.5, "deterministic": True})):
        got = run_planner(name, batch, k, **opts)
        assert validate(got.plan, batch, k) == []
        assert kind_shares(got.plan).get("ring", 0) > 0, name
        assert got.predicted_step_time_s < ref.predicted_step_time_s
        assert got.lower_bound_s <= got.predicted_step_time_s
    tab = seq_table(batch, k)
    assert k.sp_kinds[tab.kind[0, tab.degrees.index(64)]] == "ring"


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(256, 400_000), min_size=4, max_size=20))
def test_greedy_with_ring_is_never_slower_than_ulysses_greedy(lengths):
    k = BASE.with_(sp_kinds=ALL)
    batch = Batch.from_lengths(lengths)
    ref = run_planner("greedy", batch, BASE)
    got = run_planner("greedy", batch, k)
    assert validate(got.plan, batch, k) == []
    assert got.predicted_step_time_s <= ref.predicted_step_time_s * (1 + 1e-12)
    assert lower_bound(batch, k).value_s <= got.predicted_step_time_s * (1 + 1e-12)
    assert lp_bound(batch, k).value_s <= got.predicted_step_time_s * (1 + 1e-9)
    assert set(got.stats["sp_kind_shares"]) <= set(ALL)


def test_kind_map_covers_ring_by_hand():
    # test_ring_cost's toy, 1000 tokens at d=4 in a node: ring hides every transfer, so its
    # time is its compute, cp's 3e-3 s (r = 0); cp adds 2L gathers of 5.1e-5 s
    doc = kind_map(COST, [1000], degrees=[4])
    cell = doc["cells"][0][0]
    assert cell["ring_s"] == pytest.approx(3e-3, rel=1e-12)
    assert cell["cp_s"] == pytest.approx(3e-3 + 4 * 5.1e-5, rel=1e-12)
    assert cell["ring_over_ulysses"] == pytest.approx(3e-3 / cell["ulysses_s"], rel=1e-12)
    assert cell["winner"] == "ring"
    lines = map_lines(doc)
    assert lines[0].startswith("cp|ring/ulysses") and "|" in lines[1]
    # without ring offered the map is cp's as before (no ring keys)
    assert (
        "ring_s" not in kind_map(COST.with_(sp_kinds=("ulysses", "cp")), [1000], [4])["cells"][0][0]
    )


def test_plan_and_simulate_with_ring_on_the_command_line(tmp_path, capsys):
    plan, summary = tmp_path / "p.json", tmp_path / "s.json"
    args = ["--workload", "1d-long", "--model", "llama3-8b", "--cluster", "h200x64"]
    kinds = ["--sp-kinds", "ulysses,cp,ring"]
    assert main(["plan", *args, *kinds, "--out", str(plan), "--json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert sum(s["sp_kinds"].values()) == pytest.approx(1.0)
    assert set(s["sp_kinds"]) <= set(ALL)
    capsys.readouterr()
    assert main(["simulate", str(plan), *args, *kinds]) == 0
    # without ring offered a plan with ring groups is refused, the note names the flag
    if s["sp_kinds"].get("ring", 0) > 0:
        assert main(["simulate", str(plan), *args, "--sp-kinds", "ulysses,cp"]) == 1
        assert "--sp-kinds ulysses,cp,ring" in capsys.readouterr().err
