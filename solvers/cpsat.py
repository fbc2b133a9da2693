"""CP-SAT planner: the step's placement as an integer program, solved under a time budget.

Formulation (solvers/cpsat_model.py builds it, one function per labelled group)
----------------------------------------------------------------------------------
Constants (integers: seconds / unit, rounded up, unit = incumbent finish / 20000; the
only conversion is cpsat_model.to_units):
  D             allowed SP degrees d_j; N GPUs
  classes k     sequences with identical costs (exact model: one sequence each); c_k members
  t_kj          time of a member alone at degree d_j with its fewest recompute r_min (or
                "does not fit"); mt_kj = t_kj less the empty micro-batch's time C_j
  tok_k, cap0_j tokens; tokens one micro-batch holds at d_j without recompute
  S_j           slots: the most groups of degree d_j the model may open
Variables:
  u_js in {0,1}      slot s of degree d_j is a group
  y_kjs in [0, c_k]  members of class k in that group;   z_k in [0, c_k] members in phase 0
  aggregate model:   b_js >= 0 micro-batches of the group
  exact model:       x_kjsb in {0,1} sequence k in micro-batch b of group (j, s);
                     w_jsbr in {0,1} micro-batch b recomputes r layers (levels r of the batch)
  M                  the makespan
Objective: minimise M, the latest finish before the gradient sync (simulate()'s step time
less the constant sync).
Constraint groups:
  [L] layout:      u_js >= u_j,s+1;  sum_js d_j u_js <= N (aligned buddy placement of powers
                   of two then always exists; the extraction checks it)
  [A] assignment:  sum_js y_kjs + z_k = c_k;  y_kjs <= c_k u_js;  y = 0 where it does not fit
  [P] packing (aggregate): b_js >= u_js;  cap0_j b_js >= sum_{k fits at r=0} tok_k y_kjs +
                   cap0_j sum_{k needs r>0} y_kjs;  load_js = sum_k mt_kj y_kjs + C_j b_js
  [B] micro-batches (exact): sum_b x_kjsb = y_kjs; a used micro-batch has one level r;
                   sum_k tok_k x_kjsb <= cap_tok_j(r) if w_jsbr;  its time bt_jsb >=
                   sum_k (t_kj(r) - C_j(r)) x_kjsb + C_j(r) if w_jsbr;  load_js = sum_b bt_jsb
  [Z] phase 0:     P0 = sum_k t_k,N z_k (those run alone, one after another, on the whole
                   cluster; then every rank re-forms)
  [M] makespan:    M >= P0 + load_js;  load_j,s >= load_j,s+1 (symmetry)
Scale: the exact model (every sequence, every micro-batch, every recompute level 0..L while
that stays small; status "optimal" only then) for small batches; otherwise classes are identical shapes, or 16 quantiles of cost
(FlexSP), their members dealt longest first, then packed within each group (first-fit
decreasing) and, as a second candidate, re-listed by the greedy's LPT on the model's layout
and degrees. Only improvements are sought: degrees at which a class's members all outlast
the incumbent are left out, and budgets under 2 s open at most a quarter more groups of a
degree than the incumbent has (2 of a degree it lacks), a neighbourhood search.
Homogeneous clusters only (mixed ones get the greedy plan, status "fallback"). Clusters
above 256 GPUs keep the greedy's block plan (solvers/greedy_blocks.py).

Anytime and safe: the greedy runs first; its plan is the hint and the fallback, and the best
of it and any `incumbents` (other planners' plans) is returned unless CP-SAT finds better, so
the result is never slower than them by construction. Solver exceptions, a timeout without
a solution and a plan that fails validate() return that incumbent with status "fallback"
(logged). The lower bound is the tightest of the analytic bound and the packing-aware LP
(solvers/lp_bound.py); CP-SAT's own objective bound is a bound within the model's plan space
only (stats["model_bound_s"]), so it is reported but not certified.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.result import PlanResult
from dcp_opt.validate import InvalidPlanError

from . import cpsat_extract as cx
from . import cpsat_model as cm
from .common import finish, gc_paused
from .greedy import Draft, Instance, assign, candidates, make_instance, place, to_phases
from .lp_bound import lp_bound

log = logging.getLogger(__name__)

EXACT_MAX_SEQS = 8  # exact model up to this many sequences ...
EXACT_MAX_GPUS = 16  # ... on up to this many GPUs
MAX_MODEL_GPUS = 256  # larger clusters keep the greedy's block plan
LP_MAX_SEQS = 64  # HiGHS runs on batches up to this size (one solve takes ~10-40 ms at 200)
LP_PER_SEQ_S = 5e-6  # the separable LP bound's cost (27-36 ms CPU at 8192 sequences) ...
LP_ALWAYS_SEQS = 1024  # ... always paid up to this many sequences (a few ms)
# The budget covers the greedy, the model build, CP-SAT and the finishing (extraction,
# finish(), the LP bound). Kept back from it for the finishing: RESERVE_S plus
# RESERVE_PER_SEQ_S per sequence (finish() and the separable LP bound grow with the batch:
# ~15-60 ms at 2048 sequences on a loaded 2-core machine).
RESERVE_S = 0.015
RESERVE_PER_SEQ_S = 10e-6
MIN_SOLVE_S = 0.01  # less than this left before the model build: keep the greedy plan
FULL_MODEL_S = 2.0  # budgets from this long get every slot, not only the greedy's neighbourhood


def plan_cpsat(
    batch: Batch,
    cost: CostModel,
    *,
    time_limit_s: float = 0.2,
    num_workers: int = 1,
    seed: int = 0,
    deterministic: bool = False,
    incumbents: tuple[str, ...] = (),
    **opts,
) -> PlanResult:
    """Plan one step within `time_limit_s` (+ the final validation). `deterministic`: one
    worker, fixed seed, the limit counted in CP-SAT's deterministic time and no wall-clock
    decision, so every process computes the byte-identical plan. `incumbents`: names of
    other planners whose plans compete too (the result is never slower than theirs).
    `cpsat_params`: extra CP-SAT parameters. The garbage collector pauses meanwhile
    (solvers/common.py gc_paused: a mid-plan collection would eat the budget)."""
    started = time.perf_counter()
    with gc_paused():
        return _plan(
            batch, cost, started, time_limit_s, num_workers, seed, deterministic, incumbents, opts
        )


def _plan(batch, cost, started, time_limit_s, num_workers, seed, deterministic, incumbents, opts):
    inst = make_instance(batch, cost)
    best, phases = _first_valid(candidates(inst, cost.cluster), inst, cost)
    stats: dict = {"greedy_finish_s": best.finish_s}
    params = {"linearization_level": 0, **opts.get("cpsat_params", {})}
    try:
        draft, status, message = _solve(
            cost, inst, best, started, time_limit_s, num_workers, seed, deterministic, stats, params
        )
    except Exception as e:  # noqa: BLE001 (any solver failure falls back to the greedy)
        log.warning("cpsat: %s: %s; returning the greedy plan", type(e).__name__, e)
        draft, status, message = None, "fallback", f"fallback: {type(e).__name__}: {e}"
    result = None
    if draft is not None:
        result, message = _checked(draft, inst, batch, cost, started, status)
        status = "fallback" if result is None else status
    if result is None:
        result = finish(phases, batch, cost, planner="cpsat", started=started, status=status)
    result = _best_of(result, incumbents, batch, cost)
    left = time_limit_s - (time.perf_counter() - started)
    lp_s = None  # a large batch past the budget: the analytic bound only (LP: +0.1% at 8192)
    if deterministic or len(batch) <= LP_ALWAYS_SEQS or left > LP_PER_SEQ_S * len(batch):
        lp_s = lp_bound(
            batch,
            cost,
            upper_s=result.predicted_step_time_s,
            # HiGHS only while the budget lasts (the separable bound whenever it runs).
            time_limit_s=0.0 if deterministic else min(0.03, left - 0.005),
            max_lp_seqs=0 if deterministic else LP_MAX_SEQS,
        ).value_s
    stats.update(lp_bound_s=lp_s, analytic_bound_s=result.lower_bound_s)
    return replace(
        result,
        lower_bound_s=max(result.lower_bound_s, lp_s or 0.0),
        message=result.message or message,
        stats={**result.stats, **stats},
        wall_time_s=time.perf_counter() - started,
    )


def _first_valid(drafts: list[Draft], inst: Instance, cost: CostModel):
    for d in drafts:
        phases = to_phases(d, inst, cost)
        if phases is not None:
            return d, phases
    raise AssertionError("the safe draft always fits")  # pragma: no cover


def _solve(cost, inst, best, started, limit, workers, seed, det, stats, params):
    """CP-SAT from the greedy's incumbent: (better Draft or None, status, message)."""
    c = cost.cluster
    if not c.homogeneous:
        return None, "fallback", "fallback: CP-SAT models homogeneous clusters; greedy plan"
    if c.num_gpus > MAX_MODEL_GPUS:
        return None, "feasible", "greedy block plan (cluster too large for the model)"
    reserve = RESERVE_S + RESERVE_PER_SEQ_S * len(inst.ids)
    if not det and limit - (time.perf_counter() - started) - reserve < MIN_SOLVE_S:
        return None, "feasible", "no time left for CP-SAT; greedy plan"
    exact = len(inst.ids) <= EXACT_MAX_SEQS and c.num_gpus <= EXACT_MAX_GPUS
    near: dict | None = None  # short budgets search near the greedy's layout only
    if limit < FULL_MODEL_S:
        near = {}
        for _, j, _ in best.groups:
            near[j] = near.get(j, 0) + 1
    data = cm.make_data(inst, cost, best.finish_s, exact, near=near)
    model, v = cm.build(data, 8 * cm.RESOLUTION)
    stats["hinted"] = cx.add_hint(model, data, v, best)
    solver = cm.cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1 if det else max(1, workers)
    p.random_seed = seed
    for key, value in params.items():
        setattr(p, key, value)
    # max_time_in_seconds counts from solve(): what is left after the greedy and the build.
    left = limit - (time.perf_counter() - started) - reserve
    if det:
        p.max_deterministic_time = max(limit, 0.01)
    elif left < 0.005:
        return None, "feasible", "no time left for CP-SAT; greedy plan"
    else:
        p.max_time_in_seconds = left
    status = solver.solve(model)
    name = solver.status_name(status)
    solved = name in ("OPTIMAL", "FEASIBLE")
    stats.update(cpsat_status=name, exact_model=exact, classes=len(data.classes))
    if solved:
        stats.update(
            model_bound_s=solver.best_objective_bound * data.unit + inst.sync,
            cpsat_wall_s=solver.wall_time,
        )
    else:
        log.warning("cpsat: no solution (%s); returning the greedy plan", name)
        return None, "fallback", f"fallback: CP-SAT returned {name} without a solution"
    got = cx.extract(solver, data, v, place, c)
    if got is None:
        log.warning("cpsat: layout could not be placed; returning the greedy plan")
        return None, "fallback", "fallback: CP-SAT layout could not be placed"
    placed, pref, own = got
    options = [own, _relist(inst, c, placed, pref, own, solver.value(v.m) * data.unit)]
    for d in options:
        if d is not None:
            d.finish_s = cx.draft_finish(d, inst, cost)
    pick = min((d for d in options if d is not None), key=lambda d: d.finish_s)
    word = "optimal" if name == "OPTIMAL" and data.complete else "feasible"
    if pick.finish_s >= best.finish_s * (1 - 1e-12):
        return None, word, "CP-SAT found nothing better than the greedy"
    return pick, word, "CP-SAT improved on the greedy"


