"""Fidelity: does the simulator, under a fitted profile, predict what the runtime measures?

    python benchmarks/bench_fidelity.py [--world 2] [--batches 4] [--json]

1. Profile the runtime's TinyLM block on this CPU (dcp_opt.runtime.profile.measure; points cached),
   measure the gloo all-to-all and the gradient all-reduce of the world, then calibrate the
   profile with a short real run of the executor on synthetic micro-batches
   (runtime.profile.measure.calibrate_runtime; `--no-calibrate` skips it).
2. For seeded variable-length batches and several planners, plan with the fitted CostModel
   and predict each plan's step time with simulate().
3. Execute every plan with the runtime's executor (world 2 or 4, gloo, one thread per rank):
   `--warmup` untimed steps, then the median of `--steps` measured steps.
4. Report |predicted - measured| / measured per plan, before recalibration, and after: plans
   run in order and plan i is predicted with the Recalibrator fed the measured micro-batch
   times of plans 0..i-1 only (the next plan is never seen before it is predicted). Each clock
   has its predictor: `wall` (the executor's step time) the runtime-calibrated profile, which
   measured wall time; `cpu` the isolated block profile (thread CPU time, raw all-to-all and
   all-reduce microbenchmarks). Both predictions' errors are reported for both clocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from dcp_opt.solvers import available_planners, run_planner

from dcp_opt import Batch, Cluster, CostModel, simulate
from dcp_opt.cluster import GB
from dcp_opt.profile_io import load_profile, save_profile
from dcp_opt.recalibrate import Recalibrator

PLANNERS = ("bucket", "packed", "greedy", "dcp_inter", "cpsat")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, choices=(2, 4))
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--tokens", type=int, default=3072, help="tokens per global batch")
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--profile", default="benchmarks/results/fidelity.profile.json")
    p.add_argument("--reprofile", action="store_true", help="profile again even if it exists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="predict with the isolated block profile only (no runtime calibration)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    return p.parse_args(argv)


def lm_cfg(args) -> dict:
    return dict(
        vocab_size=512,
        hidden=args.hidden,
        num_heads=4,
        num_layers=args.layers,
        ffn_hidden=4 * args.hidden,
    )


def get_profile(args, log):
    """Load the profile, or measure it (1 thread, cached points) and save it."""
    from dcp_opt.runtime.models import LMConfig
    from dcp_opt.runtime.profile.blocks import lm_target
    from dcp_opt.runtime.profile.measure import ProfileConfig, profile_model

    target = lm_target(LMConfig(**lm_cfg(args)))
    path = Path(args.profile)
    if path.exists() and not args.reprofile:
        return load_profile(path, model=target.model), 0.0
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile_model(
            target, ProfileConfig(), cache_path=str(path) + ".points.json", progress=not args.json
        )
    for w in caught:
        log(f"warning: {w.message}")
    save_profile(prof, path, force=True)
    return prof, time.perf_counter() - t0


def make_cost(prof, world: int, a2a, grad_sync_s: float, *, calibrated: bool = True):
    """The world as a Cluster: one node of `world` CPU ranks, the measured all-to-all link,
    and the gradient all-reduce calibrated to its measured time (bytes per parameter such
    that the ring formula of CostModel.grad_sync_time gives the measurement).

    With `calibrated` and a profile that has a runtime calibration (Profile.runtime), its
    coefficients, in-situ all-to-all and in-situ gradient sum replace the isolated ones
    (as profile_io.cost_model_from_profile does)."""
    cal = prof.runtime if calibrated else None
    bw, lat = a2a.bandwidth_bytes_per_s, a2a.latency_s / (a2a.group_size - 1)
    if cal is not None and cal.a2a_bandwidth_bytes_per_s:
        bw, lat = cal.a2a_bandwidth_bytes_per_s, cal.a2a_latency_s or 0.0
    cluster = Cluster(
        f"cpu-gloo-{world}", 1, world, 64 * GB, 1e12, bw, bw, intra_node_latency_s=lat
    )
    params = prof.model.total_params
    per_param = grad_sync_s * cluster.intra_node_bw / (2 * (world - 1) / world * params)
    if cal is not None:
        per_param = cal.grad_reduce_bytes_per_param(prof.model, cluster)
    return CostModel(
        prof.model,
        cluster,
        prof.coefficients if cal is None else cal.apply(prof.coefficients),
        optimizer_sharding="none",
        usable_memory_fraction=1.0,
        grad_reduce_bytes_per_param=per_param,
        # the calibration's measured knobs (SP overhead, replicated work, per-step cost)
        **({} if cal is None else cal.cost_knobs(prof.model, cluster)),
    )


def make_batch(seed: int, tokens: int) -> Batch:
    """Log-normal lengths (median 256, sigma 1, clipped to [32, 2048]) up to `tokens`."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = int(np.clip(round(rng.lognormal(np.log(256), 1.0)), 32, 2048))
        out.append(n)
        total += n
    return Batch.from_lengths(out)


