"""pp_greedy: a pipeline plan in milliseconds (issue 30).

Search, over the layer splits of `stage_splits` (the parameter-balanced one and Megatron-LM's
even default) together: for each degree d a stage's units allow (columns of d units, equal
on every stage) the consecutive cuts of the length-sorted batch (compose.consecutive,
DynaPipe's shape) and, for each micro-batch token cap of `token_caps` (the 1F1B window with
every layer recomputed, with none, and between), each micro-batch count per column m in
(p, 2p, 4p, 8p) and the fewest at the cap; and mixed columns (compose.split_by_degree: the
long sequences on columns of a high degree hi, the rest on columns of a low degree lo, hi /
8 <= lo < hi, the units split near their GPU-seconds). Each choice is composed
(compose.pack, LPT) and assigned to columns (compose.columns), each column ordered by the
best named order (order.best_named), its per-stage recompute fitted
(recompute.fit_recompute), and scored by the slowest column's exact makespan; choices are
drafted in the order of a stage-uniform estimate that charges the recompute the windows
need (`estimate`). The best draft then gets local search (order.local_search) on its
slowest columns, its recompute refit after each reorder. `time_limit_s` covers it all, in
this process's CPU seconds (time.process_time: a loaded machine stretches the wall time,
not the plan): drafting stops at SEARCH_SHARE of it (once a draft fits), local search at
LOCAL_SHARE, leaving the rest to validate, simulate and bound. Every answer carries the batch's certified lower bound (dcp_opt/pipeline/
bound.py) + the step's collectives, and its gap; `stats` the single-phase bound and gap
and the order bound of its own micro-batches.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import time

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError, InfeasibleError
from dcp_opt.pipeline.bound import batch_bound_parts, column_lower_bound
from dcp_opt.pipeline.build import pipeline_plan
from dcp_opt.pipeline.check import stage_sync_s
from dcp_opt.pipeline.stages import pipeline_cost, stage_cluster, stage_layout
from dcp_opt.plan import Group, MicroBatch, Pipeline
from dcp_opt.result import PlanResult
from dcp_opt.simulate import simulate
from dcp_opt.validate import InvalidPlanError, validate

from . import steps
from .compose import columns, consecutive, pack, split_by_degree
from .instance import Instance, make_pipeline
from .order import apply_order, best_named, local_search
from .recompute import fit_recompute
from .window import (
    estimate,
    fewest,
    fits_alone,
    split_summary,
    token_caps,
    window_tokens,
)

COUNTS = (1, 2, 4, 8)  # micro-batches per column, in multiples of p
SEARCH_SHARE, LOCAL_SHARE = 0.35, 0.5  # of time_limit_s: drafting stops, local search stops
TAIL_SHARE = 0.3  # of time_limit_s: no local-search chunk is started that would end inside
# it at its measured pace, and a draft made past the search's deadline is given up in it
# (validate, simulate and bound of a 1,000-group plan: ~30 ms)
FORM_MARGIN = 0.15  # past the deadline, a form not yet drafted is drafted if its estimate is
# within this of the best value found (search)


def draft(inst: Instance, d: int, m: int, max_tokens: float, limit: float | None = None):
    """(slowest makespan, columns) of one (degree, count) choice, or None if it does not fit
    (or is given up at `limit`: `priced`). m = 0: the consecutive cuts of the length-sorted
    batch (compose.consecutive)."""
    lay = inst.layout
    ncol = lay.num_units // d
    if m:
        mbs = pack(inst, d, min(ncol * m, len(inst.ids)), max_tokens)
    else:
        mbs = consecutive(inst, d, max_tokens)
    interleaved = lay.pipeline.schedule == "interleaved"
    if interleaved and len(mbs) % (ncol * lay.num_stages):
        return None
    return priced(inst, columns(inst, d, mbs, equal_counts=interleaved), limit)


def mixed_draft(inst: Instance, hi: int, lo: int, units_hi: int, m: int, cap: float,
                lo_cap: float | None = None, limit: float | None = None):  # fmt: skip
    """Columns of degree hi on the first units_hi units for the long sequences, of degree lo
    on the rest (compose.split_by_degree, which sends every sequence over the lo window to
    hi), each part packed (LPT) into m micro-batches per column, of at most `cap` tokens
    (hi) and `lo_cap` (lo; default its window), and priced; m = 0: each part's fewest
    micro-batches at its cap. limit: `priced`'s."""
    n = inst.layout.num_units
    lo_tokens = min(cap, window_tokens(inst, lo))
    ids_hi, ids_lo = split_by_degree(inst, hi, lo, lo_tokens, units_hi)
    lo_cap = lo_tokens if lo_cap is None else min(lo_cap, lo_tokens)
    cols = []
    for d, ids, start, units, tokens in ((hi, ids_hi, 0, units_hi, cap),
                                         (lo, ids_lo, units_hi, n - units_hi, lo_cap)):  # fmt: skip
        if not ids:
            continue
        ncol = units // d
        k = ncol * m if m else fewest(inst, ids, tokens)
        mbs = pack(inst, d, min(k, len(ids)), tokens, ids)
        cols += columns(inst, d, mbs, start=start, units=units)
    return priced(inst, cols, limit)


