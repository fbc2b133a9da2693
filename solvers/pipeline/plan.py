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

import functools
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

from .compose import columns, consecutive, pack, split_by_degree
from .instance import Column, Instance, make_pipeline
from .order import apply_order, best_named, local_search
from .recompute import fit_recompute

COUNTS = (1, 2, 4, 8)  # micro-batches per column, in multiples of p
SEARCH_SHARE, LOCAL_SHARE = 0.55, 0.7  # of time_limit_s: drafting stops, local search stops


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
    return priced(inst, columns(inst, d, mbs, equal_counts=interleaved))


def mixed_draft(inst: Instance, hi: int, lo: int, units_hi: int, m: int, cap: float,
                lo_cap: float | None = None):  # fmt: skip
    """Columns of degree hi on the first units_hi units for the long sequences, of degree lo
    on the rest (compose.split_by_degree, which sends every sequence over the lo window to
    hi), each part packed (LPT) into m micro-batches per column, of at most `cap` tokens
    (hi) and `lo_cap` (lo; default its window), and priced; m = 0: each part's fewest
    micro-batches at its cap."""
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
    return priced(inst, cols)


def fewest(inst: Instance, ids, tokens: float) -> int:
    """The fewest micro-batches of at most `tokens` tokens that hold `ids`' tokens."""
    return max(1, int(-(-float(inst.tokens[ids].sum()) // tokens)))


def priced(inst: Instance, cols: list):
    """(slowest makespan, [(makespan, column)]) with each column's best named order and
    its recompute fitted, or None if a column does not fit."""
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


def search(scored: list, deadline: float):
    """The best draft of `scored` [(estimate, instance, thunk)]: drafted in the order of
    their estimates; past the deadline once one draft fits, the search stops. (makespan,
    columns, instance) or None."""
    best = None
    for _, inst, make in sorted(scored, key=lambda c: c[0]):
        got = make()
        if got is not None and (best is None or got[0] < best[0]):
            best = (*got, inst)
        if best is not None and time.process_time() > deadline:
            break
    return best


def estimate(inst: Instance, d: int, ids, units: int, m: int, tokens: float,
             part: tuple | None = None) -> float:  # fmt: skip
    """The stage-uniform estimate g (sum(t) / p + (p - 1) max(t) / p) of the slowest column of
    degree d over `units` holding `ids` in about m micro-batches each (t: a micro-batch's
    additive seconds over all stages; LPT's slowest is about max(longest, mean), Graham),
    g = 1 + the recompute the windows need over sum(t) (`recompute_estimate`); m = 0: the
    fewest micro-batches of at most `tokens` tokens. part: `summary(inst, d, ids)`."""
    p = inst.layout.num_stages
    total, top, tok, full = summary(inst, d, ids) if part is None else part
    c0 = inst.per_micro_batch(d)
    ncol = units // d
    k = max(min(ncol * m, len(ids)), -(-tok // tokens))
    g = 1.0 + recompute_estimate(inst, d, tok, full, k, ncol) / max(total, 1e-30)
    return g * ((total + k * c0) / ncol / p + (p - 1) * (max(top, total / k) + c0) / p)


def summary(inst: Instance, d: int, ids) -> tuple:
    """(sum of additive seconds, the largest, tokens, (p,) every layer's recompute seconds
    summed) of `ids` at degree d: what `estimate` reads."""
    a = inst.additive(d)[ids]
    full = inst.recompute_all(d)[ids].sum(axis=0)
    return float(a.sum()), float(a.max()), float(inst.tokens[ids].sum()), full


def recompute_estimate(inst: Instance, d: int, tok: float, full, k: float, ncol: int) -> float:
    """Seconds of recompute summed over the stages that `tok` tokens in k micro-batches of
    equal tokens on ncol columns of degree d need for stage s's window (p - s in flight
    under 1F1B, the column's all under GPipe) to fit: the fraction of the layers that
    closes the excess (recompute.fit_recompute's rule, uniform), times `full` (p,), every
    layer's recompute."""
    lay = inst.layout
    p = lay.num_stages
    per_col = k / ncol
    w = np.full(p, per_col) if lay.pipeline.schedule == "gpipe" else np.minimum(
        np.arange(p, 0, -1), per_col)  # fmt: skip
    keep, save, work, room = window_terms(inst, d)
    local = tok / k / d
    need = local * (w * keep + work) - room
    frac = np.clip(need / np.maximum(local * w * save, 1e-30), 0.0, 1.0)
    return float((frac * full).sum())


def window_terms(inst: Instance, d: int) -> tuple:
    """(p,) per stage: bytes a local token keeps with nothing recomputed, bytes recomputing
    everything saves, the working set's bytes per local token, the room."""

    def make():
        co, lay = inst.layout.cost.coeffs, inst.layout
        n = np.array(lay.pipeline.stage_layers, dtype=float)
        act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
        work = np.full(lay.num_stages, act)
        work[-1] += co.head_bytes_per_token
        return n * act, n * max(act - ckpt, 1e-30), work, stage_room(inst, d)

    return inst.memo(("window", d), make)


def stage_room(inst: Instance, d: int) -> np.ndarray:
    """(p,) a unit's bytes left on each stage for activations (a column of degree d at
    unit 0)."""
    return inst.memo(("room", d), lambda: Column(d, 0, [[0]], np.zeros(
        (1, inst.layout.num_stages), dtype=int)).memory(inst)[2])  # fmt: skip


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
        part = summary(inst, d, everything)
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
                ph, pl = summary(inst, hi, ids_hi), summary(inst, lo, ids_lo)
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


def window_tokens(inst: Instance, d: int, keep: bool = False) -> float:
    """Tokens per micro-batch with which p - s in-flight micro-batches, every layer
    recomputed (keep: none), fit stage s (the 1F1B window; a first guess, fit_recompute
    decides). A longer sequence gets a micro-batch of its own (compose.pack)."""
    lay = inst.layout
    co, p = lay.cost.coeffs, lay.num_stages
    room = stage_room(inst, d)
    stored = co.act_bytes_per_token_layer if keep else co.ckpt_bytes_per_token_layer
    out = float("inf")
    for s, n in enumerate(lay.pipeline.stage_layers):
        per_token = (p - s) * n * stored + co.act_bytes_per_token_layer
        per_token += co.head_bytes_per_token if s == p - 1 else 0.0
        out = min(out, room[s] * d / per_token)
    return out


def token_caps(inst: Instance, d: int, cap: float) -> list[float]:
    """The micro-batch token caps tried at degree d: the window with every layer recomputed,
    with none, and their geometric mean, each at most `cap`."""
    lo, hi = window_tokens(inst, d, keep=True), window_tokens(inst, d)
    return sorted({min(cap, x) for x in (lo, (lo * hi) ** 0.5, hi)})


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
        if time.process_time() > deadline:
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
    started, cpu = time.perf_counter(), time.process_time()  # deadlines in CPU seconds
    cost = pipeline_cost(cost, tensor_parallel)  # tensor parallelism is the cost model's
    splits = stage_splits(cost, pp, virtual_stages)
    scored = []  # every split's candidates, ranked together by their estimates
    for layers in splits:
        lay = stage_layout(cost, Pipeline(layers, schedule, virtual_stages))
        here = Instance(lay, batch)
        cap = float(max_tokens or max(131072, int(here.tokens.max())))
        degrees = stage_cluster(lay).allowed_degrees
        scored += [(est, here, make) for est, make in candidates(here, degrees, cap)]
    best = search(scored, cpu + SEARCH_SHARE * time_limit_s)
    if best is None:
        raise InfeasibleError(
            f"pp_greedy: no degree in {list(degrees)} fits the batch's micro-batches in the "
            f"stages' memory windows (p = {pp}, stage layers {list(splits)}, max_tokens "
            f"{int(cap)}); more stages, tensor parallelism or a smaller max_tokens"
        )
    _, cols, inst = best
    cols = improve(inst, cols, cpu + LOCAL_SHARE * time_limit_s)  # the rest: the tail
    del seed  # deterministic: every choice above is ordered
    return finish_pipeline(inst, cols, planner="pp_greedy", started=started)


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
    def make():
        lay = inst.layout
        degrees = [d for d in stage_cluster(lay).allowed_degrees if lay.num_units % d == 0]
        if not degrees:
            raise DcpOptError("pp: no degree divides a stage's units")
        return batch_bound_parts(lay, inst.batch, degrees)

    return inst.memo("bound", make)
