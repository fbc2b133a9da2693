"""Pipeline baselines as their users run them (issue 30; deviations in docs/baselines.md,
"Pipeline baselines"). Each picks its micro-batches and order its own way on columns of one
SP degree, the smallest at which its plan fits (a user picks one degree for the job); every
one then gets the fewest per-stage recompute that fits the stages' memory windows
(solvers/pipeline/recompute.py), so none is charged an out-of-memory plan.

- pp_fixed: fixed-length packing, uniform micro-batches (torchtitan, DeepSpeed): documents
  in data order, next-fit into micro-batches of `max_tokens`, round-robin over columns, run
  in data order.
- pp_verl: verl's balanced micro-batches (verl/utils/seqlen_balancing.py; see verl.py):
  Karmarkar-Karp over the columns (equal size) on the workload 24576 s + s^2, then per
  column ceil(tokens / max_tokens) micro-batches (the count made equal over columns)
  balanced by Karmarkar-Karp, run small at both ends (get_reverse_idx of its PP path).
- pp_wlb: WLB-LLM (Wang et al., OSDI'25, sec. 4.1) var-length packing: documents by
  workload, heaviest first, each to the micro-batch of least workload with token room
  (the fixed count ceil(tokens / max_tokens) per column, up to 2 x max_tokens each), the
  outliers (above max_tokens / 2) delayed: packed after the rest into the micro-batches that
  run last. Its delay of outliers to later steps is not expressible on one batch.
- pp_dynapipe: DynaPipe (Jiang et al., EuroSys'24, sec. 4-5): sequences sorted by length,
  cut into consecutive micro-batches minimising its pipeline estimate sum(t) / C + (p - 1)
  max(t) over C columns (compose.consecutive), LPT over columns, then its order search: the best of the named orders by
  the exact makespan (DynaPipe scores candidate orders with its simulator).
"""

from __future__ import annotations

import time

import numpy as np
from dcp_opt.solvers.pipeline.compose import columns as lpt_columns
from dcp_opt.solvers.pipeline.compose import consecutive
from dcp_opt.solvers.pipeline.instance import Column, Instance, make_pipeline
from dcp_opt.solvers.pipeline.order import apply_order, best_named, small_at_both_ends
from dcp_opt.solvers.pipeline.plan import finish_pipeline
from dcp_opt.solvers.pipeline.recompute import fit_recompute

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import InfeasibleError
from dcp_opt.pipeline.stages import pipeline_cost, stage_cluster, stage_layout
from dcp_opt.plan import Pipeline

from .verl import karmarkar_karp


def _fixed(inst: Instance, d: int, cap: float) -> list[Column]:
    mbs, cur, room = [], [], cap
    for i in range(len(inst.ids)):  # next-fit in data order
        if cur and inst.tokens[i] > room:
            mbs.append(cur)
            cur, room = [], cap
        cur.append(i)
        room -= inst.tokens[i]
    mbs.append(cur)
    n = inst.layout.num_units // d
    return _cols(inst, d, [mbs[c::n] for c in range(n)])


def _cols(inst: Instance, d: int, per_col: list) -> list[Column]:
    p = inst.layout.num_stages
    return [Column(d, c * d, mbs, np.zeros((len(mbs), p), dtype=int))
            for c, mbs in enumerate(per_col) if mbs]  # fmt: skip


def _verl(inst: Instance, d: int, cap: float) -> list[Column]:
    n = inst.layout.num_units // d
    s = inst.tokens
    work = (24576 * s + s * s).tolist()
    parts = karmarkar_karp(work, n, equal_size=len(s) >= n)
    count = max(int(np.ceil(s[q].sum() / cap)) for q in parts if q)
    per_col = []
    for q in parts:
        k = min(len(q), count)
        mbs = [[q[i] for i in b] for b in karmarkar_karp([work[i] for i in q], k, equal_size=False)]
        w = [sum(work[i] for i in mb) for mb in mbs]
        per_col.append([mbs[j] for j in small_at_both_ends(w)])
    return _cols(inst, d, per_col)


