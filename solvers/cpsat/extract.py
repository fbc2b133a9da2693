"""Hint and extraction of the CP-SAT model (solvers/cpsat/model.py): a greedy draft as a
complete starting solution [H], and a solution back to a draft plan (layout placed buddy
style, members dealt longest first, packed first-fit decreasing within each group)."""

from __future__ import annotations

import heapq

import numpy as np
from dcp_opt.solvers.cpsat.model import Data, Vars, cp_model
from dcp_opt.solvers.greedy.instance import Draft, Instance

from dcp_opt.cost import CostModel


def class_of(data: Data) -> np.ndarray:
    out = np.empty(len(data.inst.ids), dtype=int)
    for k, c in enumerate(data.classes):
        out[c] = k
    return out


def _group_hint(data: Data, j: int, bins, cls) -> tuple[int, dict, int]:
    """(model load, class counts, micro-batches) of one greedy group under the model."""
    members = [i for idx, _ in bins for i in idx]
    counts: dict = {}
    for i in members:
        counts[cls[i]] = counts.get(cls[i], 0) + 1
    if data.exact:
        levels = {r: c for r, c, _ in data.levels[j]}
        load = sum(sum(data.mt_r[cls[i], j, r] for i in idx) + levels.get(r, 0) for idx, r in bins)
        return load, counts, len(bins)
    cap = int(data.cap0[j])
    shared = sum(int(data.tok[k]) * n for k, n in counts.items() if data.pack[k, j])
    alone = sum(n for k, n in counts.items() if not data.pack[k, j])
    need = alone + (-(-shared // cap) if cap > 0 else sum(counts.values()))
    nb = max(len(bins), need, 1)
    load = sum(int(data.mt[k, j]) * n for k, n in counts.items()) + int(data.const[j]) * nb
    return load, counts, nb


def add_hint(model: cp_model.CpModel, data: Data, v: Vars, draft: Draft) -> bool:
    """[H] A greedy plan as a complete starting solution; False if not representable.
    Written into the proto in one call (add_hint per variable costs ~4 us each)."""
    if any(j != data.wide for _, j, _ in draft.phase0):
        return False
    cls = class_of(data)
    hint: dict[int, int] = {}  # variable index -> value; every other variable is 0
    by_deg: dict[int, list] = {}
    for start, j, bins in draft.groups:
        by_deg.setdefault(j, []).append((*_group_hint(data, j, bins, cls), bins, start))
    loads = []
    for j, groups in by_deg.items():
        if len(groups) > data.slots[j]:
            return False
        groups.sort(key=lambda g: -g[0])
        for s, (load, counts, nb, bins, start) in enumerate(groups):
            hint[v.u[j, s].index] = 1
            if (j, s) in v.st:  # the model places the groups: the greedy's start
                hint[v.st[j, s].index] = start
            hint[v.load[j, s].index] = load
            loads.append(load)
            for k, n in counts.items():
                if (k, j, s) not in v.y:
                    return False
                hint[v.y[k, j, s].index] = n
            if not data.exact:
                hint[v.nb[j, s].index] = nb
                continue
            if not _hint_bins(hint, data, v, (j, s), bins, cls):
                return False
    p0 = 0
    for _, _, bins in draft.phase0:
        for idx, _ in bins:
            for i in idx:
                if cls[i] not in v.z:
                    return False
                z = v.z[cls[i]].index
                hint[z] = hint.get(z, 0) + 1
                p0 += int(data.t[cls[i], data.wide])
    hint[v.p0.index] = p0
    hint[v.m.index] = p0 + max(loads, default=0)
    for key, st in v.st.items():  # unused slots: a value of their domain
        hint.setdefault(st.index, int(data.starts[key[0]][0]))
    n = len(model.proto.variables)
    model.proto.solution_hint.vars.extend(range(n))
    model.proto.solution_hint.values.extend([hint.get(i, 0) for i in range(n)])
    return True


def _hint_bins(hint: dict, data: Data, v: Vars, key, bins, cls) -> bool:
    """Exact model: the group's micro-batches, numbered by their first member's position."""
    j, s = key
    levels = {r: c for r, c, _ in data.levels[j]}
    pos = {k: p for p, (k, _) in enumerate(v.by_slot.get((j, s), []))}
    canon = sorted(bins, key=lambda bin_: min(pos.get(cls[i], -1) for i in bin_[0]))
    for b, (idx, r) in enumerate(canon):
        if (j, s, b, r) not in v.w or any((cls[i], j, s, b) not in v.x for i in idx):
            return False
        hint[v.w[j, s, b, r].index] = hint[v.ub[j, s, b].index] = 1
        hint[v.bt[j, s, b].index] = sum(data.mt_r[cls[i], j, r] for i in idx) + levels[r]
        for i in idx:
            hint[v.x[cls[i], j, s, b].index] = 1
    return True


def extract(solver: cp_model.CpSolver, data: Data, v: Vars, place, cluster):
    """Solution -> (placed groups, degree index per member row, Draft of the model's own
    assignment). None if the layout cannot be placed."""
    inst = data.inst
    on = [key for key, u in v.u.items() if solver.value(u)]
    slot_start: dict = {}
    if data.starts is not None:  # placed by the model ([L'])
        slot_start = {key: int(solver.value(v.st[key])) for key in on}
        placed = sorted((start, j) for (j, _), start in slot_start.items())
    else:  # buddy style; slot s of a degree takes its s-th placement
        placed = place(sorted((j for j, _ in on), key=lambda j: -inst.degrees[j]), inst, cluster)
        if len(placed) != len(on):
            return None
        counters: dict = {}
        for start, j in placed:
            s = counters.get(j, 0)
            counters[j] = s + 1
            slot_start[j, s] = start
    pref = np.full(len(inst.ids), -1)
    groups: dict = {key: [] for key in slot_start}
    phase0: list = []
    by_class: dict = {}
    for (k, j, s), y in v.y.items():
        take = solver.value(y)
        if take:
            by_class.setdefault(k, []).append((j, s, take))
    # Members dealt longest first (classes too, by their longest member), each to the group
    # with room left in the model's count that would finish it first (LPT with quotas; the
    # key uses the class's mean time at the group's degree, so one heap serves the class).
    busy = dict.fromkeys(slot_start, 0.0)
    order = sorted(range(len(data.classes)), key=lambda k: -inst.time[data.classes[k]].min())
    for k in order:
        c = data.classes[k]
        mean = inst.marginal[c].mean(axis=0)
        heap = [(busy[j, s] + mean[j], j, s, take) for j, s, take in by_class.get(k, [])]
        heapq.heapify(heap)
        for i in c[np.argsort(-np.min(inst.time[c], axis=1), kind="stable")].tolist():
            if not heap:
                phase0.append(i)
                continue
            _, j, s, take = heapq.heappop(heap)
            groups[j, s].append(i)
            busy[j, s] += float(inst.marginal[i, j])
            pref[i] = j
            if take > 1:
                heapq.heappush(heap, (busy[j, s] + mean[j], j, s, take - 1))
    if data.exact:
        bins = _exact_bins(solver, data, v)
        drafted = [(slot_start[key], key[0], bins[key]) for key in slot_start if bins.get(key)]
    else:
        drafted = [
            (slot_start[key], key[0], pack(inst, key[0], m)) for key, m in groups.items() if m
        ]
    p0 = []
    if phase0:
        start = max(inst.num_gpus - int(inst.degrees[data.wide]), 0)
        p0 = [(start, data.wide, [([i], int(inst.r_min[i, data.wide])) for i in phase0])]
        pref[phase0] = data.wide
    return placed, pref, Draft(p0, drafted, 0.0, ("cpsat",))


def _exact_bins(solver, data: Data, v: Vars) -> dict:
    out: dict = {}
    for (j, s, b, r), w in v.w.items():
        if solver.value(w):
            idx = [
                int(data.classes[k][0])
                for (k, jj, ss, bb), x in v.x.items()
                if (jj, ss, bb) == (j, s, b) and solver.value(x)
            ]
            if idx:
                out.setdefault((j, s), []).append((idx, r))
    return out


def pack(inst: Instance, j: int, members: list[int]) -> list[tuple[list[int], int]]:
    """Micro-batches of one group: members that fit without recompute, first-fit decreasing
    by tokens into micro-batches of cap0 tokens; the others alone at their r_min."""
    alone = [([i], int(inst.r_min[i, j])) for i in members if inst.r_min[i, j] > 0]
    shared = sorted((i for i in members if inst.r_min[i, j] == 0), key=lambda i: -inst.tokens[i])
    bins: list[list] = []
    room: list[float] = []
    cap = float(inst.cap0[j])
    for i in shared:
        t = float(inst.tokens[i])
        for b, left in enumerate(room):
            if t <= left:
                bins[b].append(i)
                room[b] -= t
                break
        else:
            bins.append([i])
            room.append(cap - t)
    return alone + [(b, 0) for b in bins]


def draft_finish(draft: Draft, inst: Instance, cost: CostModel) -> float:
    """Exact latest finish of a draft on a homogeneous cluster (phase 0 covers every rank).
    One vectorised cost.time call per degree (a call per micro-batch costs ~10 us)."""
    base = float(_group_times(draft.phase0, inst, cost).sum())
    return base + float(_group_times(draft.groups, inst, cost).max(initial=0.0))


def _group_times(groups: list, inst: Instance, cost: CostModel) -> np.ndarray:
    out = np.zeros(len(groups))
    by_deg: dict[int, tuple[list, list, list]] = {}
    for g, (_, j, bins) in enumerate(groups):
        owner, members, levels = by_deg.setdefault(j, ([], [], []))
        for idx, r in bins:
            owner.append(g)
            members.append(idx)
            levels.append(r)
    for j, (owner, members, levels) in by_deg.items():
        starts = np.cumsum([0] + [len(m) for m in members[:-1]])
        feats = np.add.reduceat(inst.feats[np.concatenate(members)], starts, axis=0)
        t = cost.time(feats, int(inst.degrees[j]), np.asarray(levels, dtype=float))
        np.add.at(out, owner, t)
    return out
