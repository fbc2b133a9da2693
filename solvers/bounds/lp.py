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
from dcp_opt.solvers.bounds.data import BoundData, bound_data

from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.cost import CostModel

BIG_K = (2, 3, 4)
MAX_DOUBLINGS = 2200  # 2**2200 x the least positive float (5e-324) overflows to inf


@dataclass(frozen=True)
class LPBound:
    value_s: float  # finish bound + gradient sync
    separable_s: float  # the same without the big-sequence rows
    lp_solves: int
    source: str = "lp"


def _separable_ok(dat: BoundData, t: float) -> bool:
    w = np.where(dat.time <= t, dat.work, np.inf).min(axis=1)
    return bool(np.all(np.isfinite(w)) and w.sum() <= dat.capacity * t)


def _lp_ok(dat: BoundData, t: float) -> bool:
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
    dat = bound_data(batch, cost)
    lo = ana.value_s - sync
    hi = (upper_s - sync) if upper_s else lo * 4
    # Bracket by doubling, at most MAX_DOUBLINGS times: from the least positive float that
    # reaches inf, after which nothing changes (a work sum that overflows is never "ok").
    hi = max(hi, 5e-324)
    for _ in range(MAX_DOUBLINGS):
        if _separable_ok(dat, hi):
            break
        hi *= 2
    else:  # no finite bracket: the analytic bound, which holds anyway
        return LPBound(ana.value_s, ana.value_s, 0)
    if _separable_ok(dat, lo):
        sep = lo
    else:
        sep, _ = _bisect(lambda t: _separable_ok(dat, t), lo, hi, 40, float("inf"))
    best, calls = sep, 0
    if len(batch) <= max_lp_seqs and time_limit_s > 0.005 and not _lp_ok(dat, sep):
        best, calls = _bisect(lambda t: _lp_ok(dat, t), sep, hi, 12, start + time_limit_s)
        calls += 1
    return LPBound(max(best, lo) + sync, max(sep, lo) + sync, calls)
