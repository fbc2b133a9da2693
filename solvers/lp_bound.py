"""Packing-aware lower bound on the step time: a parametric LP relaxation solved exactly.

For a candidate finish time T, every plan (any number of phases, any packing) satisfies:
- (critical path) a sequence i runs at a degree d with t_i(d) <= T * w_max only, since any
  micro-batch holding it takes at least its time alone (time grows with features and with r);
- (work) it costs at least d * (m_i(d) + c_d * tok_i / K_d) GPU-seconds, where m_i(d) is its
  time less every per-micro-batch constant (table.time_marginal), c_d the constant of an empty
  micro-batch at r = 0 and K_d the most tokens one micro-batch can hold at degree d (with every
  layer recomputed): a micro-batch's constant is shared by at most K_d tokens. This is the
  efficiency a micro-batch can actually reach given memory, not the best-case asymptote;
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
    work: np.ndarray  # (n, D) GPU-seconds lower bound
    deg: np.ndarray
    capacity: float  # sum of rank weights
    n_gpus: int


def _data(batch: Batch, cost: CostModel) -> _Data:
    tab = seq_table(batch, cost)
    c = cost.cluster
    deg = np.asarray(tab.degrees, dtype=float)
    w = np.maximum(np.asarray(c.speed_factors or (1.0,) * c.num_gpus), 1.0)
    zero = np.zeros(cost.num_features)
    const = np.array([float(cost.time(zero, int(d), 0)) for d in tab.degrees])
    L = cost.model.num_layers
    per_tok = float(cost.memory(1.0, 1, L)) - cost.fixed_bytes()
    cap = np.array([max(cost.capacity(s, int(d)) for s in c.placements(int(d))) for d in deg])
    k_tok = np.maximum(cap - cost.fixed_bytes(), 1e-30) * deg / per_tok
    work = deg[None, :] * (tab.time_marginal + const[None, :] * tab.tokens[:, None] / k_tok)
    top = w.max()
    return _Data(
        tab.time / top,
        tab.time_marginal / top,
        float(const.min()) / top,
        work,
        deg,
        float(w.sum()),
        c.num_gpus,
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
