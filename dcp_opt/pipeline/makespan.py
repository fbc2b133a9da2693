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

import numpy as np

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
    stored, work = np.asarray(stored, dtype=float), np.asarray(work, dtype=float)
    m = stored.shape[1] if stored.ndim == 2 else 0
    return [walk_peak(stage_walk(schedule, num_stages, m, virtual, s), stored, work)[0]
            for s in range(num_stages)]  # fmt: skip


@functools.lru_cache(maxsize=1024)
def stage_walk(schedule: str, num_stages: int, num_micro_batches: int, virtual: int, stage: int):
    """Stage `stage`'s actions as arrays: sign (+1 forward, -1 backward), virtual stage c,
    micro-batch k; and per micro-batch the index of its first forward and first backward."""
    p, m = num_stages, num_micro_batches
    acts = column_actions(schedule, p, m, virtual)[stage]
    sign = np.array([1.0 if a.kind == "F" else -1.0 for a in acts])
    c = np.array([a.chunk * p + stage for a in acts], dtype=np.intp)
    k = np.array([a.micro_batch for a in acts], dtype=np.intp)
    first_f, first_b = np.full(m, len(acts)), np.full(m, len(acts))
    for idx in range(len(acts) - 1, -1, -1):
        (first_f if sign[idx] > 0 else first_b)[k[idx]] = idx
    return sign, c, k, first_f, first_b


def walk_peak(walk, stored: np.ndarray, work: np.ndarray) -> tuple[float, int]:
    """(peak bytes, the action index where it is first reached) of one stage's walk: held
    after each action is the running sum of + stored (forward) and - stored (backward); a
    backward's peak is before it frees, a forward's after it stores."""
    if not len(walk[0]):
        return 0.0, 0
    peaks = held_while_running(walk, stored, work)
    i = int(np.argmax(peaks))
    return float(peaks[i]), i


def held_while_running(walk, stored: np.ndarray, work: np.ndarray) -> np.ndarray:
    """Per action of a stage's walk, the bytes held while it runs: the running sum of +
    stored (forward) and - stored (backward), a backward counted before it frees, plus the
    action's working set."""
    sign, c, k = walk[:3]
    vals = stored[c, k]
    return np.cumsum(sign * vals) + np.where(sign < 0, vals, 0.0) + work[c, k]


@functools.lru_cache(maxsize=256)
def topological_actions(schedule: str, num_stages: int, num_micro_batches: int, virtual: int):
    """Every action of a column as (stage, is_forward, virtual stage c, position k) in an
    order where each comes after its predecessors (its stage's previous action and its
    dependency edge), the same for any durations: the order column_makespan runs them in
    with unit durations (the dependencies are the graph's, not the times')."""
    p, m = num_stages, num_micro_batches
    acts = column_actions(schedule, p, m, virtual)
    V = p * virtual
    done_f = [[False] * m for _ in range(V)]
    done_b = [[False] * m for _ in range(V)]
    ptr, out = [0] * p, []
    left = sum(len(a) for a in acts)
    while left:
        for s in range(p):
            while ptr[s] < len(acts[s]):
                a = acts[s][ptr[s]]
                c, k = a.chunk * p + s, a.micro_batch
                fwd = a.kind == "F"
                if fwd and c and not done_f[c - 1][k]:
                    break
                if not fwd and not (done_f[c][k] if c == V - 1 else done_b[c + 1][k]):
                    break
                (done_f if fwd else done_b)[c][k] = True
                out.append((s, fwd, c, k))
                ptr[s] += 1
                left -= 1
    return tuple(out)


def batch_makespans(f, b, x, orders, *, schedule: str, num_stages: int, virtual: int = 1):
    """The exact makespans (column_makespan's) of K orders of one column's micro-batches at
    once: f, b (V, m), x (V - 1, m) arrays, orders (K, m) -> (K,). One pass over the
    actions in topological order, each a vector operation over the K orders."""
    orders = np.asarray(orders, dtype=np.intp)
    K, m = orders.shape
    p = num_stages
    V = len(f)
    if m == 0:
        return np.zeros(K)
    f, b = np.asarray(f, dtype=float), np.asarray(b, dtype=float)
    F, B = f[:, orders], b[:, orders]  # (V, K, m)
    X = np.asarray(x, dtype=float).reshape(V - 1, f.shape[1])[:, orders]
    end_f = np.zeros((V, m, K))
    end_b = np.zeros((V, m, K))
    free = np.zeros((p, K))
    for s, fwd, c, k in topological_actions(schedule, p, m, virtual):
        if fwd:
            ready = end_f[c - 1, k] + X[c - 1, :, k] if c else 0.0
            e = np.maximum(free[s], ready) + F[c, :, k]
            end_f[c, k] = e
        else:
            ready = end_f[c, k] if c == V - 1 else end_b[c + 1, k] + X[c, :, k]
            e = np.maximum(free[s], ready) + B[c, :, k]
            end_b[c, k] = e
        free[s] = e
    return free.max(axis=0)
