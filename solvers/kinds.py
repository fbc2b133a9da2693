"""Each group's SP kind (ulysses | cp | ring) for greedy and cpsat, when cost.sp_kinds offers
more than Ulysses.

A planner's groups come as Ulysses groups; `choose_kinds` then gives each group of degree > 1
the kind under which its micro-batches take the least time, each at the fewest recomputed
layers that fit under that kind (cp holds the gathered K/V: dcp_opt/cost/cp.py; ring its
buffers: dcp_opt/cost/ring.py). A group changes kind only when that is faster by more than
rounding, so no group's time grows; and the step time of a plan is non-decreasing in its
groups' times (a group starts when its ranks are free: max and + only, dcp_opt/simulate.py),
so the plan is never slower than its Ulysses-only self. `best_with_kinds` also keeps the
planner's Ulysses-only plan beside it, so choosing kinds never loses against Ulysses-only
planning either.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.plan import Group, MicroBatch

# another kind must win by more than this share: sums of the same terms in another order
# round apart
MARGIN = 1e-9


def choose_kinds(phases, batch: Batch, cost: CostModel) -> list[list[Group]]:
    """`phases` (lists of groups) with each group's kind chosen (module doc)."""
    if len(cost.sp_kinds) == 1:
        return [list(gs) for gs in phases]
    feats = cost.batch_features(batch)
    row = {s.id: k for k, s in enumerate(batch.sequences)}
    return [[_choose(g, feats, row, cost) for g in gs] for gs in phases]


def _choose(g: Group, feats, row, cost: CostModel) -> Group:
    if g.degree == 1 or not g.micro_batches or g.kind != "ulysses":
        return g
    f = np.array([feats[[row[s] for s in mb.sequence_ids]].sum(axis=0) for mb in g.micro_batches])
    tokens = f[:, -2]
    cap = cost.capacity(g.start_rank, g.degree)
    where = {
        "spans_nodes": cost.cluster.comm_class(g.start_rank, g.degree),
        "speed": cost.cluster.group_speed(g.start_rank, g.degree),
    }
    r_u = np.array([mb.recompute_layers for mb in g.micro_batches])
    best, best_t, best_r = "ulysses", float(np.sum(cost.time(f, g.degree, r_u, **where))), r_u
    for kind in cost.sp_kinds[1:]:  # in SP_KINDS order: cp before ring on a tie
        r = cost.min_recompute(tokens, g.degree, cap, kind=kind)
        if np.any(r < 0):
            continue  # some micro-batch does not fit under this kind
        t = float(np.sum(cost.time(f, g.degree, r, kind=kind, **where)))
        if t < best_t * (1 - MARGIN):
            best, best_t, best_r = kind, t, r
    if best == "ulysses":
        return g
    mbs = tuple(
        MicroBatch(mb.sequence_ids, int(r)) for mb, r in zip(g.micro_batches, best_r, strict=True)
    )
    return replace(g, micro_batches=mbs, kind=best)


def kind_shares(plan) -> dict[str, float]:
    """Share of the plan's group-slots (degree x micro-batches) per kind: what was chosen."""
    out: dict[str, float] = {}
    for ph in plan.phases:
        for g in ph.groups:
            out[g.kind] = out.get(g.kind, 0.0) + g.degree * len(g.micro_batches)
    total = sum(out.values()) or 1.0
    return {k: v / total for k, v in sorted(out.items())}


def best_with_kinds(results, batch: Batch, cost: CostModel, *, started: float):
    """The fastest of `results` (PlanResults of one planner for `batch`) after choose_kinds
    on each, first on ties; its stats record the chosen kinds' shares (kind_shares). The
    lower bound is the best of theirs (each holds for any plan of the batch)."""
    best = None
    for res in results:
        phases = choose_kinds([ph.groups for ph in res.plan.phases], batch, cost)
        new = finish(
            phases, batch, cost, planner=res.planner, started=started, status=res.status,
            message=res.message, stats=res.stats, normalizer_kind=res.plan.normalizer_kind,
        )  # fmt: skip
        if best is None or new.predicted_step_time_s < best.predicted_step_time_s:
            best = new
    bound = max(r.lower_bound_s for r in results)
    stats = {**best.stats, "sp_kind_shares": kind_shares(best.plan)}
    return replace(best, lower_bound_s=max(best.lower_bound_s, bound), stats=stats)
