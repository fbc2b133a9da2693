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
grows least. In a slot, sequences that need no recompute at w share a micro-batch up to
cap0[w] tokens (the per-micro-batch constant paid once: issue 13, five 432,000-token videos
and three small sequences, 2d-long 2M on h200x32, 1.649 -> 1.569 s, the small ones packed
with the fifth video at degree 32); the split prices phase 1 packed the same way.
Phase 1 (every rank, degree-j groups, each starting after its ranks' phase 0) is then
re-assigned by the greedy's step 3 (assign.rule_draft), and also kept as the split
assigned it (_build); both drafts' finishes are exact. j: the degree of least packed work;
w: every wider degree the whole batch fits at; f: GRID. Every (w, f) is split (plain
lists, heaps), and the KEEP of least estimated finish (distinct phase 0s) are drafted;
long-then(j, f) (build_long_then) for f in GRID_LONG.
Tried only where the best draft so far is more than
MIN_GAP above the bound (elsewhere it can gain little) and on at most MAX_SEQS sequences:
+10-40 ms of CPU on the issue's h200x32 batches (73 and 306 sequences, 2-core shared dev
machine), nothing on the preset's 64 x 512 (above MAX_SEQS).
"""

from __future__ import annotations

import heapq

import numpy as np
from dcp_opt.solvers.greedy.assign import assign_draft
from dcp_opt.solvers.greedy.instance import Draft, Instance, layout, place, preferred_degrees

GRID = (1.0, 1.03, 1.06, 1.1)
MIN_GAP = 0.02
MAX_SEQS = 400
GRID_LONG = (1.0, 1.06)  # long-then's targets
KEEP = 3  # candidates drafted (assign.rule_draft): the best by the split's own finish


def specs(inst: Instance, cluster, best: float) -> list[tuple[tuple, object]]:
    """(how, build) of the overflow-first candidates worth drafting against `best`: every
    (w, f) is split (cheap), the KEEP of least estimated finish are returned."""
    n = len(inst.ids)
    if n > MAX_SEQS or not best > inst.finish_lb * (1 + MIN_GAP):
        return []
    work = np.where(np.isfinite(inst.marginal), inst.marginal, np.inf) * inst.degrees
    usable = np.flatnonzero(inst.usable).tolist()
    j = min(usable, key=lambda k: float(np.where(np.isfinite(work[:, k]), work[:, k], 0).sum()))
    scored, seen = [], set()
    for w in usable:
        if inst.degrees[w] <= inst.degrees[j] or not np.isfinite(inst.time[:, w]).all():
            continue
        for f in GRID:
            spec, est, own = _build(inst, cluster, j, w, f)
            scored.append((est, ("overflow-first", j, w, f), spec, own))
    scored.sort(key=lambda x: x[0])
    out = []
    for est, how, spec, own in scored:
        key = (_key(spec[0]), tuple(spec[3]))  # several (w, f) often split alike: KEEP distinct
        if key in seen:
            continue
        seen.add(key)
        out.append((how, lambda spec=spec: spec))
        if cluster.homogeneous and np.isfinite(est):
            out.append(((*how, "split"), lambda own=own: own))
        if len(seen) == KEEP:
            break
    for f in GRID_LONG:
        how = ("long-then", j, f)
        out.append((how, lambda f=f: build_long_then(inst, cluster, j, f)))
    return out


def build_long_then(inst: Instance, cluster, j: int, f: float):
    """long-then(j, f): the sequences that take longer than T = f x the bound's finish at
    j run first, each at its least-work degree that finishes within T (greedy step 1), on
    groups laid out and filled by the greedy's steps 2-3 for them alone; then every rank
    forms degree-j groups for the rest, each starting after its ranks' phase 0. So a long
    sequence's SP group does not fill its remaining time with short sequences at its SP
    degree (under SP overhead, 1.15-1.45x their degree-1 work). None: no candidate."""

    target = inst.finish_lb * f
    long = ~(inst.time[:, j] <= target)
    pref = preferred_degrees(inst, target, inst.usable)
    items = np.flatnonzero(long)
    deg = inst.degrees.tolist()
    placed = place([j] * (inst.num_gpus // deg[j]), inst, cluster)
    if len(items) == 0:
        return [], 0.0, np.full(len(inst.ids), j), placed
    groups0 = place(layout(inst, items, pref, target, inst.num_gpus), inst, cluster)
    d0 = assign_draft(inst, cluster, items, pref, groups0, target, [], 0.0, True)
    if d0 is None:  # a long sequence fits none of its groups: no candidate
        return None
    rank_load = np.zeros(inst.num_gpus)
    for s, jj, bins in d0.groups:
        rank_load[s : s + deg[jj]] = sum(_bin_time(inst, idx, jj) for idx, _ in bins)
    base = [float(rank_load[s : s + deg[j]].max()) for s, _ in placed]
    return d0.groups, base, np.where(long, -1, j), placed


def _bin_time(inst: Instance, idx: list, j: int) -> float:
    """Seconds of one micro-batch at degree index j: its first sequence's time alone, and
    the marginal time of each packed one (packed micro-batches need no recompute, where
    time - marginal is the shared constant const[j]: dcp_opt/table.py _kind_table)."""
    return float(inst.time[idx[0], j] + inst.marginal[idx[1:], j].sum())


def rebuild(inst: Instance, cluster, how: tuple):
    """The spec of candidate `how` (a Draft.how of this module) on `inst` (search.replay),
    or the split's own draft for an ("overflow-first", ..., "split") one."""
    if how[0] == "long-then":
        return build_long_then(inst, cluster, *how[1:])
    if how[-1] == "split":
        return _build(inst, cluster, *how[1:-1])[2] if cluster.homogeneous else None
    return build(inst, cluster, *how[1:])


