"""Predict a plan's step: per-rank timeline, step time, imbalance, memory, communication.

Semantics (the same as the runtime's): a group starts a phase when all its members are free;
it runs its micro-batches back to back; after the last phase every rank joins one gradient
all-reduce, so step time = latest finish + gradient sync.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        }


def simulate(plan: Plan, batch: Batch, cost: CostModel) -> SimResult:
    cluster = cost.cluster
    n = cluster.num_gpus
    ready = np.zeros(n)
    busy = np.zeros(n)
    peak = np.full(n, cost.fixed_bytes())
    events: list[Event] = []
    comm_total = rec_total = 0.0
    feats = cost.batch_features(batch)  # cached rows; a micro-batch sums its members' rows
    row = {s.id: k for k, s in enumerate(batch.sequences)}
    for p, phase in enumerate(plan.phases):
        for g in phase.groups:
            if not g.micro_batches:
                continue
            ranks = slice(g.start_rank, g.start_rank + g.degree)
            t0 = float(ready[ranks].max())
            spans = cluster.spans_nodes(g.start_rank, g.degree)
            speed = cluster.group_speed(g.start_rank, g.degree)
            # All micro-batches of the group at once: feature sums, times, memory.
            mbs = g.micro_batches
            idx = [row[s] for mb in mbs for s in mb.sequence_ids]
            cuts = np.cumsum([0] + [len(mb.sequence_ids) for mb in mbs[:-1]])
            f = np.add.reduceat(feats[idx], cuts, axis=0)
            rec = np.array([mb.recompute_layers for mb in mbs])
            c, r, m = cost.time_parts(f, g.degree, rec, spans_nodes=spans, speed=speed)
            mem = cost.memory(f[:, -2], g.degree, rec)
            # Back to back, summed left to right as a running clock would.
            starts = np.cumsum(np.concatenate(([t0], c + r + m)))
            events += [
                Event(p, g.start_rank, g.degree, k, mb.sequence_ids, mb.recompute_layers, *v)
                for k, (mb, v) in enumerate(
                    zip(
                        mbs,
                        zip(*(x.tolist() for x in (starts[:-1], c, r, m, mem)), strict=True),
                        strict=True,
                    )
                )
            ]
            t = float(starts[-1])
            comm_total += float(m.sum()) * g.degree
            rec_total += float(r.sum()) * g.degree
            peak[ranks] = np.maximum(peak[ranks], float(mem.max()))
            busy[ranks] += t - t0
            ready[ranks] = t
    finish = float(ready.max()) if n else 0.0
    sync = cost.grad_sync_time()
    return SimResult(
        finish + sync, finish, sync, busy, finish - busy, peak, tuple(events), comm_total, rec_total
    )
