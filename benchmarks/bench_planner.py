"""Planner latency and quality at growing scale: p50/p99 wall time and gap to the bound.

    .venv/bin/python benchmarks/bench_planner.py [--reps 10] [--budget 0.2] [--json out.json]

Scales (GPUs x sequences): 32 x 256, 64 x 512, 256 x 2048, 1024 x 8192, on `h200xN` clusters.
Each batch draws exactly that many sequences from a standard workload's distribution
(`--workloads`, default 1d-balanced and 2d-balanced), seeded by repetition. Every planner is
called once first to warm up (imports, OR-Tools start-up), then `--reps` times per scale.
Gap = predicted step time / lower bound - 1 (the planner's own, tightest bound). CPU time
(all threads of the process) is reported next to wall time: on a shared machine the wall
time also counts waiting for a core.
JSON keys: {"config": {...}, "rows": [{"planner", "workload", "gpus", "seqs", "reps",
"p50_ms", "p99_ms", "max_ms", "cpu_p50_ms", "cpu_p99_ms", "gap_median", "gap_max", "over_budget_ms_max", "statuses"}]}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from dcp_opt.solvers import run_planner

from dcp_opt import Batch, CostModel, cluster_preset, model_preset, validate
from dcp_opt.batch import Sequence
from dcp_opt.workloads import Workload

SCALES = ((32, 256), (64, 512), (256, 2048), (1024, 8192))
MODELS = {"1d": "llama-7b", "2d": "opensora-stdit3-xl"}


def batch_of(workload: str, n: int, seed: int) -> Batch:
    wl = Workload.parse(workload)
    rng = np.random.default_rng(seed)
    return Batch(tuple(Sequence(i, wl.sample_shape(rng)) for i in range(n)))


def options(planner: str, budget: float) -> dict:
    return {"time_limit_s": budget} if planner == "cpsat" else {}


def run_scale(planner: str, workload: str, gpus: int, seqs: int, reps: int, budget: float):
    model = model_preset(MODELS[workload[:2]])
    cluster = cluster_preset(f"h200x{gpus}")
    walls, cpus, gaps, statuses = [], [], [], {}
    for rep in range(reps):
        batch = batch_of(workload, seqs, rep)
        cost = CostModel(model, cluster)  # fresh: no table cached from an earlier call
        t0, c0 = time.perf_counter(), time.process_time()
        res = run_planner(planner, batch, cost, **options(planner, budget))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        assert validate(res.plan, batch, cost) == [], (planner, workload, gpus, rep)
        gaps.append(res.gap)
        statuses[res.status] = statuses.get(res.status, 0) + 1
    w = np.array(walls) * 1e3
    limit = budget * 1e3 if planner == "cpsat" else 0.0
    return {
        "planner": planner,
        "workload": workload,
        "gpus": gpus,
        "seqs": seqs,
        "reps": reps,
        "p50_ms": float(np.percentile(w, 50)),
        "p99_ms": float(np.percentile(w, 99)),
        "max_ms": float(w.max()),
        "cpu_p50_ms": float(np.median(cpus) * 1e3),
        "cpu_p99_ms": float(np.percentile(np.array(cpus) * 1e3, 99)),
        "gap_median": float(np.median(gaps)),
        "gap_max": float(np.max(gaps)),
        "over_budget_ms_max": float(w.max() - limit) if planner == "cpsat" else None,
        "statuses": statuses,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planners", default="greedy,cpsat")
    ap.add_argument("--workloads", default="1d-balanced,2d-balanced")
    ap.add_argument("--scales", default=",".join(f"{g}x{s}" for g, s in SCALES))
    ap.add_argument("--reps", type=int, default=10, help="batches per scale (seeded 0..reps-1)")
    ap.add_argument("--big-reps", type=int, default=3, help="reps at 1024 GPUs and above")
    ap.add_argument("--budget", type=float, default=0.2, help="cpsat time_limit_s")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    scales = [tuple(int(x) for x in s.split("x")) for s in a.scales.split(",")]
    planners, workloads = a.planners.split(","), a.workloads.split(",")
    for p in planners:  # warm-up: imports and solver start-up are not planning latency
        warm = CostModel(model_preset(MODELS["1d"]), cluster_preset("h200x8"))
        run_planner(p, batch_of("1d-short", 16, 0), warm)
    rows = []
    print(
        f"{'planner':8} {'workload':12} {'scale':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'cpu p50':>8} {'cpu p99':>8} {'gap med':>8} {'gap max':>8}  statuses"
    )
    for gpus, seqs in scales:
        for wl in workloads:
            for p in planners:
                reps = a.big_reps if gpus >= 1024 else a.reps
                r = run_scale(p, wl, gpus, seqs, reps, a.budget)
                rows.append(r)
                print(
                    f"{p:8} {wl:12} {gpus:>4}x{seqs:<5} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} "
                    f"{r['cpu_p50_ms']:8.1f} {r['cpu_p99_ms']:8.1f} {r['gap_median']:8.3f} "
                    f"{r['gap_max']:8.3f}  "
                    f"{r['statuses']}",
                    flush=True,
                )
    if a.json:
        cfg = {"budget_s": a.budget, "reps": a.reps, "big_reps": a.big_reps}
        with open(a.json, "w") as f:
            json.dump({"config": cfg, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
