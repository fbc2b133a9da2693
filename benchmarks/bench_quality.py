"""CP-SAT plan quality on the standard workloads: issue 3's quality acceptance, reproducibly.

    .venv/bin/python benchmarks/bench_quality.py [--batches 20] [--budget S]
        [--long-budget 60 --long-batches 5] [--json OUT]

Every standard workload (dcp_opt.workloads) on h200x32 with the models of `dcp-opt bench`
(2D: opensora-stdit3-xl, 1D: llama-7b), seeded batches 0..batches-1 drawn exactly as
`dcp-opt bench` draws them (dcp_opt.analysis.bench.run_bench runs every planner, validates and
simulates each plan, and takes the tightest bound), so the figures match `dcp-opt bench
--batches 20`. Per workload, with the targets of issue 3 (PASS / FAIL):
  bound ratio     median of cpsat step time / tightest bound    <= 1.10 (2D), <= 1.15 (1D)
  slower          batches where cpsat is slower than the best of the other planners  0
  vs pac          median per-batch speedup over dcp_inter_pac  >= 1.20 (2D), >= 1.08 (1D),
                  in the one-batch framing (below): a regression check of the planner, not
                  the gain a user sees over the published method
  vs static       median per-batch speedup over static_tuned   (reported, no target)
  online vs long  with --long-batches N > 0: the first N batches planned again by CP-SAT
                  with --long-budget seconds; max over them of online / long - 1  <= 2%
                  (niced or loaded, the long solve gets less search too; --long-deterministic
                  counts CP-SAT's deterministic time instead of wall time)
cpsat runs as online (its default options, or `--budget`); a machine under load gives it less
search, which only makes its figures conservative.

Framing (ONE_BATCH_FRAMING, dcp_opt/analysis/bench_display.py): every figure here is one fixed
2M-token batch per optimizer step, and dcp_inter_pac is "the published profile forced into a
fixed batch" (memory cap 0.9, no drop_last, PAC's minimum accumulation 2, one step per batch),
not PAC as published, which forms its own 7-25M-token steps over an epoch and none from one
such batch. So "vs pac" (issue 3's target) says how the planner does on one batch against
that forced form; it is not a throughput gain at fixed training semantics. The honest
comparison is the stream benchmark (`dcp-opt bench --stream`, dcp_opt/analysis/stream.py;
benchmarks/results/stream.txt; docs/baselines.md "What a user gains"): at the published PAC's
own median step, nothing dropped, the project's planner is 1.05-1.14x over published PAC on
the 2D workloads, 1.22-1.32x on 1D, within 0.4-2 % of the stream bound (recorded run at
c3deebc).
JSON: {"config", "framing" (ONE_BATCH_FRAMING), "rows": [one per workload: workload, kind, num_batches, bound_ratio_median,
bound_ratio_max, slower_count, slower_batches ([seed, planner, ratio]), speedup_vs_pac_median,
speedup_vs_static_median, long ([seed, online_s, long_s, ratio]), online_vs_long_max,
checks ({name: {"value", "target", "pass"}})], "all_pass", "wall_time_s"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from dcp_opt.solvers import BASELINES, run_planner

from dcp_opt import CostModel, cluster_preset, model_preset, standard_batch
from dcp_opt.analysis.bench import BenchConfig, run_bench
from dcp_opt.analysis.bench_display import ONE_BATCH_FRAMING
from dcp_opt.workloads import STANDARD_WORKLOADS, Workload

CLUSTER = "h200x32"
OTHERS = (*BASELINES, "greedy")
TARGETS = {  # (bound ratio at most, speedup over dcp_inter_pac at least)
    "2d": (1.10, 1.20),
    "1d": (1.15, 1.08),
}
LONG_WITHIN = 0.02  # the online plan within 2% of a long solve


def quality_row(workload: str, batches: list[dict]) -> dict:
    """The figures of one workload from `dcp-opt bench` batch records (cpsat and OTHERS)."""
    kind = Workload.parse(workload).kind
    by_seed: dict[int, dict] = {}
    for b in batches:
        if b["workload"] == workload:
            by_seed.setdefault(b["seed"], {})[b["planner"]] = b
    ratios, slower, vs_pac, vs_static = [], [], [], []
    for seed, recs in sorted(by_seed.items()):
        cp = recs.get("cpsat")
        if cp is None or not cp["valid"]:
            slower.append([seed, "cpsat invalid", None])
            continue
        t = cp["step_time_s"]
        ratios.append(t / cp["lower_bound_s"])
        best = min(
            ((r["step_time_s"], p) for p, r in recs.items() if p in OTHERS and r["valid"]),
            default=None,
        )
        if best is not None and t > best[0] * (1 + 1e-9):
            slower.append([seed, best[1], t / best[0]])
        for ref, out in (("dcp_inter_pac", vs_pac), ("static_tuned", vs_static)):
            if recs.get(ref, {}).get("valid"):
                out.append(recs[ref]["step_time_s"] / t)
    bound_max, pac_min = TARGETS[kind]
    row = {
        "workload": workload,
        "kind": kind,
        "num_batches": len(by_seed),
        "bound_ratio_median": _median(ratios),
        "bound_ratio_max": max(ratios, default=None),
        "slower_count": len(slower),
        "slower_batches": slower,
        "speedup_vs_pac_median": _median(vs_pac),
        "speedup_vs_static_median": _median(vs_static),
        "long": [],
        "online_vs_long_max": None,
    }
    row["checks"] = {
        "bound_ratio": _check(row["bound_ratio_median"], f"<= {bound_max}", bound_max, False),
        "slower": _check(row["slower_count"], "== 0", 0, False),
        "vs_pac": _check(row["speedup_vs_pac_median"], f">= {pac_min}", pac_min, True),
    }
    return row


def add_long(row: dict, long: list[list]) -> None:
    """Attach [seed, online_s, long_s, online / long] rows and their check."""
    row["long"] = long
    worst = max((x[3] - 1.0 for x in long), default=None)
    row["online_vs_long_max"] = worst
    if long:
        row["checks"]["online_vs_long"] = _check(worst, f"<= {LONG_WITHIN:.0%}", LONG_WITHIN, False)


def _check(value, target: str, limit: float, at_least: bool) -> dict:
    ok = value is not None and (value >= limit if at_least else value <= limit)
    return {"value": value, "target": target, "pass": bool(ok)}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def long_solves(
    doc: dict, workload: str, n: int, budget: float, workers: int, deterministic: bool = False
) -> list[list]:
    """The first n batches of `workload` planned by CP-SAT with `budget` seconds."""
    kind = Workload.parse(workload).kind
    cluster = cluster_preset(CLUSTER)
    cost = CostModel(model_preset(doc["config"]["models"][kind]), cluster)
    online = {
        b["seed"]: b["step_time_s"]
        for b in doc["batches"]
        if b["workload"] == workload and b["planner"] == "cpsat" and b["valid"]
    }
    out = []
    for seed in sorted(online)[:n]:
        batch = standard_batch(workload, seed, num_gpus=cluster.num_gpus)
        res = run_planner(
            "cpsat",
            batch,
            cost,
            time_limit_s=budget,
            num_workers=workers,
            deterministic=deterministic,
        )
        long_s = res.predicted_step_time_s
        out.append([seed, online[seed], long_s, online[seed] / long_s])
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'workload':12} {'bound ratio':<20} {'slower':<12}{'vs pac (one batch)':<21}"
        f"{'vs static':>9}  online vs long (<= 2%)"
    )
    for r in rows:
        c = r["checks"]
        mark = {name: "PASS" if x["pass"] else "FAIL" for name, x in c.items()}
        mark.setdefault("online_vs_long", "")
        print(
            f"{r['workload']:12} {_fmt(r['bound_ratio_median'], '.3f'):>6} "
            f"{c['bound_ratio']['target']:>7} {mark['bound_ratio']:4} "
            f"{r['slower_count']:>3}/{r['num_batches']:<3} {mark['slower']:4} "
            f"{_fmt(r['speedup_vs_pac_median'], '.3f'):>6}x {c['vs_pac']['target']:>7} "
            f"{mark['vs_pac']:4} {_fmt(r['speedup_vs_static_median'], '.3f'):>8}x "
            f"{_fmt(r['online_vs_long_max'], '+.2%'):>8} {mark['online_vs_long']:4}"
        )
    for r in rows:
        for seed, who, ratio in r["slower_batches"]:
            print(f"  {r['workload']} seed {seed}: cpsat slower than {who} ({_fmt(ratio, '.4f')})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(w.name for w in STANDARD_WORKLOADS))
    ap.add_argument("--batches", type=int, default=20, help="seeded batches per workload")
    ap.add_argument("--budget", type=float, help="online cpsat time_limit_s (default: cpsat's)")
    ap.add_argument("--long-budget", type=float, default=60.0, help="long CP-SAT solve (s)")
    ap.add_argument("--long-batches", type=int, default=0, help="batches per workload re-solved")
    ap.add_argument("--long-workers", type=int, default=1, help="CP-SAT workers of a long solve")
    ap.add_argument(
        "--long-deterministic",
        action="store_true",
        help="long solves count CP-SAT's deterministic time (load-independent, slower in wall)",
    )
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    started = time.perf_counter()
    workloads = tuple(a.workloads.split(","))
    config = BenchConfig(
        cluster=CLUSTER,
        workloads=workloads,
        planners=(*OTHERS, "cpsat"),
        num_batches=a.batches,
        planner_options={} if a.budget is None else {"time_limit_s": a.budget},
    )
    doc = run_bench(config)
    rows = [quality_row(w, doc["batches"]) for w in workloads]
    if a.long_batches > 0:
        for row in rows:
            w = row["workload"]
            long = long_solves(
                doc, w, a.long_batches, a.long_budget, a.long_workers, a.long_deterministic
            )
            add_long(row, long)
            print(f"long solves done: {w}", flush=True)
    print_table(rows)
    print(f"vs pac: {ONE_BATCH_FRAMING}")
    all_pass = all(c["pass"] for r in rows for c in r["checks"].values())
    wall = time.perf_counter() - started
    print(f"all targets {'PASS' if all_pass else 'FAIL'}; {wall:.0f} s")
    if a.json:
        cfg = {k: v for k, v in vars(a).items() if k != "json"}
        out = {"config": {**cfg, "cluster": CLUSTER}, "framing": ONE_BATCH_FRAMING, "rows": rows}
        out.update(all_pass=all_pass, wall_time_s=wall, bench_warnings=doc["warnings"])
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
