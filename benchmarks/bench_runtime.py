"""Measured step time of plans from different planners on the same variable-length batches,
executed by dcp_opt.runtime on CPU gloo ranks, with the planners' predicted times beside.

    python benchmarks/bench_runtime.py                      # bucket vs greedy, world 2
    python benchmarks/bench_runtime.py --world 4 --planners bucket,greedy,cpsat --json

Each (batch, planner): one warm-up step, then `--repeats` timed steps; a step's time is the
slowest rank's (the step ends when the last rank's gradients are summed); the median is kept.
Predictions come from a crude FLOP-derived CPU cost model (runtime/launch.py), so compare
ratios (bucket / greedy) rather than absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch
from dcp_opt.runtime import LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.launch import cpu_cost_model
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.testing import DistWorkers
from dcp_opt.solvers import run_planner

from dcp_opt import Batch
from dcp_opt.plan import Plan

CFG = LMConfig(vocab_size=64, hidden=64, num_heads=4, num_layers=2, ffn_hidden=128)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--planners", default="bucket,greedy")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON document only")
    return ap.parse_args(argv)


def make_batch(i: int, args) -> Batch:
    # Long-tailed lengths (lognormal, as in chat/code corpora): a few long, many short.
    rng = np.random.default_rng([args.seed, i])
    n = rng.lognormal(4.3, 1.0, args.batch_size).astype(int) + 2
    return Batch.from_lengths([int(x) for x in np.minimum(n, args.max_len)])


def job_time(ctx, plan_json: str, lengths: list[int], repeats: int):
    """On every rank: warm-up + `repeats` steps of the plan; this rank's step times."""
    torch.manual_seed(0)
    state = SPState()
    model = parallelize(TinyLM(CFG), state)
    data = {i: torch.randint(CFG.vocab_size, (n + 1,)) for i, n in enumerate(lengths)}
    plan = Plan.from_json(plan_json)
    times = []
    for step in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        report = execute_step(plan, LMTask(), model, data, pool=ctx.pool, state=state, step=step)
        times.append(report.step_time_s)
    return times[1:]


def run(args) -> dict:
    cost = cpu_cost_model(model_spec(CFG), args.world, fit_tokens=0.5 * args.max_len)
    planners = args.planners.split(",")
    rows = []
    workers = DistWorkers(args.world, timeout_s=300.0)
    try:
        for i in range(args.batches):
            batch = make_batch(i, args)
            lengths = [s.shape[0] for s in batch.sequences]
            for name in planners:
                result = run_planner(name, batch, cost)
                per_rank = workers.run(job_time, result.plan.to_json(), lengths, args.repeats)
                measured = statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
                rows.append(
                    {
                        "batch": i,
                        "planner": name,
                        "tokens": batch.num_tokens,
                        "predicted_s": result.predicted_step_time_s,
                        "measured_s": measured,
                        "phases": len(result.plan.phases),
                        "micro_batches": result.plan.num_micro_batches,
                    }
                )
    finally:
        workers.close()
    return {"world": args.world, "config": vars(args), "rows": rows, "ratios": ratios(rows)}


def ratios(rows: list[dict]) -> dict:
    """Per planner vs the first listed one (the baseline): measured and predicted, per batch
    and as the geometric mean."""
    out: dict[str, dict] = {}
    base = rows[0]["planner"]
    by = {(r["batch"], r["planner"]): r for r in rows}
    for (b, name), r in by.items():
        ref = by[(b, base)]
        entry = out.setdefault(name, {"measured": [], "predicted": []})
        entry["measured"].append(ref["measured_s"] / r["measured_s"])
        entry["predicted"].append(ref["predicted_s"] / r["predicted_s"])
    for entry in out.values():
        for k in ("measured", "predicted"):
            entry[f"{k}_geomean"] = float(np.exp(np.mean(np.log(entry[k]))))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    print(f"world {args.world}, {args.batches} batches x {args.batch_size} sequences")
    print(f"{'batch':>5} {'planner':>14} {'tokens':>7} {'predicted':>10} {'measured':>10}")
    for r in report["rows"]:
        print(
            f"{r['batch']:>5} {r['planner']:>14} {r['tokens']:>7} "
            f"{r['predicted_s']:>9.3f}s {r['measured_s']:>9.3f}s"
        )
    base = report["rows"][0]["planner"]
    for name, e in report["ratios"].items():
        print(
            f"speed-up of {name} over {base}: measured {e['measured_geomean']:.2f}x, "
            f"predicted {e['predicted_geomean']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
