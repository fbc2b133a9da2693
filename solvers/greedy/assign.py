"""Steps 3 and 4 of the greedy planner (the package docstring): longest-first assignment
into placed groups, packing, and the drafts of one target makespan, one rule or one degree."""

from __future__ import annotations

import heapq

import numpy as np
from dcp_opt.solvers.greedy.instance import Draft, Instance, layout, place, preferred_degrees

from dcp_opt.cost import CostModel
from dcp_opt.plan import Group, MicroBatch


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
        start = widest_start(cluster, int(inst.degrees[dmax]))
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
    return assign_draft(
        inst, cluster, items, pref, placed, target, phase0, base, eft, cutoff=cutoff
    )


def widest_start(cluster, d: int) -> int:
    """The placement of a degree-d group with the most memory (all equal when homogeneous)."""
    return max(cluster.placements(d), key=lambda s: (cluster.group_memory(s, d), -s))


def assign_draft(
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
    start = widest_start(cluster, int(inst.degrees[dmax]))
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
    return assign_draft(inst, cluster, items, pref, placed, np.inf, [], 0.0, cutoff=cutoff)


def uniform_bounds(inst: Instance) -> np.ndarray:
    """(D,) lower bounds on the finish of uniform_draft(j): packed work over N, longest
    sequence; 0 where some sequence does not fit (it goes elsewhere: no cheap bound)."""
    t = inst.time
    work = (t - inst.const[None, :]).sum(axis=0) * inst.degrees / inst.num_gpus
    return np.where(np.isfinite(t).all(axis=0), np.maximum(work, t.max(axis=0)), 0.0)


def rule_draft(inst: Instance, cluster, spec, *, cutoff: float = np.inf) -> Draft | None:
    """The draft of one rule (rules.rules: `spec` = its build()); None if it cannot
    finish before `cutoff` (or a sequence fits none of its groups)."""
    phase0, base, pref, placed = spec
    items = np.flatnonzero(pref >= 0)
    if len(items) == 0:
        return Draft(phase0, [], float(np.max(base, initial=0.0)))
    return assign_draft(
        inst, cluster, items, pref, placed, inst.finish_lb, phase0, base, True, cutoff=cutoff
    )
