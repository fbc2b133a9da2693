"""Greedy planner: degree, group layout, packing and recompute in milliseconds.

It is the CP-SAT planner's hint and fallback, so it must be fast, always valid, and good.

For a target makespan T (seconds of the busiest group, before the gradient sync):
1. degree: each sequence takes the degree of least GPU-work d * t(d) among those that finish
   within T (the efficiency / critical-path trade-off of FlexSP, Wang et al. 2025, sec. 4);
   a sequence no degree can finish within T takes its fastest degree;
2. layout: each degree gets groups in proportion to the group-seconds its sequences need
   (demand / T, rounded so the ranks add up to N), placed big degrees first on aligned rank
   ranges (buddy allocation), so no group straddles a node;
3. assignment: longest first (LPT, Graham 1969), each sequence goes to the least-loaded group
   of its degree if that meets T, else to whichever group finishes it earliest;
4. packing: sequences that fit without recompute share a micro-batch up to the token count
   that fits at r = 0, which saves the per-micro-batch constant (launches, all-to-all latency,
   embedding/loss overhead); a sequence that needs recompute alone runs alone at its r_min.
A second phase is tried for the sequences that need most of the cluster: they run one after
another on the widest group in phase 0, then every rank re-forms for the rest.
T is scanned on a grid above the lower bound and the best plan (exact loads) is kept.
Where a batch has few distinct sequences on a power-of-two cluster, the rank relaxation's
exact plan competes too (solvers/rank_plan.py tree_candidate: several phases, widest groups
first; milliseconds by solvers/tree_bound.py).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult

from . import greedy_level
from .common import finish, gc_paused
from .greedy_rules import RULE_NAMES, rules, spec_bound
from .greedy_steps import (  # noqa: F401 (re-exported: cpsat and tests import them here)
    Draft,
    Instance,
    layout,
    make_instance,
    place,
    preferred_degrees,
)
from .kinds import best_with_kinds
from .rank_plan import tree_candidate

# Targets tried, as multiples of the analytic bound's finish time: assignment that keeps
# each sequence on its preferred degree while it meets T, and earliest-finish assignment.
# 1.01 catches a long sequence whose efficient degree finishes just above the bound: at
# 1.0 it takes the widest group, at 1.03 shorter ones take degree 1 and the layout's
# rounding leaves no group for a mid-size one (doubling memory made the plan 3 % slower:
# tests/test_properties.py test_greedy_more_memory_pinned). Batches over FAST_N try 1.0.
GRID_PREF = (1.0, 1.01, 1.03)
GRID_EFT = (1.0,)
REFINE = (0.97, 0.99)  # then targets just under the best finish so far
FAST_N = 300  # above this many sequences: one target, one refinement, the uniform layouts
UNIFORM_FIRST = 0.01  # see _uniform_first
# Above FAST_N, once the best is within this share of the analytic bound, the candidates
# still to come (uniform layouts after the grid, refinement) are skipped: they can gain at
# most that much, and on the standard workloads (64-128 GPUs, 320-1024 sequences) they
# gained 0.05 % median (0.6 % at most) for one to two assignment passes.
CLOSE_ENOUGH = 0.02
# On a cluster with a topology, batches up to this many sequences also get the plan greedy
# makes for the cluster without it, priced on the fabric (_blind_candidate): greedy runs
# twice, so large batches (the 64 x 512 latency target) are left to the aware search alone.
BLIND_MAX_SEQUENCES = 400

# ---- steps 3 and 4: assignment and packing ---------------------------------------------


class _Groups:
    """Loads, micro-batches ("bins" of [indices, r]) and the open packable bin per group."""

    def __init__(self, inst, placed, speeds, cap0, base):
        self.inst = inst
        self.deg = [j for _, j in placed]
        # base: when the group starts (phase 0's length), one for all or one per group
        self.load = [float(b) for b in base] if np.ndim(base) else [float(base)] * len(placed)
        self.speeds = np.asarray(speeds, dtype=float).tolist()
        self.cap0 = np.asarray(cap0, dtype=float).tolist()
        self.bins: list[list[list]] = [[] for _ in placed]
        self.open_tok = [-1.0] * len(placed)  # tokens of the open bin; -1 = none
        self.open_idx = [-1] * len(placed)

    def one_by_one(
        self, order: np.ndarray, pref: np.ndarray, target: float, eft: bool, cutoff: float
    ) -> bool:
        """LPT with earliest finish: the least-loaded group of the preferred degree if it
        meets the target, else the group (of any degree) that finishes the sequence first.
        (`eft` is accepted for the callers; every sequence takes the same rule.) False once
        a group would finish at or after `cutoff`: loads only grow, so the draft could not
        beat the plan that set it, and the rest of the pass is skipped.
        One Python loop over plain lists: this is the greedy planner's hot path."""
        inf = float("inf")
        heaps: dict[int, list] = {}
        for g, j in enumerate(self.deg):
            heaps.setdefault(j, []).append((self.load[g], g))
        for h in heaps.values():
            heapq.heapify(h)
        every = sorted(heaps.items())  # (degree index, its heap)
        load, open_tok, open_idx, bins = self.load, self.open_tok, self.open_idx, self.bins
        cap0, speeds = self.cap0, self.speeds
        const = self.inst.const.tolist()
        all_t, all_r, all_tok = self.inst.lists()
        prefs = pref.tolist()
        replace = heapq.heapreplace
        get = heaps.get
        for i in order.tolist():
            t_row, r_row, p, tok = all_t[i], all_r[i], prefs[i], all_tok[i]
            fin = None
            hp = get(p)
            if hp is not None:
                j = p
                g = hp[0][1]
                ot = open_tok[g]
                packs = r_row[p] == 0 and ot >= 0 and ot + tok <= cap0[g]
                fin = load[g] + (t_row[p] - const[p] if packs else t_row[p]) / speeds[g]
            if fin is None or fin > target:
                for jj, h in every:
                    tj = t_row[jj]
                    if tj == inf or jj == p:  # p was evaluated above
                        continue
                    gg = h[0][1]
                    ot = open_tok[gg]
                    pk = r_row[jj] == 0 and ot >= 0 and ot + tok <= cap0[gg]
                    f = load[gg] + (tj - const[jj] if pk else tj) / speeds[gg]
                    if fin is None or f < fin:
                        fin, j, g, packs = f, jj, gg, pk
            if fin is None or fin >= cutoff:
                return False
            if packs:  # into the group's open bin: the per-micro-batch constant is shared
                bins[g][open_idx[g]][0].append(i)
                open_tok[g] += tok
            else:
                r = r_row[j]
                bins[g].append([[i], r])
                if r == 0:  # a bin without recompute is open for packing
                    open_tok[g], open_idx[g] = tok, len(bins[g]) - 1
            load[g] = fin
            replace(heaps[j], (fin, g))
        return True


