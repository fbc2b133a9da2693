"""pp_greedy: a pipeline plan in milliseconds (issue 30).

Search: for each degree d a stage's units allow (columns of d units, equal on every stage)
the consecutive cuts of the length-sorted batch (compose.consecutive, DynaPipe's shape) and
each micro-batch count per column m in (p, 2p, 4p, 8p) (capped by the sequences),
compose (compose.pack) and assign to columns (compose.columns), order each
column by the best named order (order.best_named), fit per-stage recompute
(recompute.fit_recompute), and score the slowest column's exact makespan. The best draft
then gets local search on its slowest columns, its recompute refit after each reorder.
`time_limit_s` covers it all: the search stops at 35 % of it (once a draft fits), local
search at 60 %, leaving the rest to validate, simulate and bound. Every answer carries the batch's certified lower bound
(dcp_opt/pipeline/bound.py) + the step's collectives, and its gap.
"""

from __future__ import annotations

import time

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError, InfeasibleError
from dcp_opt.pipeline.bound import batch_bound_parts, column_lower_bound
from dcp_opt.pipeline.build import pipeline_plan
from dcp_opt.pipeline.check import stage_sync_s
from dcp_opt.pipeline.stages import pipeline_cost, stage_cluster, stage_layout
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult
from dcp_opt.simulate import simulate
from dcp_opt.validate import InvalidPlanError, validate

from .compose import columns, consecutive, pack
from .instance import Column, Instance, make_pipeline
from .order import apply_order, best_named, local_search
from .recompute import fit_recompute

COUNTS = (1, 2, 4, 8)  # micro-batches per column, in multiples of p


def draft(inst: Instance, d: int, m: int, max_tokens: float):
    """(slowest makespan, columns) of one (degree, count) choice, or None if it does not fit.
    m = 0: the consecutive cuts of the length-sorted batch (compose.consecutive)."""
    lay = inst.layout
    ncol = lay.num_units // d
    if m:
        mbs = pack(inst, d, min(ncol * m, len(inst.ids)), max_tokens)
    else:
        mbs = consecutive(inst, d, max_tokens)
    interleaved = lay.pipeline.schedule == "interleaved"
    if interleaved and len(mbs) % (ncol * lay.num_stages):
        return None
    cols = columns(inst, d, mbs, equal_counts=interleaved)
    out, worst = [], 0.0
    for col in cols:
        order, _ = best_named(col, inst, col.times(inst))
        col = apply_order(col, order)
        if not fit_recompute(col, inst):
            return None
        v = col.makespan(inst)
        worst = max(worst, v)
        out.append((v, col))
    return worst, out


