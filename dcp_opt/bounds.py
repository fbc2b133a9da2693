"""Analytic lower bound on the step time of any plan (certified, independent of solvers).

A plan's step = latest rank finish + gradient sync. Two facts bound the finish:
1. work: a sequence run at degree d costs d * t(d, r) GPU-seconds at least; packing shares
   every per-micro-batch constant (overhead, kernel launches, all-to-all latency), so with
   m_i(d) = t_i(d) less those constants, sum_i min_d d * m_i(d) <= sum_j w_j * finish;
2. critical path: every sequence runs on some group, so finish >= min_d t_i(d) / max_j w_j.
t_i(d) is taken at the fewest recomputed layers that fit, since recompute only adds time.
Speed factors divide compute but not communication, so a rank of speed s counts with weight
w = max(s, 1): (compute / s + comm) * max(s, 1) >= compute + comm for every s > 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .cost import CostModel
from .cost.finite import check_sync_finite
from .table import seq_table


@dataclass(frozen=True)
class LowerBound:
    value_s: float
    work_s: float
    longest_s: float
    grad_sync_s: float
    source: str = "analytic"


def lower_bound(batch: Batch, cost: CostModel) -> LowerBound:
    key = ("lower_bound", batch.fingerprint())  # cached: every planner's finish() asks
    return cost.memoised(key, lambda: _lower_bound(batch, cost))


def _lower_bound(batch: Batch, cost: CostModel) -> LowerBound:
    cost.check_fits(batch)
    tab = seq_table(batch, cost)
    deg = np.asarray(tab.degrees, dtype=float)
    work = np.min(tab.time_marginal * deg[None, :], axis=1).sum()
    c = cost.cluster
    w = np.maximum(c.speed_factors or (1.0,) * c.num_gpus, 1.0)
    work_s = float(work / w.sum() + cost.coeffs.microbatch_overhead_s / w.max())
    longest_s = float(np.min(tab.time, axis=1).max() / w.max())
    sync = cost.grad_sync_time()
    check_sync_finite(cost, sync)  # every planner's finish asks: never an inf step
    return LowerBound(max(work_s, longest_s) + sync, work_s + sync, longest_s + sync, sync)
