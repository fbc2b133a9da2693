"""Predict a plan's step: per-rank timeline, step time, imbalance, memory, communication.

Semantics (the same as the runtime's): a group starts a phase when all its members are free;
it runs its micro-batches back to back; after the last phase every rank joins the step's
world collectives (runtime/sharding.py: the gradient all-reduce, or in the sharded modes a
closing one-token micro-step and the reduce-scatter; the all-gather of the weights at the
step's start is charged there too), so step time = latest finish + gradient sync
(CostModel.grad_sync_time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .batch import Batch
from .cost import CostModel
from .plan import Plan


@dataclass(frozen=True)
class Event:
    """One micro-batch on one group (all members share it)."""

    phase: int
    start_rank: int
    degree: int
    index: int
    sequence_ids: tuple[int, ...]
    recompute_layers: int
    start_s: float
    compute_s: float
    recompute_s: float
    comm_s: float
    memory_bytes: float
    kind: str = "ulysses"  # the group's SP kind

    @property
    def end_s(self) -> float:
        return self.start_s + self.compute_s + self.recompute_s + self.comm_s


@dataclass(frozen=True)
class SimResult:
    step_time_s: float
    finish_s: float
    grad_sync_s: float
    busy_s: np.ndarray  # per rank, micro-batch time
    idle_s: np.ndarray  # per rank, waiting before the gradient sync
    peak_memory_bytes: np.ndarray
    events: tuple[Event, ...]
    comm_s: float  # GPU-seconds in all-to-alls
    recompute_s: float  # GPU-seconds recomputing
    # Bytes each rank sends in the step's world-wide collectives under the cost model's
    # optimizer_sharding (CostModel.step_collectives: all-reduce, or all-gather of the
    # weights + reduce-scatter of the gradients), and their time at the gradient-sync rate.
    collectives: dict = field(default_factory=dict)
    collectives_s: float = 0.0
    # Seconds of the sharded modes' closing one-token micro-step (CostModel.closing_step_time),
    # part of grad_sync_s like the collectives
    closing_step_s: float = 0.0

    @property
    def num_ranks(self) -> int:
        return len(self.busy_s)

    @property
    def imbalance(self) -> float:
        """Idle share of the GPU-time before the gradient sync."""
        total = self.finish_s * self.num_ranks
        return float(self.idle_s.sum() / total) if total > 0 else 0.0

    @property
    def comm_share(self) -> float:
        busy = float(self.busy_s.sum())
        return self.comm_s / busy if busy > 0 else 0.0

    def summary(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "finish_s": self.finish_s,
            "grad_sync_s": self.grad_sync_s,
            "imbalance": self.imbalance,
            "comm_share": self.comm_share,
            "recompute_share": self.recompute_s / max(float(self.busy_s.sum()), 1e-30),
            "peak_memory_gb": float(self.peak_memory_bytes.max()) / 1e9,
            "num_micro_batches": len(self.events),
            "collectives": dict(self.collectives),
            "collectives_s": self.collectives_s,
            "closing_step_s": self.closing_step_s,
        }


def simulate(plan: Plan, batch: Batch, cost: CostModel, *, events: bool = True) -> SimResult:
    """Run the plan on the cost model. `events=False` skips the per-micro-batch timeline
    (`events` is then empty; every total is the same): planners need only the totals.
    Per-rank clocks are Python lists: a group touches at most a few dozen ranks, where a
    list slice beats a numpy call."""
    cluster = cost.cluster
    n = cluster.num_gpus
    ready = [0.0] * n
    busy = [0.0] * n
    peak = [cost.fixed_bytes()] * n
    out: list[Event] = []
    comm_total = rec_total = 0.0
    feats = cost.batch_features(batch)  # cached rows; a micro-batch sums its members' rows
    row = _rows(batch, cost)
    for p, phase in enumerate(plan.phases):
        groups = [g for g in phase.groups if g.micro_batches]
        if not groups:
            continue
        c, r, m, mem, cuts = _phase_parts(groups, feats, row, cost)
        dur = (c + r + m).tolist()
        comm = np.add.reduceat(m, cuts[:-1]).tolist()
        rec = np.add.reduceat(r, cuts[:-1]).tolist()
        top = np.maximum.reduceat(mem, cuts[:-1]).tolist()
        cl = cuts.tolist()
        for k, g in enumerate(groups):
            a, b, s, d = cl[k], cl[k + 1], g.start_rank, g.degree
            t0 = t = max(ready[s : s + d])
            starts = []
            for x in dur[a:b]:  # back to back, summed left to right as a running clock
                starts.append(t)
                t += x
            if events:
                out += _events(p, g, starts, c[a:b], r[a:b], m[a:b], mem[a:b])
            comm_total += comm[k] * d
            rec_total += rec[k] * d
            peak[s : s + d] = [max(v, top[k]) for v in peak[s : s + d]]
            busy[s : s + d] = [v + (t - t0) for v in busy[s : s + d]]
            ready[s : s + d] = [t] * d
    finish = max(ready) if n else 0.0
    sync = cost.grad_sync_time()
    coll = cost.step_collectives()
    busy_a = np.array(busy)
    return SimResult(
        finish + sync,
        finish,
        sync,
        busy_a,
        finish - busy_a,
        np.array(peak),
        tuple(out),
        comm_total,
        rec_total,
        coll,
        _collective_seconds(coll, cost),
        cost.closing_step_time(),
    )


def _collective_seconds(coll: dict, cost: CostModel) -> float:
    """Seconds of the step's collectives at the rate grad_sync_time uses (NIC across nodes)."""
    c = cost.cluster
    if c.num_gpus == 1:
        return 0.0
    bw = c.inter_node_bw if c.num_nodes > 1 else c.intra_node_bw
    return sum(coll.values()) / bw


