"""Step former on a stream: predicted epoch time in data order vs formed steps, and the gap to
the stream lower bound (issue 13, items 4-5).

    .venv/bin/python benchmarks/bench_step_former.py [--workload 2d-balanced] [--steps 250]
        [--max-shift 2] [--tolerance 0.1] [--budget 60] [--json out.json]

The stream: `--steps` x `--target` tokens drawn from the workload's distribution (seeded,
dcp_opt.workloads.Workload.batch), in draw order. Each step is planned by the greedy planner
(solvers/greedy/); the epoch time is the sum of its predicted step times (each with its
gradient sync). Bounds (solvers/bounds/stream.py): `bound_fixed_s` for data order's steps
(the sum of certified per-step bounds, max_shift = 0), `bound_movable_s` for any assignment to
as many steps (max_shift > 0). Each row's `gap_fixed` is to the fixed bound of its own steps
(data order's, or the steps the former formed: how close the plans are to the best plans of
those steps), `gap_movable` to the movable bound (how close to the best of any formation).
JSON keys: {"config": {...}, "rows": [{"method", "steps", "tokens_p10", "tokens_median",
"tokens_p90", "epoch_s", "tokens_per_s", "bound_fixed_s", "gap_fixed", "gap_movable",
"form_wall_s",
"exchanges", "evals", "repaired" (samples the repair moved into the band)}],
"bound_fixed_s", "bound_movable_s", "speedup"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.bounds.stream import stream_lower_bound
from dcp_opt.solvers.stream.step_former import data_order_steps, form_steps_report

from dcp_opt import Batch, CostModel, cluster_preset, model_preset
from dcp_opt.workloads import Workload

MODELS = {"1d": "llama-7b", "2d": "opensora-stdit3-xl"}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="2d-balanced")
    p.add_argument("--steps", type=int, default=250, help="epoch length in target-size steps")
    p.add_argument("--target", type=int, default=2 * 1024 * 1024, help="tokens per step")
    p.add_argument("--cluster", default="h200x32")
    p.add_argument("--model", default=None, help="default: llama-7b (1D), opensora (2D)")
    p.add_argument("--max-shift", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--budget", type=float, default=None, help="former's seconds (None: auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def epoch(batches: list[Batch], cost: CostModel) -> float:
    return sum(run_planner("greedy", b, cost).predicted_step_time_s for b in batches)


def row(method, batches, cost, bounds, form=None) -> dict:
    tok = np.array([b.num_tokens for b in batches])
    t = epoch(batches, cost)
    own = bounds[0] if form is None else stream_lower_bound(batches, cost)
    return {
        "method": method,
        "steps": len(batches),
        "tokens_p10": int(np.percentile(tok, 10)),
        "tokens_median": int(np.median(tok)),
        "tokens_p90": int(np.percentile(tok, 90)),
        "epoch_s": t,
        "tokens_per_s": float(tok.sum() / t),
        "bound_fixed_s": own,
        "gap_fixed": t / own - 1,
        "gap_movable": t / bounds[1] - 1,
        "form_wall_s": form.wall_s if form else None,
        "exchanges": form.exchanges if form else None,
        "evals": form.evals if form else None,
        "repaired": form.repaired if form else None,
    }


def main(argv=None) -> int:
    a = parse(argv)
    wl = Workload.parse(a.workload)
    cost = CostModel(model_preset(a.model or MODELS[wl.kind]), cluster_preset(a.cluster))
    stream = list(wl.batch(a.seed, a.steps * a.target).sequences)
    by = {s.id: s for s in stream}

    def to_batches(steps):
        return [Batch(tuple(by[i] for i in s)) for s in steps]

    data = to_batches(data_order_steps(stream, a.target))
    t0 = time.perf_counter()
    bounds = (
        stream_lower_bound(data, cost),
        stream_lower_bound(data, cost, max_shift=max(1, a.max_shift)),
    )
    bound_wall = time.perf_counter() - t0
    form = form_steps_report(
        stream,
        target_tokens=a.target,
        max_shift=a.max_shift,
        tolerance=a.tolerance,
        cost=cost,
        budget_s=a.budget,
    )
    rows = [
        row("data order", data, cost, bounds),
        row("former", to_batches(form.steps), cost, bounds, form),
    ]
    doc = {
        "config": {
            **vars(a),
            "samples": len(stream),
            "tokens": sum(s.num_tokens for s in stream),
            "bound_wall_s": bound_wall,
        },
        "rows": rows,
        "bound_fixed_s": bounds[0],
        "bound_movable_s": bounds[1],
        "speedup": rows[0]["epoch_s"] / rows[1]["epoch_s"],
    }
    show(doc)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def show(doc: dict) -> None:
    c = doc["config"]
    print(
        f"{c['workload']} on {c['cluster']}: {c['samples']} samples, {c['tokens'] / 1e6:.0f}M "
        f"tokens, target {c['target']} tokens/step, K = {c['max_shift']}, e = {c['tolerance']}"
    )
    print(
        f"{'method':12} {'steps':>5} {'tok p10/med/p90 (K)':>22} {'epoch s':>9} {'tok/s':>10}"
        f" {'gap fixed':>9} {'gap mov.':>8} {'form s':>7}"
    )
    for r in doc["rows"]:
        toks = f"{r['tokens_p10'] // 1000}/{r['tokens_median'] // 1000}/{r['tokens_p90'] // 1000}"
        gf = f"{100 * r['gap_fixed']:.2f}%"
        fw = "-" if r["form_wall_s"] is None else f"{r['form_wall_s']:.1f}"
        print(
            f"{r['method']:12} {r['steps']:5d} {toks:>22} {r['epoch_s']:9.2f} "
            f"{r['tokens_per_s']:10.0f} {gf:>9} {100 * r['gap_movable']:7.2f}% {fw:>7}"
        )
    print(
        f"stream bound: fixed steps {doc['bound_fixed_s']:.2f} s, movable "
        f"{doc['bound_movable_s']:.2f} s; former over data order: {doc['speedup']:.4f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
