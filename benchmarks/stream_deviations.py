"""The measured effect of each published setting the one-batch emulation changes, on the
stream benchmark (docs/baselines.md, "Deviations").

    .venv/bin/python benchmarks/stream_deviations.py [--batches 128] [--json OUT]

For each 2D workload on h200x32, runs each published method as published (dcp_opt.analysis.stream:
cap 0.7, drop_last, PAC min 15, inter's biased sp-size draw) and then with one setting
changed at a time, and prints tokens/s, the dropped share and the median tokens per step.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dcp_opt.analysis.stream import MILLION, run_published, stream_epoch
from dcp_opt.cost import CostModel
from dcp_opt.inputs import load_cluster
from dcp_opt.model import model_preset

WORKLOADS = ("2d-short", "2d-balanced", "2d-long")
# name -> (methods it applies to, run_published keyword changes)
CHANGES = {
    "as published": (("bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac"), {}),
    "cap 0.9": (("bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac"), {"memory_cap": 0.9}),
    "no drop_last": (("bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac"), {"drop_last": False}),
    "PAC min_gas 2": (("dcp_inter_pac",), {"min_gas": 2}),
    "unbiased sp draw": (("dcp_inter", "dcp_inter_pac"), {"biased_sp_pick": False}),
}


def row(epoch, cost, method, seed, kw) -> dict:
    args = {"drop_last": True, "memory_cap": 0.7} | kw
    run = run_published(epoch, cost, method, seed=seed, **args)
    tok = epoch.tokens_by_id
    steps = [sum(tok[i] for i in s) for s in run.steps]
    total = sum(run.step_times)
    return {
        "tokens_per_s": sum(steps) / total if total else None,
        "dropped_share": sum(tok[i] for i in run.dropped) / epoch.num_tokens,
        "median_step_tokens": float(np.median(steps)) if steps else None,
        "num_steps": len(steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cluster", default="h200x32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    cost = CostModel(model_preset("opensora-stdit3-xl"), load_cluster(args.cluster))
    rows = []
    for w in WORKLOADS:
        epoch = stream_epoch(w, args.seed, args.batches, 2 * MILLION)
        for change, (methods, kw) in CHANGES.items():
            for m in methods:
                r = {"workload": w, "method": m, "change": change} | row(
                    epoch, cost, m, args.seed, kw
                )
                rows.append(r)
                tps = r["tokens_per_s"]
                print(
                    f"{w:12s} {m:14s} {change:17s} "
                    f"{'-' if tps is None else f'{tps / 1e6:.3f}'} Mtok/s "
                    f"dropped {r['dropped_share']:.1%} steps {r['num_steps']}",
                    flush=True,
                )
    doc = {"batches": args.batches, "cluster": args.cluster, "rows": rows,
           "wall_time_s": time.perf_counter() - t0}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
