"""The order of one column's micro-batches under the pipeline's schedule: named orders,
then local search (swaps of two positions), each scored by the exact makespan.

Named orders (by a micro-batch's seconds summed over the stages): data order; heaviest
first (Megatron dev's dynamic CP emits its groups so); lightest first; small at both ends
(verl's order: ascending to the middle, then descending); and "light ends, heavy early":
the two lightest first and last, the rest heaviest first (the bound's fill and drain,
dcp_opt/pipeline/bound.py, are short when the first and last micro-batches are)."""

from __future__ import annotations

import time

import numpy as np

from .instance import Column, Instance


def small_at_both_ends(weights) -> list[int]:
    """verl's order (its balanced micro-batches' placement): sorted ascending, alternately
    to the front and back, so the heaviest sit in the middle."""
    idx = sorted(range(len(weights)), key=lambda k: weights[k])
    front, back = idx[0::2], idx[1::2]
    return front + back[::-1]


def named_orders(weights) -> dict[str, list[int]]:
    m = len(weights)
    asc = sorted(range(m), key=lambda k: weights[k])
    out = {"data": list(range(m)), "heaviest_first": asc[::-1], "lightest_first": asc,
           "small_both_ends": small_at_both_ends(weights)}  # fmt: skip
    if m >= 3:
        out["light_ends_heavy_early"] = [asc[0]] + asc[2:][::-1] + [asc[1]]
    return out


def best_named(col: Column, inst: Instance, times) -> tuple[list[int], float]:
    w = (times[0] + times[1]).sum(axis=0)
    best, val = None, float("inf")
    for order in named_orders(w).values():
        v = col.makespan(inst, order, times)
        if v < val:
            best, val = order, v
    return best, val


def local_search(col: Column, inst: Instance, times, order, value, deadline: float):
    """First-improvement swaps of any two positions until none improves or the deadline
    passes."""
    order = list(order)
    m = len(order)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for i in range(m):
            for j in range(i + 1, m):
                cand = order.copy()
                cand[i], cand[j] = cand[j], cand[i]
                v = col.makespan(inst, cand, times)
                if v < value * (1 - 1e-12):
                    order, value, improved = cand, v, True
                if time.perf_counter() > deadline:
                    return order, value
    return order, value


def apply_order(col: Column, order) -> Column:
    return Column(col.degree, col.start, [col.mbs[k] for k in order], col.rec[np.array(order)])
