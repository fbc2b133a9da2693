"""Greedy planner, steps 1 and 2 and shared data: the per-sequence instance every optimizing
planner reads (greedy, CP-SAT), the draft plan as index lists, the preferred degree of each
sequence for a target makespan, and the group layout with its aligned placement.
See solvers/greedy/ for the whole method."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.cost import CostModel
from dcp_opt.table import best_capacity, plan_table


@dataclass(frozen=True)
class Instance:
    """What the greedy and CP-SAT planners read: per-sequence times, per-degree constants."""

    ids: np.ndarray  # (n,) sequence ids
    degrees: np.ndarray  # (D,) allowed degrees
    time: np.ndarray  # (n, D) seconds alone at r_min; inf where it does not fit
    marginal: np.ndarray  # (n, D) the same less every per-micro-batch constant
    feats: np.ndarray  # (n, F) additive features (cost.py)
    r_min: np.ndarray  # (n, D)
    tokens: np.ndarray  # (n,)
    const: np.ndarray  # (D,) per-micro-batch constant shared by packed sequences
    cap0: np.ndarray  # (D,) tokens a micro-batch may hold without recompute
    num_gpus: int
    finish_lb: float  # analytic lower bound on the latest finish (no sync)
    sync: float
    _lists: dict = field(default_factory=dict, compare=False, repr=False)

    def memo(self, name: str, make):
        """A value derived from the instance, made once: every candidate of the search
        reads it."""
        if name not in self._lists:
            self._lists[name] = make()
        return self._lists[name]

    def lists(self) -> tuple[list, list, list]:
        """time, r_min and tokens as Python lists (the per-sequence loop reads these)."""
        return self.memo(
            "lists", lambda: (self.time.tolist(), self.r_min.tolist(), self.tokens.tolist())
        )

    @property
    def usable(self) -> np.ndarray:
        """(D,) degrees at which some sequence fits."""
        return self.memo("usable", lambda: np.isfinite(self.time).any(axis=0))


# validate() accepts a micro-batch up to capacity x (1 + 1e-9): token capacities are scaled by
# a slack inside that, so a micro-batch that fills memory exactly stays in the model (a margin
# below 1 would drop it and let the model call a worse plan optimal).
CAP_SLACK = 1 + 1e-10


def make_instance(batch: Batch, cost: CostModel) -> Instance:
    tab = plan_table(batch, cost)  # seq_table unless a degree's placements cost differently
    deg = np.asarray(tab.degrees)
    const = tab.const
    per_tok = float(cost.memory(1.0, 1, 0)) - cost.fixed_bytes()
    cap = np.array([best_capacity(cost, int(d)) for d in deg])
    cap0 = np.maximum(cap - cost.fixed_bytes(), 0.0) * deg / per_tok * CAP_SLACK
    lb = lower_bound(batch, cost)
    return Instance(
        ids=np.array([s.id for s in batch.sequences]),
        degrees=deg,
        time=tab.time,
        marginal=tab.time_marginal,
        feats=tab.feats,
        r_min=tab.r_min,
        tokens=tab.tokens,
        const=const,
        cap0=cap0,
        num_gpus=cost.cluster.num_gpus,
        finish_lb=lb.value_s - lb.grad_sync_s,
        sync=lb.grad_sync_s,
    )


@dataclass
class Draft:
    """A candidate plan as index lists: phase 0 (optional) and the main phase."""

    phase0: list[tuple[int, int, list[tuple[list[int], int]]]]  # (start, degree, bins)
    groups: list[tuple[int, int, list[tuple[list[int], int]]]]
    finish_s: float  # exact on homogeneous clusters
    how: tuple = ()  # which candidate made it (replayed on other blocks by blocks.py)


# ---- step 1: degrees ------------------------------------------------------------------
def preferred_degrees(inst: Instance, target: float, usable: np.ndarray) -> np.ndarray:
    """Index of the least-work degree finishing within `target`, else the fastest one."""
    if usable is inst.usable:  # the search's case: its tables are made once per instance
        t, work_all, fastest = inst.memo("pref", lambda: _pref_tables(inst, usable))
    else:
        t, work_all, fastest = _pref_tables(inst, usable)
    work = np.where(t <= target, work_all, np.inf)
    pref = np.argmin(work, axis=1)
    none = ~np.isfinite(work[np.arange(len(pref)), pref])
    pref[none] = fastest[none]
    return pref


def _pref_tables(inst: Instance, usable: np.ndarray):
    """(time at usable degrees, GPU-work d * t there, fastest usable degree per sequence)."""
    t = np.where(usable[None, :], inst.time, np.inf)
    return t, t * inst.degrees[None, :], np.argmin(t, axis=1)


# ---- step 2: layout -------------------------------------------------------------------
def layout(
    inst: Instance, items: np.ndarray, pref: np.ndarray, target: float, ranks: int
) -> list[int]:
    """Degree indices of the groups, summing to at most `ranks` GPUs, widest first."""
    deg = inst.degrees
    p = pref[items]
    tp = inst.time[items, p]
    frac = np.bincount(p, weights=tp, minlength=len(deg)) / max(target, 1e-12)
    # A sequence longer than T/2 cannot share a group within T: give each its own.
    big = np.bincount(p[tp > target / 2], minlength=len(deg))
    frac = np.maximum(frac, big)
    # Each degree's share can be no more than the groups of it that fit: a time too large
    # for the target (inf or nan from an extreme figure) would otherwise floor to a garbage
    # count, and the leftover loop below would run for ever. Finite shares are unchanged.
    most = ranks // deg
    frac = np.where(np.isfinite(frac), frac, most)
    need = float((frac * deg).sum())
    if need > ranks:
        frac = frac * ranks / need
    counts = np.minimum(np.floor(frac), most).astype(int)
    left = ranks - int((counts * deg).sum())
    assert 0 <= left <= ranks, (left, ranks)  # so each loop below ends within `ranks` steps
    order = np.argsort(-(frac - counts) * deg, kind="stable").tolist()
    frac_l, counts_l, deg_l = frac.tolist(), counts.tolist(), deg.tolist()  # scalar reads
    for j in order:
        if frac_l[j] > counts_l[j] and deg_l[j] <= left:
            counts_l[j] += 1
            left -= deg_l[j]
    out = [j for j in range(len(deg_l) - 1, -1, -1) for _ in range(counts_l[j])]
    # Leftover ranks: the widest group that fits, among degrees some sequence can use.
    useful = np.flatnonzero(inst.usable).tolist()
    for j in sorted(useful, key=lambda j: -deg_l[j]):
        while deg_l[j] <= left:
            out.append(j)
            left -= deg_l[j]
    return sorted(out, key=lambda j: -deg_l[j])


def place(groups: list[int], inst: Instance, cluster, first: int = 0) -> list[tuple[int, int]]:
    """(start, degree index) on aligned ranges: buddy order, scanning only on a clash."""
    used = bytearray(inst.num_gpus)  # 1 = taken; bytearray.find checks a range in C
    used[:first] = b"\x01" * first
    deg = inst.degrees.tolist()
    out, cursor = [], first
    for j in groups:
        d = deg[j]
        start = cursor if _fits(used, cursor, d, cluster) else _scan(used, d, cluster)
        if start is None:
            continue
        used[start : start + d] = b"\x01" * d
        out.append((start, j))
        cursor = start + d
    return out


def _fits(used: bytearray, start: int, d: int, cluster) -> bool:
    if cluster.topology is not None:  # aligned inside the fabric's domains: placements()
        ok = start + d <= len(used) and cluster.is_placement(start, d)
        return ok and used.find(1, start, start + d) < 0
    if start % d or start + d > len(used) or used.find(1, start, start + d) >= 0:
        return False
    gpn = cluster.gpus_per_node
    # An aligned group whose degree divides the node size stays inside one node.
    return d > gpn or gpn % d == 0 or not cluster.spans_nodes(start, d)


def _scan(used: bytearray, d: int, cluster) -> int | None:
    starts = range(0, len(used) - d + 1, d) if cluster.topology is None else cluster.placements(d)
    for s in starts:
        if _fits(used, s, d, cluster):
            return s
    return None