CLOCKS = ("cpu", "wall")


def microbatch_samples(cost, batch, runs, clock: str) -> list[tuple[int, float, float]]:
    """(degree, predicted, measured median over steps) per micro-batch, from group leaders."""
    col = 7 if clock == "cpu" else 6
    by_key: dict[tuple, list[float]] = {}
    meta = {}
    for rank, res in enumerate(runs):
        for step in res["micro_batches"]:
            for mb in step:
                ph, start, d, k, ids, r = mb[:6]
                if rank == start:
                    by_key.setdefault((ph, start, k), []).append(mb[col])
                    meta[(ph, start, k)] = (d, ids, r)
    out = []
    for key, secs in by_key.items():
        d, ids, r = meta[key]
        seqs = [batch.by_id[i] for i in ids]
        pred = cost.microbatch_time(seqs, d, r, spans_nodes=False).total_s
        out.append((d, pred, statistics.median(secs)))
    return out


def microbatch_breakdown(cost, iso, batch, runs) -> list[dict]:
    """Per micro-batch (group leader): where it ran, its shape, both predictions and both
    measurements (median over steps): the per-plan breakdown behind a step's error."""
    by: dict[tuple, dict] = {}
    for rank, res in enumerate(runs):
        for step in res["micro_batches"]:
            for ph, start, d, k, ids, r, wall, cpu in step:
                if rank == start:
                    e = by.setdefault(
                        (ph, start, k), {"ids": ids, "d": d, "r": r, "w": [], "c": []}
                    )
                    e["w"].append(wall)
                    e["c"].append(cpu)
    out = []
    for (ph, start, _k), e in sorted(by.items()):
        seqs = [batch.by_id[i] for i in e["ids"]]
        out.append(
            {
                "phase": ph,
                "start_rank": start,
                "degree": e["d"],
                "lengths": [s.shape[0] for s in seqs],
                "predicted_s": cost.microbatch_time(
                    seqs, e["d"], e["r"], spans_nodes=False
                ).total_s,
                "isolated_s": iso.microbatch_time(seqs, e["d"], e["r"], spans_nodes=False).total_s,
                "wall_s": statistics.median(e["w"]),
                "cpu_s": statistics.median(e["c"]),
            }
        )
    return out


def measured_steps(runs, steps: int) -> dict[str, list[float]]:
    """Per measured step. wall: the executor's step time, slowest rank. cpu: the slowest
    rank's CPU time in micro-batches plus the gradient all-reduce (fastest rank's wait for
    it, i.e. the all-reduce itself): the step on cores nobody else uses."""
    wall = [max(r["step_s"][i] for r in runs) for i in range(steps)]
    cpu = [
        max(sum(mb[7] for mb in r["micro_batches"][i]) for r in runs)
        + min(r["grad_sync_s"][i] for r in runs)
        for i in range(steps)
    ]
    return {"wall": wall, "cpu": cpu}


