"""benchmarks/bench_quality.py: the per-workload figures and PASS/FAIL marks from hand-made
`dcp-opt bench` batch records (no planner runs)."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


def _bench():
    return load_script("benchmarks/bench_quality.py")


def _rec(workload, seed, planner, step, bound=1.0, valid=True):
    return {
        "workload": workload,
        "seed": seed,
        "planner": planner,
        "valid": valid,
        "step_time_s": step,
        "lower_bound_s": bound,
    }


def test_quality_row_figures_and_marks():
    q = _bench()
    recs = []
    # seed 0: cpsat 1.05 s vs bound 1.0; pac 1.3 s, static 1.2 s -> speedups 1.238, 1.143.
    # seed 1: cpsat 1.10 s; greedy 1.08 s is faster (slower count 1); pac 1.21 s -> 1.1.
    # seed 2: cpsat 1.00 s; pac 1.5 s -> 1.5; an invalid (faster) bucket plan is ignored.
    for seed, cp, pac, extra in [
        (0, 1.05, 1.3, [("static_tuned", 1.2, True)]),
        (1, 1.10, 1.21, [("greedy", 1.08, True)]),
        (2, 1.00, 1.5, [("bucket", 0.5, False)]),
    ]:
        recs.append(_rec("2d-long", seed, "cpsat", cp))
        recs.append(_rec("2d-long", seed, "dcp_inter_pac", pac))
        recs += [_rec("2d-long", seed, p, t, valid=v) for p, t, v in extra]
    recs.append(_rec("1d-long", 0, "cpsat", 9.0))  # another workload: not counted
    row = q.quality_row("2d-long", recs)
    assert row["num_batches"] == 3
    assert row["bound_ratio_median"] == pytest.approx(1.05)
    assert row["slower_count"] == 1 and row["slower_batches"][0][:2] == [1, "greedy"]
    assert row["speedup_vs_pac_median"] == pytest.approx(1.3 / 1.05)
    assert row["speedup_vs_static_median"] == pytest.approx(1.2 / 1.05)
    marks = {k: v["pass"] for k, v in row["checks"].items()}
    assert marks == {"bound_ratio": True, "slower": False, "vs_pac": True}


def test_online_vs_long_check():
    q = _bench()
    row = q.quality_row("1d-short", [_rec("1d-short", 0, "cpsat", 1.3)])
    assert row["checks"]["bound_ratio"]["pass"] is False  # 1.3 > 1.15 on 1D
    assert row["checks"]["vs_pac"]["pass"] is False  # no dcp_inter_pac plan: no figure
    q.add_long(row, [[0, 1.03, 1.0, 1.03], [1, 1.0, 1.0, 1.0]])
    assert row["online_vs_long_max"] == pytest.approx(0.03)
    assert row["checks"]["online_vs_long"]["pass"] is False
