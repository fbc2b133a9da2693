"""The greedy planner's candidate search: targets on a grid above the bound, the uniform
layouts, the rules and the overflow-first splits, then refinements; every draft kept with
its rank in the canonical order, best first."""

from __future__ import annotations

import numpy as np
from dcp_opt.solvers.greedy import level as greedy_level
from dcp_opt.solvers.greedy.assign import (
    draft_for,
    rule_draft,
    safe_draft,
    safe_finish,
    spec_for,
    uniform_bounds,
    uniform_draft,
)
from dcp_opt.solvers.greedy.instance import Draft, Instance
from dcp_opt.solvers.greedy.rules import RULE_NAMES, rules, spec_bound

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
    """The simple-rule layouts (solvers/greedy/rules.py), each unless its bound cannot beat
    the best so far: so the plan is never slower than a rule a user could write down."""
    for k, (how, lb, build) in enumerate(rules(inst, cluster)):
        if lb < kept.best:
            spec = build()
            if spec_bound(inst, cluster, spec) < kept.best:  # its own groups' degrees
                rank = (2.5, k)
                kept.keep(rule_draft(inst, cluster, spec, cutoff=kept.cutoff(rank)), how, rank)


def _level_stage(inst: Instance, cluster, kept: _Kept) -> None:
    """Overflow-first candidates (solvers/greedy/level.py) where the best is far from the
    bound: a coarse packing levelled by running what does not fit first, wide."""
    for k, (how, build) in enumerate(greedy_level.specs(inst, cluster, kept.best)):
        spec = build()  # a spec for rule_draft, or the split's own draft
        if spec is not None:
            rank = (2.7, k)
            if not isinstance(spec, Draft):
                spec = rule_draft(inst, cluster, spec, cutoff=kept.cutoff(rank))
            kept.keep(spec, how, rank)


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
