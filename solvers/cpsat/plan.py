"""CP-SAT planner: the step's placement as an integer program, solved under a time budget.

Formulation (solvers/cpsat/model.py builds it, one function per labelled group)
----------------------------------------------------------------------------------
Constants (integers: seconds / unit, rounded up, unit = incumbent finish / 20000; the
only conversion is cpsat/model.py to_units):
  D             allowed SP degrees d_j; N GPUs
  classes k     sequences with identical costs (exact model: one sequence each); c_k members
  t_kj          time of a member alone at degree d_j with its fewest recompute r_min (or
                "does not fit": its largest member does not); mt_kj = the members' mean of
                that time less the empty micro-batch's time C_j
  tok_k, cap0_j mean tokens of a member; tokens one micro-batch holds at d_j, no recompute
  S_j           slots: the most groups of degree d_j the model may open
Variables:
  u_js in {0,1}      slot s of degree d_j is a group
  y_kjs in [0, c_k]  members of class k in that group;   z_k in [0, c_k] members in phase 0
  load_js, P0 >= 0   the group's busy time; phase 0's length (defined once, read by [M])
  aggregate model:   b_js >= 0 micro-batches of the group
  exact model:       x_kjsb in {0,1} sequence k in micro-batch b of group (j, s);
                     w_jsbr in {0,1} micro-batch b recomputes r layers (levels r of the batch)
  M                  the makespan
Objective: minimise M, the latest finish before the gradient sync (simulate()'s step time
less the constant sync).
Constraint groups:
  [L] layout:      u_js >= u_j,s+1;  sum_js d_j u_js <= N (aligned buddy placement of powers
                   of two then always exists; the extraction checks it)
  [L'] placement (only where buddy tiling may fail: degrees 72/36/18/9, a fabric's
                   domains; cpsat/model.py placement_starts): st_js in Cluster.placements(d_j);
                   optional intervals [st_js, st_js + d_j) present iff u_js, no overlap
  [A] assignment:  sum_js y_kjs + z_k = c_k;  y_kjs <= c_k u_js;  y = 0 where it does not fit
  [P] packing (aggregate): b_js >= u_js;  cap0_j b_js >= sum_{k fits at r=0} tok_k y_kjs +
                   cap0_j sum_{k needs r>0} y_kjs;  load_js = sum_k mt_kj y_kjs + C_j b_js
  [B] micro-batches (exact): sum_b x_kjsb = y_kjs; a used micro-batch has one level r;
                   sum_k tok_k x_kjsb <= cap_tok_j(r) if w_jsbr;  its time bt_jsb >=
                   sum_k (t_kj(r) - C_j(r)) x_kjsb + C_j(r) if w_jsbr;  load_js = sum_b bt_jsb
  [Z] phase 0:     P0 = sum_k t_k,N z_k (those run alone, one after another, on the whole
                   cluster; then every rank re-forms)
  [M] makespan:    M >= P0 + load_js;  load_j,s >= load_j,s+1 (symmetry);
                   sum_js d_j load_js <= N M (redundant)
Scale: the exact model (every sequence, every micro-batch, every recompute level 0..L while
that stays small; status "optimal" only then) for small batches; otherwise classes are
identical shapes, or up to 64 classes of equal shares of the batch's work (FlexSP bucketed
by cost; equal work gives the few long sequences classes of their own), fewer (32, 16, 8)
when the build would not fit the time left. Members are dealt longest first to the group
with room in the model's count and the least time so far, then packed within each group
(first-fit decreasing) and, as a second candidate, re-listed by the greedy's LPT on the
model's layout and degrees. Only improvements are sought: degrees at which a class's members
all outlast the incumbent are left out, and budgets under 2 s open at most a quarter more
groups of a degree than the incumbent has (2 of a degree it lacks), a neighbourhood search.
Homogeneous clusters only (mixed ones get the greedy plan, status "fallback"). Clusters
above 256 GPUs keep the greedy's block plan (solvers/greedy/blocks.py).

Budget: every stage counts (instance, greedy, model, solve, extraction, finish(), LP bound;
each stage's wall time in stats["stage_s"]). The model is built only if it fits what is
left, CP-SAT gets what is left less a reserve for the stages after it, budgets under 2 s
skip CP-SAT's presolve (it takes 0.1-1 s on a 2000-variable model before the hint counts),
and the LP bound runs only while time is left.

Anytime and safe: the greedy runs first; its plan is the hint and the fallback, and the best
of it and any `incumbents` (other planners' plans) is returned unless CP-SAT finds better,
so the result is never slower than them by construction. Where solvers/bounds/tree.py solves
the rank relaxation in milliseconds, its plan (several phases, widest groups first: outside
the one-phase model) competes too (solvers/bounds/rank_plan.py tree_candidate). Solver exceptions,
a timeout without a solution and a plan that fails validate() return that incumbent with
status "fallback" (logged: INFO when the budget ran out first, WARNING for a fault). The
lower bound is the tightest of the analytic bound, the packing-aware LP (solvers/bounds/lp.py)
and, where solvers/bounds/tree.py applies, the rank relaxation's exact optimum
(stats["rank_bound_s"]).
CP-SAT's own objective bound (stats["model_bound_s"]) holds within the model only (classes
stand for their members by the mean; exact on the exact model up to the rounding of its
integer units), so it is reported but not certified. Status "optimal" (exact model, CP-SAT's
proof, the plan returned reaching the model's optimum) means: no valid plan of the model's
search space is faster by more than stats["optimal_within_s"], the rounding of one makespan
path, (2n + 1) units for n sequences (~1e-3 of the step for 8 sequences).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.bounds.rank import tree_bound_s
from dcp_opt.solvers.bounds.rank_plan import CANDIDATE_PAIRS, tree_candidate
from dcp_opt.solvers.common import finish, gc_paused
from dcp_opt.solvers.cpsat import extract as cx
from dcp_opt.solvers.cpsat import model as cm
from dcp_opt.solvers.greedy.assign import assign, to_phases
from dcp_opt.solvers.greedy.instance import Draft, Instance, make_instance, place
from dcp_opt.solvers.greedy.plan import candidates, plan_greedy
from dcp_opt.solvers.kinds import best_with_kinds
from scipy.optimize import linprog  # noqa: F401 (HiGHS loads here, ~1.5 s once, not in a budget)

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import check_planner_options
from dcp_opt.result import PlanResult
from dcp_opt.table import one_price_per_degree
from dcp_opt.validate import InvalidPlanError

log = logging.getLogger("dcp_opt.solvers.cpsat")  # the name it had as one module

EXACT_MAX_SEQS = 8  # exact model up to this many sequences ...
EXACT_MAX_GPUS = 16  # ... on up to this many GPUs
MAX_MODEL_GPUS = 256  # larger clusters keep the greedy's block plan
LP_MAX_SEQS = 64  # HiGHS runs on batches up to this size (one solve takes ~10-40 ms at 200)
LP_PER_SEQ_S = 5e-6  # the separable LP bound's cost (27-36 ms CPU at 8192 sequences) ...
LP_ALWAYS_SEQS = 1024  # ... always paid up to this many sequences (a few ms)
# The budget covers every stage: instance, greedy, model build, CP-SAT, extraction,
# finish() (validate + simulate) and the LP bound. Kept back from CP-SAT for the stages after
# it: RESERVE_S + RESERVE_PER_SEQ_S per sequence (extraction, finish() and the separable LP
# bound grow with the batch; measured per stage in stats["stage_s"]).
RESERVE_S = 0.015
RESERVE_PER_SEQ_S = 10e-6
MIN_SOLVE_S = 0.01  # CP-SAT gets at least this long, or the greedy plan is kept
BUILD_PER_VAR_S = 25e-6  # model build cost (CPU) per member variable (y), with its rows ...
BUILD_PER_SEQ_S = 10e-6  # ... and per sequence (classes, hint)
BUILD_SHARE = 0.5  # the build may take at most this share of what is left for build + solve
CLASS_STEPS = (64, 32, 16, 8)  # cost classes: the most whose build fits
MAX_SLOWNESS = 8.0  # wall / CPU of this call, capped (estimates below are CPU seconds)
FULL_MODEL_S = 2.0  # budgets from this long get every slot and CP-SAT's presolve
# Deterministic mode can make no wall-clock decision, so CP-SAT's limit is in its own
# deterministic time, which ran 5-10x slower than wall seconds on this model (one worker,
# 2-core dev CPU: a 0.2 s limit took 1.1-2.0 s on 28-306-sequence batches). The budget is
# converted at this fixed rate, the same on every machine (so plans stay byte-identical):
# 0.2 s buys 0.04 deterministic seconds, ~0.2-0.4 s of solve there.
DET_TIME_PER_S = 0.2


class _Clock:
    """The budget's one clock: time left, each stage's wall and thread-CPU time
    (stats["stage_s"], stats["stage_cpu_s"]), and how slow this call runs: wall / CPU so far,
    > 1 when the machine is loaded, so cost estimates made in CPU seconds are scaled to the
    wall clock the budget counts. Deterministic mode makes no wall-clock decision: `left()`
    is infinite there."""

    def __init__(self, started: float, limit_s: float, deterministic: bool):
        self.started, self.limit_s, self.det = started, limit_s, deterministic
        self.cpu0 = time.thread_time()
        self.stage_s: dict[str, float] = {}
        self.stage_cpu_s: dict[str, float] = {}

    def left(self) -> float:
        return math.inf if self.det else self.limit_s - (time.perf_counter() - self.started)

    def slowness(self) -> float:
        """Wall / CPU of this thread so far, the CP-SAT solve left out (its workers may run
        on other threads while this one waits)."""
        wall = time.perf_counter() - self.started - self.stage_s.get("solve", 0.0)
        cpu = time.thread_time() - self.cpu0 - self.stage_cpu_s.get("solve", 0.0)
        return min(max(wall / max(cpu, 1e-3), 1.0), MAX_SLOWNESS)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t, c = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.stage_s[name] = self.stage_s.get(name, 0.0) + time.perf_counter() - t
            self.stage_cpu_s[name] = self.stage_cpu_s.get(name, 0.0) + time.thread_time() - c


def plan_cpsat(
    batch: Batch,
    cost: CostModel,
    *,
    time_limit_s: float = 0.2,
    num_workers: int = 1,
    seed: int = 0,
    deterministic: bool = False,
    incumbents: tuple[str, ...] = (),
    cpsat_params: dict | None = None,
) -> PlanResult:
    """Plan one step within `time_limit_s`, every stage included. `deterministic`: one
    worker, fixed seed, the limit counted in CP-SAT's deterministic time and no wall-clock
    decision, so every process computes the byte-identical plan. `incumbents`: names of
    other planners whose plans compete too (the result is never slower than theirs; they
    run outside the budget). `cpsat_params`: extra CP-SAT parameters. The garbage collector
    pauses meanwhile (solvers/common.py gc_paused: a mid-plan collection would eat the
    budget)."""
    check_planner_options(
        time_limit_s=time_limit_s, seed=seed, num_workers=num_workers, where="cpsat"
    )
    clock = _Clock(time.perf_counter(), time_limit_s, deterministic)
    with gc_paused():
        return _plan(batch, cost, clock, num_workers, seed, incumbents, cpsat_params or {})


def _plan(batch, cost, clock: _Clock, num_workers, seed, incumbents, cpsat_params: dict):
    with clock.stage("instance"):
        inst = make_instance(batch, cost)
    with clock.stage("greedy"):
        best, phases = _first_valid(candidates(inst, cost.cluster), inst, cost)
    stats: dict = {"greedy_finish_s": best.finish_s}
    params = {"linearization_level": 0, **cpsat_params}
    try:
        draft, status, message = _solve(cost, inst, best, clock, num_workers, seed, stats, params)
    except Exception as e:  # noqa: BLE001 (any solver failure falls back to the greedy)
        log.warning("cpsat: %s: %s; returning the greedy plan", type(e).__name__, e)
        draft, status, message = None, "fallback", f"fallback: {type(e).__name__}: {e}"
    result = None
    with clock.stage("finish"):
        if draft is not None:
            result, message = _checked(draft, inst, batch, cost, clock.started, status)
            status = "fallback" if result is None else status
        if result is None:
            result = finish(
                phases, batch, cost, planner="cpsat", started=clock.started, status=status
            )
    with clock.stage("tree"):  # several phases of widest-first groups: outside the model
        result = tree_candidate(result, batch, cost, clock.started)
    if incumbents:
        with clock.stage("incumbents"):
            result = _best_of(result, incumbents, batch, cost)
    if len(cost.sp_kinds) > 1:  # kinds per group, never slower than greedy (solvers/kinds.py)
        with clock.stage("kinds"):
            greedy = plan_greedy(batch, cost)
            greedy = replace(greedy, planner="cpsat")  # finish() names the plan after it
            result = best_with_kinds([result, greedy], batch, cost, started=clock.started)
    with clock.stage("lp_bound"):
        lp_s = _lp(batch, cost, result.predicted_step_time_s, clock)
        tree_s = tree_bound_s(batch, cost, CANDIDATE_PAIRS)  # ms; None: does not apply
    stats.update(lp_bound_s=lp_s, rank_bound_s=tree_s, analytic_bound_s=result.lower_bound_s)
    stats.update(stage_s=clock.stage_s, stage_cpu_s=clock.stage_cpu_s)
    return replace(
        result,
        lower_bound_s=max(result.lower_bound_s, lp_s or 0.0, tree_s or 0.0),
        message=result.message or message,
        stats={**result.stats, **stats},
        wall_time_s=time.perf_counter() - clock.started,
    )


def _lp(batch, cost, upper_s: float, clock: _Clock) -> float | None:
    """The packing-aware LP bound while the budget lasts (the separable part costs ~5 us a
    sequence, HiGHS up to 30 ms on batches of <= LP_MAX_SEQS); None: analytic bound only."""
    left = clock.left()
    slow = 1.0 if clock.det else clock.slowness()
    if not (clock.det or len(batch) <= LP_ALWAYS_SEQS or left > LP_PER_SEQ_S * len(batch) * slow):
        return None
    return lp_bound(
        batch,
        cost,
        upper_s=upper_s,
        # HiGHS checks its deadline between solves: keep one solve's worth (~10 ms) back.
        time_limit_s=0.0 if clock.det else min(0.03, left - 0.01 * slow),
        max_lp_seqs=0 if clock.det else LP_MAX_SEQS,
    ).value_s


def _first_valid(drafts: list[Draft], inst: Instance, cost: CostModel):
    for d in drafts:
        phases = to_phases(d, inst, cost)
        if phases is not None:
            return d, phases
    raise AssertionError("the safe draft always fits")  # pragma: no cover


def _model(cost, inst, best, clock: _Clock, reserve: float, stats: dict):
    """(data, model, vars) that fit the time left, or None: the most cost classes whose
    estimated build takes at most BUILD_SHARE of what is left for build + solve."""
    c = cost.cluster
    exact = len(inst.ids) <= EXACT_MAX_SEQS and c.num_gpus <= EXACT_MAX_GPUS
    near: dict | None = None  # short budgets search near the greedy's layout only
    if clock.limit_s < FULL_MODEL_S:
        near = {}
        for _, j, _ in best.groups:
            near[j] = near.get(j, 0) + 1
    k = CLASS_STEPS[0]
    if not exact and not clock.det:
        slow = clock.slowness()
        per_class = BUILD_PER_VAR_S * slow * _slots_at_most(inst, near)
        room = BUILD_SHARE * (clock.left() - reserve - MIN_SOLVE_S)
        room -= BUILD_PER_SEQ_S * slow * len(inst.ids)
        k = next((k for k in CLASS_STEPS if k * per_class <= room), 0)
        if not k:
            return None
    data = cm.make_data(inst, cost, best.finish_s, exact, max_classes=k, near=near)
    model, v = cm.build(data, 8 * cm.RESOLUTION)
    stats["hinted"] = cx.add_hint(model, data, v, best)
    stats.update(exact_model=exact, classes=len(data.classes), model_vars=len(v.y))
    return data, model, v


def _slots_at_most(inst, near: dict | None) -> int:
    """An upper bound on the model's slots (cpsat/model.py make_data), without building it."""
    out = 0
    for j, d in enumerate(inst.degrees.tolist()):
        s = min(inst.num_gpus // d, len(inst.ids), cm.SLOT_CAP)
        if near is not None:
            s = max(min(s, near.get(j, 0) + max(2, near.get(j, 0) // 4)), near.get(j, 0))
        out += s
    return out


def _solve(cost, inst, best, clock: _Clock, workers, seed, stats, params):
    """CP-SAT from the greedy's incumbent: (better Draft or None, status, message)."""
    c = cost.cluster
    if not c.homogeneous:
        return None, "fallback", "fallback: CP-SAT models homogeneous clusters; greedy plan"
    if c.num_gpus > MAX_MODEL_GPUS:
        return None, "feasible", "greedy block plan (cluster too large for the model)"
    reserve = _reserve(len(inst.ids), clock)
    no_time = None, "feasible", "no time left for CP-SAT; greedy plan"
    if clock.left() - reserve < MIN_SOLVE_S:
        return no_time
    with clock.stage("model"):
        built = _model(cost, inst, best, clock, reserve, stats)
    if built is None:
        return no_time
    data, model, v = built
    solver = cm.cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1 if clock.det else max(1, workers)
    p.random_seed = seed
    # Presolve (probing above all) takes 0.1-1 s on a 2000-variable model before the hint
    # counts as a solution: short budgets skip it and search from the hint at once.
    p.cp_model_presolve = clock.limit_s >= FULL_MODEL_S
    for key, value in params.items():
        setattr(p, key, value)
    left = clock.left() - _reserve(len(inst.ids), clock)
    if clock.det:
        p.max_deterministic_time = max(clock.limit_s * DET_TIME_PER_S, 0.002)
    elif left < MIN_SOLVE_S:
        return no_time
    else:
        p.max_time_in_seconds = left
    with clock.stage("solve"):
        status = solver.solve(model)
    name = solver.status_name(status)
    stats.update(cpsat_status=name)
    if name not in ("OPTIMAL", "FEASIBLE"):
        return _no_solution(name)
    stats.update(
        model_bound_s=solver.best_objective_bound * data.unit + inst.sync,
        cpsat_wall_s=solver.wall_time,
        # What "optimal" is worth: every constant is rounded up by < 1 unit, and one
        # makespan path sums at most one term per sequence plus one constant per micro-batch
        # (<= one per sequence) and phase 0's, so a plan the model ranks behind ours may be
        # faster by up to this much (found by the nightly brute-force property: 0.5 unit).
        optimal_within_s=(2 * len(inst.ids) + 1) * data.unit,
    )
    with clock.stage("extract"):
        return _pick(solver, data, v, inst, cost, best, clock, name)


def _reserve(num_seqs: int, clock: _Clock) -> float:
    """Wall time kept back for the stages after CP-SAT, scaled by this call's slowness."""
    return (RESERVE_S + RESERVE_PER_SEQ_S * num_seqs) * clock.slowness()


def _no_solution(name: str):
    """UNKNOWN is the budget running out before CP-SAT had a solution: expected, INFO.
    INFEASIBLE or MODEL_INVALID mean the model is wrong (the hint is a solution): WARNING."""
    level = logging.INFO if name == "UNKNOWN" else logging.WARNING
    log.log(level, "cpsat: no solution (%s); returning the greedy plan", name)
    return None, "fallback", f"fallback: CP-SAT returned {name} without a solution"


def _pick(solver, data, v, inst, cost, best: Draft, clock: _Clock, name: str):
    """The model's own assignment, and (time permitting) its layout re-listed by the LPT."""
    got = cx.extract(solver, data, v, place, cost.cluster)
    if got is None:
        log.warning("cpsat: layout could not be placed; returning the greedy plan")
        return None, "fallback", "fallback: CP-SAT layout could not be placed"
    placed, pref, own = got
    options = [own]
    if clock.left() > _reserve(len(inst.ids), clock):
        options.append(
            _relist(inst, cost.cluster, placed, pref, own, solver.value(v.m) * data.unit)
        )
    for d in options:
        if d is not None:
            d.finish_s = cx.draft_finish(d, inst, cost)
    pick = min((d for d in options if d is not None), key=lambda d: d.finish_s)
    keep_greedy = pick.finish_s >= best.finish_s * (1 - 1e-12)
    returned = best.finish_s if keep_greedy else pick.finish_s
    # "optimal" only when the plan returned reaches the model's proven optimum: an extraction
    # that loses some of the model's packing is a feasible plan, not an optimal one.
    reached = returned <= solver.objective_value * data.unit * (1 + 1e-9) + 1e-12
    # and only where the model's prices are each placement's own (table.plan_table prices a
    # degree whose placements differ at its costliest: the model's optimum is not the plan's)
    exact = data.complete and one_price_per_degree(cost.cluster)
    word = "optimal" if name == "OPTIMAL" and exact and reached else "feasible"
    if keep_greedy:
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
    from dcp_opt.solvers import run_planner  # noqa: PLC0415

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