def present_pref(inst: Instance, pref: np.ndarray, present: set, target: float) -> np.ndarray:
    """A preferred degree the layout lacks becomes the least-work present one that meets the
    target (else the fastest present one), so the longest-first order sees real times."""
    have = np.zeros(len(inst.degrees), dtype=bool)
    have[list(present)] = True
    if have[pref].all():
        return pref
    return np.where(have[pref], pref, preferred_degrees(inst, target, have))


def assign(inst, items, pref, placed, target, speeds, cap0, base=0.0, eft=False, *, cutoff=np.inf):
    """Longest first into the placed groups. Returns (bins per group, loads), or None if a
    sequence fits no group or a group would finish at or after `cutoff`."""
    st = _Groups(inst, placed, speeds, cap0, base)
    pref = present_pref(inst, pref, {j for _, j in placed}, target)
    tp = inst.time[items, pref[items]]
    order = items[np.argsort(-tp, kind="stable")]
    if not st.one_by_one(order, pref, target, eft, cutoff):
        return None
    return st.bins, st.load  # bins as [indices, r] lists (unpacked like tuples)


# ---- driver ---------------------------------------------------------------------------
def spec_for(inst: Instance, cluster, target: float, two_phase: bool):
    """(phase0, base, items, pref, placed) of a candidate for makespan `target`, or None."""
    n, dmax = len(inst.ids), len(inst.degrees) - 1
    items = np.arange(n)
    phase0: list = []
    base = 0.0
    if two_phase:
        # Sequences that only a group wider than half the cluster finishes within T
        # (checked first: most batches have none, and then there is no candidate).
        huge = np.flatnonzero(_narrow_time(inst) > target)
        if len(huge) == 0 or not np.isfinite(inst.time[huge, dmax]).all():
            return None
        start = _widest_start(cluster, int(inst.degrees[dmax]))
        phase0 = [(start, dmax, [([int(i)], int(inst.r_min[i, dmax])) for i in huge])]
        base = float(inst.time[huge, dmax].sum())
        items = np.setdiff1d(items, huge)
    rest = max(target - base, 1e-9)
    pref = preferred_degrees(inst, rest, inst.usable)
    placed = place(layout(inst, items, pref, rest, inst.num_gpus), inst, cluster)
    return phase0, base, items, pref, placed


