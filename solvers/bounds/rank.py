"""The rank-assignment relaxation of every plan (issue 19; session 6): a bound that sees
the packing's granularity, solved by HiGHS as a mixed-integer program (seconds) or, where
solvers/bounds/tree.py applies, exactly by recursion over the buddy tree (milliseconds).
Its data (per-sequence marginal times, constants, shares) is solvers/lp_bound's; its
solution as a plan is solvers/bounds/rank_plan.py's."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
from dcp_opt.solvers.bounds import tree as tree_bound
from dcp_opt.solvers.bounds.data import BoundData, bound_data
from dcp_opt.solvers.bounds.lp import lp_bound

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel


@dataclass(frozen=True)
class RankBound:
    value_s: float  # certified: finish bound + gradient sync
    lp_s: float  # lp_bound's value, the floor
    proven: bool  # the relaxation solved to optimality (else its dual bound at the limit)
    integer_classes: int
    classes: int
    source: str = "rank-milp"


def rank_bound(
    batch: Batch, cost: CostModel, *, time_limit_s: float = 10.0, integer_share: float = 0.1
) -> RankBound:
    """A bound that sees the packing's granularity (issue 19: 24 videos of 9 s on 32 ranks).

    Every valid plan runs each sequence i in one group of some degree d at a placement p of
    cluster.placements(d) (validate()), and a rank's finish is at least the summed time of
    the micro-batches it is a member of. A micro-batch takes at least the marginal times of
    its sequences plus the larger of its constant and its members' shares of the constants
    (lp_bound's work row, per member: work_i(d) / d - m_i(d), since a micro-batch holds at
    most so many tokens at each recompute level). So a group at p costs its ranks at least
    sum m_i(d) + z_p, z_p >= c_d u_p (u_p = 1 if it holds any sequence: one micro-batch at
    least) and z_p >= its members' shares. With y_{i,p} in {0, 1}, sum_p y = 1, y <= u: for
    every rank r, T >= sum over the placements p covering r of (z_p + sum_i y_{i,p} m_i),
    all at the fastest speed; and the work row sum y * work_i(d) <= capacity * T. Phases,
    their order and idle waiting are left out, which can only lower the optimum: it is a
    relaxation of every plan, any number of phases. (Nearly exact on homogeneous clusters:
    with phases ordered widest group first, every member of a group is free at the same
    time; solvers/bounds/rank_plan.py builds that plan.) Sequences with identical rows form one
    class (integer counts y_{k,p} in [0, c_k]); a class whose longest time is under
    `integer_share` x the LP bound is continuous (relaxing integrality only lowers the
    optimum). Sibling blocks of ranks that the placements treat alike are ordered by load
    (swap them in any plan: a symmetry of the relaxation). HiGHS' dual bound holds at the
    time limit too; max with lp_bound.

    Where the placements are the aligned blocks of a power-of-two world with equal ranks,
    the program with every class integer is solved exactly by the recursion of
    solvers/bounds/tree.py (milliseconds for few distinct sequences; at least the MILP's
    value for any integer_share); elsewhere HiGHS solves it."""
    lp = lp_bound(batch, cost, time_limit_s=min(0.3, time_limit_s))
    sync = cost.grad_sync_time()
    tree = tree_solution(batch, cost)
    if tree is not None:
        value, n_cls = _tree_value(tree[0], sync), len(tree[1])
        return RankBound(max(value, lp.value_s), lp.value_s, True, n_cls, n_cls, "rank-tree")
    res, integer, cls, _ = rank_milp(batch, cost, lp.value_s - sync, time_limit_s, integer_share)
    dual = getattr(res, "mip_dual_bound", None)
    finish = float(dual) if dual is not None and np.isfinite(dual) else 0.0
    # HiGHS' row feasibility tolerance (1e-7 relative): keep a margin of its size
    finish -= 1e-6 * abs(finish)
    return RankBound(
        max(finish + sync, lp.value_s),
        lp.value_s,
        res.status == 0,
        int(integer.sum()),
        len(cls),
    )


def tree_bound_s(
    batch: Batch, cost: CostModel, max_pairs: int = tree_bound.MAX_PAIRS
) -> float | None:
    """The rank relaxation's exact optimum plus the gradient sync, where the recursion of
    solvers/bounds/tree.py applies within `max_pairs` pairs a level (milliseconds); else
    None."""
    tree = tree_solution(batch, cost, max_pairs)
    return None if tree is None else _tree_value(tree[0], cost.grad_sync_time())


def _tree_value(sol, sync: float) -> float:
    # the recursion sums the cost model's own terms: a margin for float rounding only
    return sol.finish_s * (1 - 1e-9) + sync


def tree_solution(batch: Batch, cost: CostModel, max_pairs: int = tree_bound.MAX_PAIRS):
    """(solvers/tree_bound.TreeSolution, classes) of the all-integer relaxation, or None
    where the recursion does not apply or would visit more than `max_pairs` pairs a level.
    Identical shapes have identical rows, so the pairs counted over shapes are at least
    those over classes: a batch within the cap by shapes is solved whatever the cap, once
    per batch and cost model (memoised like bound_data: greedy's candidate, cpsat's bound and the
    stream bound ask for the same step with different caps)."""
    if not tree_bound.applicable(cost):
        return None
    if tree_bound.pairs(Counter(seq.shape for seq in batch.sequences).values()) > max_pairs:
        return None  # refused before any table
    key = ("tree_solution", batch.fingerprint())
    return cost.memoised(key, lambda: _tree_solution(batch, cost))  # None is a result too


def _tree_solution(batch: Batch, cost: CostModel):
    dat = bound_data(batch, cost)
    cls = _classes(dat)
    # the caller's cap held over shapes, so over the classes too: no second gate here
    sol = tree_bound.solve(dat, cls, cost.cluster.num_gpus, max_pairs=math.inf)
    return None if sol is None else (sol, cls)


def rank_milp(batch: Batch, cost: CostModel, t0: float, time_limit_s: float, integer_share: float):
    """The relaxation of rank_bound solved by HiGHS: (result, integer mask per class, classes,
    placements (degree index, degree, start)); result.x[k * P + p] members of class k at
    placement p (the first K * P entries), then u_p, z_p, and last T. `t0`: a finish bound,
    for `integer_share`."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415

    dat = bound_data(batch, cost)
    cls = _classes(dat)
    c = cost.cluster
    pos = [(j, int(d), s) for j, d in enumerate(dat.deg) for s in c.placements(int(d))]
    k_n, p_n = len(cls), len(pos)
    first = [m[0] for m in cls]
    m_kp = np.array([[dat.marg[i, j] for j, _, _ in pos] for i in first])  # (K, P)
    w_kp = np.array([[dat.work[i, j] for j, _, _ in pos] for i in first])
    ok = np.isfinite(m_kp) & np.isfinite(w_kp)
    m_kp, w_kp = np.where(ok, m_kp, 0.0), np.where(ok, w_kp, 0.0)
    count = np.array([len(m) for m in cls], dtype=float)
    integer = np.array([m_kp[k][ok[k]].max(initial=0.0) >= integer_share * t0 for k in range(k_n)])
    cover = np.zeros((c.num_gpus, p_n))
    for p, (_, d, s) in enumerate(pos):
        cover[s : s + d, p] = 1.0
    # per member of a group, the least share of micro-batch constants it carries (lp_bound's
    # work row over the degree, less its marginal time) at the fastest speed
    top = float(np.maximum(np.asarray(c.speed_factors or (1.0,)), 1.0).max())
    deg_p = np.array([d for _, d, _ in pos], dtype=float)
    share_kp = np.maximum(w_kp / deg_p[None, :] / top - m_kp, 0.0)
    const_p = np.array([dat.const[j] for j, _, _ in pos])
    rows = _RankRows(k_n, p_n)
    for k in range(k_n):  # every member once; a member at p opens the group: u_p = 1
        rows.add({rows.y(k, p): 1.0 for p in range(p_n)}, count[k], count[k])
        for p in np.flatnonzero(ok[k]).tolist():
            rows.add({rows.y(k, p): 1.0, rows.u(p): -count[k]}, -np.inf, 0.0)
    for p in range(p_n):  # z_p: the constants of the group at p (module docstring)
        rows.add({rows.z(p): 1.0, rows.u(p): -const_p[p]}, 0.0, np.inf)
        terms = {rows.y(k, p): -share_kp[k, p] for k in range(k_n) if share_kp[k, p] > 0}
        rows.add({rows.z(p): 1.0, **terms}, 0.0, np.inf)
    for r in range(c.num_gpus):  # each rank within T
        at = np.flatnonzero(cover[r]).tolist()
        terms = {rows.y(k, p): m_kp[k, p] for p in at for k in range(k_n) if m_kp[k, p] > 0}
        rows.add({**terms, **{rows.z(p): 1.0 for p in at}, rows.t: -1.0}, -np.inf, 0.0)
    work = {rows.y(k, p): w_kp[k, p] for k in range(k_n) for p in range(p_n) if w_kp[k, p] > 0}
    rows.add({**work, rows.t: -dat.capacity}, -np.inf, 0.0)
    for left, right in _sibling_pairs(pos, c.num_gpus):  # load(left block) >= load(right)
        diff = cover[left].sum(axis=0) - cover[right].sum(axis=0)
        terms = {rows.y(k, p): m_kp[k, p] * diff[p] for k in range(k_n) for p in range(p_n)}
        rows.add({v: x for v, x in terms.items() if x != 0}, 0.0, np.inf)
    ub = np.concatenate(
        [np.where(ok, count[:, None], 0.0).ravel(), np.ones(p_n), [np.inf] * (p_n + 1)]
    )
    integrality = np.concatenate([np.repeat(integer, p_n), np.ones(p_n), np.zeros(p_n + 1)]).astype(
        int
    )
    obj = np.zeros(rows.n)
    obj[rows.t] = 1.0
    res = milp(
        obj,
        constraints=LinearConstraint(rows.matrix(), rows.lo, rows.hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(rows.n), ub),
        options={"time_limit": max(time_limit_s, 0.01), "disp": False},
    )
    return res, integer, cls, pos


