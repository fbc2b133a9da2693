"""Simple-rule candidates of the greedy planner: layouts a user could write down.

The greedy's own candidates choose degrees by least GPU-work per sequence; under a measured
cost model that is not the preset (SP overhead per degree, replicated per-sample work) that
choice can miss a plain layout, e.g. the one long video on the smallest group it fits and
every image at degree 1 (issue 19: 39 s against 63 s). So for every degree j that some
sequence fits at (the "base" degree), with T the analytic bound's finish:
- static(j): every group of degree j (assign.uniform_draft, in search.search);
- fit-smallest(j): sequences that do not fit at j go to the smallest degree they fit (one
  group per T of their time there, one per sequence longer than T/2, at least one), every
  other rank forms degree-j groups;
- long-smallest(j): sequences that do not fit at j or take longer than T there go to the
  smallest degree that finishes them within T; the rest at j, groups as above;
- long-first(j): the same long sequences run first, one after another on the widest group
  (phase 0, as CP-SAT's model has it), then every rank re-forms into degree-j groups;
- longest-first(m), m = 1..4: the m longest sequences first on the widest group, then the
  greedy's own degrees and layout for the rest within what is left of T;
- longest-smallest(m, j): the m longest first, then long-smallest(j) for the rest within
  what is left of T.
Each is assigned longest first with the greedy's packing; a sequence whose preferred group
would finish after T goes to the group that finishes it first (greedy.assign).
A rule runs unless its lower bound (the packed work of its groups' degrees over the ranks,
or its longest sequence, plus phase 0) cannot beat the best draft so far: the bound holds
for any assignment to those groups at full speed, so it is used on homogeneous clusters
only, and a rule is then skipped only where it could not have won.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from dcp_opt.solvers.greedy.assign import rule_draft, to_phases, uniform_draft, widest_start
from dcp_opt.solvers.greedy.instance import (
    Instance,
    layout,
    make_instance,
    place,
    preferred_degrees,
)

TOP_FIRST = 4  # longest-first(m) for m = 1..TOP_FIRST
RULE_NAMES = ("fit-smallest", "long-smallest", "long-first", "longest-first", "longest-smallest")


def rules(inst: Instance, cluster) -> list[tuple[tuple, float, Callable[[], tuple]]]:
    """(how, lower bound, build) of every rule; build() gives (phase0, base, pref, placed),
    made only for the rules that run (greedy._rule_stage). `pref` covers every sequence;
    the phase-0 sequences of long-first and longest-first have pref -1."""
    t = inst.time
    fits, minfit, smallest, long_all = inst.memo("rule_tables", lambda: _tables(inst))
    lb_fit, lb_long = inst.memo("rule_bounds", lambda: _stay_bounds(inst, cluster))
    dmax = len(inst.degrees) - 1
    n_misfit, n_long = (~fits).sum(axis=0).tolist(), long_all.sum(axis=0).tolist()
    out = []
    for j in np.flatnonzero(inst.usable).tolist():
        if not n_long[j]:  # nothing moves: static(j), the uniform layout, covers it
            continue
        if n_misfit[j] and n_misfit[j] < n_long[j]:  # (equal counts: the same sets)
            moved = ~fits[:, j]
            out.append((("fit-smallest", j), lb_fit[j], _single(inst, cluster, moved, minfit, j)))
        long = long_all[:, j]
        out.append((("long-smallest", j), lb_long[j], _single(inst, cluster, long, smallest, j)))
        if n_long[j] < len(long) and fits[long, dmax].all():
            base = float(t[long, dmax].sum())
            lb = base + _bound(inst, cluster, [j], np.flatnonzero(~long))
            out.append((("long-first", j), lb, _long_first(inst, cluster, j, long, dmax, base)))
    return out + _longest_first(inst, cluster, dmax)


def _stay_bounds(inst: Instance, cluster) -> tuple[np.ndarray, np.ndarray]:
    """(D,) bounds of fit-smallest(j) and long-smallest(j) for every j at once: the
    sequences that stay run at j, the moved ones at their best degree (packed work over the
    ranks, or the longest); 0 where groups may run at other speeds."""
    if not cluster.homogeneous:
        z = np.zeros(len(inst.degrees))
        return z, z
    w = _work_table(inst)
    t = inst.time
    best_w, best_t = w.min(axis=1)[:, None], t.min(axis=1)[:, None]
    fits, _, _, long_all = inst.memo("rule_tables", lambda: _tables(inst))
    out = []
    for stay in (fits, ~long_all):
        work = np.where(stay, w, best_w).sum(axis=0)
        longest = np.where(stay, t, best_t).max(axis=0)
        out.append(np.maximum(work / inst.num_gpus, longest))
    return out[0], out[1]


def _longest_first(inst: Instance, cluster, dmax: int) -> list:
    """longest-first(m), m = 1..TOP_FIRST: the m sequences of longest fastest time one after
    another on the widest group, then the rest laid out by the greedy's own steps 1-2 for
    the time left to the bound (a group of the size it needs for the longest ones' peers)."""
    t = inst.time
    fastest = t.min(axis=1)  # every degree is usable by some sequence or inf for all
    order = np.argsort(-fastest, kind="stable")
    # the rest's bound (_bound over every degree) without a pass per m: the least packed
    # work of each sequence, summed once, less the m taken out; the longest left is the m-th
    work = _work_table(inst).min(axis=1)
    total = float(work.sum())
    homogeneous = cluster.homogeneous
    out, base = [], 0.0
    for m in range(1, min(TOP_FIRST, len(order) - 1) + 1):
        i = order[m - 1]
        base += float(t[i, dmax])
        total -= float(work[i])
        if not base < inst.finish_lb:  # also stops at a sequence that does not fit at dmax
            break
        rest = max(total / inst.num_gpus, float(fastest[order[m]])) if homogeneous else 0.0
        top = np.zeros(len(order), dtype=bool)
        top[order[:m]] = True
        out.append((("longest-first", m), base + rest, _top_first(inst, cluster, top, dmax, base)))
        out += _top_then_rule(inst, cluster, top, dmax, base, base + rest)
    return out


def _top_then_rule(inst: Instance, cluster, top, dmax: int, base: float, lb: float) -> list:
    """longest-smallest(m, j): the m longest first on the widest group, then for the rest
    long-smallest(j) within the time left (T - phase 0): every sequence that takes longer
    than that at j on the smallest degree that finishes it in time, the others at j.
    `lb` (longest-first(m)'s bound, over every degree) bounds these too, so nothing is
    computed unless one runs (the preferences are made once per m, on first use)."""
    memo: dict = {}

    def smallest():
        if not memo:
            t = inst.time
            within = (t <= inst.finish_lb - base) | (t <= t.min(axis=1)[:, None])
            memo["v"] = within, np.argmax(within, axis=1)  # else the fastest degree
        return memo["v"]

    def build(j: int):

        within, small = smallest()
        pref = np.where(top, -1, np.where(within[:, j], j, small))
        start = widest_start(cluster, int(inst.degrees[dmax]))
        bins = [([i], int(inst.r_min[i, dmax])) for i in np.flatnonzero(top).tolist()]
        return [(start, dmax, bins)], base, pref, _layout(inst, cluster, pref, j)

    m = int(top.sum())
    return [
        (("longest-smallest", m, j), lb, lambda j=j: build(j))
        for j in np.flatnonzero(inst.usable).tolist()
    ]


def _top_first(inst: Instance, cluster, top: np.ndarray, dmax: int, base: float):
    def build():

        start = widest_start(cluster, int(inst.degrees[dmax]))
        bins = [([i], int(inst.r_min[i, dmax])) for i in np.flatnonzero(top).tolist()]
        rest = max(inst.finish_lb - base, 1e-9)
        items = np.flatnonzero(~top)
        pref = preferred_degrees(inst, rest, inst.usable)
        placed = place(layout(inst, items, pref, rest, inst.num_gpus), inst, cluster)
        return [(start, dmax, bins)], base, np.where(top, -1, pref), placed

    return build


def _tables(inst: Instance):
    """(fits (n, D), smallest degree each fits at, smallest that finishes within T, long
    (n, D): does not fit at that degree or takes longer than T there)."""
    fits = np.isfinite(inst.time)
    within = inst.time <= inst.finish_lb
    # the bound's finish is at least every sequence's fastest time, up to the rounding of
    # (finish + sync) - sync: the fastest degree counts as within, so argmax finds a True
    fastest = inst.time.min(axis=1)
    smallest = np.argmax(within | (inst.time <= fastest[:, None]), axis=1)
    return fits, np.argmax(fits, axis=1), smallest, ~within


def _single(inst: Instance, cluster, moved: np.ndarray, to: np.ndarray, j: int):
    def build():
        pref = np.where(moved, to, j)
        return [], 0.0, pref, _layout(inst, cluster, pref, j)

    return build


def _long_first(inst: Instance, cluster, j: int, long: np.ndarray, dmax: int, base: float):
    """long-first(j): `long` one after another on the widest group, then degree-j groups."""

    def build():

        start = widest_start(cluster, int(inst.degrees[dmax]))
        bins = [([i], int(inst.r_min[i, dmax])) for i in np.flatnonzero(long).tolist()]
        pref = np.where(long, -1, j)
        return [(start, dmax, bins)], base, pref, _layout(inst, cluster, pref, j)

    return build


def _layout(inst: Instance, cluster, pref: np.ndarray, j: int) -> list[tuple[int, int]]:
    """Groups for the sequences preferring another degree than j (their time there / T
    groups, one per sequence longer than T / 2, at least one), widest first while they fit,
    then degree-j groups on every rank left, then the widest usable degree that fits."""
    deg = inst.degrees.tolist()
    n = inst.num_gpus
    t0 = max(inst.finish_lb, 1e-12)
    groups, left = [], n
    for k in sorted(set(np.unique(pref).tolist()) - {j, -1}, key=lambda k: -deg[k]):
        tk = inst.time[pref == k, k]
        share = float(tk.sum()) / t0  # inf or nan from an extreme figure: as many as fit
        fill = math.ceil(share) if math.isfinite(share) else left // deg[k]
        want = max(1, fill, int((tk > t0 / 2).sum()))
        c = min(want, left // deg[k])
        groups += [k] * c
        left -= c * deg[k]
    groups += [j] * (left // deg[j])
    left %= deg[j]
    for k in sorted(np.flatnonzero(inst.usable).tolist(), key=lambda k: -deg[k]):
        while deg[k] <= left:
            groups.append(k)
            left -= deg[k]
    return place(sorted(groups, key=lambda k: -deg[k]), inst, cluster)


def _bound(inst: Instance, cluster, cols: list[int], items: np.ndarray | None = None) -> float:
    """Lower bound on the finish of any assignment of `items` (all: None) to groups of the
    degrees `cols` at full speed: packed work (time less every per-micro-batch constant, x
    degree) over all ranks, or the longest sequence at its best degree there. 0 where groups
    may run at other speeds (the bound would not hold)."""
    if not cluster.homogeneous:
        return 0.0
    work_t = _work_table(inst)
    rows = slice(None) if items is None else items
    work = work_t[rows][:, cols].min(axis=1).sum()
    longest = inst.time[rows][:, cols].min(axis=1).max(initial=0.0)
    return float(max(work / inst.num_gpus, longest))


def rule_plans(batch, cost) -> dict[str, list]:
    """Every simple-rule layout of `batch` as phases (lists of Groups), none pruned: the
    static degrees and every rule above, by name ("static-4", "long-first-1", ...). What
    greedy and cpsat must never be slower than (tests/test_robust.py, bench_robust.py)."""

    inst = make_instance(batch, cost)
    deg = inst.degrees.tolist()
    drafts = {f"static-{deg[j]}": uniform_draft(inst, cost.cluster, j) for j in range(len(deg))}
    for how, _, build in rules(inst, cost.cluster):
        drafts[_label(how, deg)] = rule_draft(inst, cost.cluster, build())
    out = {}
    for name, d in drafts.items():
        phases = None if d is None else to_phases(d, inst, cost)
        if phases is not None:
            out[name] = phases
    return out


def _work_table(inst: Instance) -> np.ndarray:
    """(n, D) packed GPU-work: time less every per-micro-batch constant, x degree."""
    return inst.memo(
        "rule_work",
        lambda: np.where(np.isfinite(inst.marginal), inst.marginal, np.inf) * inst.degrees,
    )


def _label(how: tuple, deg: list) -> str:
    """ "long-first-4" (base degree 4), "longest-first-2" (2 sequences first),
    "longest-smallest-2-1" (2 first, then base degree 1)."""
    name, *args = how
    if name == "longest-first":
        return f"{name}-{args[0]}"
    if name == "longest-smallest":
        return f"{name}-{args[0]}-{deg[args[1]]}"
    return f"{name}-{deg[args[0]]}"


def spec_bound(inst: Instance, cluster, spec) -> float:
    """A rule's bound once its groups are known (build()): phase 0 plus the bound of its
    sequences on the degrees of its groups (0 without groups: nothing to bound)."""
    phase0, base, pref, placed = spec
    if not placed:
        return 0.0
    cols = sorted({j for _, j in placed})
    return base + _bound(inst, cluster, cols, np.flatnonzero(pref >= 0))