def search(inst: Instance, degrees, cap: float, deadline: float):
    """The best draft over (degree, count): candidates ranked by the stage-uniform estimate
    sum(t) / p + (p - 1) max(t) / p of their slowest column (t: a micro-batch's additive
    seconds over all stages), then drafted exactly in that order; past the deadline once
    one draft fits, the search stops. Degrees that cannot hold the longest sequence alone
    are skipped."""
    lay = inst.layout
    p = lay.num_stages
    cands = []
    for d in degrees:
        if lay.num_units % d or not fits_alone(inst, d):
            continue
        a, c0 = inst.additive(d), inst.per_micro_batch(d)
        ncol = lay.num_units // d
        tokens = min(cap, window_tokens(inst, d))
        total, top = float(a.sum()), float(a.max())
        least = -(-float(inst.tokens.sum()) // tokens)  # micro-batches the token cap needs
        for m in COUNTS:  # LPT's slowest micro-batch is about max(longest, mean) (Graham)
            k = max(min(ncol * m * p, len(inst.ids)), least)
            est = (total + k * c0) / ncol / p + (p - 1) * (max(top, total / k) + c0) / p
            cands.append((est, d, m, tokens))
        t = np.array([a[mb].sum() for mb in consecutive(inst, d, tokens)]) + c0
        cands.append((t.sum() / ncol / p + (p - 1) * t.max() / p, d, 0, tokens))
    best = None
    for _, d, m, tokens in sorted(cands):
        got = draft(inst, d, m * p, tokens)  # m = 0: consecutive cuts
        if got is not None and (best is None or got[0] < best[0]):
            best = got
        if best is not None and time.perf_counter() > deadline:
            break
    return best


def window_tokens(inst: Instance, d: int) -> float:
    """Tokens per micro-batch with which p - s in-flight micro-batches, every layer
    recomputed, fit stage s (the 1F1B window; a first guess, fit_recompute decides). A
    longer sequence gets a micro-batch of its own (compose.pack)."""
    lay = inst.layout
    co, p = lay.cost.coeffs, lay.num_stages
    col = Column(d, 0, [[0]], np.zeros((1, p), dtype=int))
    room = col.memory(inst)[2]
    out = float("inf")
    for s, n in enumerate(lay.pipeline.stage_layers):
        per_token = (p - s) * n * co.ckpt_bytes_per_token_layer + co.act_bytes_per_token_layer
        per_token += co.head_bytes_per_token if s == p - 1 else 0.0
        out = min(out, room[s] * d / per_token)
    return out


def fits_alone(inst: Instance, d: int) -> bool:
    """Whether the longest sequence alone, every layer recomputed, fits every stage."""
    lay = inst.layout
    k = int(inst.tokens.argmax())
    col = Column(d, 0, [[k]], np.array([lay.pipeline.stage_layers]))
    stored, work, room = col.memory(inst)
    per_stage = [(stored[s::lay.num_stages] + work[s::lay.num_stages]).sum() for s in
                 range(lay.num_stages)]  # fmt: skip
    return all(x <= r for x, r in zip(per_stage, room, strict=True))


def improve(inst: Instance, cols: list, deadline: float) -> list:
    """Local search on the slowest columns first; keep a reorder only if it still fits."""
    cols = sorted(cols, key=lambda vc: -vc[0])
    for i, (v, col) in enumerate(cols):
        if time.perf_counter() > deadline:
            break
        times = col.times(inst)
        order, nv = local_search(col, inst, times, range(len(col.mbs)), v, deadline)
        cand = apply_order(col, order)
        if nv < v and fit_recompute(cand, inst):
            cols[i] = (cand.makespan(inst), cand)
    return cols


def to_groups(inst: Instance, cols: list) -> list[Group]:
    ids = inst.ids
    return [
        Group(col.start, col.degree, tuple(
            MicroBatch(tuple(ids[i] for i in mb), int(r.sum()), tuple(int(x) for x in r))
            for mb, r in zip(col.mbs, col.rec, strict=True)))
        for _, col in cols
    ]  # fmt: skip


def plan_pp_greedy(batch: Batch, cost: CostModel, *, pp: int = 4, schedule: str = "1f1b",
                   virtual_stages: int = 1, tensor_parallel: int | None = None,
                   max_tokens: int | None = None, time_limit_s: float = 0.1,
                   seed: int = 0) -> PlanResult:  # fmt: skip
    started = time.perf_counter()
    cost = pipeline_cost(cost, tensor_parallel)  # tensor parallelism is the cost model's
    layout = stage_layout(cost, make_pipeline(cost, pp, schedule, virtual_stages))
    inst = Instance(layout, batch)
    cap = float(max_tokens or max(131072, int(inst.tokens.max())))
    degrees = stage_cluster(layout).allowed_degrees
    best = search(inst, degrees, cap, started + 0.35 * time_limit_s)
    if best is None:
        raise InfeasibleError(
            f"pp_greedy: no degree in {list(degrees)} fits the batch's micro-batches in the "
            f"stages' memory windows (p = {pp}, max_tokens {int(cap)}); more stages, tensor "
            "parallelism or a smaller max_tokens"
        )
    cols = improve(inst, best[1], started + 0.6 * time_limit_s)  # the rest: the tail
    del seed  # deterministic: every choice above is ordered
    return finish_pipeline(inst, cols, planner="pp_greedy", started=started)


def finish_pipeline(inst: Instance, cols: list, *, planner: str, started: float,
                    status: str = "feasible", stats: dict | None = None) -> PlanResult:  # fmt: skip
    """Build, validate independently, simulate, bound: the pipeline planners' shared tail."""
    lay, batch = inst.layout, inst.batch
    plan = pipeline_plan([to_groups(inst, cols)], batch, lay, planner=planner)
    bad = validate(plan, batch, lay.cost)
    if bad:
        raise InvalidPlanError(bad)
    sim = simulate(plan, batch, lay.cost)
    bound = bound_s(inst)
    from dataclasses import replace

    plan = replace(plan, predicted_step_time_s=sim.step_time_s)
    stats = dict(stats or {})
    # the order's own certificate: these micro-batches, any order (bound.column_lower_bound)
    sched = lay.pipeline.schedule
    order_lb = max(column_lower_bound(*c.times(inst), num_stages=lay.num_stages, schedule=sched)
                   for _, c in cols) + stage_sync_s(lay)  # fmt: skip
    one = single_phase_bound_s(inst)
    stats.update(order_bound_s=order_lb, order_gap=sim.step_time_s / order_lb - 1.0,
                 single_phase_bound_s=one, single_phase_gap=sim.step_time_s / one - 1.0)  # fmt: skip
    return PlanResult(status, plan, sim.step_time_s, bound, time.perf_counter() - started,
                      planner, "", stats)  # fmt: skip


def bound_s(inst: Instance) -> float:
    """The batch's certified lower bound of the step over every valid plan (finish bound +
    the collectives; dcp_opt/pipeline/bound.py (1), (2), (4))."""
    return _bound_parts(inst)["bound_s"] + stage_sync_s(inst.layout)


def single_phase_bound_s(inst: Instance) -> float:
    """The batch's bound over every single-phase plan (each unit runs one column: every
    pipeline planner's and baseline's plan), with the window bound (5) as well."""
    return _bound_parts(inst)["single_phase_bound_s"] + stage_sync_s(inst.layout)


def _bound_parts(inst: Instance) -> dict:
    if "bound" not in inst._memo:
        lay = inst.layout
        degrees = [d for d in stage_cluster(lay).allowed_degrees if lay.num_units % d == 0]
        if not degrees:
            raise DcpOptError("pp: no degree divides a stage's units")
        inst._memo["bound"] = batch_bound_parts(lay, inst.batch, degrees)
    return inst._memo["bound"]
