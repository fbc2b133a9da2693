"""Checks of a pipeline plan against this job, run on every rank before any collective.

Each is a pure function of the plan, the world size, the stage and the process-group pool, so
every rank reaches the same verdict without communicating (a refused plan raises on every rank
alike, nothing is left half done). Errors name the field and what is allowed.
"""

from __future__ import annotations

from dcp_opt.errors import DcpOptError
from dcp_opt.pipeline import SCHEDULES
from dcp_opt.plan import Plan

from .stages import PipelineStage

TASKS = ("LMTask", "HFCausalLMTask")  # next-token tasks: the last stage computes their loss


class PipelinePlanError(DcpOptError):
    """A pipeline plan this runtime cannot run as given (a ValueError too)."""


def check_pipeline_plan(plan: Plan, world: int, rank: int, stage: PipelineStage,
                        tp=None) -> None:  # fmt: skip
    """The job's layout: world = stages x units x tensor_parallel, the stage built for this
    plan's split and for `rank`'s stage, a schedule this runtime runs, `tp` (a
    runtime.groups.PipelineTPGroups) exactly when the plan has tensor parallelism: every
    parameter split over a "tp" mesh dimension of the plan's degree (`_tp_size`; FSDP2's
    shards over the stage's ranks are not a split)."""
    pipe = plan.pipeline
    p, t = pipe.num_stages, plan.tensor_parallel
    if not isinstance(stage, PipelineStage):
        raise PipelinePlanError(
            f"model: {type(stage).__name__} given for a plan with a pipeline; allowed: this "
            "rank's stage, runtime.pipeline.build_stage(model, plan.pipeline.stage_layers, s)"
        )
    have = 1 if tp is None else tp.degree
    if t != have:
        raise PipelinePlanError(
            f"plan.tensor_parallel: {t} with tp of degree {have}; allowed: tensor_parallel 1 "
            "without tp, or tp=PipelineTPGroups.create(t, stages) and a model split by "
            "apply_tensor_parallel(model, tp) before build_stage"
        )
    if {_tp_size(q) for q in stage.parameters()} != {t}:
        raise PipelinePlanError(
            f"model: its parameters are {'not ' if tp is not None else ''}split by tensor "
            f"parallelism{f' of degree {t}' if tp is not None else ''} but the plan's "
            f"tensor_parallel is {t}; allowed: apply_tensor_parallel(model, tp) before "
            "build_stage exactly when the plan has tensor_parallel > 1"
        )
    if plan.num_ranks * p * t != world:
        raise PipelinePlanError(
            f"plan.num_ranks: {plan.num_ranks} units per stage x {p} stages x tensor_parallel "
            f"{t} = {plan.num_ranks * p * t} ranks, but the world has {world}; allowed: a plan "
            "whose stages x units x tensor_parallel equal the world"
        )
    if pipe.schedule not in SCHEDULES or pipe.virtual_stages != 1:
        raise PipelinePlanError(
            f"plan.pipeline.schedule: {pipe.schedule!r} with virtual_stages "
            f"{pipe.virtual_stages}; allowed: {sorted(SCHEDULES)} with virtual_stages 1 "
            "(the schedules of dcp_opt.pipeline.stage_actions this runtime runs)"
        )
    if stage.stage_layers != tuple(pipe.stage_layers):
        raise PipelinePlanError(
            f"plan.pipeline.stage_layers: {list(pipe.stage_layers)} but the stage was built "
            f"for {list(stage.stage_layers)}; allowed: build_stage with the plan's split"
        )
    want = stage_of(plan, rank)
    if stage.stage != want:
        raise PipelinePlanError(
            f"stage: built as stage {stage.stage} but this rank holds stage {want} (stage s "
            f"holds ranks [s * {plan.num_ranks * t}, (s + 1) * {plan.num_ranks * t}))"
        )
    check_stage_recompute(plan)


def check_stage_recompute(plan: Plan) -> None:
    """Every micro-batch's `stage_recompute`: one entry per stage in [0, the stage's layers],
    summing to `recompute_layers`; an empty one only with recompute_layers 0 (none)."""
    layers = plan.pipeline.stage_layers
    for p, g, k, mb in plan.micro_batches():
        where = f"plan.phases[{p}] group@{g.start_rank}x{g.degree} micro_batches[{k}]"
        got = mb.stage_recompute
        if not got and mb.recompute_layers == 0:
            continue
        ok = len(got) == len(layers) and all(0 <= r <= n for r, n in zip(got, layers, strict=True))
        if not ok or sum(got) != mb.recompute_layers:
            raise PipelinePlanError(
                f"{where}.stage_recompute: {list(got)} with recompute_layers "
                f"{mb.recompute_layers}; allowed: {len(layers)} entries, entry s in "
                f"[0, {list(layers)}[s]], summing to recompute_layers"
            )


def check_groups(plan: Plan, pool) -> None:
    """Every process group the step uses is in the pool: each SP group of degree > 1 on
    every stage, and each stage's data-parallel group (its units) when it has several."""
    n = plan.num_ranks
    for s in range(plan.pipeline.num_stages):
        needed = {(s * n + g.start_rank, g.degree) for ph in plan.phases for g in ph.groups}
        needed = {key for key in needed if key[1] > 1}
        if n > 1:
            needed.add((s * n, n))
        missing = sorted(key for key in needed if key not in pool.groups)
        if missing:
            start, degree = missing[0]
            raise PipelinePlanError(
                f"plan: stage {s} needs a process group at rank {start} of degree {degree}, "
                f"not in the pool; allowed degrees {list(pool.degrees)} at the cluster's "
                "placements (GroupPool.create over the whole world)"
            )


def _tp_size(q) -> int:
    """The size of the "tp" dimension of a DTensor parameter's mesh (apply_tensor_parallel's:
    ("tp",) alone, or ("dp", "tp") once FSDP2 shards it too); 1 for a plain tensor or a mesh
    without one (FSDP2 over a stage's ranks alone)."""
    mesh = getattr(q, "device_mesh", None)
    names = (getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
    return mesh.size(names.index("tp")) if "tp" in names else 1


def check_task(task, sharding, stage=None, tp=None) -> None:
    """The task, and a sharding: one `shard(stage, ...)` built for this very stage
    (step-level zero1 / zero2 / zero3 over the stage's ranks; with tensor parallelism, over
    the stage's units of each TP rank: shard(stage, ..., tp=tp)). `tp`: unused here."""
    if type(task).__name__ not in TASKS:
        raise PipelinePlanError(
            f"task: {type(task).__name__} cannot run under a pipeline; allowed: {list(TASKS)}"
        )
    if sharding is None:
        return
    allowed = (
        "allowed: shard(stage, make_optimizer, mode='zero1' | 'zero2' | 'zero3', pool=pool, "
        "task=task) of this rank's stage, or None (plain replicas, gradients summed over each "
        "stage's ranks)"
    )
    if getattr(sharding, "model", None) is not stage or stage is None:
        raise PipelinePlanError(f"sharding: not built for this rank's stage; {allowed}")


def stage_of(plan: Plan, rank: int) -> int:
    """The stage of global rank `rank`: stages outermost, then units, then TP ranks."""
    return rank // (plan.num_ranks * plan.tensor_parallel)
