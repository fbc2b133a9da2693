"""Planner quality across the cost models users may measure (issue 19), in one run.

    .venv/bin/python benchmarks/bench_robust.py [--quick] [--batches 2] [--cluster h200x8]
        [--sizes 2M,16M] [--models preset,sp-step,...] [--workloads ...] [--json OUT]

For every perturbed cost model of dcp_opt.perturb.FAMILY (built on the preset of the
workload's kind: 2D opensora-stdit3-xl, 1D llama-7b), every standard workload plus
2d-imageheavy (the VideoSys benchmark mix: 98 % single images, a few long videos), at 2M-
and 16M-token batches (seeded 0..batches-1, drawn as dcp_opt.workloads does): greedy and
cpsat (default options: 0.2 s budget) plan the batch, and every simple-rule layout
(solvers/greedy/rules.py rule_plans: static degrees, fit-smallest, long-smallest, long-first,
none pruned) is simulated. Per model and workload it reports the median and worst gap to
the tightest bound (analytic, the planners' own, and the packing-aware LP with 0.3 s),
and the batches where a rule layout beats greedy or cpsat. Acceptance (issue 19): cpsat's
median gap <= 5 % and worst <= 15 % on every model and workload; no batch where a rule wins.
Batches where cpsat's gap is above --explain-above (8 %) are explained: cpsat again with
--long-budget (10 s: what more search gains) and the rank-assignment bound
(solvers/bounds/rank.py rank_bound, a certified MILP relaxation of every plan that sees the
packing's granularity, the same budget) with its solution as a plan (solvers/bounds/rank_plan.py,
"rank_plan_s": faster than cpsat means the planner is loose): "tight_bound_s" is the
tightest certified bound, and the rows' gaps are to it (*_gap_plain_*: to the bound before
explain).
--quick: a smoke run (2M tokens, the 2D workloads and 2d-imageheavy, 5 models, one batch per
row, so one batch decides a row's median); the acceptance figures are the default run's.
benchmarks/results/robust.json holds one run per cluster ({"h200x32": run, "h200x8": run,
"h200x8_session4": the run before the overflow-first and long-then candidates}), each:
JSON: {"config", "commit", "rows": [per model x workload: model, workload, batches, greedy_gap_median,
greedy_gap_max, cpsat_gap_median, cpsat_gap_max (to the tightest bound), the same as
*_gap_plain_* (to the bound before explain), rule_beats_greedy, rule_beats_cpsat],
"batches": [per batch: model, workload, tokens, seed, seqs, bound_s, greedy_s, cpsat_s,
best_rule, best_rule_s, cpsat_status, infeasible, explain: {long_budget_s, long_cpsat_s,
long_lower_bound_s, rank_bound_s, rank_bound_proven, rank_plan_s, tight_bound_s}], "all_pass",
"wall_time_s"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from dcp_opt.solvers import run_planner
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.bounds.rank import rank_bound
from dcp_opt.solvers.bounds.rank_plan import rank_plan
from dcp_opt.solvers.common import finish
from dcp_opt.solvers.greedy.rules import rule_plans

from dcp_opt import CostModel, cluster_preset, model_preset
from dcp_opt.errors import InfeasibleError
from dcp_opt.perturb import FAMILY, perturbed_cost_models
from dcp_opt.workloads import EXTRA_WORKLOADS, STANDARD_WORKLOADS, Workload

MODELS = {"2d": "opensora-stdit3-xl", "1d": "llama-7b"}
SIZES = {"2M": 2 * 2**20, "16M": 16 * 2**20}
WORKLOADS = (*[w.name for w in STANDARD_WORKLOADS], *EXTRA_WORKLOADS)
TARGET_MEDIAN, TARGET_MAX = 0.05, 0.15
QUICK_MODELS = ("preset", "sp-step", "replicated-sample", "microbatch-fixed", "combined")
TIE = 1e-9  # relative: a rule "beats" a planner only by more than float noise


def one_batch(batch, cost: CostModel) -> dict:
    """Greedy, cpsat and every rule layout on one batch, with the tightest bound."""
    try:
        cost.check_fits(batch)
    except InfeasibleError as e:
        return {"infeasible": str(e)}
    g = run_planner("greedy", batch, cost)
    c = run_planner("cpsat", batch, cost)
    rules = {
        name: finish(ph, batch, cost, planner="rule", started=0.0).predicted_step_time_s
        for name, ph in rule_plans(batch, cost).items()
    }
    best_rule = min(rules, key=rules.get) if rules else None
    upper = min(g.predicted_step_time_s, c.predicted_step_time_s)
    lp = lp_bound(batch, cost, upper_s=upper, time_limit_s=0.3).value_s
    bound = max(g.lower_bound_s, c.lower_bound_s, lp)
    return {
        "seqs": len(batch),
        "bound_s": bound,
        "greedy_s": g.predicted_step_time_s,
        "cpsat_s": c.predicted_step_time_s,
        "greedy_how": g.stats.get("candidate"),
        "cpsat_status": c.status,
        "cpsat_message": c.message,
        "best_rule": best_rule,
        "best_rule_s": rules.get(best_rule),
        "infeasible": None,
    }


def explain(batch, cost: CostModel, rec: dict, long_s: float) -> dict:
    """Where a gap comes from: cpsat with `long_s` seconds (what more search gains), the
    rank-assignment bound (solvers/bounds/rank.py rank_bound, `long_s` of HiGHS): a certified
    bound that sees the packing's granularity, so what it adds to the bound is looseness of
    the bound, not of the planner; and that relaxation's solution as a plan
    (solvers/bounds/rank_plan.py): where it is faster than cpsat the planner is what is loose. (An exact CP-SAT solve of a reduced instance is no
    certificate here: its exact model runs on <= 16 GPUs and searches single-phase plans
    only, while a plan may have any number of phases.)"""
    long = run_planner("cpsat", batch, cost, time_limit_s=long_s)
    rb = rank_bound(batch, cost, time_limit_s=long_s)
    rp = rank_plan(batch, cost, time_limit_s=long_s)
    return {
        "long_budget_s": long_s,
        "long_cpsat_s": long.predicted_step_time_s,
        "long_lower_bound_s": long.lower_bound_s,
        "rank_bound_s": rb.value_s,
        "rank_bound_proven": rb.proven,
        "rank_plan_s": None if rp is None else rp.predicted_step_time_s,
        "tight_bound_s": max(rec["bound_s"], long.lower_bound_s, rb.value_s),
    }


def summarize(recs: list[dict]) -> dict:
    ok = [r for r in recs if not r["infeasible"]]

    def gaps(key, tight=True):
        return [r[key] / (_tight(r) if tight else r["bound_s"]) - 1 for r in ok]

    def beats(key):
        return sum(
            1 for r in ok if r["best_rule_s"] is not None and r["best_rule_s"] < r[key] * (1 - TIE)
        )

    out = {"batches": len(ok), "infeasible": len(recs) - len(ok)}
    for p in ("greedy", "cpsat"):
        gp = gaps(f"{p}_s")
        out[f"{p}_gap_median"] = statistics.median(gp) if gp else None
        out[f"{p}_gap_max"] = max(gp, default=None)
        plain = gaps(f"{p}_s", tight=False)  # to the planners' own bound, before explain
        out[f"{p}_gap_plain_median"] = statistics.median(plain) if plain else None
        out[f"{p}_gap_plain_max"] = max(plain, default=None)
        out[f"rule_beats_{p}"] = beats(f"{p}_s")
    return out


def _tight(r: dict) -> float:
    """The tightest certified bound known for a batch: explain's where it ran."""
    return r.get("explain", {}).get("tight_bound_s", r["bound_s"])


