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
    groups (at least one each). Returns the finish of the last pass."""
    p, m = num_stages, len(steps)
    if m == 0:
        return 0.0
    V = len(steps[0][0][1])
    acts = column_actions(schedule, p, m, virtual)
    free = [{} for _ in range(p)]  # per stage: unit -> free time
    end: dict = {}  # (kind, c, k, g) -> end time
    ptr, left = [0] * p, sum(len(a) for a in acts)
    while left:
        moved = False
        for s in range(p):
            while ptr[s] < len(acts[s]):
                a = acts[s][ptr[s]]
                c, k = a.chunk * p + s, a.micro_batch
                if not _inputs_done(a.kind, c, k, V, end):
                    break
                for g, (units, f, b, x) in enumerate(steps[k]):
                    ready = _ready(a.kind, c, k, g, V, end, x)
                    start = max([ready] + [free[s].get(u, 0.0) for u in units])
                    e = start + (f[c] if a.kind == "F" else b[c])
                    end[(a.kind, c, k, g)] = e
                    for u in units:
                        free[s][u] = e
                ptr[s] += 1
                left -= 1
                moved = True
        assert moved, "lockstep_makespan: the schedule's order deadlocked"
    return max(e for e in end.values())


def _inputs_done(kind, c, k, V, end) -> bool:
    """Group 0's input stands for all: a micro-step's groups run in one action."""
    if kind == "F":
        return c == 0 or (kind, c - 1, k, 0) in end
    return (("F", c, k, 0) if c == V - 1 else ("B", c + 1, k, 0)) in end


def _ready(kind, c, k, g, V, end, x) -> float:
    if kind == "F":
        return 0.0 if c == 0 else end[("F", c - 1, k, g)] + x[c - 1]
    if c == V - 1:
        return end[("F", c, k, g)]
    return end[("B", c + 1, k, g)] + x[c]


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
