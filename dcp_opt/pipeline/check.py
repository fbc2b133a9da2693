"""What validate() and simulate() ask of a plan with a pipeline (docs/plan-format.md, the 4-D
layout): every stage runs the plan's phases and groups on its own units, so each group is a
column of p stages through which its micro-batches flow in the group's order.

Step (DESIGN.md, "Four dimensions"): a column starts a phase when its units are free (as a
group without a pipeline), runs its pipeline to the flush (makespan.column_makespan), and
the step ends at the last column's flush + the step's collectives: per stage a ring
all-reduce of its parameters' gradients over its data-parallel replicas (2 (n-1)/n x bytes
/ bandwidth, Thakur et al. 2005; `grad_reduce_bytes_per_param` per parameter, / t), all
stages at once so the slowest counts, + the closing micro-step and `step_overhead_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..batch import Batch
from ..plan import Plan
from .lockstep import micro_step_finish, unit_peaks
from .makespan import column_makespan, stage_peaks
from .stages import (
    PIPELINE_KINDS,
    StageLayout,
    column_memory,
    column_times,
    stage_capacity,
    stage_fixed_bytes,
    stage_params,
)


@dataclass(frozen=True)
class Column:
    """One group's pipeline in one phase."""

    phase: int
    start_unit: int
    degree: int
    start_s: float
    makespan_s: float
    busy_s: tuple[float, ...]  # per stage
    peak_bytes: tuple[float, ...]  # per stage: states + reserve + activations at peak


@dataclass(frozen=True)
class PipelineSim:
    finish_s: float
    grad_sync_s: float
    columns: tuple[Column, ...]
    busy_s: np.ndarray  # (p, num_units)
    peak_bytes: np.ndarray  # (p, num_units)


def column_features(layout: StageLayout, batch: Batch, group):
    """(feats (m, F), tokens (m,), rec (m, p)) of a group's micro-batches (ids known)."""
    cost = layout.cost
    feats, row = cost.batch_features(batch), cost.batch_rows(batch)
    f = np.array(
        [feats[[row[s] for s in mb.sequence_ids]].sum(axis=0) for mb in group.micro_batches]
    )
    rec = np.array([_stage_rec(mb, layout) for mb in group.micro_batches], dtype=int)
    return f.reshape(-1, cost.num_features), f.reshape(-1, cost.num_features)[:, -2], rec


def _stage_rec(mb, layout: StageLayout) -> tuple[int, ...]:
    p = layout.num_stages
    return mb.stage_recompute if len(mb.stage_recompute) == p else (0,) * p


def column(layout: StageLayout, batch: Batch, group, *, phase: int = 0, start_s: float = 0.0):
    """Price one group's pipeline: its makespan and per-stage memory peaks."""
    pipe = layout.pipeline
    feats, tokens, rec = column_features(layout, batch, group)
    f, b, x = column_times(layout, feats, group.degree, group.start_rank, group.kind, rec)
    kw = {"schedule": pipe.schedule, "num_stages": pipe.num_stages, "virtual": pipe.virtual_stages}
    sched = column_makespan(f, b, x, **kw)
    stored, work = column_memory(layout, tokens, group.degree, rec)
    peaks = np.array(stage_peaks(stored, work, **kw)) + stage_fixed_bytes(layout)
    return Column(phase, group.start_rank, group.degree, start_s, sched.makespan_s, sched.busy_s,
                  tuple(peaks.tolist()))  # fmt: skip


def stage_sync_s(layout: StageLayout) -> float:
    """The step's collectives under a pipeline (the module docstring), the slowest stage."""
    cost, cl = layout.cost, layout.cost.cluster
    n = layout.num_units  # units of the cost model's cluster of units (stages.py)
    extra = cost.step_overhead_s + cost.closing_step_time()
    if n == 1:
        return extra
    bw = cl.inter_node_bw if n > cl.gpus_per_node else cl.intra_node_bw
    volume = stage_params(layout).max() * cost.grad_reduce_bytes_per_param
    return 2 * (n - 1) / n * volume / bw + extra


def simulate_pipeline(plan: Plan, batch: Batch, layout: StageLayout) -> PipelineSim:
    if layout.pipeline.micro_steps:
        return simulate_micro_steps(plan, batch, layout)
    p, n = layout.num_stages, layout.num_units
    ready = [0.0] * n
    busy = np.zeros((p, n))
    peak = np.tile(stage_fixed_bytes(layout)[:, None], (1, n))
    cols = []
    for ph, phase in enumerate(plan.phases):
        for g in phase.groups:
            if not g.micro_batches:
                continue
            s, d = g.start_rank, g.degree
            c = column(layout, batch, g, phase=ph, start_s=max(ready[s : s + d]))
            cols.append(c)
            ready[s : s + d] = [c.start_s + c.makespan_s] * d
            busy[:, s : s + d] += np.array(c.busy_s)[:, None]
            peak[:, s : s + d] = np.maximum(peak[:, s : s + d], np.array(c.peak_bytes)[:, None])
    return PipelineSim(max(ready) if n else 0.0, stage_sync_s(layout), tuple(cols), busy, peak)


