"""Analytic lower bound on the step time of any plan (certified, independent of solvers).

A plan's step = latest rank finish + gradient sync. Two facts bound the finish:
1. work: a sequence run at degree d costs d * t(d, r) GPU-seconds at least; packing shares only
   the per-micro-batch overhead, so sum_i min_d d * (t_i(d) - overhead) <= total speed * finish;
2. critical path: every sequence runs on some group, so finish >= min_d t_i(d) / max speed.
t_i(d) is taken at the fewest recomputed layers that fit, since recompute only adds time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .cost import CostModel
from .table import seq_table


@dataclass(frozen=True)
class LowerBound:
    value_s: float
    work_s: float
    longest_s: float
    grad_sync_s: float
    source: str = "analytic"


def lower_bound(batch: Batch, cost: CostModel) -> LowerBound:
    cost.check_fits(batch)
    tab = seq_table(batch, cost)
    deg = np.asarray(tab.degrees, dtype=float)
    work = np.min(tab.time_no_overhead * deg[None, :], axis=1).sum()
    c = cost.cluster
    max_speed = max(c.speed_factors) if c.speed_factors else 1.0
    work_s = float(work / c.total_speed + cost.coeffs.microbatch_overhead_s / max_speed)
    longest_s = float(np.min(tab.time, axis=1).max() / max_speed)
    sync = cost.grad_sync_time()
    return LowerBound(max(work_s, longest_s) + sync, work_s + sync, longest_s + sync, sync)