def _checked(draft, inst, batch, cost, started, status):
    """finish() with validation: (PlanResult, message), or (None, why) to fall back."""
    phases = to_phases(draft, inst, cost)
    if phases is None:
        log.warning("cpsat: a micro-batch does not fit in memory; returning the greedy plan")
        return None, "fallback: CP-SAT micro-batch does not fit in memory"
    try:
        res = finish(phases, batch, cost, planner="cpsat", started=started, status=status)
    except InvalidPlanError as e:
        log.warning("cpsat: plan failed validate(): %s; returning the greedy plan", e)
        return None, f"fallback: CP-SAT plan failed validate(): {e}"
    return res, "CP-SAT improved on the greedy"


def _relist(inst, cluster, placed, pref, own: Draft, target_s: float) -> Draft | None:
    """The model's layout and degrees, members re-listed by the greedy's LPT."""
    if own.phase0:
        return None
    items = np.flatnonzero(pref >= 0)
    speeds = np.ones(len(placed))
    cap0 = [float(inst.cap0[j]) for _, j in placed]
    out = assign(inst, items, pref, placed, target_s, speeds, cap0)
    if out is None:
        return None
    bins, load = out
    groups = [(s, j, bs) for (s, j), bs in zip(placed, bins, strict=True) if bs]
    return Draft([], groups, max(load), ("cpsat-relist",))


def _best_of(result: PlanResult, names: tuple[str, ...], batch, cost) -> PlanResult:
    """The fastest of the result and the named planners' plans (re-stamped as cpsat's)."""
    from . import run_planner  # noqa: PLC0415

    best = result
    for name in names:
        other = run_planner(name, batch, cost)
        if other.ok and other.predicted_step_time_s < best.predicted_step_time_s:
            plan = replace(other.plan, planner="cpsat")
            best = replace(
                result,
                plan=plan,
                predicted_step_time_s=other.predicted_step_time_s,
                status="feasible" if result.status == "optimal" else result.status,
            )
            best = replace(best, message=f"incumbent from {name}")
    return best
