"""Digests of every planner's plan on every standard workload, for refactors that must not
change a figure (issue 24: the layout by concern was checked with it, byte-identical).

    .venv/bin/python scripts/plan_digests.py --out before.json        # on the old code
    .venv/bin/python scripts/plan_digests.py --compare before.json    # on the new: exit 1 if any differs

Deterministic by construction: two seeds of each standard workload on h200x32 with the
bench's default models, every planner (cp-capable planners also with sp_kinds ulysses+cp on
the 1D workloads), cpsat in its deterministic mode (time counted in CP-SAT's deterministic
units, one worker); the stream tools on a small epoch, the stream bound with an LP time
limit far above what it needs. Per entry: the SHA-256 of the plan's JSON, its status,
predicted step time and reported bound. Wall-clock budgets (the step former, a planner's
time limit) are left out: their figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from dcp_opt.solvers import PLANNERS, data_order_steps, run_planner, stream_lower_bound

from dcp_opt import CostModel
from dcp_opt.batch import Batch
from dcp_opt.inputs import load_cluster
from dcp_opt.model import model_preset
from dcp_opt.workloads import EXTRA_WORKLOADS, STANDARD_WORKLOADS, standard_batch

MODELS = {"2d": "opensora-stdit3-xl", "1d": "llama-7b"}
CP_PLANNERS = ("greedy", "cpsat", "megatron_dynamic_cp", "verl_balanced", "bucket")


def _plan_entry(planner: str, batch: Batch, cost: CostModel) -> dict:
    opts = {"deterministic": True, "time_limit_s": 1.0} if planner == "cpsat" else {}
    try:
        r = run_planner(planner, batch, cost, **opts)
    except Exception as e:  # a planner's refusal is a figure too
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    digest = hashlib.sha256(r.plan.to_json().encode()).hexdigest() if r.plan else None
    return {
        "status": r.status,
        "plan": digest,
        "step": r.predicted_step_time_s,
        "bound": r.lower_bound_s,
    }


def _stream_entries(workload: str, cost: CostModel) -> dict:
    epoch = standard_batch(workload, 7, num_gpus=32, tokens_per_gpu=4 * 65536)
    steps = data_order_steps(list(epoch.sequences), 2_000_000)
    by_id = {s.id: s for s in epoch.sequences}
    first = [Batch(tuple(by_id[i] for i in st)) for st in steps[:4]]
    return {
        f"{workload}/stream/steps": hashlib.sha256(json.dumps(steps).encode()).hexdigest(),
        f"{workload}/stream/bound0": stream_lower_bound(first, cost, lp_time_limit_s=30),
        f"{workload}/stream/bound1": stream_lower_bound(
            first, cost, max_shift=1, lp_time_limit_s=30
        ),
    }


def digests() -> dict:
    out: dict = {}
    cluster = load_cluster("h200x32")
    workloads = [f"{w.kind}-{w.distribution}" for w in STANDARD_WORKLOADS] + list(EXTRA_WORKLOADS)
    for wl in workloads:
        started = time.perf_counter()
        model = model_preset(MODELS[wl[:2]])
        costs = {"u": CostModel(model, cluster)}
        if wl.startswith("1d"):
            costs["cp"] = CostModel(model, cluster, sp_kinds=("ulysses", "cp"))
        for seed in (0, 1):
            batch = standard_batch(wl, seed, num_gpus=32)
            for ck, cost in costs.items():
                for p in PLANNERS:
                    if ck == "u" or p in CP_PLANNERS:
                        out[f"{wl}/{seed}/{ck}/{p}"] = _plan_entry(p, batch, cost)
        out.update(_stream_entries(wl, costs["u"]))
        print(f"{wl}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the digests as JSON here")
    ap.add_argument("--compare", help="digests JSON of the code before: report every change")
    args = ap.parse_args(argv)
    now = digests()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
    if not args.compare:
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    for k in changed:
        print(f"changed {k}: {before.get(k)} -> {now.get(k)}")
    print(f"{len(now)} entries, {len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
