"""A plan from the rank-assignment relaxation (solvers/bounds/rank.py rank_milp): for benchmarks,
and, where solvers/bounds/tree.py solves it in milliseconds, a candidate of the planners
(tree_candidate).

Each group of the relaxation's solution runs in a phase of its degree, widest first; a
sequence that needs recomputed layers runs alone at its fewest, the others are packed while
the micro-batch fits without recompute. Members
of an aligned group were members of the same wider groups before it, so they are free at the
same moment and no rank waits: the plan's finish is the relaxation's plus the micro-batch
constants beyond the one per rank it counts. So a valid plan close to the certified bound
(bench_robust's explain) shows that a gap left to a planner is the planner's, not the
bound's. HiGHS on the full integer program takes seconds, not a step's budget; the
recursion takes milliseconds where it applies.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
from dcp_opt.solvers.bounds import tree as tree_bound
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.bounds.rank import rank_milp, tree_solution
from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult
from dcp_opt.validate import InvalidPlanError

CANDIDATE_PAIRS = 1 << 15  # tree_candidate: the recursion's pairs a level (~ms)
CANDIDATE_MIN_GAP = 0.01


def rank_plan(
    batch: Batch,
    cost: CostModel,
    *,
    time_limit_s: float = 10.0,
    milp: bool = True,
    max_pairs: int = tree_bound.MAX_PAIRS,
    planner: str = "rank-plan",
    started: float | None = None,
) -> PlanResult | None:
    """The relaxation's best solution within `time_limit_s` as a plan (exact and in
    milliseconds where solvers/bounds/tree.py applies with at most `max_pairs` pairs; else
    HiGHS unless `milp` is False); None if none was found or it is not a valid plan (a
    sequence that fits the relaxation's best-capacity placement but not this one's
    memory)."""
    started = time.perf_counter() if started is None else started
    nodes = _tree_nodes(batch, cost, max_pairs)
    if nodes is None and milp:
        nodes = _milp_nodes(batch, cost, time_limit_s)
    if nodes is None:
        return None
    by_degree: dict[int, list[Group]] = {}
    for start, d, idx in nodes:
        group = _group(batch, cost, list(idx), d, start)
        if group is None:
            return None
        by_degree.setdefault(d, []).append(group)
    phases = [by_degree[d] for d in sorted(by_degree, reverse=True)]
    try:
        return finish(phases, batch, cost, planner=planner, started=started)
    except InvalidPlanError:
        return None


def tree_candidate(res: PlanResult, batch: Batch, cost: CostModel, started: float) -> PlanResult:
    """`res`, or the relaxation's exact plan where that is faster: a planner's candidate
    for batches of few distinct sequences (2d-long's 2M-token steps: five 432,000-token
    videos on 32 GPUs, one of them first at degree 32 with the short ones packed beside it,
    then four at degree 8). Tried only where solvers/bounds/tree.py solves it within
    CANDIDATE_PAIRS pairs (a few ms) and `res` is over CANDIDATE_MIN_GAP above its bound."""
    if res.plan is None or res.predicted_step_time_s <= res.lower_bound_s * (1 + CANDIDATE_MIN_GAP):
        return res
    alt = rank_plan(
        batch, cost, milp=False, max_pairs=CANDIDATE_PAIRS, planner=res.planner, started=started
    )
    if alt is None or alt.predicted_step_time_s >= res.predicted_step_time_s:
        return replace(res, wall_time_s=time.perf_counter() - started)  # the try counts too
    # "optimal" is a claim within a planner's own model: a plan from outside it is feasible
    status = "feasible" if res.status == "optimal" else res.status
    # res's stats say how its plan was found (greedy's candidate, topology_blind): not this one
    return replace(alt, status=status, stats={"candidate": ["rank-tree"]})


def _tree_nodes(batch: Batch, cost: CostModel, max_pairs: int):
    tree = tree_solution(batch, cost, max_pairs)
    return None if tree is None else list(tree[0].groups)


def _milp_nodes(batch: Batch, cost: CostModel, time_limit_s: float):
    """(start, degree, sequence indices) of the MILP's best solution, or None."""
    sync = cost.grad_sync_time()
    t0 = lp_bound(batch, cost, time_limit_s=0.3).value_s - sync
    res, _, cls, pos = rank_milp(batch, cost, t0, time_limit_s, 0.0)
    if res.x is None:
        return None
    y = np.rint(res.x[: len(cls) * len(pos)]).reshape(len(cls), len(pos)).astype(int)
    members: dict[int, list[int]] = {}
    for k, seqs in enumerate(cls):
        left = iter(seqs)
        for p in np.flatnonzero(y[k]).tolist():
            members.setdefault(p, []).extend(next(left) for _ in range(y[k, p]))
    return [(pos[p][2], pos[p][1], tuple(idx)) for p, idx in members.items()]


def _group(batch: Batch, cost: CostModel, idx: list[int], d: int, start: int) -> Group | None:
    """The group's micro-batches: a sequence that needs recomputed layers alone at its
    fewest; the others packed, longest first, while the micro-batch fits without recompute
    (one constant for all of them, as the greedy packs)."""
    cap = cost.capacity(start, d)
    seqs = sorted((batch.sequences[i] for i in idx), key=lambda s: -s.num_tokens)
    mbs, packed, tokens = [], [], 0.0
    for s in seqs:
        r = int(cost.min_recompute(float(s.num_tokens), d, cap))
        if r < 0:
            return None
        if r > 0:
            mbs.append(MicroBatch((s.id,), r))
        elif packed and cost.min_recompute(tokens + s.num_tokens, d, cap) == 0:
            packed.append(s.id)
            tokens += s.num_tokens
        else:
            if packed:
                mbs.append(MicroBatch(tuple(packed), 0))
            packed, tokens = [s.id], float(s.num_tokens)
    if packed:
        mbs.append(MicroBatch(tuple(packed), 0))
    return Group(start, d, tuple(mbs))
