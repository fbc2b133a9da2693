"""Local search over group layouts for the greedy planner (small and medium batches).

From the best draft's layout, a neighbour merges two groups of one degree into one group of
twice the degree, or splits one group into two halves; the sequences are then re-assigned
(earliest finish, packing as the greedy does). Improving moves are kept until none is left
or the move budget runs out. This finds, e.g., one 16-GPU group that packs two long clips
without recompute where two 8-GPU groups would each recompute one of them.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from dcp_opt.solvers.greedy.assign import assign_draft
from dcp_opt.solvers.greedy.instance import Draft, Instance, place, preferred_degrees

MAX_SEQS = 256  # larger batches skip the search (the grid already balances them well)
MAX_MOVES = 60  # neighbours evaluated at most
WORK_BUDGET = 2000  # ... and at most this many sequence placements (a few ms)


def neighbours(layout: Counter, inst: Instance) -> list[Counter]:
    deg = inst.degrees.tolist()
    index = {d: j for j, d in enumerate(deg)}
    out = []
    for j, n in sorted(layout.items()):
        up, down = index.get(deg[j] * 2), index.get(deg[j] // 2) if deg[j] % 2 == 0 else None
        if n >= 2 and up is not None:
            out.append(layout - Counter({j: 2}) + Counter({up: 1}))
        if n >= 1 and down is not None:
            out.append(layout - Counter({j: 1}) + Counter({down: 2}))
    return out


def improve(inst: Instance, cluster, draft: Draft) -> Draft:
    """The best draft found from `draft` by layout moves (itself if none improves). The
    budget counts sequence placements, not seconds, so the result is deterministic."""
    if draft.phase0 or len(inst.ids) > MAX_SEQS or not cluster.homogeneous:
        return draft
    best = draft
    layout = Counter(j for _, j, _ in draft.groups)
    usable = inst.usable
    items = np.arange(len(inst.ids))
    moves = 0
    improved = True
    while improved and moves < MAX_MOVES:
        improved = False
        for cand in neighbours(layout, inst):
            if moves * len(inst.ids) >= WORK_BUDGET:
                return best
            moves += 1
            groups = sorted(cand.elements(), key=lambda j: -inst.degrees[j])
            placed = place(groups, inst, cluster)
            if len(placed) != len(groups):
                continue
            target = best.finish_s
            pref = preferred_degrees(inst, target, usable)
            # A neighbour counts only if it beats the best by a margin: the assignment
            # stops as soon as it cannot (same moves, same result, less work).
            need = best.finish_s * (1 - 1e-9)
            d = assign_draft(inst, cluster, items, pref, placed, target, [], 0.0, True, cutoff=need)
            if d is not None and d.finish_s < need:
                best, layout, improved = d, cand, True
                best.how = ("local", *draft.how)
                break
    return best
