"""Megatron-LM dev's dynamic CP under pipeline parallelism, priced (issue 30; deviations in
docs/baselines.md, "Pipeline baselines").

Megatron forms micro-steps over one stage's DP x CP ranks with the dev branch's rules
(megatron_schedule.py: longest first, packing-aware groups, VPP count alignment to a
multiple of p under the interleaved schedule, microbatch_group_size_per_vp_stage = p), and
runs them through its 1F1B (or interleaved) schedule in that order: heaviest first. Its
groups change from one micro-step to the next, which a schema-3 plan (one group per column)
does not express, so the step is priced by dcp_opt/pipeline/lockstep.py on the same stage
costs as simulate(): every unit of a stage follows the schedule over the micro-steps, a
group's pass starts when all its units are free.

The user's settings: max_seqlen_per_dp_cp_rank M and recompute-num-layers r (uniform: the
same first r layers of every stage recomputed in every micro-batch, Megatron's
--recompute-method block). For each power of two M the fewest r at which p - s micro-batches
of M tokens a rank fit stage s's memory (`fitting_settings`). Which M: `max_seqlen_per_rank`
= "tuned" (the default) runs every fitting M and keeps the fastest step, as a user sweeping
it on their data would (the best fixed setting in hindsight, as issue 25's tuned
baselines); "max" takes the largest that fits (the memory-bound setting: at TP 2 on 256
H200s for llama3-70b it leaves 3 micro-steps for 4 stages, 2.4x slower than tuned); an int
fixes it.
"""

from __future__ import annotations

import time

import numpy as np
from dcp_opt.solvers.pipeline.instance import Column, Instance, make_pipeline

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import InfeasibleError
from dcp_opt.pipeline.check import stage_sync_s
from dcp_opt.pipeline.lockstep import lockstep_makespan
from dcp_opt.pipeline.stages import column_times, pipeline_cost, stage_layout
from dcp_opt.plan import Pipeline

from .megatron_schedule import group_spans, schedule


def fitting_settings(inst: Instance) -> list[tuple[int, np.ndarray]]:
    """[(M, per-stage r)], M from 2^20 down to 256 (powers of two), each with the fewest
    uniform r that fits; the M that fit at no r are left out."""
    lay = inst.layout
    p, layers = lay.num_stages, lay.pipeline.stage_layers
    out = []
    for m in (1 << k for k in range(20, 7, -1)):
        for r in range(max(layers) + 1):
            rec = np.minimum(r, np.array(layers))
            col = Column(1, 0, [[0]], rec[None, :])
            stored, work, room = col.memory(inst)
            scale = m / float(inst.tokens[0])
            need = [((p - s) * stored[s::p, 0].sum() + work[s::p, 0].max()) * scale
                    for s in range(p)]  # fmt: skip
            if all(x <= y for x, y in zip(need, room, strict=True)):
                out.append((m, rec))
                break
    if not out:
        raise InfeasibleError("megatron pipeline: no max_seqlen_per_dp_cp_rank >= 256 fits")
    return out


def user_settings(inst: Instance) -> tuple[int, np.ndarray]:
    """(M, per-stage r): the largest power of two M and fewest uniform r that fit."""
    return fitting_settings(inst)[0]


def megatron_pipeline_step(batch: Batch, cost: CostModel, *, pp: int = 4,
                           schedule_name: str = "1f1b", virtual_stages: int = 1,
                           tensor_parallel: int | None = None,
                           stage_layers: tuple[int, ...] | None = None,
                           max_seqlen_per_rank: int | str = "tuned") -> dict:  # fmt: skip
    """{step_time_s, max_seqlen_per_rank, recompute, num_micro_steps, wall_time_s, tried}.
    stage_layers: the layer split (default the parameter-balanced one; Megatron-LM's own
    default is the even one, --decoder-first/last-pipeline-num-layers set others).
    max_seqlen_per_rank: "tuned", "max" or an int (the module docstring); tried: the step
    at each M run."""
    started = time.perf_counter()
    cost = pipeline_cost(cost, tensor_parallel)
    pipe = make_pipeline(cost, pp, schedule_name, virtual_stages)
    if stage_layers is not None:
        pipe = Pipeline(tuple(stage_layers), schedule_name, virtual_stages)
    lay = stage_layout(cost, pipe)
    inst = Instance(lay, batch)
    settings = fitting_settings(inst)
    if max_seqlen_per_rank == "max":
        settings = settings[:1]
    elif isinstance(max_seqlen_per_rank, int) and not isinstance(max_seqlen_per_rank, bool):
        settings = [(m, r) for m, r in settings if m == max_seqlen_per_rank]
        if not settings:
            raise InfeasibleError(
                f"megatron pipeline: max_seqlen_per_rank={max_seqlen_per_rank} does not fit "
                f"(fitting powers of two: {[m for m, _ in fitting_settings(inst)]})"
            )
    elif max_seqlen_per_rank != "tuned":
        raise ValueError(f"max_seqlen_per_rank: 'tuned', 'max' or an int, got "
                         f"{max_seqlen_per_rank!r}")  # fmt: skip
    tried = {}
    best = None
    for m, rec in settings:
        if m < int(inst.tokens.max()) / lay.num_units:
            continue  # the longest sequence needs more ranks than a stage has (rule 5a)
        finish, count = _step_at(inst, lay, m, rec, schedule_name, pp, virtual_stages)
        tried[m] = finish + stage_sync_s(lay)
        if best is None or tried[m] < best[0]:
            best = (tried[m], m, rec, count)
    if best is None:
        raise InfeasibleError("megatron pipeline: no fitting max_seqlen_per_dp_cp_rank holds "
                              "the longest sequence on a stage's ranks")  # fmt: skip
    return {
        "step_time_s": best[0],
        "max_seqlen_per_rank": best[1],
        "recompute": best[2].tolist(),
        "num_micro_steps": best[3],
        "wall_time_s": time.perf_counter() - started,
        "tried": tried,
    }


def _step_at(inst: Instance, lay, m: int, rec, schedule_name: str, pp: int, virtual: int):
    """(finish, micro-steps) of Megatron's micro-steps at M = m, priced in lockstep."""
    seqs = [(i, int(t)) for i, t in enumerate(inst.tokens)]
    vpp = pp if schedule_name == "interleaved" else None
    steps = schedule(seqs, lay.num_units, m, vpp_group=vpp)
    priced = []
    for step in steps:
        groups = []
        for start, size in group_spans(step):
            ids = step[start]
            if not ids:
                continue
            feats = inst.feats[ids].sum(axis=0)[None, :]
            f, b, x = column_times(lay, feats, size, start, "ulysses", rec[None, :])
            groups.append((range(start, start + size), f[:, 0], b[:, 0], x[:, 0]))
        priced.append(groups)
    finish = lockstep_makespan(priced, schedule=schedule_name, num_stages=pp, virtual=virtual)
    return finish, len(steps)