def run(
    models, workloads, sizes, batches: int, cluster_name: str, log, why_above=0.08, long_s=10.0
) -> dict:
    started = time.perf_counter()
    cluster = cluster_preset(cluster_name)
    families = {
        k: {
            n: m
            for n, m in perturbed_cost_models(CostModel(model_preset(v), cluster)).items()
            if n in models
        }
        for k, v in MODELS.items()
    }
    per_batch = []
    for wl in workloads:
        w = Workload.parse(wl)
        for size in sizes:
            for seed in range(batches):
                batch = w.batch(seed, SIZES[size])
                for name, cost in families[w.kind].items():
                    t = time.perf_counter()
                    rec = {"model": name, "workload": wl, "tokens": size, "seed": seed}
                    rec.update(one_batch(batch, cost))
                    if not rec["infeasible"] and rec["cpsat_s"] > rec["bound_s"] * (1 + why_above):
                        rec["explain"] = explain(batch, cost, rec, long_s)
                    per_batch.append(rec)
                    log(_line(rec, time.perf_counter() - t))
    rows = []
    for name in models:
        for wl in workloads:
            recs = [r for r in per_batch if r["model"] == name and r["workload"] == wl]
            if recs:
                rows.append({"model": name, "workload": wl, **summarize(recs)})
    ok = all(_row_pass(r) for r in rows)
    return {
        "config": {
            "cluster": cluster_name,
            "models": list(models),
            "workloads": list(workloads),
            "sizes": list(sizes),
            "batches": batches,
            "cpsat": "default options (time_limit_s 0.2)",
            "explain_above": why_above,
            "long_budget_s": long_s,
        },
        "rows": rows,
        "batches": per_batch,
        "all_pass": ok,
        "wall_time_s": time.perf_counter() - started,
    }


