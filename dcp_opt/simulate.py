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
from .cost import CostModel, zero3
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
    # GPU-seconds of the empty micro-steps per-layer zero3 adds (every unit of a shard
    # domain runs its domain's largest micro-step count in each phase: cost/zero3.py)
    padding_s: float = 0.0
    # With a pipeline (dcp_opt/pipeline/check.py): its columns, per-stage busy and peak
    pipeline: object = None

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
            "padding_s": self.padding_s,
        }


def simulate(plan: Plan, batch: Batch, cost: CostModel, *, events: bool = True) -> SimResult:
    """Run the plan on the cost model. `events=False` skips the per-micro-batch timeline
    (`events` is then empty; every total is the same): planners need only the totals.
    Per-rank clocks are Python lists: a group touches at most a few dozen ranks, where a
    list slice beats a numpy call."""
    if plan.pipeline is not None:
        return _simulate_pipeline(plan, batch, cost)
    cluster = cost.cluster
    n = cluster.num_gpus
    ready = [0.0] * n
    busy = [0.0] * n
    step = cost.step_costs()  # one question per step, one per phase below
    peak = [step.fixed_bytes] * n
    out: list[Event] = []
    comm_total = rec_total = pad_total = 0.0
    for p, phase in enumerate(plan.phases):
        groups = [g for g in phase.groups if g.micro_batches]
        if not groups:
            continue
        pc = cost.phase_costs(groups, batch)
        c, r, m, mem, cuts = pc.compute_s, pc.recompute_s, pc.comm_s, pc.memory_bytes, pc.cuts
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
        if cost.shard_domain:
            pad_total += _pad(phase.groups, cost, ready, busy)
    finish = max(ready) if n else 0.0
    busy_a = np.array(busy)
    return SimResult(
        finish + step.grad_sync_s,
        finish,
        step.grad_sync_s,
        busy_a,
        finish - busy_a,
        np.array(peak),
        tuple(out),
        comm_total,
        rec_total,
        step.collectives,
        step.collectives_s,
        step.closing_step_s,
        pad_total,
    )


def _pad(groups, cost: CostModel, ready: list, busy: list) -> float:
    """Run each unit's padding micro-steps after its phase work (zero3.domain_padding):
    each costs zero3.empty_micro_step_time. Returns their GPU-seconds."""
    pads = zero3.domain_padding(groups, len(ready), cost.shard_domain)
    if not any(pads):
        return 0.0
    e = cost.memoised("empty_micro_step", lambda: zero3.empty_micro_step_time(cost))
    for r, k in enumerate(pads):
        if k:
            ready[r] += k * e
            busy[r] += k * e
    return sum(pads) * e


def _simulate_pipeline(plan: Plan, batch: Batch, cost: CostModel) -> SimResult:
    """The step of a plan with a pipeline: the last column's flush + the step's collectives
    (dcp_opt/pipeline/check.py). Per-rank arrays are per unit (a GPU holds 1/t), stage-major;
    the timeline is per column (`pipeline.columns`), not per micro-batch event."""
    from .pipeline.check import simulate_pipeline
    from .pipeline.stages import stage_layout

    layout = stage_layout(cost, plan.pipeline, plan.tensor_parallel)
    sim = simulate_pipeline(plan, batch, layout)
    busy = sim.busy_s.ravel()  # per unit (a GPU holds 1/t of its bytes), as without a pipeline
    return SimResult(
        sim.finish_s + sim.grad_sync_s,
        sim.finish_s,
        sim.grad_sync_s,
        busy,
        sim.finish_s - busy,
        sim.peak_bytes.ravel(),
        (),
        0.0,
        0.0,
        pipeline=sim,
    )


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
