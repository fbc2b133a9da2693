"""The CP-SAT model of solvers/cpsat.py: data, one function per constraint group, extraction.

The formulation (variables, constants, objective, groups [L] [A] [P] [B] [Z] [M]) is written
out in the docstring of solvers/cpsat.py; the function names below carry the same labels.
OR-Tools is imported here and in cpsat.py only, never by `import dcp_opt.solvers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from dcp_opt.cost import CostModel

from .greedy import Instance

RESOLUTION = 20000  # integer time units per incumbent finish time
SLOT_CAP = 48  # most groups of one degree the model may open


# ---- data -------------------------------------------------------------------------------
@dataclass
class Data:
    inst: Instance
    classes: list[np.ndarray]  # member row indices of each class
    count: np.ndarray  # (K,)
    t: np.ndarray  # (K, D) time alone (units, rounded up); -1 = does not fit
    mt: np.ndarray  # (K, D) time less the r=0 micro-batch constant (units); -1 = no fit
    tok: np.ndarray  # (K,) tokens (largest member)
    pack: np.ndarray  # (K, D) bool: fits a shared micro-batch without recompute
    const: np.ndarray  # (D,) units
    cap0: np.ndarray  # (D,) integer tokens per micro-batch without recompute
    slots: list[int]  # (D,) groups the model may open per degree
    wide: int  # degree index of the phase-0 group (the whole cluster), -1 = none
    unit: float  # seconds per unit
    exact: bool
    levels: dict = field(default_factory=dict)  # exact model: d -> [(r, c_units, cap_tok)]
    complete: bool = False  # exact model with every recompute level 0..L: its optimum is exact
    mt_r: dict = field(default_factory=dict)  # exact model: (k, d, r) -> units


def to_units(seconds, unit: float):
    """The one place where seconds become integers: rounded up, so the model never
    promises a plan faster than it is."""
    return np.ceil(np.asarray(seconds, dtype=float) / unit - 1e-9).astype(np.int64)


def make_classes(inst: Instance, max_classes: int) -> list[np.ndarray]:
    """Identical sequences share a class; beyond `max_classes` distinct ones, classes are
    quantiles of the least-work time (FlexSP buckets; its planner used at most 16)."""
    shape = np.column_stack([inst.tokens, inst.time])
    _, inv = np.unique(np.round(shape, 9), axis=0, return_inverse=True)
    inv = inv.ravel()
    if inv.max() + 1 > max_classes:
        w = np.min(inst.time * inst.degrees[None, :], axis=1)
        order = np.argsort(w, kind="stable")
        inv = np.empty(len(w), dtype=int)
        inv[order] = np.arange(len(w)) * max_classes // len(w)
    return [np.flatnonzero(inv == k) for k in range(inv.max() + 1) if (inv == k).any()]


def make_data(
    inst: Instance,
    cost: CostModel,
    horizon_s: float,
    exact: bool,
    max_classes: int = 16,
    near: dict | None = None,
):
    """`near`: degree index -> groups of the incumbent; other degrees get at most 2 slots
    and each degree at most a quarter more than the incumbent's (a neighbourhood search)."""
    unit = max(horizon_s, 1e-9) / RESOLUTION
    classes = (
        [np.array([i]) for i in range(len(inst.ids))] if exact else make_classes(inst, max_classes)
    )
    t_s = np.array([inst.time[c].max(axis=0) for c in classes])
    mt_s = np.array([(inst.time[c] - inst.const[None, :]).max(axis=0) for c in classes])
    # Only improvements are sought: a degree at which a member alone outlasts the incumbent
    # is left out (each class keeps its fastest degree, so the model stays feasible).
    t_min = np.array([inst.time[c].min(axis=0) for c in classes])
    ok = np.isfinite(t_s) & (t_min <= horizon_s * (1 + 1e-9))
    ok[np.arange(len(classes)), np.argmin(t_s, axis=1)] = True
    t = np.where(ok, to_units(np.where(ok, t_s, 0), unit), -1)
    mt = np.where(ok, to_units(np.where(ok, np.maximum(mt_s, 0), 0), unit), -1)
    pack = np.array([(inst.r_min[c] == 0).all(axis=0) for c in classes])
    n_fit = [
        int(sum(len(c) for c, o in zip(classes, ok[:, j], strict=True) if o))
        for j in range(len(inst.degrees))
    ]
    slots = [min(inst.num_gpus // int(d), n_fit[j], SLOT_CAP) for j, d in enumerate(inst.degrees)]
    if near is not None and not exact:
        slots = [min(s, near.get(j, 0) + max(2, near.get(j, 0) // 4)) for j, s in enumerate(slots)]
    wide = len(inst.degrees) - 1 if int(inst.degrees[-1]) == inst.num_gpus else -1
    data = Data(
        inst=inst,
        classes=classes,
        count=np.array([len(c) for c in classes]),
        t=t,
        mt=mt,
        tok=np.array([int(inst.tokens[c].max()) for c in classes]),
        pack=pack,
        const=to_units(inst.const, unit),
        cap0=np.floor(inst.cap0).astype(np.int64),
        slots=slots,
        wide=wide,
        unit=unit,
        exact=exact,
    )
    if exact:
        _add_levels(data, cost)
    return data


LEVEL_BUDGET = 4000  # micro-batch x level booleans the exact model may spend on every level


def _add_levels(data: Data, cost: CostModel) -> None:
    """Recompute levels of the exact model: every r in 0..L while the micro-batch x level
    variables stay under LEVEL_BUDGET (packing may need more recompute than any member
    alone), else the batch's distinct r_min plus 0 and L (then not proven exact)."""
    inst, L = data.inst, cost.model.num_layers
    zero = np.zeros(cost.num_features)
    n_bins = sum(data.slots) * len(data.classes)
    data.complete = (L + 1) * n_bins <= LEVEL_BUDGET
    for j, d in enumerate(inst.degrees.tolist()):
        seen = inst.r_min[:, j][inst.r_min[:, j] >= 0].tolist()
        rs = set(range(L + 1)) if data.complete else ({0, L} | set(seen))
        cap = max(cost.capacity(s, d) for s in cost.cluster.placements(d))
        lv = []
        for r in sorted(rs):
            per = float(cost.memory(1.0, 1, r)) - cost.fixed_bytes()
            cap_tok = math.floor(max(cap - cost.fixed_bytes(), 0.0) * d / per * (1 - 1e-9))
            lv.append((r, int(to_units(float(cost.time(zero, d, r)), data.unit)), cap_tok))
        data.levels[j] = lv
        for k, c in enumerate(data.classes):
            f = inst.feats[int(c[0])]
            for r, _, _ in lv:
                extra = float(cost.time(f, d, r)) - float(cost.time(zero, d, r))
                data.mt_r[k, j, r] = int(to_units(max(extra, 0.0), data.unit))


# ---- variables and constraint groups ------------------------------------------------------
@dataclass
class Vars:
    u: dict = field(default_factory=dict)  # (j, s) -> slot s of degree j is a group
    y: dict = field(default_factory=dict)  # (k, j, s) -> members of class k in that group
    z: dict = field(default_factory=dict)  # k -> members of class k in phase 0
    load: dict = field(default_factory=dict)  # (j, s) -> busy time of the group (units)
    by_slot: dict = field(default_factory=dict)  # (j, s) -> [(k, y)]
    nb: dict = field(default_factory=dict)  # aggregate: (j, s) -> micro-batches
    bt: dict = field(default_factory=dict)  # exact: (j, s, b) -> micro-batch time
    ub: dict = field(default_factory=dict)  # exact: (j, s, b) -> micro-batch used
    x: dict = field(default_factory=dict)  # exact: (k, j, s, b) -> class k in micro-batch b
    w: dict = field(default_factory=dict)  # exact: (j, s, b, r) -> micro-batch b recomputes r
    m: object = None  # the makespan (units)


def add_layout(model: cp_model.CpModel, data: Data, v: Vars) -> None:
    """[L] Groups: slot s of degree d is used or not; used slots of a degree come first; the
    groups' ranks add up to at most N (powers of two then tile aligned ranges, buddy style)."""
    deg = data.inst.degrees
    for j, n_slots in enumerate(data.slots):
        for s in range(n_slots):
            v.u[j, s] = model.new_bool_var(f"u{j}_{s}")
            if s:
                model.add_implication(v.u[j, s], v.u[j, s - 1])
    model.add(sum(int(deg[j]) * u for (j, _), u in v.u.items()) <= data.inst.num_gpus)


def add_assignment(model: cp_model.CpModel, data: Data, v: Vars) -> None:
    """[A] Every sequence exactly once: class k's members split over used groups where they
    fit in memory (t >= 0) and phase 0; none in an unused group."""
    for k, c in enumerate(data.count.tolist()):
        parts = []
        for (j, s), u in v.u.items():
            if data.t[k, j] < 0:
                continue
            y = (
                model.new_bool_var(f"y{k}_{j}_{s}")
                if c == 1
                else model.new_int_var(0, c, f"y{k}_{j}_{s}")
            )
            model.add(y <= c * u)
            v.y[k, j, s] = y
            v.by_slot.setdefault((j, s), []).append((k, y))
            parts.append(y)
        if data.wide >= 0 and data.t[k, data.wide] >= 0:
            v.z[k] = model.new_int_var(0, c, f"z{k}")
            parts.append(v.z[k])
        model.add(sum(parts) == c)


def add_packing_aggregate(model: cp_model.CpModel, data: Data, v: Vars) -> None:
    """[P] Micro-batches of a group (bucketed model): at least one if used; members that fit
    without recompute share micro-batches of at most cap0 tokens, the others run alone.
    load = sum members * (t - c) + micro-batches * c."""
    for (j, s), u in v.u.items():
        ys = v.by_slot.get((j, s), [])
        nb = v.nb[j, s] = model.new_int_var(
            0, int(sum(data.count[k] for k, _ in ys)) or 1, f"b{j}_{s}"
        )
        model.add(nb >= u)
        shared = [int(data.tok[k]) * y for k, y in ys if data.pack[k, j]]
        alone = [y for k, y in ys if not data.pack[k, j]]
        cap = int(data.cap0[j])
        if cap > 0:
            model.add(cap * nb >= sum(shared) + cap * sum(alone))
        else:
            model.add(nb >= sum(y for _, y in ys))
        v.load[j, s] = sum(int(data.mt[k, j]) * y for k, y in ys) + int(data.const[j]) * nb


def add_bins_exact(model: cp_model.CpModel, data: Data, v: Vars) -> None:
    """[B] Micro-batches of a group (exact model): each sequence of the group in one of its
    micro-batches; a used micro-batch picks one recompute level r; its tokens fit at r; its
    time is sum of members' (t(r) - c(r)) + c(r); used micro-batches come first."""
    n = len(data.classes)
    for (j, s), u in v.u.items():
        ys = v.by_slot.get((j, s), [])
        times = []
        prev = None
        for b in range(len(ys)):
            used = v.ub[j, s, b] = model.new_bool_var(f"ub{j}_{s}_{b}")
            model.add_implication(used, u)
            if prev is not None:
                model.add_implication(used, prev)
            prev = used
            xs = []
            # Symmetry: micro-batches are numbered by their first member, so the member in
            # position p of the group's list sits in micro-batch b <= p.
            for k, _ in ys[b:]:
                v.x[k, j, s, b] = model.new_bool_var(f"x{k}_{j}_{s}_{b}")
                model.add_implication(v.x[k, j, s, b], used)
                xs.append((k, v.x[k, j, s, b]))
            bt = v.bt[j, s, b] = model.new_int_var(0, 10 * RESOLUTION * max(n, 1), f"bt{j}_{s}_{b}")
            lv = []
            for r, c_r, cap_tok in data.levels[j]:
                w = model.new_bool_var(f"w{j}_{s}_{b}_{r}")
                v.w[j, s, b, r] = w
                lv.append(w)
                model.add(sum(int(data.tok[k]) * x for k, x in xs) <= cap_tok).only_enforce_if(w)
                model.add(bt >= sum(data.mt_r[k, j, r] * x for k, x in xs) + c_r).only_enforce_if(w)
            model.add(sum(lv) == used)
            times.append(bt)
        for k, y in ys:
            model.add(sum(v.x[k, j, s, b] for b in range(len(ys)) if (k, j, s, b) in v.x) == y)
        v.load[j, s] = sum(times)


def add_phase0(data: Data, v: Vars):
    """[Z] Phase 0: members of a class in phase 0 run one after another, alone, on the group
    of the whole cluster; every group of phase 1 starts after it."""
    return sum(int(data.t[k, data.wide]) * z for k, z in v.z.items())


def add_makespan(model: cp_model.CpModel, data: Data, v: Vars, p0, horizon: int) -> None:
    """[M] makespan >= phase 0 + the load of every group; groups of one degree in
    non-increasing load (they are interchangeable); minimise the makespan."""
    v.m = model.new_int_var(0, horizon, "makespan")
    deg = data.inst.degrees
    # Redundant (implied by the rows below): the groups' GPU-time fits in N * makespan.
    model.add(
        sum(int(deg[j]) * load for (j, _), load in v.load.items()) <= data.inst.num_gpus * v.m
    )
    for (j, s), load in v.load.items():
        model.add(v.m >= p0 + load)
        if s:
            model.add(v.load[j, s - 1] >= load)
    if not v.load:
        model.add(v.m >= p0)
    model.minimize(v.m)


def build(data: Data, horizon: int) -> tuple[cp_model.CpModel, Vars]:
    model, v = cp_model.CpModel(), Vars()
    add_layout(model, data, v)
    add_assignment(model, data, v)
    (add_bins_exact if data.exact else add_packing_aggregate)(model, data, v)
    add_makespan(model, data, v, add_phase0(data, v), horizon)
    return model, v