def _wlb(inst: Instance, d: int, cap: float) -> list[Column]:
    n = inst.layout.num_units // d
    a, tok = inst.additive(d), inst.tokens
    count = max(1, int(np.ceil(tok.sum() / cap / n)))
    outlier = tok > cap / 2
    mbs = [[] for _ in range(count * n)]
    load, room = [0.0] * len(mbs), [2.0 * cap] * len(mbs)
    order = [i for i in np.argsort(-a, kind="stable").tolist() if not outlier[i]]
    late = [i for i in np.argsort(-a, kind="stable").tolist() if outlier[i]]
    for i in order + late:  # regular documents first; outliers, delayed, into the last
        ks = [k for k in range(len(mbs)) if room[k] >= tok[i]] or [int(np.argmax(room))]
        k = min(ks, key=lambda k: (load[k], -k) if outlier[i] else (load[k], k))
        mbs[k].append(i)
        load[k] += a[i]
        room[k] -= tok[i]
    mbs = [mb for mb in mbs if mb]
    return _cols(inst, d, [mbs[c::n] for c in range(n)])


def _dynapipe(inst: Instance, d: int, cap: float) -> list[Column]:
    cols = lpt_columns(inst, d, consecutive(inst, d, cap))
    return [apply_order(c, best_named(c, inst, c.times(inst))[0]) for c in cols]


METHODS = {"pp_fixed": _fixed, "pp_verl": _verl, "pp_wlb": _wlb, "pp_dynapipe": _dynapipe}


def plan_pipeline_baseline(method: str, batch: Batch, cost: CostModel, *, pp: int = 4,
                           schedule: str = "1f1b", virtual_stages: int = 1,
                           max_tokens: int = 131072, degree: int | None = None,
                           tensor_parallel: int | None = None,
                           stage_layers: tuple[int, ...] | None = None):  # fmt: skip
    started = time.perf_counter()
    cost = pipeline_cost(cost, tensor_parallel)
    pipe = make_pipeline(cost, pp, schedule, virtual_stages)
    if stage_layers is not None:  # the user's split (default the parameter-balanced one)
        pipe = Pipeline(tuple(stage_layers), schedule, virtual_stages)
    lay = stage_layout(cost, pipe)
    inst = Instance(lay, batch)
    degrees = [degree] if degree else stage_cluster(lay).allowed_degrees
    for d in degrees:
        if lay.num_units % d:
            continue
        cols = METHODS[method](inst, d, float(max_tokens))
        if schedule == "interleaved" and any(len(c.mbs) % pp for c in cols):
            continue
        if all(fit_recompute(c, inst) for c in cols):
            return finish_pipeline(inst, [(c.makespan(inst), c) for c in cols], planner=method,
                                   started=started, stats={"degree": d})  # fmt: skip
    raise InfeasibleError(f"{method}: no degree in {list(degrees)} fits (p = {pp})")


def _planner(method: str):
    def plan(batch: Batch, cost: CostModel, *, pp: int = 4, schedule: str = "1f1b",
             virtual_stages: int = 1, tensor_parallel: int | None = None,
             max_tokens: int = 131072, degree: int | None = None,
             stage_layers: tuple[int, ...] | None = None):  # fmt: skip
        return plan_pipeline_baseline(method, batch, cost, pp=pp, schedule=schedule,
                                      virtual_stages=virtual_stages, max_tokens=max_tokens,
                                      degree=degree, tensor_parallel=tensor_parallel,
                                      stage_layers=stage_layers)  # fmt: skip

    plan.__name__ = plan.__qualname__ = f"plan_{method}"
    return plan


plan_pp_fixed = _planner("pp_fixed")
plan_pp_verl = _planner("pp_verl")
plan_pp_wlb = _planner("pp_wlb")
plan_pp_dynapipe = _planner("pp_dynapipe")