def _row_pass(r: dict) -> bool:
    if not r["batches"]:
        return True
    return (
        r["cpsat_gap_median"] <= TARGET_MEDIAN
        and r["cpsat_gap_max"] <= TARGET_MAX
        and r["rule_beats_greedy"] == 0
        and r["rule_beats_cpsat"] == 0
    )


def _line(r: dict, wall: float) -> str:
    head = f"{r['model']:20s} {r['workload']:14s} {r['tokens']:>3s} seed {r['seed']}"
    if r["infeasible"]:
        return f"{head}  infeasible: {r['infeasible'][:60]}"
    b = r["bound_s"]
    why = ""
    if "explain" in r:
        e = r["explain"]
        tb = e["tight_bound_s"]
        why = (
            f"\n    {e['long_budget_s']:.0f} s cpsat {e['long_cpsat_s'] / b - 1:6.1%}; rank bound "
            f"{e['rank_bound_s']:.3f} s ({'proven' if e['rank_bound_proven'] else 'at limit'}"
            f"): cpsat {r['cpsat_s'] / tb - 1:6.1%} over the tightest bound; its plan "
            f"{_pct(e['rank_plan_s'], tb)}"
        )
    return (
        f"{head} n={r['seqs']:6d} bound {b:8.3f}s greedy {r['greedy_s'] / b - 1:6.1%} "
        f"cpsat {r['cpsat_s'] / b - 1:6.1%} rule {r['best_rule']} "
        f"{r['best_rule_s'] / b - 1:6.1%}  ({wall:.1f}s){why}"
    )


def _pct(x: float | None, b: float) -> str:
    return "none" if x is None else f"{x / b - 1:6.1%}"


def table(rows: list[dict]) -> str:
    def pct(x):
        return "   -  " if x is None else f"{x:6.1%}"

    lines = [
        f"{'model':20s} {'workload':14s} {'n':>3s}  greedy med/max   cpsat med/max  "
        "(before explain)  rule>greedy rule>cpsat  pass"
    ]
    for r in rows:
        lines.append(
            f"{r['model']:20s} {r['workload']:14s} {r['batches']:3d}  "
            f"{pct(r['greedy_gap_median'])} {pct(r['greedy_gap_max'])}  "
            f"{pct(r['cpsat_gap_median'])} {pct(r['cpsat_gap_max'])}  "
            f"({pct(r['cpsat_gap_plain_median'])} {pct(r['cpsat_gap_plain_max'])})  "
            f"{r['rule_beats_greedy']:11d} {r['rule_beats_cpsat']:10d}  "
            f"{'PASS' if _row_pass(r) else 'FAIL'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--cluster", default="h200x8")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--models", default=",".join(FAMILY))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-batch lines")
    ap.add_argument(
        "--explain-above",
        type=float,
        default=0.08,
        help="batches whose cpsat gap is above this get a long cpsat run and the rank-"
        "assignment bound, each --long-budget seconds",
    )
    ap.add_argument("--long-budget", type=float, default=10.0)
    a = ap.parse_args(argv)
    models, workloads, sizes = a.models.split(","), a.workloads.split(","), a.sizes.split(",")
    if a.quick:
        models = [m for m in models if m in QUICK_MODELS]
        workloads = [w for w in workloads if w.startswith("2d")]
        sizes = ["2M"]
    for m in models:
        if m not in FAMILY:
            ap.error(f"--models: {m!r} not allowed; allowed: {list(FAMILY)}")
    for s in sizes:
        if s not in SIZES:
            ap.error(f"--sizes: {s!r} not allowed; allowed: {list(SIZES)}")
    for w in workloads:
        Workload.parse(w)  # a clear error naming the allowed workloads
    log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    out = run(models, workloads, sizes, a.batches, a.cluster, log, a.explain_above, a.long_budget)
    for r in out["batches"]:
        if "explain" in r:
            print(_line(r, 0.0))
    print(table(out["rows"]))
    print(f"all pass: {out['all_pass']}   wall {out['wall_time_s']:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
