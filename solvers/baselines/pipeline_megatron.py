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
--recompute-method block), chosen as a user tunes them: the largest power of two M, then
the fewest r, at which p - s micro-batches of M tokens a rank fit stage s's memory.
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


def user_settings(inst: Instance) -> tuple[int, np.ndarray]:
    """(M, per-stage r): the largest power of two M and fewest uniform r that fit."""
    lay = inst.layout
    p, layers = lay.num_stages, lay.pipeline.stage_layers
    m = 1 << 20
    while m >= 256:
        for r in range(max(layers) + 1):
            rec = np.minimum(r, np.array(layers))
            col = Column(1, 0, [[0]], rec[None, :])
            stored, work, room = col.memory(inst)
            scale = m / float(inst.tokens[0])
            need = [((p - s) * stored[s::p, 0].sum() + work[s::p, 0].max()) * scale
                    for s in range(p)]  # fmt: skip
            if all(x <= y for x, y in zip(need, room, strict=True)):
                return m, rec
        m //= 2
    raise InfeasibleError("megatron pipeline: no max_seqlen_per_dp_cp_rank >= 256 fits")


def megatron_pipeline_step(batch: Batch, cost: CostModel, *, pp: int = 4,
                           schedule_name: str = "1f1b", virtual_stages: int = 1,
                           tensor_parallel: int | None = None,
                           stage_layers: tuple[int, ...] | None = None) -> dict:  # fmt: skip
    """{step_time_s, max_seqlen_per_rank, recompute, num_micro_steps, wall_time_s}.
    stage_layers: the layer split (default the parameter-balanced one; Megatron-LM's own
    default is the even one, --decoder-first/last-pipeline-num-layers set others)."""
    started = time.perf_counter()
    cost = pipeline_cost(cost, tensor_parallel)
    pipe = make_pipeline(cost, pp, schedule_name, virtual_stages)
    if stage_layers is not None:
        pipe = Pipeline(tuple(stage_layers), schedule_name, virtual_stages)
    lay = stage_layout(cost, pipe)
    inst = Instance(lay, batch)
    m, rec = user_settings(inst)
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
    finish = lockstep_makespan(priced, schedule=schedule_name, num_stages=pp,
                               virtual=virtual_stages)  # fmt: skip
    return {
        "step_time_s": finish + stage_sync_s(lay),
        "max_seqlen_per_rank": m,
        "recompute": rec.tolist(),
        "num_micro_steps": len(steps),
        "wall_time_s": time.perf_counter() - started,
    }