def _narrow_time(inst: Instance) -> np.ndarray:
    """(n,) fastest time of each sequence on a group of at most half the cluster."""

    def make():
        narrow = inst.degrees <= inst.num_gpus // 2
        return np.where(narrow[None, :], inst.time, np.inf).min(axis=1)

    return inst.memo("narrow", make)


def draft_for(
    inst: Instance,
    cluster,
    target: float,
    two_phase: bool,
    eft: bool = False,
    spec=None,
    *,
    cutoff: float = np.inf,
) -> Draft | None:
    """One candidate plan for target makespan `target` (eft: every sequence to the group
    that finishes it first, ignoring the preferred degree); None if it cannot finish before
    `cutoff`."""
    spec = spec or spec_for(inst, cluster, target, two_phase)
    if spec is None:
        return None
    phase0, base, items, pref, placed = spec
    if len(items) == 0:
        return Draft(phase0, [], base)
    return _assign_draft(
        inst, cluster, items, pref, placed, target, phase0, base, eft, cutoff=cutoff
    )


def _widest_start(cluster, d: int) -> int:
    """The placement of a degree-d group with the most memory (all equal when homogeneous)."""
    return max(cluster.placements(d), key=lambda s: (cluster.group_memory(s, d), -s))


def _assign_draft(
    inst, cluster, items, pref, placed, target, phase0, base, eft=False, *, cutoff=np.inf
) -> Draft | None:
    if not placed:
        return None
    if cluster.speed_factors is None:  # every group at full speed
        speeds = np.ones(len(placed))
    else:
        speeds = np.array([cluster.group_speed(s, int(inst.degrees[j])) for s, j in placed])
    cap0 = _group_cap0(inst, cluster, placed)
    out = assign(inst, items, pref, placed, target, speeds, cap0, base, eft, cutoff=cutoff)
    if out is None:
        return None
    bins, load = out
    groups = [(s, j, bs) for (s, j), bs in zip(placed, bins, strict=False) if bs]
    return Draft(phase0, groups, max(load))


def _group_cap0(inst, cluster, placed) -> list[float]:
    if cluster.memory_per_rank is None:
        cap0 = inst.cap0.tolist()
        return [cap0[j] for _, j in placed]
    top = max(cluster.memory_per_rank)
    return [
        float(inst.cap0[j]) * cluster.group_memory(s, int(inst.degrees[j])) / top for s, j in placed
    ]


def safe_draft(inst: Instance, cluster) -> Draft:
    """Every sequence alone, one after another, on the widest group: always fits."""
    dmax = len(inst.degrees) - 1
    start = _widest_start(cluster, int(inst.degrees[dmax]))
    bins = [([i], r) for i, r in enumerate(inst.r_min[:, dmax].tolist())]
    return Draft([], [(start, dmax, bins)], safe_finish(inst))