def _rows(batch: Batch, cost: CostModel) -> dict[int, int]:
    """Sequence id -> row of batch_features (cached with the features)."""
    key = ("rows", batch.fingerprint())
    if key not in cost._cache:
        cost._cache[key] = {s.id: k for k, s in enumerate(batch.sequences)}
    return cost._cache[key]


def _phase_parts(groups, feats, row, cost: CostModel):
    """(compute, recompute, comm, memory) of every micro-batch of a phase, in group order,
    and the group boundaries: one feature sum for the phase, and one layer-time product per
    kind of group (degree, node span, speed) on that kind's rows, as a per-kind cost call
    would do, so the sums round the same; the rest is elementwise, one call for the phase."""
    cluster = cost.cluster
    mbs = [mb for g in groups for mb in g.micro_batches]
    idx = [row[s] for mb in mbs for s in mb.sequence_ids]
    starts = np.cumsum([0] + [len(mb.sequence_ids) for mb in mbs[:-1]])
    f = np.add.reduceat(feats[idx], starts, axis=0)
    rec = np.array([mb.recompute_layers for mb in mbs])
    sizes = [len(g.micro_batches) for g in groups]
    cuts = np.cumsum([0] + sizes)
    kinds: dict[tuple, int] = {}
    kind_of = [
        kinds.setdefault(
            (
                g.degree,
                cluster.comm_class(g.start_rank, g.degree),  # node span, or placement
                cluster.group_speed(g.start_rank, g.degree),
                g.kind,  # the SP kind (cp_cost)
            ),
            len(kinds),
        )
        for g in groups
    ]
    kind_mb = np.repeat(kind_of, sizes)  # the kind of each micro-batch's group
    if not cost.takes_degree_vectors:  # a subclass reprices time per degree: call per kind
        return (*_parts_per_kind(kinds, kind_mb, f, rec, cost), cuts)
    fwd, bwd = np.empty(len(mbs)), np.empty(len(mbs))
    for (d, _, _, sp), kid in kinds.items():
        sel = np.flatnonzero(kind_mb == kid) if len(kinds) > 1 else slice(None)
        fwd[sel], bwd[sel] = cost.layer_times(f[sel], d, **_kw(sp))
    d, spans, speed, sp = (_per_mb(col, kind_mb) for col in zip(*kinds, strict=True))
    tokens = f[:, -2]
    if not isinstance(sp, str):  # groups of both SP kinds in the phase: one call per kind
        return (*_parts_per_sp_kind(fwd, bwd, tokens, d, rec, spans, speed, sp, cost), cuts)
    kw = _kw(sp)
    c, r, m = cost.time_parts_from(fwd, bwd, tokens, d, rec, spans_nodes=spans, speed=speed, **kw)
    return c, r, m, cost.memory(tokens, d, rec, **kw), cuts


def _kw(sp: str) -> dict:
    """The cost calls' `kind` argument: none for Ulysses (the calls as before the kind)."""
    return {} if sp == "ulysses" else {"kind": sp}


def _parts_per_sp_kind(fwd, bwd, tokens, d, rec, spans, speed, sp, cost: CostModel):
    """time_parts_from and memory of a phase whose groups mix SP kinds, one call per kind."""
    parts = np.empty((4, len(tokens)))
    for k in set(sp.tolist()):
        sel = np.flatnonzero(sp == k)
        d_, sp_, sd_ = (x[sel] if np.ndim(x) else x for x in (d, spans, speed))
        c, r, m = cost.time_parts_from(
            fwd[sel], bwd[sel], tokens[sel], d_, rec[sel], spans_nodes=sp_, speed=sd_, kind=k
        )
        parts[0, sel], parts[1, sel], parts[2, sel] = c, r, m
        parts[3, sel] = cost.memory(tokens[sel], d_, rec[sel], k)
    return parts[0], parts[1], parts[2], parts[3]


def _per_mb(values: tuple, kind_mb: np.ndarray):
    """One value per micro-batch from one per kind; a scalar where every kind has the same
    (fewer numpy passes: no division by a speed of 1, no node-spanning share)."""
    return values[0] if len(set(values)) == 1 else np.array(values)[kind_mb]


def _parts_per_kind(kinds: dict, kind_mb, f, rec, cost: CostModel):
    parts = np.empty((4, len(f)))
    for (d, spans, speed, sp), kid in kinds.items():
        sel = np.flatnonzero(kind_mb == kid) if len(kinds) > 1 else slice(None)
        kw = _kw(sp)
        c, r, m = cost.time_parts(f[sel], d, rec[sel], spans_nodes=spans, speed=speed, **kw)
        parts[0, sel], parts[1, sel], parts[2, sel] = c, r, m
        parts[3, sel] = cost.memory(f[sel, -2], d, rec[sel], **kw)
    return parts[0], parts[1], parts[2], parts[3]


def _events(p: int, g, starts: list, c, r, m, mem) -> list[Event]:
    return [
        Event(p, g.start_rank, g.degree, k, mb.sequence_ids, mb.recompute_layers, *v, g.kind)
        for k, (mb, v) in enumerate(
            zip(
                g.micro_batches,
                zip(starts, *(x.tolist() for x in (c, r, m, mem)), strict=True),
                strict=True,
            )
        )
    ]