def run(args, log) -> dict:
    from dcp_opt.runtime.profile import fidelity as F
    from dcp_opt.runtime.testing import DistWorkers

    prof, prof_s = get_profile(args, log)
    log(f"profile: {args.profile} ({prof_s:.0f} s)")
    workers = DistWorkers(args.world, timeout_s=300)
    try:
        nparams = workers.run(F.setup_lm, lm_cfg(args), args.seed)[0]
        a2a = workers.run(F.measure_a2a)[0]
        sync = workers.run(F.measure_grad_sync, nparams)[0]
        log(
            f"a2a {a2a.bandwidth_bytes_per_s / 1e6:.0f} MB/s + {a2a.latency_s * 1e3:.2f} ms; "
            f"grad all-reduce {sync * 1e3:.1f} ms"
        )
        if args.calibrate:
            prof = calibrate(args, prof, workers, F, log)
        cost = make_cost(prof, args.world, a2a, sync)
        iso = make_cost(prof, args.world, a2a, sync, calibrated=False)
        planners = [p for p in args.planners.split(",") if p in available_planners()]
        rcs, rows = {c: Recalibrator() for c in CLOCKS}, []
        for b in range(args.batches):
            batch = make_batch(args.seed * 1000 + b, args.tokens)
            for name in planners:
                rows.append(run_one(args, workers, F, (cost, iso), rcs, batch, name, b))
                log(_row_line(rows[-1]))
    finally:
        workers.close()
    return summarize(args, rows, prof, a2a, sync, rcs)


def calibrate(args, prof, workers, F, log):
    """The profile with a runtime calibration measured now, in these workers (saved)."""
    from dcp_opt.runtime.profile.measure import calibrate_runtime

    t0 = time.perf_counter()
    prof = calibrate_runtime(prof, F.worker_run_plan(workers), world=args.world)
    save_profile(prof, args.profile, force=True)
    c = prof.runtime
    a2a = (
        f"in-situ a2a {c.a2a_bandwidth_bytes_per_s / 1e6:.0f} MB/s + "
        f"{c.a2a_latency_s * 1e3:.2f} ms/peer; "
        if c.a2a_bandwidth_bytes_per_s
        else ""
    )
    log(
        f"runtime calibration ({time.perf_counter() - t0:.0f} s): compute x{c.compute_factor:.3f}"
        f" + {c.microbatch_overhead_s * 1e3:.1f} ms per micro-batch; {a2a}"
        f"per step {c.grad_sync_s * 1e3:.1f} ms"
    )
    return prof


def run_one(args, workers, F, costs, rcs, batch, name, b) -> dict:
    cost, iso = costs
    plan = run_planner(name, batch, cost).plan
    before = simulate(plan, batch, cost).step_time_s
    isolated = simulate(plan, batch, iso).step_time_s
    runs = workers.run(F.run_plan, plan.to_json(), batch.to_dict(), args.steps, args.warmup)
    row = {
        "batch": b,
        "planner": name,
        "num_sequences": len(batch),
        "tokens": batch.num_tokens,
        "num_micro_batches": plan.num_micro_batches,
        "degrees": sorted({g.degree for ph in plan.phases for g in ph.groups if g.micro_batches}),
        "predicted_s": before,
        "predicted_isolated_s": isolated,
        "check_s": statistics.median(c for r in runs for c in r["check_s"]),
        "micro_batches": microbatch_breakdown(cost, iso, batch, runs),
        "rank_busy_s": [  # per rank, median over steps of its micro-batches' wall time
            statistics.median(sum(m[6] for m in step) for step in r["micro_batches"]) for r in runs
        ],
        "rank_step_s": [statistics.median(r["step_s"]) for r in runs],
    }
    for clock, steps in measured_steps(runs, args.steps).items():
        # Each clock's own predictor: the runtime calibration measures the executor's wall
        # time; the isolated profile measures thread CPU time (what `cpu` counts).
        base, pred = (cost, before) if clock == "wall" else (iso, isolated)
        # predicted with what the recalibrator learnt from the previous plans only
        after = simulate(plan, batch, rcs[clock].corrected(base)).step_time_s
        measured = statistics.median(steps)
        for d, p, meas in microbatch_samples(base, batch, runs, clock):
            rcs[clock].observe(d, p, meas)
        row[clock] = {
            "measured_s": measured,
            "steps_s": steps,
            "predicted_s": pred,
            "predicted_recalibrated_s": after,
            "err_before": abs(pred - measured) / measured,
            "err_after": abs(after - measured) / measured,
            "err_isolated": abs(isolated - measured) / measured,
            "err_calibrated": abs(before - measured) / measured,
        }
    return row