def safe_finish(inst: Instance) -> float:
    return float(inst.time[:, -1].sum())


def to_phases(draft: Draft, inst: Instance, cost: CostModel) -> list[list[Group]] | None:
    """Index lists -> Groups; None if a micro-batch does not fit its group's memory."""
    phases = []
    hetero = cost.cluster.memory_per_rank is not None
    ids = inst.ids.tolist()
    for part in (draft.phase0, draft.groups):
        groups = []
        for start, j, bins in part:
            d = int(inst.degrees[j])
            mbs = []
            for idx, r in bins:
                if hetero:
                    cap = cost.capacity(start, d)
                    need = int(cost.min_recompute(float(inst.tokens[idx].sum()), d, cap))
                    if need < 0:
                        return None
                    r = max(r, need)
                mbs.append(MicroBatch(tuple([ids[i] for i in idx]), int(r)))
            groups.append(Group(start, d, tuple(mbs)))
        if groups:
            phases.append(groups)
    return phases


def uniform_draft(inst: Instance, cluster, j: int, *, cutoff: float = np.inf) -> Draft | None:
    """Every group of degree j (a sequence that does not fit there picks another group)."""
    d = int(inst.degrees[j])
    if not inst.usable[j]:
        return None
    placed = place([j] * (inst.num_gpus // d), inst, cluster)
    pref = np.full(len(inst.ids), j)
    items = np.arange(len(inst.ids))
    # Target inf: with one degree the preferred group is always the earliest finish, so
    # no sequence needs the fallback scan.
    return _assign_draft(inst, cluster, items, pref, placed, np.inf, [], 0.0, cutoff=cutoff)


def uniform_bounds(inst: Instance) -> np.ndarray:
    """(D,) lower bounds on the finish of uniform_draft(j): packed work over N, longest
    sequence; 0 where some sequence does not fit (it goes elsewhere: no cheap bound)."""
    t = inst.time
    work = (t - inst.const[None, :]).sum(axis=0) * inst.degrees / inst.num_gpus
    return np.where(np.isfinite(t).all(axis=0), np.maximum(work, t.max(axis=0)), 0.0)


class _Kept:
    """The drafts made so far, each with its rank in the canonical candidate order (safe
    draft, grid, uniform layouts, refinements), and the best of them.
    Only the best draft is used where every group has the same memory (to_phases then
    accepts every draft), so there a candidate stops as soon as it cannot beat the best so
    far ("prune"), and the safe draft (one micro-batch per sequence) is built only if it
    is the best. Ties go to the lower rank, as when the candidates ran in canonical order,
    so the order they run in changes the work, not the result."""

    def __init__(self, inst: Instance, cluster):
        self.prune = cluster.memory_per_rank is None
        self.safe_s = safe_finish(inst)
        self.drafts = [] if self.prune else [((0,), safe_draft(inst, cluster))]
        self.best, self.best_rank = self.safe_s, (0,)

    def cutoff(self, rank: tuple) -> float:
        if not self.prune:
            return np.inf
        # A candidate ranked before the best wins a tie: it stops only above the best.
        return self.best if rank > self.best_rank else float(np.nextafter(self.best, np.inf))

    def keep(self, d: Draft | None, how: tuple, rank: tuple) -> None:
        if d is None:
            return
        d.how = how
        self.drafts.append((rank, d))
        if (d.finish_s, rank) < (self.best, self.best_rank):
            self.best, self.best_rank = d.finish_s, rank

    def sorted(self, inst: Instance, cluster) -> list[Draft]:
        if self.prune and self.safe_s <= self.best:
            self.drafts.append(((0,), safe_draft(inst, cluster)))
        return [d for _, d in sorted(self.drafts, key=lambda x: (x[1].finish_s, x[0]))]


def search(inst: Instance, cluster) -> list[Draft]:
    """Candidate drafts, best (lowest finish) first. The grids are where the standard
    workloads' winners fell (targets as multiples of the bound's finish); a uniform layout
    whose cheap bound cannot beat the best so far is skipped, and so is everything after
    the grid for a large batch whose best is already CLOSE_ENOUGH to the bound."""
    kept = _Kept(inst, cluster)
    big = len(inst.ids) > FAST_N  # many sequences balance well: fewer candidates
    grid_pref, grid_eft, refine = (
        (GRID_PREF[:1], (), REFINE[-1:]) if big else (GRID_PREF, GRID_EFT, REFINE)
    )
    grid = [(f, False) for f in grid_pref] + [(f, True) for f in grid_eft]
    bounds = uniform_bounds(inst)

    def close() -> bool:
        return big and kept.best <= inst.finish_lb * (1 + CLOSE_ENOUGH)

    if _uniform_first(inst, cluster, bounds):
        _uniform_stage(inst, cluster, kept, bounds)
        # A large batch refines the uniform plan instead of trying the grid: there the grid
        # never won on the standard workloads (2d-balanced, 1d-long, 2d-long; 64-128 GPUs,
        # 320-1024 sequences: 0.000 % median and max without it).
        if not (big and kept.best < kept.safe_s):
            _grid_stage(inst, cluster, kept, grid)
    else:
        _grid_stage(inst, cluster, kept, grid)
        if not close():
            _uniform_stage(inst, cluster, kept, bounds)
    _rule_stage(inst, cluster, kept)
    _level_stage(inst, cluster, kept)
    # Refine: aim just under the best finish found (the grid is anchored on the bound, which
    # can sit far below what any plan reaches).
    for k, f in enumerate(() if close() else refine):
        f_abs = kept.best * f / inst.finish_lb
        rank = (3, k)
        d = draft_for(inst, cluster, inst.finish_lb * f_abs, False, cutoff=kept.cutoff(rank))
        kept.keep(d, ("target", f_abs, False, False), rank)
    return kept.sorted(inst, cluster)


def _uniform_first(inst: Instance, cluster, bounds: np.ndarray) -> bool:
    """Run the uniform layouts before the grid where one of them is likely to win, so the
    grid's candidates stop early: where the best uniform layout's bound sits within
    UNIFORM_FIRST of the analytic bound (the 2D workloads; the 1D ones sit 1.4-2% above
    and are won by the grid). Only on homogeneous clusters, where the uniform bound is a
    bound (equal speeds): a uniform layout run early that canonical order would have
    skipped then cannot beat the grid."""
    valid = bounds[bounds > 0]
    return (
        cluster.homogeneous
        and len(valid) > 0
        and float(valid.min()) <= inst.finish_lb * (1 + UNIFORM_FIRST)
    )


def _grid_stage(inst: Instance, cluster, kept: _Kept, grid: list) -> None:
    seen: set = set()
    for k, (f, eft) in enumerate(grid):
        for two in (False, True):
            spec = spec_for(inst, cluster, inst.finish_lb * f, two)
            if spec is None:
                continue
            phase0, _, _, pref, placed = spec
            key = (tuple(placed), pref.tobytes(), len(phase0), f if not eft else -1.0)
            if key in seen:
                continue
            seen.add(key)
            rank = (1, k, two)
            cut = kept.cutoff(rank)
            d = draft_for(inst, cluster, inst.finish_lb * f, two, eft, spec, cutoff=cut)
            kept.keep(d, ("target", f, two, eft), rank)


def _uniform_stage(inst: Instance, cluster, kept: _Kept, bounds: np.ndarray) -> None:
    for k, j in enumerate(np.argsort(bounds, kind="stable").tolist()):
        if bounds[j] < kept.best:
            rank = (2, k)
            d = uniform_draft(inst, cluster, j, cutoff=kept.cutoff(rank))
            kept.keep(d, ("uniform", j), rank)


def _rule_stage(inst: Instance, cluster, kept: _Kept) -> None:
    """The simple-rule layouts (solvers/greedy_rules.py), each unless its bound cannot beat
    the best so far: so the plan is never slower than a rule a user could write down."""
    for k, (how, lb, build) in enumerate(rules(inst, cluster)):
        if lb < kept.best:
            spec = build()
            if spec_bound(inst, cluster, spec) < kept.best:  # its own groups' degrees
                rank = (2.5, k)
                kept.keep(rule_draft(inst, cluster, spec, cutoff=kept.cutoff(rank)), how, rank)


def _level_stage(inst: Instance, cluster, kept: _Kept) -> None:
    """Overflow-first candidates (solvers/greedy_level.py) where the best is far from the
    bound: a coarse packing levelled by running what does not fit first, wide."""
    for k, (how, build) in enumerate(greedy_level.specs(inst, cluster, kept.best)):
        spec = build()  # a spec for rule_draft, or the split's own draft
        if spec is not None:
            rank = (2.7, k)
            if not isinstance(spec, Draft):
                spec = rule_draft(inst, cluster, spec, cutoff=kept.cutoff(rank))
            kept.keep(spec, how, rank)


def rule_draft(inst: Instance, cluster, spec, *, cutoff: float = np.inf) -> Draft | None:
    """The draft of one rule (greedy_rules.rules: `spec` = its build()); None if it cannot
    finish before `cutoff` (or a sequence fits none of its groups)."""
    phase0, base, pref, placed = spec
    items = np.flatnonzero(pref >= 0)
    if len(items) == 0:
        return Draft(phase0, [], float(np.max(base, initial=0.0)))
    return _assign_draft(
        inst, cluster, items, pref, placed, inst.finish_lb, phase0, base, True, cutoff=cutoff
    )


def replay(inst: Instance, cluster, how: tuple) -> Draft | None:
    """The candidate `how` (a Draft.how) on another instance."""
    if how[0] in RULE_NAMES:
        rule = next((r for r in rules(inst, cluster) if r[0] == how), None)
        return None if rule is None else rule_draft(inst, cluster, rule[2]())
    if how[0] in ("overflow-first", "long-then"):
        spec = greedy_level.rebuild(inst, cluster, how)
        if spec is None or isinstance(spec, Draft):
            return spec
        return rule_draft(inst, cluster, spec)
    if how[0] == "uniform":
        return uniform_draft(inst, cluster, how[1])
    if how[0] == "target":
        _, f, two, eft = how
        return draft_for(inst, cluster, inst.finish_lb * f, two, eft)
    return safe_draft(inst, cluster)


def candidates(inst: Instance, cluster, local: bool = True) -> Iterator[Draft]:
    """Drafts, best first: split into blocks on large clusters, else the full search.
    Lazy: the callers stop at the first draft that fits, so the safe draft behind the block
    plan (8192 one-sequence micro-batches at 1024 GPUs) is rarely built."""
    from .greedy_blocks import search_blocks  # noqa: PLC0415 (both import this module)
    from .greedy_local import improve  # noqa: PLC0415

    big = search_blocks(inst, cluster)
    if big is not None:
        yield big
        yield safe_draft(inst, cluster)
        return
    drafts = search(inst, cluster)
    if local:
        yield improve(inst, cluster, drafts[0])
    yield from drafts


def plan_greedy(batch: Batch, cost: CostModel, *, seed: int = 0, **opts) -> PlanResult:
    """Best of the greedy candidates (see the module docstring). `seed` is unused: the
    planner is deterministic; it is accepted so that every planner shares one signature."""
    started = time.perf_counter()
    with gc_paused():
        phases, how = _first_fit(batch, cost)
        res = finish(
            phases, batch, cost, planner="greedy", started=started, stats={"candidate": how}
        )
        res = _blind_candidate(res, batch, cost, started)
        res = tree_candidate(res, batch, cost, started)  # few distinct sequences: exact
        if "cp" not in cost.sp_kinds:
            return res
        # cp allowed: kinds per group on this plan and on the Ulysses-only greedy's, the
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
