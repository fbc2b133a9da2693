"""Packing-aware lower bound on the step time: a parametric LP relaxation solved exactly.

For a candidate finish time T, every plan (any number of phases, any packing) satisfies:
- (critical path) a sequence i runs at a degree d with t_i(d) <= T * w_max only, since any
  micro-batch holding it takes at least its time alone (time grows with features and with r);
- (work) it costs at least d * (m_i(d) + min_r [E_d(r) * tok_i / K_d(r) + (r - r_i) rec_i(d)])
  GPU-seconds, where m_i(d) is its time less every per-micro-batch constant
  (table.time_marginal), E_d(r) the time of an empty micro-batch at recompute level r, K_d(r)
  the most tokens a micro-batch at level r can hold at degree d, r_i its own fewest recomputed
  layers and rec_i(d) one more recomputed layer of it (r >= r_i: it does not fit below): a
  micro-batch's constant is shared by at most K_d(r) tokens, and a micro-batch packed beyond
  the tokens that fit at level r_i recomputes more. This is the efficiency a micro-batch can
  actually reach given memory, not the best-case asymptote;
- (big sequences) a rank busy with sequences i_1..i_k spends at least sum m_i + c_min (one
  micro-batch constant at least), so k sequences with m_i > (T - c_min) / k never share a
  rank: the degrees of those sequences sum to at most (k - 1) * N (k = 2, 3, 4).
With x_{i,d} >= 0, sum_d x_{i,d} = 1, the least work sum x * work must fit the ranks' time:
sum_i,d x_{i,d} work_i(d) <= sum_r max(s_r, 1) * T (speed weights as dcp_opt.bounds).
Without the big-sequence rows the LP separates per sequence (closed form, bisection on T);
with them scipy's HiGHS solves it at a few T above the separable bound, time permitting.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.cost import CostModel
from dcp_opt.table import seq_table

from . import tree_bound

BIG_K = (2, 3, 4)


@dataclass(frozen=True)
class LPBound:
    value_s: float  # finish bound + gradient sync
    separable_s: float  # the same without the big-sequence rows
    lp_solves: int
    source: str = "lp"


@dataclass(frozen=True)
class _Data:
    time: np.ndarray  # (n, D) alone, at the fastest speed; inf where it does not fit
    marg: np.ndarray  # (n, D) the same less every per-micro-batch constant
    c_min: float  # the smallest empty micro-batch time, at the fastest speed
    const: np.ndarray  # (D,) the empty micro-batch time per degree, at the fastest speed
    work: np.ndarray  # (n, D) GPU-seconds lower bound
    deg: np.ndarray
    capacity: float  # sum of rank weights
    n_gpus: int


def _data(batch: Batch, cost: CostModel) -> _Data:
    """The bound's per-sequence data, memoised on the cost model (its bounded MemoCache):
    lp_bound, the stream bound's tree term and the planners' tree candidate read it for the
    same batch."""
    key = ("lp_bound_data", batch.fingerprint())
    if key not in cost._cache:
        cost._cache[key] = _make_data(batch, cost)
    return cost._cache[key]


def _make_data(batch: Batch, cost: CostModel) -> _Data:
    tab = seq_table(batch, cost)
    c = cost.cluster
    deg = np.asarray(tab.degrees, dtype=float)
    w = np.maximum(np.asarray(c.speed_factors or (1.0,) * c.num_gpus), 1.0)
    zero = np.zeros(cost.num_features)
    # Several SP kinds (cost.sp_kinds): the table holds the least time over them, and each
    # term below is the least over the kinds, so the bound holds for plans of any kind.
    kws = [{} if k == "ulysses" else {"kind": k} for k in cost.sp_kinds]
    const = np.array(
        [min(float(cost.time(zero, int(d), 0, **kw)) for kw in kws) for d in tab.degrees]
    )
    cap = np.array([max(cost.capacity(s, int(d)) for s in c.placements(int(d))) for d in deg])
    shares = np.min([_shares(cost, tab, cap, **kw) for kw in kws], axis=0)
    work = deg[None, :] * (tab.time_marginal + shares)
    top = w.max()
    return _Data(
        tab.time / top,
        tab.time_marginal / top,
        float(const.min()) / top,
        const / top,
        work,
        deg,
        float(w.sum()),
        c.num_gpus,
    )


def _shares(cost: CostModel, tab, cap: np.ndarray, **kind) -> np.ndarray:
    """(n, D) the least each sequence adds to a micro-batch beyond its marginal time: at
    recompute level r (r >= its own r_min, else it does not fit) a micro-batch holds at most
    K_d(r) tokens, so the sequence carries at least tok / K_d(r) of the empty micro-batch's
    time E_d(r), and (r - r_min) more recomputed layers of its own, rec each; the least over
    r. Every figure is the cost model's own (time_by_degree, memory), so subclasses hold too.
    Time is affine in the features (table.py), so rec = features @ (the increment of one
    more recomputed layer per unit feature): one cost call per feature, not per sequence.
    `kind`: the SP kind's times (empty micro-batch, recompute) and its own r_min (a member
    of a kind's micro-batch at level r recomputes r - r_min of that kind beyond the
    marginal time the table holds; the table's r_min, Ulysses', would charge cp members
    for layers they already pay: a cp plan 5 % below the bound, tests/test_tree_bound.py);
    memory per token is Ulysses' at degree 1 (the least of the kinds): it can only lower
    the term."""
    L = cost.model.num_layers
    degrees = tab.degrees
    deg = np.asarray(degrees, dtype=float)
    nd, nf = len(degrees), cost.num_features
    levels = np.arange(L + 1)
    empty = cost.time_by_degree(
        np.zeros((L + 1, nf)), degrees, np.broadcast_to(levels, (nd, L + 1)), **kind
    )
    per_tok = np.array([float(cost.memory(1.0, 1, r)) for r in levels]) - cost.fixed_bytes()
    room = np.maximum(cap - cost.fixed_bytes(), 1e-30)
    a = empty * per_tok[None, :] / (room * deg)[:, None]  # (D, L + 1): E_d(r) / K_d(r)
    r0 = tab.r_min
    if kind:  # this kind's fewest layers at the same (best) capacity, as the table's
        r0 = cost.min_recompute(tab.tokens[None, :], deg[:, None], cap[:, None], **kind).T
    ok = r0 >= 0
    r0c = np.where(ok, r0, 0)
    at_r0 = tab.tokens[:, None] * a[np.arange(nd)[None, :], r0c]
    if L == 0:
        return np.where(ok, at_r0, np.inf)
    eye = np.eye(nf)
    step = [cost.time_by_degree(eye, degrees, np.full((nd, nf), r), **kind) for r in (0, 1)]
    g = (step[1] - empty[:, 1:2]) - (step[0] - empty[:, 0:1])  # (D, F) per unit feature
    rec = np.maximum(tab.feats @ g.T, 0.0)  # (n, D) one more recomputed layer of it
    slopes = (empty[:, -1] - empty[:, 0]) * (per_tok[-1] - per_tok[0])
    if _affine(empty) and _affine(per_tok[None, :]) and np.all(slopes <= 0):
        # E_d(r) and the bytes per token are affine in r with slopes of opposite signs
        # (recompute adds time and frees memory), so E_d(r) / K_d(r) is a concave quadratic
        # in r and so is the whole term: its least on [r_min, L] is at an end
        at_l = tab.tokens[:, None] * a[:, L][None, :] + (L - r0c) * rec
        return np.where(ok, np.minimum(at_r0, at_l), np.inf)
    v = tab.tokens[:, None, None] * a[None] + (levels - r0c[..., None]) * rec[..., None]
    v[levels < r0c[..., None]] = np.inf
    return np.where(ok, v.min(axis=2), np.inf)


def _affine(x: np.ndarray) -> bool:
    """Rows of x are affine in their index (second differences within rounding)."""
    if x.shape[1] < 3:
        return True
    return bool(
        np.all(np.abs(np.diff(x, 2, axis=1)) <= 1e-9 * np.abs(x).max(axis=1, keepdims=True))
    )


def _separable_ok(dat: _Data, t: float) -> bool:
    w = np.where(dat.time <= t, dat.work, np.inf).min(axis=1)
    return bool(np.all(np.isfinite(w)) and w.sum() <= dat.capacity * t)


def _lp_ok(dat: _Data, t: float) -> bool:
    """Feasibility of the LP with the big-sequence rows at finish time t (HiGHS)."""
    from scipy.optimize import linprog  # noqa: PLC0415 (scipy loads only when used)
    from scipy.sparse import coo_matrix  # noqa: PLC0415

    ok = dat.time <= t
    rows, cols = np.nonzero(ok)
    if len(np.unique(rows)) < dat.time.shape[0]:
        return False
    nv = len(rows)
    c = dat.work[rows, cols]
    a_eq = coo_matrix((np.ones(nv), (rows, np.arange(nv))), shape=(dat.time.shape[0], nv))
    a_ub, b_ub = [c], [dat.capacity * t]
    for k in BIG_K:
        big = dat.marg[rows, cols] > (t - dat.c_min) / k
        if big.any():
            a_ub.append(np.where(big, dat.deg[cols], 0.0))
            b_ub.append((k - 1) * dat.n_gpus)
    res = linprog(
        c,
        A_ub=np.array(a_ub),
        b_ub=np.array(b_ub),
        A_eq=a_eq.tocsr(),
        b_eq=np.ones(dat.time.shape[0]),
        bounds=(0, 1),
        method="highs",
    )
    return res.status == 0


def _bisect(ok, lo: float, hi: float, iters: int, deadline: float) -> tuple[float, int]:
    """Largest t in [lo, hi] known infeasible (a valid bound), and calls made."""
    calls = 0
    for _ in range(iters):
        if time.perf_counter() > deadline:
            break
        mid = 0.5 * (lo + hi)
        calls += 1
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return lo, calls


def lp_bound(
    batch: Batch,
    cost: CostModel,
    *,
    upper_s: float | None = None,
    time_limit_s: float = 0.05,
    max_lp_seqs: int = 400,
) -> LPBound:
    """The bound; `upper_s` (a known plan's step time) brackets the search."""
    start = time.perf_counter()
    ana = lower_bound(batch, cost)
    sync = ana.grad_sync_s
    dat = _data(batch, cost)
    lo = ana.value_s - sync
    hi = (upper_s - sync) if upper_s else lo * 4
    while not _separable_ok(dat, hi):
        hi *= 2
    if _separable_ok(dat, lo):
        sep = lo
    else:
        sep, _ = _bisect(lambda t: _separable_ok(dat, t), lo, hi, 40, float("inf"))
    best, calls = sep, 0
    if len(batch) <= max_lp_seqs and time_limit_s > 0.005 and not _lp_ok(dat, sep):
        best, calls = _bisect(lambda t: _lp_ok(dat, t), sep, hi, 12, start + time_limit_s)
        calls += 1
    return LPBound(max(best, lo) + sync, max(sep, lo) + sync, calls)


# ---- the rank-assignment relaxation, solved as a mixed-integer program -------------------


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

    Every valid plan runs each sequence i in one group of some degree d at a placement s of
    cluster.placements(d) (validate()), and a rank's finish is at least the summed time of
    the micro-batches it is a member of. Each micro-batch takes at least its constant plus
    the marginal times of its sequences (lp_bound's big-sequence rows use the same fact),
    and at least the sum over its sequences of marginal time plus share of the constants
    (lp_bound's work row, per member: work_i(d) / d). So with y_{i,d,s} in {0, 1},
    sum_{d,s} y = 1, for every rank r: T >= c_min + sum_{(i,d,s) covering r} m_i(d) and
    T >= sum_{(i,d,s) covering r} work_i(d) / d, all at the fastest speed; and the work row
    sum y * work_i(d) <= capacity * T. Phases, their order and idle waiting are left out,
    which can only lower the optimum: it is a relaxation of every plan, any number of
    phases. (Nearly exact on homogeneous clusters: with phases ordered widest group first,
    every member of a group is free at the same time; solvers/rank_plan.py builds that
    plan.) Sequences with identical rows form one class (integer counts y_{k,d,s} in
    [0, c_k]); a class whose longest time is under `integer_share` x the LP bound is
    continuous (relaxing integrality only lowers the optimum). Sibling blocks of ranks that
    the placements treat alike are ordered by load (swap them in any plan: a symmetry of the
    relaxation). HiGHS' dual bound holds at the time limit too; max with lp_bound.

    Each group also carries its micro-batches' constants: at least one empty micro-batch
    c_d if it holds any sequence (u_p = 1), and at least its members' shares of them
    (z_p >= both); a rank's row sums z_p + the marginal times over the placements covering
    it. Where the placements are the aligned blocks of a power-of-two world with equal
    ranks, the program with every class integer is solved exactly in milliseconds by the
    recursion of solvers/tree_bound.py (at least the MILP's value for any integer_share);
    elsewhere HiGHS solves it."""
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
    solvers/tree_bound.py applies within `max_pairs` pairs a level (milliseconds); else
    None."""
    tree = tree_solution(batch, cost, max_pairs)
    return None if tree is None else _tree_value(tree[0], cost.grad_sync_time())


def _tree_value(sol, sync: float) -> float:
    # the recursion sums the cost model's own terms: a margin for float rounding only
    return sol.finish_s * (1 - 1e-9) + sync


def tree_solution(batch: Batch, cost: CostModel, max_pairs: int = tree_bound.MAX_PAIRS):
    """(solvers/tree_bound.TreeSolution, classes) of the all-integer relaxation, or None
    where the recursion does not apply or the batch has too many distinct classes.
    Memoised on the cost model like _data: cpsat asks for the plan and then the bound."""
    key = ("tree_solution", batch.fingerprint(), max_pairs)
    found = cost._cache.get(key, key)  # None is a result: the key itself marks a miss
    if found is key:
        found = cost._cache[key] = _tree_solution(batch, cost, max_pairs)
    return found


def _tree_solution(batch: Batch, cost: CostModel, max_pairs: int):
    if not tree_bound.applicable(cost):
        return None
    # identical shapes have identical rows, so the pairs counted over shapes are at least
    # those over classes: a batch of many distinct shapes is refused before any table
    shapes = Counter(seq.shape for seq in batch.sequences).values()
    if tree_bound.pairs(shapes) > max_pairs:
        return None
    dat = _data(batch, cost)
    cls = _classes(dat)
    sol = tree_bound.solve(dat, cls, cost.cluster.num_gpus, max_pairs)
    return None if sol is None else (sol, cls)


def rank_milp(batch: Batch, cost: CostModel, t0: float, time_limit_s: float, integer_share: float):
    """The relaxation of rank_bound solved by HiGHS: (result, integer mask per class, classes,
    placements (degree index, degree, start)); result.x[k * P + p] members of class k at
    placement p (the first K * P entries), then u_p, z_p, and last T. `t0`: a finish bound,
    for `integer_share`."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415

    dat = _data(batch, cost)
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


def _classes(dat: _Data) -> list[list[int]]:
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