def _row_line(r: dict) -> str:
    parts = [
        f"batch {r['batch']} {r['planner']:<10} mbs {r['num_micro_batches']:>2} "
        f"pred {r['predicted_s']:.3f} s (isolated {r['predicted_isolated_s']:.3f})"
    ]
    for c in CLOCKS:
        m = r[c]
        parts.append(
            f"{c} {m['measured_s']:.3f} s (recal {m['predicted_recalibrated_s']:.3f}) "
            f"err {m['err_before']:.1%} -> {m['err_after']:.1%}"
        )
    return " | ".join(parts)


def _medians(rows, clock: str) -> dict:
    first = len({r["planner"] for r in rows})  # plans of the first batch
    later = rows[first:]
    med = statistics.median
    return {
        "median_err_before": med(r[clock]["err_before"] for r in rows),
        "median_err_after": med(r[clock]["err_after"] for r in rows),
        "median_err_isolated": med(r[clock]["err_isolated"] for r in rows),
        "median_err_calibrated": med(r[clock]["err_calibrated"] for r in rows),
        "median_signed_err_before": med(
            (r[clock]["predicted_s"] - r[clock]["measured_s"]) / r[clock]["measured_s"]
            for r in rows
        ),
        "median_err_before_later_batches": med(r[clock]["err_before"] for r in later)
        if later
        else None,
        "median_err_after_later_batches": med(r[clock]["err_after"] for r in later)
        if later
        else None,
    }


def summarize(args, rows, prof, a2a, sync, rcs) -> dict:
    import os

    fit = {
        b: {p: prof.fit[b][p]["median_rel_err_test"] for p in ("fwd", "bwd")}
        for b in prof.model.block_types
    }
    return {
        "world": args.world,
        "model": prof.model.to_dict(),
        "profile_device": prof.device,
        "profile_clock": prof.method.get("timing"),
        "load_average": os.getloadavg(),
        "fit_median_rel_err_test": fit,
        "a2a": {"bandwidth_bytes_per_s": a2a.bandwidth_bytes_per_s, "latency_s": a2a.latency_s},
        "grad_sync_s": sync,
        "runtime_calibration": None
        if prof.runtime is None
        else {k: v for k, v in prof.runtime.to_dict().items() if k != "samples"},
        "threads_per_rank": 1,
        **{c: _medians(rows, c) for c in CLOCKS},
        "recalibration_drift": {c: {str(k): v for k, v in rcs[c].drift().items()} for c in CLOCKS},
        "plans": rows,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    report = run(args, log)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        print(text)
    else:
        print(f"fit (held-out median rel. err): {report['fit_median_rel_err_test']}")
        print(f"load average during the run: {report['load_average']}")
        for c in CLOCKS:
            m = report[c]
            line = (
                f"{c}: median |pred - meas| / meas over {len(report['plans'])} plans: before "
                f"{m['median_err_before']:.1%}, after recalibration {m['median_err_after']:.1%}"
                f" (isolated profile: {m['median_err_isolated']:.1%}, with runtime "
                f"calibration: {m['median_err_calibrated']:.1%})"
            )
            if m["median_err_before_later_batches"] is not None:
                line += (
                    f" (batches 2+: {m['median_err_before_later_batches']:.1%} -> "
                    f"{m['median_err_after_later_batches']:.1%})"
                )
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