def simulate_micro_steps(plan: Plan, batch: Batch, layout: StageLayout) -> PipelineSim:
    """A plan whose phases are micro-steps (docs/plan-format.md, version 4): every unit runs
    the schedule over them (lockstep.lockstep_makespan); busy and peak per (stage, unit)."""
    p, n = layout.num_stages, layout.num_units
    parts, peaks = walked_micro_steps(layout, batch, plan)
    groups = [(g.start_rank, g.degree, f + b) for ps in parts for g, f, b, _, _, _ in ps]
    busy = np.zeros((p, n))
    if groups:  # each group's per-stage seconds on its units: a difference array over units
        start, deg, fb = (np.array(x) for x in zip(*groups, strict=True))
        per_stage = fb.reshape(len(fb), -1, p).sum(axis=1)  # chunk c on stage c % p
        diff = np.zeros((n + 1, p))
        np.add.at(diff, start, per_stage)
        np.add.at(diff, start + deg, -per_stage)
        busy = np.cumsum(diff[:n], axis=0).T
    peak = peaks + stage_fixed_bytes(layout)[:, None]
    return PipelineSim(micro_step_finish(layout, parts), stage_sync_s(layout), (), busy, peak)


def pipeline_violations(plan: Plan, batch: Batch, layout: StageLayout) -> list[tuple[str, str]]:
    """(code, message) of every micro-batch whose per-stage recompute is malformed, every
    group of a kind no pipeline prices, every interleaved count that is not a multiple of
    p, and every (column, stage) whose activations at peak exceed its memory."""
    out: list[tuple[str, str]] = []
    pipe, p = layout.pipeline, layout.num_stages
    known = batch.by_id
    for ph, phase in enumerate(plan.phases):
        for g in phase.groups:
            where = f"phase {ph} group@{g.start_rank}x{g.degree}"
            mbs = g.micro_batches
            if not mbs:
                continue
            bad = [_recompute_problem(mb, pipe.stage_layers) for mb in mbs]
            out += [
                ("BAD_RECOMPUTE", f"{where} micro-batch {k}: {e}") for k, e in enumerate(bad) if e
            ]
            if g.kind not in PIPELINE_KINDS:
                out.append(("BAD_KIND", f"{where}: kind {g.kind!r}; allowed in a pipeline "
                            f"{list(PIPELINE_KINDS)}"))  # fmt: skip
                continue
            if pipe.micro_steps and len(mbs) > 1:
                out.append(("BAD_PIPELINE", f"{where}: {len(mbs)} micro-batches; a group of "
                            "a micro-step holds at most one (pipeline.micro_steps)"))  # fmt: skip
                continue
            if pipe.micro_steps:
                continue  # memory per unit, below
            if pipe.schedule == "interleaved" and len(mbs) % p:
                out.append(("BAD_PIPELINE", f"{where}: {len(mbs)} micro-batches; the "
                            f"interleaved schedule needs a multiple of {p}"))  # fmt: skip
                continue
            if (
                any(bad)
                or any(not mb.sequence_ids for mb in mbs)
                or any(s not in known for mb in mbs for s in mb.sequence_ids)
                or g.start_rank < 0
                or g.start_rank + g.degree > layout.num_units
            ):
                continue  # reported by the structure and coverage checks
            out += _memory(layout, batch, g, where)
    if pipe.micro_steps:
        out += _micro_step_problems(plan, batch, layout, out)
    return out


def _micro_step_problems(plan: Plan, batch: Batch, layout: StageLayout, found) -> list:
    """A micro-step plan: the schedules it runs under, then each unit's memory over the
    schedule's walk (when every micro-batch is well formed)."""
    pipe = layout.pipeline
    if pipe.schedule not in ("1f1b", "gpipe") or pipe.virtual_stages != 1:
        return [("BAD_PIPELINE", f"pipeline.micro_steps with schedule {pipe.schedule!r} and "
                 f"virtual_stages {pipe.virtual_stages}; allowed: '1f1b' or 'gpipe' with "
                 "virtual_stages 1")]  # fmt: skip
    known = batch.by_id
    n = layout.num_units
    for phase in plan.phases:
        for g in phase.groups:
            mbs = g.micro_batches
            if (found or any(not mb.sequence_ids for mb in mbs) or g.kind not in PIPELINE_KINDS
                    or any(s not in known for mb in mbs for s in mb.sequence_ids)
                    or g.start_rank < 0 or g.start_rank + g.degree > n):  # fmt: skip
                return []  # reported by the structure, coverage and recompute checks
    peaks = walked_micro_steps(layout, batch, plan)[1] + stage_fixed_bytes(layout)[:, None]
    out = []
    for s in range(layout.num_stages):
        for u in range(n):
            cap = stage_capacity(layout, s, u, 1)
            if peaks[s, u] > cap * (1 + 1e-9):
                out.append(("OUT_OF_MEMORY", f"stage {s} unit {u}: its in-flight micro-steps "
                            f"need {peaks[s, u] / 1e9:.2f} GB per rank at peak, capacity "
                            f"{cap / 1e9:.2f} GB"))  # fmt: skip
    return out