def build(inst: Instance, cluster, j: int, w: int, f: float):
    """(phase0, base, pref, placed) as the builds of rules.py give them (assign.rule_draft),
    `base` per phase-1 group: the phase-0 load of its ranks."""
    return _build(inst, cluster, j, w, f)[0]


def _key(phase0: list) -> tuple:
    return tuple((s, jw, tuple((tuple(idx), r) for idx, r in b)) for s, jw, b in phase0)


def _build(inst: Instance, cluster, j: int, w: int, f: float):
    """build()'s spec, the split's finish, and the split's own draft: its phase-1
    assignment kept, where assign.rule_draft re-assigns phase 1 longest first. The split
    fills each group up to T (the fullest that meets it), which LPT does not: 2d-long 2M
    step 180 (three 432,000-token videos, four mid-size ones) 1.423 -> 1.350 s with a
    mid-size one first at degree 16 under two of the videos. Its finish is exact where
    every group runs at full speed with the same memory (cluster.homogeneous)."""
    deg = inst.degrees.tolist()
    slots = place([w] * (inst.num_gpus // deg[w]), inst, cluster)
    placed = place([j] * (inst.num_gpus // deg[j]), inst, cluster)
    # parent[g]: the phase-0 slot holding phase-1 group g (j < w: aligned groups nest)
    rank_slot = [-1] * inst.num_gpus
    for q, (s, _) in enumerate(slots):
        rank_slot[s : s + deg[w]] = [q] * deg[w]
    parent = [rank_slot[s] for s, _ in placed]
    bins, load0, est, bins1 = _split(inst, j, w, parent, len(slots), inst.finish_lb * f)
    phase0 = [(s, jw, b) for (s, jw), b in zip(slots, bins, strict=True) if b]
    over = np.zeros(len(inst.ids), dtype=bool)
    for b in bins:
        over[[i for idx, _ in b for i in idx]] = True
    base = [load0[q] if q >= 0 else 0.0 for q in parent]
    groups = [(s, jj, b) for (s, jj), b in zip(placed, bins1, strict=True) if b]
    if over.all():  # one phase of degree-w groups: in that form local.improve, which
        # leaves two-phase drafts alone, still searches its layout (combined 2d-balanced 2M
        # seed 0: 2.347 s as phase 0, 2.314 s from the local search on uniform degree 8)
        full = np.full(len(inst.ids), w)
        return ([], 0.0, full, slots), est, Draft([], phase0, est)
    return (phase0, base, np.where(over, -1, j), placed), est, Draft(phase0, groups, est)


def _split(inst: Instance, j: int, w: int, parent: list, n_slots: int, target: float):
    """Phase-0 bins per slot, slot loads and the latest finish (module docstring): longest
    first at j, each sequence to the phase-1 group that finishes it first if that meets T,
    else into an open phase-0 slot (the fullest that meets T), else into a new slot, else
    wherever the latest finish grows least. Phase 1's assignment is the split's own draft
    (_build) and steers rule_draft's. Plain lists and a heap of phase-1 loads per slot:
    this runs for every (w, f)."""
    t_j = inst.time[:, j].tolist()
    load0 = [0.0] * (n_slots + 1)  # per slot; last: ranks under no slot (stays 0)
    top1 = [0.0] * (n_slots + 1)  # busiest phase-1 load under each slot (last: no slot)
    load1 = [0.0] * len(parent)
    par = [q if q >= 0 else n_slots for q in parent]
    slots = _Slots(inst, w, n_slots)
    groups1 = _Slots(inst, j, len(par))  # phase 1 packs too (greedy's step 4)
    # a heap of phase-1 loads per slot (phase 0 growing shifts all of a slot's groups) and
    # each slot's earliest phase-1 finish, (finish, group, slot): min() is the earliest
    heaps: list[list] = [[] for _ in range(n_slots + 1)]
    for g, q in enumerate(par):
        heaps[q].append((0.0, g))  # in g order: already a heap
    first = [(h[0][0], h[0][1], q) if h else (np.inf, -1, q) for q, h in enumerate(heaps)]
    order = sorted(range(len(t_j)), key=lambda i: -t_j[i])
    for i in order:
        fin1, g, p = min(first)
        tj, packs = groups1.price(i, g)
        if fin1 + tj <= target:
            q = -1
        else:
            add = slots.costs(i)  # packed: its marginal time only
            worst = [a + b + c for a, b, c in zip(load0, top1, add, strict=False)]
            q = _slot_for(slots.opened, worst, load0, target, fin1 + tj)
        if q < 0:
            load1[g] += tj
            heapq.heapreplace(heaps[p], (load1[g], g))
            top1[p] = max(top1[p], load1[g])
            groups1.put(i, g, packs)
        else:
            load0[q] += add[q]
            slots.put(i, q, slots.packs(i, q))
            p = q
        if heaps[p]:
            first[p] = (load0[p] + heaps[p][0][0], heaps[p][0][1], p)
    latest = max(a + b for a, b in zip(load0, top1, strict=True))
    return slots.bins, load0[:n_slots], latest, groups1.bins


def _slot_for(opened: list, worst: list, load0: list, target: float, fin1: float) -> int:
    """The phase-0 slot of a sequence phase 1 cannot finish within T (`fin1`: its finish
    there): the fullest open slot that meets T, else the first that does, else the one
    whose latest finish grows least unless phase 1 finishes it no later; -1: phase 1."""
    if not worst or worst[0] == float("inf"):  # it fits no slot (same time in every one)
        return -1
    first, full = -1, -1
    for q, x in enumerate(worst):
        if x <= target:
            if first < 0:
                first = q
            if opened[q] and (full < 0 or load0[q] > load0[full]):
                full = q
    if full >= 0 or first >= 0:
        return full if full >= 0 else first
    q = min(range(len(worst)), key=worst.__getitem__)
    return -1 if fin1 <= worst[q] else q


class _Slots:
    """Micro-batches of the groups of one degree (w: phase-0 slots; j: phase-1 groups, to
    steer only). A sequence that needs no recompute at w joins its group's open
    micro-batch (also recompute-free) while their tokens fit cap0[w]: the per-micro-batch
    constant const[w] is paid once, so the group grows by the sequence's marginal time only
    (greedy/instance.py Instance; greedy's step 4, _Groups.one_by_one, packs by the same rule),
    and the draft's finish stays exact (the cost is affine in the summed features:
    dcp_opt/table.py _kind_table). Phase 1 is priced packed too, else phase 0 would look
    cheaper than it is against it and take short sequences at an inefficient degree."""

    def __init__(self, inst: Instance, w: int, n_slots: int):
        self.t_w, self.r_w = inst.time[:, w].tolist(), inst.r_min[:, w].tolist()
        self.tok = inst.tokens.tolist()
        self.const, self.cap = float(inst.const[w]), float(inst.cap0[w])
        self.opened = [False] * n_slots
        self.bins: list[list] = [[] for _ in range(n_slots)]
        self.open_tok = [-1.0] * n_slots  # tokens of the slot's open micro-batch; -1: none

    def packs(self, i: int, q: int) -> bool:
        """Whether sequence i joins slot q's open micro-batch."""
        ot = self.open_tok[q]
        return self.r_w[i] == 0 and ot >= 0 and ot + self.tok[i] <= self.cap

    def price(self, i: int, q: int) -> tuple[float, bool]:
        """(seconds sequence i adds to slot q, packs(i, q))."""
        if self.packs(i, q):
            return self.t_w[i] - self.const, True
        return self.t_w[i], False

    def costs(self, i: int) -> list[float]:
        """cost(i, q) of every slot q (one pass: the split's inner loop)."""
        t = self.t_w[i]
        if self.r_w[i] != 0:
            return [t] * len(self.open_tok)
        room, packed = self.cap - self.tok[i], t - self.const
        return [packed if 0 <= ot <= room else t for ot in self.open_tok]

    def put(self, i: int, q: int, packs: bool) -> None:
        if packs:
            self.bins[q][-1][0].append(i)
            self.open_tok[q] += self.tok[i]
        else:
            r = int(self.r_w[i])
            self.bins[q].append(([i], r))
            # a micro-batch without recompute stays open for packing; one with recompute
            # runs alone (greedy's step 4), and the next open one starts after it
            self.open_tok[q] = self.tok[i] if r == 0 else -1.0
        self.opened[q] = True
