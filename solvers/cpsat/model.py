"""The CP-SAT model of solvers/cpsat/plan.py: data, one function per constraint group, extraction.

The formulation (variables, constants, objective, groups [L] [A] [P] [B] [Z] [M]) is written
out in the docstring of solvers/cpsat/plan.py; the function names below carry the same labels.
OR-Tools is imported here and in cpsat.py only, never by `import dcp_opt.solvers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from dcp_opt.solvers.greedy.instance import CAP_SLACK, Instance
from ortools.sat.python import cp_model

from dcp_opt.cost import CostModel

RESOLUTION = 20000  # integer time units per incumbent finish time
SLOT_CAP = 48  # most groups of one degree the model may open


# ---- data -------------------------------------------------------------------------------
@dataclass
class Data:
    inst: Instance
    classes: list[np.ndarray]  # member row indices of each class
    count: np.ndarray  # (K,)
    t: np.ndarray  # (K, D) time alone (units, rounded up); -1 = does not fit
    mt: np.ndarray  # (K, D) members' mean time less the r=0 constant (units); -1 = no fit
    tok: np.ndarray  # (K,) tokens (members' mean, rounded up)
    pack: np.ndarray  # (K, D) bool: fits a shared micro-batch without recompute
    const: np.ndarray  # (D,) units
    cap0: np.ndarray  # (D,) integer tokens per micro-batch without recompute
    slots: list[int]  # (D,) groups the model may open per degree
    wide: int  # degree index of the phase-0 group (the whole cluster), -1 = none
    unit: float  # seconds per unit
    exact: bool
    # (D,) start ranks each degree may take (Cluster.placements) where the buddy argument of
    # [L] does not hold (a fabric's domains, degrees like 72/36/18/9); None = buddy tiling
    starts: list | None = None
    levels: dict = field(default_factory=dict)  # exact model: d -> [(r, c_units, cap_tok)]
    complete: bool = False  # exact model with every recompute level 0..L: its optimum is exact
    mt_r: dict = field(default_factory=dict)  # exact model: (k, d, r) -> units


def token_ceiling(inst: Instance) -> float:
    """The largest token capacity the model is given: a capacity above the batch's tokens
    (and above 2**40, so no real capacity changes) holds the same as that many, and stays an
    int64 for CP-SAT (a memory of 1e300 B would be a 290-digit integer)."""
    return float(max(float(inst.tokens.sum()), 2.0**40))


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
        # Equal shares of the batch's work per class (not equal counts): the few long
        # sequences that decide the makespan get classes of their own, the many short
        # ones share (their mean then stands for them well).
        w = np.min(inst.time * inst.degrees[None, :], axis=1)
        order = np.argsort(w, kind="stable")
        share = np.cumsum(w[order]) - 0.5 * w[order]
        inv = np.empty(len(w), dtype=int)
        inv[order] = np.minimum((share * max_classes / share[-1]).astype(int), max_classes - 1)
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
    and each degree at most a quarter more than the incumbent's (a neighbourhood search), and
    never fewer than the incumbent has (so the incumbent stays a complete hint)."""
    unit = max(horizon_s, 1e-9) / RESOLUTION
    classes = (
        [np.array([i]) for i in range(len(inst.ids))] if exact else make_classes(inst, max_classes)
    )
    # A class stands for its members by their mean (the class's total is then exact for any
    # split of its members); feasibility by its largest member. The extraction re-times
    # every candidate exactly (cpsat/extract.py draft_finish), so the mean only steers.
    t_s = np.array([inst.time[c].max(axis=0) for c in classes])
    mt_s = np.array([np.mean(inst.time[c] - inst.const[None, :], axis=0) for c in classes])
    # Only improvements are sought: a degree at which a member alone outlasts the incumbent
    # is left out (each class keeps its fastest degree, so the model stays feasible).
    t_min = np.array([inst.time[c].min(axis=0) for c in classes])
    ok = np.isfinite(t_s) & (t_min <= horizon_s * (1 + 1e-9))
    ok[np.arange(len(classes)), np.argmin(t_s, axis=1)] = True
    t = np.where(ok, to_units(np.where(ok, t_s, 0), unit), -1)
    mt = np.where(ok, to_units(np.where(ok, np.maximum(mt_s, 0), 0), unit), -1)
    pack = np.array([(inst.r_min[c] == 0).all(axis=0) for c in classes])
    count = np.array([len(c) for c in classes])
    n_fit = (count[:, None] * ok).sum(axis=0).tolist()
    starts = placement_starts(inst, cost.cluster)
    most = [len(x) for x in starts] if starts else [inst.num_gpus // int(d) for d in inst.degrees]
    slots = [min(most[j], n_fit[j], SLOT_CAP) for j in range(len(inst.degrees))]
    if near is not None and not exact:
        slots = [
            max(min(s, near.get(j, 0) + max(2, near.get(j, 0) // 4)), near.get(j, 0))
            for j, s in enumerate(slots)
        ]
    wide = len(inst.degrees) - 1 if int(inst.degrees[-1]) == inst.num_gpus else -1
    data = Data(
        inst=inst,
        classes=classes,
        count=count,
        t=t,
        mt=mt,
        tok=np.array([int(np.ceil(inst.tokens[c].mean())) for c in classes]),
        pack=pack,
        const=to_units(inst.const, unit),
        cap0=np.floor(np.minimum(inst.cap0, token_ceiling(inst))).astype(np.int64),
        slots=slots,
        wide=wide,
        unit=unit,
        exact=exact,
        starts=starts,
    )
    if exact:
        _add_levels(data, cost)
    return data


def placement_starts(inst: Instance, cluster) -> list | None:
    """Each degree's placements, where buddy tiling may fail: a degree other than the whole
    cluster that is not a power of two (72/36/18/9 on NVL72: 36 + 32 + 4 = 72 GPUs, yet a
    32 and a 36 cannot both sit in one rack), or placements other than every aligned range
    (a fabric's domains). None where every layout that fits N GPUs tiles buddy style."""
    n = inst.num_gpus
    degs = [int(d) for d in inst.degrees]
    starts = [cluster.placements(d) for d in degs]
    buddy = all(
        (d & (d - 1) == 0 or d == n) and st == tuple(range(0, n - d + 1, d))
        for d, st in zip(degs, starts, strict=True)
    )
    return None if buddy else starts


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
            cap_tok = max(cap - cost.fixed_bytes(), 0.0) * d / per * CAP_SLACK
            cap_tok = math.floor(min(cap_tok, token_ceiling(inst)))
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
    st: dict = field(default_factory=dict)  # (j, s) -> its start rank (Data.starts only)
    y: dict = field(default_factory=dict)  # (k, j, s) -> members of class k in that group
    z: dict = field(default_factory=dict)  # k -> members of class k in phase 0
    load: dict = field(default_factory=dict)  # (j, s) -> busy time of the group (units)
    by_slot: dict = field(default_factory=dict)  # (j, s) -> [(k, y)]
    nb: dict = field(default_factory=dict)  # aggregate: (j, s) -> micro-batches
    bt: dict = field(default_factory=dict)  # exact: (j, s, b) -> micro-batch time
    ub: dict = field(default_factory=dict)  # exact: (j, s, b) -> micro-batch used
    x: dict = field(default_factory=dict)  # exact: (k, j, s, b) -> class k in micro-batch b
    w: dict = field(default_factory=dict)  # exact: (j, s, b, r) -> micro-batch b recomputes r
    p0: object = None  # phase 0's length (units)
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
    if data.starts is not None:  # tiling is not automatic: place the groups in the model
        add_placement(model, data, v)


def add_placement(model: cp_model.CpModel, data: Data, v: Vars) -> None:
    """[L'] Each used slot takes one of its degree's placements (Cluster.placements), and
    the used slots' rank ranges do not overlap (an optional interval per slot, no-overlap):
    exactly the layouts validate() accepts."""
    deg = data.inst.degrees
    ranges = []
    for (j, s), u in v.u.items():
        d = int(deg[j])
        dom = cp_model.Domain.FromValues(list(data.starts[j]))
        v.st[j, s] = model.new_int_var_from_domain(dom, f"st{j}_{s}")
        ranges.append(model.new_optional_fixed_size_interval_var(v.st[j, s], d, u, f"iv{j}_{s}"))
    model.add_no_overlap(ranges)


def add_assignment(model: cp_model.CpModel, data: Data, v: Vars) -> None:
    """[A] Every sequence exactly once: class k's members split over used groups where they
    fit in memory (t >= 0) and phase 0; none in an unused group."""
    slots = list(v.u.items())
    for k, c in enumerate(data.count.tolist()):
        fits = data.t[k] >= 0
        parts = []
        for (j, s), u in slots:
            if not fits[j]:
                continue
            y = model.new_bool_var("") if c == 1 else model.new_int_var(0, c, "")
            if c == 1:
                model.add_implication(y, u)
            else:
                model.add_linear_constraint(
                    cp_model.LinearExpr.weighted_sum([y, u], [1, -c]), -c, 0
                )
            v.y[k, j, s] = y
            v.by_slot.setdefault((j, s), []).append((k, y))
            parts.append(y)
        if data.wide >= 0 and fits[data.wide]:
            v.z[k] = model.new_int_var(0, c, f"z{k}")
            parts.append(v.z[k])
        model.add_linear_constraint(cp_model.LinearExpr.sum(parts), c, c)


def _set_load(model: cp_model.CpModel, v: Vars, key, terms: list, coeffs: list, top: int):
    """load_js as its own variable (defined once, read by [M] and the symmetry rows)."""
    load = v.load[key] = model.new_int_var(0, top, f"load{key[0]}_{key[1]}")
    model.add_linear_constraint(
        cp_model.LinearExpr.weighted_sum([*terms, load], [*coeffs, -1]), 0, 0
    )


def add_packing_aggregate(model: cp_model.CpModel, data: Data, v: Vars, top: int) -> None:
    """[P] Micro-batches of a group (bucketed model): at least one if used; members that fit
    without recompute share micro-batches of at most cap0 tokens, the others run alone.
    load = sum members * (t - c) + micro-batches * c."""
    tok, pack, mt = data.tok.tolist(), data.pack.tolist(), data.mt.tolist()
    count, const, cap0 = data.count.tolist(), data.const.tolist(), data.cap0.tolist()
    for (j, s), u in v.u.items():
        ys = v.by_slot.get((j, s), [])
        nb = v.nb[j, s] = model.new_int_var(0, sum(count[k] for k, _ in ys) or 1, f"b{j}_{s}")
        model.add_linear_constraint(cp_model.LinearExpr.weighted_sum([nb, u], [1, -1]), 0, 2**40)
        ks = [k for k, _ in ys]
        yv = [y for _, y in ys]
        cap = int(cap0[j])
        # cap * nb >= sum_shared tok * y + cap * sum_alone y
        w = [(tok[k] if pack[k][j] else cap) if cap > 0 else 1 for k in ks]
        model.add_linear_constraint(
            cp_model.LinearExpr.weighted_sum([*yv, nb], [*w, -(cap if cap > 0 else 1)]),
            -(2**62),
            0,
        )
        _set_load(model, v, (j, s), [*yv, nb], [*(mt[k][j] for k in ks), const[j]], top)


def add_bins_exact(model: cp_model.CpModel, data: Data, v: Vars, top: int) -> None:
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
        _set_load(model, v, (j, s), times, [1] * len(times), top)


def add_phase0(model: cp_model.CpModel, data: Data, v: Vars, top: int):
    """[Z] Phase 0: members of a class in phase 0 run one after another, alone, on the group
    of the whole cluster; every group of phase 1 starts after it."""
    v.p0 = model.new_int_var(0, top, "p0")
    ks = list(v.z)
    model.add_linear_constraint(
        cp_model.LinearExpr.weighted_sum(
            [*(v.z[k] for k in ks), v.p0], [*(int(data.t[k, data.wide]) for k in ks), -1]
        ),
        0,
        0,
    )


def add_makespan(model: cp_model.CpModel, data: Data, v: Vars, horizon: int) -> None:
    """[M] makespan >= phase 0 + the load of every group; groups of one degree in
    non-increasing load (they are interchangeable); minimise the makespan."""
    v.m = model.new_int_var(0, horizon, "makespan")
    deg = data.inst.degrees.tolist()
    keys = list(v.load)
    # Redundant (implied by the rows below): the groups' GPU-time fits in N * makespan.
    model.add_linear_constraint(
        cp_model.LinearExpr.weighted_sum(
            [*(v.load[key] for key in keys), v.m], [*(deg[j] for j, _ in keys), -data.inst.num_gpus]
        ),
        -(2**62),
        0,
    )
    for (j, s), load in v.load.items():
        model.add_linear_constraint(
            cp_model.LinearExpr.weighted_sum([v.m, v.p0, load], [1, -1, -1]), 0, 2**62
        )
        if s:
            model.add_linear_constraint(
                cp_model.LinearExpr.weighted_sum([v.load[j, s - 1], load], [1, -1]), 0, 2**62
            )
    if not v.load:
        model.add_linear_constraint(
            cp_model.LinearExpr.weighted_sum([v.m, v.p0], [1, -1]), 0, 2**62
        )
    model.minimize(v.m)


def build(data: Data, horizon: int) -> tuple[cp_model.CpModel, Vars]:
    model, v = cp_model.CpModel(), Vars()
    add_layout(model, data, v)
    add_assignment(model, data, v)
    (add_bins_exact if data.exact else add_packing_aggregate)(model, data, v, horizon)
    add_phase0(model, data, v, horizon)
    add_makespan(model, data, v, horizon)
    return model, v
