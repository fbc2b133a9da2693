"""Measured step time of plans from different planners on the same variable-length batches,
executed by dcp_opt.runtime on CPU gloo ranks, with the planners' predicted times beside.

    python benchmarks/bench_runtime.py                      # bucket vs greedy, world 2
    python benchmarks/bench_runtime.py --world 4 --planners bucket,greedy,cpsat --json
    python benchmarks/bench_runtime.py --json out/bench_runtime.json   # table + JSON file
    python benchmarks/bench_runtime.py --profile tiny_lm_cpu.json      # fitted CPU profile

Each (batch, planner): one warm-up step, then `--repeats` timed steps; a step's time is the
slowest rank's (the step ends when the last rank's gradients are summed); the median is kept.
Predictions come from a crude FLOP-derived CPU cost model (runtime/launch.py), so compare
ratios (bucket / greedy) rather than absolute seconds; with `--profile` (a profile of this
TinyLM config measured by `dcp-opt profile` / runtime/profile/measure.py, saved with
dcp_opt.profile_io) the coefficients are the fitted ones instead (same memory limit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from dcp_opt.runtime import LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.launch import cpu_cost_model
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.testing import DistWorkers
from dcp_opt.solvers import available_planners, run_planner

from dcp_opt import Batch
from dcp_opt.plan import Plan

CFG = LMConfig(vocab_size=64, hidden=64, num_heads=4, num_layers=2, ffn_hidden=128)


def model_cfg(args) -> LMConfig:
    # `dcp-opt profile --target tiny-lm` measures the head with a 512-token vocabulary; a
    # profile is only accepted for the same model, so --vocab 512 goes with --profile.
    return LMConfig(**{**CFG.__dict__, "vocab_size": args.vocab})


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    default = ["bucket", "greedy"] + (["cpsat"] if "cpsat" in available_planners() else [])
    ap.add_argument("--planners", default=",".join(default), help="first = the baseline")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="OUT",
        help="write the report as JSON to OUT (and print the table); bare --json: JSON only, "
        "to stdout",
    )
    ap.add_argument("--vocab", type=int, default=CFG.vocab_size)
    ap.add_argument("--profile", help="profile JSON: fitted cost coefficients for the model")
    return ap.parse_args(argv)


def make_batch(i: int, args) -> Batch:
    # Long-tailed lengths (lognormal, as in chat/code corpora): a few long, many short.
    rng = np.random.default_rng([args.seed, i])
    n = rng.lognormal(4.3, 1.0, args.batch_size).astype(int) + 2
    return Batch.from_lengths([int(x) for x in np.minimum(n, args.max_len)])


def job_time(ctx, plan_json: str, lengths: list[int], repeats: int, vocab: int = CFG.vocab_size):
    """On every rank: warm-up + `repeats` steps of the plan; this rank's step times."""
    torch.manual_seed(0)
    state = SPState()
    cfg = LMConfig(**{**CFG.__dict__, "vocab_size": vocab})
    model = parallelize(TinyLM(cfg), state)
    data = {i: torch.randint(cfg.vocab_size, (n + 1,)) for i, n in enumerate(lengths)}
    plan = Plan.from_json(plan_json)
    times = []
    for step in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        report = execute_step(plan, LMTask(), model, data, pool=ctx.pool, state=state, step=step)
        times.append(report.step_time_s)
    return times[1:]


def make_cost(args):
    """(CostModel, description): FLOP-derived, or fitted from `--profile` on the same cluster."""
    cost = cpu_cost_model(model_spec(model_cfg(args)), args.world, fit_tokens=0.5 * args.max_len)
    if not args.profile:
        return cost, "FLOP-derived CPU preset (runtime.launch.cpu_cost_model, 3 GFLOP/s)"
    from dcp_opt.profile_io import cost_model_from_profile

    fitted = cost_model_from_profile(args.profile, cost.model, cost.cluster)
    return fitted, f"fitted profile {args.profile}"


def run(args) -> dict:
    cost, cost_source = make_cost(args)
    planners = args.planners.split(",")
    rows = []
    workers = DistWorkers(args.world, timeout_s=300.0)
    try:
        for i in range(args.batches):
            batch = make_batch(i, args)
            lengths = [s.shape[0] for s in batch.sequences]
            for name in planners:
                result = run_planner(name, batch, cost)
                per_rank = workers.run(
                    job_time, result.plan.to_json(), lengths, args.repeats, args.vocab
                )
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
    return {
        "world": args.world,
        "config": vars(args),
        "cost_model": cost_source,
        "rows": rows,
        "ratios": ratios(rows),
    }


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
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"world {args.world}, {args.batches} batches x {args.batch_size} sequences")
    print(f"cost model: {report['cost_model']}")
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
