"""Overflow-first candidates of the greedy planner: level a coarse packing with a wide phase.

When the batch is a few dozen big sequences on many ranks, the least-work degree (often 1)
leaves a bin-packing remainder: 24 videos of 9 s on 32 ranks, then 23 of 3.4-4.4 s, and no
way to reach the 10.6 s the work allows at degree 1 alone (a rank holds a 9 s video and
nothing over 1.6 s, or three mid-size ones: 12.2 s). Running the sequences that do not fit
first, on every rank in wider groups, costs their SP overhead but removes the remainder
(issue 19, 2d-long 16M on h200x32 under sp-step: 12.24 s -> 11.1 s, bound 10.65 s).

overflow-first(j, w, f), with T = f x the analytic bound's finish: sequences longest first
(time at base degree j); each goes to the least-loaded degree-j group if phase 0's length
plus that group's load stays within T, else to the least-loaded degree-w group of phase 0
(every rank in degree-w groups) if that keeps every degree-j group within T, else wherever
the latest finish grows least. Phase 1 then re-assigns its sequences by the greedy's own
step 3 (greedy.rule_draft), starting after phase 0's longest group, so the draft's finish
is an upper bound on the simulated one. Base degree j: the degree of least packed work;
w: every wider degree; f: GRID. Tried only where the best draft so far is more than
MIN_GAP above the bound (elsewhere it can gain little) and the batch has at most MAX_SEQS
sequences (a coarse packing is a few-sequences-per-rank effect).
"""

from __future__ import annotations

import heapq

import numpy as np

from .greedy_steps import Instance, place

GRID = (1.0, 1.03, 1.06, 1.1)
MIN_GAP = 0.02
MAX_SEQS = 400


def specs(inst: Instance, cluster, best: float) -> list[tuple[tuple, object]]:
    """(how, build) of every overflow-first candidate worth trying against `best`."""
    n = len(inst.ids)
    if n > MAX_SEQS or not best > inst.finish_lb * (1 + MIN_GAP):
        return []
    work = np.where(np.isfinite(inst.marginal), inst.marginal, np.inf) * inst.degrees
    usable = np.flatnonzero(inst.usable).tolist()
    j = min(usable, key=lambda k: float(np.where(np.isfinite(work[:, k]), work[:, k], 0).sum()))
    out = []
    for w in usable:
        if inst.degrees[w] <= inst.degrees[j] or not np.isfinite(inst.time[:, w]).all():
            continue
        for f in GRID:
            out.append(
                (("overflow-first", j, w, f), lambda w=w, f=f: build(inst, cluster, j, w, f))
            )
    return out


def build(inst: Instance, cluster, j: int, w: int, f: float):
    """(phase0, base, pref, placed) as greedy_rules' builds give them (greedy.rule_draft)."""
    deg = inst.degrees.tolist()
    n_gpus = inst.num_gpus
    target = inst.finish_lb * f
    t = inst.time
    over = _split(t[:, j], t[:, w], n_gpus // deg[j], n_gpus // deg[w], target)
    placed0 = place([w] * (n_gpus // deg[w]), inst, cluster)
    bins: list[list] = [[] for _ in placed0]
    load = [0.0] * len(placed0)
    for i in sorted(np.flatnonzero(over).tolist(), key=lambda i: -t[i, w]):
        g = min(range(len(load)), key=load.__getitem__)
        bins[g].append(([i], int(inst.r_min[i, w])))
        load[g] += float(t[i, w])
    phase0 = [(s, jw, b) for (s, jw), b in zip(placed0, bins, strict=True) if b]
    pref = np.where(over, -1, j)
    placed = place([j] * (n_gpus // deg[j]), inst, cluster)
    return phase0, max(load, default=0.0), pref, placed


def _split(tj: np.ndarray, tw: np.ndarray, n_j: int, n_w: int, target: float) -> np.ndarray:
    """(n,) True for the sequences phase 0 takes (module docstring); one pass, heaps of
    loads. A sequence that does not fit at j always goes to phase 0."""
    inf = float("inf")
    order = np.argsort(-np.where(np.isfinite(tj), tj, inf), kind="stable").tolist()
    ph1 = [0.0] * n_j  # min-heap of degree-j group loads
    ph0 = [0.0] * n_w  # min-heap of degree-w group loads
    top1 = top0 = 0.0  # the largest load in each
    over = np.zeros(len(tj), dtype=bool)
    a, b = tj.tolist(), tw.tolist()
    for i in order:
        fin1 = ph1[0] + a[i]  # at j: this group's finish less phase 0
        fin0 = max(top0, ph0[0] + b[i])  # phase 0's length with it
        if a[i] < inf and top0 + fin1 <= target:
            go0 = False
        elif fin0 + top1 <= target:
            go0 = True
        else:  # neither meets T: where the latest finish grows least
            go0 = not (a[i] < inf and top0 + max(top1, fin1) <= fin0 + top1)
        if go0:
            heapq.heapreplace(ph0, ph0[0] + b[i])
            top0 = fin0
            over[i] = True
        else:
            heapq.heapreplace(ph1, fin1)
            top1 = max(top1, fin1)
    return over