class _RankRows:
    """The rank relaxation's rows as sparse triplets; variables y (K x P), u (P), z (P), T."""

    def __init__(self, k_n: int, p_n: int):
        self.k_n, self.p_n = k_n, p_n
        self.n = k_n * p_n + 2 * p_n + 1
        self.t = self.n - 1
        self.data: list[float] = []
        self.cols: list[int] = []
        self.rowi: list[int] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def y(self, k: int, p: int) -> int:
        return k * self.p_n + p

    def u(self, p: int) -> int:
        return self.k_n * self.p_n + p

    def z(self, p: int) -> int:
        return self.k_n * self.p_n + self.p_n + p

    def add(self, terms: dict, lo: float, hi: float) -> None:
        row = len(self.lo)
        for col, x in terms.items():
            self.rowi.append(row)
            self.cols.append(col)
            self.data.append(float(x))
        self.lo.append(lo)
        self.hi.append(hi)

    def matrix(self):
        from scipy.sparse import csr_matrix  # noqa: PLC0415

        shape = (len(self.lo), self.n)
        return csr_matrix((self.data, (self.rowi, self.cols)), shape=shape)


def _classes(dat: BoundData) -> list[list[int]]:
    """Sequences with identical rows (time, marginal, work): interchangeable in the bound."""
    groups: dict = {}
    for i in range(dat.marg.shape[0]):
        key = (dat.time[i].tobytes(), dat.marg[i].tobytes(), dat.work[i].tobytes())
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _sibling_pairs(pos: list, n_gpus: int) -> list[tuple[list[int], list[int]]]:
    """Blocks [a, a + b) and [a + b, a + 2b) (b a power of two) that swapping maps the
    placements onto themselves: every placement inside one has its mirror in the other, and
    every other placement meeting them covers both or neither."""
    have = {(d, s) for _, d, s in pos}
    out = []
    b = 1
    while 2 * b <= n_gpus:
        for a0 in range(0, n_gpus - 2 * b + 1, 2 * b):
            if all(_mirrors(d, s, a0, b, have) for d, s in have):
                out.append((list(range(a0, a0 + b)), list(range(a0 + b, a0 + 2 * b))))
        b *= 2
    return out


def _mirrors(d: int, s: int, a0: int, b: int, have: set) -> bool:
    end = s + d
    if end <= a0 or s >= a0 + 2 * b or (s <= a0 and end >= a0 + 2 * b):
        return True  # outside both, or covering both
    if s >= a0 and end <= a0 + b:
        return (d, s + b) in have
    if s >= a0 + b and end <= a0 + 2 * b:
        return (d, s - b) in have
    return False  # straddles the two blocks partially
