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
from dataclasses import dataclass

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.cost import CostModel
from dcp_opt.table import seq_table

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
    dat = cost._cache.get(key)
    if dat is None:  # kept in a local: another thread (AsyncPlanner) may evict the entry
        dat = cost._cache[key] = _make_data(batch, cost)
    return dat


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
