"""The exact makespan of one column's micro-batches through a pipeline, and its memory.

The graph (PipeDream-Flush / Megatron's schedules, Narayanan et al. 2021 sec. 2.2): node
(F, c, k) is micro-batch k's forward on virtual stage c, (B, c, k) its backward. Edges:
(F, c-1, k) -> (F, c, k) and (B, c+1, k) -> (B, c, k) each with the P2P time x[c-1, k]
(x[c, k]); (F, V-1, k) -> (B, V-1, k) with none; and on each physical stage its actions in
the schedule's order (actions.stage_actions), one at a time. Every action starts as soon as
its predecessors are done, so an action's start is the longest path to it and the makespan
is the longest path overall. An order whose graph has a cycle (a stage waits for an action
that waits for it) is a deadlock: DcpOptError names the stage and action.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import DcpOptError
from .actions import stage_actions


@dataclass(frozen=True)
class ColumnSchedule:
    makespan_s: float
    busy_s: tuple[float, ...]  # per physical stage, seconds of its actions
    # per physical stage: (action text, start, end) in the order run
    timeline: tuple[tuple[tuple[str, float, float], ...], ...]


@functools.lru_cache(maxsize=256)
def column_actions(schedule: str, num_stages: int, num_micro_batches: int, virtual: int):
    """Every stage's actions (tuples of frozen Actions: safe to share)."""
    return tuple(
        stage_actions(schedule, num_stages, num_micro_batches, s, virtual_stages=virtual)
        for s in range(num_stages)
    )


def column_makespan(f, b, x, *, schedule: str, num_stages: int, virtual: int = 1,
                    timeline: bool = False) -> ColumnSchedule:  # fmt: skip
    """f, b: (V, m) seconds per virtual stage and micro-batch (lists or arrays), x: (V-1, m)
    P2P seconds of each edge. One pass per stage in action order, waiting on the pass's
    predecessor: each action is started once, when its predecessor has ended."""
    p, V = num_stages, len(f)
    m = len(f[0]) if V else 0
    f, b = [list(map(float, r)) for r in f], [list(map(float, r)) for r in b]
    x = [list(map(float, r)) for r in x]
    acts = column_actions(schedule, p, m, virtual)
    end_f = [[None] * m for _ in range(V)]
    end_b = [[None] * m for _ in range(V)]
    ptr, free = [0] * p, [0.0] * p
    busy = [0.0] * p
    lines: list[list] = [[] for _ in range(p)]
    left = sum(len(a) for a in acts)
    while left:
        moved = False
        for s in range(p):
            while ptr[s] < len(acts[s]):
                a = acts[s][ptr[s]]
                c, k = a.chunk * p + s, a.micro_batch
                ready = _ready(a.kind, c, k, V, end_f, end_b, x)
                if ready is None:
                    break
                start = max(free[s], ready)
                dur = f[c][k] if a.kind == "F" else b[c][k]
                free[s] = start + dur
                (end_f if a.kind == "F" else end_b)[c][k] = free[s]
                busy[s] += dur
                if timeline:
                    lines[s].append((str(a), start, free[s]))
                ptr[s] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [f"stage {s} at {acts[s][ptr[s]]}" for s in range(p) if ptr[s] < len(acts[s])]
            raise DcpOptError(f"schedule: {schedule!r} deadlocks: {', '.join(stuck)}")
    return ColumnSchedule(max(free) if m else 0.0, tuple(busy), tuple(map(tuple, lines)))


def _ready(kind, c, k, V, end_f, end_b, x):
    """When (kind, c, k)'s predecessor's output has arrived, or None if it has not run."""
    if kind == "F":
        if c == 0:
            return 0.0
        e = end_f[c - 1][k]
        return None if e is None else e + x[c - 1][k]
    if c == V - 1:
        return end_f[c][k]
    e = end_b[c + 1][k]
    return None if e is None else e + x[c][k]


def stage_peaks(stored, work, *, schedule: str, num_stages: int, virtual: int = 1) -> list:
    """Per physical stage, the peak activation bytes over time: walking its actions, a
    forward adds the micro-batch's stored bytes on that chunk and a backward frees them; the
    peak is the most held while an action runs (held + that action's working set)."""
    p, m = num_stages, len(stored[0]) if len(stored) else 0
    out = []
    for s, acts in enumerate(column_actions(schedule, p, m, virtual)):
        held = peak = 0.0
        for a in acts:
            c, k = a.chunk * p + s, a.micro_batch
            if a.kind == "F":
                held += stored[c][k]
                peak = max(peak, held + work[c][k])
            else:
                peak = max(peak, held + work[c][k])
                held -= stored[c][k]
        out.append(peak)
    return out
