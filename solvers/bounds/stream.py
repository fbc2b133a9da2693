"""Certified lower bound on an epoch's time: the steps of a stream, each one optimizer step
(issue 13, item 5). docs/stream.md states the argument; here in short.

An epoch's time is the sum of its steps' times (each step ends with its gradient sync; the
cost model has no other per-step fixed cost: CostModel.grad_sync_time is the only one).

max_shift = 0 (the steps are fixed): the sum over steps of the per-step certified bound,
max(dcp_opt.bounds.lower_bound, solvers.bounds/lp.py, the rank relaxation's exact
optimum where solvers/bounds/tree.py solves it in milliseconds: few distinct sequences on a
power-of-two cluster, e.g. 2d-long's 2M-token steps of 5-11 videos) of each step. Each is
a bound on any plan of that step (their own docstrings), so the sum bounds any plans of
the steps.

max_shift > 0 (a step former may move samples between steps, keeping the number of steps:
solvers/stream/step_former.py guarantees it): a bound for every assignment of the same sequences
to the same number S of steps, whatever K and tolerance. For any step k with sequences I_k,
its finish time (step time less the sync) is at least each of
  (a) sum_{i in I_k} w_i / W + c        (dcp_opt.bounds, fact 1: w_i = min_d d * m_i(d) the
                                          least GPU-seconds of sequence i, W the summed rank
                                          weights, c = per-micro-batch overhead / max weight)
  (b) sum_{i in I_k} v_i / W            (solvers.lp_bound's work row, least over every
                                          degree: v_i = min_d d * (m_i(d) + the share of
                                          micro-batch constants it must carry); the LP
                                          allows only degrees that meet T, so the least
                                          over all of them holds for any T)
Both are sums of per-sequence terms, so their sums over the S steps do not depend on the
assignment: epoch >= max(sum_i w_i / W + S c, sum_i v_i / W) + S * sync, since a sum of
per-step maxima is at least the maximum of the sums. The longest-sequence (critical-path)
terms are left out: a former can pair any long sequence with enough work that it never binds,
and a term that holds for every assignment would need the band and K (not given here).
"""

from __future__ import annotations

import numpy as np
from dcp_opt.solvers.bounds.data import bound_data
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.bounds.rank import tree_bound_s

from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.cost import CostModel
from dcp_opt.errors import require
from dcp_opt.table import seq_table

# the tree term's pairs a level (solvers/bounds/tree.py): a few ms a step; 2d-long's 2M-token
# steps need 900 (median) to 472,392, a 1d-long step of 13 distinct lengths 1.6M (0.46 s)
TREE_PAIRS = 1 << 17


def stream_lower_bound(
    steps: list[Batch], cost: CostModel, *, max_shift: int = 0, lp_time_limit_s: float = 0.05
) -> float:
    """Seconds: no plan of these steps (max_shift = 0), nor of any reassignment of their
    sequences to as many steps (max_shift > 0), takes less (module docstring).
    `lp_time_limit_s` bounds each step's LP refinement (0: the separable bound only)."""
    _check(steps, cost, max_shift, lp_time_limit_s)
    if max_shift == 0:
        return float(sum(_step_bound(b, cost, lp_time_limit_s) for b in steps))
    return float(_movable_bound(steps, cost))


def _check(steps, cost, max_shift, lp_time_limit_s) -> None:
    require(
        isinstance(steps, (list, tuple)) and len(steps) > 0,
        "steps",
        "must be a non-empty list of Batch",
    )
    for k, b in enumerate(steps):
        require(isinstance(b, Batch), f"steps[{k}]", f"must be a Batch, got {type(b).__name__}")
    require(
        isinstance(max_shift, int) and not isinstance(max_shift, bool) and max_shift >= 0,
        "max_shift",
        f"must be an integer >= 0, got {max_shift!r}",
    )
    require(
        isinstance(lp_time_limit_s, (int, float)) and lp_time_limit_s >= 0,
        "lp_time_limit_s",
        f"must be seconds >= 0, got {lp_time_limit_s!r}",
    )
    require(isinstance(cost, CostModel), "cost", f"must be a CostModel, got {cost!r}")


def step_lower_bound(batch: Batch, cost: CostModel, *, lp_time_limit_s: float = 0.05) -> float:
    """One step's term of the max_shift = 0 bound (module docstring): stream_lower_bound of
    fixed steps is the sum of these, so a caller may memoise them per step."""
    _check([batch], cost, 0, lp_time_limit_s)
    return float(_step_bound(batch, cost, lp_time_limit_s))


def _step_bound(batch: Batch, cost: CostModel, lp_time_limit_s: float) -> float:
    ana = lower_bound(batch, cost).value_s
    lp = lp_bound(batch, cost, time_limit_s=lp_time_limit_s).value_s
    tree = tree_bound_s(batch, cost, TREE_PAIRS) if lp_time_limit_s > 0 else None
    return max(ana, lp, tree or 0.0)


def _movable_bound(steps: list[Batch], cost: CostModel) -> float:
    c = cost.cluster
    weights = np.maximum(np.asarray(c.speed_factors or (1.0,) * c.num_gpus, dtype=float), 1.0)
    per_mb = cost.coeffs.microbatch_overhead_s / weights.max()
    work_a = work_b = 0.0
    for b in steps:  # per-sequence terms: the same whichever step holds the sequence
        cost.check_fits(b)
        tab = seq_table(b, cost)
        deg = np.asarray(tab.degrees, dtype=float)
        work_a += float(np.min(tab.time_marginal * deg[None, :], axis=1).sum())
        work_b += float(np.min(bound_data(b, cost).work, axis=1).sum())
    n = len(steps)
    finish = max(work_a / weights.sum() + n * per_mb, work_b / weights.sum())
    return finish + n * cost.grad_sync_time()
