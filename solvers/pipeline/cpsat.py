"""pp_cpsat: the order of each column's micro-batches by CP-SAT, greedy's plan as the hint.

Formulation (one column; its micro-batches, their recompute and the schedule fixed; the
order is the decision). Times are integers: seconds / `unit`, rounded; the order found is
then priced exactly (makespan.column_makespan), so rounding never misstates a plan.

    y[j, k]  in {0, 1}: position j runs micro-batch k          (A) each row and column once
    D[a]     = sum_k y[j, k] dur[c, k]: the duration of action a = (pass, position j, chunk)
             on stage s (virtual stage c), an interval [S[a], S[a] + D[a])
    (P1) on each stage its actions in the schedule's order (actions.stage_actions with
         positions for micro-batches): S[next] >= end[prev]; and no overlap per stage
    (P2) F(c, j) starts >= end F(c - 1, j) + X(c - 1, j);  B(c, j) >= end B(c + 1, j)
         + X(c, j);  B(V - 1, j) >= end F(V - 1, j)     (X = sum_k y[j, k] x[c, k])
    (O)  minimise the makespan >= every end

Optimal in this model = the best order of these micro-batches under the schedule (up to
the rounding of `unit`); CP-SAT's dual bound is reported per column.
"""

from __future__ import annotations

import time

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.pipeline.check import stage_sync_s
from dcp_opt.pipeline.makespan import column_actions

from .instance import Instance, columns_of_plan
from .order import apply_order
from .plan import finish_micro_step_plan, finish_pipeline, plan_pp_greedy
from .recompute import fit_recompute
from .steps import slowest_groups


def solve_order(f, b, x, *, schedule: str, num_stages: int, virtual: int = 1, hint=None,
                time_limit_s: float = 1.0, num_workers: int = 1, seed: int = 0,
                resolution: float | None = None) -> dict:  # fmt: skip
    """The formulation above for one column: {order, status, objective_s, bound_s}."""
    from ortools.sat.python import cp_model

    V, m = len(f), len(f[0])
    p = num_stages
    top = max(max(map(max, f)), max(map(max, b)), 1e-30)
    unit = resolution or top / 20_000
    F = [[round(v / unit) for v in row] for row in f]
    B = [[round(v / unit) for v in row] for row in b]
    X = [[round(v / unit) for v in row] for row in x]
    horizon = sum(map(sum, F)) + sum(map(sum, B)) + sum(map(sum, X)) + 1
    md = cp_model.CpModel()
    y = [[md.NewBoolVar(f"y{j}_{k}") for k in range(m)] for j in range(m)]
    for j in range(m):  # (A)
        md.AddExactlyOne(y[j])
        md.AddExactlyOne(y[i][j] for i in range(m))

    def pick(table, c, j):
        return sum(table[c][k] * y[j][k] for k in range(m))

    end, ms = {}, md.NewIntVar(0, horizon, "makespan")
    for s, acts in enumerate(column_actions(schedule, p, m, virtual)):
        ivs, prev = [], None
        for a in acts:
            c, j = a.chunk * p + s, a.micro_batch
            st = md.NewIntVar(0, horizon, f"s{a}@{s}")
            size = md.NewIntVar(0, horizon, f"d{a}@{s}")
            md.Add(size == pick(F if a.kind == "F" else B, c, j))
            e = md.NewIntVar(0, horizon, f"e{a}@{s}")
            ivs.append(md.NewIntervalVar(st, size, e, f"i{a}@{s}"))
            if prev is not None:  # (P1)
                md.Add(st >= prev)
            prev = e
            end[(a.kind, c, j)] = (st, e)
            md.Add(ms >= e)  # (O)
        md.AddNoOverlap(ivs)
    for (kind, c, j), (st, _) in end.items():  # (P2)
        if kind == "F" and c > 0:
            md.Add(st >= end[("F", c - 1, j)][1] + pick(X, c - 1, j))
        elif kind == "B" and c < V - 1:
            md.Add(st >= end[("B", c + 1, j)][1] + pick(X, c, j))
        elif kind == "B":
            md.Add(st >= end[("F", c, j)][1])
    md.Minimize(ms)
    if hint is not None:
        for j, k in enumerate(hint):
            for kk in range(m):
                md.AddHint(y[j][kk], kk == k)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(num_workers)
    solver.parameters.random_seed = int(seed)
    st = solver.Solve(md)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return {"order": list(hint) if hint is not None else None, "status": "unknown",
                "objective_s": None, "bound_s": solver.BestObjectiveBound() * unit}  # fmt: skip
    order = [next(k for k in range(m) if solver.Value(y[j][k])) for j in range(m)]
    return {
        "order": order,
        "status": "optimal" if st == cp_model.OPTIMAL else "feasible",
        "objective_s": solver.ObjectiveValue() * unit,
        "bound_s": solver.BestObjectiveBound() * unit,
        # certified in seconds: a path holds at most 2 V m passes and 2 (V - 1) m transfers,
        # each rounded by at most unit / 2
        "certified_bound_s": max(0.0, (solver.BestObjectiveBound() - (2 * V - 1) * m) * unit),
    }


