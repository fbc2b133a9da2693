"""How the predicted speedups move when one cost-model constant moves (docs/cost-model.md).

    .venv/bin/python benchmarks/cost_sensitivity.py [--batches 3] [--json out/sensitivity.json]

Runs `dcp_opt.analysis.bench.run_bench` once per perturbation, with bucket, static_tuned,
dcp_inter_pac and greedy, and prints the median speedups per workload: dcp_inter_pac over
bucket ("pac/b"), greedy over bucket ("g/b") and greedy over static_tuned ("g/s").
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from dcp_opt.analysis.bench import BenchConfig, run_bench
from dcp_opt.cluster import Cluster
from dcp_opt.cost import CostModel, Efficiency, flops_coefficients
from dcp_opt.model import ModelSpec

PLANNERS = ("bucket", "static_tuned", "dcp_inter_pac", "greedy")
BASE = Efficiency()


def _eff(**kw) -> Callable[[ModelSpec, Cluster], CostModel]:
    eff = replace(BASE, **kw)
    return lambda m, c: CostModel(m, c, flops_coefficients(m, c, eff))


def _cluster(**kw) -> Callable[[ModelSpec, Cluster], CostModel]:
    return lambda m, c: CostModel(m, c.with_(**kw))


def _coeffs(**scale) -> Callable[[ModelSpec, Cluster], CostModel]:
    def make(m: ModelSpec, c: Cluster) -> CostModel:
        co = flops_coefficients(m, c)
        return CostModel(m, c, replace(co, **{k: getattr(co, k) * v for k, v in scale.items()}))

    return make


PERTURBATIONS: dict[str, Callable[[ModelSpec, Cluster], CostModel]] = {
    "baseline": lambda m, c: CostModel(m, c),
    "mfu both x0.5": _eff(mfu_linear=BASE.mfu_linear / 2, mfu_attention=BASE.mfu_attention / 2),
    "mfu_attention x0.5": _eff(mfu_attention=BASE.mfu_attention / 2),
    "mfu_attention x1.5": _eff(mfu_attention=BASE.mfu_attention * 1.5),
    "bwd_attention_ratio 2.0": _eff(bwd_attention_ratio=2.0),
    "inter_node_bw x0.25": _cluster(inter_node_bw=50e9 / 4),
    "inter_node_bw x2": _cluster(inter_node_bw=100e9),
    "intra_node_bw x0.25": _cluster(intra_node_bw=450e9 / 4),
    "microbatch_overhead 0": _eff(microbatch_overhead_s=0.0),
    "microbatch_overhead x4": _eff(microbatch_overhead_s=BASE.microbatch_overhead_s * 4),
    "block_launch x4": _eff(block_launch_s=BASE.block_launch_s * 4),
    "reserved 4 -> 12 GB": _eff(reserved_bytes=12e9),
    "activation bytes x1.5": _coeffs(act_bytes_per_token_layer=1.5),
    "memory fraction 0.7": lambda m, c: CostModel(m, c, usable_memory_fraction=0.7),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--cluster", default="h200x32")
    ap.add_argument("--only", default=None, help="comma-separated perturbation names")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config = BenchConfig(cluster=args.cluster, planners=PLANNERS, num_batches=args.batches)
    names = args.only.split(",") if args.only else list(PERTURBATIONS)
    results = {}
    for name in names:
        doc = run_bench(config, make_cost=PERTURBATIONS[name])
        results[name] = {
            (r["workload"], r["planner"]): (
                r["median_speedup_vs_bucket"],
                r["median_speedup_vs_static_tuned"],
                r["all_valid"],
            )
            for r in doc["summary"]
        }
        print(f"{name}: {doc['total_wall_time_s']:.1f} s", flush=True)
    table = Table(title="median speedups: pac/b  g/b  g/s (h200x32)")
    table.add_column("perturbation")
    for w in config.workloads:
        table.add_column(w, justify="right")
    for name, res in results.items():
        cells = []
        for w in config.workloads:
            pac, g = res[(w, "dcp_inter_pac")], res[(w, "greedy")]
            cells.append(f"{pac[0]:.2f} {g[0]:.2f} {g[1]:.2f}")
        table.add_row(name, *cells)
    Console(width=160).print(table)
    if args.json:
        out = {n: {f"{w}/{p}": v for (w, p), v in r.items()} for n, r in results.items()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