def _recompute_problem(mb, stage_layers) -> str:
    r = mb.stage_recompute
    if len(r) != len(stage_layers):
        return f"stage_recompute {list(r)} needs one entry per stage ({len(stage_layers)})"
    if any(not 0 <= x <= n for x, n in zip(r, stage_layers, strict=True)):
        return f"stage_recompute {list(r)} not within [0, stage_layers {list(stage_layers)}]"
    if sum(r) != mb.recompute_layers:
        return f"recompute_layers {mb.recompute_layers} is not the sum of {list(r)}"
    return ""


def _memory(layout: StageLayout, batch: Batch, g, where: str) -> list[tuple[str, str]]:
    pipe = layout.pipeline
    _, tokens, rec = column_features(layout, batch, g)
    stored, work = column_memory(layout, tokens, g.degree, rec)
    peaks = np.array(stage_peaks(stored, work, schedule=pipe.schedule, num_stages=pipe.num_stages,
                                 virtual=pipe.virtual_stages)) + stage_fixed_bytes(layout)  # fmt: skip
    out = []
    for s, need in enumerate(peaks.tolist()):
        cap = stage_capacity(layout, s, g.start_rank, g.degree)
        if need > cap * (1 + 1e-9):
            out.append(("OUT_OF_MEMORY", f"{where} stage {s}: in-flight micro-batches need "
                        f"{need / 1e9:.2f} GB per rank at peak, capacity {cap / 1e9:.2f} GB"))  # fmt: skip
    return out


def walked_micro_steps(layout, batch, plan) -> tuple:
    """(micro_step_parts, lockstep.unit_peaks of them) of a micro-step plan, the last answer
    kept on the cost model's memo: validate() and simulate() each need both for the same plan
    (a planner calls one, then the other: 10 ms of its 0.1 s at 256 GPUs x 130 micro-steps).
    The entry holds the plan itself and is used only for that very object (`is`, so no id
    is reused while it is held) on the same batch and pipeline; any other plan recomputes
    and replaces it. A pure function of (cost model, batch, plan), so a thread that reads
    another's entry gets the same answer or recomputes."""
    key, fp = ("walked_micro_steps",), batch.fingerprint()
    kept = layout.cost.recall(key)
    if kept is not None and kept[0] is plan and kept[1] == fp and kept[2] == layout.pipeline:
        return kept[3]
    parts = micro_step_parts(layout, batch, plan)
    out = (parts, unit_peaks(layout, parts))
    layout.cost.remember(key, (plan, fp, layout.pipeline, out))
    return out


def micro_step_parts(layout, batch, plan) -> list:
    """Per phase k (micro-step k), [(group, f (V,), b (V,), x (V - 1,), stored (V,), work
    (V,))] of its groups that hold a micro-batch: stages.column_times and column_memory of
    that micro-batch, the simulator's own prices (one call per group placement)."""
    cost = layout.cost
    feats, row = cost.batch_features(batch), cost.batch_rows(batch)
    where: dict = {}  # (start, degree, kind) -> [(k, j, group)]
    for k, phase in enumerate(plan.phases):
        for j, g in enumerate(phase.groups):
            if g.micro_batches:
                where.setdefault((g.start_rank, g.degree, g.kind), []).append((k, j, g))
    found = {}
    for (start, degree, kind), items in where.items():
        mbs = [g.micro_batches[0] for _, _, g in items]
        rows = [row[i] for mb in mbs for i in mb.sequence_ids]
        cuts = np.cumsum([0] + [len(mb.sequence_ids) for mb in mbs[:-1]])
        fs = np.add.reduceat(feats[rows], cuts, axis=0)  # each micro-batch's feature sum
        rec = np.array([_stage_rec(mb, layout) for mb in mbs], dtype=int)
        f, b, x = column_times(layout, fs, degree, start, kind, rec)
        stored, work = column_memory(layout, fs[:, -2], degree, rec)
        for i, (k, j, g) in enumerate(items):
            found[(k, j)] = (g, f[:, i], b[:, i], x[:, i], stored[:, i], work[:, i])
    return [[found[(k, j)] for j, g in enumerate(ph.groups) if g.micro_batches]
            for k, ph in enumerate(plan.phases)]  # fmt: skip