def plan_pp_cpsat(batch: Batch, cost: CostModel, *, pp: int = 4, schedule: str = "1f1b",
                  virtual_stages: int = 1, tensor_parallel: int | None = None,
                  max_tokens: int | None = None, time_limit_s: float = 10.0,
                  num_workers: int = 1, seed: int = 0, micro_steps: bool = True,
                  stage_layers: tuple[int, ...] | None = None):  # fmt: skip
    """greedy's plan, then each column's order by CP-SAT (slowest column first, the time
    budget shared); a column keeps CP-SAT's order only if it is faster and still fits. A
    micro-step plan gets its micro-steps' order (`order_micro_steps`)."""
    started = time.perf_counter()
    g = plan_pp_greedy(batch, cost, pp=pp, schedule=schedule, virtual_stages=virtual_stages,
                       tensor_parallel=tensor_parallel, max_tokens=max_tokens,
                       micro_steps=micro_steps, stage_layers=stage_layers)  # fmt: skip
    if g.plan.pipeline.micro_steps:
        return order_micro_steps(g, batch, cost, started + time_limit_s, started=started,
                                 num_workers=num_workers, seed=seed)  # fmt: skip
    inst, drafts = columns_of_plan(g.plan, batch, cost)
    cols = sorted(((c.makespan(inst), c) for c in drafts), key=lambda vc: -vc[0])
    pipe, deadline, stats, floors = inst.layout.pipeline, started + time_limit_s, [], []
    for i, (v, col) in enumerate(cols):
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        f, b, x = (a.tolist() for a in col.times(inst))
        got = solve_order(f, b, x, schedule=pipe.schedule, num_stages=pipe.num_stages,
                          virtual=pipe.virtual_stages, hint=list(range(len(col.mbs))),
                          time_limit_s=left / (len(cols) - i), num_workers=num_workers,
                          seed=seed)  # fmt: skip
        stats.append(got["status"])
        if "certified_bound_s" in got:  # these micro-batches, any order: the column's floor
            floors.append(got["certified_bound_s"])
        if got["order"] is None:
            continue
        cand = apply_order(col, got["order"])
        nv = cand.makespan(inst)
        if nv < v and fit_recompute(cand, inst):
            cols[i] = (cand.makespan(inst), cand)
    if not stats:
        raise DcpOptError("pp_cpsat: time_limit_s left no time for CP-SAT after greedy")
    res = finish_pipeline(inst, cols, planner="pp_cpsat", started=started,
                          stats={"column_order_status": stats})  # fmt: skip
    if floors:  # CP-SAT's dual bound of a column's order, where it beats bound.py's
        lb = max(res.stats["order_bound_s"], max(floors) + stage_sync_s(inst.layout))
        res.stats.update(order_bound_s=lb, order_gap=res.predicted_step_time_s / lb - 1.0)
    return res


def order_micro_steps(g, batch: Batch, cost: CostModel, deadline: float, *, started: float,
                      num_workers: int = 1, seed: int = 0):  # fmt: skip
    """CP-SAT on the order of a micro-step plan's micro-steps, each priced as its slowest
    group (steps.py: an upper bound of the lockstep finish in any order; its recompute fits
    in any order); kept if simulate's exact finish improves."""
    from dataclasses import replace

    from dcp_opt.pipeline.check import micro_step_parts
    from dcp_opt.pipeline.stages import stage_layout

    plan = g.plan
    inst = Instance(stage_layout(cost, plan.pipeline, plan.tensor_parallel), batch)
    parts = micro_step_parts(inst.layout, batch, plan)
    F, B, X = slowest_groups(parts, inst.layout.num_virtual)
    pipe = plan.pipeline
    left = deadline - time.perf_counter()
    if left <= 0.05:
        raise DcpOptError("pp_cpsat: time_limit_s left no time for CP-SAT after greedy")
    got = solve_order(F.tolist(), B.tolist(), X.tolist(), schedule=pipe.schedule,
                      num_stages=pipe.num_stages, hint=list(range(len(parts))),
                      time_limit_s=left, num_workers=num_workers, seed=seed)  # fmt: skip
    best = finish_micro_step_plan(inst, replace(plan, planner="pp_cpsat"), started=started,
                                  stats={"step_order_status": got["status"]})  # fmt: skip
    if got["order"] is not None:
        moved = replace(plan, planner="pp_cpsat",
                        phases=tuple(plan.phases[k] for k in got["order"]))  # fmt: skip
        cand = finish_micro_step_plan(inst, moved, started=started,
                                      stats={"step_order_status": got["status"]})  # fmt: skip
        if cand.predicted_step_time_s < best.predicted_step_time_s:
            best = cand
    return best