def priced(inst: Instance, cols: list, limit: float | None = None):
    """(slowest makespan, [(makespan, column)]) with each column's best named order and
    its recompute fitted, or None if a column does not fit, or if the CPU clock passes
    `limit` (a draft made past the search's deadline is given up between two columns
    rather than overrun the budget: 40 ms a column draft at 256 GPUs x 1,300 documents)."""
    out, worst = [], 0.0
    for col in cols:
        if limit is not None and time.process_time() > limit:
            return None
        order, _ = best_named(col, inst, col.times(inst))
        col = apply_order(col, order)
        if not fit_recompute(col, inst):
            return None
        v = col.makespan(inst)
        worst = max(worst, v)
        out.append((v, col))
    return worst, out


def search(scored: list, deadline: float, limit: float | None = None):
    """The best draft of `scored` [(estimate, instance, thunk)]: each form's (columns,
    micro-steps) drafted in the order of its estimates, the next draft from the form that
    has had the less time so far (the one with the lower best estimate first; their
    estimates rank within a form better than across, and their drafts cost differently).
    Past the deadline, once one draft fits, it stops, but first drafts each form not yet
    drafted whose best estimate is within FORM_MARGIN of the best draft's value (cross-form
    estimates were off by up to 13 % on the benchmark's rows; a form estimated further off
    than that is not worth its draft: a column draft costs 30 ms at 256 GPUs); such a draft
    is given up at `limit` (its thunk's `limit`). (value, drafted, [micro-steps' times,]
    instance) or None."""
    queues = [sorted((c for c in scored if c[1].layout.pipeline.micro_steps == f),
                     key=lambda c: c[0]) for f in (False, True)]  # fmt: skip
    queues = sorted((collections.deque(q) for q in queues if q), key=lambda q: q[0][0])
    spent = [0.0] * len(queues)
    best, tried = None, set()
    while any(queues):
        i = min((j for j, q in enumerate(queues) if q), key=lambda j: spent[j])
        _, inst, make = queues[i].popleft()
        t = time.process_time()
        late = best is not None and t > deadline  # only a form still worth one is drafted
        got = make(limit=limit) if late else make()
        spent[i] += time.process_time() - t
        tried.add(i)
        if got is not None and (best is None or got[0] < best[0]):
            best = (*got, inst)
        if best is not None and time.process_time() > deadline:
            worth = [j for j, q in enumerate(queues) if j not in tried and q
                     and q[0][0] <= (1 + FORM_MARGIN) * best[0]]  # fmt: skip
            if not worth:
                break
            for j, q in enumerate(queues):  # past the deadline: only the forms still worth one
                if j not in worth:
                    q.clear()
    return best


