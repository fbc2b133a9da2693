"""Overflow-first candidates of the greedy planner: the sequences a packing at the base
degree cannot hold run first, in wider groups, on as few ranks as they need.

Two shapes the other candidates miss (issue 19, h200x32):
- a coarse packing: 24 videos of 9 s and 23 of 3.4-4.4 s on 32 ranks under sp-step; at
  degree 1 a rank holds one video and nothing over 1.6 s, or three mid-size ones (12.2 s),
  against 10.6 s of work per rank. Some mid-size ones first at degree 8 on every rank:
  12.24 -> 11.16 s;
- a few long sequences among hundreds of short ones under SP overhead: single-phase layouts
  give the long ones SP groups and then fill those groups' time with short sequences at
  the SP degree, 1.35-1.45x their degree-1 work. The long ones first on two degree-8
  groups, then every rank at degree 1: 2.03 -> 1.85 s (2d-short 2M, combined).

overflow-first(j, w, f), T = f x the analytic bound's finish: sequences longest first (time
at base degree j); each goes to the degree-j group that finishes it first (after its
ranks' phase-0 load) if that meets T; else into an open phase-0 slot of degree w (the
fullest whose ranks still meet T), else into a new slot, else wherever the latest finish
grows least. Phase 1 (every rank, degree-j groups, each starting after its ranks' phase 0)
is then re-assigned by the greedy's step 3 (greedy.rule_draft), so the draft's finish is
exact up to packing. j: the degree of least packed work; w: every wider degree the whole
batch fits at; f: GRID. Tried only where the best draft so far is more than MIN_GAP above
the bound (elsewhere it can gain little) and on at most MAX_SEQS sequences.
"""

from __future__ import annotations

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
    """(phase0, base, pref, placed) as greedy_rules' builds give them (greedy.rule_draft),
    `base` per phase-1 group: the phase-0 load of its ranks."""
    deg = inst.degrees.tolist()
    slots = place([w] * (inst.num_gpus // deg[w]), inst, cluster)
    placed = place([j] * (inst.num_gpus // deg[j]), inst, cluster)
    # parent[g]: the phase-0 slot holding phase-1 group g (j < w: aligned groups nest)
    rank_slot = np.full(inst.num_gpus, -1)
    for q, (s, _) in enumerate(slots):
        rank_slot[s : s + deg[w]] = q
    parent = np.array([rank_slot[s] for s, _ in placed])
    bins, load0 = _split(inst, j, w, parent, len(slots), inst.finish_lb * f)
    phase0 = [(s, jw, b) for (s, jw), b in zip(slots, bins, strict=True) if b]
    over = np.zeros(len(inst.ids), dtype=bool)
    for b in bins:
        over[[i for (i,), _ in b]] = True
    base = [float(load0[q]) if q >= 0 else 0.0 for q in parent.tolist()]
    return phase0, base, np.where(over, -1, j), placed


def _split(inst: Instance, j: int, w: int, parent: np.ndarray, n_slots: int, target: float):
    """Phase-0 bins per slot and slot loads (module docstring): longest first at j, each
    sequence to the phase-1 group that finishes it first if that meets T, else into an
    open phase-0 slot (the fullest that meets T), else into a new slot, else wherever the
    latest finish grows least. Loads of phase 1 only steer: rule_draft re-assigns."""
    t, r_w = inst.time, inst.r_min[:, w]
    load0 = np.zeros(n_slots)
    load1 = np.zeros(len(parent))
    opened = np.zeros(n_slots, dtype=bool)
    bins: list[list] = [[] for _ in range(n_slots)]
    # a phase-1 group outside every slot (a remainder of ranks) has no phase-0 load
    par = np.where(parent >= 0, parent, n_slots)
    order = np.argsort(-np.where(np.isfinite(t[:, j]), t[:, j], np.inf), kind="stable")
    for i in order.tolist():
        tj, tw = t[i, j], t[i, w]
        total = np.append(load0, 0.0)[par] + load1
        g = int(np.argmin(total))
        fin1 = total[g] + tj
        if fin1 <= target:
            load1[g] += tj
            continue
        worst = _slot_worst(load0, load1, par, n_slots) + tw  # finish of each slot with i
        fits = worst <= target
        if not np.isfinite(tw):
            q = -1
        elif (fits & opened).any():
            q = int(np.argmax(np.where(fits & opened, load0, -np.inf)))
        elif (fits & ~opened).any():
            q = int(np.argmax(fits & ~opened))
        else:
            q = int(np.argmin(worst))
            if np.isfinite(tj) and fin1 <= worst[q]:
                q = -1
        if q < 0:
            load1[g] += tj
        else:
            load0[q] += tw
            opened[q] = True
            bins[q].append(([i], int(r_w[i])))
    return bins, load0


def _slot_worst(load0: np.ndarray, load1: np.ndarray, par: np.ndarray, n_slots: int):
    """(n_slots,) each slot's latest finish: its phase-0 load plus its busiest child."""
    top = np.zeros(n_slots + 1)
    np.maximum.at(top, par, load1)
    return load0 + top[:n_slots]
