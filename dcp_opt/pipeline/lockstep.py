"""The makespan of micro-steps whose groups change from one micro-step to the next, as
Megatron-LM dev's dynamic CP runs them under pipeline parallelism: micro-step k is a set
of disjoint groups of a stage's units, the same on every stage; every unit of every stage
follows the schedule's order over the micro-steps (actions.stage_actions); a group's pass
on stage s starts when all its units there are free and its own input has arrived
(the previous virtual stage's pass of the same group and micro-step + its P2P, as
makespan.py). simulate() prices a plan of micro-steps (Pipeline.micro_steps, schema 4)
here, from check.micro_step_parts; Megatron's baseline prices its micro-steps here too.
With one group per micro-step spanning the same units it is makespan.column_makespan.
"""

from __future__ import annotations

import numpy as np

from .makespan import column_actions, stage_walk


def lockstep_makespan(steps, *, schedule: str, num_stages: int, virtual: int = 1) -> float:
    """steps[k]: list of (units (a range), f (V,), b (V,), x (V - 1,)) of micro-step k's
    groups (at least one each; disjoint units). Returns the finish of the last pass. Each
    action runs all of its micro-step's groups at once on arrays (a group starts at the
    later of its input and its units' latest free time, np.maximum.reduceat over the
    units' segments)."""
    p, m = num_stages, len(steps)
    if m == 0:
        return 0.0
    V = len(steps[0][0][1])
    acts = column_actions(schedule, p, m, virtual)
    prep = [_Step(st) for st in steps]
    free = np.zeros((p, max(max(st.size for st in prep), 1)))  # per stage: unit -> free time
    end = {"F": [[None] * m for _ in range(V)], "B": [[None] * m for _ in range(V)]}
    ptr, left = [0] * p, sum(len(a) for a in acts)
    while left:
        moved = False
        for s in range(p):
            while ptr[s] < len(acts[s]):
                a = acts[s][ptr[s]]
                c, k = a.chunk * p + s, a.micro_batch
                ready = _ready(a.kind, c, k, V, end, prep[k])
                if ready is None:
                    break
                e = prep[k].run(free[s], ready, a.kind, c)
                end[a.kind][c][k] = e
                ptr[s] += 1
                left -= 1
                moved = True
        assert moved, "lockstep_makespan: the schedule's order deadlocked"
    return float(max(e.max() for ends in end.values() for row in ends for e in row))


class _Step:
    """One micro-step's groups as arrays: their units' segments, and f, b (V, G), x (V - 1,
    G) by chunk, so that each action reads one contiguous row."""

    def __init__(self, groups):
        if any(groups[g][0].start > groups[g + 1][0].start for g in range(len(groups) - 1)):
            groups = sorted(groups, key=lambda gr: gr[0].start)
        units = [gr[0] for gr in groups]
        G = len(groups)
        self.f = np.array([gr[1] for gr in groups], dtype=float).T.copy()
        self.b = np.array([gr[2] for gr in groups], dtype=float).T.copy()
        self.x = np.array([gr[3] for gr in groups], dtype=float).reshape(G, -1).T.copy()
        self.deg = np.array([len(u) for u in units])
        self.size = max((u.stop for u in units), default=0)
        self.zeros = np.zeros(G)
        lo = [u.start for u in units]
        # the common case: groups tile units 0..size-1 with no gap and none idle
        self.tiled = lo[0] == 0 and all(len(u) for u in units) and all(
            units[g].stop == lo[g + 1] for g in range(G - 1))  # fmt: skip
        if self.tiled:
            self.cuts = np.array(lo, dtype=int)
            return
        self.busy = self.deg > 0  # a group of no units (every unit idles) waits for none
        lo = [u.start for u in units if len(u)]
        cuts = sorted({*lo, *(u.stop for u in units if len(u))} - {self.size})
        self.cuts = np.array(cuts, dtype=int)
        self.sel = np.searchsorted(self.cuts, lo)  # each busy group's segment
        self.units = np.concatenate([np.arange(u.start, u.stop) for u in units] or [[]])
        self.units = self.units.astype(int)

    def run(self, free: np.ndarray, ready: np.ndarray, kind: str, c: int) -> np.ndarray:
        """Every group's pass on one stage: (G,) end times; `free` (this stage's units)
        updated in place."""
        dur = self.f[c] if kind == "F" else self.b[c]
        if self.tiled:
            e = np.maximum(ready, np.maximum.reduceat(free[: self.size], self.cuts)) + dur
            free[: self.size] = np.repeat(e, self.deg)
            return e
        start = np.array(ready, dtype=float)
        if len(self.cuts):
            held = np.maximum.reduceat(free[: self.size], self.cuts)[self.sel]
            start[self.busy] = np.maximum(start[self.busy], held)
        e = start + dur
        free[self.units] = np.repeat(e[self.busy], self.deg[self.busy])
        return e


def _ready(kind, c, k, V, end, step):
    """(G,) when each group's input is there, or None while the input pass has not run (a
    micro-step's groups run in one action: group 0's input stands for all)."""
    if kind == "F":
        if c == 0:
            return step.zeros
        prev = end["F"][c - 1][k]
        return None if prev is None else prev + step.x[c - 1]
    if c == V - 1:
        return end["F"][c][k]
    prev = end["B"][c + 1][k]
    return None if prev is None else prev + step.x[c]


# ---- plans whose phases are micro-steps (Pipeline.micro_steps; docs/plan-format.md) -----
def micro_step_finish(layout, parts) -> float:
    """lockstep_makespan of check.micro_step_parts; 0 with no micro-batch at all."""
    pipe = layout.pipeline
    steps = [[(g.ranks, f, b, x) for g, f, b, x, _, _ in ps] for ps in parts]
    if not any(steps):
        return 0.0
    V = layout.num_virtual
    empty = (range(0), np.zeros(V), np.zeros(V), np.zeros(V - 1))
    steps = [s or [empty] for s in steps]  # a micro-step where every unit idles
    return lockstep_makespan(steps, schedule=pipe.schedule, num_stages=pipe.num_stages,
                             virtual=pipe.virtual_stages)  # fmt: skip


def unit_peaks(layout, parts) -> np.ndarray:
    """(p, num_units) activation bytes at peak: unit u of stage s walks the schedule's
    actions over the K micro-steps holding what its own micro-batches store (nothing where
    it idles), as makespan.stage_peaks does for a column."""
    pipe, p, n = layout.pipeline, layout.num_stages, layout.num_units
    V, K = layout.num_virtual, len(parts)
    stored, work = np.zeros((n, V, K)), np.zeros((n, V, K))
    for k, ps in enumerate(parts):
        for g, _, _, _, st, wk in ps:
            stored[g.start_rank : g.start_rank + g.degree, :, k] = st
            work[g.start_rank : g.start_rank + g.degree, :, k] = wk
    out = np.zeros((p, n))
    for s in range(p):  # makespan.walk_peak for every unit at once
        sign, c, k = stage_walk(pipe.schedule, p, K, pipe.virtual_stages, s)[:3]
        if not len(sign):
            continue
        vals = stored[:, c, k]  # (n, actions)
        peaks = np.cumsum(sign * vals, axis=1) + np.where(sign < 0, vals, 0.0) + work[:, c, k]
        out[s] = peaks.max(axis=1)
    return out