def candidates(inst: Instance, degrees, cap: float) -> list:
    """(estimate, thunk drafting it) for each pure degree and count (m in COUNTS x p;
    consecutive cuts) and, outside the interleaved schedule, each mix of a high degree hi
    on units_hi units and a low one lo on the rest (compose.split_by_degree), m = p, 2p."""
    lay = inst.layout
    p, n = lay.num_stages, lay.num_units
    fit = [d for d in degrees if n % d == 0 and fits_alone(inst, d)]
    everything = np.arange(len(inst.ids))
    out = []
    for d in fit:
        part = split_summary(inst, d, 0, 1)  # the whole batch, from the prefix sums
        for tokens in token_caps(inst, d, cap):
            least = -(-fewest(inst, everything, tokens) // (n // d))
            for m in sorted({*(c * p for c in COUNTS), least}):
                est = estimate(inst, d, everything, n, m, tokens, part)
                out.append((est, functools.partial(draft, inst, d, m, tokens)))
        tokens = min(cap, window_tokens(inst, d))
        est = estimate(inst, d, everything, n, 0, tokens, part)  # the fewest micro-batches
        out.append((est, functools.partial(draft, inst, d, 0, tokens)))
    if lay.pipeline.schedule == "interleaved":
        return out
    for hi in fit:
        for lo in (d for d in degrees if hi // 8 <= d < hi and hi % d == 0):  # <= 8 lo a hi
            lo_tokens = min(cap, window_tokens(inst, lo))
            share = inst.additive(hi)[inst.tokens > lo_tokens].sum() * hi
            share /= max(float((inst.additive(lo) * lo).sum()), 1e-30)  # forced GPU-s share
            near = hi * max(1, round(n * share / hi))
            for units in sorted({u for u in (near - hi, near, near + hi, n // 2) if 0 < u < n}):
                if units % hi:
                    continue
                ids_hi, ids_lo = split_by_degree(inst, hi, lo, lo_tokens, units)
                if not ids_lo or not ids_hi:
                    continue
                j = len(ids_hi)  # the j longest: split_by_degree cuts the sorted order
                ph, pl = split_summary(inst, hi, j, 0), split_summary(inst, lo, j, 1)
                for m in (p, 2 * p, 4 * p, 8 * p):
                    est = max(estimate(inst, hi, ids_hi, units, m, cap, ph),
                              estimate(inst, lo, ids_lo, n - units, m, lo_tokens, pl))  # fmt: skip
                    out.append((est, functools.partial(mixed_draft, inst, hi, lo, units, m, cap)))
                for lo_cap in token_caps(inst, lo, lo_tokens):  # each part its fewest
                    est = max(estimate(inst, hi, ids_hi, units, 0, cap, ph),
                              estimate(inst, lo, ids_lo, n - units, 0, lo_cap, pl))  # fmt: skip
                    out.append((est, functools.partial(mixed_draft, inst, hi, lo, units, 0, cap,
                                                       lo_cap)))  # fmt: skip
    return out


def improve(inst: Instance, cols: list, deadline: float, limit: float | None = None) -> list:
    """Local search on the slowest columns first; keep a reorder only if it still fits.
    deadline, limit: order.local_search's."""
    cols = sorted(cols, key=lambda vc: -vc[0])
    for i, (v, col) in enumerate(cols):
        if time.process_time() > deadline:
            break
        times = col.times(inst)
        order, nv = local_search(col, inst, times, range(len(col.mbs)), v, deadline, limit)
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
                   seed: int = 0, micro_steps: bool = True,
                   stage_layers: tuple[int, ...] | None = None) -> PlanResult:  # fmt: skip
    """stage_layers: the job's layer split, fixed (a training run builds its stages once;
    default: the better of `stage_splits`, chosen per batch)."""
    with collection_paused():
        return _plan_pp_greedy(batch, cost, pp, schedule, virtual_stages, tensor_parallel,
                               max_tokens, time_limit_s, seed, micro_steps, stage_layers)  # fmt: skip


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector paused while pp_greedy plans: its milliseconds
    allocate many short-lived objects, and a collection of a large heap (a training process's)
    mid-plan cost 6-10 ms at the p99 (measured in bench_pipeline's process: p99 86-90 ms
    with it, 80 without). Reference counting still frees everything acyclic; the collector
    runs again after, as before if it was on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan_pp_greedy(batch, cost, pp, schedule, virtual_stages, tensor_parallel, max_tokens,
                    time_limit_s, seed, micro_steps, stage_layers) -> PlanResult:  # fmt: skip
    started, cpu = time.perf_counter(), time.process_time()  # deadlines in CPU seconds
    cost = pipeline_cost(cost, tensor_parallel)  # tensor parallelism is the cost model's
    splits = stage_splits(cost, pp, virtual_stages)
    if stage_layers is not None:
        splits = [fixed_split(cost, pp, stage_layers)]
    scored = []  # every split's candidates, ranked together by their estimates
    search_end = cpu + SEARCH_SHARE * time_limit_s
    for layers in splits:
        lay = stage_layout(cost, Pipeline(layers, schedule, virtual_stages))
        here = Instance(lay, batch)
        cap = float(max_tokens or max(131072, int(here.tokens.max())))
        degrees = stage_cluster(lay).allowed_degrees
        scored += [(est, here, make) for est, make in candidates(here, degrees, cap)]
        if micro_steps and virtual_stages == 1 and schedule in ("1f1b", "gpipe"):
            ms = here.sibling(stage_layout(cost, Pipeline(layers, schedule, 1, True)))
            scored += [(est, ms, make) for est, make in steps.candidates(ms, degrees, cap)]
    limit = cpu + (1 - TAIL_SHARE) * time_limit_s  # no late draft or chunk ends past it
    best = search(scored, search_end, limit)
    if best is None:
        raise InfeasibleError(
            f"pp_greedy: no degree in {list(degrees)} fits the batch's micro-batches in the "
            f"stages' memory windows (p = {pp}, stage layers {list(splits)}, max_tokens "
            f"{int(cap)}); more stages, tensor parallelism or a smaller max_tokens"
        )
    inst, cols = best[-1], best[1]
    del seed  # deterministic: every choice above is ordered
    local_end = cpu + LOCAL_SHARE * time_limit_s
    if inst.layout.pipeline.micro_steps:
        _, cols = steps.improve(inst, cols, best[2], best[0], local_end, limit)
        return finish_micro_steps(inst, cols, planner="pp_greedy", started=started)
    cols = improve(inst, cols, local_end, limit)  # the rest: the tail
    return finish_pipeline(inst, cols, planner="pp_greedy", started=started)


def fixed_split(cost: CostModel, pp: int, stage_layers) -> tuple[int, ...]:
    """The user's split, checked: pp entries >= 1 summing to the model's layers."""
    layers = tuple(stage_layers)
    L = cost.model.num_layers
    ok = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers)
    if len(layers) != pp or not ok or sum(layers) != L:
        raise DcpOptError(
            f"stage_layers: {list(layers)}; allowed: {pp} integers >= 1 (one a stage) summing "
            f"to the model's {L} layers"
        )
    return layers


def stage_splits(cost: CostModel, pp: int, virtual: int = 1) -> list[tuple[int, ...]]:
    """The layer splits pp_greedy tries: the parameter-balanced one (instance.
    balanced_stage_layers) and the even one Megatron-LM makes by default (num_layers / p a
    stage, the remainder to the middle stages), when they differ."""
    first = make_pipeline(cost, pp, "1f1b", virtual).stage_layers
    L = cost.model.num_layers
    even = [L // pp] * pp
    for k in range(L % pp):  # the middle stages hold neither embedding nor head
        even[(pp - L % pp) // 2 + k] += 1
    out = [first]
    if tuple(even) != first and min(even) >= virtual:
        out.append(tuple(even))
    return out


def finish_pipeline(inst: Instance, cols: list, *, planner: str, started: float,
                    status: str = "feasible", stats: dict | None = None) -> PlanResult:  # fmt: skip
    """Build, validate independently, simulate, bound: the pipeline planners' shared tail."""
    lay, batch = inst.layout, inst.batch
    plan = pipeline_plan([to_groups(inst, cols)], batch, lay, planner=planner)
    bad = validate(plan, batch, lay.cost)
    if bad:
        raise InvalidPlanError(bad)
    sim = simulate(plan, batch, lay.cost)
    one = single_phase_bound_s(inst)  # first: its parts hold bound_s's (one computation)
    bound = bound_s(inst)
    from dataclasses import replace

    plan = replace(plan, predicted_step_time_s=sim.step_time_s)
    stats = dict(stats or {})
    # the order's own certificate: these micro-batches, any order (bound.column_lower_bound)
    sched = lay.pipeline.schedule
    order_lb = max(column_lower_bound(*c.times(inst), num_stages=lay.num_stages, schedule=sched)
                   for _, c in cols) + stage_sync_s(lay)  # fmt: skip
    stats.update(order_bound_s=order_lb, order_gap=sim.step_time_s / order_lb - 1.0,
                 single_phase_bound_s=one, single_phase_gap=sim.step_time_s / one - 1.0)  # fmt: skip
    return PlanResult(status, plan, sim.step_time_s, bound, time.perf_counter() - started,
                      planner, "", stats)  # fmt: skip


def finish_micro_steps(inst: Instance, drafted: list, *, planner: str,
                       started: float) -> PlanResult:  # fmt: skip
    """A micro-step draft (steps.py) built, validated independently, simulated (the exact
    lockstep finish) and bounded: `finish_micro_step_plan`."""
    lay, batch = inst.layout, inst.batch
    plan = pipeline_plan(steps.to_phases(inst, drafted), batch, lay, planner=planner)
    return finish_micro_step_plan(inst, plan, started=started)


def finish_micro_step_plan(inst: Instance, plan, *, started: float,
                           stats: dict | None = None) -> PlanResult:  # fmt: skip
    """Validate, simulate and bound a micro-step plan. The single-phase and order bounds are
    the columns'; a micro-step plan has the batch bound only."""
    from dataclasses import replace

    lay, batch = inst.layout, inst.batch
    bad = validate(plan, batch, lay.cost)
    if bad:
        raise InvalidPlanError(bad)
    sim = simulate(plan, batch, lay.cost)
    plan = replace(plan, predicted_step_time_s=sim.step_time_s)
    degrees = {g.degree for ph in plan.phases for g in ph.groups if g.micro_batches}
    stats = {"micro_steps": len(plan.phases), "degrees": sorted(degrees), **(stats or {})}
    return PlanResult("feasible", plan, sim.step_time_s, bound_s(inst),
                      time.perf_counter() - started, plan.planner, "", stats)  # fmt: skip


def bound_s(inst: Instance) -> float:
    """The batch's certified lower bound of the step over every valid plan (finish bound +
    the collectives; dcp_opt/pipeline/bound.py (1), (2), (4))."""
    return _bound_parts(inst, windows=False)["bound_s"] + stage_sync_s(inst.layout)


def single_phase_bound_s(inst: Instance) -> float:
    """The batch's bound over every single-phase plan (each unit runs one column: every
    pipeline planner's and baseline's plan), with the window bound (5) as well."""
    return _bound_parts(inst)["single_phase_bound_s"] + stage_sync_s(inst.layout)


def _bound_parts(inst: Instance, windows: bool = True) -> dict:
    def make():
        lay = inst.layout
        degrees = [d for d in stage_cluster(lay).allowed_degrees if lay.num_units % d == 0]
        if not degrees:
            raise DcpOptError("pp: no degree divides a stage's units")
        return batch_bound_parts(lay, inst.batch, degrees, windows=windows)

    if windows or inst.known(("bound", True)):  # the fuller one holds bound_s too
        return inst.memo(("bound", True), make)
    return inst.memo(("bound", False), make)
