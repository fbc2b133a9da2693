"""Issue 25: how far the frameworks' tuned settings on the stream are from their best fixed
setting, found in hindsight over the whole epoch.

    .venv/bin/python benchmarks/bench_framework_settings.py [--stream benchmarks/results/stream.json]
        [--json OUT]

The stream (`dcp-opt bench --stream`) tunes each framework on the first 2 steps over a grid of
powers of two (solvers/baselines/tuned.py). Here each of a few fixed settings runs over the
whole default 1D epoch (250 x 2M tokens, llama-7b, h200x32, seed 0, the same data-order steps
and cost model as the stream's framework rows: ulysses, cp and ring offered, Megatron on ring,
verl on Ulysses): the grid's picks, max_seqlen_per_rank / max_token_len 12K and 14K, and the
most tokens per rank (per GPU) that fit without recompute (None: the planners' defaults,
resolved per step; Megatron's is one number on these epochs, 15,007 on ring). Each row gives
the epoch time, the micro-batches over the memory at the setting (`oom`: the framework would
not survive them; dcp_opt adds recompute), and greedy+cp's epoch from the stream JSON over it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dcp_opt.solvers import run_planner

from dcp_opt import CostModel, cluster_preset, model_preset
from dcp_opt.analysis.stream import MILLION, data_order_steps, stream_epoch
from dcp_opt.analysis.stream_frameworks import CP_KINDS
from dcp_opt.analysis.stream_steps import StepCache

WORKLOADS = ("1d-short", "1d-balanced", "1d-long")
K = 1024
MEGATRON = [  # (max_seqlen_per_rank, recompute); None: the most that fits, no recompute
    (8 * K, "none"), (12 * K, "none"), (14 * K, "none"), (16 * K, "full"), (None, None),
]  # fmt: skip
VERL = [  # (max_token_len_per_gpu, balance); no checkpointing; None: the most that fits
    (8 * K, "workload"), (12 * K, "workload"), (16 * K, "workload"),
    (None, "workload"), (None, "tokens"),
]  # fmt: skip


def epoch_of(planner: str, options: dict, steps, cache, cost) -> dict:
    """The epoch time of `planner` at `options` over `steps`, and its micro-batches over the
    memory; Megatron's resolved max_seqlen_per_rank per step."""
    total, oom, resolved = 0.0, 0, set()
    for ids in steps:
        res = run_planner(planner, cache.batch(ids), cost, **options)
        total += res.predicted_step_time_s
        oom += res.stats.get("oom_micro_batches", 0)
        resolved.add(res.stats.get("max_seqlen_per_rank"))
    return {"epoch_time_s": total, "oom_micro_batches": oom, "resolved": sorted(resolved, key=str)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stream", default="benchmarks/results/stream.json")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with open(args.stream) as f:
        greedy = {
            r["workload"]: r["epoch_time_s"]
            for r in json.load(f)["methods"]
            if r["method"] == "greedy+cp@2M"
        }
    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x32"), sp_kinds=CP_KINDS)
    t0, rows = time.perf_counter(), []
    for w in WORKLOADS:
        epoch = stream_epoch(w, 0, 250, 2 * MILLION)
        steps, cache = data_order_steps(epoch, 2 * MILLION), StepCache(epoch, cost)
        runs = [
            ("megatron_dynamic_cp", {"max_seqlen_per_rank": m, "recompute": r, "kind": "ring"})
            for m, r in MEGATRON
        ] + [
            ("verl_balanced", {"max_token_len_per_gpu": m, "balance": b, "checkpointing": False})
            for m, b in VERL
        ]
        for planner, options in runs:
            row = {"workload": w, "planner": planner, "setting": options}
            row |= epoch_of(planner, options, steps, cache, cost)
            row["greedy_cp_speedup"] = row["epoch_time_s"] / greedy[w] if w in greedy else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"config": vars(args), "rows": rows, "wall_time_s": time.perf_counter() - t0}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
