"""`plan_greedy`: the best greedy draft that fits (the package docstring), then the
topology-blind and the tree candidates, and the SP kind of each group where cp or ring is
offered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from itertools import islice

from dcp_opt.solvers.bounds.rank_plan import tree_candidate
from dcp_opt.solvers.common import finish, gc_paused
from dcp_opt.solvers.greedy.align import align_domains, repack_groups
from dcp_opt.solvers.greedy.assign import safe_draft, to_phases, uniform_draft
from dcp_opt.solvers.greedy.blocks import search_blocks
from dcp_opt.solvers.greedy.instance import Draft, Instance, make_instance
from dcp_opt.solvers.greedy.local import improve
from dcp_opt.solvers.greedy.search import search
from dcp_opt.solvers.kinds import best_with_kinds

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.cost.settings import fits
from dcp_opt.plan import Group
from dcp_opt.result import PlanResult

# On a cluster with a topology, batches up to this many sequences also get the plan greedy
# makes for the cluster without it, priced on the fabric (_blind_candidate): greedy runs
# twice, so large batches (the 64 x 512 latency target) are left to the aware search alone.
BLIND_MAX_SEQUENCES = 400
# Under per-layer zero3, how many of the search's drafts simulate scores (_aligned_candidate)
DOMAIN_DRAFTS = 6


def candidates(inst: Instance, cluster, local: bool = True) -> Iterator[Draft]:
    """Drafts, best first: split into blocks on large clusters, else the full search.
    Lazy: the callers stop at the first draft that fits, so the safe draft behind the block
    plan (8192 one-sequence micro-batches at 1024 GPUs) is rarely built."""
    big = search_blocks(inst, cluster)
    if big is not None:
        yield big
        yield safe_draft(inst, cluster)
        return
    drafts = search(inst, cluster)
    if local:
        yield improve(inst, cluster, drafts[0])
    yield from drafts


def plan_greedy(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    time_limit_s: float | None = None,
    num_workers: int | None = None,
    deterministic: bool | None = None,
) -> PlanResult:
    """Best of the greedy candidates (see the module docstring). `seed`, `time_limit_s`,
    `num_workers` and `deterministic` are unused: the planner is deterministic, single-threaded
    and takes milliseconds; they are accepted (and checked by the registry) so that the
    searching planners' options can be passed to it too. Any other option is refused."""
    started = time.perf_counter()
    with gc_paused():
        phases, how = _first_fit(batch, cost)
        res = finish(
            phases, batch, cost, planner="greedy", started=started, stats={"candidate": how}
        )
        res = _blind_candidate(res, batch, cost, started)
        res = tree_candidate(res, batch, cost, started)  # few distinct sequences: exact
        res = _aligned_candidate(res, batch, cost, started)
        if len(cost.sp_kinds) == 1:
            return res
        # cp or ring allowed: kinds per group on this plan and on the Ulysses-only greedy's, the
        # faster kept (solvers/kinds.py: never slower than Ulysses-only greedy)
        alone = cost.with_(sp_kinds=("ulysses",))
        u_phases, u_how = _first_fit(batch, alone)
        u_res = finish(
            u_phases, batch, cost, planner="greedy", started=started, stats={"candidate": u_how}
        )
        return best_with_kinds([res, u_res], batch, cost, started=started)


def _blind_candidate(res: PlanResult, batch: Batch, cost: CostModel, started: float):
    """`res`, or the topology-blind greedy plan where that is faster on the fabric. The aware
    tables price a degree at its costliest placement (dcp_opt/table.py plan_table), so on
    some fabrics greedy's heuristic lands on a plan the blind one beats by a fraction of a
    per cent (issue 17: 0.4 % on 16-GPU leaves at 2:1); planning blind and pricing on the
    graph is a rule a user could apply, so it is a candidate. Its groups sit at multiples of
    their degree, placements on any fabric; a plan the fabric refuses is skipped."""
    cluster = cost.cluster
    if cluster.topology is None or len(batch) > BLIND_MAX_SEQUENCES:
        return res
    blind = cost.with_(cluster=cluster.with_(topology=None))
    phases, how = _first_fit(batch, blind)
    groups = [g for phase in phases for g in phase]
    now = time.perf_counter()
    if not all(
        g.degree in cluster.allowed_degrees and cluster.is_placement(g.start_rank, g.degree)
        for g in groups
    ):
        return replace(res, wall_time_s=now - started)  # the blind search counts too
    alt = finish(
        phases, batch, cost, planner="greedy", started=started,
        stats={"candidate": how, "topology_blind": True},
    )  # fmt: skip
    if alt.predicted_step_time_s < res.predicted_step_time_s:
        return alt
    return replace(res, wall_time_s=alt.wall_time_s)


def _aligned_candidate(res: PlanResult, batch: Batch, cost: CostModel, started: float):
    """Under per-layer zero3 (shard_domain > 0), where greedy's tables cannot see that the
    per-layer gathers hide behind a micro-step's compute: `res`, greedy's plan without the
    gathers, and the first DOMAIN_DRAFTS drafts of the search and every uniform layout, each also with its groups
    repacked (fewer, larger micro-batches) and then with counts evened inside the domains
    (align.py), scored by simulate; the fastest is kept."""
    if not cost.shard_domain:
        return res
    inst = make_instance(batch, cost)
    cluster = cost.cluster
    drafts = list(islice(candidates(inst, cluster, local=False), DOMAIN_DRAFTS))
    drafts += [uniform_draft(inst, cluster, j) for j in range(len(inst.degrees))]
    layouts = [[list(ph.groups) for ph in res.plan.phases]]
    # the plan greedy makes for the step-level schedule (no per-layer gathers), priced with
    # them: a rule a user could apply, so a candidate where the step-level states fit
    flat = cost.without_gathers()
    if fits(flat, max(s.num_tokens for s in batch.sequences)):
        layouts.append(_first_fit(batch, flat)[0])
    layouts += [p for p in (to_phases(d, inst, cost) for d in drafts if d) if p is not None]
    best = res
    for phases in layouts:
        packed = repack_groups(phases, batch, cost)
        for cand in (phases, packed, align_domains(packed, batch, cost.shard_domain)):
            alt = finish(cand, batch, cost, planner="greedy", started=started, stats=res.stats)
            if alt.predicted_step_time_s < best.predicted_step_time_s:
                best = replace(alt, stats={**alt.stats, "domain_candidate": True})
    return replace(best, wall_time_s=time.perf_counter() - started)


def _first_fit(batch: Batch, cost: CostModel) -> tuple[list[list[Group]], list]:
    """The groups of the best candidate that fits, and which candidate it was. A function
    of its own so that the instance and the drafts (thousands of lists) are freed before the
    collector resumes, instead of being walked by its first collection."""
    inst = make_instance(batch, cost)
    for draft in candidates(inst, cost.cluster):
        phases = to_phases(draft, inst, cost)
        if phases is not None:
            return phases, list(draft.how)
    raise AssertionError("the safe draft always fits")  # candidates() ends with it
